"""Running a plan's candidates: the estimator's limit, one trial, failures, confirmation on the device.

What :func:`memfit.search.plan.plan` calls for each group of candidates
(:mod:`memfit.search.candidates`): the estimator's largest micro-batch
(:func:`estimated_max_micro_batch`, the default predictor), the trial itself
(:func:`trial`: two optimizer steps of one micro-batch, for several ranks inside a
rehearsal of the heaviest rank), the predicted speed on the plan's card
(:func:`predicted_speed`), trials that fail for a reason other than memory
(:class:`Failures`), and, after fake-tensor trials, the real runs that confirm them
(:func:`confirm_on_device`).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from memfit.errors import MemfitError, WorkloadError
from memfit.memory.devices import Device, SimDevice
from memfit.memory.gpus import GPU
from memfit.memory.oom import is_oom, release_cached_memory
from memfit.run.measure import Measurement, measure, non_finite_loss_message
from memfit.run.settings import Settings
from memfit.run.strategy import OFFLOAD_SHARDS
from memfit.search.candidates import Candidate, PlanRequest, Speed, describe_settings, recommended_candidate
from memfit.search.trials import Trials
from memfit.workload import Workload

__all__ = [
    "Predictor",
    "Trial",
    "SpeedPredictor",
    "estimated_max_micro_batch",
    "predicted_speed",
    "trial",
]

#: (workload, settings, device, largest micro-batch of interest) -> largest that fits, or None
Predictor = Callable[[Workload, Settings, Device, int], "int | None"]
Trial = Callable[[Workload, Settings, Device], Measurement]
#: (workload, settings, card) -> predicted (seconds per step, samples/s) on one device
SpeedPredictor = Callable[[Workload, Settings, GPU], "tuple[float, float]"]
#: called with each candidate after its trial
Progress = Callable[[Candidate], None]


def estimated_max_micro_batch(workload: Workload, settings: Settings, device: Device, limit: int) -> int | None:
    """The estimator's largest micro-batch up to ``limit`` for these settings on this
    device (None: the device's memory is unknown)."""
    return estimated_limit(workload, settings, device, limit)[0]


def estimated_limit(
    workload: Workload, settings: Settings, device: Device, limit: int
) -> tuple[int | None, int | None]:
    """:func:`estimated_max_micro_batch`, and the rank its trace found heaviest at that
    micro-batch (None for one rank, or when nothing fits)."""
    if device.capacity is None:
        return None, None
    from memfit.estimator.estimate import estimate

    probe_settings = settings.replace(micro_batch_size=None, accumulation_steps=1)
    found = estimate(workload, None, probe_settings, device=device, search_limit=limit, speed=False)
    heaviest = found.rank if found.world_size > 1 and found.max_batch_size else None
    return found.max_batch_size, heaviest


def predicted_speed(workload: Workload, settings: Settings, card: GPU) -> tuple[float, float]:
    """The estimator's predicted (seconds per step, samples/s) of the settings on ``card``
    (for several ranks, one rank's computation: communication is not predicted)."""
    from memfit.estimator.speed import step_time

    one_rank = settings.replace(world_size=1, shard="none", shard_group_size=None)
    time = step_time(workload, one_rank, card)
    return time.seconds_per_step, time.samples_per_second


def trial(workload: Workload, settings: Settings, device: Device) -> Measurement:
    """Two optimizer steps of one micro-batch: memory and speed of the candidate."""
    assert settings.micro_batch_size is not None
    return measure(workload, settings.micro_batch_size, device, settings.replace(accumulation_steps=1), steps=2)


def speed_card(gpu: Device, named: str | GPU | None) -> GPU | None:
    """The card whose predicted speed ranks the candidates, or None to rank by measurement."""
    if named is None and not isinstance(gpu, SimDevice):
        return None
    from memfit.estimator.speed import speed_gpu

    if named is not None:
        return speed_gpu(named)
    card = gpu.gpu if isinstance(gpu, SimDevice) else None
    # a simulated card without peaks (a laptop part) ranks as a sim:SIZE does, on the default card
    return speed_gpu(card if card is not None and card.has_peaks else None)


@contextmanager
def rehearsing(
    request: PlanRequest, shape: Settings, run_trial: Trial, limit: int | None, heaviest: int | None = None
) -> Iterator[None]:
    """For several ranks, the default trials run inside a rehearsal of the heaviest rank:
    ``heaviest`` when the group's estimate gave it, else the one the estimate's trace (every
    distinct rank) finds peaking highest at the group's largest micro-batch, else the one
    holding the most parameter bytes."""
    if shape.world_size <= 1 or run_trial is not trial:
        yield
        return
    from memfit.estimator.rehearsal import rehearsal

    if heaviest is None:
        heaviest = _heaviest_rank_at(request.workload, shape, request.device, limit)
    with rehearsal(request.workload, shape, heaviest):
        yield


def _heaviest_rank_at(workload: Workload, shape: Settings, device: Device, limit: int | None) -> int | None:
    """The rank the traced estimate finds heaviest at micro-batch ``limit`` (None: unknown).

    Why: under ZeRO-1 or FSDP2 with uneven shards the rank holding the most state is not
    always the one that reserves the most (the allocator places small tensors differently).
    """
    if limit is None or limit < 1 or device.capacity is None:
        return None
    from memfit.estimator.estimate import estimate

    one_step = shape.replace(micro_batch_size=None, accumulation_steps=1)
    try:
        return estimate(workload, limit, one_step, device=device, search=False, speed=False).rank
    except Exception:  # noqa: BLE001 - only the choice of rank is lost; the trials follow
        return None


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``, for a status or a summary."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class Failures:
    """Trials that raised an error other than out of memory: counted, the first one kept.

    Why keep the first with its traceback: when every trial fails so, the plan cannot say
    anything and the user's own error is the answer (re-raised as it was). Why clear its
    frames: the traceback's frames hold the failed step's tensors, which would otherwise
    stay allocated on the device through every later trial.
    """

    def __init__(self) -> None:
        self.first: Exception | None = None
        self.count = 0
        self.trials = 0
        self.last_reason: str | None = None

    @property
    def first_reason(self) -> str:
        return one_line(self.first) if self.first is not None else ""

    def run(self, run_trial: Trial, workload: Workload, settings: Settings, device: Device) -> Measurement | None:
        """One trial; None when it failed for a reason other than memory."""
        self.trials += 1
        self.last_reason = None
        failed = False
        try:
            measurement = run_trial(workload, settings, device)
        except Exception as error:
            if is_oom(error) or isinstance(error, WorkloadError):
                # run_trial reports memory as a result; an OOM here is a bug to show. A
                # workload's broken contract (a closure optimizer, a loss that is not one
                # number) is the same for every candidate: refused now, not after each.
                raise
            failed = True
            self.count += 1
            self.last_reason = one_line(error)
            if self.first is None:
                traceback.clear_frames(error.__traceback__)
                self.first = error
        if failed:
            release_cached_memory()  # outside the except block: the failed step's tensors go
            device.empty_cache()
            return None
        measurement.refuse_if_retained()  # the next candidates would see a smaller device
        if measurement.fits and not measurement.finite_loss:
            raise MemfitError(
                non_finite_loss_message(workload.name, measurement.batch_size, measurement.loss or math.nan)
                + (
                    f" (micro-batch {settings.micro_batch_size} in {settings.precision}; "
                    f"if only {settings.precision} gives it, leave it out with --precision)"
                    if settings.precision != "fp32"
                    else f" (micro-batch {settings.micro_batch_size})"
                )
            )
        return measurement

    def raise_if_every_trial_failed(self) -> None:
        if self.first is not None and self.count == self.trials:
            raise self.first


def status_of(measurement: Measurement | None, budget: int | None, failure: str | None) -> str:
    """A candidate's status after its trial (see :attr:`Candidate.status`)."""
    if measurement is None:
        return f"failed: {failure}"
    if not measurement.fits:
        return "out of memory"
    if budget is not None and measurement.peak_reserved > budget:
        return "over headroom"
    return "measured"


def unranked_refusal(shortfall: str) -> MemfitError:
    """The refusal of a plan that only real runs can rank, on a host that cannot hold one.

    Args:
        shortfall: :attr:`Trials.host_shortfall`, how much host memory real steps need.
    """
    return MemfitError(
        f"{shortfall}, and only a real run can time the candidates: name a card with --gpu "
        "(speed_gpu=) to rank them by predicted speed, or use a machine with more memory"
    )


def confirm_on_device(
    measured: list[Candidate], trials: Trials, request: PlanRequest, progress: Progress | None, speed: Speed
) -> int | None:
    """Run for real what fake trials cannot say; return the optimizer steps run (None: they disagreed).

    Fake trials say what fits, not how fast. Candidates without the speed that ranks them
    (``speed``: the predicted one on a simulated GPU; measured where none could be
    predicted) are timed on the device, as every plan did before fake trials; then the
    recommended candidate, if it still rests on a fake trial, runs for real too. A real run that does
    not end as the fake one did (out of memory, over the headroom, an error, a loss that is
    not finite) sends the caller back to plan on real trials, which report it as they do.
    """
    steps = 0

    def run_for_real(c: Candidate) -> bool:
        nonlocal steps
        s = c.settings
        assert s.micro_batch_size is not None and c.measurement is not None
        problem = None
        try:
            real = trials.real(s.micro_batch_size, s.replace(accumulation_steps=1))
        except Exception as error:  # noqa: BLE001 - the real-trial plan reports it, candidate by candidate
            problem = one_line(error)
        steps += 2
        if problem is None:
            # a workload keeping memory from run to run is named, not blamed on fake tensors
            real.refuse_if_retained()
        if problem is None and (status_of(real, request.budget, None) != "measured" or not real.finite_loss):
            problem = (
                "out of memory" if not real.fits else "over the headroom" if real.finite_loss else "a loss not finite"
            )
        if problem is not None:
            trials.tell(
                f"micro-batch {s.micro_batch_size} in {describe_settings(s)} fit on fake tensors but ran for real "
                f"with {problem}: the plan ran again on real trials"
            )
            return False
        if c.samples_per_second is None and real.samples_per_second is not None:
            c.samples_per_second = real.samples_per_second * request.world_size
        c.measurement = real
        if progress:
            progress(c)
        return True

    unranked = [c for c in measured if speed(c) is None and c.settings.shard not in OFFLOAD_SHARDS]
    if unranked and trials.host_shortfall is not None:
        # Only a real run can rank them, and the host cannot hold one: refused, not guessed.
        raise unranked_refusal(trials.host_shortfall)
    for c in unranked:
        if not run_for_real(c):
            return None
    best = recommended_candidate(measured, speed)
    if best.settings.shard in OFFLOAD_SHARDS:
        # a simulated GPU cannot keep the host's memory apart: the estimator's trial stands
        trials.tell("the recommended CPU offload was not run for real: its memory is the estimator's (fake tensors)")
        return steps
    if best.measurement is not None and best.measurement.fake and trials.host_shortfall is not None:
        # The fake trial's answer stands, said as such: a real run would exhaust the host.
        trials.tell(
            f"the recommended candidate was not run for real ({trials.host_shortfall}): "
            "its memory is the estimator's (fake tensors)"
        )
        return steps
    if best.measurement is not None and best.measurement.fake and not run_for_real(best):
        return None
    return steps
