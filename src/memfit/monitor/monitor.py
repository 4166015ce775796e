"""Monitor: a per-step memory timeline of a training loop, and what it says is wrong.

Call ``monitor.step()`` at each step boundary; the monitor records allocated and reserved
memory at that moment, the peak since the previous step (the peaks are reset at every
recorded step), the reserve no tensor holds, the allocator's retries and OOMs since the
monitor started, the step's time and any labels you pass (a phase, the batch's shape).
It writes the records as JSON lines to ``path`` (a header line first), flushed one by
one, so a run that dies still leaves its timeline; ``memfit report`` turns the file into
a picture and a page. ``monitor.findings`` names leaks, fragmentation and new-shape peaks
(:mod:`memfit.monitor.findings`).

Bounded memory, however long the run: the findings and the summary stream (running
maxima and counts, and per rule only the steps it needs), and ``monitor.records`` holds
the last ``keep`` records; every record goes to the file.

Cheap by design: a step reads the allocator's counters and resets its peaks; it never
waits for the GPU unless ``synchronize=True`` (then step times are the GPU's too).

>>> import torch
>>> from memfit.monitor.monitor import Monitor
>>> with Monitor("sim:64MiB") as monitor:
...     kept = []
...     for step in range(12):
...         kept.append(torch.ones(1024))   # 4 KiB kept every step: a leak
...         _ = monitor.step(phase="train")
>>> [finding.kind for finding in monitor.findings]
['leak']
>>> monitor.records[-1]["allocated"] - monitor.records[-2]["allocated"]
4096
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from memfit._html import to_html
from memfit._io import write_atomically
from memfit._plot import png_data_uri
from memfit._version import __version__
from memfit.distributed import rank
from memfit.errors import MemfitError
from memfit.memory.allocator import snapshot_bytes
from memfit.memory.devices import CudaDevice, Device, SimDevice, active_device
from memfit.memory.devices import device as make_device
from memfit.memory.oom import is_oom
from memfit.monitor.findings import DEFAULT_WINDOW, FindingsStream, MemoryFinding, findings_html
from memfit.monitor.runfile import FORMAT_VERSION, RecordedRun, StepSummary, read_run
from memfit.monitor.timeline import timeline_png
from memfit.units import format_size

__all__ = ["Monitor", "jsonable_label", "describe_record", "DEFAULT_KEEP"]

#: records a monitor holds in memory by default (about 10 MiB of Python dicts); the file
#: and the streamed findings and summary cover every step
DEFAULT_KEEP = 10_000


def jsonable_label(value: Any) -> Any:
    """A label value as JSON: a tensor becomes its shape, a torch.Size or tuple a list.

    Why shapes: ``monitor.step(inputs=x)`` should record what matters for memory (the
    shape), not the tensor's contents.
    """
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (torch.Size, tuple, list)):
        return [jsonable_label(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): jsonable_label(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


def resolve_device(spec: Device | str | None) -> Device:
    """The device to watch: the one given, else the one the loop runs in
    (``with memfit.device("sim:8GiB"):``), else the current CUDA device.

    Why no simulated default: a monitor on a device nothing runs on records nothing, so
    without a GPU and outside a ``memfit.device`` block the caller must say which.
    """
    if spec is not None:
        return make_device(spec)
    entered = active_device()
    if entered is not None:
        return entered
    if not torch.cuda.is_available():
        raise MemfitError(
            "Monitor needs a device: no CUDA GPU here; pass one, such as Monitor('sim:8GiB'), "
            "or make the monitor inside `with memfit.device('sim:8GiB'):`"
        )
    return make_device(f"cuda:{torch.cuda.current_device()}")


def resolve_path(path: str | os.PathLike[str] | None) -> Path | None:
    """The JSON lines path, with ``{rank}`` replaced by this process's rank.

    Why: under torchrun every rank runs the same code; ``path="run-{rank}.jsonl"`` gives
    each its own file instead of several processes writing one.
    """
    if path is None:
        return None
    text = os.fspath(path)
    if "{rank}" in text:
        text = text.replace("{rank}", str(rank()))
    return Path(text)


class Monitor:
    """Record memory at each step boundary; find leaks, fragmentation and new-shape peaks.

    Use it as a context manager and call :meth:`step` at the end of each training step.

    Args:
        device: a memfit device or spec (``"sim:8GiB"``, ``"cuda:0"``); None means the
            device of the ``with memfit.device(...)`` block the monitor is made in, else the
            current CUDA device. The monitor enters the device for the duration of the
            ``with`` block (for ``sim:`` and ``cpu`` that is what counts the tensors).
        path: JSON lines file to write (replaced if it exists; ``{rank}`` is the rank),
            for ``memfit report``.
        every: record one step in ``every`` (peaks then cover all the steps in between).
        snapshot: a pickle file for PyTorch's memory viewer
            (https://pytorch.org/memory_viz): the allocator's history is recorded while
            the monitor runs and dumped when it exits (on CUDA by PyTorch; on ``sim:``
            and ``cpu`` by memfit's allocator model, in the same format).
        max_entries: the most allocator events the snapshot keeps.
        window: consecutive recorded steps a leak must persist over.
        synchronize: wait for the GPU at each recorded step, so step times are exact.
        keep: the most recent records held in ``monitor.records`` (every record goes to
            ``path``; findings and the summary cover the whole run whatever this is).
    """

    def __init__(
        self,
        device: Device | str | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        every: int = 1,
        snapshot: str | os.PathLike[str] | None = None,
        max_entries: int = 100_000,
        window: int = DEFAULT_WINDOW,
        synchronize: bool = False,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        _check_positive("every", every)
        _check_positive("max_entries", max_entries)
        _check_positive("keep", keep)
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise MemfitError(f"invalid window {window!r}: must be an integer of at least 3")
        self.device = resolve_device(device)
        if snapshot is not None and not isinstance(self.device, (CudaDevice, SimDevice)):
            raise MemfitError(
                f"snapshot= needs a CUDA or simulated device (one whose allocator history is recorded); "
                f"{self.device.spec} is neither"
            )
        self.path = resolve_path(path)
        self.snapshot = Path(snapshot) if snapshot is not None else None
        self.every = every
        self.max_entries = max_entries
        self.window = window
        self.synchronize = synchronize
        self.keep = keep
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._stream = FindingsStream(window)
        self._summary = StepSummary(keep)
        self.header: dict[str, Any] = {}
        self._file: IO[str] | None = None
        self._steps = 0
        self._baseline = {"num_alloc_retries": 0, "num_ooms": 0}
        self._started = 0.0
        self._last = 0.0
        self._last_recorded_step = -1
        self._active = False
        self._recording_history = False

    # -- the context manager -----------------------------------------------------------

    def __enter__(self) -> Monitor:
        if self._active:
            raise MemfitError("this Monitor is already running; make a new one for another run")
        self.device.__enter__()
        try:
            if self.snapshot is not None:
                if isinstance(self.device, SimDevice):
                    self.device.allocator.record_history(max_entries=self.max_entries)
                else:
                    torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
                self._recording_history = True
            stats = self.device.memory_stats()
            self._baseline = {key: int(stats.get(key, 0)) for key in self._baseline}
            self.device.reset_peak_memory_stats()
            self.header = self._make_header()
            if self.path is not None:
                # a log, appended to step by step (a run that dies keeps its steps so far), so
                # not written atomically; read_run skips a last line cut short
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("w", encoding="utf-8")
                except OSError as error:
                    raise MemfitError(
                        f"cannot write the monitor's file {self.path}: {error.strerror or error}"
                    ) from None
                self._write(self.header)
        except BaseException:
            self._close()
            raise
        self._recent.clear()
        self._stream = FindingsStream(self.window)
        self._summary = StepSummary(self.keep)
        self._steps = 0
        self._last_recorded_step = -1
        self._active = True
        self._started = self._last = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is not None and isinstance(exc, Exception) and is_oom(exc):
                self._record(self._steps, {}, event="oom", message=str(exc).split("\n")[0])
        finally:
            self._close()
        return None  # exceptions propagate unchanged

    def step(self, **labels: Any) -> dict[str, Any] | None:
        """Mark the end of a training step; return the record, or None when not recorded."""
        if not self._active:
            raise MemfitError("monitor.step() outside its `with Monitor(...)` block")
        self._steps += 1
        if self._steps % self.every:
            return None
        return self._record(self._steps - 1, labels)

    # -- results -----------------------------------------------------------------------

    @property
    def records(self) -> list[dict[str, Any]]:
        """The last ``keep`` step records (the file has them all)."""
        return list(self._recent)

    @property
    def findings(self) -> list[MemoryFinding]:
        """Leak, fragmentation and new-shape-peak findings over the whole run so far."""
        return self._stream.findings(self.device.capacity)

    def summary(self) -> dict[str, Any]:
        """The run in a few numbers (bytes as ints), for tables and JSON; the step time is
        the median of the last ``keep`` steps."""
        return self._summary.to_dict(self.header)

    def recorded(self) -> RecordedRun:
        """The run so far, for ``memfit.write_report``: read back from the file when there is
        one (every step), else the records held, with the whole run's findings and summary."""
        if self.path is not None and self.path.exists():
            if self._file is not None:
                self._file.flush()
            return read_run(self.path)
        return RecordedRun(dict(self.header), self.records, known_findings=self.findings, known_summary=self.summary())

    def _repr_html_(self) -> str:
        """A monitor in a notebook: its summary, its findings and its timeline."""
        findings = self.findings
        parts = [to_html(self.summary()), findings_html(findings)]
        if self.records:
            png = timeline_png(self.header, self.records, findings)
            parts.append(f'<img src="{png_data_uri(png)}" alt="memory timeline">')
        return "<div>" + "".join(parts) + "</div>"

    def __repr__(self) -> str:
        return f"<memfit Monitor on {self.device.spec}: {len(self.records)} steps recorded>"

    # -- internals ---------------------------------------------------------------------

    def _make_header(self) -> dict[str, Any]:
        return {
            "kind": "header",
            "format": FORMAT_VERSION,
            "memfit": __version__,
            "torch": torch.__version__,
            "device": self.device.spec,
            "description": self.device.describe(),
            "capacity": self.device.capacity,
            "simulated": self.device.simulated,
            "every": self.every,
            "window": self.window,
            "snapshot": str(self.snapshot) if self.snapshot is not None else None,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    def _record(self, step: int, labels: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
        if self.synchronize:
            self.device.synchronize()
        now = time.perf_counter()
        stats = self.device.memory_stats()
        self.device.reset_peak_memory_stats()
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        steps_covered = max(step - self._last_recorded_step, 1)
        record: dict[str, Any] = {
            "kind": "step",
            "step": step,
            "time": round(now - self._started, 6),
            "seconds": round((now - self._last) / steps_covered, 6),
            "allocated": allocated,
            "reserved": reserved,
            "peak_allocated": int(stats.get("allocated_bytes.all.peak", allocated)),
            "peak_reserved": int(stats.get("reserved_bytes.all.peak", reserved)),
            "unallocated": reserved - allocated,
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)) - self._baseline["num_alloc_retries"],
            "num_ooms": int(stats.get("num_ooms", 0)) - self._baseline["num_ooms"],
            "labels": {str(key): jsonable_label(value) for key, value in labels.items()},
        }
        record.update(extra)
        self._recent.append(record)
        self._stream.add(record)
        self._summary.add(record)
        self._last = now
        self._last_recorded_step = step
        if self._file is not None:
            self._write(record)
        return record

    def _write(self, record: Mapping[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()  # a run that dies still leaves every step written so far

    def _close(self) -> None:
        try:
            if self._recording_history and self.snapshot is not None:
                self._recording_history = False
                if isinstance(self.device, SimDevice):
                    _dump_model_snapshot(self.device, self.snapshot)
                else:
                    _dump_snapshot(self.snapshot)
        finally:
            self._active = False
            if self._file is not None:
                self._file.close()
                self._file = None
            self.device.__exit__(None, None, None)


def _dump_snapshot(path: Path) -> None:
    """Write the recorded allocator history (as ``torch.cuda.memory._dump_snapshot`` does:
    the pickled ``_snapshot()``) through the one atomic writer, then stop recording it."""
    try:
        write_atomically(path, pickle.dumps(torch.cuda.memory._snapshot()))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _dump_model_snapshot(device: SimDevice, path: Path) -> None:
    """Write the allocator model's history (PyTorch's snapshot format) atomically, then stop recording."""
    try:
        write_atomically(path, snapshot_bytes(device.allocator.snapshot()))
    finally:
        device.allocator.record_history(enabled=False)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemfitError(f"invalid {name} {value!r}: must be a positive integer")


def describe_record(record: Mapping[str, Any]) -> str:
    """One line for a step record, for logs."""
    return (
        f"step {record['step']}: allocated {format_size(record['allocated'])}, "
        f"reserved {format_size(record['reserved'])}, peak {format_size(record['peak_allocated'])}"
    )
