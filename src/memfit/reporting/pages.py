"""Reports people can read: a timeline PNG and one self-contained HTML page.

The page gathers a monitored run (its findings and its memory timeline) and, when given,
the results of ``memfit probe --json``, ``memfit estimate --json`` and ``memfit plan --json``
with their figures. Self-contained: no CDN, no script, every image embedded as a base64
``data:`` URI, so the file can be mailed or attached to an issue. Figures are drawn with
matplotlib's Agg canvas (no display, no pyplot state).

:func:`to_html` renders any memfit result (or a dict) as a table; result classes use it for
Jupyter's ``_repr_html_``.

>>> print(html_table([{"batch_size": 8, "peak_allocated": 3 * 2**20}]))
<table class="memfit"><thead><tr><th>batch_size</th><th>peak_allocated</th></tr></thead><tbody><tr><td>8</td><td title="3145728 bytes">3.00 MiB</td></tr></tbody></table>
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.monitor.findings import Finding
from memfit.monitor.monitor import RecordedRun, read_run, summarize
from memfit.units import GiB, KiB, MiB, format_size

__all__ = [
    "write_report",
    "ReportFiles",
    "to_html",
    "html_table",
    "is_byte_key",
    "timeline_png",
    "probe_png",
    "estimate_png",
    "report_html",
    "results_html",
    "plan_png",
    "write_results_report",
    "monitor_html",
    "findings_html",
    "load_result",
    "png_data_uri",
    "write_atomically",
]

_BYTE_NAMES = frozenset(
    {"allocated", "reserved", "total", "memory", "capacity", "free", "unallocated", "breakdown", "bytes"}
)
_BYTE_SUFFIXES = ("_allocated", "_reserved", "_bytes", "_memory", "_capacity", "_unallocated", "_total")

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:70rem;
color:#1f2328;padding:0 1rem;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.25rem;margin-top:2rem;border-bottom:1px solid #d0d7de}
.sub{color:#59636e;margin-top:0}
table.memfit{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}
table.memfit th,table.memfit td{border:1px solid #d0d7de;padding:.25rem .6rem;text-align:left;vertical-align:top}
table.memfit th{background:#f6f8fa}
.finding{border-left:4px solid #cf222e;background:#fff5f5;padding:.6rem 1rem;margin:1rem 0}
.finding.shape_peak{border-color:#9a6700;background:#fff8e5}
.finding.fragmentation{border-color:#8250df;background:#f8f5ff}
.finding h3{margin:.1rem 0 .4rem 0;font-size:1.05rem}
.ok{border-left:4px solid #1a7f37;background:#f0fff4;padding:.6rem 1rem}
img{max-width:100%;border:1px solid #d0d7de}
code{background:#f6f8fa;padding:0 .2rem}
"""


# -- tables ----------------------------------------------------------------------------


def is_byte_key(key: str) -> bool:
    """True when a field of that name holds bytes (``peak_allocated``, ``total``, ``memory``).

    Why by name: memfit's JSON keeps bytes as plain ints, so a table shows "3.00 MiB"
    instead of 3145728 only when the field's name says it is a size.
    """
    name = key.lower()
    return name in _BYTE_NAMES or name.endswith(_BYTE_SUFFIXES) or "bytes" in name


def _cell(value: Any, in_bytes: bool) -> str:
    """One table cell's HTML: sizes for people (bytes in the tooltip), nested values as tables."""
    if value is None:
        return "<td>-</td>"
    if isinstance(value, bool):
        return f"<td>{'yes' if value else 'no'}</td>"
    if isinstance(value, int) and in_bytes:
        return f'<td title="{value} bytes">{html.escape(format_size(value))}</td>'
    if isinstance(value, float):
        return f"<td>{value:.4g}</td>"
    if isinstance(value, (Mapping, list, tuple)) and not value:
        return "<td>-</td>"
    if isinstance(value, Mapping) or _is_rows(value):
        return f"<td>{to_html(value, _bytes=in_bytes)}</td>"
    if isinstance(value, (list, tuple)):
        if all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in value):
            return f"<td>{html.escape(', '.join(str(item) for item in value))}</td>"  # a shape
        return "<td>" + "<br>".join(html.escape(str(item)) for item in value) + "</td>"  # sentences
    return f"<td>{html.escape(str(value))}</td>"


def _is_rows(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, Mapping) for v in value)


def html_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A table with one row per mapping; columns are the union of keys, in first-seen order."""
    rows = list(rows)
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            for key in row:
                seen.setdefault(str(key), None)
        columns = list(seen)
    head = "".join(f"<th>{html.escape(str(column))}</th>" for column in columns)
    body = "".join(
        "<tr>" + "".join(_cell(row.get(column), is_byte_key(str(column))) for column in columns) + "</tr>"
        for row in rows
    )
    return f'<table class="memfit"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _as_data(obj: Any) -> Any:
    """A result object as plain data: its ``to_dict()``, a dataclass's fields, or itself."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def to_html(obj: Any, *, _bytes: bool = False) -> str:
    """Any memfit result, mapping or list of mappings as an HTML table (for ``_repr_html_``).

    A mapping becomes a two-column table (nested mappings and lists of mappings nest as
    tables); a list of mappings becomes one row per item; a finding becomes its block.
    """
    if isinstance(obj, Finding):
        return findings_html([obj])
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(item, Finding) for item in obj):
        return findings_html(list(obj))
    data = _as_data(obj)
    if _is_rows(data):
        return html_table([_as_data(row) for row in data])
    if isinstance(data, Mapping):
        rows = "".join(
            f"<tr><th>{html.escape(str(key))}</th>{_cell(_as_data(value), _bytes or is_byte_key(str(key)))}</tr>"
            for key, value in data.items()
        )
        return f'<table class="memfit"><tbody>{rows}</tbody></table>'
    return f"<pre>{html.escape(str(data))}</pre>"


# -- findings --------------------------------------------------------------------------


def findings_html(findings: Sequence[Finding]) -> str:
    """Each finding as a block: title, summary, evidence table, causes and advice."""
    if not findings:
        return '<div class="ok">No findings: no leak, no fragmentation, no new-shape peak.</div>'
    blocks = []
    for finding in findings:
        evidence = {key: value for key, value in finding.evidence.items() if key != "events"}
        events = finding.evidence.get("events")
        parts = [
            f'<div class="finding {html.escape(finding.kind)}">',
            f"<h3>{html.escape(finding.title)}</h3>",
            f"<p>{html.escape(finding.summary)}</p>",
            to_html(evidence),
        ]
        if events:
            parts.append(html_table(events))
        if finding.causes:
            parts.append("<p><b>Likely causes</b></p><ul>")
            parts.extend(f"<li>{_inline_code(cause)}</li>" for cause in finding.causes)
            parts.append("</ul>")
        if finding.advice:
            parts.append("<p><b>What to do</b></p><ul>")
            parts.extend(f"<li>{_inline_code(advice)}</li>" for advice in finding.advice)
            parts.append("</ul>")
        parts.append("</div>")
        blocks.append("".join(parts))
    return "".join(blocks)


def _inline_code(text: str) -> str:
    """Escape text and turn `backquoted` spans into <code>."""
    pieces = html.escape(text).split("`")
    return "".join(f"<code>{piece}</code>" if index % 2 else piece for index, piece in enumerate(pieces))


# -- figures ---------------------------------------------------------------------------


#: legends right of the plot, so they never hide a line
_LEGEND_OUTSIDE: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8, "frameon": False}


def _unit(largest: float) -> tuple[str, int]:
    """The binary unit that keeps a chart's numbers readable."""
    for name, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if largest >= size:
            return name, size
    return "B", 1


def _figure(width: float = 10.0, height: float = 4.2) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # Agg: a Figure made without pyplot renders headless
    return buffer.getvalue()


def timeline_png(header: Mapping[str, Any], records: Sequence[Mapping[str, Any]], findings: Sequence[Finding] = ()) -> bytes:
    """Allocated, reserved and peak memory per step, OOMs marked, the capacity as a line.

    Findings are drawn where they happened: a leak's steps shaded, a new-shape peak marked.
    """
    figure = _figure()
    axes = figure.subplots()
    device = header.get("description") or header.get("device") or "device"
    axes.set_title(f"memfit monitor · {device}", loc="left", fontsize=11)
    if not records:
        axes.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=axes.transAxes)
        axes.set_axis_off()
        return _png(figure)
    steps = [int(r["step"]) for r in records]
    series = {
        "peak allocated (per step)": [int(r.get("peak_allocated", r["allocated"])) for r in records],
        "reserved": [int(r.get("reserved", 0)) for r in records],
        "allocated (at step end)": [int(r["allocated"]) for r in records],
    }
    largest = max(max(values) for values in series.values())
    capacity = header.get("capacity")
    show_capacity = isinstance(capacity, int) and largest >= 0.2 * capacity
    unit, size = _unit(max(largest, capacity if show_capacity else 0))
    styles = {
        "peak allocated (per step)": {"color": "#d1242f", "linewidth": 1.2, "alpha": 0.85},
        "reserved": {"color": "#8250df", "linewidth": 1.6},
        "allocated (at step end)": {"color": "#0969da", "linewidth": 1.6},
    }
    marker = "o" if len(steps) <= 60 else None
    for name, values in series.items():
        axes.plot(steps, [v / size for v in values], label=name, marker=marker, markersize=3, **styles[name])
    if show_capacity:
        axes.axhline(capacity / size, color="#1f2328", linestyle="--", linewidth=1, label=f"capacity {format_size(capacity)}")
    elif isinstance(capacity, int):
        axes.text(0.99, 0.02, f"capacity {format_size(capacity)} (off the chart)", ha="right", va="bottom",
                  transform=axes.transAxes, fontsize=8, color="#59636e")
    ooms, previous = [], 0
    for record in records:
        count = int(record.get("num_ooms", 0))
        if count > previous or record.get("event") == "oom":
            ooms.append(record)
        previous = count
    if ooms:
        axes.scatter([int(r["step"]) for r in ooms], [int(r.get("peak_reserved", r.get("reserved", 0))) / size for r in ooms],
                     marker="X", s=90, color="#cf222e", zorder=5, label="out of memory")
    for finding in findings:
        if finding.kind == "leak":
            axes.axvspan(finding.first_step, finding.last_step, color="#cf222e", alpha=0.08, label=finding.title)
        elif finding.kind == "fragmentation":
            axes.axvspan(finding.first_step, finding.last_step, color="#8250df", alpha=0.07, label=finding.title)
        elif finding.kind == "shape_peak":
            for index, event in enumerate(finding.evidence.get("events", [])):
                axes.axvline(event["step"], color="#9a6700", linestyle=":", linewidth=1.2,
                             label="new largest input shape" if index == 0 else None)
    axes.set_xlabel("step (one per monitor.step() call)")
    axes.set_ylabel(unit)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(**_LEGEND_OUTSIDE)
    return _png(figure)


def probe_png(probe: Mapping[str, Any]) -> bytes | None:
    """Peak memory (and throughput) per batch size tried; OOM trials marked. None without trials."""
    trials = [t for t in probe.get("trials") or [] if isinstance(t, Mapping) and isinstance(t.get("batch_size"), int)]
    if not trials:
        return None
    trials.sort(key=lambda t: t["batch_size"])
    largest = max(int(t.get("peak_reserved") or t.get("peak_allocated") or 0) for t in trials)
    capacity = probe.get("capacity") if isinstance(probe.get("capacity"), int) else None
    unit, size = _unit(max(largest, capacity or 0))
    figure = _figure(10.0, 4.0)
    axes = figure.subplots()
    axes.set_title("memfit probe · peak memory per batch size", loc="left", fontsize=11)
    fitting = [t for t in trials if t.get("fits") is not False]  # an OOM's peak is only partial
    for key, color in (("peak_allocated", "#0969da"), ("peak_reserved", "#8250df")):
        points = [(t["batch_size"], t[key]) for t in fitting if isinstance(t.get(key), int)]
        if points:
            axes.plot([p[0] for p in points], [p[1] / size for p in points], marker="o", color=color,
                      label=key.replace("_", " "))
    failed = [t for t in trials if t.get("fits") is False]
    if failed:
        axes.scatter([t["batch_size"] for t in failed],
                     [(capacity or int(t.get("peak_reserved") or t.get("peak_allocated") or 0)) / size for t in failed],
                     marker="X", s=90, color="#cf222e", zorder=5, label="out of memory")
    if capacity:
        axes.axhline(capacity / size, color="#1f2328", linestyle="--", linewidth=1, label=f"capacity {format_size(capacity)}")
    for key, style in (("max_batch_size", "--"), ("recommended_batch_size", ":")):
        if isinstance(probe.get(key), int):
            axes.axvline(probe[key], color="#1a7f37", linestyle=style, linewidth=1.2,
                         label=f"{key.replace('_', ' ')} = {probe[key]}")
    axes.set_xlabel("batch size")
    axes.set_ylabel(unit)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    speeds = [(t["batch_size"], t["samples_per_second"]) for t in fitting if isinstance(t.get("samples_per_second"), (int, float))]
    if speeds:
        twin = axes.twinx()
        twin.plot([s[0] for s in speeds], [s[1] for s in speeds], color="#9a6700", linestyle="-.", marker="s",
                  markersize=3, label="samples/s")
        twin.set_ylabel("samples/s")
        twin.set_ylim(bottom=0)
        lines, labels = axes.get_legend_handles_labels()
        more_lines, more_labels = twin.get_legend_handles_labels()
        # past the twin axis's labels
        axes.legend(lines + more_lines, labels + more_labels, **{**_LEGEND_OUTSIDE, "bbox_to_anchor": (1.1, 1.0)})
    else:
        axes.legend(**_LEGEND_OUTSIDE)
    return _png(figure)


def estimate_png(estimate: Mapping[str, Any]) -> bytes | None:
    """The estimate's breakdown by category as bars, total and device memory as lines."""
    breakdown = estimate.get("breakdown")
    if not isinstance(breakdown, Mapping):
        return None
    items = [(str(k), int(v)) for k, v in breakdown.items() if isinstance(v, int) and not isinstance(v, bool)]
    if not items:
        return None
    items.sort(key=lambda item: item[1])
    marks = {key: estimate[key] for key in ("peak_reserved", "memory") if isinstance(estimate.get(key), int)}
    unit, size = _unit(max([v for _, v in items] + list(marks.values())))
    figure = _figure(8.0, 0.9 + 0.38 * len(items))
    axes = figure.subplots()
    axes.set_title(f"memfit estimate · batch size {estimate.get('batch_size', '?')}", loc="left", fontsize=11)
    axes.barh([k for k, _ in items], [v / size for _, v in items], color="#0969da")
    for name, value in items:
        axes.text(value / size, name, f" {format_size(value)}", va="center", fontsize=8)
    colors = {"peak_reserved": "#8250df", "memory": "#1f2328"}
    for key, value in marks.items():
        axes.axvline(value / size, color=colors[key], linestyle="--", linewidth=1,
                     label=f"{key.replace('_', ' ')} {format_size(value)}")
    if marks:
        axes.legend(loc="lower right", fontsize=8)
    axes.set_xlabel(unit)
    axes.grid(True, axis="x", alpha=0.3)
    return _png(figure)


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _img(png: bytes, alt: str) -> str:
    return f'<img src="{png_data_uri(png)}" alt="{html.escape(alt)}">'


# -- pages -----------------------------------------------------------------------------


def monitor_html(header: Mapping[str, Any], records: Sequence[Mapping[str, Any]], findings: Sequence[Finding]) -> str:
    """A monitor in a notebook: its summary, its findings and its timeline."""
    parts = [to_html(summarize(header, list(records))), findings_html(findings)]
    if records:
        parts.append(_img(timeline_png(header, records, findings), "memory timeline"))
    return "<div>" + "".join(parts) + "</div>"


def _plan_html(plan: Mapping[str, Any]) -> str:
    candidates = plan.get("candidates")
    rest = {key: value for key, value in plan.items() if key != "candidates"}
    parts = []
    if rest:
        parts.append(to_html(rest))
    if _is_rows(candidates):
        parts.append("<h3>Candidates</h3>" + html_table(candidates))
    return "".join(parts) or to_html(plan)


def _probe_html(probe: Mapping[str, Any]) -> str:
    rest = {key: value for key, value in probe.items() if key != "trials"}
    parts = [to_html(rest)] if rest else []
    if _is_rows(probe.get("trials")):
        parts.append("<h3>Trials</h3>" + html_table(probe["trials"]))
    return "".join(parts)


def report_html(
    run: RecordedRun,
    timeline: bytes,
    findings: Sequence[Finding],
    *,
    probe: Mapping[str, Any] | None = None,
    estimate: Mapping[str, Any] | None = None,
    plan: Mapping[str, Any] | None = None,
    title: str = "memfit report",
) -> str:
    """The whole page as a string: findings, timeline, run summary, then any results."""
    header = run.header
    device = header.get("description") or header.get("device") or "?"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">{html.escape(str(device))} · {len(run.records)} steps recorded · '
        f"started {html.escape(str(header.get('started', '?')))} · memfit {html.escape(str(header.get('memfit', '?')))}"
        f" · torch {html.escape(str(header.get('torch', '?')))}</p>",
        "<h2>Findings</h2>",
        findings_html(findings),
        "<h2>Memory timeline</h2>",
        _img(timeline, "memory per step: allocated, reserved, peak"),
        "<h2>Run</h2>",
        to_html(run.summary()),
    ]
    parts.extend(results_html(probe=probe, estimate=estimate, plan=plan))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def results_html(
    *,
    doctor: Mapping[str, Any] | None = None,
    probe: Mapping[str, Any] | None = None,
    estimate: Mapping[str, Any] | None = None,
    plan: Mapping[str, Any] | None = None,
    figures: dict[str, bytes] | None = None,
) -> list[str]:
    """The page sections for whichever results are given, each with its figure.

    ``figures`` (name -> PNG), when given, receives the figures drawn, so a caller can
    also write them as files beside the page.
    """
    figures = figures if figures is not None else {}
    parts: list[str] = []
    if doctor is not None:
        parts.append("<h2>Environment (memfit doctor)</h2>")
        rows = [
            {"severity": f.get("severity"), "check": f.get("check"), "finding": f.get("message"), "fix": f.get("fix") or ""}
            for f in doctor.get("findings", [])
            if isinstance(f, Mapping)
        ]
        parts.append(html_table(rows) if rows else '<p class="ok">No findings.</p>')
    sections = (
        ("probe", "Probe", probe, probe_png, _probe_html),
        ("estimate", "Estimate", estimate, estimate_png, to_html),
        ("plan", "Plan", plan, plan_png, _plan_html),
    )
    for name, heading, result, draw, render in sections:
        if result is None:
            continue
        parts.append(f"<h2>{heading}</h2>")
        figure = draw(result)
        if figure is not None:
            figures[name] = figure
            parts.append(_img(figure, f"{name} figure"))
        parts.append(render(result))
    return parts


def plan_png(plan: Mapping[str, Any]) -> bytes | None:
    """Peak reserved memory against samples/s for each measured candidate: the Pareto
    front joined, the recommendation starred, the capacity dashed. None without data."""
    measured = [
        c for c in plan.get("candidates") or []
        if isinstance(c, Mapping) and c.get("fits") and isinstance(c.get("peak_reserved"), int)
        and isinstance(c.get("samples_per_second"), (int, float))
    ]
    if not measured:
        return None
    capacity = plan.get("capacity") if isinstance(plan.get("capacity"), int) else None
    unit, size = _unit(max([c["peak_reserved"] for c in measured] + [capacity or 0]))
    figure = _figure(9.0, 4.2)
    axes = figure.subplots()
    axes.set_title(f"memfit plan · target batch {plan.get('target_batch_size', '?')}", loc="left", fontsize=11)
    markers = {"fp32": "o", "bf16": "s", "fp16": "^"}
    for precision, marker in markers.items():
        for checkpointing, fill in (("none", "#0969da"), ("blocks", "none")):
            group = [c for c in measured if c.get("precision") == precision and c.get("checkpointing") == checkpointing]
            if group:
                axes.scatter([c["peak_reserved"] / size for c in group], [c["samples_per_second"] for c in group],
                             marker=marker, s=55, facecolors=fill, edgecolors="#0969da",
                             label=f"{precision}" + (", checkpointing" if checkpointing == "blocks" else ""))
    for c in measured:
        axes.annotate(f"{c.get('micro_batch_size')}×{c.get('accumulation_steps')}",
                      (c["peak_reserved"] / size, c["samples_per_second"]),
                      textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = [c for c in plan.get("pareto") or [] if isinstance(c, Mapping) and c.get("samples_per_second")]
    if len(front) > 1:
        axes.plot([c["peak_reserved"] / size for c in front], [c["samples_per_second"] for c in front],
                  color="#9a6700", linewidth=1, label="Pareto front")
    best = plan.get("recommended")
    if isinstance(best, Mapping) and best.get("samples_per_second"):
        axes.scatter([best["peak_reserved"] / size], [best["samples_per_second"]], marker="*", s=260,
                     color="#cf222e", zorder=5, label="recommended")
    if capacity:
        axes.axvline(capacity / size, color="#1f2328", linestyle="--", linewidth=1, label=f"capacity {format_size(capacity)}")
    axes.set_xlabel(f"peak reserved ({unit})")
    axes.set_ylabel("samples/s")
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(**_LEGEND_OUTSIDE)
    return _png(figure)


def write_results_report(
    output: str | os.PathLike[str],
    *,
    title: str = "memfit report",
    doctor: Mapping[str, Any] | None = None,
    probe: Mapping[str, Any] | None = None,
    estimate: Mapping[str, Any] | None = None,
    plan: Mapping[str, Any] | None = None,
) -> Path:
    """A report of results without a monitored run (what ``memfit fit`` writes): the HTML
    page, and each figure also as a PNG beside it (``report-probe.png``, ...)."""
    figures: dict[str, bytes] = {}
    body = results_html(doctor=doctor, probe=probe, estimate=estimate, plan=plan, figures=figures)
    page = "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *body,
        "</body></html>\n",
    ])
    html_path = Path(output)
    for name, png in figures.items():
        write_atomically(html_path.with_name(f"{html_path.stem}-{name}.png"), png)
    write_atomically(html_path, page.encode("utf-8"))
    return html_path


# -- files -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportFiles:
    """What :func:`write_report` wrote, and the findings it reported."""

    html: Path
    png: Path
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"html": str(self.html), "png": str(self.png), "findings": [f.to_dict() for f in self.findings]}


def load_result(source: Mapping[str, Any] | str | os.PathLike[str] | Any, what: str) -> dict[str, Any]:
    """A probe/estimate/plan result as a dict: given as a dict, a result object, or a JSON file."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise MemfitError(f"cannot read the {what} file {path}: {error.strerror or error}") from None
        except json.JSONDecodeError as error:
            raise MemfitError(f"the {what} file {path} is not JSON (line {error.lineno}): write it with `memfit {what} --json`") from None
    else:
        data = _as_data(source)
    if not isinstance(data, Mapping):
        raise MemfitError(f"the {what} result must be a JSON object, as `memfit {what} --json` writes")
    return dict(data)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is meant to be shared
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def timeline_path(output: Path) -> Path:
    """Where the timeline PNG goes: beside the HTML, ``report.html`` -> ``report-timeline.png``."""
    return output.with_name(f"{output.stem}-timeline.png")


def write_report(
    run: RecordedRun | str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    probe: Any = None,
    estimate: Any = None,
    plan: Any = None,
    title: str = "memfit report",
) -> ReportFiles:
    """Write the HTML report and, beside it, the timeline PNG; return their paths.

    Everything is rendered before anything is written, and each file is written
    atomically, so a bad input leaves no file behind.
    """
    recorded = run if isinstance(run, RecordedRun) else read_run(run)
    results = {
        "probe": load_result(probe, "probe") if probe is not None else None,
        "estimate": load_result(estimate, "estimate") if estimate is not None else None,
        "plan": load_result(plan, "plan") if plan is not None else None,
    }
    findings = recorded.findings()
    timeline = timeline_png(recorded.header, recorded.records, findings)
    page = report_html(recorded, timeline, findings, title=title, **results)
    html_path = Path(output)
    png_path = timeline_path(html_path)
    write_atomically(png_path, timeline)
    write_atomically(html_path, page.encode("utf-8"))
    return ReportFiles(html=html_path, png=png_path, findings=findings)
