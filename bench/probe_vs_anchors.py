"""memfit probe against the batch-size finders people use today, on the same simulated GPUs.

For each workload and budget (a ``sim:`` GPU: real tensors on the CPU, CUDA's allocator
rules, an OOM past the budget) this runs, side by side in one process:

- memfit probe (``headroom=0``: the search for the maximum only);
- Lightning's BatchSizeFinder, ``mode="power"`` and ``mode="binsearch"`` (the real
  ``lightning`` package: a LightningModule wrapping the workload, trained on the sim
  device through ``Tuner.scale_batch_size``, its defaults: init 2, 3 steps per trial);
- Accelerate's ``find_executable_batch_size`` (the real ``accelerate`` package), started
  at 2x and at 8x the true maximum, the function being two optimizer steps;
- the Ultralytics AutoBatch rule: batches 1, 2, 4, 8, 16, a line fitted through their
  peak reserved memory, the batch at 60 % of the free memory, and its default of 16 when
  that lands outside 1..1024 (its rule, re-implemented here: Ultralytics' own function
  needs a YOLO model);
- the true maximum: doubling then bisection on ``memfit.measure``, verified at the
  maximum (fits) and the maximum + 1 (does not). A bisection, not a linear scan, to keep
  the run short; it assumes fitting is monotone in the batch size, which every scan run
  while writing this held.

Every method's optimizer steps are counted where they happen (calls of the workload's
loss: one per attempted step, an OOM step included); "fits" re-runs the batch each
method returned with ``memfit.measure`` on a fresh device. Wall times are ratios to
memfit's on the same row. Run: ``python bench/probe_vs_anchors.py`` (27 minutes on a
shared, busy 2-core machine); it writes the "probe" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memfit
from _results import write_section
from memfit.memory.oom import release_cached_memory
from memfit.run.measure import measure
from memfit.run.settings import Settings
from memfit.run.steps import run_steps
from memfit.search.probe import probe
from memfit.workload import Workload

#: (workload, simulated GPU): budgets chosen for maxima from about 100 to a few thousand
CASES: list[tuple[str, str]] = [
    ("mlp:layers=2,width=256,features=256", "sim:32MiB"),
    ("convnet:blocks=2,channels=8,image_size=32", "sim:64MiB"),
    ("convnet:blocks=2,channels=8,image_size=32", "sim:256MiB"),
    ("gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=32,vocab_size=256", "sim:64MiB"),
    ("gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=32,vocab_size=256", "sim:256MiB"),
]


@dataclass
class Row:
    method: str
    steps: int
    found: int
    fits: bool | None
    seconds: float


class StepCounter:
    """Counts attempted optimizer steps through the workload's loss (one call per step)."""

    def __init__(self) -> None:
        self.calls = 0

    def wrap(self, workload: Workload) -> Workload:
        loss = workload.loss

        def counted(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            self.calls += 1
            return loss(model, batch)

        return replace(workload, loss=counted)


@contextlib.contextmanager
def counting(workload: Workload) -> Iterator[tuple[Workload, StepCounter]]:
    counter = StepCounter()
    yield counter.wrap(workload), counter


def fits(ref: str, spec: str, batch: int) -> bool:
    release_cached_memory()
    return batch >= 1 and measure(ref, batch, memfit.device(spec)).fits


# -- the methods ---------------------------------------------------------------------------------


def run_memfit(workload: Workload, spec: str) -> tuple[int, int]:
    with counting(workload) as (counted, counter):
        result = probe(counted, spec, headroom=0)
    return result.max_batch_size, counter.calls


def true_maximum(workload: Workload, spec: str) -> tuple[int, int]:
    """Doubling, then bisection, then the answer verified at max (fits) and max + 1 (does not)."""
    gpu = memfit.device(spec)
    with counting(workload) as (counted, counter):
        ok = lambda b: measure(counted, b, gpu).fits  # noqa: E731
        lo, hi = 0, 1
        while ok(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        assert ok(lo) and not ok(lo + 1), "fitting is not monotone here"
    return lo, counter.calls


def run_lightning(workload: Workload, spec: str, mode: str) -> tuple[int, int]:
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)  # its per-trial chatter

    gpu = memfit.device(spec)
    with counting(workload) as (counted, counter):

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = counted.build_model()
                self.batch_size = 2

            def training_step(self, batch: Any, _index: int) -> torch.Tensor:
                return counted.loss(self.model, batch)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return counted.optimizer(self.parameters())

            def train_dataloader(self) -> torch.utils.data.DataLoader:
                return torch.utils.data.DataLoader(
                    range(10**7), batch_size=self.batch_size, collate_fn=lambda idx: counted.make_batch(len(idx))
                )

        module = Module()
        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                max_epochs=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=root,
            )
            with gpu:
                found = Tuner(trainer).scale_batch_size(module, mode=mode)
    return int(found or 0), counter.calls


def run_accelerate(workload: Workload, spec: str, start: int) -> tuple[int, int]:
    from accelerate.utils import find_executable_batch_size

    gpu = memfit.device(spec)
    with counting(workload) as (counted, counter):

        @find_executable_batch_size(starting_batch_size=start)
        def train(batch_size: int) -> int:
            run_steps(counted, Settings(micro_batch_size=batch_size), gpu, steps=2)
            return batch_size

        found = train()
    return found, counter.calls


def run_autobatch(workload: Workload, spec: str, fraction: float = 0.6) -> tuple[int, int]:
    """Ultralytics' rule: profile 1..16, fit memory = a + b * batch, aim at 60 % of free memory."""
    gpu = memfit.device(spec)
    with counting(workload) as (counted, counter):
        sizes, used = [], []
        for batch in (1, 2, 4, 8, 16):
            result = measure(counted, batch, gpu)
            if result.fits:
                sizes.append(batch)
                used.append(result.peak_reserved)
        free = gpu.capacity - gpu.memory_reserved()
        slope, intercept = np.polyfit(sizes, used, deg=1)
        found = int((free * fraction - intercept) / slope) if slope > 0 else 0
        if not 1 <= found <= 1024:
            found = 16  # Ultralytics' "CUDA anomaly detected": its default batch size
    return found, counter.calls


METHODS: list[tuple[str, Callable[[Workload, str, int], tuple[int, int]]]] = [
    ("memfit probe", lambda wl, spec, true: run_memfit(wl, spec)),
    ("Lightning power", lambda wl, spec, true: run_lightning(wl, spec, "power")),
    ("Lightning binsearch", lambda wl, spec, true: run_lightning(wl, spec, "binsearch")),
    ("Accelerate from 2x", lambda wl, spec, true: run_accelerate(wl, spec, 2 * true)),
    ("Accelerate from 8x", lambda wl, spec, true: run_accelerate(wl, spec, 8 * true)),
    ("AutoBatch rule (60 %)", lambda wl, spec, true: run_autobatch(wl, spec)),
]


def bench_case(ref: str, spec: str) -> tuple[int, int, list[Row]]:
    workload = memfit.load_workload(ref)
    started = time.perf_counter()
    true, true_steps = true_maximum(workload, spec)
    scan_seconds = time.perf_counter() - started
    rows = []
    for name, method in METHODS:
        release_cached_memory()
        started = time.perf_counter()
        found, steps = method(workload, spec, true)
        seconds = time.perf_counter() - started
        rows.append(Row(name, steps, found, fits(ref, spec, found), seconds))
        print(f"  {name:24s} steps {steps:4d}  found {found:6d}  true {true:6d}  {seconds:6.1f} s", flush=True)
    rows.append(Row("exhaustive (bisection)", true_steps, true, True, scan_seconds))
    return true, true_steps, rows


def table(results: list[tuple[str, str, int, list[Row]]]) -> str:
    lines = [
        "| workload | GPU | method | optimizer steps | batch found | found / true max | found batch fits | wall time vs memfit |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for ref, spec, true, rows in results:
        memfit_seconds = rows[0].seconds
        for row in rows:
            lines.append(
                f"| `{ref}` | `{spec}` | {row.method} | {row.steps} | {row.found} | "
                f"{row.found / true:.3f} | {'yes' if row.fits else '**no**'} | {row.seconds / memfit_seconds:.2f}x |"
            )
    return "\n".join(lines)


def summary(results: list[tuple[str, str, int, list[Row]]]) -> str:
    exact = sum(rows[0].found == true for _, _, true, rows in results)
    fewer = sum(rows[0].steps < rows[2].steps for _, _, _, rows in results)
    return (
        f"memfit probe exact on {exact} of {len(results)} rows; fewer optimizer steps than "
        f"Lightning binsearch on {fewer} of {len(results)} rows."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(0)
    results = []
    started = time.perf_counter()
    for ref, spec in CASES:
        print(f"{ref} on {spec}", flush=True)
        true, _, rows = bench_case(ref, spec)
        results.append((ref, spec, true, rows))
    total = time.perf_counter() - started
    text = "\n".join(
        [
            "## memfit probe vs Lightning, Accelerate and AutoBatch (simulated GPUs)",
            "",
            "Command: `python bench/probe_vs_anchors.py` "
            f"(torch {torch.__version__}, {os.cpu_count()} CPUs, {total / 60:.1f} min in all).",
            "",
            "Each row runs on a `sim:` GPU (real tensors on the CPU, CUDA's caching-allocator rules, an OOM "
            "past the budget). Optimizer steps are counted as attempted (a step that runs out of memory counts). "
            '"found batch fits" re-runs the returned batch on a fresh device. The true maximum comes from '
            "doubling and bisection on `memfit.measure`, verified at max (fits) and max + 1 (does not). "
            "Lightning: `Tuner.scale_batch_size` with its defaults (init 2, 3 steps per trial, "
            "binsearch margin 5 %). Accelerate: `find_executable_batch_size` around two optimizer steps. "
            "AutoBatch: Ultralytics' rule re-implemented (its function needs a YOLO model). Wall times are "
            "ratios on a shared 2-core CPU; they include each method's own overheads (Lightning's trainer).",
            "",
            table(results),
            "",
            summary(results),
        ]
    )
    print(text)
    if not args.no_write:
        write_section("probe", text)


if __name__ == "__main__":
    main()
