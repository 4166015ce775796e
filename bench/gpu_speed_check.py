"""Predicted against measured speed on the GPU of this machine: per kernel class, and per workload.

Per kernel class (the default, about a minute): one microbenchmark for each class of
``memfit.estimator.kernel_rates`` (``bench/kernel_bench.py``: 16-bit, tf32 and fp32
products, one wave and two waves, dense/grouped/depthwise convolutions in NHWC and NCHW,
element-wise, batch norm, softmax, a reduction, a foreach optimizer step), its GPU time by
CUDA events against memfit's prediction for the card ``torch.cuda.get_device_name()``
names, and the efficiency that would make the prediction exact beside the one memfit uses.
A short table is printed; every row goes to the JSON file.

Per workload (``--workloads``): for a few workloads, precisions and batch sizes,
``memfit.measure`` on ``cuda`` (the median of the last steps' times, after warm-up steps)
against ``memfit.estimator.speed.step_time``. ``bench/gpu_accuracy.py`` calls
:func:`check` and writes its rows with its own results.

Without CUDA (or with ``--dry-run``) nothing is measured: the predictions alone are
computed and printed for ``--gpu`` (default: the A100 80GB SXM), which exercises every code
path but the CUDA events on a CPU.

Run: .venv/bin/python bench/gpu_speed_check.py [--dry-run] [--gpu NAME] [--workloads] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit._io import write_atomically
from memfit.estimator.speed import step_time
from memfit.memory.gpus import lookup
from memfit.run.steps import run_steps

OUT = Path(__file__).resolve().parent / "gpu_speed_check.json"

#: (workload, batch sizes, precisions): a transformer, a convnet and an MLP, in seconds each
WORKLOADS: list[tuple[str, tuple[int, ...], tuple[str, ...]]] = [
    ("gpt2:n_layer=6,seq_len=512", (4, 16), ("fp32", "bf16", "fp16")),
    ("resnet50:image_size=224", (32, 128), ("fp32", "bf16")),
    ("mlp:layers=8,width=4096,features=4096", (256, 2048), ("fp32", "bf16")),
]
#: optimizer steps timed after two warm-up steps (the first allocates the optimizer state)
TIMED_STEPS = 5


def measured_seconds(ref: str, settings: memfit.Settings, device: memfit.Device) -> float | None:
    """The median of the timed steps' seconds, or None when the batch does not fit."""
    from memfit.memory.oom import is_oom

    try:
        run = run_steps(memfit.load_workload(ref), settings, device, steps=2 + TIMED_STEPS)
    except Exception as error:
        if not is_oom(error):
            raise
        torch.cuda.empty_cache()
        return None
    return statistics.median(run.step_seconds[2:])


def check(gpu: str | None = None, *, measure: bool = True, quick: bool = False) -> list[dict[str, Any]]:
    """Rows of predicted (and, with ``measure``, measured) samples/s on this machine's GPU.

    Args:
        gpu: the card to predict for (default: the one ``torch.cuda.get_device_name()``
            names).
        measure: run the workloads on ``cuda`` (False: predictions only, for a CPU).
        quick: the first workload only.
    """
    name = gpu or torch.cuda.get_device_name(0)
    card = lookup(name)
    device = memfit.device("cuda") if measure else None
    rows = []
    for ref, batches, precisions in WORKLOADS[:1] if quick else WORKLOADS:
        for precision in precisions:
            if precision == "bf16" and not card.bf16:
                continue
            for batch in batches:
                settings = memfit.Settings(precision=precision, micro_batch_size=batch)  # type: ignore[arg-type]
                predicted = step_time(ref, settings, card)
                seconds = measured_seconds(ref, settings, device) if device is not None else None
                row = {
                    "workload": ref,
                    "precision": precision,
                    "batch_size": batch,
                    "gpu": card.name,
                    "predicted_samples_per_second": predicted.samples_per_second,
                    "measured_samples_per_second": batch / seconds if seconds else None,
                }
                if seconds:
                    row["error_pct"] = 100.0 * (predicted.samples_per_second * seconds / batch - 1)
                rows.append(row)
                measured = row["measured_samples_per_second"]
                print(
                    f"{ref:40s} {precision:5s} b={batch:<5d} predicted {predicted.samples_per_second:10.1f}"
                    + (f"  measured {measured:10.1f}  ({row['error_pct']:+.1f} %)" if measured else ""),
                    flush=True,
                )
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |error| and, per workload, whether the prediction orders its settings as measured."""
    measured = [r for r in rows if r.get("error_pct") is not None]
    orders = {}
    for ref in {r["workload"] for r in measured}:
        mine = [r for r in measured if r["workload"] == ref]
        by_measured = sorted(mine, key=lambda r: r["measured_samples_per_second"])
        by_predicted = sorted(mine, key=lambda r: r["predicted_samples_per_second"])
        orders[ref] = [(r["precision"], r["batch_size"]) for r in by_measured] == [
            (r["precision"], r["batch_size"]) for r in by_predicted
        ]
    return {
        "median_abs_error_pct": statistics.median(abs(r["error_pct"]) for r in measured) if measured else None,
        "same_order": orders,
    }


def kernel_classes(gpu: str, *, measure: bool) -> list[dict[str, Any]]:
    """One row per microbenchmark of ``bench/kernel_bench.py``: predicted and (with
    ``measure``) measured GPU seconds, the rate memfit uses and the one the measurement implies.

    Args:
        gpu: the card to predict for.
        measure: time each case on ``cuda`` (False: predictions only).
    """
    from kernel_bench import cases, implied_rate, measured, predicted
    from memfit.estimator.kernel_rates import RATES

    card = lookup(gpu)
    rates = RATES.for_card(card.name)  # its measured fp32 matmul efficiency, where there is one
    rows = []
    for case in cases(card):
        total, own = predicted(case, card)
        seconds = measured(case) if measure else None
        row: dict[str, Any] = {
            "case": case.name,
            "class": case.cls.name.lower(),
            "rate": case.rate,
            "memfit_rate": getattr(rates, case.rate),
            "predicted_seconds": total,
            "predicted_class_seconds": own,
            "measured_seconds": seconds,
        }
        if seconds:
            row["error_pct"] = 100.0 * (total / seconds - 1)
            row["implied_rate"] = implied_rate(case, total, own, seconds, rates)
        rows.append(row)
        shown = (
            f"  measured {seconds * 1e3:9.3f} ms  implied {_rate(case.rate, row['implied_rate'])}" if seconds else ""
        )
        print(
            f"{case.name:36s} {case.rate:11s} memfit {_rate(case.rate, row['memfit_rate'])}  "
            f"predicted {total * 1e3:9.3f} ms{shown}",
            flush=True,
        )
    return rows


def _rate(name: str, value: float) -> str:
    """A rate as the table shows it: the latency in microseconds, an efficiency as a fraction."""
    return f"{value * 1e6:.2f}us" if name == "latency" else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="predict only (what a machine without CUDA does)")
    parser.add_argument("--gpu", default=None, help="the card to predict for (default: this machine's)")
    parser.add_argument("--workloads", action="store_true", help="also the end-to-end workloads (minutes)")
    parser.add_argument("--quick", action="store_true", help="with --workloads: the first workload only")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    measure = torch.cuda.is_available() and not args.dry_run
    if not measure:
        print(
            f"no CUDA GPU here (torch {torch.__version__}) or --dry-run: predictions only, nothing measured",
            file=sys.stderr,
        )
    gpu = args.gpu or (torch.cuda.get_device_name(0) if measure else "A100 80GB SXM")
    started = time.perf_counter()
    result: dict[str, Any] = {"gpu": lookup(gpu).name, "kernel_classes": kernel_classes(gpu, measure=measure)}
    if args.workloads:
        rows = check(gpu, measure=measure, quick=args.quick)
        result.update({"rows": rows, **summary(rows)})
    result["seconds"] = round(time.perf_counter() - started, 1)
    if measure:
        result["torch"], result["cuda"] = torch.__version__, torch.version.cuda
    # the dry run writes its predictions too (to --out), so the whole path runs on a CPU
    write_atomically(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if measure and args.workloads:
        print(f"median |error| {result['median_abs_error_pct']:.1f} %; same order: {result['same_order']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
