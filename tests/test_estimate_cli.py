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
    assert main(["estimate", TINY, "--gpu", "rtx3080"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("memfit: error: unknown GPU 'rtx3080': close names: ")
    assert "RTX 3090" in err


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
    assert data["max_batch_size"] >= 4
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
    for category in ("optimizer state", "activations", "ddp buckets", "cuda context", "cublas workspace"):
        assert rows[category] == format_size(expected.breakdown[category])
    assert rows["total"] == format_size(expected.total)
    card = lookup("RTX 3090")
    assert f"Batch 8 fits in {format_size(card.memory)} (RTX 3090)" in " ".join(out.split())


def table_rows(out: str) -> list[list[str]]:
    """The cells of each row of a rich table, stripped."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
