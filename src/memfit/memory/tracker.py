"""Watch every tensor storage that PyTorch code creates or frees, on real or fake tensors.

Why a dispatch mode: it sees every ATen operation after autograd, in forward, backward
and the optimizer alike, so the stream of storage allocations and frees it reports is the
one a GPU's allocator would receive. What counts as being on the device (a host tensor
made outside does not; what the code puts on the GPU does) is the rule written out in
``docs/design.md`` ("What the simulated GPU counts"), applied in
:meth:`StorageTracker.__torch_dispatch__` and by :class:`Placement` (the Python calls). Frees are observed through weak references on the
storages, so they arrive exactly when the last tensor (or saved-for-backward reference)
lets go. The same stream drives the simulated GPU (real tensors on the CPU) and the
estimator (fake tensors: shapes only, no memory, no arithmetic).

>>> import torch
>>> events = []
>>> class Recorder:
...     def allocated(self, nbytes, labels): events.append(nbytes); return len(events)
...     def freed(self, handle): pass
>>> with StorageTracker(Recorder()):
...     x = torch.ones(256)
>>> events
[1024]
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.cuda.counting import counting

__all__ = [
    "StorageTracker",
    "Placement",
    "StorageListener",
    "Labels",
    "current_labels",
    "labelled",
    "module_labels",
    "storages_of",
]


@dataclass(frozen=True)
class Labels:
    """What the program was doing when a storage was allocated."""

    phase: str = "other"  # "forward", "backward", "optimizer", "other"
    step: int = -1  # optimizer step index, -1 outside a step
    module: str = ""  # dotted path of the innermost module running its forward
    #: what the allocating code says the memory is for, when it knows better than the phase
    #: ("communication buffers", "unsharded parameters": DDP's and FSDP2's own memory)
    role: str = ""


_state = threading.local()


def current_labels() -> Labels:
    """The labels set by the innermost :func:`labelled` block on this thread."""
    return getattr(_state, "labels", Labels())


@contextlib.contextmanager
def labelled(**changes: Any) -> Iterator[None]:
    """Label the allocations made inside the block (for example ``phase="backward"``).

    Why thread-local: the autograd engine may run backward on its own threads, which keep
    the label of the thread that set it only when the caller labels the whole backward.
    """
    previous = current_labels()
    _state.labels = Labels(**{**previous.__dict__, **changes})
    try:
        yield
    finally:
        _state.labels = previous


@contextlib.contextmanager
def module_labels(model: nn.Module) -> Iterator[None]:
    """Label allocations with the dotted path of the module whose forward made them.

    Why hooks on every module: the estimator reports which modules hold the most
    activation memory, and only the module running at allocation time knows. A forward
    pre-hook opens the label and the forward hook closes it (no ``with`` block spans the
    two callbacks), so the labels are set here, beside the thread-local they live in.

    Args:
        model: the module whose submodules label what their forward allocates.
    """
    stack: list[Labels] = []
    handles = []
    for name, module in model.named_modules():

        def enter(_module: nn.Module, _args: object, name: str = name) -> None:
            stack.append(current_labels())
            _state.labels = Labels(**{**stack[-1].__dict__, "module": name or "<root>"})

        def leave(_module: nn.Module, _args: object, _out: object) -> None:
            if stack:
                _state.labels = stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    outer = current_labels()
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        _state.labels = outer


class StorageListener(Protocol):
    """Receives allocations and frees from a :class:`StorageTracker`."""

    def allocated(self, nbytes: int, labels: Labels) -> int:
        """Account ``nbytes``; return a handle. May raise to refuse (an OOM)."""

    def freed(self, handle: int) -> None:
        """The storage behind ``handle`` was freed."""


#: tensor type -> True when it is a wrapper subclass (DTensor) whose memory is its inner tensors'
_WRAPPERS: dict[type, bool] = {}


def _is_wrapper(kind: type) -> bool:
    wrapper = _WRAPPERS.get(kind)
    if wrapper is None:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

        wrapper = _WRAPPERS[kind] = is_traceable_wrapper_subclass_type(kind)
    return wrapper


def _tensors(value: Any, found: list[torch.Tensor]) -> None:
    """Collect the tensors in an operation's nested lists, tuples and dicts.

    Why not a pytree flatten: this runs twice per operation, and ATen arguments are only
    ever these containers; the plain walk is markedly cheaper (it matters for the fake
    steps of a 7B model). A wrapper subclass (FSDP2's and ZeRO's DTensor) owns no memory
    of its own: its storage reports the *global* size; what a GPU holds is its inner
    (local) tensors, so those are collected instead.
    """
    if isinstance(value, torch.Tensor):
        if _is_wrapper(type(value)):
            attrs, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
            for attr in attrs:
                _tensors(getattr(value, attr), found)
            return
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)


def storages_of(values: Any) -> Iterator[torch.UntypedStorage]:
    """The storages of the tensors in ``values`` (an operation's nested arguments or results).

    A wrapper subclass (DTensor) yields its local tensors' storages; sparse and other
    storage-less tensors yield none.

    Args:
        values: a tensor, or lists, tuples and dicts of them (other values are skipped).
    """
    found: list[torch.Tensor] = []
    _tensors(values, found)
    for tensor in found:
        storage = _storage_of(tensor)
        if storage is not None:
            yield storage


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


#: operations that read a host tensor into a device one (or back) without the host tensor
#: being on the device: ``gpu.copy_(cpu)`` is a host-to-device copy on a GPU
_COPIES = ("aten.copy_.default", "aten._copy_from.default", "aten._copy_from_and_resize.default")


def _indexes_host(args: tuple[Any, ...], host: list[torch.UntypedStorage]) -> bool:
    """True when an indexing operation's source (its first argument) is a host tensor."""
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    storage = _storage_of(source) if source is not None else None
    return storage is not None and any(storage is held for held in host)


#: operations that pick elements of their first argument by an index: on a GPU the index of
#: a host tensor is a host tensor (``data[idx]`` of a dataset on the host is a host batch)
_HOST_INDEXING = (
    "aten.index.Tensor",
    "aten.index_select.default",
    "aten.take.default",
    "aten.gather.default",
    "aten.masked_select.default",
)


# -- storage resizes: FSDP2 allocates and frees unsharded parameters by resizing storages ----
#
# ``UntypedStorage.resize_`` is not an ATen operation, so no dispatch mode sees it; FSDP2
# frees each unit's full parameters with ``storage.resize_(0)`` and brings them back with
# ``storage.resize_(nbytes)``. While a tracker is active on a thread, ``resize_`` is
# wrapped so that thread's trackers see the new size at once (a free, or an allocation).

_active = threading.local()
_resize_lock = threading.Lock()
_resize_users = 0
_original_resize: Any = None


def _active_trackers() -> list[StorageTracker]:
    trackers: list[StorageTracker] | None = getattr(_active, "trackers", None)
    if trackers is None:
        trackers = _active.trackers = []
    return trackers


def _resize_and_report(storage: torch.UntypedStorage, size: int) -> Any:
    out = _original_resize(storage, size)
    for tracker in list(getattr(_active, "trackers", ())):
        tracker._see(storage)
    return out


def _watch_resizes(tracker: StorageTracker) -> None:
    global _resize_users, _original_resize
    with _resize_lock:
        if _resize_users == 0:
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _resize_and_report  # type: ignore[method-assign,assignment]
        _resize_users += 1
    _active_trackers().append(tracker)


def _unwatch_resizes(tracker: StorageTracker) -> None:
    global _resize_users
    trackers = _active_trackers()
    if tracker in trackers:
        trackers.reverse()
        trackers.remove(tracker)  # the innermost entry
        trackers.reverse()
    with _resize_lock:
        _resize_users -= 1
        if _resize_users == 0:
            torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]


class Placement(TorchFunctionMode):
    """Where the code would put a tensor on a GPU, seen from the Python calls themselves.

    Why a function mode: ``.to("cpu")`` of a CPU tensor reaches no ATen operation at all,
    so the dispatch mode cannot see it. ``tensor.to(device)`` of a tensor the device does
    not hold is a host-to-device copy on a GPU: here it becomes a copy the device holds
    (the view's bytes, not the whole storage it may be a view of); ``.to`` of a held
    tensor returns it as it is.

    Args:
        tracker: the device's tracker (what it holds, and where a copy is counted).
    """

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not counting():
            return out
        if func is torch.Tensor.to and args:
            return self._placed(args[0], out, args[1:], kwargs)
        # ``torch.tensor(data)`` is a host tensor, device="cpu" or not (torch's own code
        # names "cpu" for what stays on the host: Adam's step counters)
        return out

    def _placed(self, tensor: torch.Tensor, out: torch.Tensor, args: tuple[Any, ...], kwargs: Any) -> torch.Tensor:
        if isinstance(tensor, torch.nn.Parameter) or _is_wrapper(type(tensor)) or self.tracker.tracks(out):
            return out  # a parameter counts where it is used; a DTensor is its local tensors
        try:
            target = torch._C._nn._parse_to(*args, **kwargs)[0]
        except (TypeError, RuntimeError):
            return out
        if target is None or torch.device(target).type != "cpu":
            return out
        placed = out.clone() if out is tensor else out
        self.tracker.adopt([placed])
        return placed


class StorageTracker(TorchDispatchMode):
    """A dispatch mode that reports each storage's allocation and free to a listener.

    A storage is reported the first time the mode sees it, as an operation's output or
    input; :meth:`adopt` reports tensors that existed before (parameters, optimizer state)
    up front. A storage stays tracked until it is freed, across several ``with`` blocks.
    """

    def __init__(self, listener: StorageListener) -> None:
        super().__init__()
        self.listener = listener
        self._lock = threading.Lock()
        # id(storage) -> (weak reference, handle, nbytes). The weak reference's callback
        # removes the entry and reports the free, so an id is never reused while present.
        self._tracked: dict[int, tuple[weakref.ref, int, int]] = {}

    # -- what the device and the estimator call ----------------------------------------

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Start tracking tensors that already exist (for example a model's parameters)."""
        for storage in storages_of(list(tensors)):
            self._see(storage)

    def tracks(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor``'s storage is tracked (counted by the listener) now."""
        try:
            key = id(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return False
        with self._lock:
            return key in self._tracked

    @property
    def tracked_bytes(self) -> int:
        with self._lock:
            return sum(nbytes for _, _, nbytes in self._tracked.values())

    def forget_all(self) -> None:
        """Report every tracked storage as freed (the device is being discarded)."""
        with self._lock:
            entries = list(self._tracked.values())
            self._tracked.clear()
        for _, handle, _ in entries:
            self.listener.freed(handle)

    # -- the dispatch mode -------------------------------------------------------------

    def __enter__(self) -> StorageTracker:
        _watch_resizes(self)
        try:
            super().__enter__()
        except BaseException:
            _unwatch_resizes(self)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _unwatch_resizes(self)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not counting():  # CPU-only scratch work of an emulated CUDA kernel (memfit.cuda)
            return self._call(func, args, kwargs)
        inputs: list[torch.Tensor] = []
        _tensors((args, kwargs), inputs)
        on_device, host = self._sort_inputs(inputs)
        if host and str(func) in _HOST_INDEXING and _indexes_host(args, host):
            on_device = False  # a host tensor indexed: on a GPU its index is a host tensor too
        elif on_device and host and str(func) not in _COPIES:
            # A host tensor meeting a device tensor: on a GPU it must have been moved there.
            for storage in host:
                self._see(storage)
        out = self._call(func, args, kwargs)
        if on_device or not inputs:  # made on the device (a factory: torch.zeros, arange)
            for storage in storages_of(out):
                self._see(storage)
        return out

    def _sort_inputs(self, inputs: list[torch.Tensor]) -> tuple[bool, list[torch.UntypedStorage]]:
        """Whether an operation has a device tensor among its inputs, and the storages of
        its host tensors other than 0-dim scalars (which a GPU operation reads from the
        host). A parameter counts as on the device, wherever it was made."""
        on_device = False
        host: list[torch.UntypedStorage] = []
        for tensor in inputs:
            storage = _storage_of(tensor)
            if storage is None:
                continue
            with self._lock:
                tracked = id(storage) in self._tracked
            if tracked or isinstance(tensor, torch.nn.Parameter):
                self._see(storage)  # tracked: a resize in place is seen; a parameter: counted
                on_device = True
            elif tensor.dim() > 0:
                host.append(storage)
        return on_device, host

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the operation (a subclass may turn some of its errors into clearer ones)."""
        return func(*args, **kwargs)

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            entry = self._tracked.get(key)
        if entry is not None:
            if entry[2] == nbytes:
                return
            self._forget(key)  # resized in place (resize_, out= kernels): free, then allocate
        if nbytes == 0:
            return
        handle = self.listener.allocated(nbytes, current_labels())  # may raise an OOM
        ref = weakref.ref(storage, functools.partial(self._forgotten, key))
        with self._lock:
            self._tracked[key] = (ref, handle, nbytes)

    def _forgotten(self, key: int, _ref: object) -> None:
        """The weak reference's callback: the storage was freed."""
        self._forget(key)

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._tracked.pop(key, None)
        if entry is not None:
            self.listener.freed(entry[1])
