"""An allocator snapshot (PyTorch's memory viewer format) in a report, offline.

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns, or memfit's allocator
model writes (:meth:`memfit.memory.allocator.CachingAllocatorModel.snapshot`): segments
with their blocks, and the trace of every allocation, free and ``cudaMalloc``.

PyTorch's viewer is a web page: ``torch.cuda._memory_viz.trace_plot(snapshot)`` returns
its HTML with the snapshot inside, but the page loads the viewer's script from a CDN
(cdn.jsdelivr.net), so it does not open offline. A report therefore carries:

- :func:`memory_figure`: allocated and reserved memory over the trace, drawn here (the
  viewer's "Active Memory Timeline" in one picture), with each phase shaded and the peak
  marked;
- the snapshot itself, embedded as a download link, to drop into https://pytorch.org/memory_viz;
- beside the page, the viewer's own HTML (:func:`viewer_html`), for a browser online.

>>> from memfit.memory.allocator import CachingAllocatorModel
>>> allocator = CachingAllocatorModel()
>>> allocator.record_history()
>>> allocator.free(allocator.malloc(3 * 2**20))
>>> [(t.action, t.allocated, t.reserved) for t in timeline(allocator.snapshot())]
[('segment_alloc', 0, 20971520), ('alloc', 3145728, 20971520), ('free_requested', 3145728, 20971520), ('free_completed', 0, 20971520)]
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memfit._plot import LEGEND_OUTSIDE, binary_unit, new_figure, png_bytes, png_data_uri
from memfit.memory.allocator import snapshot_bytes
from memfit.units import format_size

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Moment", "timeline", "memory_figure", "memory_png", "viewer_html", "snapshot_html", "VIEWER_URL"]

#: where PyTorch's memory viewer opens a snapshot file (dropped on the page, nothing uploaded)
VIEWER_URL = "https://pytorch.org/memory_viz"

_PHASE_COLORS = {"forward": "#ddf4ff", "backward": "#fff8c5", "optimizer": "#fbefff"}


@dataclass(frozen=True)
class Moment:
    """The allocator after one action of the trace: bytes allocated (requested) and reserved."""

    action: str
    allocated: int
    reserved: int
    phase: str


def timeline(snapshot: Mapping[str, Any], device: int = 0) -> list[Moment]:
    """Allocated and reserved bytes after each action of ``device``'s trace.

    Memory held before the trace began (the snapshot's live blocks and segments that the
    trace never allocated) is counted from the start, as the viewer does.
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    allocated, reserved = _held_before(snapshot, trace, device)
    moments = []
    for entry in trace:
        action = str(entry.get("action"))
        size = int(entry.get("size", 0))
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        frames = entry.get("frames") or []
        phase = str(frames[0].get("name", "")) if frames and isinstance(frames[0], Mapping) else ""
        moments.append(Moment(action, allocated, reserved, phase))
    return moments


def _held_before(snapshot: Mapping[str, Any], trace: list[Any], device: int) -> tuple[int, int]:
    """(allocated, reserved) at the trace's start: the end state minus what the trace changed."""
    segments = [s for s in snapshot.get("segments") or [] if s.get("device", 0) == device]
    allocated = sum(
        int(b.get("requested_size", b.get("size", 0)))
        for s in segments
        for b in s.get("blocks") or []
        if b.get("state") == "active_allocated"
    )
    reserved = sum(int(s.get("total_size", 0)) for s in segments)
    for entry in trace:
        size = int(entry.get("size", 0))
        action = entry.get("action")
        allocated -= size if action == "alloc" else -size if action == "free_completed" else 0
        reserved -= size if action == "segment_alloc" else -size if action == "segment_free" else 0
    return max(allocated, 0), max(reserved, 0)


def memory_figure(snapshot: Mapping[str, Any], title: str = "allocator history") -> Figure | None:
    """Allocated and reserved memory after each action of the trace, phases shaded, the
    peak and any OOM marked. None when the snapshot has no trace."""
    moments = timeline(snapshot)
    if not moments:
        return None
    unit, size = binary_unit(max(max(m.reserved, m.allocated) for m in moments))
    figure = new_figure(10.0, 3.8)
    axes = figure.subplots()
    axes.set_title(f"memfit · {title}", loc="left", fontsize=11)
    shown: set[str] = set()
    start = 0
    for index in range(1, len(moments) + 1):
        if index == len(moments) or moments[index].phase != moments[start].phase:
            phase = moments[start].phase
            if phase in _PHASE_COLORS:
                label = phase if phase not in shown else None
                shown.add(phase)
                axes.axvspan(start, index, color=_PHASE_COLORS[phase], linewidth=0, label=label)
            start = index
    x = list(range(len(moments)))
    axes.step(x, [m.reserved / size for m in moments], where="post", color="#8250df", label="reserved")
    axes.step(x, [m.allocated / size for m in moments], where="post", color="#0969da", label="allocated (as requested)")
    peak = max(range(len(moments)), key=lambda i: (moments[i].allocated, -i))
    axes.plot(
        [peak],
        [moments[peak].allocated / size],
        "o",
        color="#cf222e",
        label=f"peak {format_size(moments[peak].allocated)}",
    )
    for index, moment in enumerate(moments):
        if moment.action == "oom":
            axes.axvline(index, color="#cf222e", linestyle="--", linewidth=1, label="out of memory")
    axes.set_xlabel("allocator action")
    axes.set_ylabel(unit)
    axes.set_xlim(0, max(len(moments) - 1, 1))
    axes.set_ylim(bottom=0)
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(**LEGEND_OUTSIDE)
    return figure


def memory_png(snapshot: Mapping[str, Any], title: str = "allocator history") -> bytes | None:
    """:func:`memory_figure` as PNG bytes (None without a trace)."""
    figure = memory_figure(snapshot, title)
    return None if figure is None else png_bytes(figure)


def viewer_html(snapshot: Mapping[str, Any]) -> str:
    """PyTorch's memory viewer page with the snapshot inside (``trace_plot``); it loads the
    viewer's script from a CDN when opened, so it needs a network connection."""
    from torch.cuda import _memory_viz

    return str(_memory_viz.trace_plot(dict(snapshot)))


def snapshot_html(
    snapshot: Mapping[str, Any], *, title: str = "allocator history", viewer_page: str | None = None
) -> str:
    """The report's section: the figure, the snapshot as a download link, the viewer page's link.

    Args:
        snapshot: the snapshot dict.
        title: what the snapshot shows (one training step at the chosen settings, a run).
        viewer_page: the relative link of the viewer's HTML written beside the report, if any.
    """
    parts = ["<h2>Memory viewer</h2>"]
    png = memory_png(snapshot, title)
    if png is not None:
        parts.append(f'<img src="{png_data_uri(png)}" alt="{html.escape(title)}: allocated and reserved over time">')
    moments = timeline(snapshot)
    segments = snapshot.get("segments") or []
    summary = (
        f"{html.escape(title)}: {len(moments)} allocator actions, {len(segments)} segment(s) at the end"
        + (f", peak allocated {format_size(max(m.allocated for m in moments))}" if moments else "")
        + (", ran out of memory" if any(m.action == "oom" for m in moments) else "")
    )
    link = "data:application/octet-stream;base64," + base64.b64encode(snapshot_bytes(dict(snapshot))).decode("ascii")
    parts.append(
        f"<p>{summary}. "
        f'<a download="memfit-snapshot.pickle" href="{link}">Save the snapshot</a> and drop it on '
        f'<a href="{VIEWER_URL}">{VIEWER_URL}</a> (PyTorch\'s memory viewer: nothing is uploaded)'
        + (
            f'; or open <a href="{html.escape(viewer_page)}">{html.escape(viewer_page)}</a>, the viewer with the '
            "snapshot inside (it loads the viewer's script from the network)."
            if viewer_page
            else "."
        )
        + "</p>"
    )
    return "\n".join(parts)
