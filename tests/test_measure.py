"""measure() on the simulated GPU: numbers move the right way and are reproducible."""

import pytest

import memfit
from memfit.run.settings import Settings, find_blocks

BLOCKS4 = "mlp:layers=4,width=256,features=256"


def peak(ref: str, batch: int, **settings) -> int:
    result = memfit.measure(ref, batch, "sim:4GiB", Settings(**settings))
    assert result.fits
    return result.peak_allocated


def test_larger_batch_raises_peak():
    assert peak(BLOCKS4, 1024) < peak(BLOCKS4, 2048) < peak(BLOCKS4, 4096)


def test_checkpointing_blocks_lowers_activation_memory_of_a_4_block_model():
    assert peak(BLOCKS4, 512, checkpointing="blocks") < peak(BLOCKS4, 512)


def test_bf16_lowers_peak():
    assert peak("convnet:blocks=2,channels=16,image_size=32", 32, precision="bf16") < peak(
        "convnet:blocks=2,channels=16,image_size=32", 32
    )


def test_fp16_runs_with_a_grad_scaler():
    assert memfit.measure(BLOCKS4, 8, "sim:1GiB", Settings(precision="fp16")).fits


def test_same_numbers_on_every_run():
    runs = [
        memfit.measure("gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=16,vocab_size=128", 4, "sim:1GiB") for _ in range(3)
    ]
    assert len({(r.peak_allocated, r.peak_reserved) for r in runs}) == 1


def test_an_oom_is_a_result():
    result = memfit.measure(BLOCKS4, 4096, "sim:16MiB")
    assert not result.fits and result.seconds_per_step is None
    assert result.peak_reserved <= 16 * 2**20


def test_other_errors_propagate_unchanged():
    def broken_loss(model, batch):
        raise ValueError("a real bug")

    wl = memfit.load_workload("mlp:layers=1,width=8,features=8")
    wl.loss = broken_loss
    with pytest.raises(ValueError, match="a real bug"):
        memfit.measure(wl, 2, "sim:1GiB")


def test_find_blocks_picks_the_repeated_layers():
    model = memfit.load_workload(BLOCKS4).build_model()
    assert len(find_blocks(model)) == 4
