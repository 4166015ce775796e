"""measure() on the simulated GPU: numbers move the right way and are reproducible."""

import math

import pytest
import torch

import memfit
from memfit.errors import DoesNotFitError, MemfitError
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


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_lowers_peak(precision):
    assert peak("convnet:blocks=2,channels=16,image_size=32", 32, precision=precision) < peak(
        "convnet:blocks=2,channels=16,image_size=32", 32
    )


@pytest.mark.parametrize(
    ("precision", "dtype", "loss_scale"), [("fp16", torch.float16, 2.0**16), ("fp32", torch.float32, 1.0)]
)
def test_fp16_runs_under_autocast_with_a_grad_scaler(precision, dtype, loss_scale):
    """fp16 computes the forward in float16 and backpropagates the loss scaled by GradScaler's
    initial 2**16; the scaler steps the optimizer (fp32: no autocast, no scaling)."""
    base = memfit.load_workload(BLOCKS4)
    torch.manual_seed(0)
    model = base.build_model()  # an instance: measure trains it in place, so its weights can be read after
    activations: list[torch.dtype] = []
    model.blocks[1].register_forward_hook(lambda module, args, out: activations.append(out.dtype))
    gradients_of_the_loss: list[float] = []

    def loss(m, batch):
        value = base.loss(m, batch)
        value.register_hook(lambda grad: gradients_of_the_loss.append(float(grad)))
        return value

    before = [p.detach().clone() for p in model.parameters()]
    workload = memfit.Workload(model=model, make_batch=base.make_batch, loss=loss, name="blocks4")
    assert memfit.measure(workload, 8, "sim:1GiB", Settings(precision=precision)).fits
    assert activations == [dtype, dtype]  # two steps, one forward each
    # d(scale * loss)/d(loss): the scale; unchanged at step 2, so step 1 found no inf and was not skipped
    assert gradients_of_the_loss == [loss_scale, loss_scale]
    after = list(model.parameters())  # stepped: every weight moved, and none overflowed
    assert all(torch.isfinite(p).all() and not torch.equal(p, q) for p, q in zip(after, before))


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


def _nan_after(steps_ok: int):
    """A loss that turns NaN after ``steps_ok`` calls, as a diverging step does (log of 0 here)."""
    calls = []
    plain = memfit.load_workload("mlp:layers=1,width=8,features=8").loss

    def loss(model, batch):
        calls.append(1)
        value = plain(model, batch)
        return value * torch.log(torch.tensor(0.0)) * 0 if len(calls) > steps_ok else value

    return loss


def test_a_nan_loss_is_a_warning_and_the_measurement_says_so():
    """Issue 14, item 5: a NaN loss was reported as a success without a word."""
    wl = memfit.load_workload("mlp:layers=1,width=8,features=8")
    wl.loss = _nan_after(1)
    with pytest.warns(UserWarning, match=r"the loss at batch 4 is nan \(not finite\): the training step is broken"):
        result = memfit.measure(wl, 4, "sim:1GiB")
    assert result.fits and not result.finite_loss and math.isnan(result.loss)
    assert result.to_dict()["finite_loss"] is False
    clean = memfit.measure("mlp:layers=1,width=8,features=8", 4, "sim:1GiB")
    assert clean.finite_loss and math.isfinite(clean.loss)


def test_probe_refuses_a_nan_loss_naming_the_batch():
    wl = memfit.load_workload("mlp:layers=1,width=8,features=8")
    wl.loss = _nan_after(0)
    with pytest.warns(UserWarning), pytest.raises(MemfitError, match="the loss at batch 1 is nan") as caught:
        memfit.probe(wl, "sim:64MiB", guess=None)
    assert not isinstance(caught.value, DoesNotFitError)
