"""memfit guard under DDP: an OOM on one rank makes every rank re-run the batch, and nobody hangs.

Two real processes over gloo. Only rank 1 runs out of memory (a real
``torch.OutOfMemoryError`` raised in its forward, or in its backward); both ranks must
finish, hold identical parameters, and match plain DDP without OOMs: one SGD step on the
average of the ranks' whole-batch gradients. A deadlock fails the test by its timeout.

This file is also the worker: ``python test_guard_distributed.py --worker RANK ...``.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

STEPS = 3
WORLD = 2
DEADLINE_S = 60


class Net(nn.Module):
    """A small MLP with a buffer, so DDP would broadcast buffers in forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 16)
        self.second = nn.Linear(16, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)) * self.scale)


def local_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 1's last batch is smaller: the ranks split different sample counts."""
    samples = 6 if (rank == 1 and step == STEPS - 1) else 8
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(samples, 6, generator=generator), torch.randint(0, 3, (samples,), generator=generator)


def mean_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


#: rank 1's OOMs: (step, micro-batch index within the attempt); at step 0 twice in a row
FAULTS = [(0, 0), (0, 1), (1, 1)]


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected on rank 1)")


def worker(rank: int, store: str, where: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from memfit.guard import Guard
    from memfit.guard.check import checking

    torch.set_num_threads(1)
    gc.freeze()  # each recovered OOM runs gc.collect(); frozen imports make it cheap here
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    pending = list(FAULTS) if rank == 1 else []
    state = {"step": 0, "call": 0}

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if checking():  # the guard's check of the loss before its first split: no faults, not counted
            return mean_loss(m, batch)
        due = bool(pending) and pending[0] == (state["step"], state["call"])
        state["call"] += 1
        if due:
            pending.pop(0)
            state["call"] = 0  # the guard starts a new attempt after this OOM
            if where == "forward":
                m(batch[0])  # some activations exist, then the OOM
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected on rank 1)")
            return _RaiseInBackward.apply(mean_loss(m, batch))
        return mean_loss(m, batch)

    guard = Guard(model, optimizer, loss_fn)
    history = []
    for step in range(STEPS):
        state["step"], state["call"] = step, 0
        guard.step(local_batch(rank, step))
        history.append([p.detach().clone() for p in model.module.parameters()])
    events = [
        (e.step, e.micro_batch_before, e.micro_batch_after, e.where, e.rank, e.micro_batch_index) for e in guard.events
    ]
    torch.save({"history": history, "events": events, "micro": guard.micro_batch_size, "left": pending}, out)
    dist.destroy_process_group()


def reference_history() -> list[list[torch.Tensor]]:
    """Plain training without OOMs: each step averages the two ranks' whole-batch gradients."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    for step in range(STEPS):
        loss = sum(mean_loss(model, local_batch(rank, step)) for rank in range(WORLD)) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.parametrize(
    ("shapes", "bucket_bytes", "expected"),
    [
        ([(4,), (4,), (4,)], 32, [2, 1]),  # 16 B each: two fit in 32 B
        ([(4,), (4,), (4,)], 1000, [3]),
        ([(100,), (4,)], 32, [1, 1]),  # a tensor larger than a bucket gets its own
    ],
)
def test_buckets_group_tensors_up_to_a_size(
    shapes: list[tuple[int, ...]], bucket_bytes: int, expected: list[int]
) -> None:
    from memfit.distributed import _buckets

    tensors = [torch.zeros(shape) for shape in shapes]
    assert [len(group) for group in _buckets(tensors, bucket_bytes)] == expected


def test_buckets_never_mix_dtypes() -> None:
    from memfit.distributed import _buckets

    tensors = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    assert [[t.dtype for t in group] for group in _buckets(tensors, 1000)] == [[torch.float32], [torch.float64] * 2]


def test_helpers_without_a_process_group_answer_for_this_process() -> None:
    from memfit.distributed import agree_min_each, average_across_ranks_, broadcast_from_main_

    assert agree_min_each([3, 1, 2]) == [3, 1, 2]
    tensor = torch.arange(3.0)
    average_across_ranks_([tensor])
    broadcast_from_main_([tensor])
    assert tensor.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.timeout(DEADLINE_S + 30)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_only_rank_one_runs_out_of_memory(where: str, tmp_path: Path, run_ranks: Any) -> None:
    run_ranks(
        __file__,
        lambda rank: [str(tmp_path / "store"), where, str(tmp_path / f"rank{rank}.pt")],
        WORLD,
        DEADLINE_S,
    )

    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert results[1]["left"] == []  # every planned OOM fired on rank 1
    expected = reference_history()
    for step in range(STEPS):
        for p0, p1, ref in zip(results[0]["history"][step], results[1]["history"][step], expected[step]):
            assert torch.equal(p0, p1)  # identical on both ranks
            assert float((p0 - ref).norm() / ref.norm()) < 1e-6

    # Both ranks went through the same sizes; rank 0 learned of rank 1's OOMs.
    mine = [(0, 8, 4, where, 1, 0), (0, 4, 2, where, 1, 1), (1, 2, 1, where, 1, 1)]
    theirs = [(step, before, after, w, rank, None) for step, before, after, w, rank, _ in mine]
    assert results[1]["events"] == mine
    assert results[0]["events"] == theirs
    assert results[0]["micro"] == results[1]["micro"] == 1


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    # End without finalizing Python: DDP and ZeRO keep the gloo group alive past
    # destroy_process_group, and its worker thread can still be releasing the last
    # collective's tensors then (SIGABRT, see conftest.py's run_ranks).
    sys.stdout.flush()
    os._exit(0)
