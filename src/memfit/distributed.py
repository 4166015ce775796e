"""Rank agreement: make every process of a torch.distributed job decide the same thing.

Why: when ranks decide alone (one rank runs out of memory, the others do not), they call
different collectives and the job hangs. Each helper here is one all-reduce that every
rank must call at the same point; without an initialized process group they answer
for this process alone, so single-GPU code needs no special case.

It also joins the process group torchrun describes (:func:`process_group`), so every
memfit command and function works the same way on every rank.

>>> agree_min(42)   # no process group: this process's own value
42
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "launched_by_torchrun",
    "process_group",
    "output_on_main_only",
    "is_distributed",
    "rank",
    "world_size",
    "is_main_process",
    "agree_min",
    "agree_max",
    "any_rank",
    "agree_min_each",
    "average_across_ranks_",
    "average_gradients_",
    "broadcast_from_main_",
]


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment describes a job of several processes (torchrun's variables).

    >>> launched_by_torchrun({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    True
    >>> launched_by_torchrun({"WORLD_SIZE": "1"})
    False
    """
    env = os.environ if environ is None else environ
    needed = ("RANK", "MASTER_ADDR", "MASTER_PORT")
    return int(env.get("WORLD_SIZE", "1")) > 1 and all(name in env for name in needed)


@contextlib.contextmanager
def process_group(backend: str | None = None) -> Iterator[bool]:
    """Join the process group torchrun describes for the duration; yield True when distributed.

    Why leave it afterwards: a group this made is this block's; one that already
    existed (the user's, Lightning's) is used as it is and left alone.
    """
    if not launched_by_torchrun() or not dist.is_available() or dist.is_initialized():
        yield dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=chosen)
    try:
        yield True
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def output_on_main_only(rank: int | None = None) -> Iterator[None]:
    """Send stdout to nowhere on every rank but 0 (errors still reach stderr).

    Why: N processes printing the same agreed answer is noise, and N JSON documents on
    one stdout are not JSON.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


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


def _all_reduce(value: int, op: Any) -> int:
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


def agree_min_each(values: Sequence[int]) -> list[int]:
    """The element-wise minimum of several ints over all ranks, in one all-reduce.

    Why one call: the guard decides several things at once after each attempt (did anyone
    run out of memory, at which size, on which rank, which gradients exist anywhere); one
    collective keeps it cheap and keeps every rank in the same sequence of collectives.
    A maximum is the negated minimum of the negated values.
    """
    if not is_distributed():
        return [int(value) for value in values]
    tensor = torch.tensor(list(values), dtype=torch.int64, device=_reduce_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [int(value) for value in tensor.tolist()]


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, about ``bucket_bytes`` per group."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        same_kind = groups and groups[-1][0].dtype == tensor.dtype and groups[-1][0].device == tensor.device
        if not same_kind or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return groups


def average_across_ranks_(tensors: Sequence[torch.Tensor], bucket_bytes: int = 25 * 2**20) -> None:
    """Replace each tensor, in place, by its mean over all ranks (DDP's gradient all-reduce, by hand).

    Why by hand: DDP all-reduces inside backward, so a rank that runs out of memory in
    backward leaves the others waiting in a collective forever. The guard accumulates
    gradients locally and averages them here, once, after every rank finished. Like DDP,
    each tensor is divided by the world size and then summed, in buckets of about
    ``bucket_bytes`` (a flat copy per bucket), so a few large collectives replace many
    small ones. Every rank must pass tensors of the same shapes in the same order.
    """
    if not is_distributed():
        return
    count = world_size()
    for group in _buckets(tensors, bucket_bytes):
        if len(group) == 1 and group[0].is_contiguous():
            group[0].div_(count)
            dist.all_reduce(group[0])
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        flat.div_(count)
        dist.all_reduce(flat)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def average_gradients_(params: Sequence[torch.nn.Parameter], bucket_bytes: int = 0) -> None:
    """Each parameter's gradient becomes its mean over the ranks (a missing one: zeros).

    Why in place by default (``bucket_bytes=0``: one all-reduce per gradient, no copy):
    the step that calls this is often one that just ran short of memory, where even a
    bucket's flat copy can fail. Every rank must pass the same parameters in one order.
    """
    if not is_distributed():
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    average_across_ranks_(grads, bucket_bytes)


def broadcast_from_main_(tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite each tensor, in place, with rank 0's values (DDP's buffer broadcast, by hand)."""
    if not is_distributed():
        return
    for tensor in tensors:
        dist.broadcast(tensor, src=0)
