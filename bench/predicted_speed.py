"""Predicted training speed against published real-GPU throughput, by kernel class.

Each row (``bench/speed_rows.py``: 138 published single-GPU training throughputs from 7
sources, 15 cards) reproduces a published measurement as a workload
(``bench/speed_workloads.py``: the model built from its config with random weights, the
batch, precision, layout, accumulation, checkpointing and optimizer the source used) and
compares ``memfit.estimator.speed.step_time`` (fake tensors, no GPU) with the published
samples/s.

The efficiencies of :mod:`memfit.estimator.kernel_rates` are sourced (matmuls, streaming
bandwidth) or calibrated: ``--calibrate`` fits the calibrated ones on the rows marked
``calibration`` only (the split is stated in ``bench/speed_rows.py``) and prints them; the
figures reported are those of the **validation** rows, which no efficiency was fitted to.
Targets (issue 22): median |error| <= 7 %, worst <= 30 %, Spearman >= 0.97.

Writes the "predicted-speed" section of docs/benchmarks.md (``--json FILE`` also writes
the rows, with the predicted time of each kernel class).

Run: .venv/bin/python bench/predicted_speed.py [--quick] [--calibrate] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import memfit
from _results import write_section
from memfit._io import write_atomically
from memfit.estimator.kernel_rates import RATES, Rates, elements_per_thread
from memfit.estimator.speed import record_step, step_time
from memfit.estimator.speed_accuracy import FILE, Band, SpeedAccuracy
from memfit.estimator.timing import OpTrace
from memfit.memory.gpus import lookup
from speed_rows import MEASURED_MS, OTHER_PREDICTORS, ROWS, SOURCES, Row
from speed_workloads import workload

COMMAND = "python bench/predicted_speed.py"
#: the validation figures memfit installs and prints beside a predicted step
#: (memfit.estimator.speed_accuracy)
ACCURACY = Path(__file__).resolve().parent.parent / "src" / "memfit" / "estimator" / FILE
#: the calibrated fields of Rates and the grid each is searched on
CALIBRATED = {
    "tf32_conv": [i / 100 for i in range(10, 96, 2)],
    "conv_half": [i / 100 for i in range(20, 96, 2)],
    "grouped": [i / 100 for i in range(4, 101, 2)],
    "depthwise": [i / 100 for i in range(4, 86, 2)],
    "layout": [i / 100 for i in range(10, 96, 2)],
    "latency": [i / 10 * 1e-6 for i in range(6, 31)],
}
#: the rates without those taken from NeuSight's single kernels (bench/neusight_kernels.py)
WITHOUT_NEUSIGHT_KERNELS = replace(RATES, fp32_matmul_by_card=(), layer_norm=1.0, softmax=1.0)


@dataclass
class Result:
    row: Row
    predicted: float
    seconds_per_step: float
    error_pct: float
    by_class: dict[str, float] = field(default_factory=dict)
    bound_by: str = ""


def _key(row: Row) -> str:
    card = lookup(row.gpu)
    settings = row.settings.replace(accumulation_steps=1)
    return f"{row.workload}|{settings.precision}|{settings.checkpointing}|{settings.micro_batch_size}|{card.compute_capability}"


def traces(rows: list[Row], cache: Path | None) -> dict[str, OpTrace]:
    """One recorded step per (workload, settings, capability), read from ``cache`` when there."""
    found: dict[str, OpTrace] = {}
    stored: dict[str, OpTrace] = {}
    path = cache / "traces.pickle" if cache is not None else None
    if path is not None and path.exists():
        stored = pickle.loads(path.read_bytes())
    for row in rows:
        key = _key(row)
        if key in found:
            continue
        if key not in stored:
            started = time.perf_counter()
            # foreach=False: these sources' optimizers ran their per-parameter loops
            stored[key] = record_step(workload(row.workload), row.settings, foreach=False, gpu=lookup(row.gpu))
            print(f"traced {key} in {time.perf_counter() - started:.0f} s", flush=True)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(pickle.dumps(stored))
        found[key] = stored[key]
    return found


def predict_rows(
    rows: list[Row], recorded: dict[str, OpTrace], rates: Rates = RATES, *, own_torch: bool = True
) -> list[Result]:
    """Each row predicted; ``own_torch``: with the streaming kernels of the PyTorch its source
    ran (:func:`elements_per_thread` of ``Source.torch``), else with the installed torch's."""
    results = []
    for row in rows:
        p = step_time(
            "unused",
            row.settings,
            row.gpu,
            tf32_matmul=row.tf32_matmul,
            tf32_conv=row.tf32_conv,
            trace=recorded[_key(row)],
            rates=rates,
            per_thread=elements_per_thread(SOURCES[row.source].torch) if own_torch else None,
        )
        error = 100.0 * (p.samples_per_second - row.published) / row.published
        results.append(Result(row, p.samples_per_second, p.seconds_per_step, error, p.by_class, p.bound_by))
    return results


def _loss(results: list[Result]) -> float:
    """Mean squared log error: over- and under-prediction weigh alike."""
    return statistics.fmean(math.log(r.predicted / r.row.published) ** 2 for r in results)


def calibrate(rows: list[Row], recorded: dict[str, OpTrace]) -> Rates:
    """Coordinate descent over :data:`CALIBRATED` on ``rows`` (the calibration rows only)."""
    rates = RATES
    best = _loss(predict_rows(rows, recorded, rates))
    for sweep in range(4):
        moved = False
        for name, grid in CALIBRATED.items():
            for value in grid:
                trial = rates.with_values(**{name: value})
                loss = _loss(predict_rows(rows, recorded, trial))
                if loss < best - 1e-12:
                    best, rates, moved = loss, trial, True
        print(f"sweep {sweep}: loss {best:.5f} {rates}", flush=True)
        if not moved:
            break
    return rates


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0


def figures(results: list[Result]) -> dict[str, float]:
    errors = [abs(r.error_pct) for r in results]
    return {
        "rows": len(results),
        "median_abs_error_pct": statistics.median(errors) if errors else math.nan,
        "worst_error_pct": max((r.error_pct for r in results), key=abs, default=math.nan),
        "spearman": spearman([r.predicted for r in results], [r.row.published for r in results]),
    }


def _band(results: list[Result]) -> Band:
    """Rows, median |error| and worst error of ``results``, rounded as the docs print them (so
    a rerun that changes nothing rewrites the same speed_accuracy.json)."""
    f = figures(results)
    return Band(len(results), round(f["median_abs_error_pct"], 1), round(f["worst_error_pct"], 1))


def _bands(results: list[Result], key: Callable[[Result], str]) -> dict[str, Band]:
    """The band of each value of ``key``, in the order of the values."""
    values = sorted({key(r) for r in results})
    return {value: _band([r for r in results if key(r) == value]) for value in values}


def accuracy(results: list[Result]) -> SpeedAccuracy:
    """The validation rows' figures, overall and by what bounds each predicted step."""
    validation = [r for r in results if not r.row.calibration]
    by_bound = _bands(validation, lambda r: r.bound_by)
    return SpeedAccuracy(_band(validation), by_bound, round(figures(validation)["spearman"], 3), COMMAND)


#: workloads of models without convolutions but a patch embedding (one list for both groupings)
_TRANSFORMERS = ("vit", "swin", "bert", "neusight")


def _kind(row: Row) -> str:
    if row.workload.startswith(("resnext", "regnet")):
        return "grouped convolutions"
    if row.workload.startswith(("efficientnet", "mobilenet", "convnext")):
        return "depthwise convolutions"
    if row.workload.startswith(_TRANSFORMERS):
        return "transformers"
    return "dense convolutions"


def _source(row: Row) -> str:
    return row.source


def _mode(row: Row) -> str:
    """The arithmetic and layout a row ran: tf32 only where the card has it, no layout for
    models without convolutions but a patch embedding."""
    layout = "NHWC" if "/nhwc/" in row.workload else "NCHW"
    if row.workload.startswith(_TRANSFORMERS):
        layout = "transformer"
    if row.workload.startswith("bert-squad") and row.workload.endswith("fp16"):
        return f"fp16, {layout}"  # APEX O2: an fp16 model, settings in fp32
    if row.settings.precision != "fp32":
        return f"{row.settings.precision}, {layout}"
    tf32 = (row.tf32_conv or row.tf32_matmul) and lookup(row.gpu).tf32 is not None
    return f"{'tf32' if tf32 else 'fp32'}, {layout}"


def _card(row: Row) -> str:
    return row.gpu


def _lines(bands: dict[str, Band]) -> list[str]:
    """One line per band: rows, median |error|, worst error."""
    return [
        f"- {value}: {b.rows} rows, median |error| {b.median_abs_error_pct:.1f} %, worst {b.worst_error_pct:+.1f} %"
        for value, b in bands.items()
    ]


def _grouped(results: list[Result], key: Callable[[Row], str]) -> list[str]:
    """One line per value of ``key(row)``."""
    return _lines(_bands(results, lambda r: key(r.row)))


def report(
    results: list[Result],
    seconds: float,
    bands: SpeedAccuracy,
    installed: list[Result] | None = None,
    unmeasured: list[Result] | None = None,
) -> str:
    """The docs section; ``bands``: :func:`accuracy` of ``results``; ``installed``: the same
    rows predicted with the installed torch's streaming kernels instead of their sources'
    (shown beside, as docs/benchmarks.md asks of a figure improved by reproducing the measured
    software); ``unmeasured``: without the rates taken from NeuSight's single kernels
    (:data:`WITHOUT_NEUSIGHT_KERNELS`; shown beside: the kernels come from the lab of the
    neusight rows)."""
    validation = [r for r in results if not r.row.calibration]
    calibration = [r for r in results if r.row.calibration]
    v, c = figures(validation), figures(calibration)
    without = ""
    if installed is not None:
        w = figures([r for r in installed if not r.row.calibration])
        wc = figures([r for r in installed if r.row.calibration])
        without = (
            f" Without reproducing the sources' PyTorch (every row with the installed torch {torch.__version__}'s "
            f"streaming kernels, {elements_per_thread()} elements a thread, instead of their PyTorch's "
            f"{', '.join(sorted({str(elements_per_thread(s.torch)) for s in SOURCES.values()}))}): validation "
            f"median {w['median_abs_error_pct']:.1f} %, worst {w['worst_error_pct']:+.1f} %, Spearman "
            f"{w['spearman']:.3f}; calibration median {wc['median_abs_error_pct']:.1f} %, worst "
            f"{wc['worst_error_pct']:+.1f} %."
        )
    if unmeasured is not None:
        u = figures([r for r in unmeasured if not r.row.calibration])
        un = figures([r for r in unmeasured if r.row.source == "neusight"])
        n = figures([r for r in validation if r.row.source == "neusight"])
        without += (
            " Without the rates taken from single kernels NeuSight's lab timed on the cards of the "
            "neusight rows, so that those rows are not independent of them (one fp32 matmul efficiency "
            f"for every card, {RATES.gemm_fp32:.3f}, instead of `MEASURED_FP32_MATMUL`'s "
            f"{len(RATES.fp32_matmul_by_card)} cards; PyTorch's layer norm and softmax at the streaming "
            f"rate instead of {RATES.layer_norm:.3f} and {RATES.softmax:.3f} of it): validation median "
            f"{u['median_abs_error_pct']:.1f} %, worst {u['worst_error_pct']:+.1f} %, Spearman "
            f"{u['spearman']:.3f}; the neusight rows {un['median_abs_error_pct']:.1f} % (with them "
            f"{n['median_abs_error_pct']:.1f} %)."
        )
    lines = [
        "## Predicted training speed against published GPU throughput",
        "",
        f"Command: `{COMMAND}` ({platform.machine()}, memfit {memfit.__version__}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {seconds:.0f} s; no GPU).",
        "",
        "Each row reproduces a published single-GPU training throughput as a workload (the source's model "
        "built from its config with random weights; its batch, precision, memory layout, accumulation, "
        "checkpointing and optimizer) and predicts its samples/s with `memfit.estimator.speed.step_time` "
        "on the card of the table. The model (`memfit/estimator/timing.py`, `kernel_classes.py`, "
        "`kernel_rates.py`) times each kernel by its class: matrix products at the sourced 16-bit "
        "efficiency with tile and wave quantization for the card's SM count, fp32 ones on the CUDA "
        "cores at the efficiency measured on the card where single kernels were timed on it "
        "(`MEASURED_FP32_MATMUL`, `python bench/neusight_kernels.py`); convolutions by kind "
        "(dense, grouped, depthwise) with cuDNN's NCHW transposes on tensor cores (dense and grouped "
        "ones: a depthwise convolution runs no tensor-core kernel); memory-bound kernels at the "
        "measured streaming bandwidth, or less where the bytes a thread of PyTorch's kernels keeps in "
        "flight cannot cover the memory latency (Little's law; each row with its source's PyTorch: "
        "`Source.torch` in `bench/speed_rows.py`), PyTorch's layer norm and softmax at the share of it "
        "measured on single kernels (`LAYER_NORM_EFFICIENCY`, `SOFTMAX_EFFICIENCY`, the same script); "
        "tf32 apart: tf32 matmuls at the efficiency measured in XLA's GEMM table on the H100 and the "
        "B200 (`MEASURED_TF32_MATMUL`, their median on every other card; `python bench/xla_matmul_table.py`), "
        "a tf32 convolution at the faster of its tensor-core kernel (with the transposes) "
        "and cuDNN's CUDA-core fp32 kernel on NCHW. "
        f"Calibrated efficiencies (fitted by `{COMMAND} --calibrate` on the {len(calibration)} calibration "
        f"rows only; the split is stated in `bench/speed_rows.py`): {_rates_text(RATES)}. "
        "Error = (predicted - published) / published. DeepLearningExamples' rows are whole training "
        "runs on ImageNet JPEGs (their input pipeline is in the published figure, not in the "
        "prediction); every other source ran synthetic batches.",
        "",
        "Sources:",
        "",
        *[f"- **{s.key}**: {s.citation}. {s.setup}." for s in SOURCES.values()],
        "",
        f"**Validation rows ({v['rows']:.0f}, no efficiency fitted to them): median |error| "
        f"{v['median_abs_error_pct']:.1f} %, worst {v['worst_error_pct']:+.1f} %, Spearman {v['spearman']:.3f}** "
        f"(targets: 7 %, 30 %, 0.97: {_verdict(v)}). Calibration rows ({c['rows']:.0f}): median "
        f"{c['median_abs_error_pct']:.1f} %, worst {c['worst_error_pct']:+.1f} %.{without}",
        "",
        "By kind (validation rows):",
        "",
    ]
    lines += _grouped(validation, _kind)
    lines += [
        "",
        "By what bounds the predicted step (validation rows; what `memfit estimate` prints beside a prediction):",
        "",
    ]
    lines += _lines(bands.by_bound)
    for title, key in (("source", _source), ("precision and layout", _mode), ("card", _card)):
        lines += ["", f"By {title} (validation rows):", "", *_grouped(validation, key)]
    lines += [
        "",
        "| split | source | row | GPU | published samples/s | predicted | error | bound by |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        share = r.by_class.get(r.bound_by, 0.0) / max(r.seconds_per_step, 1e-12)
        lines.append(
            f"| {'calibration' if r.row.calibration else 'validation'} | {r.row.source} | {r.row.label} | "
            f"{r.row.gpu} | {r.row.published:.2f} | {r.predicted:.2f} | {r.error_pct:+.1f} % | "
            f"{r.bound_by} ({share:.0%}) |"
        )
    lines += against_others(results)
    return "\n".join(lines)


def against_others(results: list[Result]) -> list[str]:
    """The rows that other predictors were published on (NeuSight's artifact: NeuSight,
    Habitat and a roofline), each predictor's latency error beside memfit's, and each one's
    median |error| over those rows. Error = (predicted - measured) / measured, on the step's
    milliseconds as the artifact reports them (a positive error: predicted slower)."""
    shared = [r for r in results if r.row.source == "neusight"]
    if not shared:
        return []
    names = list(OTHER_PREDICTORS[shared[0].row.label])

    def error(predicted_ms: float, measured_ms: float) -> float:
        return 100.0 * (predicted_ms - measured_ms) / measured_ms

    errors: dict[str, list[float]] = {"memfit": [], **{name: [] for name in names}}
    table = []
    for r in shared:
        measured = MEASURED_MS[r.row.label]
        mine = error(r.seconds_per_step * 1000, measured)
        theirs = {name: error(ms, measured) for name, ms in OTHER_PREDICTORS[r.row.label].items()}
        errors["memfit"].append(abs(mine))
        for name, e in theirs.items():
            errors[name].append(abs(e))
        cells = " | ".join(f"{e:+.1f} %" for e in theirs.values())
        table.append(f"| {r.row.label} | {measured:.1f} | {r.seconds_per_step * 1000:.1f} ({mine:+.1f} %) | {cells} |")
    medians = ", ".join(f"{name} {statistics.median(values):.1f} %" for name, values in errors.items())
    return [
        "",
        f"### NeuSight's rows against the predictors its paper compared ({len(shared)} rows)",
        "",
        "The same measured steps predicted by memfit (no GPU, none of these rows fitted) and by the "
        "predictors of NeuSight's artifact (its `scripts/asplos/summary/summary.csv`: NeuSight, trained "
        "on kernels measured on five other GPUs, the V100 PCIe among them; Habitat, which scales "
        "kernels measured on one GPU to another; a roofline). Error on the milliseconds of forward "
        f"and backward; median |error|: {medians}.",
        "",
        f"| row | measured ms | memfit ms | {' | '.join(names)} |",
        "|---|---:|---:|" + "---:|" * len(names),
        *table,
    ]


def _rates_text(rates: Rates) -> str:
    return ", ".join(
        f"latency {rates.latency * 1e6:.1f} us" if name == "latency" else f"{name} {getattr(rates, name):.2f}"
        for name in CALIBRATED
    )


def _verdict(v: dict[str, float]) -> str:
    met = [v["median_abs_error_pct"] <= 7, abs(v["worst_error_pct"]) <= 30, v["spearman"] >= 0.97]
    return "all met" if all(met) else f"{sum(met)} of 3 met"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three rows, no docs update (a smoke test)")
    parser.add_argument("--calibrate", action="store_true", help="fit the calibrated efficiencies, print them")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    parser.add_argument("--cache", type=Path, default=None, help="keep the recorded steps in this folder")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = ROWS
    if args.quick:
        rows = [r for r in ROWS if r.workload == "resnet50/timm"] + [r for r in ROWS if r.source == "hf-v100"][:1]
    if args.calibrate:
        rows = [r for r in ROWS if r.calibration]
    recorded = traces(rows, args.cache)
    if args.calibrate:
        fitted = calibrate(rows, recorded)
        print("calibrated:", {name: getattr(fitted, name) for name in CALIBRATED})
        return 0
    results = predict_rows(rows, recorded)
    for r in results:
        print(f"{r.row.source:16s} {r.row.label:45s} {r.row.gpu:15s} published {r.row.published:8.2f} "
              f"predicted {r.predicted:8.2f} ({r.error_pct:+.1f} %) {r.bound_by}")  # fmt: skip
    installed = predict_rows(rows, recorded, own_torch=False)
    unmeasured = predict_rows(rows, recorded, WITHOUT_NEUSIGHT_KERNELS)
    bands = accuracy(results)
    text = report(results, time.perf_counter() - started, bands, installed, unmeasured)
    print(text)
    if args.json is not None:
        data: dict[str, Any] = {
            "rows": [
                {
                    "source": r.row.source,
                    "row": r.row.label,
                    "gpu": r.row.gpu,
                    "calibration": r.row.calibration,
                    "settings": r.row.settings.to_dict(),
                    "published_samples_per_second": r.row.published,
                    "predicted_samples_per_second": r.predicted,
                    "error_pct": r.error_pct,
                    "seconds_by_class": r.by_class,
                    "bound_by": r.bound_by,
                }
                for r in results
            ],
            "validation": figures([r for r in results if not r.row.calibration]),
        }
        write_atomically(args.json, json.dumps(data, indent=2) + "\n")
    if not args.quick:
        write_section("predicted-speed", text)
        write_atomically(ACCURACY, json.dumps(bands.to_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
