"""Rank agreement: make every process of a torch.distributed job decide the same thing.

Why: when ranks decide alone (one rank runs out of memory, the others do not), they call
different collectives and the job hangs. Each helper here is one all-reduce that every
rank must call at the same point; without an initialized process group they answer
for this process alone, so single-GPU code needs no special case.

>>> agree_min(42)   # no process group: this process's own value
42
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "rank", "world_size", "is_main_process", "agree_min", "agree_max", "any_rank"]


def is_distributed() -> bool:
    """True inside an initialized process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group; RANK when torchrun set it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return rank() == 0


def _reduce_device() -> torch.device:
    """nccl reduces CUDA tensors only; gloo reduces CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(value: int, op: dist.ReduceOp) -> int:
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_reduce_device())
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def agree_min(value: int) -> int:
    """The smallest value over all ranks (for example the largest batch that fits everywhere)."""
    return _all_reduce(value, dist.ReduceOp.MIN)


def agree_max(value: int) -> int:
    """The largest value over all ranks."""
    return _all_reduce(value, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True when the flag is set on at least one rank (for example "I ran out of memory")."""
    return bool(agree_max(int(flag)))
