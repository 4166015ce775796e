"""The memory timeline of a monitored run as a PNG: allocated, reserved and peak per step.

OOMs are marked, the capacity drawn as a line, and the findings where they happened (a
leak's steps shaded, a new-shape peak marked).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memfit._plot import LEGEND_OUTSIDE, binary_unit, new_figure, png_bytes
from memfit.monitor.findings import MemoryFinding
from memfit.units import format_size

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["timeline_png", "timeline_figure"]


def timeline_png(
    header: Mapping[str, Any], records: Sequence[Mapping[str, Any]], findings: Sequence[MemoryFinding] = ()
) -> bytes:
    """Allocated, reserved and peak memory per step, OOMs marked, the capacity as a line.

    Findings are drawn where they happened: a leak's steps shaded, a new-shape peak marked.

    Args:
        header: the run's header record (``device``, ``description``, ``capacity``).
        records: its step records, as a Monitor writes them.
        findings: findings over those records, drawn at their steps.
    """
    return png_bytes(timeline_figure(header, records, findings))


def timeline_figure(
    header: Mapping[str, Any], records: Sequence[Mapping[str, Any]], findings: Sequence[MemoryFinding] = ()
) -> Figure:
    """The figure :func:`timeline_png` renders (public so what it plots can be read back).

    Args:
        header: the run's header record (``device``, ``description``, ``capacity``).
        records: its step records, as a Monitor writes them.
        findings: findings over those records, drawn at their steps.
    """
    figure = new_figure()
    axes = figure.subplots()
    device = header.get("description") or header.get("device") or "device"
    axes.set_title(f"memfit monitor · {device}", loc="left", fontsize=11)
    if not records:
        axes.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=axes.transAxes)
        axes.set_axis_off()
        return figure
    steps = [int(r["step"]) for r in records]
    series = {
        "peak allocated (per step)": [int(r.get("peak_allocated", r["allocated"])) for r in records],
        "reserved": [int(r.get("reserved", 0)) for r in records],
        "allocated (at step end)": [int(r["allocated"]) for r in records],
    }
    largest = max(max(values) for values in series.values())
    capacity = header.get("capacity") if isinstance(header.get("capacity"), int) else None
    show_capacity = capacity is not None and largest >= 0.2 * capacity
    unit, size = binary_unit(max(largest, capacity if capacity is not None and show_capacity else 0))
    styles = {
        "peak allocated (per step)": {"color": "#d1242f", "linewidth": 1.2, "alpha": 0.85},
        "reserved": {"color": "#8250df", "linewidth": 1.6},
        "allocated (at step end)": {"color": "#0969da", "linewidth": 1.6},
    }
    marker = "o" if len(steps) <= 60 else None
    for name, values in series.items():
        axes.plot(steps, [v / size for v in values], label=name, marker=marker, markersize=3, **styles[name])
    if capacity is not None and show_capacity:
        axes.axhline(
            capacity / size, color="#1f2328", linestyle="--", linewidth=1, label=f"capacity {format_size(capacity)}"
        )
    elif isinstance(capacity, int):
        axes.text(
            0.99,
            0.02,
            f"capacity {format_size(capacity)} (off the chart)",
            ha="right",
            va="bottom",
            transform=axes.transAxes,
            fontsize=8,
            color="#59636e",
        )
    ooms, previous = [], 0
    for record in records:
        count = int(record.get("num_ooms", 0))
        if count > previous or record.get("event") == "oom":
            ooms.append(record)
        previous = count
    if ooms:
        axes.scatter(
            [int(r["step"]) for r in ooms],
            [int(r.get("peak_reserved", r.get("reserved", 0))) / size for r in ooms],
            marker="X",
            s=90,
            color="#cf222e",
            zorder=5,
            label="out of memory",
        )
    for finding in findings:
        if finding.kind == "leak":
            axes.axvspan(finding.first_step, finding.last_step, color="#cf222e", alpha=0.08, label=finding.title)
        elif finding.kind == "fragmentation":
            axes.axvspan(finding.first_step, finding.last_step, color="#8250df", alpha=0.07, label=finding.title)
        elif finding.kind == "shape_peak":
            for index, event in enumerate(finding.evidence.get("events", [])):
                axes.axvline(
                    event["step"],
                    color="#9a6700",
                    linestyle=":",
                    linewidth=1.2,
                    label="new largest input shape" if index == 0 else None,
                )
    axes.set_xlabel("step (one per monitor.step() call)")
    axes.set_ylabel(unit)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(**LEGEND_OUTSIDE)
    return figure
