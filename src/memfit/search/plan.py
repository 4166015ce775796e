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

When nothing fits on the GPU alone (and the strategies were not given), the same splits are
weighed under CPU offload (:mod:`memfit.search.offload_plan`), with the checkpointing modes
dropped for saving nothing on the GPU alone weighed again: that check saw a step whose peak
the optimizer's states may set, and offload moves those to the host.

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

Where each part lives: the candidates, their groups, dominance and the Pareto front in
:mod:`memfit.search.candidates`; the estimator's limit, the trials, failures and the
confirmation on the device in :mod:`memfit.search.plan_trials`; the reason, the advice
and "nothing fits" in :mod:`memfit.search.plan_text`. This module holds the entry point:
:func:`plan` checks and resolves its arguments once into a
:class:`~memfit.search.candidates.PlanRequest`, then weighs the groups in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from memfit import distributed
from memfit._html import HtmlRepr
from memfit.errors import DoesNotFitError, MemfitError
from memfit.memory.devices import Device, SimDevice
from memfit.memory.devices import device as make_device
from memfit.memory.gpus import GPU
from memfit.run.checkpointing import recompute_order
from memfit.run.host_memory import check_host_memory, host_refusal
from memfit.run.measure import Measurement
from memfit.run.settings import PRECISIONS, Checkpointing, Precision, Settings
from memfit.run.state import preserved_workload
from memfit.run.strategy import OFFLOAD_SHARDS, Shard
from memfit.search.candidates import (
    Candidate,
    Group,
    PlanRequest,
    Speed,
    check_target,
    checkpointing_axis,
    dominates,
    group_of,
    measured_speed,
    pareto_front,
    predicted_speed_of,
    recommended_candidate,
    strategies,
)
from memfit.search.headroom import DEFAULT_HEADROOM, check_headroom
from memfit.search.offload_plan import OffloadTrials, allocator_advice, needs_estimated_trials, offload_axis
from memfit.search.plan_text import nothing_fits_message, plan_advice, reason, why_this_strategy
from memfit.search.plan_trials import (
    Failures,
    Predictor,
    Progress,
    SpeedPredictor,
    Trial,
    confirm_on_device,
    estimated_limit,
    estimated_max_micro_batch,
    one_line,
    predicted_speed,
    rehearsing,
    speed_card,
    status_of,
    trial,
    unranked_refusal,
)
from memfit.search.trials import TrialKind, Trials, choose_trials
from memfit.workload import Workload, load_workload

__all__ = ["plan", "Plan", "PlanHooks"]


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
        speed = predicted_speed_of if self.ranked_by == "predicted" else measured_speed
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


@dataclass(frozen=True)
class PlanHooks:
    """How a plan learns about its candidates (the seams of :func:`plan`'s keywords)."""

    #: the largest micro-batch that fits for a group of settings (None: run every candidate)
    predictor: Predictor | None = estimated_max_micro_batch
    run_trial: Trial = trial
    progress: Progress | None = None
    predict_speed: SpeedPredictor = predicted_speed
    #: receives one line when trials fall back to real runs, and why
    say: Callable[[str], None] | None = None


@dataclass
class _Ledger:
    """What the plan has learnt so far: each candidate, the trials run, what could not run."""

    results: dict[Settings, Candidate]
    #: the card whose predicted speed ranks (None once a prediction failed: the measured speed ranks)
    card: GPU | None
    failures: Failures = field(default_factory=Failures)
    trial_steps: int = 0
    estimate_error: str | None = None
    speed_error: str | None = None
    #: the CPU offload fallback's trials, when nothing fit on the GPU alone
    offload: OffloadTrials | None = None


def _offload_fallback(
    request: PlanRequest, hooks: PlanHooks, ledger: _Ledger, on_device: Trials | None
) -> OffloadTrials | None:
    """Nothing fits on the GPU alone: weigh the same splits under CPU offload, with memfit's
    own trials on a simulated GPU by the estimator's (:mod:`memfit.search.offload_plan`);
    a caller's ``run_trial`` runs them as it runs every candidate."""
    if not request.offload_fallback or any(c.fits for c in ledger.results.values()):
        return None
    if any(shard in OFFLOAD_SHARDS for shard, _ in request.axis):
        return None
    offload = replace(request, axis=offload_axis(), **_offload_checkpointing(request))
    trials = OffloadTrials(card=ledger.card)
    if on_device is not None and needs_estimated_trials(request.device):
        hooks = replace(hooks, predictor=None, run_trial=trials.trial, predict_speed=trials.predict)
    for s in offload.pool():
        ledger.results.setdefault(s, Candidate(s, "not run"))
    for group in offload.groups():
        _weigh_group(offload, hooks, ledger, group)
    return trials


def _offload_checkpointing(request: PlanRequest) -> dict[str, Any]:
    """The checkpointing modes the offload fallback weighs: those the plan dropped for saving
    nothing on the GPU alone are weighed again. Why: that check compares the whole step's
    peak on the GPU, which the optimizer step's states may set; under offload those states
    live on the host and the activations checkpointing drops may be the GPU's peak. A mode
    with no blocks that run stays dropped."""
    again = tuple(mode for mode, why in request.dropped if why != "saves nothing (no blocks run)")
    if not again:
        return {}
    modes = tuple(sorted(dict.fromkeys(request.checkpointing + again), key=recompute_order))
    return {"checkpointing": modes, "dropped": tuple((m, why) for m, why in request.dropped if m not in again)}


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
    offload: bool = True,
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
            ``none`` (DDP), ``optimizer`` (ZeRO-1), ``gradients``, ``full`` (FSDP2), and
            when none of those fits, at any world size, ``offload`` (FSDP2 with
            CPUOffloadPolicy: :mod:`memfit.search.offload_plan`)); given, only those.
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
        offload: when nothing fits and ``shards`` is not given, weigh the candidates under
            CPU offload (``shard="offload"``).

    Raises:
        DoesNotFitError: no candidate fits within the headroom.
        MemfitError: a bad target or headroom; a trial whose loss is NaN or infinite.
    """
    wl = load_workload(workload)
    if trials == "real" and run_trial is trial:
        check_host_memory(make_device(device), wl)  # refused before the candidates' checks run fake steps
    # Nothing of the caller's changes: a model instance, its optimizer, every RNG (the
    # candidates' models are built from the caller's streams), success or error.
    with preserved_workload(wl) as preserved:
        request = _resolve(
            preserved,
            target_batch_size,
            device,
            world_size=world_size,
            precisions=precisions,
            checkpointing=checkpointing,
            strategy_axis=(shards, gpus_per_node),
            reference_batch_size=reference_batch_size,
            headroom=headroom,
            speed_gpu=speed_gpu,
            # the estimator says what checkpointing saves, unless the caller measures otherwise
            check_savings=predictor is estimated_max_micro_batch and run_trial is trial,
        )
        request = replace(request, offload_fallback=request.offload_fallback and offload)
        return _plan(request, PlanHooks(predictor, run_trial, progress, predict_speed, say), trials)


def _resolve(
    wl: Workload,
    target_batch_size: int,
    device: Device | str,
    *,
    world_size: int,
    precisions: Sequence[Precision] | None,
    checkpointing: Sequence[Checkpointing] | None,
    strategy_axis: tuple[Sequence[Shard] | None, int | None],
    reference_batch_size: int | None,
    headroom: float,
    speed_gpu: str | GPU | None,
    check_savings: bool = True,
) -> PlanRequest:
    """Check the arguments (one line each, before any work) and resolve them into a request."""
    check_target(target_batch_size, world_size)
    check_headroom(headroom)
    if world_size > 1 and distributed.is_distributed():
        raise MemfitError(
            f"plan for {world_size} ranks rehearses one rank on a fake process group in one process; "
            "this one is already in a process group: run it without torchrun"
        )
    gpu = make_device(device)
    # A model instance comes with the script's own optimizer, bound to its real parameters:
    # the fake steps of a predicted speed must not step it (as probe's guess does not).
    card = speed_card(gpu, speed_gpu) if wl.builds_fresh_models else None
    usable = [p for p in (precisions or PRECISIONS) if gpu.supports(p) and (card is None or p != "bf16" or card.bf16)]
    model = _structure(wl)
    # A model instance's optimizer is bound to its real parameters: no fake steps may step it.
    check = check_savings and wl.builds_fresh_models
    modes = checkpointing_axis(wl, checkpointing, model, target_batch_size // world_size, check=check)
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    del model
    return PlanRequest(
        workload=wl,
        device=gpu,
        target_batch_size=target_batch_size,
        world_size=world_size,
        precisions=tuple(usable),
        checkpointing=modes.modes,
        dropped=modes.dropped,
        axis=tuple(strategies(world_size, *strategy_axis)),
        headroom=headroom,
        reference_batch_size=reference_batch_size,
        has_batchnorm=has_batchnorm,
        card=card,
        offload_fallback=strategy_axis[0] is None,
    )


def _structure(wl: Workload) -> nn.Module:
    """The model for its structure only (its blocks, batch norm): built on the meta device,
    so a 7B model costs no host memory; built as it is where its constructor cannot run there."""
    if not wl.builds_fresh_models:
        return wl.build_model()
    try:
        with torch.device("meta"):
            return wl.build_model()
    except Exception:  # noqa: BLE001 - a constructor computing on its tensors: build it for real
        return wl.build_model()


def _plan(request: PlanRequest, hooks: PlanHooks, kind: TrialKind) -> Plan:
    """Weigh every group of candidates, confirm fake trials on the device, recommend."""
    given = hooks  # the caller's hooks: a re-plan on real trials starts from these, not the fake path's
    on_device, hooks = _trials_for(request, hooks, kind)
    ledger = _new_ledger(request)
    _check_host(on_device, ledger)
    for group in request.groups():
        _weigh_group(request, hooks, ledger, group)
    ledger.offload = _offload_fallback(request, hooks, ledger, on_device)
    ledger.failures.raise_if_every_trial_failed()
    measured = [c for c in ledger.results.values() if c.fits]
    if ledger.card is None:
        for c in ledger.results.values():  # none, or a partial ranking: the measured speed ranks all
            c.predicted_seconds_per_step = c.predicted_samples_per_second = None
    speed = measured_speed if ledger.card is None else predicted_speed_of
    if on_device is not None and any(c.measurement is not None and c.measurement.fake for c in measured):
        confirmed = confirm_on_device(measured, on_device, request, hooks.progress, speed)
        if confirmed is None:
            # The fake path dropped the estimator's search (a fake trial per candidate stood
            # in for it); real trials need it again to prune, and the caller's say= too.
            again = _plan(request, given, "real")
            again.trials_note = on_device.note
            return again
        ledger.trial_steps += confirmed
    return _result(request, ledger, measured, speed, on_device)


def _check_host(on_device: Trials | None, ledger: _Ledger) -> None:
    """Refuse, before any trial, a plan whose real runs the host cannot hold: real trials, or
    fake ones whose candidates only a measured speed can rank. A plan on fake trials ranked by
    a card's predicted speed goes on; its answer is then not confirmed for real, and says so."""
    if on_device is None or on_device.host_shortfall is None:
        return
    if not on_device.fake:
        raise host_refusal(on_device.host_shortfall)
    if ledger.card is None:
        raise unranked_refusal(on_device.host_shortfall)


def _new_ledger(request: PlanRequest) -> _Ledger:
    """Every candidate not run yet, and the card whose predicted speed ranks them."""
    ledger = _Ledger({s: Candidate(s, request.initial_status(s)) for s in request.pool()}, card=request.card)
    if request.card is None and not request.workload.builds_fresh_models and isinstance(request.device, SimDevice):
        ledger.speed_error = (
            "the workload's model is an instance, with the script's own optimizer: fake steps must not step it, "
            "so no speed is predicted and the measured one ranks"
        )
    return ledger


def _trials_for(request: PlanRequest, hooks: PlanHooks, kind: TrialKind) -> tuple[Trials | None, PlanHooks]:
    """The one place that chooses what a trial runs: a trial given by the caller as it is,
    else fake tensors where they stand in for the device (:mod:`memfit.search.trials`)."""
    if hooks.run_trial is not trial:
        return None, hooks
    on_device = choose_trials(
        kind, request.workload, request.device, Settings(world_size=request.world_size), steps=2, say=hooks.say
    )
    if not on_device.fake:
        return on_device, hooks
    fake_trials = on_device

    def run_fake(_wl: Workload, s: Settings, _gpu: Device) -> Measurement:
        assert s.micro_batch_size is not None
        return fake_trials(s.micro_batch_size, s.replace(accumulation_steps=1))

    # The estimator's search is a series of the same fake runs; a fake trial per
    # candidate, largest first, answers the same question with fewer of them.
    predictor = None if hooks.predictor is estimated_max_micro_batch else hooks.predictor
    return on_device, replace(hooks, predictor=predictor, run_trial=run_fake)


def _weigh_group(request: PlanRequest, hooks: PlanHooks, ledger: _Ledger, group: Group) -> None:
    """One group: skipped when measured candidates dominate it, else pruned by the
    estimator's limit and tried from the largest micro-batch down."""
    members = [s for s in ledger.results if group_of(s) == group]
    # A group whose every candidate a measured one already beats costs nothing.
    for s in members:
        if any(o.fits and dominates(o.settings, s) for o in ledger.results.values()):
            ledger.results[s].status = "dominated"
    if all(ledger.results[s].status == "dominated" for s in members):
        return
    precision, ckpt, (shard, group_size) = group
    shape = Settings(
        precision=precision,
        checkpointing=ckpt,
        world_size=request.world_size,
        shard=shard,
        shard_group_size=group_size,
    )
    limit, heaviest = _group_limit(request, hooks, ledger, shape)
    with rehearsing(request, shape, hooks.run_trial, limit, heaviest):
        for s in members:
            _weigh(request, hooks, ledger, ledger.results[s], limit)


def _group_limit(
    request: PlanRequest, hooks: PlanHooks, ledger: _Ledger, shape: Settings
) -> tuple[int | None, int | None]:
    """The group's largest micro-batch by the predictor, and (the default estimator, several
    ranks) the rank its trace found heaviest there; (None, None) when it cannot say."""
    if hooks.predictor is None or ledger.estimate_error is not None:
        return None, None
    if hooks.predictor is estimated_max_micro_batch and not request.workload.builds_fresh_models:
        # the estimator's fake steps would run the script's own optimizer (see _resolve)
        return None, None
    try:
        if hooks.predictor is estimated_max_micro_batch:
            # the same trace says which rank peaks highest there (several ranks)
            return estimated_limit(request.workload, shape, request.device, request.per_rank)
        return hooks.predictor(request.workload, shape, request.device, request.per_rank), None
    except Exception as error:  # noqa: BLE001 - the estimate only prunes; trials decide
        # Why go on: an operation fake tensors cannot run (a value read in the step)
        # stops the estimate, not the trials; a bug in the step shows up unchanged in
        # the first trial.
        ledger.estimate_error = one_line(error)
        return None, None


def _weigh(request: PlanRequest, hooks: PlanHooks, ledger: _Ledger, c: Candidate, limit: int | None) -> None:
    """One candidate: too large by the estimate, dominated by a measured one, or tried."""
    s = c.settings
    c.predicted_max_micro_batch = limit
    if c.status != "not run":
        return
    if limit is not None and s.micro_batch_size is not None and s.micro_batch_size > limit:
        c.status = "too large (estimate)"
        return
    if any(o.fits and dominates(o.settings, s) for o in ledger.results.values()):
        c.status = "dominated"
        return
    c.measurement = ledger.failures.run(hooks.run_trial, request.workload, s, request.device)
    ledger.trial_steps += 2
    c.status = status_of(c.measurement, request.budget, ledger.failures.last_reason)
    if c.fits:
        _record_speed(request, hooks, ledger, c)
    if hooks.progress:
        hooks.progress(c)


def _record_speed(request: PlanRequest, hooks: PlanHooks, ledger: _Ledger, c: Candidate) -> None:
    """A fitting candidate's measured speed, and its predicted one on the plan's card."""
    assert c.measurement is not None
    sps = c.measurement.samples_per_second
    c.samples_per_second = None if sps is None else sps * request.world_size
    if ledger.card is None:
        return
    try:
        seconds, samples = hooks.predict_speed(request.workload, c.settings, ledger.card)
    except MemfitError as error:
        # Fake tensors cannot run this step (a value read in forward): no predicted
        # speed for any candidate; the measured one ranks, and says so.
        ledger.speed_error, ledger.card = one_line(error), None
    else:
        c.predicted_seconds_per_step = seconds
        c.predicted_samples_per_second = samples * request.world_size


def _allocator_advice(request: PlanRequest, ledger: _Ledger, best: Candidate) -> list[str]:
    """The allocator setting that would reserve least for the recommendation, with its saving:
    the recommended step's events replayed under each (:func:`memfit.estimate`'s
    ``reserved_by_setting``); nothing where the estimator cannot run the step."""
    from memfit.estimator.estimate import estimate
    from memfit.memory import allocator_conf

    s = best.settings
    known = ledger.offload.reserved_by_setting.get(s.replace(accumulation_steps=1)) if ledger.offload else None
    if known is None:
        if not isinstance(request.device, SimDevice):
            return []  # a real GPU's trials measured it: the replay would be of the estimator's step
        try:
            one = s.replace(accumulation_steps=1)
            known = estimate(
                request.workload, s.micro_batch_size, one, device=request.device, search=False, speed=False
            ).reserved_by_setting
        except Exception:  # noqa: BLE001 - advice only: a step fake tensors cannot run gives none
            return []
    return allocator_advice(known, allocator_conf.current().describe())


def _result(
    request: PlanRequest, ledger: _Ledger, measured: list[Candidate], speed: Speed, on_device: Trials | None
) -> Plan:
    """The plan: the recommendation among the candidates that fit, or why none does."""
    ordered = list(ledger.results.values())
    if not measured:
        raise DoesNotFitError(nothing_fits_message(request, ordered, ledger.failures))
    best = recommended_candidate(measured, speed)
    card = ledger.card
    return Plan(
        workload=request.workload.name,
        device=request.device.spec,
        capacity=request.device.capacity,
        target_batch_size=request.target_batch_size,
        world_size=request.world_size,
        candidates=ordered,
        recommended=best,
        reason=reason(best, measured, request.device, speed, card) + why_this_strategy(best, ordered, request.axis),
        advice=plan_advice(request, best.settings, ledger.failures)
        + (ledger.offload.advice(best.settings) if ledger.offload else [])
        + _allocator_advice(request, ledger, best),
        trial_steps=ledger.trial_steps,
        headroom=request.headroom,
        estimate_error=ledger.estimate_error,
        ranked_by="measured" if card is None else "predicted",
        speed_gpu=None if card is None else card.name,
        speed_error=ledger.speed_error,
        trials_note=on_device.note if on_device is not None else None,
    )
