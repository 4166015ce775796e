"""One rank of N rehearsed on one device: real tensors on a fake process group.

Why beside the trace (:mod:`memfit.estimator.distributed_trace`, fake tensors): probe and
plan measure a strategy's memory with real steps on the device they search (a simulated
GPU, or a real one), and a step's time without communication. The model is wrapped by
the strategy exactly as on N GPUs (:mod:`memfit.run.parallel`), and every collective of
the fake process group returns at once, so the device holds what that rank would hold:
the same components, the same allocations.

>>> import memfit
>>> with rehearsal(memfit.load_workload("mlp:layers=1,width=16,features=16"), memfit.Settings()) as rank:
...     rank
0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from memfit.errors import MemfitError
from memfit.estimator.distributed_trace import heaviest_rank, unavailable_reason
from memfit.run.parallel import fake_process_group
from memfit.run.settings import Settings
from memfit.workload import Workload

__all__ = ["rehearsal"]


@contextlib.contextmanager
def rehearsal(workload: Workload, settings: Settings, rank: int | None = None) -> Iterator[int]:
    """Play one rank of ``settings.world_size`` on a fake process group with real tensors.

    Yields the rank played: ``rank``, or by default the one holding the most parameter
    bytes (:func:`~memfit.estimator.distributed_trace.heaviest_rank`; under ZeRO-1 and
    FSDP2 with uneven shards not always the one peaking highest: probe passes the rank the
    traced estimate found heaviest). Probe and plan run their trials inside. With
    ``world_size=1`` nothing is made and rank 0 is yielded.

    Raises:
        MemfitError: the strategy cannot run here, or this process is already in a
            process group (rehearse without torchrun).
    """
    if settings.world_size <= 1:
        yield 0
        return
    reason = unavailable_reason(settings)
    if reason is not None:
        raise MemfitError(f"cannot rehearse {settings.world_size} ranks here: {reason}")
    if dist.is_initialized():
        raise MemfitError(
            f"world size {settings.world_size} is rehearsed as one rank of a fake process group in one "
            "process; this one is already in a process group: run it without torchrun"
        )
    if rank is None:
        rank = heaviest_rank(workload, settings)
    elif not 0 <= rank < settings.world_size:
        raise MemfitError(f"invalid rank {rank} to rehearse: world size {settings.world_size}")
    with fake_process_group(settings.world_size, rank):
        yield rank
