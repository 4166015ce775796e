"""The zoo's pure-torch GPT (the default workload), and the default path without transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import memfit
from memfit.errors import WorkloadError
from memfit.estimator.estimate import estimate
from memfit.run.settings import find_blocks
from memfit.run.steps import run_steps
from memfit.workload.gpt import GPT, Block, GPTShape
from memfit.workload.zoo import DEFAULT_WORKLOAD, TINY, build

TINY_GPT = TINY["gpt"]  # gpt:layers=2,embd=32,heads=2,seq_len=16,vocab=128

# TINY_GPT's parameters, by hand: wte 128x32 (4096) + wpe 16x32 (512); per block: two
# LayerNorms (2 x 64), qkv 32x96 + 96 (3168), attn proj 32x32 + 32 (1056), fc 32x128 + 128
# (4224), mlp proj 128x32 + 32 (4128) = 12704, two blocks 25408; ln_f 64; the LM head is
# tied to wte (0).
TINY_GPT_PARAMS = 4096 + 512 + 2 * 12704 + 64
# untied and without biases: the blocks lose their biases and LayerNorm shifts
# (2 x 12352 = 24704), ln_f keeps 32 weights, and the head adds 32x128 (4096)
TINY_GPT_UNTIED_NO_BIAS_PARAMS = 4096 + 512 + 2 * 12352 + 32 + 4096


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tiny_gpt_builds_with_the_hand_counted_parameters() -> None:
    wl = memfit.load_workload(TINY_GPT)
    model = wl.build_model()
    assert isinstance(model, GPT) and n_params(model) == TINY_GPT_PARAMS
    assert model.lm_head.weight is model.wte.weight
    untied = build("gpt", "layers=2,embd=32,heads=2,seq_len=16,vocab=128,tied=false,bias=false").build_model()
    assert n_params(untied) == TINY_GPT_UNTIED_NO_BIAS_PARAMS
    ids, targets = wl.make_batch(3)
    assert ids.shape == targets.shape == (3, 16)  # worst case: every sequence at full length
    assert int(ids.max()) < 128 and model(ids).shape == (3, 16, 128)
    assert wl.info["seq_len"] == 16 and "nanoGPT" in wl.info["description"]


def test_default_shapes_are_gpt2_small() -> None:
    with torch.device("meta"):  # 124M parameters, no memory
        model = GPT(GPTShape())
    assert n_params(model) == 124_439_808  # GPT-2 124M (transformers' GPT2LMHeadModel counts the same)


def test_training_steps_on_sim_change_the_weights() -> None:
    wl = memfit.load_workload(TINY_GPT)
    model = wl.build_model()
    wl.model = model  # train this instance in place
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with memfit.device("sim:256MiB") as gpu:
        run_steps(wl, memfit.Settings(micro_batch_size=4), gpu, steps=2)
    assert all(not torch.equal(weights[name], p.detach()) for name, p in model.named_parameters())
    assert gpu.memory_stats()["allocated_bytes.all.peak"] > 0


def test_measure_fits_and_checkpointing_blocks_lowers_the_peak() -> None:
    ref = "gpt:layers=4,embd=32,heads=2,seq_len=64,vocab=128"
    model = memfit.load_workload(ref).build_model()
    blocks = find_blocks(model)
    assert len(blocks) == 4 and all(isinstance(b, Block) for b in blocks)
    plain = memfit.measure(ref, 8, "sim:1GiB")
    checkpointed = memfit.measure(ref, 8, "sim:1GiB", memfit.Settings(checkpointing="blocks"))
    assert plain.fits and checkpointed.fits
    assert checkpointed.peak_allocated < plain.peak_allocated


@pytest.mark.parametrize(("precision", "checkpointing"), [("fp32", "none"), ("bf16", "blocks")])
def test_estimate_equals_sim_measurement(precision: str, checkpointing: str) -> None:
    settings = memfit.Settings(precision=precision, checkpointing=checkpointing)
    est = estimate(TINY_GPT, 4, settings, device="sim:1GiB", search=False)
    measured = memfit.measure(TINY_GPT, 4, "sim:1GiB", settings)
    assert est.fits is measured.fits is True
    assert est.peak_allocated == pytest.approx(measured.peak_allocated, rel=0.01)
    assert est.peak_reserved == pytest.approx(measured.peak_reserved, rel=0.01)


def test_dropout_changes_activations_not_structure() -> None:
    torch.manual_seed(0)
    with_dropout = build("gpt", "layers=2,embd=32,heads=2,seq_len=16,vocab=128,dropout=0.1").build_model()
    without = build("gpt", "layers=2,embd=32,heads=2,seq_len=16,vocab=128,dropout=0").build_model()
    shapes = {name: tuple(t.shape) for name, t in with_dropout.state_dict().items()}
    assert shapes == {name: tuple(t.shape) for name, t in without.state_dict().items()}
    assert len(find_blocks(with_dropout)) == len(find_blocks(without)) == 2
    without.load_state_dict(with_dropout.state_dict())
    ids = torch.randint(0, 128, (2, 16))
    with_dropout.eval()
    without.eval()
    assert torch.equal(with_dropout(ids), without(ids))  # in eval, dropout does nothing
    with_dropout.train()
    assert not torch.equal(with_dropout(ids), with_dropout(ids))  # in training, it draws masks
    # and the masks are saved for backward: more activation memory, as GPT-2's dropout costs
    ref = "gpt:layers=2,embd=32,heads=2,seq_len=16,vocab=128"
    assert (
        memfit.measure(ref, 8, "sim:1GiB").peak_allocated
        > memfit.measure(f"{ref},dropout=0", 8, "sim:1GiB").peak_allocated
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("embd=30,heads=4", "zoo workload 'gpt': embd=30 must be divisible by heads=4"),
        ("layers=0", "zoo workload 'gpt': layers must be a positive integer, not 0"),
        ("seq_len=-8", "seq_len must be a positive integer, not -8"),
        ("vocab=1.5", "vocab must be a positive integer, not 1.5"),
        ("dropout=1.0", "dropout must be a probability in [0, 1), not 1.0"),
        ("dropout=-0.1", "dropout must be a probability in [0, 1), not -0.1"),
        ("bias=1", "bias must be true or false, not 1"),
        ("tied=yes", "tied must be true or false, not 'yes'"),
        ("n_layer=2", "unknown option 'n_layer' for zoo workload 'gpt': use layers, embd, heads"),
    ],
)
def test_bad_options_are_one_line_errors(options: str, message: str, run_cli) -> None:
    with pytest.raises(WorkloadError) as error:
        build("gpt", options)
    assert message in str(error.value)
    status, _out, err = run_cli("measure", f"gpt:{options}", "--batch-size", "1", "--device", "sim:1GiB")
    assert status == 2 and err.count("\n") == 1 and err.startswith("memfit: error: ") and message in err


def test_the_default_workload_is_the_pure_torch_gpt() -> None:
    assert DEFAULT_WORKLOAD.startswith("gpt:")
    wl = memfit.load_workload(DEFAULT_WORKLOAD)
    model = wl.build_model()
    assert isinstance(model, GPT) and len(model.blocks) == 2 and model.shape.embd == 128
    assert "transformers" not in type(model).__module__


# -- the default path without transformers ------------------------------------------------

# Runs ``memfit ARGS`` as if transformers were not installed: an import finder first on
# sys.meta_path refuses transformers and its submodules, and records every attempt, so the
# test can also show that the default path never tries to import it.
NO_TRANSFORMERS = textwrap.dedent(
    """
    import sys

    attempts = []

    class NoTransformers:
        def find_spec(self, name, path=None, target=None):
            if name == "transformers" or name.startswith("transformers."):
                attempts.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTransformers())
    from memfit.cli import main

    status = main(sys.argv[1:])
    print("transformers import attempts:", attempts, file=sys.stderr)
    sys.exit(status)
    """
)


def memfit_without_transformers(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # the memfit under test, even where PYTHONPATH is relative (it runs in another folder)
    source = str(Path(memfit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", NO_TRANSFORMERS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=55
    )


@pytest.mark.slow
def test_fit_runs_without_transformers(tmp_path: Path) -> None:
    done = memfit_without_transformers(
        tmp_path, "fit", TINY_GPT, "--max-batch-size", "4", "--device", "sim:16MiB", "--json"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["plan"]["target_batch_size"] == 4
    assert (tmp_path / "memfit.lock").is_file() and (tmp_path / "memfit-report" / "report.html").is_file()
    assert "transformers import attempts: []" in done.stderr


@pytest.mark.slow
def test_estimate_of_the_default_runs_without_transformers(tmp_path: Path) -> None:
    done = memfit_without_transformers(tmp_path, "estimate", "--device", "sim:64MiB", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["workload"] == DEFAULT_WORKLOAD
    assert result["fits"] is True and result["max_batch_size"] >= 1
    assert "transformers import attempts: []" in done.stderr


def test_a_transformers_entry_without_transformers_says_how_to_install_it(tmp_path: Path) -> None:
    done = memfit_without_transformers(tmp_path, "estimate", "gpt2", "--device", "sim:64MiB")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines()[0] == (
        "memfit: error: zoo workload 'gpt2' needs transformers: pip install 'memfit[hf]'"
    )
    assert "Traceback" not in done.stderr
