"""memfit fit: the whole workflow in one call, the way careful practitioners do it by hand.

1. **doctor**: is the environment sound (a CPU wheel, an old driver, another process)?
2. **estimate**: how much memory one step needs, and the largest batch predicted to fit
   (when fake tensors cannot run the step, fit goes on without it and says why);
3. **probe**: the largest batch that really fits, exact, starting from the prediction;
4. **plan**: the fastest micro-batch, accumulation, precision and checkpointing that
   reach the target batch (by default the batch probe recommends) within the headroom;
5. **lock**: write ``memfit.lock`` (the settings, the measurements, the environment) and
   a report (HTML with the figures embedded).

>>> import tempfile, memfit
>>> out = tempfile.mkdtemp()
>>> result = fit("mlp:layers=2,width=32,features=16", device="sim:24MiB", target_batch_size=64,
...              lock_path=f"{out}/memfit.lock", report_dir=f"{out}/report", run_doctor=False)
>>> result.plan.recommended.settings.batch_size
64
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError, WorkloadError
from memfit.estimator import speed_accuracy
from memfit.memory.devices import Device
from memfit.memory.devices import device as make_device
from memfit.run.measure import Measurement
from memfit.run.settings import Checkpointing, Precision, Settings
from memfit.run.state import preserved_workload
from memfit.run.strategy import Shard
from memfit.search.candidates import Candidate, check_target
from memfit.search.headroom import DEFAULT_HEADROOM, check_headroom
from memfit.search.lock import Lock, Measured, Predicted, write_lock
from memfit.search.plan import Plan, plan
from memfit.search.trials import TrialKind, trial_line
from memfit.units import format_size
from memfit.workload import Workload, load_workload

__all__ = ["fit", "FitResult"]

Say = Callable[[str], None]


@dataclass
class FitResult:
    """Everything ``fit`` found, and where it wrote the lock and the report."""

    workload: str
    device: str
    capacity: int | None
    diagnosis: Any  # memfit.environment.doctor.Diagnosis, or None when the doctor was skipped
    estimate: Any  # memfit.estimator.estimate.Estimate, or None without a known capacity
    probe: Any  # memfit.search.probe.ProbeResult
    plan: Plan
    lock: Lock
    lock_path: Path
    report_path: Path | None
    #: why the estimate could not run (None when it ran or was not asked for)
    estimate_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "device": self.device,
            "capacity": self.capacity,
            "doctor": self.diagnosis.to_dict() if self.diagnosis is not None else None,
            "estimate": self.estimate.to_dict() if self.estimate is not None else None,
            "estimate_error": self.estimate_error,
            "probe": self.probe.to_dict(),
            "plan": self.plan.to_dict(),
            "lock": str(self.lock_path),
            "report": str(self.report_path) if self.report_path else None,
        }

    def summary(self) -> list[str]:
        """What fits, what was chosen and why, in a few sentences."""
        lines = []
        if self.diagnosis is not None:
            errors = self.diagnosis.count("error")
            warnings = self.diagnosis.count("warning")
            lines.append(
                f"Environment: {errors} error(s), {warnings} warning(s)"
                + (" — run `memfit doctor` for the fixes." if errors or warnings else ".")
            )
        if self.estimate_error is not None:
            lines.append(
                f"Estimate: could not run ({self.estimate_error}); probe searched from batch 1 "
                "and plan tried every candidate."
            )
        elif self.estimate is not None and self.estimate.max_batch_size is not None:
            speed = ""
            if self.estimate.predicted_samples_per_second:
                speed = (
                    f" Predicted on the {self.estimate.speed_gpu}: "
                    f"{self.estimate.predicted_samples_per_second:,.1f} samples/s at that batch."
                )
            lines.append(
                f"Estimate: a step at batch {self.estimate.batch_size} needs {format_size(self.estimate.total)}; "
                f"predicted largest batch {self.estimate.max_batch_size}.{speed}"
            )
        p = self.probe
        if p.limit == "max_batch_size":
            largest = f"at least {p.max_batch_size} fits (the search stopped at max_batch_size)"
        else:
            largest = f"the largest batch that fits is {p.max_batch_size} (exact)"
        fake = sum(1 for t in p.trials if t.fake)
        on_fake = f" ({fake} on fake tensors, the answer confirmed by real runs)" if fake else ""
        lines.append(
            f"Probe: {largest}, {len(p.trials)} trials{on_fake}, {p.trial_steps} optimizer steps; "
            f"recommended {p.recommended_batch_size}: {p.reason}"
        )
        lines.append(f"Plan for batch {self.plan.target_batch_size}: {self.plan.reason}")
        predicted = self.speed_line()
        if predicted is not None:
            lines.append(predicted)
        lines.extend(f"Advice: {note}" for note in self.plan.advice)
        lines.append(f"Wrote {self.lock_path}" + (f" and {self.report_path}" if self.report_path else "") + ".")
        return lines

    def speed_line(self) -> str | None:
        """The chosen settings' predicted speed on the plan's card, one line (None: the plan
        ranked by measured speed, as on a real GPU)."""
        best = self.plan.recommended
        if self.plan.ranked_by != "predicted" or best is None or not best.predicted_samples_per_second:
            return None
        seconds = f", {best.predicted_seconds_per_step:.3g} s per step" if best.predicted_seconds_per_step else ""
        return (
            f"Predicted speed on the {self.plan.speed_gpu}: {best.predicted_samples_per_second:,.1f} samples/s"
            f"{seconds} at the chosen settings.{speed_accuracy.sentence()}"
        )


def _chosen_step_snapshot(
    workload: Workload, settings: Settings, gpu: Device, say: Say
) -> tuple[dict[str, Any] | None, str]:
    """The allocator history of two optimizer steps at the chosen micro-batch, for the
    report's memory viewer section (fake tensors: the allocator model's view of the device).

    None where fake tensors cannot run the step (said why); accumulation is left out (its
    micro-batches repeat the first one's memory).
    """
    from memfit.estimator.fake import UnsupportedOperation
    from memfit.estimator.snapshot import step_snapshot

    assert settings.micro_batch_size is not None
    title = f"two optimizer steps at micro-batch {settings.micro_batch_size}, {settings.precision}" + (
        ", checkpointing" if settings.checkpointing != "none" else ""
    )
    if not workload.builds_fresh_models:
        return None, title
    say("report: recording the chosen step's allocator history (fake tensors)")
    try:
        snapshot = step_snapshot(
            workload, settings.micro_batch_size, settings.replace(accumulation_steps=1), device=gpu
        )
    except UnsupportedOperation as error:
        say(f"report: no memory snapshot ({error})")
        return None, title
    return snapshot, title


def _probe_progress(say: Say) -> Callable[[int, Measurement | None], None]:
    def progress(batch_size: int, measurement: Measurement | None) -> None:
        if measurement is not None:
            say(f"probe · batch {batch_size}: {trial_line(measurement)}")

    return progress


def _plan_progress(say: Say) -> Callable[[Candidate], None]:
    def progress(candidate: Candidate) -> None:
        s = candidate.settings
        if candidate.measurement is not None:
            setting = f"micro-batch {s.micro_batch_size} x {s.accumulation_steps} in {s.precision}"
            if s.checkpointing != "none":
                setting += f", checkpointing {s.checkpointing}"
            say(f"plan · {setting}: {trial_line(candidate.measurement)}")

    return progress


def _check_outputs(lock_path: str | os.PathLike[str], report_dir: str | os.PathLike[str] | None) -> None:
    """Refuse a lock or report path that cannot be written, before any trial."""
    from memfit._io import check_writable, check_writable_folder
    from memfit.reporting.pages import check_report_outputs

    check_writable(lock_path, "lock")
    if report_dir is not None:
        check_report_outputs(check_writable_folder(report_dir, "report folder") / "report.html")


def fit(
    workload: Workload | str,
    device: Device | str = "auto",
    *,
    target_batch_size: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    max_batch_size: int | None = None,
    world_size: int = 1,
    precisions: Sequence[Precision] | None = None,
    checkpointing: Sequence[Checkpointing] | None = None,
    shards: Sequence[Shard] | None = None,
    gpus_per_node: int | None = None,
    lock_path: str | os.PathLike[str] = "memfit.lock",
    report_dir: str | os.PathLike[str] | None = "memfit-report",
    run_doctor: bool = True,
    say: Say | None = None,
    speed_gpu: str | None = None,
    trials: TrialKind = "auto",
) -> FitResult:
    """Doctor, estimate, probe, plan; then write the lock and the report.

    Args:
        workload: a :class:`memfit.Workload` or a reference, resolved once here.
        device: where to probe and plan (see :func:`memfit.device`).
        target_batch_size: the global batch per optimizer step (default: the batch probe
            recommends, times the world size).
        headroom: the fraction of memory the recommendation leaves free (probe's
            recommended batch and plan's chosen settings both keep it).
        max_batch_size: the largest batch worth considering.
        world_size: ranks sharing the target batch. With more than one, estimate and probe
            look at one rank under FSDP2 (``shard="full"``, the strategy that holds least;
            rehearsed on a fake process group), and the plan weighs every strategy.
        precisions: the precisions plan considers (default: all the device supports).
        checkpointing: the checkpointing modes plan considers (default: all the model has).
        shards: the sharding strategies the plan considers (default: all).
        gpus_per_node: GPUs per machine, for hybrid sharding in the plan.
        lock_path: where to write ``memfit.lock``.
        report_dir: where to write the HTML report and its figures (None: no report).
        run_doctor: check the environment first.
        say: called with one line as each phase starts and after each trial (progress
            for people).
        trials: what probe's and plan's trials run (``"auto"``: fake tensors on a
            simulated GPU, confirmed by real runs; ``"real"``: every trial for real).
        speed_gpu: plan ranks by the predicted speed on this card (default: on a
            simulated GPU its card, else :data:`memfit.estimator.speed.DEFAULT_SPEED_GPU`;
            on a real GPU the measured speed).
    """
    say = say or (lambda _text: None)
    if target_batch_size is not None:
        check_target(target_batch_size, world_size)  # before any long work
    check_headroom(headroom)
    _check_outputs(lock_path, report_dir)  # seconds now, not after the whole search
    request = FitRequest(
        workload=load_workload(workload),
        device=make_device(device),
        target_batch_size=target_batch_size,
        headroom=headroom,
        max_batch_size=max_batch_size,
        world_size=world_size,
        axes=PlanAxes(precisions, checkpointing, shards, gpus_per_node),
        speed_gpu=speed_gpu,
        trials=trials,
        say=say,
    )
    from memfit.environment import system

    machine = system.current_probe()  # one probe: its answers are read once, for doctor and lock
    diagnosis = _doctor(machine, say) if run_doctor else None
    # Every phase runs the caller's model instance and optimizer: all of it comes back, and
    # every RNG, success or error (probe and plan restore too; this covers the phases between).
    with preserved_workload(request.workload) as preserved:
        request = replace(request, workload=preserved)
        predicted, estimate_error = _estimate(request)
        found = _probe(request, predicted)
        target = target_batch_size or found.recommended_batch_size * world_size
        chosen = _plan(request, target)
        best = chosen.recommended
        if best is None or best.measurement is None:
            raise MemfitError(chosen.reason)
        lock = _lock(request, machine, best, chosen.speed_gpu, (target, found.max_batch_size))
        report_path = None
        if report_dir is not None:
            report_path = _report(
                request, Path(report_dir) / "report.html", best.settings, _Findings(diagnosis, predicted, found, chosen)
            )
    path = write_lock(lock, lock_path)  # last: a lock on disk means the whole fit succeeded
    return FitResult(
        workload=request.workload.name,
        device=request.device.spec,
        capacity=request.device.capacity,
        diagnosis=diagnosis,
        estimate=predicted,
        probe=found,
        plan=chosen,
        lock=lock,
        lock_path=path,
        report_path=report_path,
        estimate_error=estimate_error,
    )


@dataclass(frozen=True)
class PlanAxes:
    """What the plan may vary, as :func:`fit` was asked (None: the plan's defaults)."""

    precisions: Sequence[Precision] | None = None
    checkpointing: Sequence[Checkpointing] | None = None
    shards: Sequence[Shard] | None = None
    gpus_per_node: int | None = None


@dataclass(frozen=True)
class FitRequest:
    """What :func:`fit` was asked, resolved once: the workload and device, and what each phase needs."""

    workload: Workload
    device: Device
    target_batch_size: int | None
    headroom: float
    max_batch_size: int | None
    world_size: int
    axes: PlanAxes
    speed_gpu: str | None
    trials: TrialKind
    say: Say

    @property
    def first_settings(self) -> Settings:
        """One rank's view for estimate and probe: alone, or under the strategy that holds
        least (the plan weighs the others)."""
        return Settings() if self.world_size <= 1 else Settings(world_size=self.world_size, shard="full")


@dataclass(frozen=True)
class _Findings:
    """What the phases found, for the report."""

    diagnosis: Any
    estimate: Any
    probe: Any
    plan: Plan


def _doctor(machine: Any, say: Say) -> Any:
    from memfit.environment.doctor import diagnose

    say("doctor: checking the environment")
    return diagnose(machine)


def _estimate(request: FitRequest) -> tuple[Any, str | None]:
    """The estimate for one rank's view, or why it could not run (None, None: not asked,
    the device's memory is unknown or the model is an instance)."""
    wl, gpu, say = request.workload, request.device, request.say
    if gpu.capacity is None or not wl.builds_fresh_models:
        # (a model instance comes with the script's own optimizer: see probe.estimated_guess)
        return None, None
    from memfit.estimator.estimate import estimate

    say("estimate: predicting peak memory on fake tensors")
    try:
        return estimate(wl, None, request.first_settings, device=gpu), None
    except WorkloadError:
        raise  # the workload's contract (a closure optimizer): refused before probe and plan
    except Exception as error:  # noqa: BLE001 - as probe does: the trials that follow decide
        # Why go on: fake tensors cannot run every step (a value read in forward); the
        # estimate only saves trials. A bug in the step shows up in the first trial.
        lines = str(error).strip().splitlines()
        estimate_error = lines[0] if lines else type(error).__name__
        say(f"estimate: could not run ({estimate_error}); going on without it")
        return None, estimate_error


def _probe(request: FitRequest, predicted: Any) -> Any:
    """Probe one rank's view, starting from the estimate's answer (no second estimate)."""
    from memfit.search.probe import probe

    request.say("probe: finding the largest batch that fits")
    return probe(
        request.workload,
        request.device,
        request.first_settings,
        headroom=request.headroom,
        max_batch_size=request.max_batch_size,
        guess=predicted.max_batch_size if predicted else None,  # no second estimate
        progress=_probe_progress(request.say),
        trials=request.trials,
        say=request.say,
        # the rank the estimate found heaviest (its trace covers every distinct rank)
        rehearse_rank=predicted.rank if predicted is not None and request.world_size > 1 else None,
    )


def _plan(request: FitRequest, target: int) -> Plan:
    request.say(f"plan: the fastest settings that reach batch {target}")
    axes = request.axes
    return plan(
        request.workload,
        target,
        request.device,
        world_size=request.world_size,
        shards=axes.shards,
        gpus_per_node=axes.gpus_per_node,
        precisions=axes.precisions,
        checkpointing=axes.checkpointing,
        headroom=request.headroom,
        speed_gpu=request.speed_gpu,
        progress=_plan_progress(request.say),
        # fit confirms its answer by running it; CPU offload's memory on a simulated GPU is the estimator's
        offload=False,
        trials=request.trials,
        say=request.say,
    )


def _lock(request: FitRequest, machine: Any, best: Candidate, speed_gpu: str | None, found: tuple[int, int]) -> Lock:
    """The lock for the chosen settings: what real runs measured, what was predicted, the environment.

    Why apart: a fake-tensor trial (a simulated GPU's) and the step-time model are
    predictions; only a real run on the device is a measurement, and a speed nobody
    measured (a fake trial has no time) is left out rather than written as 0.
    """
    from memfit.environment.envfile import fingerprint

    measurement = best.measurement
    assert measurement is not None
    gpu = request.device
    target, max_batch_size = found
    real = not measurement.fake
    return Lock(
        workload=request.workload.reference,
        workload_name=request.workload.name,
        settings=best.settings,
        target_batch_size=target,
        world_size=request.world_size,
        environment=fingerprint(machine),
        measured=Measured(
            device=gpu.spec,
            capacity=gpu.capacity or 0,
            peak_allocated=measurement.peak_allocated if real else None,
            peak_reserved=measurement.peak_reserved if real else None,
            samples_per_second=best.samples_per_second if real and best.samples_per_second else None,
            headroom=request.headroom,
            max_batch_size=max_batch_size,
        ),
        predicted=Predicted(
            peak_allocated=None if real else measurement.peak_allocated,
            peak_reserved=None if real else measurement.peak_reserved,
            seconds_per_step=best.predicted_seconds_per_step,
            samples_per_second=best.predicted_samples_per_second,
            speed_gpu=speed_gpu if best.predicted_samples_per_second is not None else None,
        ),
    )


def _report(request: FitRequest, path: Path, chosen: Settings, found: _Findings) -> Path:
    """The HTML report of every phase, with the chosen step's allocator history."""
    from memfit.reporting.pages import write_results_report
    from memfit.search.probe_speeds import with_predicted_speeds

    wl, gpu = request.workload, request.device
    snapshot, snapshot_title = _chosen_step_snapshot(wl, chosen, gpu, request.say)
    return write_results_report(
        path,
        title=f"memfit fit · {wl.name} on {gpu.describe()}",
        doctor=found.diagnosis.to_dict() if found.diagnosis is not None else None,
        probe=with_predicted_speeds(found.probe.to_dict(), wl, request.first_settings, gpu, request.speed_gpu),
        estimate=found.estimate.to_dict() if found.estimate is not None else None,
        plan=found.plan.to_dict(),
        snapshot=snapshot,
        snapshot_title=snapshot_title,
    )
