"""The lock keeps real measurements and predictions apart: [measured] only from real runs on the
device, [predicted] for fake-tensor trials and the step-time model, nothing written as 0 that
nobody measured (issue 20, item 6)."""

from __future__ import annotations

import sys
from pathlib import Path

import memfit
from memfit.environment.envfile import Fingerprint
from memfit.run.measure import Measurement
from memfit.run.settings import Settings
from memfit.search.candidates import Candidate
from memfit.search.fit import FitRequest, PlanAxes, _lock
from memfit.search.lock import Lock, Measured, Predicted, load_lock, write_lock

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_fit_on_a_simulated_gpu_records_the_confirmed_real_run_as_measured_and_the_speed_as_predicted(
    tmp_path: Path,
) -> None:
    result = memfit.fit(
        "mlp:layers=2,width=32,features=16",
        "sim:24MiB",
        target_batch_size=64,
        lock_path=tmp_path / "memfit.lock",
        report_dir=None,
        run_doctor=False,
    )
    best = result.plan.recommended
    assert best is not None and best.measurement is not None and not best.measurement.fake
    document = tomllib.loads((tmp_path / "memfit.lock").read_text())
    # the figures under [measured] are a fresh real run's, to the byte
    settings = best.settings
    again = memfit.measure(
        "mlp:layers=2,width=32,features=16",
        settings.micro_batch_size,
        "sim:24MiB",
        settings.replace(accumulation_steps=1),
    )
    assert document["measured"]["peak_reserved"] == again.peak_reserved
    assert document["measured"]["peak_allocated"] == again.peak_allocated
    # the speed that ranked the candidates is a prediction on the card, said so
    assert document["predicted"]["speed_gpu"] == result.plan.speed_gpu
    assert document["predicted"]["samples_per_second"] == best.predicted_samples_per_second
    assert "peak_reserved" not in document["predicted"]
    assert load_lock(tmp_path / "memfit.lock").predicted.speed_gpu == result.plan.speed_gpu


def test_a_fake_trials_figures_go_under_predicted_and_an_unmeasured_speed_is_left_out(tmp_path: Path) -> None:
    settings = Settings(micro_batch_size=8)
    fake = Measurement(8, True, 3 * 2**20, 4 * 2**20, None, fake=True)
    best = Candidate(settings, "measured", measurement=fake)
    request = FitRequest(
        workload=memfit.load_workload("mlp:layers=1,width=16"),
        device=memfit.device("sim:64MiB"),
        target_batch_size=8,
        headroom=0.05,
        max_batch_size=None,
        world_size=1,
        axes=PlanAxes(),
        speed_gpu=None,
        trials="auto",
        say=lambda _line: None,
    )
    lock = _lock(request, None, best, None, (8, 16))
    assert (lock.measured.peak_allocated, lock.measured.peak_reserved, lock.measured.samples_per_second) == (
        None,
        None,
        None,
    )
    assert (lock.predicted.peak_allocated, lock.predicted.peak_reserved) == (3 * 2**20, 4 * 2**20)
    text = lock.to_toml()
    measured = tomllib.loads(text)["measured"]
    assert "samples_per_second" not in measured and "peak_reserved" not in measured
    assert 0.0 not in measured.values() and 0 not in [v for k, v in measured.items() if k != "max_batch_size"]


def test_a_lock_round_trips_both_tables(tmp_path: Path) -> None:
    lock = Lock(
        workload="mlp",
        settings=Settings(micro_batch_size=8),
        target_batch_size=8,
        environment=Fingerprint(python="3.11.7", os="Linux x86_64"),
        measured=Measured(device="sim:64MiB", capacity=64 * 2**20, peak_allocated=10, peak_reserved=2**21),
        predicted=Predicted(seconds_per_step=0.5, samples_per_second=16.0, speed_gpu="A100 80GB"),
    )
    loaded = load_lock(write_lock(lock, tmp_path / "memfit.lock"))
    assert loaded.measured == lock.measured and loaded.predicted == lock.predicted
    assert loaded.measured.samples_per_second is None
