"""The caching allocator model's bookkeeping: segments, blocks and pools of cached blocks.

Kept apart from the rules (:mod:`memfit.memory.allocator`, :mod:`memfit.memory.expandable`)
so both read the same structures. A segment is one ``cudaMalloc`` (or, with
``page`` set, one expandable segment: address space whose pages are mapped on demand); its
blocks cover it in address order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Segment", "Block", "FreePool", "Frames"]

#: where an allocation was made, as PyTorch's memory viewer shows it: a list of
#: ``{"filename", "line", "name"}`` dicts, innermost first
Frames = list[dict[str, Any]]


@dataclass(eq=False)
class Segment:
    address: int
    size: int
    small: bool
    blocks: list[Block] = field(default_factory=list)  # in address order
    #: an expandable segment: address space whose pages are mapped as needed (0: a cudaMalloc'ed one)
    page: int = 0


@dataclass(eq=False)
class Block:
    address: int
    size: int
    segment: Segment
    allocated: bool = False
    requested: int = 0
    frames: Frames | None = None  # kept only while the history is recorded
    #: backed by memory (False: address space of an expandable segment, not mapped)
    mapped: bool = True
    #: the pool's get_free_block count when the block was cached (for garbage collection)
    gc_base: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)

    @property
    def whole_segment(self) -> bool:
        return len(self.segment.blocks) == 1


class FreePool:
    """Cached free blocks of one pool, sorted by (size, address) for best-fit lookup."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[tuple[int, int], Block] = {}
        #: get_free_block calls on this pool (counted while garbage collection is on)
        self.calls = 0

    def add(self, block: Block) -> None:
        bisect.insort(self._keys, block.key)
        self._blocks[block.key] = block
        block.gc_base = self.calls

    def remove(self, block: Block) -> None:
        index = bisect.bisect_left(self._keys, block.key)
        del self._keys[index]
        del self._blocks[block.key]

    def from_size(self, rounded: int) -> list[Block]:
        """The cached blocks of at least ``rounded`` bytes, smallest first."""
        index = bisect.bisect_left(self._keys, (rounded, -1))
        return [self._blocks[key] for key in self._keys[index:]]

    def best_fit(self, rounded: int) -> Block | None:
        index = bisect.bisect_left(self._keys, (rounded, -1))
        if index == len(self._keys):
            return None
        return self._blocks[self._keys[index]]

    def blocks(self) -> list[Block]:
        """Every cached block, smallest first."""
        return [self._blocks[key] for key in self._keys]
