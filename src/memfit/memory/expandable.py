"""Expandable segments (``expandable_segments:True``) in the caching allocator model.

The rules follow ``c10/cuda/CUDACachingAllocator.cpp`` (Note [Expandable Segments],
``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``, ``unmap_block``):

- each pool has one segment of address space (for 1 1/8 of the memory), cut into pages of
  2 MiB (small pool) or 20 MiB (large pool), none of them mapped at first;
- a request no cached block serves takes the lowest-addressed stretch of free and unmapped
  blocks long enough for it, and maps only the pages it lacks (reserved memory grows by
  whole pages); the mapped pages merge with the free block before them, so the segment
  stays one block where it can;
- a block taken from an expandable segment is always split (the rest, at least 512 B, stays
  cached), in both pools;
- releasing cached memory (an OOM retry, ``empty_cache``) unmaps the pages entirely inside
  free blocks; a segment left with no mapped page is dropped.

Used as a mixin by :class:`memfit.memory.allocator.CachingAllocatorModel`, whose state it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.memory.allocator_blocks import Block, FreePool, Segment
from memfit.units import MiB

if TYPE_CHECKING:
    from memfit.memory.allocator_conf import AllocatorConfig

__all__ = ["ExpandableSegments", "SMALL_PAGE", "LARGE_PAGE", "UNBOUNDED_SPACE"]

SMALL_PAGE = 2 * MiB  # kSmallBuffer: the small pool's page
LARGE_PAGE = 20 * MiB  # kLargeBuffer: the large pool's page
#: the address space of a segment when the model has no budget (the card's size is unknown)
UNBOUNDED_SPACE = 1 << 50


class ExpandableSegments:
    """Blocks of expandable segments: finding address space, mapping and unmapping pages."""

    budget: int | None
    config: AllocatorConfig
    _pools: dict[bool, FreePool]
    _segments: list[Segment]
    _next_address: int
    _counters: dict[str, int]

    # provided by the allocator model
    def _add(self, name: str, delta: int) -> None: ...
    def _record(self, action: str, address: int, size: int) -> None: ...

    # -- neighbours within a segment ---------------------------------------------------

    @staticmethod
    def _prev_of(block: Block) -> Block | None:
        blocks = block.segment.blocks
        index = blocks.index(block)
        return blocks[index - 1] if index > 0 else None

    @staticmethod
    def _next_of(block: Block) -> Block | None:
        blocks = block.segment.blocks
        index = blocks.index(block)
        return blocks[index + 1] if index + 1 < len(blocks) else None

    def _neighbours(self, block: Block) -> list[Block]:
        """The blocks before and after ``block`` in its segment (``block->prev, block->next``)."""
        return [found for found in (self._prev_of(block), self._next_of(block)) if found is not None]

    @staticmethod
    def _mergeable(neighbour: Block, block: Block) -> bool:
        """``try_merge_blocks``' test: free, and mapped alike."""
        return not neighbour.allocated and neighbour.mapped == block.mapped

    @staticmethod
    def _absorb(block: Block, neighbour: Block) -> None:
        """``block`` takes in its neighbour's bytes (it starts where the earlier of them starts)."""
        block.address = min(block.address, neighbour.address)
        block.size += neighbour.size
        block.segment.blocks.remove(neighbour)

    # -- finding address space and mapping pages --------------------------------------

    def _expandable_block(self, rounded: int, small: bool) -> Block | None:
        """``try_allocate_expandable_block``: a free block of at least ``rounded`` bytes made
        by mapping pages, taken out of its pool; None when the pages do not fit."""
        candidate = self._find_space(rounded, small)
        if not candidate.mapped:
            mapped = self._map(candidate, min(candidate.size, rounded))
            if mapped is None:
                return None
            candidate = mapped
        while candidate.size < rounded:
            following = self._next_of(candidate)
            assert following is not None and not following.mapped
            mapped = self._map(following, min(rounded - candidate.size, following.size))
            if mapped is None:
                return None
            candidate = mapped
        self._pools[small].remove(candidate)
        return candidate

    def _find_space(self, rounded: int, small: bool) -> Block:
        """``find_expandable_block``: the lowest unmapped block (with the free block before it)
        that starts a free stretch of ``rounded`` bytes; a new segment when there is none."""
        segments = sorted((s for s in self._segments if s.page and s.small == small), key=lambda s: s.address)
        for segment in segments:
            for block in [b for b in segment.blocks if not b.mapped]:
                start = self._prev_of(block)
                if start is None or start.allocated:
                    start = block
                if self._free_stretch(start) >= rounded:
                    return start
        return self._new_expandable_segment(small)

    def _free_stretch(self, start: Block) -> int:
        blocks = start.segment.blocks
        total = 0
        for block in blocks[blocks.index(start) :]:
            if block.allocated:
                break
            total += block.size
        return total

    def _new_expandable_segment(self, small: bool) -> Block:
        page = SMALL_PAGE if small else LARGE_PAGE
        memory = self.budget if self.budget is not None else UNBOUNDED_SPACE
        # PyTorch reserves address space for 1 1/8 of the card's memory
        space = page * -(-(memory + memory // 8) // page)
        segment = Segment(address=self._next_address, size=space, small=small, page=page)
        self._next_address += space
        block = Block(address=segment.address, size=space, segment=segment, mapped=False)
        segment.blocks.append(block)
        self._segments.append(segment)
        return block

    def _map(self, block: Block, size: int) -> Block | None:
        """``map_block``: back the first ``size`` bytes of an unmapped block with whole pages
        and merge them with a free neighbour; None (nothing mapped) past the budget."""
        page = block.segment.page
        mapped = page * -(-size // page)
        if self.budget is not None and self._counters["reserved"] + mapped > self.budget:
            return None
        if mapped < block.size:
            rest = Block(address=block.address + mapped, size=block.size - mapped, segment=block.segment, mapped=False)
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, rest)
        block.mapped, block.size = True, mapped
        pool = self._pools[block.segment.small]
        for neighbour in self._neighbours(block):
            if self._mergeable(neighbour, block):
                pool.remove(neighbour)
                self._absorb(block, neighbour)
        pool.add(block)
        self._add("reserved", mapped)
        self._counters["num_device_alloc"] += 1
        self._record("segment_map", block.address, mapped)
        return block

    def _unmap(self, block: Block) -> None:
        """``unmap_block``: unmap the pages entirely inside a free block (the partial pages at
        its ends stay cached); drop the segment when nothing in it is mapped."""
        segment, page = block.segment, block.segment.page
        offset = block.address - segment.address
        first = -(-offset // page)
        last = (offset + block.size) // page
        if first >= last:
            return
        pool = self._pools[segment.small]
        pool.remove(block)
        start, end = segment.address + first * page, segment.address + last * page
        index = segment.blocks.index(block)
        if end < block.address + block.size:
            after = Block(address=end, size=block.address + block.size - end, segment=segment)
            segment.blocks.insert(index + 1, after)
            pool.add(after)
        if start > block.address:
            before = Block(address=block.address, size=start - block.address, segment=segment)
            segment.blocks.insert(index, before)
            pool.add(before)
        block.address, block.size, block.mapped = start, end - start, False
        for neighbour in self._neighbours(block):
            if self._mergeable(neighbour, block):
                self._absorb(block, neighbour)
        self._add("reserved", -(end - start))
        self._counters["num_device_free"] += 1
        self._record("segment_unmap", start, end - start)
        if len(segment.blocks) == 1:
            self._segments.remove(segment)
