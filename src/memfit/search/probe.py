"""``memfit.probe()``: the largest batch that fits on a device, and the one to use, by trial.

Each trial runs two optimizer steps at one batch size through :func:`memfit.measure`
(worst-case shapes; the second step with the optimizer state alive), so what fits here
fits in training. The batch sizes tried come from :mod:`memfit.batch_search`: small
first, then a jump along the measured slope of memory, then a proof that the next size
does not fit. The answer is exact: the largest multiple of ``multiple_of`` that fits,
with the next one shown not to.

The recommended batch is the largest whose peak reserved memory stays under
``(1 - headroom)`` of the device, found from the memory line of every trial and verified
by a trial (:mod:`memfit.search.headroom`); or, when throughput stops growing before it,
the smallest batch within 2 % of the best samples per second, but only where repeated
timings agree closely enough to tell (else the headroom batch, and ``reason`` says so).

Probing leaves no trace: a model given as an instance is trained in place and then put
back, bit for bit, with the optimizer the workload hands out, any objects passed in
``preserve`` (a GradScaler, a scheduler) and every random generator. Under an initialized
process group every rank probes its own device and all return the smallest answer.

>>> from memfit.search.probe import probe
>>> result = probe("mlp:layers=1,width=16,features=8", "sim:64MiB", max_batch_size=64)
>>> result.max_batch_size, result.limit
(64, 'max_batch_size')

With ``settings.world_size > 1`` the trials rehearse one rank of that many on a fake
process group (:func:`memfit.estimator.rehearsal.rehearsal`): the model wrapped
by the strategy (DDP, ZeRO-1, FSDP2), the rank that holds the most, its memory on this
device exactly as on N GPUs, its step time without communication.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from memfit import distributed
from memfit._html import HtmlRepr
from memfit.batch_search import Outcome, SearchSpace, answer, next_batch_size
from memfit.errors import DoesNotFitError, MemfitError, WorkloadError
from memfit.estimator.rehearsal import rehearsal
from memfit.memory.devices import CudaDevice, Device
from memfit.memory.devices import device as make_device
from memfit.run.measure import Measurement, non_finite_loss_message
from memfit.run.settings import Settings
from memfit.run.state import preserved_workload
from memfit.run.strategy import describe
from memfit.search.eval_probe import EvalTrials, EvaluationMode, check_evaluation
from memfit.search.headroom import DEFAULT_HEADROOM, check_headroom, next_headroom_batch, repeatable, within_budget
from memfit.search.trials import TRIAL_KINDS, TrialKind, Trials, choose_trials
from memfit.units import format_size
from memfit.workload import Workload, WorstCase, load_workload

__all__ = [
    "probe",
    "ProbeResult",
    "search",
    "Search",
    "recommend",
    "Recommendation",
    "TRIAL_STEPS",
    "THROUGHPUT_TOLERANCE",
    "HEADROOM_TRIALS",
]

#: optimizer steps per trial: the second runs with the optimizer state alive
TRIAL_STEPS = 2
#: a batch within this fraction of the best samples/s counts as "as fast"
THROUGHPUT_TOLERANCE = 0.02
#: at most this many trials after the maximum, to find the batch within the headroom
HEADROOM_TRIALS = 5

TrialFunction = Callable[[int], Measurement]
#: ``progress(batch_size, None)`` before a trial, ``progress(batch_size, measurement)`` after
Progress = Callable[[int, "Measurement | None"], None]


@dataclass(frozen=True)
class ProbeResult(HtmlRepr):
    """What :func:`probe` found. Bytes are ints; ``trials`` are in the order they ran."""

    max_batch_size: int
    recommended_batch_size: int
    #: the largest batch tried with peak reserved within (1 - headroom) of capacity
    #: (searched for at most HEADROOM_TRIALS trials after the maximum)
    headroom_batch_size: int
    #: the smallest batch within 2 % of the best samples/s (among trials up to the above)
    throughput_batch_size: int | None
    #: why the recommended batch is what it is, in one sentence
    reason: str
    #: "memory" (the next size did not fit) or "max_batch_size" (the search bound)
    limit: str
    trials: tuple[Measurement, ...]
    trial_steps: int
    capacity: int | None
    headroom: float
    multiple_of: int
    device: str = ""
    workload: str = ""
    world_size: int = 1
    #: this rank's own maximum (the others may have less memory)
    local_max_batch_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields above, trials as dicts with samples_per_second."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("trials", "extra")}
        data["trials"] = [
            {
                "batch_size": t.batch_size,
                "fits": t.fits,
                "peak_allocated": t.peak_allocated,
                "peak_reserved": t.peak_reserved,
                "samples_per_second": t.samples_per_second,
                "seconds_per_step": t.seconds_per_step,
                "fake": t.fake,
            }
            for t in self.trials
        ]
        data.update(self.extra)
        return data


@dataclass(frozen=True)
class Search:
    """The outcome of :func:`search` on one device: trials and the three batch sizes."""

    trials: tuple[Measurement, ...]
    max_batch_size: int
    headroom_batch_size: int
    throughput_batch_size: int | None
    recommended_batch_size: int
    reason: str
    limit: str


def _outcome(measurement: Measurement) -> Outcome:
    """A trial as the search policies see it: fits, and its peak reserved memory when it did."""
    return Outcome(measurement.batch_size, measurement.fits, measurement.peak_reserved if measurement.fits else 0)


def search(
    trial: TrialFunction,
    space: SearchSpace,
    *,
    capacity: int | None,
    headroom: float = DEFAULT_HEADROOM,
    progress: Progress | None = None,
    describe: str = "the workload",
    headroom_guess: int | None = None,
) -> Search:
    """Run trials until the maximum and the headroom batch are found; pick the recommendation.

    ``trial(batch_size)`` runs one trial (:func:`memfit.measure` in :func:`probe`, a
    formula in tests). ``capacity`` is the device's memory for the headroom rule.

    Args:
        trial: runs one batch size and returns its measurement.
        space: the batch sizes searched (multiple, bound, first guess).
        capacity: the device's memory in bytes (None: no headroom rule).
        headroom: the fraction of ``capacity`` the recommended batch leaves free.
        progress: called before and after each trial.
        describe: names the workload and device in errors.
        headroom_guess: a predicted headroom batch (the estimator's memory line at the
            budget), verified by a trial and its neighbour before any other headroom trial.

    Raises:
        DoesNotFitError: the smallest batch does not fit.
        MemfitError: a trial's loss is NaN or infinite (a broken step, not memory).
    """
    trials: list[Measurement] = []

    def run(batch_size: int) -> Measurement:
        if progress is not None:
            progress(batch_size, None)
        result = trial(batch_size)
        trials.append(result)
        if progress is not None:
            progress(batch_size, result)
        result.refuse_if_retained()  # later trials would see a smaller device
        if result.fits and not result.finite_loss:
            raise MemfitError(non_finite_loss_message(describe, batch_size, _loss_value(result)))
        return result

    while (batch := next_batch_size(space, [_outcome(t) for t in trials])) is not None:
        run(batch)
    maximum = answer(space, [_outcome(t) for t in trials])
    if maximum == 0:
        raise DoesNotFitError(_does_not_fit_message(describe, trials, space, capacity))
    limit_kind = "max_batch_size" if maximum + space.multiple_of > space.max_units * space.multiple_of else "memory"

    headroom_batch = maximum
    budget = None
    if capacity is not None and headroom > 0:
        # The largest batch within the smaller budget, from the memory line of every trial
        # so far; a few more trials at most, since a recommendation needs no proof to the
        # last sample. Only a batch verified within the budget is an answer.
        budget = math.floor((1 - headroom) * capacity)
        start = len(trials)
        for _ in range(HEADROOM_TRIALS):
            outcomes = [_outcome(t) for t in trials]
            batch = next_headroom_batch(
                outcomes,
                budget,
                maximum=maximum,
                multiple_of=space.multiple_of,
                phase_start=start,
                guess=headroom_guess,
            )
            if batch is None:
                break
            run(batch)
        headroom_batch = within_budget(
            [_outcome(t) for t in trials], budget, maximum=maximum, multiple_of=space.multiple_of
        )
    choice = recommend(trials, headroom_batch, headroom)
    for _ in range(2):  # a second round when the repeats moved the throughput batch
        if not choice.repeat:
            break
        for batch in choice.repeat:
            run(batch)
        choice = recommend(trials, headroom_batch, headroom)
    if headroom_batch == 0:
        # Not even the smallest batch keeps the headroom: it is still the one to use, said so.
        smallest = min((t for t in trials if t.fits), key=lambda t: t.batch_size)
        headroom_batch = smallest.batch_size
        share = smallest.peak_reserved / capacity if capacity else 0.0
        choice = Recommendation(
            headroom_batch,
            choice.throughput_batch,
            f"no batch keeps {headroom:.0%} of memory free: even batch {headroom_batch} reserves {share:.1%} of it",
        )
    return Search(
        tuple(trials), maximum, headroom_batch, choice.throughput_batch, choice.batch, choice.reason, limit_kind
    )


def confirmed_search(
    trials: Trials,
    space: SearchSpace,
    *,
    capacity: int | None,
    headroom: float = DEFAULT_HEADROOM,
    progress: Progress | None = None,
    describe: str = "the workload",
    headroom_guess: int | None = None,
) -> Search:
    """:func:`search` with ``trials``; an answer found on fake tensors is confirmed for real.

    Before the search, the smallest batch runs for real: fake tensors have no values, so a
    broken step (a NaN loss) would otherwise show only at the end; this way it fails at
    once, as a search of real trials does, and a step that does not fit even there is
    proven so on the device. After it, the search's own proof runs on the device: the
    maximum fits and the next size does not (one real run when the maximum is the
    search's bound). Should a real run disagree with the fake ones (the allocator model and
    the device part ways), the whole search runs again on real trials, starting from the
    fake answer, so no answer rests on fake tensors alone.
    """
    kwargs: dict[str, Any] = {
        "capacity": capacity,
        "headroom": headroom,
        "progress": progress,
        "describe": describe,
        "headroom_guess": headroom_guess,
    }
    if not trials.fake:
        return search(trials, space, **kwargs)
    real: list[Measurement] = []

    def run_real(batch_size: int) -> Measurement:
        if progress is not None:
            progress(batch_size, None)
        measured = trials.real(batch_size)
        real.append(measured)
        if progress is not None:
            progress(batch_size, measured)
        measured.refuse_if_retained()
        if measured.fits and not measured.finite_loss:
            raise MemfitError(non_finite_loss_message(describe, batch_size, _loss_value(measured)))
        return measured

    def disagreement(batch_size: int, fits: bool, guess: int | None) -> Search:
        trials.tell(
            f"a real run at batch {batch_size} {'fit' if fits else 'ran out of memory'} where fake tensors "
            "said otherwise: the search ran again on real trials"
        )
        return search(trials.real, dataclasses.replace(space, guess=guess), **kwargs)

    if not run_real(space.multiple_of).fits:
        raise DoesNotFitError(_does_not_fit_message(describe, real, space, capacity))
    try:
        found = search(trials, space, **kwargs)
    except DoesNotFitError:
        return disagreement(space.multiple_of, True, None)
    ran = {t.batch_size: t for t in (*real, *found.trials) if not t.fake}  # real already (or fallen back)
    proofs = [(found.max_batch_size, True)]
    if found.limit == "memory":
        proofs.append((found.max_batch_size + space.multiple_of, False))
    for batch_size, expected in proofs:
        measured = ran.get(batch_size) or run_real(batch_size)
        if measured.fits != expected:
            return disagreement(batch_size, measured.fits, found.max_batch_size)
    # The recommendation stands: throughput needs times, and of the trials only the real
    # runs have them (fake tensors do no arithmetic): the smallest batch, the maximum and
    # the size above it, which the throughput rule does not weigh on single timings.
    return dataclasses.replace(found, trials=(real[0], *found.trials, *real[1:]))


def _loss_value(measurement: Measurement) -> float:
    return math.nan if measurement.loss is None else measurement.loss


@dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend` decided: the batch, the throughput batch, why; or what to re-time."""

    batch: int
    #: the smallest batch within 2 % of the best samples/s (among trials up to the headroom batch)
    throughput_batch: int | None
    reason: str
    #: batch sizes whose timing must be repeated before throughput may decide (empty: decided)
    repeat: tuple[int, ...] = ()


def recommend(trials: Sequence[Measurement], headroom_batch: int, headroom: float) -> Recommendation:
    """The recommended batch: the headroom batch, or a smaller one as fast, timings permitting.

    Why the throughput rule: past the point where a GPU is saturated a larger batch
    only adds memory pressure (and changes the optimization), not speed. Why repeats: one
    timing on a busy machine can be off by a factor of three, and a rule that picks a
    smaller batch from it makes training slower for nothing. So the smaller batch is
    chosen only when both it and the headroom batch were timed at least twice, each
    pair agreeing within :data:`THROUGHPUT_TOLERANCE`, and the headroom batch is still
    no faster by more than the tolerance left after that noise; the best of the repeated
    timings counts. Otherwise ``repeat`` names the batches to time again, or (with
    repeats already made) the headroom batch is recommended and ``reason`` says why.

    Args:
        trials: every trial, repeats included (same batch size, one more timing).
        headroom_batch: the largest batch verified within the headroom.
        headroom: the fraction of memory kept free (for the reason).

    >>> m = lambda b, s: Measurement(b, True, 0, 0, s)
    >>> once = [m(1, 0.01), m(64, 0.50), m(128, 1.0), m(256, 2.0)]
    >>> recommend(once, 256, 0.05).repeat
    (64, 256)
    >>> recommend(once + [m(64, 0.501), m(256, 2.001)], 256, 0.05).batch
    64
    >>> "timings do not repeat" in recommend(once + [m(64, 0.9), m(256, 2.0)], 256, 0.05).reason
    True
    """
    by_headroom = f"the largest batch with peak reserved memory within {1 - headroom:.0%} of capacity"
    timings: dict[int, list[float]] = {}
    for t in trials:
        if t.fits and t.seconds_per_step and t.batch_size <= headroom_batch:
            timings.setdefault(t.batch_size, []).append(t.seconds_per_step)
    if not timings:
        return Recommendation(headroom_batch, None, by_headroom)
    speeds = {b: b / min(seconds) for b, seconds in timings.items()}
    best = max(speeds.values())
    fastest = min(b for b, s in speeds.items() if s >= (1 - THROUGHPUT_TOLERANCE) * best)
    # "Stops growing" needs a larger batch measured and found no faster; the fastest
    # batch being the largest one measured says nothing about the sizes above it.
    if fastest >= max(speeds) or headroom_batch not in timings:
        return Recommendation(headroom_batch, fastest, by_headroom)
    pair = (fastest, headroom_batch)
    # Noise that any repeated timing has shown settles it; else time the two contenders again.
    shown = [seconds for seconds in timings.values() if len(seconds) > 1]
    noisy = bool(shown) and not repeatable(shown, THROUGHPUT_TOLERANCE)[0]
    if not noisy and any(len(timings[b]) < 2 for b in pair):
        return Recommendation(
            headroom_batch, fastest, by_headroom, repeat=tuple(b for b in pair if len(timings[b]) < 2)
        )
    steady, noise = repeatable(shown if noisy else [timings[b] for b in pair], THROUGHPUT_TOLERANCE)
    margin = THROUGHPUT_TOLERANCE - noise
    if not steady or speeds[headroom_batch] > (1 + margin) * speeds[fastest]:
        return Recommendation(
            headroom_batch,
            fastest,
            (
                f"{by_headroom}; timings do not repeat closely enough for throughput to decide "
                f"(batch {fastest} vs {headroom_batch}, repeated timings {noise:.0%} apart)"
                if not steady
                else f"{by_headroom}; repeated timings show it faster than batch {fastest}"
            ),
        )
    return Recommendation(
        fastest,
        fastest,
        (
            f"throughput stops growing at batch {fastest} (within {THROUGHPUT_TOLERANCE:.0%} of the best "
            f"samples/s, timings repeated {noise:.1%} apart); {headroom_batch} would fit with {headroom:.0%} headroom"
        ),
    )


def _does_not_fit_message(
    describe: str, trials: Sequence[Measurement], space: SearchSpace, capacity: int | None
) -> str:
    smallest = min((t for t in trials if not t.fits), key=lambda t: t.batch_size, default=None)
    batch = smallest.batch_size if smallest else space.multiple_of
    cap = format_size(capacity) if capacity else "its memory"
    ran_out = ""
    if smallest is not None and smallest.peak_reserved:
        ran_out = f" (it ran out of memory with {format_size(smallest.peak_reserved)} reserved)"
    return (
        f"{describe} does not fit even at batch size {batch}: one training step needs more than the "
        f"{cap} the device has{ran_out}; try bf16, checkpointing, a smaller model, or "
        "`memfit estimate` to see where the memory goes"
    )


# -- the device-facing part ---------------------------------------------------------------


def probe(
    workload: Workload | str,
    device: Device | str = "auto",
    settings: Settings | None = None,
    *,
    max_batch_size: int | None = None,
    multiple_of: int = 1,
    headroom: float = DEFAULT_HEADROOM,
    guess: int | str | None = "estimate",
    progress: Progress | None = None,
    preserve: Sequence[Any] = (),
    trials: TrialKind = "auto",
    say: Callable[[str], None] | None = None,
    rehearse_rank: int | None = None,
    evaluation: bool | str = False,
) -> ProbeResult:
    """Find the largest batch that fits on ``device`` (exact) and the batch to use.

    Each trial runs two optimizer steps at one batch size; the search jumps along the
    measured memory-per-sample line and proves its answer (the next size does not fit).
    The model, the optimizers and the RNG states are restored bit for bit afterwards.
    Under a process group every rank must call this; all return the smallest maximum.

    Args:
        workload: a :class:`memfit.Workload` or a reference (``"gpt2:n_layer=2"``,
            ``"train.py:make_workload"``), resolved once here.
        device: ``"cuda"``, ``"cuda:N"``, ``"sim:8GiB"``, ``"cpu"``, ``"auto"`` or a device.
        settings: precision, checkpointing and accumulation (the batch probed is the
            micro-batch); default fp32, no checkpointing.
        max_batch_size: the largest batch worth considering (the search stops there).
        multiple_of: only batch sizes that are multiples of this (8 suits tensor cores).
        headroom: the fraction of memory the recommended batch leaves free.
        guess: a predicted maximum tried first (a right guess ends the search in two
            trials); ``"estimate"`` asks :func:`memfit.estimate` on a device whose memory
            is known; ``None`` searches from batch 1.
        progress: called as ``progress(batch, None)`` before and
            ``progress(batch, measurement)`` after each trial.
        preserve: further objects to restore afterwards (a GradScaler, an LR scheduler).
        trials: ``"auto"`` searches on fake tensors on a simulated GPU and confirms the
            answer with real runs (the maximum fits, the next size does not); ``"real"``
            runs every trial for real (see :mod:`memfit.search.trials`).
        say: receives one line when trials fall back to real runs, and why.
        rehearse_rank: with ``world_size > 1``, the rank whose memory the trials rehearse
            (default: the rank the traced estimate found heaviest at its guess, when it
            ran; else the one holding the most parameter bytes).
        evaluation: probe the evaluation batch instead (``True``/``"no_grad"``, or
            ``"inference_mode"``): the loss in eval mode without gradients, each trial
            real (:mod:`memfit.search.eval_probe`); one GPU only.

    Raises:
        DoesNotFitError: not even the smallest batch fits.
    """
    check_headroom(headroom)
    mode = check_evaluation(evaluation, settings or Settings())
    request = _resolve(
        load_workload(workload),
        device,
        settings or Settings(),
        space=(max_batch_size, multiple_of),
        headroom=headroom,
        guess=guess,
        trials=trials,
    )
    if mode is not None:
        request = dataclasses.replace(request, evaluation=mode)
    hooks = _ProbeHooks(progress, tuple(preserve), say, rehearse_rank)
    failure: BaseException | None = None
    probed: _Probed | None = None
    try:
        probed = _search_preserving(request, hooks)
    except Exception as error:  # noqa: BLE001 - re-raised below, after the ranks agree
        failure = error
    result = _agree(probed.found if probed else None, failure, request)
    fake = sum(1 for t in result.trials if t.fake)
    note, rehearsed = (probed.note, probed.rehearsed) if probed else (None, {})
    evaluated: dict[str, Any] = {"evaluation": mode} if mode is not None else {}
    batches = request.workload.make_batch
    if isinstance(batches, WorstCase):  # which sample sets the limit
        evaluated["worst_case"] = batches.describe()
    counts = {"fake_trials": fake, "real_trials": len(result.trials) - fake}
    return dataclasses.replace(result, extra={**counts, "trials_note": note, **rehearsed, **evaluated})


@dataclass(frozen=True)
class _ProbeRequest:
    """What :func:`probe` was asked, checked and resolved once where it enters."""

    workload: Workload
    device: Device
    settings: Settings
    space: SearchSpace
    max_batch_size: int | None
    headroom: float
    guess: int | str | None
    trials: TrialKind
    #: the evaluation batch is probed instead of the training step (see memfit.search.eval_probe)
    evaluation: EvaluationMode | None = None


@dataclass(frozen=True)
class _ProbeHooks:
    """How a probe reports and what it leaves as it found it."""

    progress: Progress | None = None
    preserve: tuple[Any, ...] = ()
    say: Callable[[str], None] | None = None
    rehearse_rank: int | None = None


class _Probed(NamedTuple):
    """This rank's search, why its trials were real (None: they were not), the rank rehearsed."""

    found: Search
    note: str | None
    rehearsed: dict[str, Any]


def _resolve(
    wl: Workload,
    device: Device | str,
    settings: Settings,
    *,
    space: tuple[int | None, int],
    headroom: float,
    guess: int | str | None,
    trials: TrialKind,
) -> _ProbeRequest:
    """Check the arguments (one line each, before any trial) and resolve the device and the search space."""
    if device == "auto" and distributed.is_distributed() and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"  # this rank's GPU, not every rank's cuda:0
    gpu = make_device(device)
    if isinstance(guess, str) and guess != "estimate":
        raise MemfitError(f"invalid guess {guess!r}: a batch size, or 'estimate'")
    max_batch_size, multiple_of = space
    searched = SearchSpace(
        capacity=_search_capacity(gpu),
        multiple_of=multiple_of,
        max_batch_size=max_batch_size,
        guess=guess if isinstance(guess, int) else None,
    )
    if searched.capacity is None and max_batch_size is None:
        raise MemfitError(f"{gpu.describe()} has no memory limit: give max_batch_size (--max-batch-size)")
    if trials not in TRIAL_KINDS:
        raise MemfitError(f"invalid trials {trials!r}: use one of {', '.join(TRIAL_KINDS)}")
    if settings.world_size > 1 and distributed.is_distributed():
        raise MemfitError(
            f"probe with world size {settings.world_size} rehearses one rank on a fake process group in "
            "one process; this one is already in a process group: run it without torchrun"
        )
    return _ProbeRequest(wl, gpu, settings, searched, max_batch_size, headroom, guess, trials)


def _search_preserving(request: _ProbeRequest, hooks: _ProbeHooks) -> _Probed:
    """This rank's search, with the model, its optimizers and ``preserve`` put back afterwards."""
    wl, gpu, settings = request.workload, request.device, request.settings
    space, rank = request.space, hooks.rehearse_rank
    with preserved_workload(wl, *hooks.preserve) as probed:
        headroom_guess = None
        if request.guess == "estimate":
            guessed = estimated_guess(wl, gpu, settings, request.max_batch_size, headroom=request.headroom)
            space = dataclasses.replace(space, guess=guessed.batch_size)
            headroom_guess = guessed.headroom
            if rank is None and settings.world_size > 1:
                # Under ZeRO-1 or uneven FSDP2 shards the rank that peaks highest is
                # not always the one holding the most: the trace of every candidate says.
                rank = guessed.rank
        # The one place that chooses what a trial runs (see memfit.search.trials).
        run_trial = (
            EvalTrials(probed, gpu, settings, request.evaluation, say=hooks.say)
            if request.evaluation is not None
            else choose_trials(request.trials, probed, gpu, settings, steps=TRIAL_STEPS, say=hooks.say)
        )
        # world_size > 1: the trials rehearse the rank holding the most, on a fake
        # process group (the strategy's memory exactly; time without communication).
        with rehearsal(wl, settings, rank) as rehearsed_rank:
            found = confirmed_search(
                run_trial,
                space,
                capacity=gpu.capacity,
                headroom=request.headroom,
                progress=hooks.progress,
                describe=f"{wl.name} on {gpu.describe()}",
                headroom_guess=headroom_guess,
            )
    rehearsed: dict[str, Any] = {}
    if settings.world_size > 1:
        rehearsed = {
            "rehearsed_world_size": settings.world_size,
            "rehearsed_rank": rehearsed_rank,
            "shard": settings.shard,
            "strategy": describe(settings.shard, settings.world_size, settings.shard_group_size),
        }
    return _Probed(found, run_trial.note, rehearsed)


class Guess(NamedTuple):
    """The estimator's largest batch (None when unknown), the rank it is for (the
    heaviest of the ranks traced; None for one rank, or when unknown), and its headroom
    batch (the largest whose estimated peak reserved memory keeps the headroom; None when
    unknown or not asked)."""

    batch_size: int | None
    rank: int | None
    headroom: int | None = None


def estimated_guess(
    workload: Workload, gpu: Device, settings: Settings, limit: int | None, *, headroom: float = 0.0
) -> Guess:
    """The estimator's largest batch, as the search's first guess, its heaviest rank, and
    (with ``headroom``) the batch its memory line puts at the headroom's budget.

    Why tolerate a failure: the guess only saves trials; an operation fake tensors cannot
    run must not stop a probe that real trials can do.

    Args:
        workload: the workload.
        gpu: the device probed (its capacity bounds the estimate).
        settings: the probe's settings.
        limit: the largest batch worth considering.
        headroom: the fraction of memory the headroom batch leaves free (0: no headroom guess).
    """
    if gpu.capacity is None or not workload.builds_fresh_models:
        # A model instance comes with the script's own optimizer (bound to the real
        # parameters), which a fake-tensor run must not touch: search from batch 1.
        return Guess(None, None)
    from memfit.estimator.estimate import estimate

    unbatched = settings.replace(micro_batch_size=None)
    try:
        predicted = estimate(workload, None, unbatched, device=gpu, search_limit=limit, speed=False)
        maximum = predicted.max_batch_size or None
        rank = predicted.rank if predicted.world_size > 1 and maximum else None
        if maximum is None or headroom <= 0:
            return Guess(maximum, rank)
        budget = math.floor((1 - headroom) * gpu.capacity)

        def outcome(batch: int) -> Outcome:
            at = estimate(workload, batch, unbatched, device=gpu, search=False, speed=False)
            return Outcome(batch, bool(at.fits), at.peak_reserved if at.fits else 0)

        # the estimator's memory line, searched by the rule probe's real trials follow
        # (memfit.search.headroom), on fake runs: a few, from the maximum's own
        found = [Outcome(maximum, True, predicted.peak_reserved), Outcome(maximum + 1, False)]
        while (batch := next_headroom_batch(found, budget, maximum=maximum, phase_start=2)) is not None:
            found.append(outcome(batch))
        # none within the budget: batch 1 is the one to verify (over it, nothing keeps the headroom)
        return Guess(maximum, rank, max(1, within_budget(found, budget, maximum=maximum)))
    except WorkloadError:
        raise  # the workload's contract (a closure optimizer): refused before any real trial
    except Exception:  # noqa: BLE001 - only the starting point is lost; real trials follow
        # A bug in the user's step shows up unchanged in the first real trial.
        return Guess(None, None)


def _search_capacity(gpu: Device) -> int | None:
    """The memory the search aims at: on CUDA, no more than this process can still reserve.

    Why: the CUDA context and other processes take memory that never shows up in
    PyTorch's reserved bytes, so predicting against the card's total would overshoot.
    """
    if isinstance(gpu, CudaDevice) and gpu.capacity is not None:
        free, _total = torch.cuda.mem_get_info(gpu.torch_device)
        return max(1, min(gpu.capacity, gpu.memory_reserved() + free))
    return gpu.capacity


_OK, _DOES_NOT_FIT, _FAILED = 0, 1, 2


def _agree(found: Search | None, failure: BaseException | None, request: _ProbeRequest) -> ProbeResult:
    """Make every rank return the same answer, or every rank raise.

    Why this shape: each rank runs its own number of trials (its device may be smaller),
    so the ranks meet only here, and every rank makes exactly the same collectives: one
    for "did anyone fail", then, unless someone did, one per agreed number.
    """
    gpu, workload, space = request.device, request.workload, request.space
    code = _OK if failure is None else _DOES_NOT_FIT if isinstance(failure, DoesNotFitError) else _FAILED
    worst = distributed.agree_max(code)
    if worst != _OK:
        if failure is not None and code == worst:
            raise failure
        if worst == _DOES_NOT_FIT:
            raise DoesNotFitError(
                f"{workload.name} does not fit even at batch size {space.multiple_of} on another rank's device"
            )
        raise MemfitError("memfit probe failed on another rank; see that rank's error")
    assert found is not None
    maximum = distributed.agree_min(found.max_batch_size)
    headroom_batch = min(distributed.agree_min(found.headroom_batch_size), maximum)
    recommended = min(distributed.agree_min(found.recommended_batch_size), headroom_batch)
    reason = found.reason
    if recommended != found.recommended_batch_size:
        reason = f"the smallest recommendation over {distributed.world_size()} ranks"
    limit = found.limit if maximum == found.max_batch_size else "memory"
    return ProbeResult(
        max_batch_size=maximum,
        recommended_batch_size=recommended,
        headroom_batch_size=headroom_batch,
        throughput_batch_size=found.throughput_batch_size,
        reason=reason,
        limit=limit,
        trials=found.trials,
        trial_steps=TRIAL_STEPS * len(found.trials),
        capacity=gpu.capacity,
        headroom=request.headroom,
        multiple_of=space.multiple_of,
        device=gpu.spec,
        workload=workload.name,
        world_size=distributed.world_size() if distributed.is_distributed() else 1,
        local_max_batch_size=found.max_batch_size,
    )
