"""Reports people can read: one self-contained HTML page, with its figures beside it.

The page gathers a monitored run (its findings and its memory timeline) and, when given,
the results of ``memfit probe --json``, ``memfit estimate --json`` and ``memfit plan --json``
with their figures. Self-contained: no CDN, no script, every image embedded as a base64
``data:`` URI, so the file can be mailed or attached to an issue.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import io
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit._html import html_table, to_html
from memfit._io import check_writable, write_atomically
from memfit._plot import png_data_uri
from memfit._read import load_json
from memfit._schema import MAX_BYTES, MAX_COUNT, Field, Rows, Table
from memfit.errors import MemfitError
from memfit.memory.allocator import snapshot_bytes
from memfit.monitor.findings import MemoryFinding, findings_html
from memfit.monitor.monitor import Monitor
from memfit.monitor.runfile import RecordedRun, read_run
from memfit.monitor.timeline import timeline_png
from memfit.reporting.figures import estimate_png, plan_png, probe_png
from memfit.reporting.memory_viz import snapshot_html, viewer_html

__all__ = [
    "write_report",
    "write_results_report",
    "ReportFiles",
    "report_html",
    "results_html",
    "load_result",
    "timeline_path",
    "load_snapshot",
    "snapshot_files",
]

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


def _img(png: bytes, alt: str) -> str:
    return f'<img src="{png_data_uri(png)}" alt="{html.escape(alt)}">'


# -- pages -----------------------------------------------------------------------------


def _plan_html(plan: Mapping[str, Any]) -> str:
    candidates = plan.get("candidates")
    rest = {key: value for key, value in plan.items() if key != "candidates"}
    parts = []
    if rest:
        parts.append(to_html(rest))
    if isinstance(candidates, list) and candidates and all(isinstance(c, Mapping) for c in candidates):
        parts.append("<h3>Candidates</h3>" + html_table(candidates))
    return "".join(parts) or to_html(plan)


def _probe_html(probe: Mapping[str, Any]) -> str:
    rest = {key: value for key, value in probe.items() if key != "trials"}
    parts = [to_html(rest)] if rest else []
    trials = probe.get("trials")
    if isinstance(trials, list) and trials and all(isinstance(t, Mapping) for t in trials):
        parts.append("<h3>Trials</h3>" + html_table(probe["trials"]))
    return "".join(parts)


def _estimate_html(estimate: Mapping[str, Any]) -> str:
    """The estimate's table, and its predicted GPU time by kernel class (what bounds the step)."""
    page = to_html(estimate)
    time = estimate.get("predicted_time")
    classes = time.get("by_class") if isinstance(time, Mapping) else None
    if not isinstance(classes, Mapping) or not classes:
        return page
    busy = sum(float(v) for v in classes.values()) or 1.0
    rows = [
        {
            "kernel class": str(name).replace("_", " "),
            "GPU ms per step": f"{float(v) * 1e3:.3g}",
            "share": f"{float(v) / busy:.0%}",
        }
        for name, v in classes.items()
    ]
    bound = str(time.get("bound_by", "")).replace("_", " ") if isinstance(time, Mapping) else ""
    page += f"<h3>Predicted time by kernel class (bound by {html.escape(bound)})</h3>" + html_table(rows)
    band = estimate.get("speed_accuracy")
    if isinstance(band, Mapping) and band.get("text"):
        page += f"<p>Such predictions were {html.escape(str(band['text']))}.</p>"
    return page


def report_html(
    run: RecordedRun,
    timeline: bytes,
    findings: Sequence[MemoryFinding],
    *,
    probe: Mapping[str, Any] | None = None,
    estimate: Mapping[str, Any] | None = None,
    plan: Mapping[str, Any] | None = None,
    title: str = "memfit report",
    snapshot: Mapping[str, Any] | None = None,
    viewer_page: str | None = None,
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
    if snapshot is not None:
        parts.append(snapshot_html(snapshot, title="the monitored run", viewer_page=viewer_page))
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
            {
                "severity": f.get("severity"),
                "check": f.get("check"),
                "finding": f.get("message"),
                "fix": f.get("fix") or "",
            }
            for f in doctor.get("findings", [])
            if isinstance(f, Mapping)
        ]
        parts.append(html_table(rows) if rows else '<p class="ok">No findings.</p>')
    sections = (
        ("probe", "Probe", probe, probe_png, _probe_html),
        ("estimate", "Estimate", estimate, estimate_png, _estimate_html),
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


def write_results_report(
    output: str | os.PathLike[str],
    *,
    title: str = "memfit report",
    doctor: Mapping[str, Any] | None = None,
    probe: Mapping[str, Any] | None = None,
    estimate: Mapping[str, Any] | None = None,
    plan: Mapping[str, Any] | None = None,
    snapshot: Mapping[str, Any] | None = None,
    snapshot_title: str = "one training step",
) -> Path:
    """A report of results without a monitored run (what ``memfit fit`` writes): the HTML
    page, and each figure also as a PNG beside it (``report-probe.png``, ...).

    With ``snapshot`` (an allocator history in PyTorch's memory viewer format) the page
    embeds it (:mod:`memfit.reporting.memory_viz`), and the pickle and the viewer's page go
    beside it (``report-snapshot.pickle``, ``report-memory-viz.html``).
    """
    html_path = check_report_outputs(output)
    figures: dict[str, bytes] = {}
    body = results_html(doctor=doctor, probe=probe, estimate=estimate, plan=plan, figures=figures)
    extra_files: dict[Path, bytes] = {}
    if snapshot is not None:
        viewer = snapshot_files(html_path, snapshot, extra_files)
        body.append(snapshot_html(snapshot, title=snapshot_title, viewer_page=viewer))
    page = "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>",
            *body,
            "</body></html>\n",
        ]
    )
    for name, png in figures.items():
        write_atomically(html_path.with_name(f"{html_path.stem}-{name}.png"), png)
    for path, data in extra_files.items():
        write_atomically(path, data)
    write_atomically(html_path, page.encode("utf-8"))
    return html_path


#: what a report writes beside its page, by suffix: ``report.html`` -> ``report-probe.png``, ...
REPORT_FILES = (
    "-probe.png",
    "-estimate.png",
    "-plan.png",
    "-timeline.png",
    "-snapshot.pickle",
    "-memory-viz.html",
)


def check_report_outputs(output: str | os.PathLike[str]) -> Path:
    """Refuse, in one line and before any work, a report page or any file beside it that
    cannot be written (a folder where the snapshot goes, a pipe, a name too long); return the page's path.

    Args:
        output: the HTML page to write.
    """
    html_path = check_writable(output, "report")
    for suffix in REPORT_FILES:
        check_writable(html_path.with_name(f"{html_path.stem}{suffix}"), "report file")
    return html_path


def snapshot_files(html_path: Path, snapshot: Mapping[str, Any], files: dict[Path, bytes]) -> str:
    """Add the snapshot's pickle and the viewer's page (beside ``html_path``) to ``files``;
    return the viewer page's relative link."""
    viewer = html_path.with_name(f"{html_path.stem}-memory-viz.html")
    files[html_path.with_name(f"{html_path.stem}-snapshot.pickle")] = snapshot_bytes(dict(snapshot))
    files[viewer] = viewer_html(snapshot).encode("utf-8")
    return viewer.name


def written_snapshot(run: Any, recorded: RecordedRun) -> Path | None:
    """The snapshot the monitor wrote, if it is still there (as recorded, or beside the run file)."""
    written = run.snapshot if isinstance(run, Monitor) else recorded.header.get("snapshot")
    if not isinstance(written, (str, os.PathLike)):
        return None
    places = [Path(written)]
    if isinstance(run, (str, os.PathLike)):
        places.append(Path(run).parent / Path(written).name)
    return next((place for place in places if place.is_file()), None)


def load_snapshot(source: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A snapshot as a dict: given as one, or a pickle file (``torch.cuda.memory._dump_snapshot``'s,
    or memfit's). Only plain data is unpickled: a file that names any class is refused."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    try:
        data = _PlainUnpickler(io.BytesIO(path.read_bytes())).load()
    except OSError as error:
        raise MemfitError(f"cannot read the snapshot {path}: {error.strerror or error}") from None
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise MemfitError(f"{path} is not a memory snapshot (a pickle of plain data): {error}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("segments"), list):
        raise MemfitError(f"{path} is not a memory snapshot: no segments (write one with memfit estimate --snapshot)")
    return dict(data)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles lists, dicts, strings and numbers only: a snapshot never names a class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


# -- files -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportFiles:
    """What :func:`write_report` wrote, and the findings it reported."""

    html: Path
    png: Path
    findings: list[MemoryFinding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"html": str(self.html), "png": str(self.png), "findings": [f.to_dict() for f in self.findings]}


#: what each result must hold to be one (``memfit X --json`` writes these keys), as
def _result_schemas() -> dict[str, Table]:
    """What each ``memfit {probe,estimate,plan} --json`` result holds that a page draws, field by field."""
    size = functools.partial(Field, "int", nullable=True, low=0, high=MAX_BYTES)
    speed = Field("number", required=False, nullable=True, low=0, high=1e15)
    batch = functools.partial(Field, "int", low=0, high=MAX_COUNT)
    row = Table({"peak_reserved": size(required=False), "samples_per_second": speed})
    return {
        "probe": Table(
            {
                "max_batch_size": batch(),
                "recommended_batch_size": batch(),
                "trials": Rows(
                    Table(
                        {
                            "batch_size": batch(low=1),
                            "peak_allocated": size(required=False),
                            "peak_reserved": size(required=False),
                            "samples_per_second": speed,
                        }
                    )
                ),
                "capacity": size(required=False),
            }
        ),
        "estimate": Table(
            {
                "batch_size": batch(low=1),
                "peak_allocated": size(nullable=False),
                "peak_reserved": size(required=False, nullable=False),
                "total": size(nullable=False),
                "breakdown": Field("table"),
                "memory": size(required=False),
            }
        ),
        "plan": Table(
            {
                "workload": Field("str"),
                "candidates": Rows(row),
                "target_batch_size": batch(required=False, low=1),
                "pareto": Rows(row, required=False),
                "recommended": Field("table", required=False, nullable=True, fields=row),
                "capacity": size(required=False),
            }
        ),
    }


RESULT_SCHEMAS = _result_schemas()


def _schema_problem(data: Mapping[str, Any], what: str) -> str | None:
    """Why ``data`` is not a ``memfit {what} --json`` result (None: it is one): the field and why."""
    try:
        RESULT_SCHEMAS[what].check(data, "result")
    except MemfitError as error:
        return str(error).removeprefix("result: ")
    return None


def load_result(source: Mapping[str, Any] | str | os.PathLike[str] | Any, what: str) -> dict[str, Any]:
    """A probe/estimate/plan result as a dict: given as a dict, a result object, or a JSON file.

    A file or dict that is not that command's result (another command's, or anything
    else) is refused with one line, before any page is drawn.

    Args:
        source: the result object, its ``to_dict()``, or a ``memfit {what} --json`` file.
        what: ``"probe"``, ``"estimate"`` or ``"plan"``.
    """
    where = f"the {what} result"
    if isinstance(source, (str, os.PathLike)):
        where = f"the {what} file {source}"
        data = load_json(source, f"{what} file", hint=f"write it with `memfit {what} --json`", where=where)
    else:
        data = (
            source.to_dict()
            if hasattr(source, "to_dict")
            else dataclasses.asdict(source)
            if dataclasses.is_dataclass(source) and not isinstance(source, type)
            else source
        )
    if not isinstance(data, Mapping):
        raise MemfitError(f"{where} must be a JSON object, as `memfit {what} --json` writes")
    problem = _schema_problem(data, what)
    if problem:
        raise MemfitError(f"{where} is not a `memfit {what} --json` result ({problem})")
    return dict(data)


def timeline_path(output: Path) -> Path:
    """Where the timeline PNG goes: beside the HTML, ``report.html`` -> ``report-timeline.png``."""
    return output.with_name(f"{output.stem}-timeline.png")


def write_report(
    run: RecordedRun | Monitor | str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    probe: Any = None,
    estimate: Any = None,
    plan: Any = None,
    title: str = "memfit report",
    snapshot: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> ReportFiles:
    """Write the HTML report and, beside it, the timeline PNG; return their paths.

    Everything is rendered before anything is written, and each file is written
    atomically, so a bad input leaves no file behind.

    Args:
        run: a :class:`~memfit.monitor.monitor.Monitor`, a run read back with
            :func:`memfit.read_run`, or the path of a monitor's JSON lines file.
        output: the HTML file to write (the PNG goes beside it).
        probe: a probe result (object, dict, or ``memfit probe --json`` file).
        estimate: an estimate result, likewise.
        plan: a plan result, likewise.
        title: the page's title.
        snapshot: an allocator snapshot (a dict, or a pickle file) to embed; by default
            the one the monitor wrote (``Monitor(snapshot=...)``), when it is there.
    """
    html_path = check_report_outputs(output)
    png_path = timeline_path(html_path)
    if isinstance(run, Monitor):
        recorded = run.recorded()
    elif isinstance(run, RecordedRun):
        recorded = run
    else:
        recorded = read_run(run)
    results = {
        "probe": load_result(probe, "probe") if probe is not None else None,
        "estimate": load_result(estimate, "estimate") if estimate is not None else None,
        "plan": load_result(plan, "plan") if plan is not None else None,
    }
    if snapshot is None:
        snapshot = written_snapshot(run, recorded)
    loaded = load_snapshot(snapshot) if snapshot is not None else None
    findings = recorded.findings()
    timeline = timeline_png(recorded.header, recorded.records, findings)
    extra_files: dict[Path, bytes] = {}
    viewer = snapshot_files(html_path, loaded, extra_files) if loaded is not None else None
    page = report_html(recorded, timeline, findings, title=title, snapshot=loaded, viewer_page=viewer, **results)
    write_atomically(png_path, timeline)
    for path, data in extra_files.items():
        write_atomically(path, data)
    write_atomically(html_path, page.encode("utf-8"))
    return ReportFiles(html=html_path, png=png_path, findings=findings)
