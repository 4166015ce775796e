"""Estimate against a real GPU: measured peak allocated and reserved vs predicted.

For each zoo workload (the shapes below: small enough that every run takes seconds),
at two batch sizes, in fp32 and bf16: ``memfit.measure`` on ``cuda`` against
``memfit.estimate(..., memory=<the card's total>)`` (CUDA semantics: foreach optimizers;
fixed costs are not part of the comparison because torch's counters do not see the
CUDA context). The cuBLAS workspace *is* allocated through PyTorch's caching allocator
on recent PyTorch, once per process and stream: a warm-up matmul allocates it first,
it is reported separately, and each measurement counts from what the process held
before the run. Target: peak reserved within 5 %.

Prints a table and writes JSON to ``--out`` (default bench/gpu_accuracy.json),
atomically. Without CUDA it exits at once with a clear message (status 2).

Run: .venv/bin/python bench/gpu_accuracy.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.estimator.estimate import estimate
from memfit.units import format_size

OUT = Path(__file__).resolve().parent / "gpu_accuracy.json"

#: (workload, two batch sizes): real shapes where they run in seconds on one GPU
WORKLOADS: list[tuple[str, tuple[int, int]]] = [
    ("mlp", (64, 256)),
    ("convnet", (16, 64)),
    ("gpt2:n_layer=4,seq_len=512", (2, 8)),
    ("bert-base:layers=4,seq_len=256", (4, 16)),
    ("vit-base:layers=4", (4, 16)),
    ("resnet50:image_size=128", (8, 32)),
    ("llama-1b:layers=2,seq_len=512", (1, 4)),
    ("llama-7b:layers=1,seq_len=512", (1, 2)),
]


def write_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gpu-accuracy-")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


def error(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured if measured else 0.0


def cublas_workspace_bytes() -> int:
    """What the first matmul of the process adds to allocated memory (the cuBLAS workspace)."""
    before = torch.cuda.memory_allocated()
    a = torch.ones(64, 64, device="cuda")
    _ = a @ a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - 2 * a.nbytes
    del a, _
    return max(workspace, 0)


def run(out: Path, quick: bool) -> int:
    if not torch.cuda.is_available():
        print(
            "bench/gpu_accuracy.py needs a CUDA GPU; none is visible here (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}). Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    gpu = memfit.device("cuda")
    name = torch.cuda.get_device_name(0)
    total = torch.cuda.get_device_properties(0).total_memory
    workspace = cublas_workspace_bytes()
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    workloads = WORKLOADS[:3] if quick else WORKLOADS
    for ref, batches in workloads:
        for batch in batches:
            for precision in ("fp32", "bf16"):
                if precision == "bf16" and not gpu.supports("bf16"):
                    continue
                settings = memfit.Settings(precision=precision)
                # What the process holds before the run (the cuBLAS workspace) is not the
                # workload's: measure from there.
                torch.cuda.empty_cache()
                base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                measured = memfit.measure(ref, batch, gpu, settings)
                measured = dataclasses.replace(
                    measured,
                    peak_allocated=measured.peak_allocated - base_allocated,
                    peak_reserved=measured.peak_reserved - base_reserved,
                )
                predicted = estimate(ref, batch, settings, memory=total, search=False)
                row = {
                    "workload": ref,
                    "batch_size": batch,
                    "precision": precision,
                    "fits": measured.fits,
                    "measured_allocated": measured.peak_allocated,
                    "predicted_allocated": predicted.peak_allocated,
                    "measured_reserved": measured.peak_reserved,
                    "predicted_reserved": predicted.peak_reserved,
                    "allocated_error_pct": round(error(predicted.peak_allocated, measured.peak_allocated), 2),
                    "reserved_error_pct": round(error(predicted.peak_reserved, measured.peak_reserved), 2),
                }
                rows.append(row)
                print(
                    f"{ref:45s} b={batch:<4d} {precision:5s} alloc {format_size(measured.peak_allocated):>11s} vs "
                    f"{format_size(predicted.peak_allocated):>11s} ({row['allocated_error_pct']:+.2f} %)  reserved "
                    f"{format_size(measured.peak_reserved):>11s} vs {format_size(predicted.peak_reserved):>11s} "
                    f"({row['reserved_error_pct']:+.2f} %)",
                    flush=True,
                )
    worst = max((abs(r["reserved_error_pct"]) for r in rows if r["fits"]), default=0.0)
    result = {
        "gpu": name,
        "total_memory": total,
        "cublas_workspace_in_allocator": workspace,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": round(time.perf_counter() - started, 1),
        "worst_reserved_error_pct": worst,
        "rows": rows,
    }
    write_atomically(out, result)
    print(f"worst |reserved error| {worst:.2f} % on {name}; written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="JSON file to write (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="only the first three workloads")
    args = parser.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
