"""A plan's candidates: the axes, every exact split of the target, dominance and the Pareto front.

Pure bookkeeping, no trial runs here (:mod:`memfit.search.plan_trials` runs them). A
candidate is a :class:`~memfit.run.settings.Settings` whose ``micro_batch x
accumulation_steps x world_size`` is the target exactly, in one precision, one
checkpointing mode and, for several ranks, one sharding strategy; a *group* is the
candidates that share those three and differ only in the micro-batch.

>>> [c.micro_batch_size for c in candidates(12, precisions=["fp32"], checkpointing=["none"])]
[12, 6, 4, 3, 2, 1]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from memfit.errors import MemfitError
from memfit.memory.devices import Device
from memfit.memory.gpus import GPU
from memfit.run.checkpointing import BUDGET, describe_modules, recompute_order, recomputes_no_more
from memfit.run.measure import Measurement
from memfit.run.settings import CHECKPOINTING, PRECISIONS, Checkpointing, Precision, Settings, find_blocks
from memfit.run.strategy import OFFLOAD_SHARDS, SHARDS, Shard, check_strategy, describe
from memfit.workload import Workload

__all__ = [
    "Candidate",
    "PlanRequest",
    "candidates",
    "check_target",
    "MAX_TARGET_BATCH",
    "SPEED_TOLERANCE",
    "divisors",
    "dominates",
    "pareto_front",
    "strategies",
    "strategy_cost",
    "Strategy",
    "CheckpointingAxis",
    "checkpointing_axis",
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


def _nearest_multiple(n: int, k: int) -> int:
    down = n - n % k
    return down if down >= k else k


#: a sharding strategy: (shard, shard group size or None)
Strategy = tuple[Shard, "int | None"]
#: a group of candidates: (precision, checkpointing, strategy); they differ in the micro-batch only
Group = tuple[Precision, Checkpointing, Strategy]


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
    # CPU offload is the fallback when nothing else fits (memfit.search.offload_plan), unless asked for
    chosen = list(shards or [shard for shard in SHARDS if shard not in OFFLOAD_SHARDS])
    found: list[Strategy] = [(shard, None) for shard in chosen]
    if gpus_per_node is not None and 1 < gpus_per_node < world_size and world_size % gpus_per_node == 0:
        found += [(shard, gpus_per_node) for shard in chosen if shard in ("gradients", "full")]
    return sorted(found, key=strategy_cost)


def strategy_cost(strategy: Strategy) -> int:
    """Communication, least first: DDP, ZeRO-1 (adds a parameter broadcast), hybrid sharding
    (all-gathers within a node), FSDP2 across every rank; keeping full parameters from
    forward to backward saves backward's all-gathers."""
    shard, group = strategy
    base = {"none": 0, "optimizer": 1, "gradients": 2, "full": 3, "offload": 6}[shard]
    return base if shard in ("none", "optimizer", "offload") or group is not None else base + 2


def sharding_cost(s: Settings) -> int:
    """:func:`strategy_cost` of the settings' strategy (0 for one rank)."""
    return strategy_cost((s.shard, s.shard_group_size)) if s.world_size > 1 or s.shard in OFFLOAD_SHARDS else 0


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


def describe_settings(s: Settings) -> str:
    """Precision, checkpointing and strategy in words: ``bf16, activation checkpointing, FSDP2 ...``."""
    ckpt = {"none": "", "blocks": ", activation checkpointing"}.get(
        s.checkpointing, f", checkpointing {s.checkpointing}"
    )
    shown = s.world_size > 1 or s.shard in OFFLOAD_SHARDS
    ranks = f", {describe(s.shard, s.world_size, s.shard_group_size)}" if shown else ""
    return f"{s.precision}{ckpt}{ranks}"


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for, checked and resolved once where it enters
    (:func:`memfit.search.plan.plan`): the workload and device, the target, the axes of
    its candidates, the headroom and the card whose predicted speed ranks them."""

    workload: Workload
    device: Device
    target_batch_size: int
    world_size: int
    #: the precisions the device (and the speed card) can run, of those asked for
    precisions: tuple[Precision, ...]
    checkpointing: tuple[Checkpointing, ...]
    #: the sharding strategies, least communication first (:func:`strategies`)
    axis: tuple[Strategy, ...]
    headroom: float
    reference_batch_size: int | None = None
    has_batchnorm: bool = False
    #: the card whose predicted speed ranks the candidates (None: the measured speed ranks)
    card: GPU | None = None
    #: weigh the candidates under CPU offload when none fits (the strategies were not chosen)
    offload_fallback: bool = True
    #: checkpointing modes shown but not weighed, and why (:func:`checkpointing_axis`)
    dropped: tuple[tuple[Checkpointing, str], ...] = ()

    @property
    def per_rank(self) -> int:
        """Samples per optimizer step on one rank."""
        return self.target_batch_size // self.world_size

    @property
    def budget(self) -> int | None:
        """The most a recommended candidate may reserve: ``(1 - headroom)`` of the device (None: no limit)."""
        capacity = self.device.capacity
        return math.floor((1 - self.headroom) * capacity) if capacity else None

    def pool(self) -> list[Settings]:
        """Every candidate of the request (:func:`candidates`), those of the dropped
        checkpointing modes included (shown, never weighed)."""
        return candidates(
            self.target_batch_size,
            world_size=self.world_size,
            precisions=self.precisions,
            checkpointing=self.checkpointing + tuple(mode for mode, _ in self.dropped),
            strategies=self.axis,
        )

    def initial_status(self, s: Settings) -> str:
        """``not run``, or why a dropped checkpointing mode is not weighed."""
        return dict(self.dropped).get(s.checkpointing, "not run")

    def groups(self) -> list[Group]:
        """The groups in the order a plan weighs them: least sharding first, then least
        recomputation, then the precisions as given."""
        return [(p, c, strategy) for strategy in self.axis for c in self.checkpointing for p in self.precisions]


def group_of(s: Settings) -> Group:
    return (s.precision, s.checkpointing, (s.shard, s.shard_group_size))


def checkpointing_modes(model: nn.Module) -> list[Checkpointing]:
    """Offer checkpointing only where the model may have blocks to checkpoint: a
    transformers model, or modules of one class that hold modules (a static look; the
    run decides, :func:`checkpointing_axis`)."""
    supported = getattr(model, "supports_gradient_checkpointing", False) or bool(find_blocks(model))
    if not supported:
        kinds: dict[type, int] = {}
        for m in model.modules():
            if m is not model and any(True for _ in m.children()) and not isinstance(m, _CONTAINERS):
                kinds[type(m)] = kinds.get(type(m), 0) + 1
        supported = any(n >= 2 for n in kinds.values())
    return list(CHECKPOINTING) if supported else ["none"]


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

#: the most ``first:N`` members a ``budget`` axis adds (besides ``blocks``)
BUDGET_STEPS = 3


@dataclass(frozen=True)
class CheckpointingAxis:
    """The checkpointing modes a plan weighs, least recomputation first, and those it
    shows but drops (a mode that saves nothing), with why."""

    modes: tuple[Checkpointing, ...]
    dropped: tuple[tuple[Checkpointing, str], ...] = ()


def checkpointing_axis(
    workload: Workload,
    asked: Sequence[Checkpointing] | None,
    model: nn.Module,
    micro_batch: int,
    *,
    check: bool = True,
) -> CheckpointingAxis:
    """The modes to weigh: those asked for (default: :func:`checkpointing_modes`), with
    ``budget`` made ``first:N`` steps up to ``blocks`` (recompute as few blocks as fit), and
    every mode whose fake step at ``micro_batch`` holds no less memory than without
    checkpointing dropped (status "saves nothing (6 x Linear)": the peak is elsewhere, or
    no block runs).

    Why fake steps: shapes only, so the check costs no device memory and a second at
    most; where the model cannot run on fake tensors the modes are weighed as asked.

    Args:
        workload: the plan's workload.
        asked: the modes the user gave (None: the model's default modes).
        model: one model of the workload (for the default modes).
        micro_batch: the micro-batch the check runs at (the largest the plan considers).
        check: drop the modes that save nothing (False: only ``budget`` is resolved, for
            a plan whose caller measures memory its own way).
    """
    from memfit.estimator.fake import UnsupportedOperation, run_fake_steps

    modes = list(asked or checkpointing_modes(model))
    if modes == ["none"]:
        return CheckpointingAxis(("none",))

    def peak(mode: str) -> tuple[int, list[tuple[str, str]]]:
        run = run_fake_steps(workload, Settings(micro_batch_size=micro_batch, checkpointing=mode), steps=1)
        return run.peak_allocated, run.checkpointed

    try:
        plain = peak("none")[0] if check else 0
        if BUDGET in modes:
            modes = _budget_steps(modes, len(peak("blocks")[1]))
        dropped: list[tuple[str, str]] = []
        for mode in [m for m in modes if m != "none" and check]:
            try:
                held, done = peak(mode)
            except MemfitError:  # no block runs: asked for, a user error; by default, dropped
                if asked:
                    raise
                dropped.append((mode, "saves nothing (no blocks run)"))
                continue
            if held >= plain:
                what = describe_modules(done) or "nothing"
                dropped.append((mode, f"saves nothing ({what})"))
    except UnsupportedOperation:  # without a block count, the budget's one sure step: every block
        weighed = dict.fromkeys("blocks" if m == BUDGET else m for m in modes)
        return CheckpointingAxis(tuple(sorted(weighed, key=recompute_order)))
    gone = {mode for mode, _ in dropped}
    kept = sorted((m for m in dict.fromkeys(modes) if m not in gone), key=recompute_order)
    return CheckpointingAxis(tuple(kept), tuple(dropped))


def _budget_steps(modes: list[str], blocks: int) -> list[str]:
    """``budget`` as ``first:N`` for up to :data:`BUDGET_STEPS` block counts, then ``blocks``."""
    counts = sorted({max(1, round(blocks * i / (BUDGET_STEPS + 1))) for i in range(1, BUDGET_STEPS + 1)} - {blocks})
    steps = [f"first:{n}" for n in counts if n < blocks] + ["blocks"]
    out: list[str] = []
    for m in modes:
        out.extend(steps if m == BUDGET else [m])
    return list(dict.fromkeys(out))


def dominates(a: Settings, b: Settings) -> bool:
    """True when ``a`` is at least as fast as ``b`` by construction: the same precision, a
    micro-batch at least as large, no more recomputation and no more sharding."""
    assert a.micro_batch_size is not None and b.micro_batch_size is not None
    return (
        a.precision == b.precision
        and a.micro_batch_size >= b.micro_batch_size
        and recomputes_no_more(a.checkpointing, b.checkpointing)
        and sharding_cost(a) <= sharding_cost(b)
        and a != b
    )


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
    #: the predicted step on the plan's card (see memfit.search.plan): what ranks a simulated GPU's candidates
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


#: the speed that ranks candidates: measured (a real GPU) or predicted (on the plan's card)
Speed = Callable[[Candidate], "float | None"]


def measured_speed(c: Candidate) -> float | None:
    return c.samples_per_second


def predicted_speed_of(c: Candidate) -> float | None:
    return c.predicted_samples_per_second


def pareto_front(measured: Sequence[Candidate], speed: Speed = measured_speed) -> list[Candidate]:
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


def recommended_candidate(measured: Sequence[Candidate], speed: Speed = measured_speed) -> Candidate:
    """The fastest; among those within SPEED_TOLERANCE of it, the one that shards least
    (its communication, which neither a rehearsal's time nor the prediction counts, is the
    least), then the one using least memory."""
    fastest = max(speed(c) or 0.0 for c in measured)
    close = [c for c in measured if (speed(c) or 0.0) >= fastest * (1 - SPEED_TOLERANCE)]
    return min(close, key=lambda c: (sharding_cost(c.settings), c.measurement.peak_reserved))  # type: ignore[union-attr]
