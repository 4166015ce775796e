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

import collections
import itertools
import pickle
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from memfit.memory.allocator_blocks import Block, Frames, FreePool, Segment
from memfit.memory.allocator_conf import AllocatorConfig, round_request
from memfit.memory.allocator_conf import current as current_config
from memfit.memory.expandable import ExpandableSegments
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
    "replay_reserved",
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


def replay_reserved(events: Iterable[Sequence[Any]], budget: int | None, config: AllocatorConfig) -> int | None:
    """The peak reserved memory of recorded allocations and frees under ``config``, or None
    when they do not fit in ``budget``.

    Why a replay: the order of allocations and frees does not depend on the allocator's
    settings, so one recorded step answers "how much would each setting reserve" exactly.

    Args:
        events: ``("alloc", handle, nbytes, ...)`` and ``("free", handle, ...)`` in order.
        budget: the memory the allocator may reserve (None: no limit).
        config: the allocator settings to replay under.
    """
    allocator = CachingAllocatorModel(budget=budget, config=config)
    handles: dict[int, int] = {}
    try:
        for event in events:
            if event[0] == "alloc":
                handles[event[1]] = allocator.malloc(event[2])
            else:
                allocator.free(handles.pop(event[1]))
    except AllocationFailed:
        return None
    return allocator.stats()["reserved_bytes.all.peak"]


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


def _mapped_runs(segment: Segment) -> list[list[Block]]:
    """The blocks of a segment as the snapshot shows them: one segment per stretch of mapped
    blocks (a cudaMalloc'ed segment is one stretch)."""
    runs: list[list[Block]] = [[]]
    for block in segment.blocks:
        if block.mapped:
            runs[-1].append(block)
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def _segment_dict(small: bool, expandable: bool, blocks: list[Block]) -> dict[str, Any]:
    """One segment of ``torch.cuda.memory._snapshot()``, addresses from :data:`SNAPSHOT_BASE_ADDRESS`."""
    base = SNAPSHOT_BASE_ADDRESS
    allocated = sum(block.size for block in blocks if block.allocated)
    return {
        "device": 0,
        "address": base + blocks[0].address,
        "total_size": sum(block.size for block in blocks),
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(block.requested for block in blocks if block.allocated),
        "stream": 0,
        "segment_type": "small" if small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": expandable,
        "frames": [],
        "blocks": [
            {
                "address": base + block.address,
                "size": block.size,
                "requested_size": block.requested if block.allocated else 0,
                "state": "active_allocated" if block.allocated else "inactive",
                "frames": list(block.frames or []) if block.allocated else [],
            }
            for block in blocks
        ],
    }


class CachingAllocatorModel(ExpandableSegments):
    """The caching allocator's bookkeeping, with an optional budget on reserved memory.

    ``malloc`` returns a handle (an int) to pass to ``free``; it raises
    :class:`AllocationFailed` when the request cannot be served within ``budget``.
    ``stats()`` uses ``torch.cuda.memory_stats()`` key names. Thread-safe: tensors can be
    freed from the autograd engine's threads. ``config`` is the allocator's settings
    (:mod:`memfit.memory.allocator_conf`; default: :func:`~memfit.memory.allocator_conf.current`,
    the ``PYTORCH_CUDA_ALLOC_CONF`` of this process).

    The ``budget`` is the card's memory: a new segment (or, with expandable segments, the
    pages a request maps) fails past it. With ``per_process_memory_fraction`` the allocator
    may reserve only that share of it, checked as PyTorch checks a fraction: before each
    ``cudaMalloc``, on the segment size the request would get.
    """

    def __init__(self, budget: int | None = None, config: AllocatorConfig | None = None) -> None:
        self.budget = budget
        self.config = config if config is not None else current_config()
        fraction = self.config.per_process_memory_fraction
        #: what the allocator may reserve under a memory fraction (None: no fraction set)
        self.allowed = None if fraction is None or budget is None else int(fraction * budget)
        self._lock = threading.RLock()
        self._pools = {True: FreePool(), False: FreePool()}
        self._segments: list[Segment] = []
        self._live: dict[int, Block] = {}
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
            rounded = round_request(nbytes, self.config)
            small = is_small(rounded)
            block = self._free_block(rounded, small)
            if block is None:
                if self._collecting:
                    self._garbage_collect()
                block = self._new_block(rounded, small)
                if block is None:
                    self._counters["num_ooms"] += 1
                    self._record("oom", (self.budget or 0) - self.reserved, rounded, frames)
                    raise AllocationFailed(rounded, self.stats(), self.budget or 0)
            if self._should_split(block, rounded):
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
            for neighbour in self._neighbours(block):
                if self._mergeable(neighbour, block):
                    self._pools[block.segment.small].remove(neighbour)
                    self._absorb(block, neighbour)
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
            segments = [
                _segment_dict(segment.small, bool(segment.page), run)
                for segment in sorted(self._segments, key=lambda seg: seg.address)
                for run in _mapped_runs(segment)
            ]
            trace = [dict(entry) for entry in self._trace] if self._trace is not None else []
        for entry in trace:
            if entry["action"] != "oom":
                entry["addr"] += base
        return {"segments": segments, "device_traces": [trace]}

    def empty_cache(self) -> None:
        """Release every cached segment that holds no allocated block (``torch.cuda.empty_cache``);
        with expandable segments, unmap every free page."""
        with self._lock:
            self._release_cached()

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
                "segment.all.current": sum(1 for segment in self._segments if not segment.page),
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

    # -- finding a cached block (get_free_block) -------------------------------------

    @property
    def _collecting(self) -> bool:
        """Garbage collection runs only under a memory fraction (PyTorch's ``set_fraction``)."""
        return self.allowed is not None and self.config.garbage_collection_threshold > 0.0

    def _free_block(self, rounded: int, small: bool) -> Block | None:
        """The cached block a request takes, removed from its pool; None when none may serve it."""
        pool = self._pools[small]
        if self._collecting:
            pool.calls += 1
        candidates = pool.from_size(rounded)
        if not candidates:
            return None
        index = 0
        if candidates[0].segment.page and self.config.expandable_segments:
            # Best fit by the size a block can grow to: a block before unmapped space
            # counts that space too, so a block that cannot grow may be taken first.
            while (
                candidates[index].segment.page
                and index + 1 < len(candidates)
                and self._growable(candidates[index + 1]) < self._growable(candidates[index])
            ):
                index += 1
        block = candidates[index]
        limit = self.config.max_split_size
        if limit is not None and rounded < limit <= block.size:
            return None  # an oversize block is kept for oversize requests
        if limit is not None and rounded >= limit and block.size >= rounded + self.config.max_non_split_rounding:
            return None
        pool.remove(block)
        return block

    def _growable(self, block: Block) -> int:
        following = self._next_of(block)
        return block.size + (following.size if following is not None and not following.mapped else 0)

    def _should_split(self, block: Block, rounded: int) -> bool:
        remaining = block.size - rounded
        if block.segment.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        limit = self.config.max_split_size
        return (limit is None or rounded < limit) and remaining > SMALL_SIZE

    # -- new memory (alloc_block), and giving it back ---------------------------------

    def _new_block(self, rounded: int, small: bool) -> Block | None:
        """New memory for a request: a segment (or mapped pages), then after releasing
        oversize cached blocks, then after releasing every cached one (a retry)."""
        block = self._alloc_block(rounded, small)
        if block is None and self._release_oversize(rounded, small):
            block = self._alloc_block(rounded, small)
        if block is None:
            self._counters["num_alloc_retries"] += 1
            self._release_cached()
            block = self._alloc_block(rounded, small)
        return block

    def _alloc_block(self, rounded: int, small: bool) -> Block | None:
        size = segment_size(rounded)
        if self.allowed is not None and self.reserved + size > self.allowed:
            return None
        if self.config.expandable_segments:
            return self._expandable_block(rounded, small)
        if self.budget is not None and self.reserved + size > self.budget:
            return None
        return self._allocate_segment(size, small)

    def _allocate_segment(self, size: int, small: bool) -> Block:
        segment = Segment(address=self._next_address, size=size, small=small)
        self._next_address += size
        block = Block(address=segment.address, size=size, segment=segment)
        segment.blocks.append(block)
        self._segments.append(segment)
        self._add("reserved", size)
        self._counters["num_device_alloc"] += 1
        self._record("segment_alloc", segment.address, size)
        return block

    def _release_oversize(self, rounded: int, small: bool) -> bool:
        """``release_available_cached_blocks``: with a split limit, free one cached oversize
        segment large enough, or the largest ones until enough is freed."""
        limit = self.config.max_split_size
        if limit is None:
            return False
        pool, wanted = self._pools[small], max(rounded, limit)
        whole = [block for block in pool.blocks() if block.whole_segment and not block.segment.page]
        large_enough = [block for block in whole if block.size >= wanted]
        if large_enough:
            self._release_segment(large_enough[0])
            return True
        released = 0
        for block in reversed(whole):
            if released >= wanted or block.size < limit:
                break
            released += block.size
            self._release_segment(block)
        return released >= wanted

    def _release_cached(self) -> None:
        """``release_cached_blocks``: free every cached whole segment, unmap free pages."""
        for small in (False, True):
            pool = self._pools[small]
            for block in pool.blocks():
                if block.segment.page:
                    self._unmap(block)
                elif block.whole_segment:
                    self._release_segment(block)

    def _release_segment(self, block: Block) -> None:
        segment = block.segment
        self._pools[segment.small].remove(block)
        self._segments.remove(segment)
        self._add("reserved", -segment.size)
        self._counters["num_device_free"] += 1
        self._record("segment_free", segment.address, segment.size)

    def _garbage_collect(self) -> None:
        """Release cached whole large segments, oldest first, while reserved memory is past
        ``garbage_collection_threshold`` of the allowed memory (a pass per average age)."""
        threshold = int(self.config.garbage_collection_threshold * (self.allowed or 0))
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self._pools[False]
        freeable = [block for block in pool.blocks() if block.whole_segment and not block.segment.page]
        total_age = sum(pool.calls - block.gc_base for block in freeable)
        count, freed = len(freeable), True
        while reclaimed < target and freed and count > 0:
            average, freed = total_age / count, False
            for block in [block for block in pool.blocks() if block.whole_segment and not block.segment.page]:
                age = pool.calls - block.gc_base
                if age >= average:
                    freed, reclaimed, total_age, count = True, reclaimed + block.size, total_age - age, count - 1
                    self._release_segment(block)

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

    def _split(self, block: Block, rounded: int) -> None:
        rest = Block(address=block.address + rounded, size=block.size - rounded, segment=block.segment)
        block.size = rounded
        blocks = block.segment.blocks
        blocks.insert(blocks.index(block) + 1, rest)
        self._pools[block.segment.small].add(rest)

    def _inactive_split_bytes(self) -> int:
        return sum(
            block.size
            for segment in self._segments
            if len(segment.blocks) > 1 and not segment.page  # PyTorch leaves expandable ones out
            for block in segment.blocks
            if not block.allocated
        )

    def _add(self, name: str, delta: int) -> None:
        value = self._counters[name] + delta
        self._counters[name] = value
        if value > self._counters[f"{name}_peak"]:
            self._counters[f"{name}_peak"] = value
