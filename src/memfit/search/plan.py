"""memfit plan: the fastest settings that reach a target batch within memory.

The field's advice, automated: when the batch you want does not fit, turn on mixed
precision, gradient accumulation or activation checkpointing, and keep the combination
that trains fastest. Candidates are every ``micro_batch x accumulation_steps x world_size
== target`` with each precision (fp32, bf16 where the device has it, fp16 with a
GradScaler) and each checkpointing mode (none, blocks). With ``world_size > 1`` the
sharding strategy is one more axis: DDP, ZeRO-1, FSDP2 keeping full parameters from
forward to backward, FSDP2, and with ``gpus_per_node`` hybrid sharding within a node
(:mod:`memfit.run.parallel`), ordered by what they communicate, least first.

The search, cheapest evidence first:

1. within one precision, a candidate is *dominated* by a measured one with a micro-batch
   at least as large, no more recomputation and no more sharding (the same work in
   fewer, larger kernels, without recompute, communicating less, is not slower);
   dominated candidates are not run, and a group (strategy, precision, checkpointing)
   of dominated candidates costs nothing at all;
2. for each other group, the estimator (fake tensors, no memory, no arithmetic; for N
   ranks, one rank traced on a fake process group) gives the largest micro-batch that
   fits; larger ones are discarded;
3. the rest are run as short trials (two optimizer steps of one micro-batch) from the
   most promising down; a trial that runs out of memory moves to the next smaller
   micro-batch of its group. For N ranks a trial rehearses the rank that holds the most
   on a fake process group (:func:`memfit.estimator.rehearsal.rehearsal`): its
   memory on the device is the strategy's, exactly; its time leaves out communication.

On a simulated GPU the trials run on fake tensors (:mod:`memfit.search.trials`), which
makes step 2 redundant (the estimator's search is a series of the same fake runs), and
the candidates they rank then run for real: those without a speed to rank by, and the
recommended one.

samples/s of a candidate is ``micro_batch / seconds per trial step`` on one device (times
the world size): a trial step holds one micro-batch and one optimizer step, so it
slightly favours larger micro-batches, which is also what accumulation rewards. For N
ranks neither the measured nor the predicted speed counts communication; among
candidates within 2 % of the fastest the plan takes the one that shards least (its
communication is the smallest), then the one using the least memory.

What counts as fitting: a trial that ran without running out of memory, with its peak
reserved memory within ``(1 - headroom)`` of the device (a candidate above that is shown
as "over headroom" and not recommended). A trial that fails for another reason (an
operation the device cannot run in that precision) is shown as "failed: <why>" and
skipped; when every trial fails so, the first error propagates with its traceback. A loss
that is NaN or infinite refuses the plan (:class:`~memfit.errors.MemfitError`): a broken
step is not a memory problem. The target is bounded by :data:`MAX_TARGET_BATCH`.

Which speed ranks the candidates: on a real GPU, the measured one. On a simulated GPU the
trials run on the CPU, whose speed says nothing about the GPU's; there, and whenever a
card is named (``speed_gpu=``), candidates that fit are ranked by their **predicted** step
time on the card (:mod:`memfit.estimator.timing`: every operation of one fake step timed
on the card's published peaks; accumulation and the optimizer step included): the card of
``sim:RTX 3090``, or the documented default of ``sim:SIZE``
(:data:`memfit.estimator.speed.DEFAULT_SPEED_GPU`).

>>> [c.micro_batch_size for c in candidates(12, precisions=["fp32"], checkpointing=["none"])]
[12, 6, 4, 3, 2, 1]
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memfit import distributed
from memfit._html import HtmlRepr
from memfit.errors import DoesNotFitError, MemfitError
from memfit.memory.devices import Device, SimDevice
from memfit.memory.devices import device as make_device
from memfit.memory.gpus import GPU
from memfit.memory.oom import is_oom, release_cached_memory
from memfit.run.measure import Measurement, measure, non_finite_loss_message
from memfit.run.settings import CHECKPOINTING, PRECISIONS, Checkpointing, Precision, Settings, find_blocks
from memfit.run.strategy import SHARDS, Shard, check_strategy, describe
from memfit.search.headroom import DEFAULT_HEADROOM, check_headroom
from memfit.search.trials import TrialKind, Trials, choose_trials
from memfit.units import format_size
from memfit.workload import Workload, load_workload

__all__ = [
    "plan",
    "Plan",
    "Candidate",
    "candidates",
    "check_target",
    "MAX_TARGET_BATCH",
    "divisors",
    "dominates",
    "pareto_front",
    "advice",
    "strategies",
    "strategy_cost",
    "Strategy",
]

#: how much faster one setting must be to be called faster, not noise
SPEED_TOLERANCE = 0.02
#: the largest target batch memfit plans for (2**24 samples per optimizer step). Why a
#: bound: every divisor of the target is a micro-batch to consider; below 2**24 no number
#: has more than 504 divisors (14,414,400 has the most), so a plan weighs at most
#: 6 x 504 candidates, and a typing slip (99999999999999) is refused at once
MAX_TARGET_BATCH = 2**24


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, largest first, in O(sqrt(n)) steps.

    >>> divisors(12)
    [12, 6, 4, 3, 2, 1]
    """
    small: list[int] = []
    large: list[int] = []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return large + small[::-1]


def check_target(target_batch_size: int, world_size: int = 1) -> None:
    """Refuse a target batch memfit cannot plan for, in one line (before any work).

    Args:
        target_batch_size: samples per optimizer step over all ranks.
        world_size: ranks sharing it; the target must be a multiple of it.
    """
    if target_batch_size < 1:
        raise MemfitError(f"invalid target batch {target_batch_size}: must be at least 1")
    if target_batch_size > MAX_TARGET_BATCH:
        raise MemfitError(
            f"target batch {target_batch_size} is above the largest memfit plans for "
            f"({MAX_TARGET_BATCH:,} = 2**24 samples per optimizer step)"
        )
    if world_size < 1:
        raise MemfitError(f"invalid world size {world_size}: must be at least 1")
    if target_batch_size % world_size:
        raise MemfitError(
            f"target batch {target_batch_size} cannot be split over {world_size} processes: "
            f"choose a multiple of {world_size}, such as {_nearest_multiple(target_batch_size, world_size)}"
        )


#: a sharding strategy: (shard, shard group size or None)
Strategy = tuple[Shard, "int | None"]


def strategies(
    world_size: int, shards: Sequence[Shard] | None = None, gpus_per_node: int | None = None
) -> list[Strategy]:
    """The strategies a plan for ``world_size`` ranks considers, least communication first.

    One rank: none. Several: ``shards`` (default: all four), and with ``gpus_per_node``
    (less than the world size, dividing it) hybrid sharding within a node for the FSDP2
    strategies.

    >>> strategies(16, gpus_per_node=8)
    [('none', None), ('optimizer', None), ('gradients', 8), ('full', 8), ('gradients', None), ('full', None)]
    """
    if world_size <= 1:
        return [("none", None)]
    chosen = list(shards or SHARDS)
    found: list[Strategy] = [(shard, None) for shard in chosen]
    if gpus_per_node is not None and 1 < gpus_per_node < world_size and world_size % gpus_per_node == 0:
        found += [(shard, gpus_per_node) for shard in chosen if shard in ("gradients", "full")]
    return sorted(found, key=strategy_cost)


def strategy_cost(strategy: Strategy) -> int:
    """Communication, least first: DDP, ZeRO-1 (adds a parameter broadcast), hybrid sharding
    (all-gathers within a node), FSDP2 across every rank; keeping full parameters from
    forward to backward saves backward's all-gathers."""
    shard, group = strategy
    base = {"none": 0, "optimizer": 1, "gradients": 2, "full": 3}[shard]
    return base if shard in ("none", "optimizer") or group is not None else base + 2


def candidates(
    target_batch_size: int,
    *,
    world_size: int = 1,
    precisions: Sequence[Precision] = PRECISIONS,
    checkpointing: Sequence[Checkpointing] = CHECKPOINTING,
    strategies: Sequence[Strategy] = (("none", None),),
) -> list[Settings]:
    """Every Settings whose micro-batch x accumulation x world size is the target exactly.

    Why exact: a plan that changes the global batch changes the training (learning-rate
    schedule, convergence), which is the user's decision, not memfit's.
    """
    check_target(target_batch_size, world_size)
    per_rank = target_batch_size // world_size
    for shard, group in strategies:
        check_strategy(shard, world_size, group)
    return [
        Settings(
            precision=p,
            checkpointing=c,
            micro_batch_size=m,
            accumulation_steps=per_rank // m,
            world_size=world_size,
            shard=shard,
            shard_group_size=group,
        )
        for shard, group in strategies
        for p in precisions
        for c in checkpointing
        for m in divisors(per_rank)
    ]


def _nearest_multiple(n: int, k: int) -> int:
    down = n - n % k
    return down if down >= k else k


def dominates(a: Settings, b: Settings) -> bool:
    """True when ``a`` is at least as fast as ``b`` by construction: the same precision, a
    micro-batch at least as large, no more recomputation and no more sharding."""
    assert a.micro_batch_size is not None and b.micro_batch_size is not None
    return (
        a.precision == b.precision
        and a.micro_batch_size >= b.micro_batch_size
        and CHECKPOINTING.index(a.checkpointing) <= CHECKPOINTING.index(b.checkpointing)
        and _cost(a) <= _cost(b)
        and a != b
    )


def _cost(s: Settings) -> int:
    return strategy_cost((s.shard, s.shard_group_size)) if s.world_size > 1 else 0


@dataclass
class Candidate:
    """One candidate and what the plan learnt about it."""

    settings: Settings
    #: "measured", "out of memory", "over headroom" (fits, but above (1 - headroom) of the
    #: device), "too large (estimate)", "dominated", "not run", or "failed: <why>" (an
    #: error other than out of memory)
    status: str
    predicted_max_micro_batch: int | None = None
    measurement: Measurement | None = None
    samples_per_second: float | None = None
    #: the predicted step on the plan's card (see the module): what ranks a simulated GPU's candidates
    predicted_seconds_per_step: float | None = None
    predicted_samples_per_second: float | None = None

    @property
    def fits(self) -> bool:
        return self.status == "measured"

    def to_dict(self) -> dict[str, Any]:
        m = self.measurement
        return {
            **self.settings.to_dict(),
            "status": self.status,
            "fits": self.fits if m is not None else None,
            "peak_allocated": m.peak_allocated if m else None,
            "peak_reserved": m.peak_reserved if m else None,
            "samples_per_second": self.samples_per_second,
            "predicted_seconds_per_step": self.predicted_seconds_per_step,
            "predicted_samples_per_second": self.predicted_samples_per_second,
            "predicted_max_micro_batch": self.predicted_max_micro_batch,
            "fake": m.fake if m is not None else None,
        }


def _measured_speed(c: Candidate) -> float | None:
    return c.samples_per_second


def _predicted_speed(c: Candidate) -> float | None:
    return c.predicted_samples_per_second


def pareto_front(
    measured: Sequence[Candidate], speed: Callable[[Candidate], float | None] = _measured_speed
) -> list[Candidate]:
    """The measured candidates no other beats on both memory (lower) and speed (higher).

    ``speed``: the speed that counts (measured by default; the predicted one on a
    simulated GPU).
    """
    front = []
    for c in measured:
        assert c.measurement is not None and speed(c) is not None
        beaten = any(
            o is not c
            and o.measurement is not None
            and speed(o) is not None
            and o.measurement.peak_reserved <= c.measurement.peak_reserved
            and (speed(o) or 0.0) >= (speed(c) or 0.0)
            and (o.measurement.peak_reserved < c.measurement.peak_reserved or (speed(o) or 0.0) > (speed(c) or 0.0))
            for o in measured
        )
        if not beaten:
            front.append(c)
    return sorted(front, key=lambda c: c.measurement.peak_reserved)  # type: ignore[union-attr]


def advice(
    *,
    target_batch_size: int,
    micro_batch_size: int | None,
    reference_batch_size: int | None = None,
    has_batchnorm: bool = False,
    world_size: int = 1,
    variable_shapes: bool = False,
    cudnn_benchmark: bool = False,
) -> list[str]:
    """Rules of thumb that apply to the chosen settings, one sentence each."""
    notes = []
    if reference_batch_size and reference_batch_size != target_batch_size:
        ratio = target_batch_size / reference_batch_size
        notes.append(
            f"The global batch {target_batch_size} is {ratio:g}x the reference {reference_batch_size}: "
            f"scale the learning rate by {ratio:g} (linear rule, SGD-style) or {ratio**0.5:.3g} "
            "(square-root rule, Adam-style), with warm-up; this is advice, check it on your task."
        )
    if has_batchnorm and micro_batch_size is not None and micro_batch_size < 16:
        fix = "SyncBatchNorm across ranks" if world_size > 1 else "GroupNorm"
        notes.append(
            f"The model has BatchNorm and the micro-batch is {micro_batch_size} (< 16): its batch "
            f"statistics get noisy; consider {fix}."
        )
    if variable_shapes and cudnn_benchmark:
        notes.append(
            "torch.backends.cudnn.benchmark is on and input shapes vary: each new shape re-tunes "
            "and may pick a workspace-hungry algorithm; turn it off or pad to fixed shapes."
        )
    return notes


@dataclass
class Plan(HtmlRepr):
    """The plan's result: every candidate, the Pareto front, the recommendation and why."""

    workload: str
    device: str
    capacity: int | None
    target_batch_size: int
    world_size: int
    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    advice: list[str] = field(default_factory=list)
    trial_steps: int = 0
    #: the fraction of memory a recommended candidate leaves free
    headroom: float = 0.0
    #: why the estimator could not prune candidates (None when it ran, or was not asked)
    estimate_error: str | None = None
    #: "measured" (a real GPU's trials) or "predicted" (on ``speed_gpu``: see the module)
    ranked_by: str = "measured"
    speed_gpu: str | None = None
    #: why the predicted speed could not rank a simulated GPU's candidates (None: it did, or was not asked)
    speed_error: str | None = None
    #: None, or why the trials ran for real (or ran again) where fake tensors were expected
    trials_note: str | None = None

    @property
    def pareto(self) -> list[Candidate]:
        speed = _predicted_speed if self.ranked_by == "predicted" else _measured_speed
        return pareto_front([c for c in self.candidates if c.fits], speed)

    @property
    def settings(self) -> Settings:
        if self.recommended is None:
            raise MemfitError(self.reason)
        return self.recommended.settings

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "device": self.device,
            "capacity": self.capacity,
            "target_batch_size": self.target_batch_size,
            "world_size": self.world_size,
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "reason": self.reason,
            "advice": list(self.advice),
            "trial_steps": self.trial_steps,
            "headroom": self.headroom,
            "estimate_error": self.estimate_error,
            "ranked_by": self.ranked_by,
            "speed_gpu": self.speed_gpu,
            "speed_error": self.speed_error,
            "trials_note": self.trials_note,
            "pareto": [c.to_dict() for c in self.pareto],
            "candidates": [c.to_dict() for c in self.candidates],
        }


#: (workload, settings, device, largest micro-batch of interest) -> largest that fits, or None
Predictor = Callable[[Workload, Settings, Device, int], "int | None"]
Trial = Callable[[Workload, Settings, Device], Measurement]
#: (workload, settings, card) -> predicted (seconds per step, samples/s) on one device
SpeedPredictor = Callable[[Workload, Settings, GPU], "tuple[float, float]"]


def estimated_max_micro_batch(workload: Workload, settings: Settings, device: Device, limit: int) -> int | None:
    """The estimator's largest micro-batch up to ``limit`` for these settings on this
    device (None: the device's memory is unknown)."""
    return _estimated_limit(workload, settings, device, limit)[0]


def _estimated_limit(
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


def _group_order(
    precisions: Sequence[Precision], checkpointing: Sequence[Checkpointing], axis: Sequence[Strategy]
) -> list[tuple[Precision, Checkpointing, Strategy]]:
    return [(p, c, strategy) for strategy in axis for c in checkpointing for p in precisions]


def _group(s: Settings) -> tuple[Precision, Checkpointing, Strategy]:
    return (s.precision, s.checkpointing, (s.shard, s.shard_group_size))


@contextmanager
def _rehearsing(
    workload: Workload,
    shape: Settings,
    run_trial: Trial,
    device: Device,
    limit: int | None,
    heaviest: int | None = None,
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
        heaviest = _heaviest_rank_at(workload, shape, device, limit)
    with rehearsal(workload, shape, heaviest):
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


def plan(
    workload: Workload | str,
    target_batch_size: int,
    device: Device | str = "auto",
    *,
    world_size: int = 1,
    precisions: Sequence[Precision] | None = None,
    checkpointing: Sequence[Checkpointing] | None = None,
    shards: Sequence[Shard] | None = None,
    gpus_per_node: int | None = None,
    reference_batch_size: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    predictor: Predictor | None = estimated_max_micro_batch,
    run_trial: Trial = trial,
    progress: Callable[[Candidate], None] | None = None,
    speed_gpu: str | GPU | None = None,
    predict_speed: SpeedPredictor = predicted_speed,
    trials: TrialKind = "auto",
    say: Callable[[str], None] | None = None,
) -> Plan:
    """Find the fastest settings whose micro-batch x accumulation x world size is the target.

    Candidates are every exact split of the target in each precision the device supports,
    each checkpointing mode the model has and, for several ranks, each sharding strategy;
    the estimator discards what cannot fit, candidates a measured one already beats are
    skipped, and short trials measure the rest (for several ranks, a rehearsal of the rank
    holding the most, on a fake process group).

    Args:
        workload: a :class:`memfit.Workload` or a reference, resolved once here.
        target_batch_size: samples per optimizer step over all ranks (at most
            :data:`MAX_TARGET_BATCH`).
        device: where the trials run (see :func:`memfit.device`): one rank's GPU.
        world_size: ranks sharing the target batch.
        precisions: the precisions to consider (default: all the device supports).
        checkpointing: the checkpointing modes to consider (default: all the model has).
        shards: the sharding strategies to consider with ``world_size > 1`` (default: all:
            ``none`` (DDP), ``optimizer`` (ZeRO-1), ``gradients``, ``full`` (FSDP2)).
        gpus_per_node: GPUs per machine; adds hybrid sharding (FSDP2 within a node,
            replicated across nodes) when the world spans several nodes.
        reference_batch_size: the batch the learning rate was tuned for, for advice on
            scaling it.
        headroom: the fraction of the device's memory a recommended candidate leaves free
            (its peak reserved memory is at most ``(1 - headroom)`` of capacity).
        predictor: the largest micro-batch that fits for a group of settings (default:
            the estimator); ``None`` runs every candidate. When it fails, every candidate
            is tried and ``Plan.estimate_error`` says why.
        run_trial: runs one candidate (default: two optimizer steps of one micro-batch).
        progress: called with each candidate after its trial.
        speed_gpu: rank the candidates by their predicted speed on this card of the table
            (default: on a simulated GPU, its card or the documented default; on a real
            GPU, the measured speed ranks).
        predict_speed: the predicted (seconds per step, samples/s) of a candidate on a card.
        trials: ``"auto"`` runs the default trials on fake tensors on a simulated GPU, and
            then the candidates it ranks (at least the recommended one) for real;
            ``"real"`` runs every trial for real (see :mod:`memfit.search.trials`).
        say: receives one line when trials fall back to real runs, and why.

    Raises:
        DoesNotFitError: no candidate fits within the headroom.
        MemfitError: a bad target or headroom; a trial whose loss is NaN or infinite.
    """
    check_target(target_batch_size, world_size)
    check_headroom(headroom)
    if world_size > 1 and distributed.is_distributed():
        raise MemfitError(
            f"plan for {world_size} ranks rehearses one rank on a fake process group in one process; "
            "this one is already in a process group: run it without torchrun"
        )
    wl = load_workload(workload)
    gpu = make_device(device)
    budget = math.floor((1 - headroom) * gpu.capacity) if gpu.capacity else None
    card = _speed_card(gpu, speed_gpu)
    precisions = [
        p for p in (precisions or PRECISIONS) if gpu.supports(p) and (card is None or p != "bf16" or card.bf16)
    ]
    model = wl.build_model()
    checkpointing = list(checkpointing or _checkpointing_modes(model))
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    del model
    axis = strategies(world_size, shards, gpus_per_node)
    pool = candidates(
        target_batch_size, world_size=world_size, precisions=precisions, checkpointing=checkpointing, strategies=axis
    )
    results = {s: Candidate(s, "not run") for s in pool}
    # The one place that chooses what a trial runs: a trial given by the caller as it is,
    # else fake tensors where they stand in for the device (memfit.search.trials).
    on_device = (
        None
        if run_trial is not trial
        else choose_trials(trials, wl, gpu, Settings(world_size=world_size), steps=2, say=say)
    )
    if on_device is not None and on_device.fake:
        fake_trials = on_device
        if predictor is estimated_max_micro_batch:
            # The estimator's search is a series of the same fake runs; a fake trial per
            # candidate, largest first, answers the same question with fewer of them.
            predictor = None

        def run_trial(_wl: Workload, s: Settings, _gpu: Device) -> Measurement:
            assert s.micro_batch_size is not None
            return fake_trials(s.micro_batch_size, s.replace(accumulation_steps=1))

    per_rank = target_batch_size // world_size
    trial_steps = 0
    estimate_error: str | None = None
    speed_error: str | None = None
    failures = _Failures()
    for group in _group_order(precisions, checkpointing, axis):
        members = [s for s in pool if _group(s) == group]
        # A group whose every candidate a measured one already beats costs nothing.
        for s in members:
            if any(o.fits and dominates(o.settings, s) for o in results.values()):
                results[s].status = "dominated"
        if all(results[s].status == "dominated" for s in members):
            continue
        precision, ckpt, (shard, group_size) = group
        shape = Settings(
            precision=precision, checkpointing=ckpt, world_size=world_size, shard=shard, shard_group_size=group_size
        )
        limit = heaviest = None
        if predictor is not None and estimate_error is None:
            try:
                if predictor is estimated_max_micro_batch:
                    # the same trace says which rank peaks highest there (several ranks)
                    limit, heaviest = _estimated_limit(wl, shape, gpu, per_rank)
                else:
                    limit = predictor(wl, shape, gpu, per_rank)
            except Exception as error:  # noqa: BLE001 - the estimate only prunes; trials decide
                # Why go on: an operation fake tensors cannot run (a value read in the
                # step) stops the estimate, not the trials; a bug in the step shows up
                # unchanged in the first trial.
                estimate_error = _one_line(error)
        with _rehearsing(wl, shape, run_trial, gpu, limit, heaviest):
            for s in members:
                c = results[s]
                c.predicted_max_micro_batch = limit
                if c.status != "not run":
                    continue
                if limit is not None and s.micro_batch_size is not None and s.micro_batch_size > limit:
                    c.status = "too large (estimate)"
                    continue
                if any(o.fits and dominates(o.settings, s) for o in results.values()):
                    c.status = "dominated"
                    continue
                c.measurement = failures.run(run_trial, wl, s, gpu)
                trial_steps += 2
                c.status = _status(c.measurement, budget, failures.last_reason)
                if c.fits:
                    assert c.measurement is not None
                    sps = c.measurement.samples_per_second
                    c.samples_per_second = None if sps is None else sps * world_size
                    if card is not None:
                        try:
                            seconds, samples = predict_speed(wl, s, card)
                        except MemfitError as error:
                            # Fake tensors cannot run this step (a value read in forward): no
                            # predicted speed for any candidate; the measured one ranks, and says so.
                            speed_error, card = _one_line(error), None
                        else:
                            c.predicted_seconds_per_step = seconds
                            c.predicted_samples_per_second = samples * world_size
                if progress:
                    progress(c)

    failures.raise_if_every_trial_failed()
    measured = [c for c in results.values() if c.fits]
    if card is None:
        for c in results.values():  # none, or a partial ranking: the measured speed ranks all
            c.predicted_seconds_per_step = c.predicted_samples_per_second = None
    speed = _measured_speed if card is None else _predicted_speed
    if on_device is not None and any(c.measurement is not None and c.measurement.fake for c in measured):
        confirmed = _confirm_on_device(measured, on_device, world_size, budget, progress, speed)
        if confirmed is None:
            again = plan(
                wl,
                target_batch_size,
                gpu,
                world_size=world_size,
                precisions=precisions,
                checkpointing=checkpointing,
                shards=shards,
                gpus_per_node=gpus_per_node,
                reference_batch_size=reference_batch_size,
                headroom=headroom,
                predictor=predictor,
                progress=progress,
                speed_gpu=speed_gpu,
                predict_speed=predict_speed,
                trials="real",
            )
            again.trials_note = on_device.note
            return again
        trial_steps += confirmed
    ordered = list(results.values())
    if not measured:
        raise DoesNotFitError(_nothing_fits_message(target_batch_size, pool, ordered, gpu, headroom, failures))
    best = _recommend(measured, speed)
    chosen = best.settings
    notes = advice(
        target_batch_size=target_batch_size,
        micro_batch_size=chosen.micro_batch_size,
        reference_batch_size=reference_batch_size,
        has_batchnorm=has_batchnorm,
        world_size=world_size,
    )
    if per_rank > 1 and len(divisors(per_rank)) == 2 and chosen.micro_batch_size == 1:
        notes.append(
            f"{per_rank} is prime, so only micro-batch 1 reaches it exactly; a target of "
            f"{(per_rank - 1) * world_size} or {(per_rank + 1) * world_size} allows larger micro-batches."
        )
    if failures.count:
        notes.append(
            f"{failures.count} candidate(s) failed for a reason other than memory and were skipped "
            f"(first: {failures.first_reason})."
        )
    return Plan(
        workload=wl.name,
        device=gpu.spec,
        capacity=gpu.capacity,
        target_batch_size=target_batch_size,
        world_size=world_size,
        candidates=ordered,
        recommended=best,
        reason=_reason(best, measured, gpu, speed, card) + _why_this_strategy(best, ordered, axis),
        advice=notes,
        trial_steps=trial_steps,
        headroom=headroom,
        estimate_error=estimate_error,
        ranked_by="measured" if card is None else "predicted",
        speed_gpu=None if card is None else card.name,
        speed_error=speed_error,
        trials_note=on_device.note if on_device is not None else None,
    )


def _one_line(error: BaseException) -> str:
    """``Type: first line of the message``, for a status or a summary."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class _Failures:
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
        return _one_line(self.first) if self.first is not None else ""

    def run(self, run_trial: Trial, workload: Workload, settings: Settings, device: Device) -> Measurement | None:
        """One trial; None when it failed for a reason other than memory."""
        self.trials += 1
        self.last_reason = None
        failed = False
        try:
            measurement = run_trial(workload, settings, device)
        except Exception as error:
            if is_oom(error):
                raise  # run_trial reports memory as a result; an OOM here is a bug to show
            failed = True
            self.count += 1
            self.last_reason = _one_line(error)
            if self.first is None:
                traceback.clear_frames(error.__traceback__)
                self.first = error
        if failed:
            release_cached_memory()  # outside the except block: the failed step's tensors go
            device.empty_cache()
            return None
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


def _status(measurement: Measurement | None, budget: int | None, failure: str | None) -> str:
    if measurement is None:
        return f"failed: {failure}"
    if not measurement.fits:
        return "out of memory"
    if budget is not None and measurement.peak_reserved > budget:
        return "over headroom"
    return "measured"


def _nothing_fits_message(
    target: int,
    pool: Sequence[Settings],
    ordered: Sequence[Candidate],
    gpu: Device,
    headroom: float,
    failures: _Failures,
) -> str:
    over = [c for c in ordered if c.status == "over headroom" and c.measurement is not None]
    failed = f"; {failures.count} candidate(s) failed for another reason (first: {failures.first_reason})"
    failed = failed if failures.count else ""
    if over:
        least = min(over, key=lambda c: c.measurement.peak_reserved)  # type: ignore[union-attr]
        assert least.measurement is not None and gpu.capacity
        share = least.measurement.peak_reserved / gpu.capacity
        return (
            f"no settings reach batch {target} on {gpu.describe()} within the {headroom:.0%} headroom: "
            f"the least memory, micro-batch {least.settings.micro_batch_size} with {_describe(least.settings)}, "
            f"reserves {share:.1%} of it; lower the headroom or the target{failed}"
        )
    smallest = min(pool, key=lambda s: (s.micro_batch_size, CHECKPOINTING.index(s.checkpointing)))
    return (
        f"no settings reach batch {target} on {gpu.describe()}: even micro-batch "
        f"{smallest.micro_batch_size} with {_describe(smallest)} runs out of memory{failed}"
    )


def _speed_card(gpu: Device, named: str | GPU | None) -> GPU | None:
    """The card whose predicted speed ranks the candidates, or None to rank by measurement."""
    if named is None and not isinstance(gpu, SimDevice):
        return None
    from memfit.estimator.speed import speed_gpu

    if named is not None:
        return speed_gpu(named)
    return speed_gpu(gpu.gpu if isinstance(gpu, SimDevice) else None)


def _confirm_on_device(
    measured: list[Candidate],
    trials: Trials,
    world_size: int,
    budget: int | None,
    progress: Callable[[Candidate], None] | None,
    speed: Callable[[Candidate], float | None],
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
            problem = _one_line(error)
        steps += 2
        if problem is None and (_status(real, budget, None) != "measured" or not real.finite_loss):
            problem = (
                "out of memory" if not real.fits else "over the headroom" if real.finite_loss else "a loss not finite"
            )
        if problem is not None:
            trials.tell(
                f"micro-batch {s.micro_batch_size} in {_describe(s)} fit on fake tensors but ran for real with "
                f"{problem}: the plan ran again on real trials"
            )
            return False
        if c.samples_per_second is None and real.samples_per_second is not None:
            c.samples_per_second = real.samples_per_second * world_size
        c.measurement = real
        if progress:
            progress(c)
        return True

    for c in [c for c in measured if speed(c) is None]:
        if not run_for_real(c):
            return None
    best = _recommend(measured, speed)
    if best.measurement is not None and best.measurement.fake and not run_for_real(best):
        return None
    return steps


def _checkpointing_modes(model: nn.Module) -> list[Checkpointing]:
    """Offer checkpointing only where the model has blocks to checkpoint."""
    supported = getattr(model, "supports_gradient_checkpointing", False) or bool(find_blocks(model))
    return list(CHECKPOINTING) if supported else ["none"]


def _recommend(
    measured: Sequence[Candidate], speed: Callable[[Candidate], float | None] = _measured_speed
) -> Candidate:
    """The fastest; among those within SPEED_TOLERANCE of it, the one that shards least
    (its communication, which neither a rehearsal's time nor the prediction counts, is the
    least), then the one using least memory."""
    fastest = max(speed(c) or 0.0 for c in measured)
    close = [c for c in measured if (speed(c) or 0.0) >= fastest * (1 - SPEED_TOLERANCE)]
    return min(close, key=lambda c: (_cost(c.settings), c.measurement.peak_reserved))  # type: ignore[union-attr]


def _describe(s: Settings) -> str:
    ckpt = ", activation checkpointing" if s.checkpointing == "blocks" else ""
    ranks = f", {describe(s.shard, s.world_size, s.shard_group_size)}" if s.world_size > 1 else ""
    return f"{s.precision}{ckpt}{ranks}"


def _why_this_strategy(best: Candidate, candidates: Sequence[Candidate], axis: Sequence[Strategy]) -> str:
    """Why the recommendation shards as it does: what the strategies that shard less could not do."""
    s = best.settings
    if s.world_size <= 1:
        return ""
    mine = strategy_cost((s.shard, s.shard_group_size))
    lines = []
    for strategy in axis:
        if strategy_cost(strategy) >= mine:
            break
        group = [c for c in candidates if (c.settings.shard, c.settings.shard_group_size) == strategy]
        name = describe(strategy[0], s.world_size, strategy[1])
        if any(c.fits for c in group):
            lines.append(f"{name} fits but is slower")
            continue
        predicted = [c.predicted_max_micro_batch for c in group if c.predicted_max_micro_batch is not None]
        if predicted and max(predicted) == 0:
            lines.append(f"{name} does not fit even at micro-batch 1 (estimate, per rank)")
        else:
            lines.append(f"{name} does not fit at any micro-batch tried")
    if not lines:
        return f" Strategy: {describe(s.shard, s.world_size, s.shard_group_size)}, the least sharding."
    return f" Strategy: {describe(s.shard, s.world_size, s.shard_group_size)}, because " + "; ".join(lines) + "."


def _reason(
    best: Candidate,
    measured: Sequence[Candidate],
    gpu: Device,
    speed: Callable[[Candidate], float | None] = _measured_speed,
    card: GPU | None = None,
) -> str:
    s = best.settings
    assert best.measurement is not None
    memory = format_size(best.measurement.peak_reserved)
    if gpu.capacity:
        memory += f" of {format_size(gpu.capacity)}"
    others = len(measured) - 1
    value = speed(best)
    rate = f"{value:.1f} samples/s" if value else "the best speed"
    if card is not None and value:
        rate = f"{rate} predicted on the {card.name}"
    return (
        f"micro-batch {s.micro_batch_size} x {s.accumulation_steps} accumulation step(s) in {_describe(s)} "
        f"is the fastest of {others + 1} setting(s) that fit ({rate}, peak {memory} reserved)"
        + (" and uses the least memory of those within 2% of it." if others else ".")
    )
