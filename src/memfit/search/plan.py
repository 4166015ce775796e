"""memfit plan: the fastest settings that reach a target batch within memory.

The field's advice, automated: when the batch you want does not fit, turn on mixed
precision, gradient accumulation or activation checkpointing, and keep the combination
that trains fastest. Candidates are every ``micro_batch x accumulation_steps x world_size
== target`` with each precision (fp32, bf16 where the device has it, fp16 with a
GradScaler) and each checkpointing mode (none, blocks).

The search, cheapest evidence first:

1. within one precision, a candidate is *dominated* by a measured one with a micro-batch
   at least as large and no more recomputation (the same work in fewer, larger
   kernels, without recompute, is not slower); dominated candidates are not run, and a
   group (precision, checkpointing) of dominated candidates costs nothing at all;
2. for each other group, the estimator (fake tensors, no memory, no arithmetic) gives
   the largest micro-batch that fits; larger ones are discarded;
3. the rest are run as short trials (two optimizer steps of one micro-batch) from the
   most promising down; a trial that runs out of memory moves to the next smaller
   micro-batch of its group.

samples/s of a candidate is ``micro_batch / seconds per trial step`` on one device (times
the world size): a trial step holds one micro-batch and one optimizer step, so it
slightly favours larger micro-batches, which is also what accumulation rewards.

>>> [c.micro_batch_size for c in candidates(12, precisions=["fp32"], checkpointing=["none"])]
[12, 6, 4, 3, 2, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memfit._html import HtmlRepr
from memfit.errors import DoesNotFitError, MemfitError
from memfit.memory.devices import Device
from memfit.memory.devices import device as make_device
from memfit.run.measure import Measurement, measure
from memfit.run.settings import CHECKPOINTING, PRECISIONS, Checkpointing, Precision, Settings, find_blocks
from memfit.units import format_size
from memfit.workload import Workload, load_workload

__all__ = [
    "plan",
    "Plan",
    "Candidate",
    "candidates",
    "divisors",
    "dominates",
    "pareto_front",
    "advice",
]

#: how much faster one setting must be to be called faster, not noise
SPEED_TOLERANCE = 0.02


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, largest first."""
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def candidates(
    target_batch_size: int,
    *,
    world_size: int = 1,
    precisions: Sequence[Precision] = PRECISIONS,
    checkpointing: Sequence[Checkpointing] = CHECKPOINTING,
) -> list[Settings]:
    """Every Settings whose micro-batch x accumulation x world size is the target exactly.

    Why exact: a plan that changes the global batch changes the training (learning-rate
    schedule, convergence), which is the user's decision, not memfit's.
    """
    if target_batch_size < 1:
        raise MemfitError(f"invalid target batch {target_batch_size}: must be at least 1")
    if world_size < 1:
        raise MemfitError(f"invalid world size {world_size}: must be at least 1")
    if target_batch_size % world_size:
        raise MemfitError(
            f"target batch {target_batch_size} cannot be split over {world_size} processes: "
            f"choose a multiple of {world_size}, such as {_nearest_multiple(target_batch_size, world_size)}"
        )
    per_rank = target_batch_size // world_size
    return [
        Settings(precision=p, checkpointing=c, micro_batch_size=m, accumulation_steps=per_rank // m)
        for p in precisions
        for c in checkpointing
        for m in divisors(per_rank)
    ]


def _nearest_multiple(n: int, k: int) -> int:
    down = n - n % k
    return down if down >= k else k


def dominates(a: Settings, b: Settings) -> bool:
    """True when ``a`` is at least as fast as ``b`` by construction: the same precision, a
    micro-batch at least as large, and no more recomputation."""
    assert a.micro_batch_size is not None and b.micro_batch_size is not None
    return (
        a.precision == b.precision
        and a.micro_batch_size >= b.micro_batch_size
        and CHECKPOINTING.index(a.checkpointing) <= CHECKPOINTING.index(b.checkpointing)
        and a != b
    )


@dataclass
class Candidate:
    """One candidate and what the plan learnt about it."""

    settings: Settings
    #: "measured", "out of memory", "too large (estimate)", "dominated", "not run"
    status: str
    predicted_max_micro_batch: int | None = None
    measurement: Measurement | None = None
    samples_per_second: float | None = None

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
            "predicted_max_micro_batch": self.predicted_max_micro_batch,
        }


def pareto_front(measured: Sequence[Candidate]) -> list[Candidate]:
    """The measured candidates no other beats on both memory (lower) and speed (higher)."""
    front = []
    for c in measured:
        assert c.measurement is not None and c.samples_per_second is not None
        beaten = any(
            o is not c
            and o.measurement is not None
            and o.samples_per_second is not None
            and o.measurement.peak_reserved <= c.measurement.peak_reserved
            and o.samples_per_second >= c.samples_per_second
            and (
                o.measurement.peak_reserved < c.measurement.peak_reserved or o.samples_per_second > c.samples_per_second
            )
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

    @property
    def pareto(self) -> list[Candidate]:
        return pareto_front([c for c in self.candidates if c.fits])

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
            "pareto": [c.to_dict() for c in self.pareto],
            "candidates": [c.to_dict() for c in self.candidates],
        }


#: (workload, settings, device, largest micro-batch of interest) -> largest that fits, or None
Predictor = Callable[[Workload, Settings, Device, int], "int | None"]
Trial = Callable[[Workload, Settings, Device], Measurement]


def estimated_max_micro_batch(workload: Workload, settings: Settings, device: Device, limit: int) -> int | None:
    """The estimator's largest micro-batch up to ``limit`` for these settings on this
    device (None: the device's memory is unknown)."""
    if device.capacity is None:
        return None
    from memfit.estimator.estimate import estimate

    probe_settings = settings.replace(micro_batch_size=None, accumulation_steps=1)
    return estimate(workload, None, probe_settings, device=device, search_limit=limit).max_batch_size


def trial(workload: Workload, settings: Settings, device: Device) -> Measurement:
    """Two optimizer steps of one micro-batch: memory and speed of the candidate."""
    assert settings.micro_batch_size is not None
    return measure(workload, settings.micro_batch_size, device, settings.replace(accumulation_steps=1), steps=2)


def _group_order(
    precisions: Sequence[Precision], checkpointing: Sequence[Checkpointing]
) -> list[tuple[Precision, Checkpointing]]:
    return [(p, c) for c in checkpointing for p in precisions]


def plan(
    workload: Workload | str,
    target_batch_size: int,
    device: Device | str = "auto",
    *,
    world_size: int = 1,
    precisions: Sequence[Precision] | None = None,
    checkpointing: Sequence[Checkpointing] | None = None,
    reference_batch_size: int | None = None,
    predictor: Predictor | None = estimated_max_micro_batch,
    run_trial: Trial = trial,
    progress: Callable[[Candidate], None] | None = None,
) -> Plan:
    """Find the fastest settings whose micro-batch x accumulation x world size is the target.

    Candidates are every exact split of the target in each precision the device supports
    and each checkpointing mode the model has; the estimator discards what cannot fit,
    candidates a measured one already beats are skipped, and short trials measure the rest.

    Args:
        workload: a :class:`memfit.Workload` or a reference, resolved once here.
        target_batch_size: samples per optimizer step over all ranks.
        device: where the trials run (see :func:`memfit.device`).
        world_size: ranks sharing the target batch.
        precisions: the precisions to consider (default: all the device supports).
        checkpointing: the checkpointing modes to consider (default: all the model has).
        reference_batch_size: the batch the learning rate was tuned for, for advice on
            scaling it.
        predictor: the largest micro-batch that fits for a group of settings (default:
            the estimator); ``None`` runs every candidate.
        run_trial: runs one candidate (default: two optimizer steps of one micro-batch).
        progress: called with each candidate after its trial.

    Raises:
        DoesNotFitError: no candidate fits.
    """
    wl = load_workload(workload)
    gpu = make_device(device)
    precisions = [p for p in (precisions or PRECISIONS) if gpu.supports(p)]
    model = wl.build_model()
    checkpointing = list(checkpointing or _checkpointing_modes(model))
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    del model
    pool = candidates(target_batch_size, world_size=world_size, precisions=precisions, checkpointing=checkpointing)
    results = {s: Candidate(s, "not run") for s in pool}

    per_rank = target_batch_size // world_size
    trial_steps = 0
    for group in _group_order(precisions, checkpointing):
        members = [s for s in pool if (s.precision, s.checkpointing) == group]
        # A group whose every candidate a measured one already beats costs nothing.
        for s in members:
            if any(o.fits and dominates(o.settings, s) for o in results.values()):
                results[s].status = "dominated"
        if all(results[s].status == "dominated" for s in members):
            continue
        limit = (
            predictor(wl, Settings(precision=group[0], checkpointing=group[1]), gpu, per_rank) if predictor else None
        )
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
            c.measurement = run_trial(wl, s, gpu)
            trial_steps += 2
            if c.measurement.fits:
                c.status = "measured"
                sps = c.measurement.samples_per_second
                c.samples_per_second = None if sps is None else sps * world_size
            else:
                c.status = "out of memory"
            if progress:
                progress(c)

    measured = [c for c in results.values() if c.fits]
    ordered = list(results.values())
    if not measured:
        smallest = min(pool, key=lambda s: (s.micro_batch_size, CHECKPOINTING.index(s.checkpointing)))
        raise DoesNotFitError(
            f"no settings reach batch {target_batch_size} on {gpu.describe()}: even micro-batch "
            f"{smallest.micro_batch_size} with {_describe(smallest)} runs out of memory"
        )
    best = _recommend(measured)
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
    return Plan(
        workload=wl.name,
        device=gpu.spec,
        capacity=gpu.capacity,
        target_batch_size=target_batch_size,
        world_size=world_size,
        candidates=ordered,
        recommended=best,
        reason=_reason(best, measured, gpu),
        advice=notes,
        trial_steps=trial_steps,
    )


def _checkpointing_modes(model: nn.Module) -> list[Checkpointing]:
    """Offer checkpointing only where the model has blocks to checkpoint."""
    supported = getattr(model, "supports_gradient_checkpointing", False) or bool(find_blocks(model))
    return list(CHECKPOINTING) if supported else ["none"]


def _recommend(measured: Sequence[Candidate]) -> Candidate:
    """The fastest; among those within SPEED_TOLERANCE of it, the one using least memory."""
    fastest = max(c.samples_per_second or 0.0 for c in measured)
    close = [c for c in measured if (c.samples_per_second or 0.0) >= fastest * (1 - SPEED_TOLERANCE)]
    return min(close, key=lambda c: c.measurement.peak_reserved)  # type: ignore[union-attr]


def _describe(s: Settings) -> str:
    ckpt = ", activation checkpointing" if s.checkpointing == "blocks" else ""
    return f"{s.precision}{ckpt}"


def _reason(best: Candidate, measured: Sequence[Candidate], gpu: Device) -> str:
    s = best.settings
    assert best.measurement is not None
    memory = format_size(best.measurement.peak_reserved)
    if gpu.capacity:
        memory += f" of {format_size(gpu.capacity)}"
    others = len(measured) - 1
    speed = f"{best.samples_per_second:.1f} samples/s" if best.samples_per_second else "the best speed"
    return (
        f"micro-batch {s.micro_batch_size} x {s.accumulation_steps} accumulation step(s) in {_describe(s)} "
        f"is the fastest of {others + 1} setting(s) that fit ({speed}, peak {memory} reserved)"
        + (" and uses the least memory of those within 2% of it." if others else ".")
    )
