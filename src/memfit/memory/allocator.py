"""A model of PyTorch's CUDA caching allocator, in pure Python.

Why a model: the simulated GPU and the estimator must say how much memory CUDA would
*reserve*, not only how many bytes tensors hold. Reserved memory is what runs out, and it
is larger than allocated memory because of rounding, segment sizes and cached blocks.
The rules follow ``c10/cuda/CUDACachingAllocator.cpp`` (one stream, default settings):

- a request is rounded up to a multiple of 512 B (at least 512 B);
- requests up to 1 MiB live in the small pool, in 2 MiB segments; larger ones in the
  large pool, in 20 MiB segments when under 10 MiB, else in a segment of their own size
  rounded up to 2 MiB;
- a freed block stays cached in its segment, merges with free neighbours, and is reused
  best-fit (smallest block that is large enough, lowest address first);
- a block is split when the rest is worth keeping (small pool: at least 512 B; large
  pool: more than 1 MiB), otherwise the whole block is handed out;
- when a new segment would push reserved memory past the budget, every cached segment
  that is entirely free is released and the request retried once (``num_alloc_retries``);
  if it still does not fit, the allocation fails (``num_ooms``).

When asked (:meth:`CachingAllocatorModel.record_history`), the model keeps the trace
PyTorch's own allocator keeps under ``torch.cuda.memory._record_memory_history()``, and
:meth:`~CachingAllocatorModel.snapshot` returns the dict ``torch.cuda.memory._snapshot()``
returns (segments with their blocks, the trace of alloc / free_requested / free_completed /
segment_alloc / segment_free / oom actions), which PyTorch's memory viewer opens.

>>> from memfit.units import MiB
>>> allocator = CachingAllocatorModel(budget=64 * MiB)
>>> block = allocator.malloc(3 * MiB)
>>> allocator.stats()["reserved_bytes.all.current"] == 20 * MiB
True
"""

from __future__ import annotations

import bisect
import collections
import itertools
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any

from memfit.units import MiB

__all__ = [
    "CachingAllocatorModel",
    "AllocationFailed",
    "round_size",
    "segment_size",
    "is_small",
    "should_split",
    "Frames",
    "SNAPSHOT_BASE_ADDRESS",
    "SNAPSHOT_PICKLE_PROTOCOL",
    "snapshot_bytes",
    "MIN_BLOCK_SIZE",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
]

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded to this
SMALL_SIZE = 1 * MiB  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: size of a small-pool segment
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment for large requests under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a request gets its own segment
ROUND_LARGE = 2 * MiB  # kRoundLarge: own segments are rounded up to this

#: the first segment's address in a snapshot: the model's addresses start at 0, and a
#: viewer that treats address 0 as "none" would lose the first block
SNAPSHOT_BASE_ADDRESS = 0x7F00_0000_0000

#: the pickle protocol of a written snapshot: the memory viewer's own unpickler reads 2 to 4
SNAPSHOT_PICKLE_PROTOCOL = 4

#: where an allocation was made, as PyTorch's memory viewer shows it: a list of
#: ``{"filename", "line", "name"}`` dicts, innermost first
Frames = list[dict[str, Any]]


def round_size(nbytes: int) -> int:
    """Round a request the way the allocator does: up to a multiple of 512 B, at least 512 B."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def is_small(rounded: int) -> bool:
    """True when a rounded request is served by the small pool."""
    return rounded <= SMALL_SIZE


def segment_size(rounded: int) -> int:
    """Size of the segment cudaMalloc'ed when no cached block can serve a rounded request."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


def should_split(block_size: int, rounded: int, small: bool) -> bool:
    """True when the rest of a block after serving ``rounded`` is worth keeping as a block."""
    remaining = block_size - rounded
    if small:
        return remaining >= MIN_BLOCK_SIZE
    return remaining > SMALL_SIZE


def snapshot_bytes(snapshot: dict[str, Any]) -> bytes:
    """A snapshot pickled as ``torch.cuda.memory._dump_snapshot`` writes it (protocol 4)."""
    return pickle.dumps(snapshot, protocol=SNAPSHOT_PICKLE_PROTOCOL)


class AllocationFailed(Exception):
    """The model could not serve a request within its budget (the caller raises the OOM)."""

    def __init__(self, requested: int, stats: dict[str, int], budget: int) -> None:
        super().__init__(f"cannot allocate {requested} bytes within a budget of {budget} bytes")
        self.requested = requested
        self.stats = stats
        self.budget = budget


@dataclass(eq=False)
class _Segment:
    address: int
    size: int
    small: bool
    blocks: list[_Block] = field(default_factory=list)  # in address order


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    segment: _Segment
    allocated: bool = False
    requested: int = 0
    frames: Frames | None = None  # kept only while the history is recorded

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


class _FreePool:
    """Cached free blocks of one pool, sorted by (size, address) for best-fit lookup."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[tuple[int, int], _Block] = {}

    def add(self, block: _Block) -> None:
        bisect.insort(self._keys, block.key)
        self._blocks[block.key] = block

    def remove(self, block: _Block) -> None:
        index = bisect.bisect_left(self._keys, block.key)
        del self._keys[index]
        del self._blocks[block.key]

    def best_fit(self, rounded: int) -> _Block | None:
        index = bisect.bisect_left(self._keys, (rounded, -1))
        if index == len(self._keys):
            return None
        return self._blocks[self._keys[index]]


class CachingAllocatorModel:
    """The caching allocator's bookkeeping, with an optional budget on reserved memory.

    ``malloc`` returns a handle (an int) to pass to ``free``; it raises
    :class:`AllocationFailed` when the request cannot be served within ``budget``.
    ``stats()`` uses ``torch.cuda.memory_stats()`` key names. Thread-safe: tensors can be
    freed from the autograd engine's threads.
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self._lock = threading.RLock()
        self._pools = {True: _FreePool(), False: _FreePool()}
        self._segments: list[_Segment] = []
        self._live: dict[int, _Block] = {}
        self._handles = itertools.count(1)
        self._next_address = 0
        self._counters: dict[str, int] = {
            "allocated": 0,
            "reserved": 0,
            "requested": 0,
            "allocated_peak": 0,
            "reserved_peak": 0,
            "requested_peak": 0,
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_device_alloc": 0,
            "num_device_free": 0,
            "allocation_count": 0,
        }
        #: the recorded actions (None: not recording), oldest first, at most ``max_entries``
        self._trace: collections.deque[dict[str, Any]] | None = None

    # -- public interface ------------------------------------------------------------

    def malloc(self, nbytes: int, frames: Frames | None = None) -> int:
        """Serve a request of ``nbytes``; return a handle for :meth:`free`.

        ``frames`` says where the request came from, for the recorded history.
        """
        with self._lock:
            rounded = round_size(nbytes)
            small = is_small(rounded)
            block = self._pools[small].best_fit(rounded)
            if block is None:
                try:
                    block = self._new_segment_block(rounded, small)
                except AllocationFailed:
                    self._record("oom", (self.budget or 0) - self.reserved, rounded, frames)
                    raise
            else:
                self._pools[small].remove(block)
            if should_split(block.size, rounded, small):
                self._split(block, rounded)
            block.allocated = True
            block.requested = nbytes
            handle = next(self._handles)
            self._live[handle] = block
            self._add("allocated", block.size)
            self._add("requested", nbytes)
            self._counters["allocation_count"] += 1
            if self._trace is not None:
                block.frames = frames or []
                self._record("alloc", block.address, nbytes, frames)
            return handle

    def free(self, handle: int, frames: Frames | None = None) -> None:
        """Return a block to its pool's cache, merged with free neighbours."""
        with self._lock:
            block = self._live.pop(handle)
            if self._trace is not None:
                # One stream: the free completes at once (CUDA records both moments).
                self._record("free_requested", block.address, block.requested, frames)
                self._record("free_completed", block.address, block.requested, frames)
            block.allocated = False
            block.frames = None
            self._add("allocated", -block.size)
            self._add("requested", -block.requested)
            block = self._merge_with_free_neighbours(block)
            self._pools[block.segment.small].add(block)

    def record_history(self, enabled: bool = True, max_entries: int = 100_000) -> None:
        """Start (or, with ``enabled=False``, stop) keeping the trace :meth:`snapshot` returns.

        Why only when asked: a training step makes tens of thousands of allocations; the
        trace costs a dict each. ``max_entries`` keeps the newest actions, as CUDA's does.
        """
        with self._lock:
            self._trace = collections.deque(maxlen=max_entries) if enabled else None

    def snapshot(self) -> dict[str, Any]:
        """The allocator's state and recorded history as ``torch.cuda.memory._snapshot()`` gives it.

        ``segments``: every segment (``segment_type`` small or large) with its blocks in
        address order (``active_allocated`` or ``inactive``); ``device_traces``: one list
        (device 0) of the recorded actions, empty unless :meth:`record_history` was on.
        Addresses start at :data:`SNAPSHOT_BASE_ADDRESS`.
        """
        base = SNAPSHOT_BASE_ADDRESS
        with self._lock:
            segments = []
            for segment in sorted(self._segments, key=lambda seg: seg.address):
                blocks = [
                    {
                        "address": base + block.address,
                        "size": block.size,
                        "requested_size": block.requested if block.allocated else 0,
                        "state": "active_allocated" if block.allocated else "inactive",
                        "frames": list(block.frames or []) if block.allocated else [],
                    }
                    for block in segment.blocks
                ]
                allocated = sum(block.size for block in segment.blocks if block.allocated)
                segments.append(
                    {
                        "device": 0,
                        "address": base + segment.address,
                        "total_size": segment.size,
                        "allocated_size": allocated,
                        "active_size": allocated,
                        "requested_size": sum(block.requested for block in segment.blocks if block.allocated),
                        "stream": 0,
                        "segment_type": "small" if segment.small else "large",
                        "segment_pool_id": (0, 0),
                        "is_expandable": False,
                        "frames": [],
                        "blocks": blocks,
                    }
                )
            trace = [dict(entry) for entry in self._trace] if self._trace is not None else []
        for entry in trace:
            if entry["action"] != "oom":
                entry["addr"] += base
        return {"segments": segments, "device_traces": [trace]}

    def empty_cache(self) -> None:
        """Release every cached segment that holds no allocated block (``torch.cuda.empty_cache``)."""
        with self._lock:
            self._release_free_segments()

    def reset_peak(self) -> None:
        """Set every peak to its current value (``torch.cuda.reset_peak_memory_stats``)."""
        with self._lock:
            for name in ("allocated", "reserved", "requested"):
                self._counters[f"{name}_peak"] = self._counters[name]

    def stats(self) -> dict[str, int]:
        """Counters under ``torch.cuda.memory_stats()`` key names."""
        with self._lock:
            c = self._counters
            return {
                "allocated_bytes.all.current": c["allocated"],
                "allocated_bytes.all.peak": c["allocated_peak"],
                "active_bytes.all.current": c["allocated"],
                "active_bytes.all.peak": c["allocated_peak"],
                "reserved_bytes.all.current": c["reserved"],
                "reserved_bytes.all.peak": c["reserved_peak"],
                "requested_bytes.all.current": c["requested"],
                "requested_bytes.all.peak": c["requested_peak"],
                "inactive_split_bytes.all.current": self._inactive_split_bytes(),
                "segment.all.current": len(self._segments),
                "allocation.all.current": len(self._live),
                "allocation.all.allocated": c["allocation_count"],
                "num_alloc_retries": c["num_alloc_retries"],
                "num_ooms": c["num_ooms"],
                "num_device_alloc": c["num_device_alloc"],
                "num_device_free": c["num_device_free"],
            }

    @property
    def recording(self) -> bool:
        """True while the history for :meth:`snapshot` is recorded."""
        return self._trace is not None

    @property
    def allocated(self) -> int:
        return self._counters["allocated"]

    @property
    def reserved(self) -> int:
        return self._counters["reserved"]

    # -- the allocator's rules -------------------------------------------------------

    def _new_segment_block(self, rounded: int, small: bool) -> _Block:
        """cudaMalloc a new segment; on failure release cached segments and retry once."""
        size = segment_size(rounded)
        if self._fits(size):
            return self._allocate_segment(size, small)
        self._counters["num_alloc_retries"] += 1
        self._release_free_segments()
        if self._fits(size):
            return self._allocate_segment(size, small)
        self._counters["num_ooms"] += 1
        raise AllocationFailed(rounded, self.stats(), self.budget or 0)

    def _fits(self, segment: int) -> bool:
        return self.budget is None or self._counters["reserved"] + segment <= self.budget

    def _allocate_segment(self, size: int, small: bool) -> _Block:
        segment = _Segment(address=self._next_address, size=size, small=small)
        self._next_address += size
        block = _Block(address=segment.address, size=size, segment=segment)
        segment.blocks.append(block)
        self._segments.append(segment)
        self._add("reserved", size)
        self._counters["num_device_alloc"] += 1
        self._record("segment_alloc", segment.address, size)
        return block

    def _record(self, action: str, address: int, size: int, frames: Frames | None = None) -> None:
        """Append one action to the trace, when recording (an OOM's address is the free memory)."""
        if self._trace is None:
            return
        entry: dict[str, Any] = {"action": action, "size": size, "stream": 0, "frames": frames or []}
        if action == "oom":
            entry["device_free"] = address
        else:
            entry["addr"] = address
        self._trace.append(entry)

    def _split(self, block: _Block, rounded: int) -> None:
        rest = _Block(address=block.address + rounded, size=block.size - rounded, segment=block.segment)
        block.size = rounded
        blocks = block.segment.blocks
        blocks.insert(blocks.index(block) + 1, rest)
        self._pools[block.segment.small].add(rest)

    def _merge_with_free_neighbours(self, block: _Block) -> _Block:
        blocks = block.segment.blocks
        index = blocks.index(block)
        pool = self._pools[block.segment.small]
        if index + 1 < len(blocks) and not blocks[index + 1].allocated:
            after = blocks.pop(index + 1)
            pool.remove(after)
            block.size += after.size
        if index > 0 and not blocks[index - 1].allocated:
            before = blocks[index - 1]
            pool.remove(before)
            before.size += block.size
            blocks.pop(index)
            block = before
        return block

    def _release_free_segments(self) -> None:
        kept = []
        for segment in self._segments:
            if len(segment.blocks) == 1 and not segment.blocks[0].allocated:
                self._pools[segment.small].remove(segment.blocks[0])
                self._add("reserved", -segment.size)
                self._counters["num_device_free"] += 1
                self._record("segment_free", segment.address, segment.size)
            else:
                kept.append(segment)
        self._segments = kept

    def _inactive_split_bytes(self) -> int:
        return sum(
            block.size
            for segment in self._segments
            if len(segment.blocks) > 1
            for block in segment.blocks
            if not block.allocated
        )

    def _add(self, name: str, delta: int) -> None:
        value = self._counters[name] + delta
        self._counters[name] = value
        if value > self._counters[f"{name}_peak"]:
            self._counters[f"{name}_peak"] = value
