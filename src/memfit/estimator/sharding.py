"""The formulas' fallback: what one rank holds when N ranks share a model, by division.

The estimator traces DDP, ZeRO-1 and FSDP2 on a fake process group
(:mod:`memfit.estimator.distributed_trace`); these formulas serve only where that cannot
run, and the estimate says so (``method="formulas"``). Per rank, with P, G, O the parameter, gradient and optimizer-state bytes of the model
on one GPU and N the world size (ceil division, so no byte is lost):

==============  ======================================  ======================  ==============
``shard``       what is divided by N                    per-rank states         DDP buckets
==============  ======================================  ======================  ==============
``none``        nothing (DDP: every rank holds it all)  P + G + O               yes
``optimizer``   optimizer state (ZeRO-1)                P + G + O/N             yes
``gradients``   gradients and optimizer state (ZeRO-2)  P + G/N + O/N           no
``full``        all three (ZeRO-3, FSDP FULL_SHARD)     P/N + G/N + O/N         no
==============  ======================================  ======================  ==============

DDP buckets (``none`` and ``optimizer`` with N > 1): DistributedDataParallel keeps its
own flat copy of every gradient, in buckets filled in reverse parameter order, the
first capped at 1 MiB and the others at ``bucket_cap_mb`` = 25 MiB; each bucket is one
allocation. ZeRO-2/3 and FSDP's own communication buffers (and FSDP's transient
all-gather of one unit's full parameters) are not counted.

>>> shard_states(1000, 1000, 2000, world_size=4, shard="gradients")
(1000, 250, 500)
>>> bucket_sizes([600_000, 600_000, 30_000_000])
[1200000, 30000000]
"""

from __future__ import annotations

from collections.abc import Iterable

from memfit.errors import MemfitError
from memfit.run.strategy import SHARDS, Shard
from memfit.units import MiB

__all__ = ["Shard", "SHARDS", "shard_states", "bucket_sizes", "uses_ddp_buckets", "FIRST_BUCKET", "BUCKET_CAP", "check"]

FIRST_BUCKET = 1 * MiB  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP = 25 * MiB  # DistributedDataParallel(bucket_cap_mb=25)


def check(world_size: int, shard: str) -> None:
    """Refuse a world size below 1 or an unknown shard mode, in one line."""
    if world_size < 1:
        raise MemfitError(f"invalid world size {world_size}: must be at least 1")
    if shard not in SHARDS:
        raise MemfitError(f"unknown shard mode {shard!r}: use one of {', '.join(SHARDS)}")


def _split(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def shard_states(params: int, grads: int, optimizer: int, *, world_size: int, shard: str) -> tuple[int, int, int]:
    """Per-rank (parameters, gradients, optimizer state) bytes under ``shard`` (the table above)."""
    check(world_size, shard)
    divided = {"none": (), "optimizer": ("o",), "gradients": ("g", "o"), "full": ("p", "g", "o")}[shard]
    return (
        _split(params, world_size) if "p" in divided else params,
        _split(grads, world_size) if "g" in divided else grads,
        _split(optimizer, world_size) if "o" in divided else optimizer,
    )


def uses_ddp_buckets(world_size: int, shard: str) -> bool:
    """DDP (with or without ZeRO-1) keeps gradient buckets once there is more than one rank."""
    return world_size > 1 and shard in ("none", "optimizer")


def bucket_sizes(gradient_sizes: Iterable[int], first_cap: int = FIRST_BUCKET, cap: int = BUCKET_CAP) -> list[int]:
    """Pack gradients (in the order backward produces them) into DDP's buckets.

    Why the order: DDP fills buckets in reverse parameter order, the order gradients
    become ready in backward. A bucket closes once it reaches its cap; a gradient larger
    than the cap gets a bucket of its own size.
    """
    buckets: list[int] = []
    current = 0
    limit = first_cap
    for size in gradient_sizes:
        current += size
        if current >= limit:
            buckets.append(current)
            current = 0
            limit = cap
    if current:
        buckets.append(current)
    return buckets
