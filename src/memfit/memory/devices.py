"""Devices behind one interface: a real GPU (``cuda[:i]``), the CPU, or a simulated GPU.

Why one interface: probe, plan, guard and monitor run training steps and read memory
statistics without caring where. ``sim:SIZE`` runs real tensors on the CPU under a
:class:`~memfit.memory.tracker.StorageTracker` feeding the CUDA caching-allocator model,
and raises CUDA's ``torch.OutOfMemoryError`` when modeled reserved memory would pass the
budget, so the whole of memfit can be exercised (and trusted) on a machine without a GPU.

>>> import torch, memfit
>>> with memfit.device("sim:64MiB") as gpu:
...     x = torch.zeros(1024, 1024)  # 4 MiB, served from a 20 MiB segment
...     gpu.memory_stats()["reserved_bytes.all.current"] // 2**20
20
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch

from memfit.cuda.context import fixed_costs, resolve_cuda_version
from memfit.cuda.semantics import cuda_semantics
from memfit.cuda.target import CudaTarget
from memfit.distributed import launched_by_torchrun
from memfit.errors import DeviceError, MemfitError
from memfit.memory.allocator import AllocationFailed, CachingAllocatorModel
from memfit.memory.gpus import GPU, lookup
from memfit.memory.tracker import Labels, Placement, StorageTracker, current_labels
from memfit.units import format_size, parse_size

__all__ = [
    "Device",
    "CudaDevice",
    "SimDevice",
    "device",
    "rank_device",
    "active_device",
    "DEFAULT_SIM_MEMORY",
    "oom_message",
    "labels_as_frames",
]

DEFAULT_SIM_MEMORY = "8GiB"

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: the devices entered in this thread, innermost last (see :func:`active_device`)
_entered = threading.local()


def active_device() -> Device | None:
    """The innermost memfit device entered in this thread (``with memfit.device(...)``), or None.

    Why: code beside the training loop (the guard's OOM events) must read the memory of
    the device the loop runs on, a simulated one included, without being handed it.
    """
    stack: list[Device] = getattr(_entered, "stack", [])
    return stack[-1] if stack else None


def _push(entered: Device) -> None:
    _entered.stack = [*getattr(_entered, "stack", []), entered]


def _pop(left: Device) -> None:
    stack: list[Device] = getattr(_entered, "stack", [])
    if stack and stack[-1] is left:
        _entered.stack = stack[:-1]


class Device(ABC):
    """Where training steps run and memory is measured."""

    #: the spec string this device was made from ("cuda:0", "sim:8GiB", "cpu")
    spec: str
    #: where tensors of this device live
    torch_device: torch.device
    #: bytes the workload may reserve, or None for no limit
    capacity: int | None
    #: ``device_type`` for ``torch.amp.autocast`` and ``GradScaler``
    autocast_device_type: str
    #: True for the simulated GPU and the CPU
    simulated: bool = False

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Allocator statistics under ``torch.cuda.memory_stats()`` key names."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Set the peaks to the current values."""

    def synchronize(self) -> None:
        """Wait for queued work (so a step's time is its real duration)."""
        return None

    def empty_cache(self) -> None:
        """Return cached, unused memory to the device."""
        return None

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the device was entered (the real GPU already does)."""
        return None

    def supports(self, precision: str) -> bool:
        """True when training in ``precision`` works on this device."""
        return True

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor``'s memory counts on this device (what a leak check sums)."""
        return tensor.device == self.torch_device

    def memory_allocated(self) -> int:
        return self.memory_stats().get("allocated_bytes.all.current", 0)

    def memory_reserved(self) -> int:
        return self.memory_stats().get("reserved_bytes.all.current", 0)

    def describe(self) -> str:
        """One line naming the device and its capacity."""
        capacity = format_size(self.capacity) if self.capacity else "no limit"
        return f"{self.spec} ({capacity})"

    def __repr__(self) -> str:
        return f"<memfit device {self.describe()}>"


def oom_message(requested: int, stats: dict[str, Any], capacity: int, label: str) -> str:
    """CUDA's OOM message, so the simulated GPU's errors read like the real ones."""
    reserved = stats["reserved_bytes.all.current"]
    allocated = stats["allocated_bytes.all.current"]
    return (
        f"CUDA out of memory. Tried to allocate {format_size(requested)}. "
        f"GPU 0 ({label}) has a total capacity of {format_size(capacity)} of which "
        f"{format_size(capacity - reserved)} is free. Of the allocated memory "
        f"{format_size(allocated)} is allocated by PyTorch, and "
        f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated."
    )


_SIM_GPU = "sim-gpu"  # the default of SimDevice's ``cuda``: a simulated GPU's CUDA semantics


class SimDevice(Device):
    """A GPU simulated on the CPU: real tensors, CUDA's allocator rules, a memory budget.

    ``capacity=None`` gives an unlimited device (``cpu``): the same accounting, no OOM.
    ``record=True`` keeps every allocation and free in :attr:`events` (for breakdowns).
    ``cuda`` is the CUDA GPU whose semantics the steps follow (:mod:`memfit.cuda.semantics`:
    attention kernels, autocast lists, fused dropout, cuDNN RNNs): by default the
    simulated GPU's (:class:`~memfit.cuda.target.CudaTarget`), except for the plain
    ``cpu`` device, which keeps the CPU's; ``None`` keeps the CPU's.
    """

    simulated = True
    autocast_device_type = "cpu"
    #: the card it stands for (``sim:RTX 3090``): its precisions, and the speed plan ranks by
    gpu: GPU | None = None

    def __init__(
        self,
        capacity: int | None,
        spec: str | None = None,
        *,
        record: bool = False,
        cuda: CudaTarget | str | None = _SIM_GPU,
    ) -> None:
        self.capacity = capacity
        self.spec = spec or (f"sim:{format_size(capacity).replace(' ', '')}" if capacity else "cpu")
        self.torch_device = torch.device("cpu")
        self.allocator = CachingAllocatorModel(budget=capacity)
        self.tracker = StorageTracker(self)
        self.events: list[tuple[str, int, int, Labels]] | None = [] if record else None
        if cuda == _SIM_GPU:
            cuda = None if self.spec == "cpu" else CudaTarget()
        assert cuda is None or isinstance(cuda, CudaTarget)
        #: the CUDA GPU whose semantics runs on this device follow, or None for the CPU's
        self.cuda: CudaTarget | None = cuda
        self._depth = 0
        self._semantics: contextlib.ExitStack | None = None

    # -- StorageListener: the tracker reports here -------------------------------------

    def allocated(self, nbytes: int, labels: Labels) -> int:
        try:
            handle = self.allocator.malloc(nbytes, labels_as_frames(labels) if self.allocator.recording else None)
        except AllocationFailed as failure:
            # Raised from inside the failing operation, as CUDA's allocator does.
            raise torch.OutOfMemoryError(
                oom_message(failure.requested, failure.stats, failure.budget, f"simulated, {self.spec}")
            ) from None
        if self.events is not None:
            self.events.append(("alloc", handle, nbytes, labels))
        return handle

    def freed(self, handle: int) -> None:
        self.allocator.free(handle, labels_as_frames(current_labels()) if self.allocator.recording else None)
        if self.events is not None:
            # Labelled with the moment of the free: the breakdown tells a gradient (freed
            # by zero_grad in the optimizer phase) from a backward temporary by it.
            self.events.append(("free", handle, 0, current_labels()))

    # -- Device ------------------------------------------------------------------------

    def __enter__(self) -> SimDevice:
        if self._depth == 0:
            stack = contextlib.ExitStack()
            if self.cuda is not None:
                stack.enter_context(cuda_semantics(self.cuda))
            stack.enter_context(self.tracker)
            # what a GPU would hold: host factories and .to(device) (docs/design.md)
            stack.enter_context(Placement(self.tracker))
            self._semantics = stack
        self._depth += 1
        _push(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _pop(self)
        self._depth -= 1
        if self._depth == 0 and self._semantics is not None:
            stack, self._semantics = self._semantics, None
            stack.__exit__(*exc)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tracker.adopt(tensors)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.tracker.tracks(tensor)

    def memory_stats(self) -> dict[str, int]:
        return self.allocator.stats()

    def reset_peak_memory_stats(self) -> None:
        self.allocator.reset_peak()

    def empty_cache(self) -> None:
        self.allocator.empty_cache()

    def supports(self, precision: str) -> bool:
        if precision == "bf16" and self.gpu is not None:
            return self.gpu.bf16
        return True  # the CPU autocasts to bf16 and fp16

    def describe(self) -> str:
        if self.capacity is None:
            return "cpu (no limit; memory counted with the CUDA allocator model)"
        card = self.gpu.name if self.gpu is not None else "GPU"
        return f"{self.spec} (simulated {card}, {format_size(self.capacity)})"


class CudaDevice(Device):
    """A real CUDA GPU, optionally capped to emulate a smaller card."""

    autocast_device_type = "cuda"

    def __init__(self, index: int, memory: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise DeviceError(_no_cuda_reason())
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceError(f"cuda:{index} does not exist: this machine has {count} GPU(s)")
        self.spec = f"cuda:{index}"
        self.torch_device = torch.device("cuda", index)
        total = torch.cuda.get_device_properties(index).total_memory
        if memory is not None and memory > total:
            raise DeviceError(f"--memory {format_size(memory)} is more than {self.spec} has ({format_size(total)})")
        self.capacity = memory or total
        if memory is not None:
            # The caching allocator then fails like a card of this size would.
            torch.cuda.set_per_process_memory_fraction(memory / total, index)

    def __enter__(self) -> CudaDevice:
        self._previous = torch.cuda.current_device()
        torch.cuda.set_device(self.torch_device)
        _push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _pop(self)
        torch.cuda.set_device(self._previous)

    def memory_stats(self) -> dict[str, int]:
        return dict(torch.cuda.memory_stats(self.torch_device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def supports(self, precision: str) -> bool:
        if precision == "bf16":
            return torch.cuda.is_bf16_supported()
        return True

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.torch_device)
        return f"{self.spec} ({name}, {format_size(self.capacity or 0)})"


def labels_as_frames(labels: Labels) -> list[dict[str, Any]]:
    """What the program was doing, as the one stack frame PyTorch's memory viewer shows:
    ``module:step:phase`` (the dotted module path, the optimizer step, the phase).

    >>> labels_as_frames(Labels(phase="forward", step=1, module="blocks.0.attn"))
    [{'filename': 'blocks.0.attn', 'line': 1, 'name': 'forward'}]
    """
    return [{"filename": labels.module or "<step>", "line": labels.step, "name": labels.phase}]


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return (
            f"CUDA was asked for, but this torch ({torch.__version__}) is a CPU-only build; "
            "run `memfit doctor`, or use --device sim:8GiB"
        )
    return "CUDA was asked for, but no GPU is visible; run `memfit doctor`, or use --device sim:8GiB"


_SPEC_RE = re.compile(r"^(?P<kind>cuda|cpu|sim|auto)(?::(?P<arg>.+))?$")


def device(spec: str | Device = "auto", *, memory: int | str | None = None) -> Device:
    """Make a device from a spec: ``cuda``, ``cuda:1``, ``cpu``, ``sim:8GiB``, ``sim:RTX 3090`` or ``auto``.

    Args:
        spec: ``cuda[:N]`` (a real GPU), ``cpu``, ``sim:SIZE`` (a GPU simulated on the
            CPU), ``sim:GPU`` (a card of :mod:`memfit.memory.gpus` simulated: its memory
            less the fixed costs, its precisions, its speed for plan), or ``auto`` (the first GPU when there is one, else ``sim:8GiB``); a device
            is returned as it is.
        memory: caps a real GPU (emulating a smaller card) or sizes a ``sim`` device.
    """
    if isinstance(spec, Device):
        return spec
    text = spec.strip()
    match = _SPEC_RE.match(text[:4].lower() + text[4:])
    if match is None:
        raise DeviceError(f"unknown device {spec!r}: use cuda, cuda:N, cpu, sim:SIZE (such as sim:8GiB) or auto")
    kind, arg = match.group("kind"), match.group("arg")
    cap = parse_size(memory) if memory is not None else None
    if kind == "auto":
        if arg is not None:
            raise DeviceError(f"unknown device {spec!r}: 'auto' takes no argument")
        kind = "cuda" if torch.cuda.is_available() else "sim"
        arg = None if kind == "cuda" else (arg or DEFAULT_SIM_MEMORY)
    if kind == "cuda":
        if arg is not None and not arg.isdigit():
            raise DeviceError(f"unknown device {spec!r}: the GPU index must be a number (cuda:0)")
        return CudaDevice(int(arg or 0), cap)
    if kind == "cpu":
        if arg is not None:
            raise DeviceError(f"unknown device {spec!r}: 'cpu' takes no argument")
        return SimDevice(cap, "cpu") if cap else SimDevice(None)
    if arg is None and cap is None:
        raise DeviceError(f"device {spec!r} needs a size, such as sim:8GiB")
    if arg is not None and arg[:1].isalpha():
        return _sim_card(arg, spec, cap)
    try:
        size = cap if cap is not None else parse_size(arg or "")
    except MemfitError as error:
        raise DeviceError(f"unknown device {spec!r}: {error}") from None
    return SimDevice(size, f"sim:{arg}" if arg else None)


def _sim_card(name: str, spec: str, capacity: int | None) -> SimDevice:
    """``sim:RTX 3090``: the card's usable memory less what the allocator never sees (the
    estimator's fixed costs for the installed CUDA: :func:`memfit.cuda.context.fixed_costs`),
    or ``capacity``; its precisions and its CUDA semantics (compute capability); and its
    speed for plan."""
    try:
        card = lookup(name)
    except MemfitError as error:
        raise DeviceError(f"unknown device {spec!r}: give a size (sim:8GiB) or a GPU of the table: {error}") from None
    cuda, _ = resolve_cuda_version(None)
    usable = card.memory - sum(fixed_costs(card.family, card.compute_capability[0], cuda).values())
    # the card's own CUDA semantics too: its compute capability picks the attention kernels
    semantics = CudaTarget(card.compute_capability, cuda, card.name)
    sim = SimDevice(capacity if capacity is not None else usable, f"sim:{card.name}", cuda=semantics)
    sim.gpu = card
    return sim


def rank_device(spec: str, rank: int | None = None, local_rank: int | None = None) -> str:
    """The device spec for this rank: its own GPU for ``auto``/``cuda``, its size of a ``sim:`` list.

    Per-rank sizes: ``sim:24GiB,16GiB`` gives rank 0 the first size and rank 1 the second
    (the last size is repeated for further ranks), to rehearse a job over unequal GPUs on
    one CPU.

    >>> rank_device("sim:8GiB,4GiB", rank=1)
    'sim:4GiB'
    >>> rank_device("cpu", rank=3)
    'cpu'
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    local = int(os.environ.get("LOCAL_RANK", str(rank))) if local_rank is None else local_rank
    text = spec.strip()
    if text.lower().startswith("sim:") and "," in text:
        sizes = [size.strip() for size in text[4:].split(",") if size.strip()]
        return f"sim:{sizes[min(rank, len(sizes) - 1)]}"
    if text.lower() in ("auto", "cuda") and torch.cuda.is_available() and launched_by_torchrun():
        return f"cuda:{local % torch.cuda.device_count()}"
    return text
