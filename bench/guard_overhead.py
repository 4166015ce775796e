"""Guard overhead: a steady-state training step with memfit's guard (no OOM) against the plain loop.

Both loops train identical copies of one model on one fixed batch; their steps are
timed alternately (plain, guard, guard, plain, ...: drift and warm-up hit both alike),
many times, and compared by their medians. The target is at most 1 % slower.

    .venv/bin/python bench/guard_overhead.py            # writes the "guard" section of docs/benchmarks.md
    .venv/bin/python bench/guard_overhead.py --reps 50 --no-write
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memfit
from _results import write_section
from memfit.guard import Guard
from memfit.workload import move_to


def _timed(step: Callable[[], float], sync: Callable[[], None]) -> float:
    sync()
    started = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - started


def _loops(
    workload_ref: str, batch_size: int, device: torch.device
) -> tuple[Callable[[], float], Callable[[], float], Guard]:
    """A plain step and a guarded step of one model, optimizer and batch.

    Why one model for both: two copies sit at different addresses and can differ in
    speed by more than the guard costs; taking turns on one model measures only the loops.
    """
    workload = memfit.load_workload(workload_ref)
    torch.manual_seed(0)
    plain_model = workload.build_model().to(device)
    plain_optimizer = workload.optimizer(plain_model.parameters())
    batch = move_to(workload.make_batch(batch_size), device)
    guard = Guard(plain_model, plain_optimizer, workload.loss)

    def plain_step() -> float:
        loss = workload.loss(plain_model, batch)
        loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def guard_step() -> float:
        return guard.step(batch)

    return plain_step, guard_step, guard


def measure(workload_ref: str, batch_size: int, reps: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median seconds per step of the plain loop and of the guard, timed alternately."""
    plain_step, guard_step, guard = _loops(workload_ref, batch_size, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        plain_step()
        guard_step()
    plain: list[float] = []
    guarded: list[float] = []
    for rep in range(reps):
        # ABBA order: neither loop always runs first after the other.
        if rep % 2 == 0:
            plain.append(_timed(plain_step, sync))
            guarded.append(_timed(guard_step, sync))
        else:
            guarded.append(_timed(guard_step, sync))
            plain.append(_timed(plain_step, sync))
    assert guard.events == [] and guard.accumulation == 1, "the guard split a batch: not a steady state"
    paired = [g / p for g, p in zip(guarded, plain)]
    return {
        "median_paired_difference": statistics.median(g - p for g, p in zip(guarded, plain)),
        "plain_median": statistics.median(plain),
        "guard_median": statistics.median(guarded),
        "ratio_of_medians": statistics.median(guarded) / statistics.median(plain),
        "median_paired_ratio": statistics.median(paired),
        "paired_q1": statistics.quantiles(paired, n=4)[0],
        "paired_q3": statistics.quantiles(paired, n=4)[2],
    }


def _empty_steps(device: torch.device) -> tuple[Callable[[], float], Callable[[], float]]:
    """A plain and a guarded step that do almost no tensor work: one weight, a scalar loss.

    Why: what is left is the guard's own bookkeeping (counting samples, the attempt loop,
    the optimizer call), which does not grow with the model.
    """
    plain_model = torch.nn.Linear(1, 1, bias=False).to(device)
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.0)
    batch = (torch.zeros(8, 1, device=device), torch.zeros(8, device=device))

    def loss_fn(model: torch.nn.Module, _batch: object) -> torch.Tensor:
        return model.weight.sum()

    guard = Guard(plain_model, plain_optimizer, loss_fn)

    def plain_step() -> float:
        loss = loss_fn(plain_model, batch)
        loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return plain_step, lambda: guard.step(batch)


def fixed_cost(blocks: int, block: int, device: torch.device) -> dict[str, float]:
    """The guard's own seconds per step: the fastest of alternating blocks of empty steps.

    Why blocks and minima: on a busy machine single short steps are often descheduled;
    the fastest of many alternating blocks of ``block`` steps is the cost without that.
    """
    plain_step, guard_step = _empty_steps(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run_block(step: Callable[[], float]) -> float:
        sync()
        started = time.perf_counter()
        for _ in range(block):
            step()
        sync()
        return (time.perf_counter() - started) / block

    for _ in range(block):
        plain_step()
        guard_step()
    plain: list[float] = []
    guarded: list[float] = []
    for index in range(blocks):
        if index % 2 == 0:
            plain.append(run_block(plain_step))
            guarded.append(run_block(guard_step))
        else:
            guarded.append(run_block(guard_step))
            plain.append(run_block(plain_step))
    return {"plain": min(plain), "guard": min(guarded), "fixed": min(guarded) - min(plain)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp:layers=2,width=512,features=512")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--empty-blocks", type=int, default=200, help="alternating blocks of 100 empty steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    result = measure(args.workload, args.batch_size, args.reps, args.warmup, device)
    overhead = (result["ratio_of_medians"] - 1) * 100
    # The guard's own work per step does not grow with the model; steps that do almost
    # nothing else measure it with little noise.
    tiny = fixed_cost(args.empty_blocks, 100, device)
    fixed = tiny["fixed"]
    fixed_share = fixed / result["plain_median"] * 100
    where = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))"
    )
    command = "python bench/guard_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"""## guard: overhead of a steady-state step (no OOM)

`{command.strip()}`

Workload `{args.workload}`, batch {args.batch_size}, AdamW; plain loop (forward, backward,
`optimizer.step()`, `zero_grad`, `loss.item()`) against `memfit.Guard.step`, taking turns on
one model and optimizer; {args.reps} steps each, timed alternately (ABBA) after {args.warmup} warm-up steps;
{where}, torch {torch.__version__}.

| | median step |
|---|---|
| plain loop | {result["plain_median"] * 1e3:.2f} ms |
| guard | {result["guard_median"] * 1e3:.2f} ms |
| **guard / plain (ratio of medians)** | **{result["ratio_of_medians"]:.4f}** ({overhead:+.2f} %) |
| median of per-pair ratios (quartiles) | {result["median_paired_ratio"]:.4f} ({result["paired_q1"]:.4f} to {result["paired_q3"]:.4f}) |

The guard's own cost per step, which does not grow with the model, measured on empty
steps (one weight, a scalar loss; the fastest of {args.empty_blocks} alternating blocks of 100
steps each: plain {tiny["plain"] * 1e6:.1f} µs, guard {tiny["guard"] * 1e6:.1f} µs per step):
**{fixed * 1e6:.1f} µs**, that is {fixed_share:.3f} % of the step above.

Target: at most 1 % slower. {"Met." if overhead <= 1.0 else "Not met in this run."}
"""
    print(text)
    if not args.no_write:
        write_section("guard", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
