"""Predict a training step's peak GPU memory, its breakdown and the largest batch that
fits, for any GPU, without one.

Method: two full optimizer steps of the workload run on fake tensors
(:mod:`memfit.estimator.fake`: the same :func:`~memfit.run.steps.run_steps`, storage tracker
and caching-allocator model as the simulated GPU, no real memory, no arithmetic), with
the target's memory as the allocator's budget. The recorded allocations and frees are
replayed (:mod:`memfit.estimator.breakdown`) to find the peak and what holds it.

The target:

- ``device="sim:8GiB"`` (or a :class:`~memfit.memory.devices.SimDevice`): the simulated
  GPU itself, no fixed costs, the optimizer's CPU implementation, so the estimate equals
  what ``memfit measure --device sim:8GiB`` measures;
- ``gpu="RTX 3090"``: a card from :mod:`memfit.memory.gpus`; its usable memory less the
  fixed costs (:func:`memfit.cuda.context.fixed_costs`: the CUDA context for the CUDA
  version, ``cuda_version=``, and module loading, cuBLAS's workspaces, a capped cuDNN
  workspace; override with ``fixed_costs=``) is the allocator's budget, and optimizers use
  their CUDA default (foreach);
- ``memory="16GiB"``: a CUDA GPU whose allocator may reserve that much (fixed costs
  only when given);
- nothing: an unlimited CUDA GPU (no ``fits``, no ``max_batch_size``).

``total`` = peak reserved + fixed costs; ``fits`` means the steps ran within the budget;
``max_batch_size`` is found by fake runs at growing batch sizes (doubling, then
bisection).

With ``world_size > 1`` (and a ``shard`` strategy) every figure is one rank's: the steps
run as that rank of a fake process group of N ranks, wrapped by PyTorch's own DDP,
ZeroRedundancyOptimizer or FSDP2 (:mod:`memfit.estimator.distributed_trace`), within the
per-rank budget, for the rank that holds the most (under ZeRO-1 every distinct partition
is traced and the heaviest is shown: ``rank``); the breakdown adds ``communication buffers`` (DDP's buckets, FSDP2's
all-gather and reduce-scatter buffers) and ``unsharded parameters`` (FSDP2's full
parameters of a unit). ``method`` is ``"traced"``. Where tracing cannot run (no
torch.distributed, or a process in a real process group with a workload a separate
process cannot load) the one-GPU breakdown is divided as :mod:`memfit.estimator.sharding`
documents, ``method`` is ``"formulas"`` and ``method_note`` says why.

>>> est = estimate("mlp:layers=1,width=16,features=16", batch_size=2, device="sim:64MiB", search=False)
>>> est.fits, est.total == est.peak_reserved
(True, True)
>>> sum(est.breakdown[c] for c in ("parameters", "gradients", "optimizer state", "activations", "temporaries")) == est.peak_allocated
True
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from memfit._html import HtmlRepr
from memfit.batch_search import Outcome, SearchSpace, answer, run_search
from memfit.cuda.context import fixed_costs as cuda_fixed_costs
from memfit.cuda.context import resolve_cuda_version
from memfit.cuda.target import CudaTarget
from memfit.errors import MemfitError
from memfit.estimator import sharding, speed_accuracy
from memfit.estimator.breakdown import CATEGORIES, ROLES, Peak, analyze
from memfit.estimator.distributed_trace import (
    CHILD_CANNOT_LOAD,
    TraceUnavailable,
    load_in_child,
    run_in_child,
    serve_child,
    tracing,
    unavailable_reason,
)
from memfit.estimator.fake import FakeSteps, Runner
from memfit.estimator.offload import OffloadRun, offload_step_time, offloaded
from memfit.estimator.speed import no_speed_reason, speed_card, speed_gpu, step_time
from memfit.estimator.timing import OpTrace, StepTime
from memfit.memory import allocator_conf
from memfit.memory.allocator import CachingAllocatorModel, replay_reserved
from memfit.memory.devices import Device, SimDevice
from memfit.memory.devices import device as make_device
from memfit.memory.gpus import GPU, lookup
from memfit.run.checkpointing import describe_modules
from memfit.run.settings import Settings
from memfit.run.strategy import OFFLOAD_SHARDS, Shard, check_strategy, describe
from memfit.units import format_size, parse_size
from memfit.workload import Workload, load_workload

__all__ = ["estimate", "Estimate", "Target", "resolve_target", "largest_fitting", "apply_sharding", "Figures", "Way"]

#: the largest batch the search tries (a guard against a workload whose memory does not grow)
MAX_SEARCH = 1 << 20


@dataclass(frozen=True)
class Target:
    """What the estimate is for: its name, memory, fixed costs and optimizer flavour."""

    name: str
    memory: int | None
    fixed: dict[str, int] = field(default_factory=dict)
    cuda: bool = True  # optimizers take their CUDA default (foreach)
    bf16: bool = True
    #: the CUDA version the fixed costs are for (None: no fixed costs were derived)
    cuda_version: tuple[int, int] | None = None
    #: the CUDA GPU whose kernels, autocast lists and dropout the fake steps follow
    #: (memfit.cuda.semantics); None keeps the CPU's (the plain ``cpu`` device)
    semantics: CudaTarget | None = field(default_factory=CudaTarget)
    #: the card whose speed the predicted step time is for (None: no prediction)
    speed: GPU | None = None

    @property
    def fixed_total(self) -> int:
        return sum(self.fixed.values())

    @property
    def budget(self) -> int | None:
        """What the caching allocator may reserve: the memory less the fixed costs."""
        return None if self.memory is None else self.memory - self.fixed_total


def resolve_target(
    gpu: str | GPU | None = None,
    memory: int | str | None = None,
    device: str | Device | None = None,
    fixed_costs: int | str | None = None,
    cuda_version: str | tuple[int, ...] | None = None,
) -> Target:
    """The target from the one of ``gpu``, ``memory`` or ``device`` that is given.

    Args:
        gpu: a GPU model from the table.
        memory: a CUDA GPU whose allocator may reserve this much.
        device: a device spec (``sim:8GiB``, ``cuda``).
        fixed_costs: override the memory outside the tensors.
        cuda_version: the CUDA of the user's torch build, for a GPU's fixed costs and the
            attention kernel PyTorch prefers on it (default: the installed torch's, else
            :data:`memfit.cuda.context.DEFAULT_CUDA_VERSION`).

    The target's ``semantics`` (:class:`~memfit.cuda.target.CudaTarget`) is the GPU whose
    CUDA semantics the fake steps follow: the named GPU's capability, a real GPU's own, the
    simulated GPU's for a ``sim:`` device (so estimate and measure agree), none for ``cpu``.
    """
    given = [name for name, value in (("gpu", gpu), ("memory", memory), ("device", device)) if value is not None]
    if len(given) > 1:
        raise MemfitError(f"give one target, not {' and '.join(given)}: --gpu NAME, --memory SIZE or --device sim:SIZE")
    fixed_override = None if fixed_costs is None else _parse_fixed(fixed_costs)
    cuda, _ = resolve_cuda_version(cuda_version)
    if gpu is not None:
        card = gpu if isinstance(gpu, GPU) else lookup(gpu)
        if fixed_override is None:
            fixed = cuda_fixed_costs(card.family, card.compute_capability[0], cuda)
        else:
            fixed = {"fixed costs": fixed_override}
        semantics = CudaTarget(card.compute_capability, cuda, card.name)
        return Target(
            card.name, card.memory, fixed, cuda=True, bf16=card.bf16, cuda_version=cuda, semantics=semantics, speed=card
        )
    if memory is not None:
        size = parse_size(memory)
        fixed = {"fixed costs": fixed_override} if fixed_override else {}
        return Target(f"{format_size(size)} GPU", size, fixed, cuda=True, semantics=CudaTarget(cuda_version=cuda))
    if device is not None:
        dev = make_device(device)
        if isinstance(dev, SimDevice):
            # the simulated GPU itself: its own semantics, so estimate and measure agree
            card = speed_gpu(dev.gpu)
            return Target(
                dev.spec, dev.capacity, {}, cuda=False, bf16=dev.supports("bf16"), semantics=dev.cuda, speed=card
            )
        fixed = {"fixed costs": fixed_override} if fixed_override else {}
        major, minor = torch.cuda.get_device_capability(dev.torch_device)
        semantics = CudaTarget((major, minor), cuda, dev.describe())
        return Target(dev.describe(), dev.capacity, fixed, cuda=True, bf16=dev.supports("bf16"), semantics=semantics)
    fixed = {"fixed costs": fixed_override} if fixed_override else {}
    semantics = CudaTarget(cuda_version=cuda)
    return Target("CUDA GPU (no memory given)", None, fixed, cuda=True, semantics=semantics)


def _parse_fixed(value: int | str) -> int:
    if isinstance(value, int) and value == 0:
        return 0
    if isinstance(value, str) and value.strip() == "0":
        return 0
    return parse_size(value)


@dataclass
class Estimate(HtmlRepr):
    """A prediction for one batch size on one target. Bytes are ints."""

    workload: str
    batch_size: int
    settings: dict[str, Any]
    target: str
    memory: int | None
    peak_allocated: int
    peak_reserved: int
    fixed_costs: dict[str, int]
    total: int
    breakdown: dict[str, int]
    top_modules: list[dict[str, Any]]
    fits: bool | None
    max_batch_size: int | None
    world_size: int = 1
    shard: str = "none"
    shard_group_size: int | None = None
    #: how the ranks train ("DDP (DistributedDataParallel)", "FSDP2 fully_shard", ...)
    strategy: str = ""
    #: "single GPU"; "traced" (one rank of a fake process group); "formulas" (the fallback)
    method: str = "single GPU"
    #: why the figures come from formulas, when they do
    method_note: str = ""
    #: the rank the figures are for: the one holding the most
    rank: int = 0
    #: the CUDA version the fixed costs are for ("12.8"; None when none were derived)
    cuda_version: str | None = None
    #: the CUDA semantics the fake steps followed (GPU, CUDA and torch versions), or None
    #: for the CPU's (the plain ``cpu`` device)
    cuda: str | None = None
    #: the predicted step on ``speed_gpu`` (None without a GPU model, or over several ranks)
    predicted_seconds_per_step: float | None = None
    predicted_samples_per_second: float | None = None
    speed_gpu: str | None = None
    #: where the predicted time goes (seconds: compute, memory, host), and the tf32 settings
    predicted_time: dict[str, Any] | None = None
    #: the error band of such predictions (:func:`memfit.estimator.speed_accuracy.for_step`)
    speed_accuracy: dict[str, Any] | None = None
    #: why there is no predicted step on the target's card, when there is a card
    speed_note: str = ""
    #: "estimated as eager: ..." when the workload is torch.compile'd (see memfit.estimator.compiled)
    compile_note: str = ""
    #: the allocator settings the figures are for (PYTORCH_CUDA_ALLOC_CONF, or "torch's defaults")
    allocator: str = "torch's defaults"
    #: peak reserved bytes of the same step under other allocator settings (None: does not fit)
    reserved_by_setting: dict[str, int | None] = field(default_factory=dict)
    #: under CPU offload: the most host memory the step holds (None: no offload)
    host_memory: int | None = None
    #: what checkpointing recomputes, by class (``8 x BasicBlock``; "" without checkpointing)
    checkpointed: str = ""
    #: the dotted path of each checkpointed module, in the order forward runs them
    checkpointed_modules: list[str] = field(default_factory=list)
    #: peak allocated bytes checkpointing saves: the same step without it, minus this one
    #: (None without checkpointing, or where the figures come from formulas)
    checkpointing_saves: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def largest_fitting(
    trial: Callable[[int], Outcome], capacity: int | None, limit: int = MAX_SEARCH, guess: int | None = None
) -> int:
    """The largest batch in 1..limit that fits (0 if none), for memory monotone in the batch.

    Why probe's search policy: each call is a fake run, and memory is close to linear in
    the batch, so jumping along the line between fitting runs proves the boundary in a
    handful of runs, where doubling and bisection take about 2·log2(answer).
    """
    space = SearchSpace(capacity=capacity, max_batch_size=limit, guess=guess)
    return answer(space, run_search(space, trial))


def apply_sharding(peak: Peak, world_size: int, shard: str) -> Figures:
    """Per-rank figures (categories, peak allocated, peak reserved) from a one-GPU peak.

    The states are divided as :func:`memfit.estimator.sharding.shard_states` says; DDP buckets are
    allocated through a fresh allocator model and added; the one-GPU allocator overhead
    (reserved − allocated) is kept.
    """
    categories = dict(peak.categories)
    params, grads, states = categories["parameters"], categories["gradients"], categories["optimizer state"]
    categories["parameters"], categories["gradients"], categories["optimizer state"] = sharding.shard_states(
        params, grads, states, world_size=world_size, shard=shard
    )
    bucket_allocated = bucket_reserved = 0
    if sharding.uses_ddp_buckets(world_size, shard):
        allocator = CachingAllocatorModel(budget=None)
        for size in sharding.bucket_sizes(peak.gradient_sizes):
            allocator.malloc(size)
        bucket_allocated, bucket_reserved = allocator.allocated, allocator.reserved
        categories["ddp buckets"] = bucket_allocated
    allocated = sum(categories.values())
    reserved = allocated + (peak.peak_reserved - peak.peak_allocated) + (bucket_reserved - bucket_allocated)
    return Figures(categories, allocated, reserved)


class _Prediction:
    """One batch size on the target: whether it fits, and (on demand) its breakdown.

    Why lazy: the batch-size search needs only ``fits``; the replay, and the unlimited
    re-run that says what a batch that does not fit would need, are for the batch shown.
    """

    def __init__(
        self, run: Runner, settings: Settings, target: Target, budget: int | None, count_ops: bool = False
    ) -> None:
        if budget is not None and budget <= 0:
            raise MemfitError(f"the fixed costs ({format_size(target.fixed_total)}) leave no memory on {target.name}")
        self._runner, self._settings = run, settings
        self._count_ops = count_ops
        self._run = run(settings, budget, count_ops)
        self._budget = budget
        self.fits = self._run.fits
        #: the allocator model's peak reserved bytes of the budgeted run (what the search needs)
        self.peak_reserved = self._run.peak_reserved
        self._peak: Peak | None = None
        #: peak reserved under each allocator setting shown (filled with the breakdown)
        self.by_setting: dict[str, int | None] = {}

    @property
    def ops(self) -> OpTrace | None:
        """The operations of the last step (for the predicted step time), when counted."""
        if self._count_ops and self._run.ops is None:
            self.peak  # noqa: B018  (a run that did not fit is re-run without a limit)
        return self._run.ops

    @property
    def peak(self) -> Peak:
        if self._peak is None:
            if not self._run.fits:
                # What a batch that does not fit would need: the same steps without a limit.
                self._run = self._runner(self._settings, None, self._count_ops)
                self._budget = None
            self._peak = analyze(self._run.events, budget=self._budget)
            self.by_setting = _by_setting(self._run.events, self._budget, self._peak.peak_reserved)
            self._run.events = []  # the replay is done: let the events go
        return self._peak

    @property
    def compile_note(self) -> str:
        """What of the workload is torch.compile'd and ran eager ("" if nothing)."""
        return self._run.compile_note

    @property
    def offload(self) -> OffloadRun | None:
        """The run shown, when the step offloads to the host (its host figures)."""
        self.peak  # noqa: B018  (the run shown)
        return self._run if isinstance(self._run, OffloadRun) else None

    @property
    def checkpointed(self) -> tuple[tuple[str, str], ...]:
        """(path, class) of each module checkpointing recomputed in the run shown."""
        self.peak  # noqa: B018  (the run shown: a run that did not fit is re-run without a limit)
        return tuple(self._run.checkpointed)

    @property
    def rank(self) -> int:
        """The rank whose run this is (the heaviest traced; 0 on one GPU)."""
        self.peak  # noqa: B018  (the run shown: a run that did not fit is re-run without a limit)
        return self._run.rank


def _by_setting(events: list[Any], budget: int | None, reserved: int) -> dict[str, int | None]:
    """The step's peak reserved memory under the settings it ran with and under the ones
    worth comparing (torch's defaults, expandable segments): the same events replayed."""
    current = allocator_conf.current()
    shown: dict[str, int | None] = {current.describe(): reserved}
    for other in allocator_conf.COMPARED:
        if other.describe() not in shown:
            shown[other.describe()] = replay_reserved(events, budget, other)
    return shown


class Way(enum.Enum):
    """How an estimate's step is traced: decided once, at the estimator's entry
    (:func:`_decide`); each way then runs one way down. The value is ``Estimate.method``."""

    #: one GPU: the fake steps (:class:`~memfit.estimator.fake.FakeSteps`)
    ONE_GPU = "single GPU"
    #: one rank of N on a fake process group (:func:`~memfit.estimator.distributed_trace.tracing`)
    RANKS = "traced"
    #: one GPU's steps, its states divided as :mod:`memfit.estimator.sharding` says
    FORMULAS = "formulas"
    #: this process is in a real process group: a separate process estimates (and decides again)
    IN_CHILD = "in a separate process"


class _Decision(NamedTuple):
    way: Way
    #: why the figures come from formulas (FORMULAS only)
    reason: str = ""


@dataclass(frozen=True)
class _Options:
    """What to search and show, apart from what runs."""

    batch_size: int | None
    search: bool
    search_limit: int | None
    speed: bool
    #: the allocator settings to follow (None: this process's PYTORCH_CUDA_ALLOC_CONF)
    alloc_conf: str | None = None


@dataclass(frozen=True)
class _Request:
    """One estimate, checked: what runs (workload, settings, target) and what to show."""

    workload: Workload
    settings: Settings
    target: Target
    options: _Options


class Figures(NamedTuple):
    """One rank's memory: bytes by category, and the peaks allocated and reserved."""

    categories: dict[str, int]
    allocated: int
    reserved: int


@dataclass(frozen=True)
class _Shown:
    """Everything an :class:`Estimate` reports, as each way found it."""

    workload: str
    batch_size: int
    settings: Settings
    target: Target
    figures: Figures
    top_modules: list[tuple[str, int]]
    fits: bool | None
    max_batch_size: int | None
    way: Way
    rank: int = 0
    note: str = ""
    step: StepTime | None = None
    compile_note: str = ""
    by_setting: dict[str, int | None] = field(default_factory=dict)
    host_memory: int | None = None
    #: under offload: seconds of the host copies and of the CPU's optimizer step
    host_time: dict[str, float] | None = None
    #: (path, class) of each checkpointed module, and the peak allocated bytes that saves
    checkpointed: tuple[tuple[str, str], ...] = ()
    checkpointing_saves: int | None = None


def estimate(
    workload: Workload | str,
    batch_size: int | None = None,
    settings: Settings | None = None,
    *,
    gpu: str | GPU | None = None,
    memory: int | str | None = None,
    device: str | Device | None = None,
    world_size: int | None = None,
    shard: Shard | None = None,
    shard_group_size: int | None = None,
    fixed_costs: int | str | None = None,
    cuda_version: str | tuple[int, ...] | None = None,
    search: bool | None = None,
    search_limit: int | None = None,
    speed: bool = True,
    alloc_conf: str | None = None,
) -> Estimate:
    """Predict peak memory and its breakdown at ``batch_size`` on a target (see the module).

    Give at most one target: ``gpu``, ``memory`` or ``device``. With ``world_size > 1``
    every figure is one rank's (the rank that holds the most), traced through PyTorch's
    own DDP, ZeroRedundancyOptimizer or FSDP2 on a fake process group
    (:mod:`memfit.estimator.distributed_trace`); where tracing cannot run, from formulas
    (:mod:`memfit.estimator.sharding`), and ``method`` says so.

    Args:
        workload: a :class:`memfit.Workload` or a reference, resolved once here.
        batch_size: the micro-batch (samples per forward/backward) on each rank. Without
            it, on a target with memory, the estimate is at the largest batch that fits (or
            at 1 when none does); without memory, at 1.
        settings: precision, checkpointing, accumulation and strategy.
        gpu: a GPU model from the table (``"RTX 3090"``, ``"NVIDIA A100-SXM4-80GB"``).
        memory: a CUDA GPU whose allocator may reserve this much (``"16GiB"``).
        device: the simulated GPU itself (``"sim:8GiB"``): no fixed costs.
        world_size: ranks training together (default: ``settings.world_size``).
        shard: what the ranks divide among them (default: ``settings.shard``): ``none``
            (DDP), ``optimizer`` (ZeRO-1), ``gradients`` (FSDP2 keeping full parameters
            from forward to backward), ``full`` (FSDP2).
        shard_group_size: FSDP2 shards within groups of this many ranks and replicates
            across groups (hybrid sharding; default: ``settings.shard_group_size``).
        fixed_costs: override the memory the allocator never sees (CUDA context,
            workspaces).
        cuda_version: the CUDA of the torch build that will train (``"11.8"``,
            ``"cu124"``), for a GPU's CUDA context (default: the installed torch's CUDA,
            else :data:`memfit.cuda.context.DEFAULT_CUDA_VERSION`); also which attention
            kernel PyTorch prefers there (cuDNN first on sm90/sm100 with CUDA 13 wheels).
        search: find ``max_batch_size`` (default: only when ``batch_size`` is not given).
        search_limit: the largest batch worth proving (tried first; when it fits the
            search ends at once).
        speed: also predict the step time on the target's card (``gpu``, or the
            simulated GPU's card; see :mod:`memfit.estimator.timing`; one GPU only).
        alloc_conf: the caching allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` takes
            them (``"expandable_segments:True"``; default: this process's variable).
    """
    wl = load_workload(workload)
    settings = _with_strategy(settings or Settings(), world_size, shard, shard_group_size)
    if batch_size is not None and batch_size < 1:
        raise MemfitError(f"invalid batch size {batch_size}: must be at least 1")
    target = resolve_target(gpu, memory, device, fixed_costs, cuda_version)
    if settings.precision == "bf16" and not target.bf16:
        raise MemfitError(f"{target.name} does not support bf16: use --precision fp16 or fp32")
    if alloc_conf is not None:
        allocator_conf.parse(alloc_conf)  # refused here, before any run
    options = _Options(batch_size, batch_size is None if search is None else search, search_limit, speed, alloc_conf)
    return _estimate(_Request(wl, settings, target, options))


def _with_strategy(settings: Settings, world_size: int | None, shard: Shard | None, group_size: int | None) -> Settings:
    """``settings`` with the strategy arguments given (each checked, in one line)."""
    changes: dict[str, Any] = {}
    if world_size is not None:
        changes["world_size"] = world_size
    if shard is not None:
        changes["shard"] = shard
    if group_size is not None:
        changes["shard_group_size"] = group_size
    if not changes:
        return settings
    merged = {**settings.to_dict(), **changes}
    check_strategy(merged["shard"], merged["world_size"], merged["shard_group_size"])
    return settings.replace(**changes)


def _estimate(request: _Request) -> Estimate:
    """The one decision (how the step is traced), then that way down, under the allocator
    settings asked for (every allocator model made inside follows them)."""
    text = request.options.alloc_conf
    with allocator_conf.use(text) if text is not None else contextlib.nullcontext():
        return _estimate_as_set(request)


def _estimate_as_set(request: _Request) -> Estimate:
    decision = _decide(request)
    if decision.way is Way.IN_CHILD:
        try:
            return _in_child(request)
        except TraceUnavailable as why:  # the child could not load the workload, or trace
            decision = _Decision(Way.FORMULAS, str(why))
    if decision.way is Way.FORMULAS:
        return _by_formulas(request, decision.reason)
    return _traced(request, decision.way)


def _decide(request: _Request) -> _Decision:
    """How this process traces the step: one GPU, one rank of N here, in a separate
    process (this one is in a real process group: torchrun, Lightning), or formulas."""
    settings, wl = request.settings, request.workload
    if settings.world_size <= 1 and settings.shard not in OFFLOAD_SHARDS:
        return _Decision(Way.ONE_GPU)
    reason = unavailable_reason(settings)
    if reason is not None:
        return _Decision(Way.FORMULAS, reason)
    if not dist.is_initialized():
        return _Decision(Way.RANKS)
    # The fake process group is the process's default group: a process already in a
    # real one asks a separate process, which loads the workload again by reference.
    if not wl.builds_fresh_models or wl.reference is None:
        return _Decision(Way.FORMULAS, CHILD_CANNOT_LOAD)
    return _Decision(Way.IN_CHILD)


def _in_child(request: _Request) -> Estimate:
    """The estimate made by a separate process (no process group), which decides again."""
    child = {
        "workload": request.workload.reference,
        "settings": request.settings.to_dict(),
        "target": request.target,
        "options": request.options,
    }
    answer: dict[str, Any] = run_in_child("memfit.estimator.estimate", child, "the estimate")
    return Estimate(**answer)


def _traced(request: _Request, way: Way) -> Estimate:
    """Fake runs at growing batch sizes within the (per-rank) budget, then the breakdown:
    one GPU's steps, or the heaviest rank's of N on a fake process group."""
    wl, settings, target, options = request.workload, request.settings, request.target, request.options
    cache: dict[int, _Prediction] = {}
    # Counting the operations costs a few per cent of a fake run: only where the predicted
    # time may be needed (the given batch, or every batch of a search).
    card = speed_card(target.speed, settings) if options.speed else None
    offload = settings.shard in OFFLOAD_SHARDS
    count = card is not None and target.cuda and not offload
    # under CPU offload the optimizer steps on the CPU, where PyTorch's default is the for-loop
    foreach = target.cuda and not offload
    one_gpu = FakeSteps(wl, foreach=foreach, cuda=target.semantics)
    runner = (
        tracing(wl, settings, foreach=foreach, cuda=target.semantics)
        if way is Way.RANKS
        else contextlib.nullcontext(one_gpu)
    )
    with runner as traced:
        run = offloaded(traced) if offload else traced

        def predict(b: int) -> _Prediction:
            if b not in cache:
                counted = count and options.batch_size in (None, b)
                cache[b] = _Prediction(run, settings.replace(micro_batch_size=b), target, target.budget, counted)
            return cache[b]

        def outcome(b: int) -> Outcome:
            prediction = predict(b)
            return Outcome(b, prediction.fits, prediction.peak_reserved if prediction.fits else 0)

        max_batch = _search(outcome, target, target.budget, options)
        chosen = options.batch_size if options.batch_size is not None else max(max_batch or 0, 1)
        prediction = predict(chosen)
        peak, ops = prediction.peak, prediction.ops if count else None
        saves = None
        if settings.checkpointing != "none":
            # the same step without checkpointing: what it saves, by the same allocator model
            plain = _Prediction(run, settings.replace(micro_batch_size=chosen, checkpointing="none"), target, None)
            saves = plain.peak.peak_allocated - peak.peak_allocated
    step, host, host_time = None, prediction.offload, None
    if card is not None and host is not None:
        step, copies, cpu = offload_step_time(wl, settings.replace(micro_batch_size=chosen), card, host.host_parameters)
        host_time = {
            "offload_copy_seconds": copies,
            "cpu_optimizer_seconds": cpu,
            "host_parameter_bytes": host.host_parameters,
        }
    elif card is not None:
        # The fake steps of a simulated GPU run the CPU's optimizer loop (its own
        # accounting); the time is for the card, so step_time records them again in
        # CUDA's foreach form.
        step = step_time(wl, settings.replace(micro_batch_size=chosen), card, trace=ops)
    return _result(
        _Shown(
            workload=wl.name,
            batch_size=chosen,
            settings=settings,
            target=target,
            figures=Figures(dict(peak.categories), peak.peak_allocated, peak.peak_reserved),
            top_modules=peak.top_modules,
            fits=prediction.fits if target.memory is not None else None,
            max_batch_size=max_batch,
            way=way,
            # under ZeRO-1 the heaviest rank can change with the batch size: the one of the batch shown
            rank=prediction.rank,
            step=step,
            compile_note=prediction.compile_note,
            by_setting=prediction.by_setting,
            host_memory=host.host_peak if host is not None else None,
            host_time=host_time,
            checkpointed=prediction.checkpointed,
            checkpointing_saves=saves,
        )
    )


def _by_formulas(request: _Request, reason: str) -> Estimate:
    """The fallback: one GPU's unlimited run, its states divided as the formulas say."""
    wl, settings, target, options = request.workload, request.settings, request.target, request.options
    one = settings.replace(world_size=1, shard="none", shard_group_size=None)
    run = FakeSteps(wl, foreach=target.cuda, cuda=target.semantics)
    cache: dict[int, _Prediction] = {}

    def predict(b: int) -> _Prediction:
        if b not in cache:
            cache[b] = _Prediction(run, one.replace(micro_batch_size=b), target, None)
        return cache[b]

    def outcome(b: int) -> Outcome:
        reserved = apply_sharding(predict(b).peak, settings.world_size, settings.shard).reserved
        total = reserved + target.fixed_total
        return Outcome(b, target.memory is not None and total <= target.memory, total)

    max_batch = _search(outcome, target, target.memory, options)
    chosen = options.batch_size if options.batch_size is not None else max(max_batch or 0, 1)
    prediction = predict(chosen)
    peak = prediction.peak
    checkpointed = prediction.checkpointed
    return _result(
        _Shown(
            workload=wl.name,
            batch_size=chosen,
            settings=settings,
            target=target,
            figures=apply_sharding(peak, settings.world_size, settings.shard),
            top_modules=peak.top_modules,
            fits=outcome(chosen).fits if target.memory is not None else None,
            max_batch_size=max_batch,
            way=Way.FORMULAS,
            checkpointed=checkpointed,
            note=(
                f"tracing cannot run here ({reason}): per-rank figures from formulas "
                "(memfit.estimator.sharding), which leave out FSDP's all-gather and reduce-scatter "
                "buffers and the full parameters of each unit"
            ),
            compile_note=prediction.compile_note,
        )
    )


def _search(outcome: Callable[[int], Outcome], target: Target, capacity: int | None, options: _Options) -> int | None:
    if target.memory is None or (options.batch_size is not None and not options.search):
        return None
    if options.search_limit is not None:
        return largest_fitting(outcome, capacity, limit=options.search_limit, guess=options.search_limit)
    return largest_fitting(outcome, capacity)


def _result(shown: _Shown) -> Estimate:
    """The :class:`Estimate` of what a way found."""
    figures, target, settings, step = shown.figures, shown.target, shown.settings, shown.step
    names = (*CATEGORIES, *ROLES, "ddp buckets")
    breakdown = {name: figures.categories[name] for name in names if name in figures.categories}
    breakdown["allocator overhead"] = figures.reserved - figures.allocated
    # Each fixed cost by its name (cuda context, cublas workspace, cudnn workspace), or
    # one line when there is none to name (a simulated GPU) or the user gave the total.
    breakdown.update(target.fixed or {"fixed costs": 0})
    world = settings.world_size
    return Estimate(
        workload=shown.workload,
        batch_size=shown.batch_size,
        settings=settings.replace(micro_batch_size=shown.batch_size).to_dict(),
        target=target.name,
        memory=target.memory,
        peak_allocated=figures.allocated,
        peak_reserved=figures.reserved,
        fixed_costs=dict(target.fixed),
        total=figures.reserved + target.fixed_total,
        breakdown=breakdown,
        top_modules=[{"module": name, "bytes": nbytes} for name, nbytes in shown.top_modules],
        fits=shown.fits,
        max_batch_size=shown.max_batch_size,
        world_size=world,
        shard=settings.shard,
        shard_group_size=settings.shard_group_size,
        strategy=describe(settings.shard, world, settings.shard_group_size),
        method=shown.way.value,
        method_note=shown.note,
        rank=shown.rank,
        cuda_version=None if target.cuda_version is None else "{}.{}".format(*target.cuda_version),
        cuda=target.semantics.describe() if target.semantics is not None else None,
        predicted_seconds_per_step=step.seconds_per_step if step else None,
        predicted_samples_per_second=step.samples_per_second if step else None,
        speed_gpu=step.gpu if step else None,
        predicted_time={**step.to_dict(), **(shown.host_time or {})} if step else None,
        speed_accuracy=speed_accuracy.for_step(step.bound_by) if step else None,
        speed_note="" if step else no_speed_reason(target.speed, settings),
        compile_note=shown.compile_note,
        allocator=allocator_conf.current().describe(),
        reserved_by_setting=dict(shown.by_setting),
        host_memory=shown.host_memory,
        checkpointed=describe_modules(shown.checkpointed) if shown.checkpointed else "",
        checkpointed_modules=[path for path, _ in shown.checkpointed],
        checkpointing_saves=shown.checkpointing_saves,
    )


def _answer(child: dict[str, Any]) -> dict[str, Any]:
    """The child's side of an estimate asked for by a process in a real process group
    (a dict: run as ``__main__``, this module's classes are not the parent's)."""
    workload = load_in_child(child["workload"])
    return _estimate(_Request(workload, Settings(**child["settings"]), child["target"], child["options"])).to_dict()


if __name__ == "__main__":
    sys.exit(serve_child(_answer))
