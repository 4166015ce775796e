"""What a plan says: why it recommends what it does, its advice, and why nothing fits.

Sentences only; the numbers come from the candidates (:mod:`memfit.search.candidates`)
and their trials (:mod:`memfit.search.plan_trials`).
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.memory.devices import Device
from memfit.memory.gpus import GPU
from memfit.run.checkpointing import recompute_order
from memfit.run.settings import Settings
from memfit.run.strategy import describe
from memfit.search.candidates import (
    Candidate,
    PlanRequest,
    Speed,
    Strategy,
    describe_settings,
    divisors,
    measured_speed,
    strategy_cost,
)
from memfit.search.plan_trials import Failures
from memfit.units import format_size

__all__ = ["advice"]


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


def plan_advice(request: PlanRequest, chosen: Settings, failures: Failures) -> list[str]:
    """:func:`advice` for the chosen settings, and what the plan itself noticed: a prime
    target, candidates that failed for a reason other than memory."""
    per_rank, world_size = request.per_rank, request.world_size
    notes = advice(
        target_batch_size=request.target_batch_size,
        micro_batch_size=chosen.micro_batch_size,
        reference_batch_size=request.reference_batch_size,
        has_batchnorm=request.has_batchnorm,
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
    return notes


def nothing_fits_message(request: PlanRequest, ordered: Sequence[Candidate], failures: Failures) -> str:
    """Why no candidate reaches the target: the least memory over the headroom, or the
    smallest candidate out of memory."""
    target, gpu = request.target_batch_size, request.device
    over = [c for c in ordered if c.status == "over headroom" and c.measurement is not None]
    failed = f"; {failures.count} candidate(s) failed for another reason (first: {failures.first_reason})"
    failed = failed if failures.count else ""
    if over:
        least = min(over, key=lambda c: c.measurement.peak_reserved)  # type: ignore[union-attr]
        assert least.measurement is not None and gpu.capacity
        share = least.measurement.peak_reserved / gpu.capacity
        return (
            f"no settings reach batch {target} on {gpu.describe()} within the {request.headroom:.0%} headroom: "
            f"the least memory, micro-batch {least.settings.micro_batch_size} with "
            f"{describe_settings(least.settings)}, reserves {share:.1%} of it; lower the headroom or the target{failed}"
        )
    smallest = min((c.settings for c in ordered), key=lambda s: (s.micro_batch_size, recompute_order(s.checkpointing)))
    return (
        f"no settings reach batch {target} on {gpu.describe()}: even micro-batch "
        f"{smallest.micro_batch_size} with {describe_settings(smallest)} runs out of memory{failed}"
    )


def why_this_strategy(best: Candidate, candidates: Sequence[Candidate], axis: Sequence[Strategy]) -> str:
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


def reason(
    best: Candidate,
    measured: Sequence[Candidate],
    gpu: Device,
    speed: Speed = measured_speed,
    card: GPU | None = None,
) -> str:
    """Why ``best``: the fastest of those that fit, at what speed (on which card) and memory."""
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
        f"micro-batch {s.micro_batch_size} x {s.accumulation_steps} accumulation step(s) in {describe_settings(s)} "
        f"is the fastest of {others + 1} setting(s) that fit ({rate}, peak {memory} reserved)"
        + (" and uses the least memory of those within 2% of it." if others else ".")
    )
