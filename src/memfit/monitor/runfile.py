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

from memfit._read import MAX_DEPTH, NotFiniteError, nesting_depth, read_text, strict_loads
from memfit._schema import MAX_BYTES, MAX_COUNT, MAX_TEXT, Field, Table
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


def _bytes(required: bool = False) -> Field:
    return Field("int", required=required, low=0, high=MAX_BYTES)


def _text() -> Field:
    return Field("str", required=False, nullable=True, high=MAX_TEXT)


#: a monitor's header, as :class:`~memfit.monitor.monitor.Monitor` writes it (other keys left alone)
HEADER_SCHEMA = Table(
    {
        "kind": Field("str", choices=("header",)),
        "format": Field("int", required=False, low=1, high=FORMAT_VERSION),
        "capacity": Field("int", required=False, nullable=True, low=0, high=MAX_BYTES),
        "window": Field("int", required=False, nullable=True, low=3, high=MAX_COUNT),
        "every": Field("int", required=False, nullable=True, low=1, high=MAX_COUNT),
        "simulated": Field("bool", required=False, nullable=True),
        **{name: _text() for name in ("device", "description", "memfit", "torch", "snapshot", "started")},
    }
)
#: one step record: whole numbers of bytes and counts, seconds, labels
STEP_SCHEMA = Table(
    {
        "kind": Field("str", choices=("step",)),
        "step": Field("int", low=0, high=MAX_COUNT),
        "allocated": _bytes(required=True),
        **{name: _bytes() for name in ("reserved", "peak_allocated", "peak_reserved", "unallocated")},
        **{name: Field("int", required=False, low=0, high=MAX_COUNT) for name in ("num_alloc_retries", "num_ooms")},
        **{name: Field("number", required=False, low=0, high=1e9) for name in ("time", "seconds")},
        "labels": Field("table", required=False),
    }
)


def _checked(table: Table, item: Any, source: Path, number: int, what: str) -> dict[str, Any]:
    """``item`` when it fits ``table``; else one line naming the file, the line and the field."""
    try:
        return table.check(item, f"{source}:{number}")
    except MemfitError as error:
        where, _, problem = str(error).partition(f"{source}:{number}: ")
        raise MemfitError(f"{source}:{number}: {what} ({problem or where})") from None


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
            item = strict_loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and header is not None:
                break  # the last line was cut short by a crash
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (not JSON)") from None
        except NotFiniteError as error:
            raise MemfitError(f"{source}:{number}: not a memfit monitor record ({error} is no number)") from None
        except ValueError:  # int(): more digits than Python converts
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (a number too long)") from None
        except RecursionError:
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (nested too deeply)") from None
        if nesting_depth(item) > MAX_DEPTH:
            raise MemfitError(f"{source}:{number}: not a memfit monitor record (nested too deeply)")
        if not isinstance(item, dict):
            raise MemfitError(f"{source}:{number}: not a memfit monitor record")
        if header is None:
            if item.get("kind") != "header":
                raise MemfitError(f"{source}: not a memfit monitor run (the first line is not its header)")
            header = _checked(HEADER_SCHEMA, item, source, number, "a damaged memfit monitor header")
            continue
        records.append(_checked(STEP_SCHEMA, item, source, number, "not a memfit monitor step record"))
    if header is None:
        raise MemfitError(f"{source}: empty, not a memfit monitor run")
    return RecordedRun(header, records)
