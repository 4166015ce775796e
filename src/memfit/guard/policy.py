"""The guard's policy: which micro-batch size to run. Pure arithmetic, no torch.

Halve on an OOM (rounded up, so 7 samples run as 4 + 3), double again after ``grow_after``
clean steps, so the guard climbs back the way it came down.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError

__all__ = ["SplitPolicy", "halve", "grow"]


def halve(size: int) -> int:
    """The micro-batch size after an OOM at ``size``: half, rounded up.

    Why rounded up: 7 samples run as 4 + 3 in two passes, not as 3 + 3 + 1 in three.

    >>> [halve(s) for s in (8, 7, 2)]
    [4, 4, 1]
    """
    if size <= 1:
        raise ValueError("a micro-batch of one sample cannot be halved")
    return (size + 1) // 2


def grow(limit: int, samples: int) -> int | None:
    """The next larger micro-batch size to try: double; None once that covers the batch.

    Why doubling: it undoes one halving, so the guard climbs back the way it came down.

    >>> grow(4, 16), grow(8, 16)
    (8, None)
    """
    doubled = limit * 2
    return None if doubled >= samples else doubled


@dataclass
class SplitPolicy:
    """The micro-batch limit and how it changes: halve on an OOM, grow after clean steps.

    ``limit=None`` runs whole batches. ``grow_after=K``: after K steps without an OOM the
    limit doubles (a size that then runs out of memory is simply halved again).
    """

    limit: int | None = None
    grow_after: int | None = None
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise MemfitError(f"invalid micro-batch size {self.limit}: must be at least 1")
        if self.grow_after is not None and self.grow_after < 1:
            raise MemfitError(f"invalid grow_after={self.grow_after}: must be at least 1 step")

    def size_for(self, samples: int) -> int:
        """The micro-batch size to run a batch of ``samples`` at."""
        return samples if self.limit is None else min(self.limit, samples)

    def shrink(self, failed_size: int) -> int:
        """Halve after an OOM at ``failed_size``; return the new limit."""
        self.limit = halve(failed_size)
        self.clean_steps = 0
        return self.limit

    def finish_step(self, samples: int, had_oom: bool) -> bool:
        """Count a finished step; return True when the limit grew."""
        if had_oom or self.limit is None or self.grow_after is None:
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps < self.grow_after:
            return False
        self.limit = grow(self.limit, samples)
        self.clean_steps = 0
        return True
