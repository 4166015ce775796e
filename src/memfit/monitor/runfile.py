"""A monitored run on disk: JSON lines, a header first, one record per recorded step.

:func:`read_run` reads a file the :class:`~memfit.monitor.monitor.Monitor` wrote (a run
that crashed mid-line included); :class:`RecordedRun` holds it and gives its summary and
findings.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.monitor.findings import DEFAULT_WINDOW, MemoryFinding, analyze_steps

__all__ = ["RecordedRun", "read_run", "summarize", "FORMAT_VERSION"]

#: version of the JSON lines format (the header's "format")
FORMAT_VERSION = 1


def summarize(header: Mapping[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run in a few numbers: steps, last and highest memory, retries, OOMs."""
    steps = [r for r in records if r.get("kind", "step") == "step"]
    last = steps[-1] if steps else {}
    return {
        "device": header.get("description") or header.get("device"),
        "capacity": header.get("capacity"),
        "steps_recorded": len(steps),
        "last_step": last.get("step"),
        "allocated": last.get("allocated"),
        "reserved": last.get("reserved"),
        "highest_peak_allocated": max((r.get("peak_allocated", 0) for r in steps), default=None),
        "highest_reserved": max((r.get("peak_reserved", 0) for r in steps), default=None),
        "num_alloc_retries": last.get("num_alloc_retries", 0),
        "num_ooms": last.get("num_ooms", 0),
        # the median: the first step pays for warm-up (kernels, lazy imports, optimizer state)
        "seconds_per_step": statistics.median(r.get("seconds", 0.0) for r in steps) if steps else None,
    }


@dataclass
class RecordedRun:
    """A run read back from its JSON lines: the header and the step records."""

    header: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def capacity(self) -> int | None:
        capacity = self.header.get("capacity")
        return int(capacity) if isinstance(capacity, int) else None

    def findings(self, window: int | None = None) -> list[MemoryFinding]:
        return analyze_steps(
            self.records, capacity=self.capacity, window=window or int(self.header.get("window") or DEFAULT_WINDOW)
        )

    def summary(self) -> dict[str, Any]:
        return summarize(self.header, self.records)


def read_run(path: str | os.PathLike[str]) -> RecordedRun:
    """Read a monitor's JSON lines file; raise MemfitError naming the first bad line.

    A truncated last line (the process died while writing it) is skipped, because a run
    that crashed is the one most worth reading.
    """
    source = Path(path)
    try:
        lines = source.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise MemfitError(f"cannot read {source}: {error.strerror or error}") from None
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
        if not isinstance(item, dict):
            raise MemfitError(f"{source}:{number}: not a memfit monitor record")
        if header is None:
            if item.get("kind") != "header":
                raise MemfitError(f"{source}: not a memfit monitor run (the first line is not its header)")
            header = item
            continue
        if (
            item.get("kind") != "step"
            or not isinstance(item.get("step"), int)
            or not isinstance(item.get("allocated"), int)
        ):
            raise MemfitError(f"{source}:{number}: not a memfit monitor step record")
        records.append(item)
    if header is None:
        raise MemfitError(f"{source}: empty, not a memfit monitor run")
    return RecordedRun(header, records)
