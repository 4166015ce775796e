"""How N ranks share a model, by name: the strategies, their checks and descriptions.

Plain data without torch, so that reading a ``memfit.lock`` and parsing the command line
do not import it; :mod:`memfit.run.parallel` does the wrapping.

>>> check_strategy("full", world_size=8, group_size=4)
>>> describe("full", 8, 4)
'HSDP: FSDP2 fully_shard over groups of 4 ranks, replicated over 2 groups'
"""

from __future__ import annotations

from typing import Literal

from memfit.errors import MemfitError

__all__ = ["Shard", "SHARDS", "FSDP_SHARDS", "OFFLOAD_SHARDS", "check_strategy", "component", "describe"]

#: what N ranks divide among them: nothing (DDP), optimizer state (ZeRO-1), + gradients (FSDP2
#: keeping full parameters from forward to backward), everything (FSDP2, ZeRO-3), everything
#: and kept on the host (FSDP2 with CPUOffloadPolicy: the optimizer steps on the CPU)
Shard = Literal["none", "optimizer", "gradients", "full", "offload"]
SHARDS: tuple[Shard, ...] = ("none", "optimizer", "gradients", "full", "offload")
#: the strategies FSDP2 trains with (fully_shard)
FSDP_SHARDS: tuple[Shard, ...] = ("gradients", "full", "offload")
#: the strategies that keep states on the host: also for one GPU, where nothing else is sharded
OFFLOAD_SHARDS: tuple[Shard, ...] = ("offload",)

_COMPONENTS = {
    "none": "DDP (DistributedDataParallel)",
    "optimizer": "DDP + ZeroRedundancyOptimizer (ZeRO-1)",
    "gradients": "FSDP2 fully_shard, reshard_after_forward=False",
    "full": "FSDP2 fully_shard",
    "offload": "FSDP2 fully_shard with CPUOffloadPolicy (parameters, gradients and optimizer state on the host)",
}


def check_strategy(shard: str, world_size: int, group_size: int | None = None) -> None:
    """Refuse an unknown strategy, a world size below 1 or a group size that does not divide it.

    >>> check_strategy("optimizer", world_size=4, group_size=2)
    Traceback (most recent call last):
    memfit.errors.MemfitError: --shard-group-size applies to --shard gradients, full or offload (FSDP2), not optimizer
    """
    if world_size < 1:
        raise MemfitError(f"invalid world size {world_size}: must be at least 1")
    if shard not in SHARDS:
        raise MemfitError(f"unknown shard mode {shard!r}: use one of {', '.join(SHARDS)}")
    if group_size is None:
        return
    if shard not in FSDP_SHARDS:
        raise MemfitError(f"--shard-group-size applies to --shard gradients, full or offload (FSDP2), not {shard}")
    if group_size < 1 or world_size % group_size:
        raise MemfitError(
            f"invalid shard group size {group_size}: it must divide the world size {world_size} "
            "(the ranks form world/group replicas of one sharded group)"
        )


def component(shard: str) -> str:
    """The PyTorch component a strategy trains with, in a few words."""
    return _COMPONENTS[shard]


def describe(shard: str, world_size: int, group_size: int | None = None) -> str:
    """One phrase naming how ``world_size`` ranks train under ``shard``."""
    if world_size <= 1:
        return component(shard) + " on one GPU" if shard in OFFLOAD_SHARDS else "one rank (no strategy)"
    if group_size is not None and group_size < world_size and shard in FSDP_SHARDS:
        return (
            f"HSDP: {component(shard)} over groups of {group_size} ranks, "
            f"replicated over {world_size // group_size} groups"
        )
    return component(shard)
