"""The arithmetic of an effective batch: per-device batch x accumulation x ranks.

Why its own module: the Lightning and transformers integrations both turn "the largest
batch that fits" and "the batch I want per optimizer step" into a per-device batch and a
number of accumulation steps, and must do it the same way. Pure integers, no framework.

>>> split_target(256, world_size=2, fits=40)
(32, 4)
>>> split_target(96, world_size=1, fits=500)
(96, 1)
"""

from __future__ import annotations

from memfit.errors import MemfitError

__all__ = ["split_target"]


def split_target(target: int, world_size: int, fits: int) -> tuple[int, int]:
    """(per-device batch, accumulation steps) whose product with ``world_size`` is exactly ``target``.

    Why exact: gradient accumulation averages equal micro-batches, so the update equals
    the update of one batch of ``target`` samples only when every micro-batch has the
    same size. Among the exact splits, the one with the fewest accumulation steps (the
    largest per-device batch at most ``fits``) is the fastest.
    """
    for name, value in (("target batch size", target), ("world size", world_size), ("batch that fits", fits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MemfitError(f"invalid {name} {value!r}: must be a positive integer")
    if target % world_size:
        raise MemfitError(
            f"target batch size {target} is not divisible by the {world_size} ranks: choose a multiple of {world_size}"
        )
    per_rank = target // world_size
    for accumulation in range(1, per_rank + 1):
        if per_rank % accumulation == 0 and per_rank // accumulation <= fits:
            return per_rank // accumulation, accumulation
    raise AssertionError("unreachable: accumulation = per_rank gives a batch of 1")  # pragma: no cover
