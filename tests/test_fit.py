"""memfit fit: doctor, estimate, probe, plan, then the lock and the report."""

from __future__ import annotations

import json

import memfit
from memfit._plot import png_data_uri
from memfit.reporting.figures import estimate_png, plan_png, probe_png
from memfit.search.lock import load_lock

TINY = "mlp:layers=2,width=32,features=16"


def test_fit_writes_a_lock_and_a_report_that_agree_with_the_plan(tmp_path):
    result = memfit.fit(
        TINY,
        "sim:16MiB",
        target_batch_size=96,
        lock_path=tmp_path / "memfit.lock",
        report_dir=tmp_path / "report",
        run_doctor=False,
    )
    lock = load_lock(tmp_path / "memfit.lock")
    assert lock.settings == result.plan.recommended.settings
    assert lock.settings.batch_size == 96 and lock.target_batch_size == 96
    assert lock.measured.max_batch_size == result.probe.max_batch_size
    assert lock.measured.device == "sim:16MiB" and lock.measured.capacity == 16 * 2**20
    # the estimate was probe's starting point, and on sim it is exact
    assert result.estimate.max_batch_size == result.probe.max_batch_size
    page = (tmp_path / "report" / "report.html").read_text()
    # the figures beside the page, and embedded in it, are those of this fit's own results
    for name, draw, result_of in (
        ("probe", probe_png, result.probe),
        ("estimate", estimate_png, result.estimate),
        ("plan", plan_png, result.plan),
    ):
        png = (tmp_path / "report" / f"report-{name}.png").read_bytes()
        assert png == draw(result_of.to_dict())
        assert f'<img src="{png_data_uri(png)}" alt="{name} figure">' in page
    assert "Plan" in page and "Probe" in page and "Estimate" in page
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "report-estimate.png",
        "report-plan.png",
        "report-probe.png",
        "report.html",
    ]


def test_fit_command_default_target_and_json(tmp_path, run_cli):
    status, out, err = run_cli(
        "fit",
        TINY,
        "--device",
        "sim:8MiB",
        "--lock",
        str(tmp_path / "m.lock"),
        "--report-dir",
        str(tmp_path / "r"),
        "--json",
    )
    assert status == 0, err
    data = json.loads(out)
    assert data["plan"]["target_batch_size"] == data["probe"]["recommended_batch_size"]
    assert data["doctor"]["exit_status"] == 0
    assert load_lock(tmp_path / "m.lock").target_batch_size == data["plan"]["target_batch_size"]


def test_fit_bad_input_writes_nothing(tmp_path, run_cli):
    status, _out, err = run_cli(
        "fit", "gtp2", "--device", "sim:8MiB", "--lock", str(tmp_path / "m.lock"), "--report-dir", str(tmp_path / "r")
    )
    assert status == 2 and len(err.strip().splitlines()) == 1 and "unknown workload" in err
    assert list(tmp_path.iterdir()) == []
