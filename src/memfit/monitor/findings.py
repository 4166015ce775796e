"""Findings: what a per-step memory timeline says is wrong, with the evidence and the causes.

Pure functions over the step records a :class:`memfit.Monitor` writes (a list of dicts,
bytes as ints): no torch, no device, so every rule is unit-tested on synthetic series.
Each kind of finding is reported at most once per run:

- ``leak``: memory at step boundaries keeps growing over a window of steps that ran the
  same input shapes (a loss kept with its graph, outputs appended, evaluation without
  ``no_grad``). Steps are compared within one group: the same ``phase`` label and the same
  shape labels, so a batch of longer sequences (labelled with its shape) is not taken
  for a leak.
- ``fragmentation``: the caching allocator holds far more than the run ever needed at
  once, and more as the run goes on, or it had to flush its cache and retry again and
  again. The cure on CUDA is ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
- ``shape_peak``: the peak rose with a new largest input shape: not a leak, but a sign
  that the batch size was chosen for shapes smaller than the worst case.

>>> steps = [{"step": i, "allocated": 1000 + 512 * i, "labels": {}} for i in range(12)]
>>> [finding.kind for finding in analyze_steps(steps)]
['leak']
>>> analyze_steps(steps)[0].evidence["growth_bytes_per_step"]
512
"""

from __future__ import annotations

import collections
import html
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit._html import html_table, inline_code, to_html
from memfit.units import MiB, format_size

__all__ = [
    "MemoryFinding",
    "analyze_steps",
    "FindingsStream",
    "find_leak",
    "find_fragmentation",
    "find_shape_peak",
    "shape_key",
    "shape_size",
    "rising_fraction",
    "steps_per_record",
    "growth_by_phase",
    "keeps_growing",
    "fragmentation_floor",
    "unused_reserve",
    "successful_retries",
    "DEFAULT_WINDOW",
    "SHAPE_LABEL_NAMES",
]

#: consecutive recorded steps (of one group) a leak must persist over
DEFAULT_WINDOW = 10
#: share of a window's step-to-step changes that must be increases for a leak
LEAK_RISING_FRACTION = 0.75
#: share of a window's rises a leak may give back (drops) and still count as growing
LEAK_GIVE_BACK = 0.25
#: a peak counts as new when it passes the previous highest by this share
NEW_PEAK_MARGIN = 0.05
#: reserved memory beyond the highest allocated peak counts as large from this share...
FRAGMENTATION_SHARE = 0.25
#: ...and from this many bytes, or this share of the capacity, whichever is larger
FRAGMENTATION_FLOOR = 64 * MiB
FRAGMENTATION_CAPACITY_SHARE = 0.02
#: recorded steps with a successful allocator retry before retries count as rising
RETRY_STEPS = 2

#: the most step numbers a finding's evidence lists (retry steps, new-shape peaks): a run of
#: millions of steps must not grow its findings without bound; the counts stay exact
MAX_EVIDENCE_STEPS = 1000

#: labels that hold an input shape even when their value is a single number
SHAPE_LABEL_NAMES = frozenset({"batch_size", "seq_len", "seq_length", "length", "num_tokens", "tokens"})

EXPANDABLE_SEGMENTS = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


@dataclass(frozen=True)
class MemoryFinding:
    """One problem the timeline shows. Bytes in ``evidence`` are ints."""

    kind: str  # "leak", "fragmentation" or "shape_peak"
    title: str  # one line, with the key number
    summary: str  # the evidence in a sentence or two
    first_step: int
    last_step: int
    evidence: dict[str, Any] = field(default_factory=dict)
    causes: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "title": self.title,
            "summary": self.summary,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "evidence": dict(self.evidence),
            "causes": list(self.causes),
            "advice": list(self.advice),
        }

    def __str__(self) -> str:
        return f"{self.title}: {self.summary}"

    def _repr_html_(self) -> str:
        """The finding as a block: title, summary, evidence, causes and advice."""
        return findings_html([self])


def analyze_steps(
    records: Sequence[Mapping[str, Any]],
    *,
    capacity: int | None = None,
    window: int = DEFAULT_WINDOW,
) -> list[MemoryFinding]:
    """Every finding the records support, each kind at most once, in a fixed order."""
    stream = FindingsStream(window)
    for record in records:
        stream.add(record)
    return stream.findings(capacity)


class FindingsStream:
    """The findings of a run, fed one record at a time, in memory that does not grow with it.

    Why: a monitor watches runs of millions of steps; it keeps the full records in its
    file, and here only what each rule needs: per group of steps the last ``window``
    boundaries and the first growing stretch's ends, the running highest peak and the
    worst unused reserve, the retry steps (up to :data:`MAX_EVIDENCE_STEPS`), the new-shape
    peaks. :func:`analyze_steps` is this stream over a list, so both give the same answer.

    >>> stream = FindingsStream(window=10)
    >>> for i in range(1000):
    ...     stream.add({"step": i, "allocated": 1000 + 512 * i, "labels": {}})
    >>> [f.kind for f in stream.findings()], stream.held() <= 3 * 10
    (['leak'], True)
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.leak = _LeakStream(window)
        self.fragmentation = _FragmentationStream()
        self.shape_peak = _ShapePeakStream()

    def add(self, record: Mapping[str, Any]) -> None:
        """Take the next record (records arrive in step order)."""
        self.leak.add(record)
        self.fragmentation.add(record)
        self.shape_peak.add(record)

    def findings(self, capacity: int | None = None) -> list[MemoryFinding]:
        """Every finding so far, each kind at most once, in a fixed order."""
        found = [self.leak.finding(), self.fragmentation.finding(capacity), self.shape_peak.finding()]
        return [finding for finding in found if finding is not None]

    def held(self) -> int:
        """How many step boundaries the stream holds (it does not grow with the run)."""
        return self.leak.held()


# -- shapes ----------------------------------------------------------------------------


def _is_shape(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, int) and (name in SHAPE_LABEL_NAMES or name.endswith("shape"))


def shape_key(labels: Mapping[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The input-shape part of a step's labels, as a hashable key.

    Why this rule: shapes arrive as ``shape=x.shape`` (a list of ints once recorded) or as a
    number under a name such as ``seq_len``; every other label (an epoch, a learning rate)
    changes from step to step without changing what a step allocates.
    """
    items = []
    for name, value in labels.items():
        if _is_shape(name, value):
            dims = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            items.append((name, dims))
    return tuple(sorted(items))


def shape_size(key: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    """How big a shape key is: the sum of its shapes' element counts (0 without shapes)."""
    return sum(math.prod(dims) for _, dims in key)


def _group_of(record: Mapping[str, Any]) -> tuple[Any, ...]:
    labels = record.get("labels") or {}
    return (labels.get("phase"), shape_key(labels))


# -- leak ------------------------------------------------------------------------------


def rising_fraction(values: Sequence[int]) -> float:
    """Share of consecutive changes in ``values`` that are increases (0.0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    rises = sum(1 for before, after in itertools.pairwise(values) if after > before)
    return rises / (len(values) - 1)


def keeps_growing(values: Sequence[int]) -> bool:
    """True when a window of boundary memory keeps growing: up in most steps, and not giving back.

    Why both tests: a leak rises in most steps (``LEAK_RISING_FRACTION``) and keeps what
    it gained (the drops sum to at most a quarter of the rises); a sawtooth (gradient
    accumulation, a cache that is cleared) rises as often but gives it all back.
    """
    if len(values) < 2 or values[-1] <= values[0]:
        return False
    rises = sum(after - before for before, after in itertools.pairwise(values) if after > before)
    net = values[-1] - values[0]
    return rising_fraction(values) >= LEAK_RISING_FRACTION and net >= (1 - LEAK_GIVE_BACK) * rises


def steps_per_record(records: Sequence[Mapping[str, Any]]) -> int:
    """How many steps one record stands for: the median gap between recorded steps (``every``)."""
    gaps = sorted(
        int(after["step"]) - int(before["step"])
        for before, after in itertools.pairwise(records)
        if int(after["step"]) > int(before["step"])
    )
    return gaps[len(gaps) // 2] if gaps else 1


def growth_by_phase(
    records: Sequence[Mapping[str, Any]], first_step: int, last_step: int, every: int = 1
) -> dict[Any, float]:
    """Bytes per step each phase added to boundary memory between two steps.

    Why by phase: a leak in evaluation also shows at the training steps' boundaries (the
    leaked memory stays); the phase whose steps *add* the memory is the one to fix. Each
    change between consecutive records of the same shapes is charged to the later one.
    """
    added: dict[Any, int] = {}
    counted: dict[Any, int] = {}
    span = [r for r in records if first_step <= int(r["step"]) <= last_step and "allocated" in r]
    for before, after in itertools.pairwise(span):
        if shape_key(before.get("labels") or {}) != shape_key(after.get("labels") or {}):
            continue
        phase = (after.get("labels") or {}).get("phase")
        added[phase] = added.get(phase, 0) + int(after["allocated"]) - int(before["allocated"])
        counted[phase] = counted.get(phase, 0) + 1
    return {phase: added[phase] / (counted[phase] * every) for phase in added}


def find_leak(records: Sequence[Mapping[str, Any]], *, window: int = DEFAULT_WINDOW) -> MemoryFinding | None:
    """Memory at step boundaries that keeps growing among steps of the same phase and shapes."""
    stream = _LeakStream(window)
    for record in records:
        stream.add(record)
    return stream.finding()


@dataclass(frozen=True)
class _Boundary:
    """One recorded step of a group: its memory, its step, and the phase growth so far."""

    allocated: int
    step: int
    #: per phase, (bytes added, changes counted) over the run up to this record
    growth: tuple[tuple[Any, int, int], ...]


class _GroupStretch:
    """One group's steps: the last ``window`` boundaries and its first growing stretch.

    The stretch is the first window where memory keeps growing, extended by every
    qualifying window that overlaps the last one; only its two end windows are kept,
    since trimming its ends (to the first and last rise) never looks further.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.recent: collections.deque[_Boundary] = collections.deque(maxlen=window)
        self.count = 0
        self.first_window: list[_Boundary] | None = None
        self.last_window: list[_Boundary] = []
        self.first_start = self.last_start = 0
        self.closed = False

    def add(self, boundary: _Boundary) -> None:
        self.recent.append(boundary)
        self.count += 1
        if self.count < self.window or self.closed:
            return
        start = self.count - self.window
        grows = keeps_growing([b.allocated for b in self.recent])
        if self.first_window is None:
            if grows:
                self.first_window, self.last_window = list(self.recent), list(self.recent)
                self.first_start = self.last_start = start
            return
        if start > self.last_start + self.window - 1:
            self.closed = True  # no later window can join the first stretch
        elif grows:
            self.last_start, self.last_window = start, list(self.recent)

    def ends(self) -> tuple[_Boundary, _Boundary] | None:
        """The stretch trimmed to its first and last rise: (first, last) boundaries."""
        if self.first_window is None:
            return None
        first, last = self.first_window, self.last_window
        start, end = self.first_start, self.last_start + self.window - 1

        def value(index: int) -> int:
            if index - self.first_start < len(first):
                return first[index - self.first_start].allocated
            return last[index - self.last_start].allocated

        while start < end and value(start + 1) <= value(start):
            start += 1
        while end > start and value(end - 1) >= value(end):
            end -= 1

        def at(index: int) -> _Boundary:
            if index - self.first_start < len(first):
                return first[index - self.first_start]
            return last[index - self.last_start]

        return at(start), at(end)


class _LeakStream:
    """The leak rule, fed one record at a time (see :func:`find_leak`)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.groups: dict[tuple[Any, ...], _GroupStretch] = {}
        self.growth: dict[Any, tuple[int, int]] = {}  # per phase: (bytes added, changes counted)
        self.previous: Mapping[str, Any] | None = None
        self.gaps: collections.Counter[int] = collections.Counter()
        self.previous_step: int | None = None

    def add(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if self.previous_step is not None and step > self.previous_step:
            self.gaps[step - self.previous_step] += 1
        self.previous_step = step
        if "allocated" not in record:
            return
        labels = record.get("labels") or {}
        if self.previous is not None and shape_key(self.previous.get("labels") or {}) == shape_key(labels):
            phase = labels.get("phase")
            added, counted = self.growth.get(phase, (0, 0))
            self.growth[phase] = (added + int(record["allocated"]) - int(self.previous["allocated"]), counted + 1)
        self.previous = record
        snapshot = tuple((phase, added, counted) for phase, (added, counted) in self.growth.items())
        group = self.groups.get(_group_of(record))
        if group is None:
            group = self.groups[_group_of(record)] = _GroupStretch(self.window)
        group.add(_Boundary(int(record["allocated"]), step, snapshot))

    def held(self) -> int:
        return sum(len(g.recent) + len(g.first_window or ()) + len(g.last_window) for g in self.groups.values())

    def steps_per_record(self) -> int:
        """The median gap between recorded steps (as :func:`steps_per_record`)."""
        total = sum(self.gaps.values())
        if not total:
            return 1
        seen = 0
        for gap in sorted(self.gaps):
            seen += self.gaps[gap]
            if seen > total // 2:
                return gap
        return 1  # pragma: no cover - the loop always returns

    def finding(self) -> MemoryFinding | None:
        stretches = []
        for (_, shapes), group in self.groups.items():
            ends = group.ends()
            if ends is not None:
                first, last = ends
                stretches.append((last.allocated - first.allocated, shapes, first, last))
        if not stretches:
            return None
        _, shapes, first, last = max(stretches, key=lambda item: item[0])
        every = self.steps_per_record()
        before = {phase: (added, counted) for phase, added, counted in first.growth}
        by_phase = {}
        for phase, added, counted in last.growth:
            added_before, counted_before = before.get(phase, (0, 0))
            if counted > counted_before:
                by_phase[phase] = (added - added_before) / ((counted - counted_before) * every)
        return _leak_finding(first, last, shapes, by_phase, len(stretches))


def _leak_finding(
    first: _Boundary,
    last: _Boundary,
    shapes: tuple[tuple[str, tuple[int, ...]], ...],
    by_phase: dict[Any, float],
    groups_growing: int,
) -> MemoryFinding:
    # the fastest-growing phase first; equal rates in the order of their names, so the
    # answer does not depend on which phase happened to come first
    by_phase = dict(sorted(by_phase.items(), key=lambda item: (-item[1], str(item[0]))))
    phase, per_step = next(iter(by_phase.items())) if by_phase else (None, 0.0)
    growth = round(per_step)
    phases = [p for p in by_phase if p is not None]
    step_name = f"{phase!r} step" if phase is not None and len(phases) > 1 else "step"
    shape_text = ", ".join(f"{name}={list(dims)}" for name, dims in shapes) or "no shape labels"
    others = (
        "; steps of other phases added "
        + ", ".join(f"{format_size(round(value))} ({p!r})" for p, value in by_phase.items() if p != phase)
        if len(by_phase) > 1
        else ""
    )
    evidence = {
        "growth_bytes_per_step": growth,
        "phase": phase,
        "total_growth_bytes": last.allocated - first.allocated,
        "from_step": first.step,
        "to_step": last.step,
        "first_allocated": first.allocated,
        "last_allocated": last.allocated,
        "shapes": shape_text,
        "groups_growing": groups_growing,
    }
    return MemoryFinding(
        kind="leak",
        title=f"Memory leak: +{format_size(growth)} per {step_name}",
        summary=(
            f"Allocated memory at step boundaries grew by {format_size(growth)} per {step_name}, "
            f"from {format_size(first.allocated)} at step {first.step} to "
            f"{format_size(last.allocated)} at step {last.step}, among steps with the same "
            f"shapes ({shape_text}){others}. "
            "Left running, it runs out of memory whatever the batch size."
        ),
        first_step=first.step,
        last_step=last.step,
        evidence=evidence,
        causes=(
            "a loss kept with its graph: `total = total + loss` or `losses.append(loss)` keeps "
            "every step's autograd graph and the activations it saved",
            "outputs appended to a list: `outputs.append(model(x))` keeps the outputs and their graph",
            "a missing `torch.no_grad()` (or `torch.inference_mode()`) in evaluation: each forward "
            "builds a graph that lives as long as its outputs are referenced",
            "a cache or hidden state carried across steps without `.detach()`",
        ),
        advice=(
            "log numbers, not tensors: `total += loss.item()` or `loss.detach()`",
            "store `out.detach().cpu()` when outputs must be kept",
            "wrap evaluation in `with torch.no_grad():` and call `model.eval()`",
        ),
    )


# -- fragmentation ---------------------------------------------------------------------


def fragmentation_floor(capacity: int | None) -> int:
    """Bytes of unused reserve below which fragmentation is not worth a finding.

    Why a floor: a few cached segments (2 MiB small-pool, 20 MiB large-pool) are the
    allocator doing its job; only a share of the GPU is worth a change of settings.
    """
    if capacity is None:
        return FRAGMENTATION_FLOOR
    return max(FRAGMENTATION_FLOOR, int(capacity * FRAGMENTATION_CAPACITY_SHARE))


def unused_reserve(records: Sequence[Mapping[str, Any]]) -> list[int]:
    """For each record: reserved memory beyond the highest allocated peak seen so far.

    Why not reserved - allocated at the boundary: between steps the activations are freed
    and their blocks stay cached for the next step, which is the cache doing its job. Memory
    reserved beyond anything the run ever held at once is memory the allocator could not
    reuse: fragmentation.
    """
    highest = 0
    unused = []
    for record in records:
        highest = max(highest, int(record.get("peak_allocated", record.get("allocated", 0))))
        unused.append(max(int(record.get("reserved", 0)) - highest, 0))
    return unused


def successful_retries(records: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per record: allocator retries that succeeded since the previous record.

    Why subtract OOMs: every OOM comes after a failed retry; those belong to the OOM.
    The counters in the records are cumulative since the monitor started.
    """
    result = []
    retries = ooms = 0
    for record in records:
        now_retries = int(record.get("num_alloc_retries", 0))
        now_ooms = int(record.get("num_ooms", 0))
        result.append(max((now_retries - retries) - (now_ooms - ooms), 0))
        retries, ooms = now_retries, now_ooms
    return result


def find_fragmentation(records: Sequence[Mapping[str, Any]], *, capacity: int | None = None) -> MemoryFinding | None:
    """Unused reserve that is large and growing, or allocator retries that keep happening."""
    stream = _FragmentationStream()
    for record in records:
        stream.add(record)
    return stream.finding(capacity)


class _FragmentationStream:
    """The fragmentation rule, fed one record at a time: running maxima and the retry steps.

    The same numbers as :func:`unused_reserve` and :func:`successful_retries` over the
    whole list, without the list: the first record's unused reserve, the worst one (the
    first at its value), and the steps with a successful retry.
    """

    def __init__(self) -> None:
        self.highest = 0
        self.first: tuple[int, int] | None = None  # (step, unused reserve)
        self.worst: tuple[int, int, int] | None = None  # (unused reserve, step, reserved)
        self.retries = self.ooms = 0
        self.retry_total = 0
        self.retry_count = 0
        self.retry_steps: list[int] = []  # the first MAX_EVIDENCE_STEPS of them
        self.last_retry_step = 0

    def add(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        self.highest = max(self.highest, int(record.get("peak_allocated", record.get("allocated", 0))))
        reserved = int(record.get("reserved", 0))
        unused = max(reserved - self.highest, 0)
        if self.first is None:
            self.first = (step, unused)
        if self.worst is None or unused > self.worst[0]:
            self.worst = (unused, step, reserved)
        now_retries, now_ooms = int(record.get("num_alloc_retries", 0)), int(record.get("num_ooms", 0))
        succeeded = max((now_retries - self.retries) - (now_ooms - self.ooms), 0)
        self.retries, self.ooms = now_retries, now_ooms
        if succeeded > 0:
            self.retry_total += succeeded
            self.retry_count += 1
            self.last_retry_step = step
            if len(self.retry_steps) < MAX_EVIDENCE_STEPS:
                self.retry_steps.append(step)

    def finding(self, capacity: int | None = None) -> MemoryFinding | None:
        if self.first is None or self.worst is None:
            return None
        first_record_step, first_unused = self.first
        worst_unused, worst_step, reserved_at_worst = self.worst
        floor = fragmentation_floor(capacity)
        large = worst_unused >= max(floor, FRAGMENTATION_SHARE * reserved_at_worst)
        growing = worst_unused > first_unused
        rising_retries = self.retry_count >= RETRY_STEPS
        if not (large and growing) and not rising_retries:
            return None
        first_retry = self.retry_steps[0] if self.retry_steps else 0
        facts = []
        if large and growing:
            highest = reserved_at_worst - worst_unused
            facts.append(
                f"at step {worst_step} the allocator reserved {format_size(reserved_at_worst)} "
                f"while the most the run ever held at once was {format_size(highest)}: "
                f"{format_size(worst_unused)} reserved but never usable "
                f"(up from {format_size(first_unused)} at step {first_record_step})"
            )
        if rising_retries:
            facts.append(
                f"the allocator flushed its cache and retried in {self.retry_count} steps "
                f"({self.retry_total} retries, first at step {first_retry}, last at step {self.last_retry_step})"
            )
        first_step = first_record_step if large and growing else first_retry
        last_step = worst_step if large and growing else self.last_retry_step
        if rising_retries and large and growing:
            first_step, last_step = min(first_step, first_retry), max(last_step, self.last_retry_step)
        summary = "; ".join(facts)
        return MemoryFinding(
            kind="fragmentation",
            title=f"Fragmentation: {format_size(worst_unused)} reserved but unusable",
            summary=summary[0].upper() + summary[1:] + ".",
            first_step=first_step,
            last_step=last_step,
            evidence={
                "unused_reserve_bytes": worst_unused,
                "unused_reserve_first_bytes": first_unused,
                "reserved_bytes": reserved_at_worst,
                "at_step": worst_step,
                "successful_retries": self.retry_total,
                "retry_steps": list(self.retry_steps),
                "retry_steps_count": self.retry_count,
            },
            causes=(
                "tensors of many different sizes (variable sequence lengths, varying batch shapes) "
                "leave cached blocks that are too small for the next request",
                "long-lived tensors allocated between short-lived ones pin segments that can then never be returned",
            ),
            advice=(
                f"set {EXPANDABLE_SEGMENTS} in the environment of the training process before CUDA "
                f"starts: on the command line (`{EXPANDABLE_SEGMENTS} python train.py`), in the job "
                "script before `torchrun` (every rank inherits it), or at the very top of the script "
                f"with `os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'` before "
                "`import torch`",
                "pad inputs to a few fixed lengths (buckets), so blocks are reused",
                "the simulated GPU models the default allocator; expandable segments apply on a real GPU",
            ),
        )


# -- a new peak from a new largest shape -----------------------------------------------


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def find_shape_peak(records: Sequence[Mapping[str, Any]]) -> MemoryFinding | None:
    """Peaks that rose with a new largest input shape (not a leak: the worst case grew)."""
    stream = _ShapePeakStream()
    for record in records:
        stream.add(record)
    return stream.finding()


class _ShapePeakStream:
    """The new-shape-peak rule, fed one record at a time.

    Each event needs a larger shape and a peak 5 % above every earlier one, so events are
    few (the peak multiplies by 1.05 each time); still, at most MAX_EVIDENCE_STEPS are kept.
    """

    def __init__(self) -> None:
        self.highest_peak: int | None = None
        self.largest_shape = 0
        self.events: list[dict[str, Any]] = []
        self.count = 0

    def add(self, record: Mapping[str, Any]) -> None:
        if "peak_allocated" not in record:
            return
        peak = int(record["peak_allocated"])
        key = shape_key(record.get("labels") or {})
        size = shape_size(key)
        highest = self.highest_peak
        if highest is not None and key and size > self.largest_shape and peak > highest * (1 + NEW_PEAK_MARGIN):
            event = {
                "step": int(record["step"]),
                "peak_bytes": peak,
                "previous_peak_bytes": highest,
                "shape": ", ".join(f"{name}={list(dims)}" for name, dims in key),
            }
            self.count += 1
            if len(self.events) < MAX_EVIDENCE_STEPS:
                self.events.append(event)
            else:
                self.events[-1] = event  # keep the latest: the finding reports the last peak
        self.highest_peak = peak if highest is None else max(highest, peak)
        self.largest_shape = max(self.largest_shape, size)

    def finding(self) -> MemoryFinding | None:
        events = list(self.events)
        if not events:
            return None
        first, last = events[0], events[-1]
        return MemoryFinding(
            kind="shape_peak",
            title=f"New peak from a new largest input: {format_size(last['peak_bytes'])}",
            summary=(
                f"The peak rose {_times(self.count)} with a new largest input shape, from "
                f"{format_size(first['previous_peak_bytes'])} to {format_size(last['peak_bytes'])} at step "
                f"{last['step']} ({last['shape']}). A larger input needs more memory: this peak is not a "
                "leak, the worst case got bigger."
            ),
            first_step=first["step"],
            last_step=last["step"],
            evidence={"events": events, "peak_bytes": last["peak_bytes"], "shape": last["shape"]},
            causes=(
                "inputs of varying size (sequence length, image size, number of objects): the largest one sets the peak",
            ),
            advice=(
                "size the batch with worst-case shapes: a workload's make_batch should return the "
                "longest sequence (`memfit probe` and `memfit estimate` then find what fits)",
                "or cap the input size (truncate, bucket by length) so the worst case is known",
            ),
        )


def findings_html(findings: Sequence[MemoryFinding]) -> str:
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
            parts.extend(f"<li>{inline_code(cause)}</li>" for cause in finding.causes)
            parts.append("</ul>")
        if finding.advice:
            parts.append("<p><b>What to do</b></p><ul>")
            parts.extend(f"<li>{inline_code(advice)}</li>" for advice in finding.advice)
            parts.append("</ul>")
        parts.append("</div>")
        blocks.append("".join(parts))
    return "".join(blocks)
