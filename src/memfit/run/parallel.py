"""Wrap a model for N ranks: DDP, ZeRO-1, FSDP2 or hybrid sharding, by PyTorch's own components.

One function decides how a model is trained across the ranks of the current process
group, and every place that trains does it through it: real runs under torchrun
(:func:`memfit.run.steps.run_steps`), the estimator's trace on a fake process group
(:mod:`memfit.estimator.distributed_trace`) and a user's own loop
(``lock.settings.apply(model)``). So what memfit measures, what it predicts and what the
user trains are the same objects.

=============  ===========================================================  =========================
``shard``      what the ranks divide (PyTorch component)                    per-rank states
=============  ===========================================================  =========================
``none``       nothing: ``DistributedDataParallel`` (gradient buckets)      P + G + O + buckets
``optimizer``  optimizer state: DDP + ``ZeroRedundancyOptimizer`` (ZeRO-1)  P + G + O/N + buckets
``gradients``  gradients and optimizer state: FSDP2 ``fully_shard`` with    P/N + G/N + O/N, and the
               ``reshard_after_forward=False`` (full parameters kept from   full parameters of every
               forward to backward, as ZeRO-2)                              unit from forward to backward
``full``       everything: FSDP2 ``fully_shard`` (ZeRO-3)                   P/N + G/N + O/N, and one or
                                                                            two units' full parameters
``offload``    everything, kept on the host: FSDP2 ``fully_shard`` with     one or two units' full
               ``CPUOffloadPolicy`` (the optimizer steps on the CPU)       parameters; P/N + G/N + O/N
                                                                            in host memory
=============  ===========================================================  =========================

``offload`` applies to one GPU too (``world_size=1``: FSDP2 over a process group of one
rank), the usual way to train a model whose states do not fit on the card.

In bf16 or fp16 FSDP2 gets its mixed-precision policy (``MixedPrecisionPolicy``: full
parameters gathered in the half dtype, gradients reduced in fp32), as FSDP2 is set up for
half-precision training; autocast runs as well, as it does without a strategy.

With ``group_size=G`` (``gradients`` and ``full`` only), FSDP2 shards within groups of G
ranks and replicates across the N/G groups (hybrid sharding, HSDP: a 2-D device mesh
``(N/G, G)``, gradients all-reduced across groups).

FSDP2's units are the modules given by the workload (``Workload.fsdp_units``) or, by
default, the model's repeated blocks (:func:`memfit.run.settings.find_blocks`, the blocks
activation checkpointing uses), then the root module for what is left.

With ``world_size=1`` nothing is wrapped, even inside a process group (each rank then
trains alone, as memfit's probe does under torchrun); with more, the default process
group must have exactly that many ranks.

>>> check_strategy("full", world_size=8, group_size=4)
>>> describe("full", 8, 4)
'HSDP: FSDP2 fully_shard over groups of 4 ranks, replicated over 2 groups'
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import MemfitError
from memfit.memory.devices import SimDevice
from memfit.memory.tracker import labelled
from memfit.run.strategy import OFFLOAD_SHARDS, SHARDS, Shard, check_strategy, component, describe

#: the breakdown's names for DDP's and FSDP2's own memory (``Labels.role``)
COMMUNICATION = "communication buffers"
UNSHARDED = "unsharded parameters"

__all__ = [
    "Shard",
    "SHARDS",
    "Units",
    "Parallel",
    "check_strategy",
    "describe",
    "component",
    "group_world_size",
    "parallelize",
    "wrap_optimizer",
    "device_mesh",
    "is_fake_group",
    "clear_meshes",
    "fake_process_group",
    "check_offload_device",
    "collective_internals_untracked",
    "COMMUNICATION",
    "UNSHARDED",
]

#: the modules that become FSDP2 units, given the model
Units = Callable[[nn.Module], Iterable[nn.Module]]


def group_world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_fake_group() -> bool:
    """True when the default process group is PyTorch's fake backend (the estimator's trace)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


_MESHES: dict[tuple[int, str, tuple[int, ...]], Any] = {}


def device_mesh(device_type: str, world_size: int, group_size: int | None = None) -> Any:
    """The device mesh FSDP2 shards over: 1-D of all ranks, or 2-D ``(replicas, group)`` for HSDP.

    Why outside every dispatch mode: the mesh holds a small CPU tensor of rank numbers,
    which must be a real tensor (not a fake one) and is no GPU memory (a storage tracker
    must not count it). Why cached per process group: a 2-D mesh creates sub-groups, a
    collective every rank must call in the same order; one mesh per group serves every run.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import _disable_current_modes

    group = dist.distributed_c10d._get_default_group()
    shape = (world_size,) if not group_size or group_size == world_size else (world_size // group_size, group_size)
    key = (id(group), device_type, shape)
    mesh = _MESHES.get(key)
    if mesh is None:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        with _disable_current_modes():
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        _MESHES.clear()  # meshes of a destroyed group must not be reused by id
        _MESHES[key] = mesh
    return mesh


def clear_meshes() -> None:
    """Forget the cached meshes (their process group is being destroyed)."""
    _MESHES.clear()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank ``rank`` of a fake process group of ``world_size`` ranks for the block.

    PyTorch's ``"fake"`` backend (``torch.testing._internal.distributed.fake_pg``): every
    collective returns at once and moves nothing, so one process plays one rank, for the
    estimator's trace (fake tensors) or a rehearsal (real tensors on a device). The group
    is torch.distributed's default group, global to the process: a process already in a
    process group is refused (that group is the user's), and the group made here is
    destroyed in ``finally`` whatever happens.
    """
    if dist.is_initialized():
        raise MemfitError(
            "this process is already in a process group (torchrun, Lightning): a fake one of "
            f"{world_size} ranks cannot be made beside it"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        clear_meshes()
        dist.destroy_process_group()


@dataclass
class Parallel:
    """A model made ready for its ranks.

    ``model`` is what to train: a ``DistributedDataParallel`` around the model, or the
    model itself (FSDP2 shards it in place). ``shard`` and ``world_size`` say how.
    """

    model: nn.Module
    shard: Shard
    world_size: int
    group_size: int | None = None

    @property
    def wrapped(self) -> bool:
        return self.world_size > 1 or self.shard in OFFLOAD_SHARDS

    def optimizer(
        self, make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The optimizer for :attr:`model`: ``make_optimizer(params)``, sharded by ZeRO-1 under
        ``shard="optimizer"``."""
        made = make_optimizer(self.model.parameters())
        if self.shard == "optimizer" and self.wrapped:
            return wrap_optimizer(made)
        return made


def parallelize(
    model: nn.Module,
    shard: Shard,
    world_size: int,
    *,
    units: Units | None = None,
    group_size: int | None = None,
    precision: str = "fp32",
    device: torch.device | str | None = None,
) -> Parallel:
    """Wrap ``model`` for the ``world_size`` ranks of the default process group under ``shard``.

    Call it once the model is on its device (and checkpointing applied); create the
    optimizer afterwards, from the returned model's parameters
    (:meth:`Parallel.optimizer`). With ``world_size=1`` the model is returned as it is.

    Args:
        model: the model, on its device.
        shard: ``none`` (DDP), ``optimizer`` (DDP + ZeRO-1), ``gradients`` (FSDP2 keeping
            full parameters from forward to backward) or ``full`` (FSDP2).
        world_size: ranks training together; the default process group must have as many.
        units: the modules that become FSDP2 units (default: none but the root; pass
            :func:`memfit.run.settings.find_blocks` for the repeated blocks).
        group_size: shard within groups of this many ranks and replicate across groups
            (HSDP; FSDP2 strategies only).
        device: where FSDP2 places each rank's shards (default: where the parameters
            are); a model built on the CPU is moved there unit by unit, shards only.
        precision: ``bf16`` or ``fp16`` gives FSDP2 its mixed-precision policy (the
            gathered full parameters in that dtype, gradients reduced in fp32), as FSDP2
            training in half precision is set up; DDP leaves precision to autocast.
    """
    check_strategy(shard, world_size, group_size)
    if world_size <= 1 and shard not in OFFLOAD_SHARDS:
        return Parallel(model, shard, 1)
    world = group_world_size() if dist.is_available() and dist.is_initialized() else 0
    if world != world_size:
        where = f"a process group of {world}" if world else "no process group"
        raise MemfitError(
            f"the settings are for {world_size} ranks but this process is in {where}: "
            f"launch with torchrun --nproc-per-node {world_size}"
        )
    if shard in ("none", "optimizer"):
        return Parallel(_ddp(model), shard, world)
    where = torch.device(device).type if device is not None else _device_type(model)
    _fully_shard(
        model, shard=shard, units=units, world=world, group_size=group_size, precision=precision, device_type=where
    )
    return Parallel(model, shard, world, group_size)


def check_offload_device(shard: str, device: object) -> None:
    """Refuse CPU offload on a simulated GPU outside the estimator's trace (one line).

    Why: on the CPU the host's tensors and the simulated GPU's are the same memory, so a
    real run there would count the host's states against the GPU; the estimator's trace
    (on the fake process group) places them apart (:mod:`memfit.estimator.offload`).
    """
    if shard in OFFLOAD_SHARDS and isinstance(device, SimDevice) and not is_fake_group():
        raise MemfitError(
            "--shard offload keeps states in host memory, which a simulated GPU cannot tell from its own: "
            "predict it with memfit estimate (or memfit plan), or measure it on a real GPU"
        )


def _device_type(model: nn.Module) -> str:
    for tensor in model.parameters():
        return tensor.device.type
    return "cpu"


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if not is_fake_group():
        return DistributedDataParallel(model)
    return _ddp_on_fake_group(model)


def _ddp_on_fake_group(model: nn.Module) -> nn.Module:
    """DDP on the fake backend (the estimator's trace), with the same buckets and copies.

    The fake backend neither reads tensors nor returns a bucket from its all-reduce, and
    fake tensors have no data. Three places of DDP need that, and get it:

    - the start-up check of every rank's parameter shapes reads them: it is skipped, and
      the start-up broadcast of parameters and buffers is done as DDP does it;
    - the reducer's all-reduce must hand the bucket back: a hook all-reduces it in place
      and returns it (every rank standing for one with the same gradients, their average
      is the bucket itself);
    - rebuilding the buckets after the first step (in the next forward) agrees on the
      new bucket order through small int32 tensors DDP fills and reads on the CPU: in
      that forward's preamble, int32 tensors (and operations on real tensors only) are
      made real, while the buckets themselves stay fake.

    DDP's own memory is labelled ``communication buffers`` for the breakdown.
    """
    from torch.distributed.utils import _sync_module_states
    from torch.nn.parallel import DistributedDataParallel

    with labelled(role=COMMUNICATION):
        _sync_module_states(
            module=model,
            process_group=dist.distributed_c10d._get_default_group(),
            broadcast_bucket_size=250 * 1024 * 1024,
            src=0,
            params_and_buffers_to_ignore=set(),
            broadcast_buffers=True,
        )
        wrapped = DistributedDataParallel(model, init_sync=False)
    wrapped.register_comm_hook(None, _in_place_all_reduce)
    original = wrapped._pre_forward

    def pre_forward(*args: Any, **kwargs: Any) -> Any:
        with labelled(role=COMMUNICATION), _RealIndexTensors():
            return original(*args, **kwargs)

    wrapped._pre_forward = pre_forward  # type: ignore[method-assign]
    return wrapped


class _RealIndexTensors(TorchDispatchMode):
    """Make int32 tensors (DDP's bucket indices), and operations on real tensors only, real."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        index = func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") == torch.int32
        if index or (tensors and not any(isinstance(t, FakeTensor) for t in tensors)):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _in_place_all_reduce(_state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    # On the fake backend every rank stands for one holding the same gradients, whose
    # average is this rank's own: the bucket is handed back as it is (in place, as DDP's
    # own all-reduce works).
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    return work.get_future().then(lambda _future: buffer)


# DDP checks a hook's annotations against the real classes (not the strings postponed
# evaluation leaves), so they are set to the classes themselves.
_in_place_all_reduce.__annotations__ = {
    "_state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fully_shard(
    model: nn.Module,
    *,
    shard: Shard,
    units: Units | None,
    world: int,
    group_size: int | None,
    precision: str,
    device_type: str,
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(device_type, world, group_size)
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": shard in ("full", "offload")}
    if shard in OFFLOAD_SHARDS:
        from torch.distributed.fsdp import CPUOffloadPolicy

        # pinned host memory needs CUDA; a simulated GPU (the CPU) keeps pageable memory
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    if precision in _HALF:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=_HALF[precision], reduce_dtype=torch.float32)
    chosen = [] if units is None else [unit for unit in units(model) if unit is not model]
    for unit in chosen:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    if is_fake_group():
        _loopback_collectives(model)


def _loopback_collectives(model: nn.Module) -> None:
    """On the fake backend, FSDP2's all-gather and reduce-scatter fill their outputs as if
    every rank held this rank's data.

    Why: the fake backend moves nothing, so a rehearsal on real tensors (one rank of N
    on a real or simulated GPU) would compute on uninitialised memory, and a GradScaler
    seeing inf would skip the optimizer step (and its state). With every rank standing
    for one like this one, the gathered parameters are this rank's shard repeated and
    the averaged gradient is this rank's own. The fill is one in-place copy: nothing is
    allocated, so memory is what FSDP2 itself allocates. Fake tensors need no fill.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:  # pragma: no cover - another FSDP2 layout: values stay unfilled
        return

    class LoopbackAllGather(DefaultAllGather):
        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
        ) -> Any:
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            if not _is_fake_tensor(input_tensor):
                slots = output_tensor.view(group.size(), -1)
                slots.copy_(input_tensor.reshape(1, -1).expand_as(slots))
            return work

    class LoopbackReduceScatter(DefaultReduceScatter):
        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            if not _is_fake_tensor(input_tensor):
                output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))
            return work

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(LoopbackAllGather())
            module.set_custom_reduce_scatter(LoopbackReduceScatter())


def _is_fake_tensor(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def wrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (class, hyper-parameters, parameter groups) as a
    ``ZeroRedundancyOptimizer``: each rank keeps the state of its share of the parameters.

    Why from an instance: a workload hands out optimizers through a factory
    (``optimizer(params)``); its class, defaults and groups say everything ZeRO needs.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if optimizer.state:
        raise MemfitError("ZeRO-1 must wrap a fresh optimizer (this one has already stepped)")
    accepted = set(inspect.signature(type(optimizer).__init__).parameters)
    groups = [dict(group) for group in optimizer.param_groups]
    first = groups[0]
    # A group also holds settings the class fixes itself (AdamW's decoupled_weight_decay).
    kwargs = {key: value for key, value in first.items() if key != "params" and key in accepted}
    zero = ZeroRedundancyOptimizer(first["params"], optimizer_class=type(optimizer), **kwargs)
    for group in groups[1:]:
        zero.add_param_group(group)
    return zero


_wait_lock = threading.Lock()
_wait_users = 0
_original_wait: Any = None


def _wait_untracked(work: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _original_wait(work, *args, **kwargs)


@contextlib.contextmanager
def collective_internals_untracked() -> Iterator[None]:
    """While a collective is waited for, no dispatch mode (no storage tracker) sees what runs.

    Why: a communication library's own buffers are not the caching allocator's (NCCL
    allocates its own); gloo on the CPU copies a reduce-scatter's input on its worker
    thread and slices the copy on the waiting thread inside ``Work.wait()``, where a
    simulated GPU would count it. With waits untracked, a real run on ``sim:`` devices
    counts what a CUDA job's allocator would, as the fake process group's trace does.
    """
    global _wait_users, _original_wait
    if not dist.is_available():
        yield
        return
    with _wait_lock:
        if _wait_users == 0:
            _original_wait = dist.Work.wait
            dist.Work.wait = _wait_untracked  # type: ignore[method-assign,assignment]
        _wait_users += 1
    try:
        yield
    finally:
        with _wait_lock:
            _wait_users -= 1
            if _wait_users == 0:
                dist.Work.wait = _original_wait  # type: ignore[method-assign]
