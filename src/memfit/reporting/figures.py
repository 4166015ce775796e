"""Figures of results as PNG bytes: probe's trials, the estimate's breakdown and plan's
candidates (a monitored run's timeline is :mod:`memfit.monitor.timeline`).

Each ``*_png`` renders the matplotlib ``Figure`` its ``*_figure`` builds; the figure is
public so what a chart plots can be read back (and tested) without decoding pixels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from memfit._plot import LEGEND_OUTSIDE, binary_unit, new_figure, png_bytes
from memfit.units import format_size

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "probe_png",
    "estimate_png",
    "plan_png",
    "probe_figure",
    "estimate_figure",
    "plan_figure",
    "plan_speed",
    "probe_speed",
]


def probe_png(probe: Mapping[str, Any]) -> bytes | None:
    """Peak memory (and throughput) per batch size tried; OOM trials marked. None without trials.

    Args:
        probe: a probe result as ``ProbeResult.to_dict()`` or ``memfit probe --json`` gives it.
    """
    figure = probe_figure(probe)
    return None if figure is None else png_bytes(figure)


def estimate_png(estimate: Mapping[str, Any]) -> bytes | None:
    """The estimate's breakdown by category as bars, total and device memory as lines.

    Args:
        estimate: an estimate as ``Estimate.to_dict()`` or ``memfit estimate --json`` gives it.
    """
    figure = estimate_figure(estimate)
    return None if figure is None else png_bytes(figure)


def plan_png(plan: Mapping[str, Any]) -> bytes | None:
    """Peak reserved memory against samples/s for each measured candidate. None without data.

    Args:
        plan: a plan as ``Plan.to_dict()`` or ``memfit plan --json`` gives it.
    """
    figure = plan_figure(plan)
    return None if figure is None else png_bytes(figure)


def probe_figure(probe: Mapping[str, Any]) -> Figure | None:
    """The figure :func:`probe_png` renders: peak allocated and reserved per fitting batch
    size as lines, OOM trials as crosses at the capacity, the capacity dashed, the largest
    and recommended batch sizes as vertical lines, samples/s on a twin axis. None without trials.

    Args:
        probe: a probe result as ``ProbeResult.to_dict()`` or ``memfit probe --json`` gives it.
    """
    trials = [t for t in probe.get("trials") or [] if isinstance(t, Mapping) and isinstance(t.get("batch_size"), int)]
    if not trials:
        return None
    trials.sort(key=lambda t: t["batch_size"])
    largest = max(int(t.get("peak_reserved") or t.get("peak_allocated") or 0) for t in trials)
    capacity = probe.get("capacity") if isinstance(probe.get("capacity"), int) else None
    unit, size = binary_unit(max(largest, capacity or 0))
    figure = new_figure(10.0, 4.0)
    axes = figure.subplots()
    axes.set_title("memfit probe · peak memory per batch size", loc="left", fontsize=11)
    fitting = [t for t in trials if t.get("fits") is not False]  # an OOM's peak is only partial
    for key, color in (("peak_allocated", "#0969da"), ("peak_reserved", "#8250df")):
        points = [(t["batch_size"], t[key]) for t in fitting if isinstance(t.get(key), int)]
        if points:
            axes.plot(
                [p[0] for p in points],
                [p[1] / size for p in points],
                marker="o",
                color=color,
                label=key.replace("_", " "),
            )
    failed = [t for t in trials if t.get("fits") is False]
    if failed:
        axes.scatter(
            [t["batch_size"] for t in failed],
            [(capacity or int(t.get("peak_reserved") or t.get("peak_allocated") or 0)) / size for t in failed],
            marker="X",
            s=90,
            color="#cf222e",
            zorder=5,
            label="out of memory",
        )
    if capacity:
        axes.axhline(
            capacity / size, color="#1f2328", linestyle="--", linewidth=1, label=f"capacity {format_size(capacity)}"
        )
    for key, style in (("max_batch_size", "--"), ("recommended_batch_size", ":")):
        if isinstance(probe.get(key), int):
            axes.axvline(
                probe[key],
                color="#1a7f37",
                linestyle=style,
                linewidth=1.2,
                label=f"{key.replace('_', ' ')} = {probe[key]}",
            )
    axes.set_xlabel("batch size")
    axes.set_ylabel(unit)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    speed, speed_label = probe_speed(probe)
    speeds = [(t["batch_size"], t[speed]) for t in fitting if isinstance(t.get(speed), (int, float))]
    if speeds:
        twin = axes.twinx()
        twin.plot(
            [s[0] for s in speeds],
            [s[1] for s in speeds],
            color="#9a6700",
            linestyle="-.",
            marker="s",
            markersize=3,
            label="samples/s",
        )
        twin.set_ylabel(speed_label)
        twin.set_ylim(bottom=0)
        lines, labels = axes.get_legend_handles_labels()
        more_lines, more_labels = twin.get_legend_handles_labels()
        # past the twin axis's labels
        axes.legend(lines + more_lines, labels + more_labels, **{**LEGEND_OUTSIDE, "bbox_to_anchor": (1.1, 1.0)})
    else:
        axes.legend(**LEGEND_OUTSIDE)
    return figure


def probe_speed(probe: Mapping[str, Any]) -> tuple[str, str]:
    """The trials' speed a probe chart shows, as (key of a trial, axis label): the speed
    predicted on the named card where the trials carry it (a simulated GPU:
    :func:`memfit.search.probe_speeds.with_predicted_speeds`), else the measured one, saying
    whose it is (on a simulated GPU, the CPU's).

    >>> probe_speed({"device": "sim:8GiB", "speed_gpu": "RTX 4090", "trials": [{"predicted_samples_per_second": 9.0}]})
    ('predicted_samples_per_second', 'samples/s predicted on the RTX 4090')
    >>> probe_speed({"device": "sim:8GiB", "trials": [{"samples_per_second": 3.0}]})[1]
    'samples/s measured on sim:8GiB (the CPU, not a GPU)'
    >>> probe_speed({"device": "cuda:0"})[1]
    'samples/s measured on cuda:0'
    """
    trials = [t for t in probe.get("trials") or [] if isinstance(t, Mapping)]
    if any(isinstance(t.get("predicted_samples_per_second"), (int, float)) for t in trials):
        return "predicted_samples_per_second", f"samples/s predicted on the {probe.get('speed_gpu') or 'card'}"
    device = str(probe.get("device") or "the device")
    simulated = device.startswith(("sim", "cpu"))
    return "samples_per_second", f"samples/s measured on {device}" + (" (the CPU, not a GPU)" if simulated else "")


def estimate_figure(estimate: Mapping[str, Any]) -> Figure | None:
    """The figure :func:`estimate_png` renders: one horizontal bar per breakdown category
    (smallest first), the peak reserved and the device's memory as vertical lines. None
    without a breakdown.

    Args:
        estimate: an estimate as ``Estimate.to_dict()`` or ``memfit estimate --json`` gives it.
    """
    breakdown = estimate.get("breakdown")
    if not isinstance(breakdown, Mapping):
        return None
    items = [(str(k), int(v)) for k, v in breakdown.items() if isinstance(v, int) and not isinstance(v, bool)]
    if not items:
        return None
    items.sort(key=lambda item: item[1])
    marks = {key: estimate[key] for key in ("peak_reserved", "memory") if isinstance(estimate.get(key), int)}
    unit, size = binary_unit(max([v for _, v in items] + list(marks.values())))
    figure = new_figure(8.0, 0.9 + 0.38 * len(items))
    axes = figure.subplots()
    axes.set_title(f"memfit estimate · batch size {estimate.get('batch_size', '?')}", loc="left", fontsize=11)
    axes.barh([k for k, _ in items], [v / size for _, v in items], color="#0969da")
    for name, value in items:
        axes.text(value / size, name, f" {format_size(value)}", va="center", fontsize=8)
    colors = {"peak_reserved": "#8250df", "memory": "#1f2328"}
    for key, value in marks.items():
        axes.axvline(
            value / size,
            color=colors[key],
            linestyle="--",
            linewidth=1,
            label=f"{key.replace('_', ' ')} {format_size(value)}",
        )
    if marks:
        axes.legend(loc="lower right", fontsize=8)
    axes.set_xlabel(unit)
    axes.grid(True, axis="x", alpha=0.3)
    return figure


def plan_speed(plan: Mapping[str, Any]) -> tuple[str, str]:
    """The candidates' speed a plan ranked by, as (key of a candidate, axis label).

    A plan ranked by the predicted speed (a simulated GPU, or a named card) shows that
    speed, on the card it names, for every candidate that fits (fake trials too); a plan on
    a real GPU shows the speed its trials measured.

    >>> plan_speed({"ranked_by": "predicted", "speed_gpu": "RTX 4090"})
    ('predicted_samples_per_second', 'samples/s predicted on the RTX 4090')
    >>> plan_speed({"ranked_by": "measured", "device": "cuda:0"})
    ('samples_per_second', 'samples/s measured on cuda:0')
    """
    if plan.get("ranked_by") == "predicted":
        return "predicted_samples_per_second", f"samples/s predicted on the {plan.get('speed_gpu') or 'card'}"
    return "samples_per_second", f"samples/s measured on {plan.get('device') or 'the device'}"


def plan_figure(plan: Mapping[str, Any]) -> Figure | None:
    """The figure :func:`plan_png` renders: peak reserved memory against the speed the plan
    ranked by (:func:`plan_speed`) for each candidate that fits (one marker per precision,
    hollow with checkpointing), the Pareto front joined, the recommendation starred, the
    capacity dashed. None without data.

    Args:
        plan: a plan as ``Plan.to_dict()`` or ``memfit plan --json`` gives it.
    """
    speed, speed_label = plan_speed(plan)
    measured = [
        c
        for c in plan.get("candidates") or []
        if isinstance(c, Mapping)
        and c.get("fits")
        and isinstance(c.get("peak_reserved"), int)
        and isinstance(c.get(speed), (int, float))
    ]
    if not measured:
        return None
    capacity = plan.get("capacity") if isinstance(plan.get("capacity"), int) else None
    unit, size = binary_unit(max([c["peak_reserved"] for c in measured] + [capacity or 0]))
    figure = new_figure(9.0, 4.2)
    axes = figure.subplots()
    axes.set_title(f"memfit plan · target batch {plan.get('target_batch_size', '?')}", loc="left", fontsize=11)
    markers = {"fp32": "o", "bf16": "s", "fp16": "^"}
    modes = sorted({str(c.get("checkpointing")) for c in measured}, key=lambda m: (m != "none", m))
    for precision, marker in markers.items():
        for checkpointing in modes:
            group = [c for c in measured if c.get("precision") == precision and c.get("checkpointing") == checkpointing]
            if group:
                named = {"none": "", "blocks": ", checkpointing"}.get(checkpointing, f", checkpointing {checkpointing}")
                axes.scatter(
                    [c["peak_reserved"] / size for c in group],
                    [c[speed] for c in group],
                    marker=marker,
                    s=55,
                    facecolors="#0969da" if checkpointing == "none" else "none",
                    edgecolors="#0969da",
                    label=f"{precision}{named}",
                )
    for c in measured:
        axes.annotate(
            f"{c.get('micro_batch_size')}×{c.get('accumulation_steps')}",
            (c["peak_reserved"] / size, c[speed]),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=8,
        )
    front = [c for c in plan.get("pareto") or [] if isinstance(c, Mapping) and c.get(speed)]
    if len(front) > 1:
        axes.plot(
            [c["peak_reserved"] / size for c in front],
            [c[speed] for c in front],
            color="#9a6700",
            linewidth=1,
            label="Pareto front",
        )
    best = plan.get("recommended")
    if isinstance(best, Mapping) and best.get(speed):
        axes.scatter(
            [best["peak_reserved"] / size],
            [best[speed]],
            marker="*",
            s=260,
            color="#cf222e",
            zorder=5,
            label="recommended",
        )
    if capacity:
        axes.axvline(
            capacity / size, color="#1f2328", linestyle="--", linewidth=1, label=f"capacity {format_size(capacity)}"
        )
    axes.set_xlabel(f"peak reserved ({unit})")
    axes.set_ylabel(speed_label)
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(**LEGEND_OUTSIDE)
    return figure
