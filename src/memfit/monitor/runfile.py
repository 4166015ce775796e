"""A monitored run on disk: JSON lines, a header first, one record per recorded step.

:func:`read_run` reads a file the :class:`~memfit.monitor.monitor.Monitor` wrote (a run
that crashed mid-line included); :class:`RecordedRun` holds it and gives its summary and
findings.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit._read import MAX_DEPTH, nesting_depth, read_text
from memfit.errors import MemfitError
from memfit.monitor.findings import DEFAULT_WINDOW, MemoryFinding, analyze_steps

__all__ = ["RecordedRun", "read_run", "summarize", "StepSummary", "FORMAT_VERSION"]

#: version of the JSON lines format (the header's "format")
FORMAT_VERSION = 1


def summarize(header: Mapping[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run in a few numbers: steps, last and highest memory, retries, OOMs."""
    summary = StepSummary()
    for record in records:
        summary.add(record)
    return summary.to_dict(header)


class StepSummary:
    """The numbers of :func:`summarize`, kept as records arrive: counts, the last record,
    running maxima, and the step times of the last ``keep`` steps (all when None).

    Why a window for the times only: the median step time needs the times themselves;
    everything else is a running count or maximum, so a monitor's summary stays the same
    size however long the run.
    """

    def __init__(self, keep: int | None = None) -> None:
        self.steps = 0
        self.last: dict[str, Any] = {}
        self.highest_peak_allocated: int | None = None
        self.highest_reserved: int | None = None
        self.seconds: collections.deque[float] = collections.deque(maxlen=keep)

    def add(self, record: Mapping[str, Any]) -> None:
        if record.get("kind", "step") != "step":
            return
        self.steps += 1
        self.last = dict(record)
        peak, reserved = record.get("peak_allocated", 0), record.get("peak_reserved", 0)
        self.highest_peak_allocated = (
            peak if self.highest_peak_allocated is None else max(self.highest_peak_allocated, peak)
        )
        self.highest_reserved = reserved if self.highest_reserved is None else max(self.highest_reserved, reserved)
        self.seconds.append(record.get("seconds", 0.0))

    def to_dict(self, header: Mapping[str, Any]) -> dict[str, Any]:
        last = self.last
        return {
            "device": header.get("description") or header.get("device"),
            "capacity": header.get("capacity"),
            "steps_recorded": self.steps,
            "last_step": last.get("step"),
            "allocated": last.get("allocated"),
            "reserved": last.get("reserved"),
            "highest_peak_allocated": self.highest_peak_allocated,
            "highest_reserved": self.highest_reserved,
            "num_alloc_retries": last.get("num_alloc_retries", 0),
            "num_ooms": last.get("num_ooms", 0),
            # the median: the first step pays for warm-up (kernels, lazy imports, optimizer state)
            "seconds_per_step": statistics.median(self.seconds) if self.seconds else None,
        }


@dataclass
class RecordedRun:
    """A run read back from its JSON lines: the header and the step records."""

    header: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    #: findings already worked out over the whole run (a monitor's, whose records are only
    #: the last ones it kept); None: work them out from ``records``
    known_findings: list[MemoryFinding] | None = None
    #: likewise the summary over the whole run
    known_summary: dict[str, Any] | None = None

    @property
    def capacity(self) -> int | None:
        capacity = self.header.get("capacity")
        return int(capacity) if isinstance(capacity, int) else None

    def findings(self, window: int | None = None) -> list[MemoryFinding]:
        if self.known_findings is not None and window is None:
            return list(self.known_findings)
        return analyze_steps(
            self.records, capacity=self.capacity, window=window or int(self.header.get("window") or DEFAULT_WINDOW)
        )

    def summary(self) -> dict[str, Any]:
        if self.known_summary is not None:
            return dict(self.known_summary)
        return summarize(self.header, self.records)


#: fields of a step record that hold whole numbers (bytes or counts), when present
_INT_FIELDS = ("peak_allocated", "reserved", "peak_reserved", "unallocated", "num_alloc_retries", "num_ooms")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _record_problem(item: Mapping[str, Any]) -> str | None:
    """Why a JSON object is not a step record the findings and the timeline can read (None: it is)."""
    if item.get("kind") != "step":
        return f"kind {item.get('kind')!r}"
    for name in ("step", "allocated"):
        if not _is_int(item.get(name)):
            return f"{name} must be a whole number"
    for name in _INT_FIELDS:
        if name in item and not _is_int(item[name]):
            return f"{name} must be a whole number"
    if "seconds" in item and (isinstance(item["seconds"], bool) or not isinstance(item["seconds"], (int, float))):
        return "seconds must be a number"
    if "labels" in item and not isinstance(item["labels"], Mapping):
        return "labels must be an object"
    return None


def _header_problem(header: Mapping[str, Any]) -> str | None:
    """Why a header cannot be used (None: it can)."""
    if header.get("capacity") is not None and not _is_int(header["capacity"]):
        return "capacity must be a whole number"
    window = header.get("window")
    if window is not None and (not _is_int(window) or window < 3):
        return "window must be a whole number of at least 3"
    return None


def read_run(path: str | os.PathLike[str]) -> RecordedRun:
    """Read a monitor's JSON lines file; raise MemfitError naming the first bad line.

    A truncated last line (the process died while writing it) is skipped, because a run
    that crashed is the one most worth reading.
    """
    source = Path(path)
    lines = read_text(source, "monitor run").splitlines()
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and header is not None:
                break  # the last line was cut short by a crash
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (not JSON)") from None
        except RecursionError:
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (nested too deeply)") from None
        if nesting_depth(item) > MAX_DEPTH:
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (nested too deeply)")
        if not isinstance(item, dict):
            raise MemfitError(f"{source}:{number}: not a memfit monitor record")
        if header is None:
            if item.get("kind") != "header":
                raise MemfitError(f"{source}: not a memfit monitor run (the first line is not its header)")
            problem = _header_problem(item)
            if problem:
                raise MemfitError(f"{source}:{number}: a damaged memfit monitor header ({problem})")
            header = item
            continue
        problem = _record_problem(item)
        if problem:
            raise MemfitError(f"{source}:{number}: not a memfit monitor step record ({problem})")
        records.append(item)
    if header is None:
        raise MemfitError(f"{source}: empty, not a memfit monitor run")
    return RecordedRun(header, records)
