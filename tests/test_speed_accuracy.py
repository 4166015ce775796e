"""The error band printed beside a predicted step (memfit.estimator.speed_accuracy): the
installed figures are the predicted-speed bench's validation rows, agree with
docs/benchmarks.md, and reach `estimate` (text and --json) and `plan`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import memfit
from memfit.cli import main
from memfit.estimator import speed_accuracy
from memfit.estimator.kernel_rates import KernelClass
from memfit.estimator.speed_accuracy import Band, SpeedAccuracy, describe

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows(bench_module: Callable[[str], ModuleType]) -> list[object]:
    return bench_module("speed_rows").ROWS


def test_the_installed_figures_are_the_benchs_validation_rows(rows: list[object]) -> None:
    table = speed_accuracy.load()
    assert table is not None, "speed_accuracy.json is missing: run python bench/predicted_speed.py"
    validation = [r for r in rows if not r.calibration]  # type: ignore[attr-defined]
    # a row added or moved without rerunning the bench leaves these behind
    assert table.overall.rows == len(validation)
    assert sum(b.rows for b in table.by_bound.values()) == len(validation)
    names = {c.name.lower() for c in KernelClass} | {"host"}
    assert set(table.by_bound) <= names
    for band in (table.overall, *table.by_bound.values()):
        assert 0 <= band.median_abs_error_pct <= abs(band.worst_error_pct)


def test_the_installed_figures_agree_with_docs_benchmarks() -> None:
    table = speed_accuracy.load()
    assert table is not None
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    o = table.overall
    assert (
        f"**Validation rows ({o.rows}, no efficiency fitted to them): median |error| {o.median_abs_error_pct:.1f} %, "
        f"worst {o.worst_error_pct:+.1f} %, Spearman {table.spearman:.3f}**"
    ) in docs
    for name, band in table.by_bound.items():
        line = (
            f"- {name}: {band.rows} rows, median |error| {band.median_abs_error_pct:.1f} %, "
            f"worst {band.worst_error_pct:+.1f} %"
        )
        assert line in docs


def test_the_band_is_the_rows_bound_as_the_step_is() -> None:
    table = SpeedAccuracy(Band(40, 10.0, -30.0), {"layout": Band(5, 12.5, 42.0)}, 0.98, "cmd")
    assert "the 5 bound by layout as this step is: median 12.5 %, worst +42.0 %" in describe(table, "layout")
    assert "none was bound by conv depthwise" in describe(table, "conv_depthwise")
    assert describe(table).startswith(
        "checked against 40 published GPU throughputs: median error 10.0 %, worst -30.0 %"
    )
    assert SpeedAccuracy.from_dict(table.to_dict()) == table


def test_a_broken_file_shows_no_band(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = tmp_path / "speed_accuracy.json"
    bad.write_text('{"overall": {"rows": "many"}}')

    class Files:
        def joinpath(self, name: str) -> Path:
            return tmp_path / name

    monkeypatch.setattr(speed_accuracy.resources, "files", lambda package: Files())
    speed_accuracy.load.cache_clear()
    try:
        assert speed_accuracy.load() is None
    finally:
        monkeypatch.undo()
        speed_accuracy.load.cache_clear()
    assert speed_accuracy.load() is not None


def test_estimate_prints_and_writes_the_band(capsys: pytest.CaptureFixture[str]) -> None:
    ref = "mlp:layers=2,width=256,features=256"
    assert main(["estimate", ref, "--gpu", "A100 80GB SXM", "--batch-size", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    band = data["speed_accuracy"]
    table = speed_accuracy.load()
    assert table is not None
    assert band["bound_by"] == data["predicted_time"]["bound_by"]
    assert band["overall"] == table.overall.to_dict()
    mine = table.by_bound.get(band["bound_by"])
    assert band["same_bound"] == (mine.to_dict() if mine is not None else None)
    assert main(["estimate", ref, "--gpu", "A100 80GB SXM", "--batch-size", "4096"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"Such predictions were checked against {table.overall.rows} published GPU throughputs" in out


def test_an_estimate_without_a_predicted_step_has_no_band() -> None:
    # several ranks: no step time (communication is not modelled), so no band either
    mlp = "mlp:layers=1,width=16,features=8"
    four = memfit.estimate(mlp, 4, memfit.Settings(world_size=4, shard="full"), gpu="A100 80GB SXM")
    assert four.predicted_seconds_per_step is None and four.speed_accuracy is None
    one = memfit.estimate(mlp, 4, gpu="A100 80GB SXM")
    assert one.speed_accuracy is not None and one.speed_accuracy["bound_by"] == one.predicted_time["bound_by"]


def test_plan_prints_the_overall_band(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "mlp:layers=1,width=16,features=8", "--target-batch", "4", "--device", "sim:RTX 4090",
                 "--precision", "fp32", "--checkpointing", "none"])  # fmt: skip
    assert code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Such predictions were checked against" in out and "(docs/benchmarks.md)" in out


def test_the_report_page_shows_the_band() -> None:
    from memfit.reporting.pages import results_html

    estimate = memfit.estimate("mlp:layers=1,width=64,features=64", 64, gpu="RTX 4090", search=False)
    page = "\n".join(results_html(estimate=estimate.to_dict(), figures={}))
    assert "Such predictions were checked against" in page
