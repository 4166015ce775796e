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
bisection). With ``world_size > 1`` the one-GPU breakdown is divided as
:mod:`memfit.estimator.sharding` documents (ZeRO-1/2/3, FSDP; DDP buckets), the allocator overhead
of the one-GPU run kept, and ``fits`` is ``total <= memory``.

>>> est = estimate("mlp:layers=1,width=16,features=16", batch_size=2, device="sim:64MiB", search=False)
>>> est.fits, est.total == est.peak_reserved
(True, True)
>>> sum(est.breakdown[c] for c in ("parameters", "gradients", "optimizer state", "activations", "temporaries")) == est.peak_allocated
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from memfit._html import HtmlRepr
from memfit.batch_search import Outcome, SearchSpace, answer, run_search
from memfit.cuda.context import fixed_costs as cuda_fixed_costs
from memfit.cuda.context import resolve_cuda_version
from memfit.cuda.target import CudaTarget
from memfit.errors import MemfitError
from memfit.estimator import sharding
from memfit.estimator.breakdown import CATEGORIES, Peak, analyze
from memfit.estimator.fake import run_fake_steps
from memfit.estimator.sharding import Shard
from memfit.estimator.speed import speed_gpu, step_time
from memfit.estimator.timing import OpTrace, StepTime
from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.devices import Device, SimDevice
from memfit.memory.devices import device as make_device
from memfit.memory.gpus import GPU, lookup
from memfit.run.settings import Settings
from memfit.units import format_size, parse_size
from memfit.workload import Workload, load_workload

__all__ = ["estimate", "Estimate", "Target", "resolve_target", "largest_fitting", "apply_sharding"]

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


def apply_sharding(peak: Peak, world_size: int, shard: str) -> tuple[dict[str, int], int, int]:
    """Per-rank (categories, peak allocated, peak reserved) from a one-GPU peak.

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
    return categories, allocated, reserved


class _Prediction:
    """One batch size on the target: whether it fits, and (on demand) its breakdown.

    Why lazy: the batch-size search needs only ``fits``; the replay, and the unlimited
    re-run that says what a batch that does not fit would need, are for the batch shown.
    """

    def __init__(
        self, workload: Workload, settings: Settings, target: Target, budget: int | None, count_ops: bool = False
    ) -> None:
        if budget is not None and budget <= 0:
            raise MemfitError(f"the fixed costs ({format_size(target.fixed_total)}) leave no memory on {target.name}")
        self._workload, self._settings, self._target = workload, settings, target
        self._count_ops = count_ops
        self._run = run_fake_steps(
            workload, settings, foreach=target.cuda, budget=budget, cuda=target.semantics, count_ops=count_ops
        )
        self._budget = budget
        self.fits = self._run.fits
        #: the allocator model's peak reserved bytes of the budgeted run (what the search needs)
        self.peak_reserved = self._run.peak_reserved
        self._peak: Peak | None = None

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
                self._run = run_fake_steps(
                    self._workload,
                    self._settings,
                    foreach=self._target.cuda,
                    budget=None,
                    cuda=self._target.semantics,
                    count_ops=self._count_ops,
                )
                self._budget = None
            self._peak = analyze(self._run.events, budget=self._budget)
            self._run.events = []  # the replay is done: let the events go
        return self._peak


def estimate(
    workload: Workload | str,
    batch_size: int | None = None,
    settings: Settings | None = None,
    *,
    gpu: str | GPU | None = None,
    memory: int | str | None = None,
    device: str | Device | None = None,
    world_size: int = 1,
    shard: Shard = "none",
    fixed_costs: int | str | None = None,
    cuda_version: str | tuple[int, ...] | None = None,
    search: bool | None = None,
    search_limit: int | None = None,
    speed: bool = True,
) -> Estimate:
    """Predict peak memory and its breakdown at ``batch_size`` on a target (see the module).

    Give at most one target: ``gpu``, ``memory`` or ``device``.

    Args:
        workload: a :class:`memfit.Workload` or a reference, resolved once here.
        batch_size: the micro-batch (samples per forward/backward) on each rank. Without
            it, on a target with memory, the estimate is at the largest batch that fits (or
            at 1 when none does); without memory, at 1.
        settings: precision, checkpointing and accumulation.
        gpu: a GPU model from the table (``"RTX 3090"``, ``"NVIDIA A100-SXM4-80GB"``).
        memory: a CUDA GPU whose allocator may reserve this much (``"16GiB"``).
        device: the simulated GPU itself (``"sim:8GiB"``): no fixed costs.
        world_size: ranks training together.
        shard: what the ranks divide among them (``none``: DDP; ``optimizer``: ZeRO-1;
            ``gradients``: ZeRO-2; ``full``: ZeRO-3 / FSDP).
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
            simulated GPU's card; see :mod:`memfit.estimator.timing`).
    """
    wl = load_workload(workload)
    settings = settings or Settings()
    sharding.check(world_size, shard)
    if batch_size is not None and batch_size < 1:
        raise MemfitError(f"invalid batch size {batch_size}: must be at least 1")
    target = resolve_target(gpu, memory, device, fixed_costs, cuda_version)
    if search is None:
        search = batch_size is None
    if settings.precision == "bf16" and not target.bf16:
        raise MemfitError(f"{target.name} does not support bf16: use --precision fp16 or fp32")
    sharded = world_size > 1
    cache: dict[int, _Prediction] = {}

    def predict(b: int) -> _Prediction:
        # Sharded: the one-GPU run is unlimited, and the divided total decides.
        if b not in cache:
            budget = None if sharded else target.budget
            # Counting the operations costs a few per cent of a fake run: only where the
            # predicted time may be needed (the given batch, or every batch of a search).
            count = speed and target.speed is not None and target.cuda and batch_size in (None, b)
            cache[b] = _Prediction(wl, settings.replace(micro_batch_size=b), target, budget, count)
        return cache[b]

    def outcome(b: int) -> Outcome:
        prediction = predict(b)
        if not sharded:
            return Outcome(b, prediction.fits, prediction.peak_reserved if prediction.fits else 0)
        _, _, reserved = apply_sharding(prediction.peak, world_size, shard)
        total = reserved + target.fixed_total
        return Outcome(b, target.memory is not None and total <= target.memory, total)

    max_batch = None
    if target.memory is not None and (batch_size is None or search):
        capacity = target.memory if sharded else target.budget
        if search_limit is not None:
            max_batch = largest_fitting(outcome, capacity, limit=search_limit, guess=search_limit)
        else:
            max_batch = largest_fitting(outcome, capacity)
    chosen = batch_size if batch_size is not None else max(max_batch or 0, 1)
    prediction = predict(chosen)
    categories, allocated, reserved = apply_sharding(prediction.peak, world_size, shard)
    total = reserved + target.fixed_total
    breakdown = {name: categories.get(name, 0) for name in (*CATEGORIES, "ddp buckets") if name in categories}
    breakdown["allocator overhead"] = reserved - allocated
    # Each fixed cost by its name (cuda context, cublas workspace, cudnn workspace), or
    # one line when there is none to name (a simulated GPU) or the user gave the total.
    breakdown.update(target.fixed or {"fixed costs": 0})
    step = (
        _predicted_time(wl, settings.replace(micro_batch_size=chosen), target, prediction, world_size)
        if speed
        else None
    )
    return Estimate(
        workload=wl.name,
        batch_size=chosen,
        settings=settings.replace(micro_batch_size=chosen).to_dict(),
        target=target.name,
        memory=target.memory,
        peak_allocated=allocated,
        peak_reserved=reserved,
        fixed_costs=dict(target.fixed),
        total=total,
        breakdown=breakdown,
        top_modules=[{"module": name, "bytes": nbytes} for name, nbytes in prediction.peak.top_modules],
        fits=outcome(chosen).fits if target.memory is not None else None,
        max_batch_size=max_batch,
        world_size=world_size,
        shard=shard,
        cuda_version=None if target.cuda_version is None else "{}.{}".format(*target.cuda_version),
        cuda=target.semantics.describe() if target.semantics is not None else None,
        predicted_seconds_per_step=step.seconds_per_step if step else None,
        predicted_samples_per_second=step.samples_per_second if step else None,
        speed_gpu=step.gpu if step else None,
        predicted_time=step.to_dict() if step else None,
    )


def _predicted_time(
    workload: Workload, settings: Settings, target: Target, prediction: _Prediction, world_size: int
) -> StepTime | None:
    """The predicted step on the target's card, from the operations of the fake steps.

    None without a card (``memory=``), over several ranks (communication is not modelled),
    or for bf16 on a card without it. The fake steps of a simulated GPU run the CPU's
    optimizer loop (the simulated GPU's own accounting); the time is for the card, so
    its optimizers are recorded again in CUDA's foreach form.
    """
    card = target.speed
    if card is None or world_size > 1 or (settings.precision == "bf16" and not card.bf16):
        return None
    trace = prediction.ops if target.cuda else None
    if trace is not None:
        return step_time(workload, settings, card, trace=trace)
    return step_time(workload, settings, card, foreach=True)
