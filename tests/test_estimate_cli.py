"""`memfit estimate` on the command line: table, --json, and one-line errors."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.estimator.estimate import estimate
from memfit.memory.gpus import lookup
from memfit.units import format_size

TINY = "mlp:layers=1,width=32,features=32"


def test_unknown_gpu_is_one_line_exit_2_listing_close_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--gpu", "rtx3090x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("memfit: error: unknown GPU 'rtx3090x': close names: ")
    assert "RTX 3090" in err


def test_a_gpu_name_that_fits_two_cards_is_one_line_exit_2_naming_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--gpu", "NVIDIA GeForce RTX 3080"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "fits several GPUs: RTX 3080 10GB, RTX 3080 12GB" in err


def test_two_targets_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--gpu", "T4", "--memory", "8GiB", "--batch-size", "2"]) == 2
    assert "give one target" in capsys.readouterr().err


def test_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--batch-size", "4", "--device", "sim:64MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in (
        "batch_size",
        "peak_allocated",
        "peak_reserved",
        "total",
        "breakdown",
        "fits",
        "max_batch_size",
        "memory",
        "top_modules",
    ):
        assert key in data
    assert data["batch_size"] == 4 and data["fits"] is True and data["memory"] == 64 * 2**20
    assert data["total"] == data["peak_reserved"]
    assert data["max_batch_size"] is None  # --batch-size given: no search unless --max-batch
    assert set(data["breakdown"]) == {
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
        "temporaries",
        "allocator overhead",
        "fixed costs",
    }


def test_without_batch_size_reports_the_largest_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--device", "sim:4MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_size"] == data["max_batch_size"] >= 1 and data["fits"] is True


def test_table_shows_the_breakdown_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", TINY, "--batch-size", "8", "--gpu", "RTX 3090", "--world-size", "2", "--shard", "optimizer"])
        == 0
    )
    out = capsys.readouterr().out
    expected = estimate(TINY, 8, gpu="RTX 3090", world_size=2, shard="optimizer")
    rows = {cells[0]: cells[1] for cells in table_rows(out) if len(cells) >= 2}
    for category in ("optimizer state", "communication buffers", "cuda context", "cublas workspace"):
        assert rows[category] == format_size(expected.breakdown[category])
    assert rows["total"] == format_size(expected.total)
    card = lookup("RTX 3090")
    assert f"Batch 8 fits in {format_size(card.memory)} (RTX 3090)" in " ".join(out.split())


def table_rows(out: str) -> list[list[str]]:
    """The cells of each row of a rich table, stripped."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]


def test_max_batch_searches_at_a_given_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--batch-size", "4", "--device", "sim:4MiB", "--max-batch", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_size"] == 4 and data["max_batch_size"] >= 4


def test_accumulation_steps_reach_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", TINY, "--batch-size", "4", "--device", "sim:64MiB", "--json"]
    assert main([*args, "--accumulation-steps", "3"]) == 0
    three = json.loads(capsys.readouterr().out)
    assert three["settings"]["accumulation_steps"] == 3 and three["settings"]["micro_batch_size"] == 4
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    # the gradients of the first micro-batch live on while the next runs: never less memory
    assert three["peak_allocated"] >= one["peak_allocated"]


def test_a_bad_cuda_version_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--batch-size", "2", "--gpu", "T4", "--cuda-version", "twelve"]) == 2
    err = capsys.readouterr().err
    assert err == "memfit: error: invalid CUDA version 'twelve': write it as 12.4 (or cu124)\n"


DTYPE_FACTORY = """
import torch
from torch import nn
import memfit


def workload():
    def model():
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 10)).to(torch.bfloat16)

    return memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 64, dtype=torch.bfloat16), torch.randint(0, 10, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]),
    )
"""


def test_a_factory_that_changes_the_dtype_is_estimated_as_measured(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "bf16_model.py"
    source.write_text(DTYPE_FACTORY)
    ref = f"{source}:workload"
    assert main(["estimate", ref, "--batch-size", "32", "--device", "sim:256MiB", "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert main(["measure", ref, "--batch-size", "32", "--device", "sim:256MiB", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    measured = measured[0] if isinstance(measured, list) else measured
    assert estimated["peak_allocated"] == measured["peak_allocated"]
    # bf16 parameters, each rounded up to the allocator's 512-byte blocks: 2 bytes an element
    blocks = [64 * 256 * 2, 512, 256 * 10 * 2, 512]
    assert estimated["breakdown"]["parameters"] == sum(blocks) == 38912
