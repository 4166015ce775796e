"""memfit fit: doctor, estimate, probe, plan, then the lock and the report."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import memfit
from memfit._plot import png_data_uri
from memfit.errors import WorkloadError
from memfit.reporting.figures import estimate_png, plan_png, probe_png
from memfit.reporting.memory_viz import timeline
from memfit.reporting.pages import load_snapshot
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
    # the figures beside the page, and embedded in it, are those of this fit's own results (the
    # probe's with each fitting batch's speed predicted on the simulated GPU's card)
    from memfit.search.probe_speeds import with_predicted_speeds

    charted = with_predicted_speeds(
        result.probe.to_dict(), memfit.load_workload(TINY), memfit.Settings(), memfit.device("sim:16MiB")
    )
    for name, draw, shown in (
        ("probe", probe_png, charted),
        ("estimate", estimate_png, result.estimate.to_dict()),
        ("plan", plan_png, result.plan.to_dict()),
    ):
        png = (tmp_path / "report" / f"report-{name}.png").read_bytes()
        assert png == draw(shown)
        assert f'<img src="{png_data_uri(png)}" alt="{name} figure">' in page
    assert "Plan" in page and "Probe" in page and "Estimate" in page
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "report-estimate.png",
        "report-memory-viz.html",
        "report-plan.png",
        "report-probe.png",
        "report-snapshot.pickle",
        "report.html",
    ]
    # the chosen settings' step, in PyTorch's memory viewer format, embedded and beside the page
    chosen = result.plan.recommended
    snapshot = load_snapshot(tmp_path / "report" / "report-snapshot.pickle")
    peak = max(moment.reserved for moment in timeline(snapshot))
    assert peak == chosen.measurement.peak_reserved
    assert "<h2>Memory viewer</h2>" in page and 'download="memfit-snapshot.pickle"' in page
    # the predicted speed of the chosen settings on the simulated GPU's card, in the summary
    predicted = f"{chosen.predicted_samples_per_second:,.1f} samples/s"
    assert f"Predicted speed on the {result.plan.speed_gpu}: {predicted}" in "\n".join(result.summary())
    assert "Such predictions were checked against" in "\n".join(result.summary())  # with the bench's error band
    assert f"two optimizer steps at micro-batch {chosen.settings.micro_batch_size}, {chosen.settings.precision}" in page


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


# -- issue 14: the lock's reference, fit without the estimate, fit's axes --------------------------------

#: pytorch/examples' models as workloads (tests/workloads), loaded by reference as a user's file is
EXAMPLES = Path(__file__).parent / "workloads" / "pytorch_examples.py"

TINY_SOURCE = textwrap.dedent(
    """
    import torch, memfit

    def make():
        return memfit.Workload(
            model=lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
            make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
            loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
            name="my tiny classifier",
        )
    """
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small steps on 2 shared cores


def small_fit(workload, tmp_path, **options):
    """fit at a small target and search bound, fp32 only, no report: the lock is what is checked."""
    arguments = dict(
        target_batch_size=8,
        max_batch_size=16,
        precisions=["fp32"],
        lock_path=tmp_path / "memfit.lock",
        report_dir=None,
        run_doctor=False,
    )
    return memfit.fit(workload, "sim:8MiB", **{**arguments, **options})


@pytest.mark.parametrize("kind", ["zoo", "file", "module"])
def test_the_lock_records_the_reference_and_loads_it_again(kind, tmp_path, monkeypatch):
    """Issue 14, item 4: the lock stored the workload's name, so load_workload(lock.workload) failed."""
    (tmp_path / "tiny_workload.py").write_text(TINY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    ref = {"zoo": TINY, "file": f"{tmp_path / 'tiny_workload.py'}:make", "module": "tiny_workload:make"}[kind]
    small_fit(ref, tmp_path)
    lock = load_lock(tmp_path / "memfit.lock")
    assert lock.workload == ref
    loaded = memfit.load_workload(lock.workload)
    assert loaded.reference == ref
    if kind != "zoo":
        assert lock.workload_name == loaded.name == "my tiny classifier"  # the name, kept for people
    assert memfit.measure(loaded, lock.micro_batch_size, "sim:8MiB", lock.settings).fits


def test_a_workload_object_has_no_reference_and_the_lock_says_so(tmp_path):
    workload = memfit.Workload(
        model=lambda: torch.nn.Linear(8, 2),
        make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        name="made in my script",
    )
    small_fit(workload, tmp_path)
    text = (tmp_path / "memfit.lock").read_text()
    assert 'name = "made in my script"' in text and "given as a Workload object, not a reference" in text
    lock = load_lock(tmp_path / "memfit.lock")
    assert lock.workload is None and lock.workload_name == "made in my script"
    with pytest.raises(WorkloadError, match=r"a memfit\.lock made for a Workload object records none"):
        memfit.load_workload(lock.workload)


def test_fit_goes_on_when_the_estimate_cannot_run(tmp_path):
    """Issue 14, item 8: nn.TransformerEncoder with a float mask stops fake tensors (aten._local_scalar_dense)."""
    result = small_fit(f"{EXAMPLES}:transformer_language_model", tmp_path, target_batch_size=2)
    assert result.estimate is None and "aten._local_scalar_dense" in result.estimate_error
    # plan's pruning could not run either: on sim: its fake trials (which replace the
    # estimator's search there) fell back to real ones, and it tried every candidate
    assert "fake tensors cannot run this step" in result.plan.trials_note
    assert all(c.measurement is None or not c.measurement.fake for c in result.plan.candidates)
    summary = result.summary()
    assert summary[0].startswith("Estimate: could not run (cannot estimate: operation aten._local_scalar_dense")
    assert result.probe.trials[0].batch_size == 1  # searched from batch 1, as probe does without a guess
    assert load_lock(tmp_path / "memfit.lock").settings.batch_size == 2
    assert result.to_dict()["estimate_error"] == result.estimate_error


def test_fit_command_leaves_axes_out(tmp_path, run_cli):
    status, out, err = run_cli(
        "fit", TINY, "--device", "sim:8MiB", "--target-batch", "8", "--max-batch-size", "16",
        "--precision", "fp32", "--precision", "bf16", "--checkpointing", "none",
        "--lock", str(tmp_path / "m.lock"), "--report-dir", str(tmp_path / "r"), "--no-doctor", "--json",
    )  # fmt: skip
    assert status == 0, err
    data = json.loads(out)
    assert {(c["precision"], c["checkpointing"]) for c in data["plan"]["candidates"]} <= {
        ("fp32", "none"),
        ("bf16", "none"),
    }
    assert {c["precision"] for c in data["plan"]["candidates"]} == {"fp32", "bf16"}
    status, _, err = run_cli("fit", TINY, "--device", "sim:8MiB", "--checkpointing", "some")
    assert status == 2 and "unknown checkpointing 'some'" in err
