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
    found = [
        find_leak(records, window=window),
        find_fragmentation(records, capacity=capacity),
        find_shape_peak(records),
    ]
    return [finding for finding in found if finding is not None]


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


def _growing_stretch(values: Sequence[int], window: int) -> tuple[int, int] | None:
    """Indices (start, end) of the first stretch made of windows where memory keeps growing.

    The stretch runs from the first qualifying window to the end of the last one that
    overlaps it (so a leak that stopped is still found), trimmed to its first and last
    rise, so the growth per step is not diluted by flat steps around it.
    """
    qualifying = [
        start for start in range(0, len(values) - window + 1) if keeps_growing(values[start : start + window])
    ]
    if not qualifying:
        return None
    start = end = qualifying[0]
    for candidate in qualifying[1:]:
        if candidate > end + window - 1:
            break
        end = candidate
    end += window - 1
    while start < end and values[start + 1] <= values[start]:
        start += 1
    while end > start and values[end - 1] >= values[end]:
        end -= 1
    return start, end


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
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for record in records:
        if "allocated" in record:
            groups.setdefault(_group_of(record), []).append(record)
    stretches = []
    for group, members in groups.items():
        stretch = _growing_stretch([int(r["allocated"]) for r in members], window)
        if stretch is not None:
            first, last = members[stretch[0]], members[stretch[1]]
            stretches.append((int(last["allocated"]) - int(first["allocated"]), group, first, last))
    if not stretches:
        return None
    _, (_, shapes), first, last = max(stretches, key=lambda item: item[0])
    every = steps_per_record(records)
    by_phase = growth_by_phase(records, int(first["step"]), int(last["step"]), every)
    phase, per_step = max(by_phase.items(), key=lambda item: item[1]) if by_phase else (None, 0.0)
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
        "total_growth_bytes": int(last["allocated"]) - int(first["allocated"]),
        "from_step": int(first["step"]),
        "to_step": int(last["step"]),
        "first_allocated": int(first["allocated"]),
        "last_allocated": int(last["allocated"]),
        "shapes": shape_text,
        "groups_growing": len(stretches),
    }
    return MemoryFinding(
        kind="leak",
        title=f"Memory leak: +{format_size(growth)} per {step_name}",
        summary=(
            f"Allocated memory at step boundaries grew by {format_size(growth)} per {step_name}, "
            f"from {format_size(int(first['allocated']))} at step {first['step']} to "
            f"{format_size(int(last['allocated']))} at step {last['step']}, among steps with the same "
            f"shapes ({shape_text}){others}. "
            "Left running, it runs out of memory whatever the batch size."
        ),
        first_step=int(first["step"]),
        last_step=int(last["step"]),
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
    if not records:
        return None
    unused = unused_reserve(records)
    retries = successful_retries(records)
    floor = fragmentation_floor(capacity)
    worst = max(range(len(records)), key=lambda i: (unused[i], -i))
    reserved_at_worst = int(records[worst].get("reserved", 0))
    large = unused[worst] >= max(floor, FRAGMENTATION_SHARE * reserved_at_worst)
    growing = unused[worst] > unused[0]
    retry_steps = [int(r["step"]) for r, n in zip(records, retries) if n > 0]
    rising_retries = len(retry_steps) >= RETRY_STEPS
    if not (large and growing) and not rising_retries:
        return None
    facts = []
    if large and growing:
        highest = reserved_at_worst - unused[worst]
        facts.append(
            f"at step {records[worst]['step']} the allocator reserved {format_size(reserved_at_worst)} "
            f"while the most the run ever held at once was {format_size(highest)}: "
            f"{format_size(unused[worst])} reserved but never usable "
            f"(up from {format_size(unused[0])} at step {records[0]['step']})"
        )
    if rising_retries:
        facts.append(
            f"the allocator flushed its cache and retried in {len(retry_steps)} steps "
            f"({sum(retries)} retries, first at step {retry_steps[0]}, last at step {retry_steps[-1]})"
        )
    first_step = int(records[0]["step"]) if large and growing else retry_steps[0]
    last_step = int(records[worst]["step"]) if large and growing else retry_steps[-1]
    if rising_retries and large and growing:
        first_step, last_step = min(first_step, retry_steps[0]), max(last_step, retry_steps[-1])
    summary = "; ".join(facts)
    return MemoryFinding(
        kind="fragmentation",
        title=f"Fragmentation: {format_size(unused[worst])} reserved but unusable",
        summary=summary[0].upper() + summary[1:] + ".",
        first_step=first_step,
        last_step=last_step,
        evidence={
            "unused_reserve_bytes": unused[worst],
            "unused_reserve_first_bytes": unused[0],
            "reserved_bytes": reserved_at_worst,
            "at_step": int(records[worst]["step"]),
            "successful_retries": sum(retries),
            "retry_steps": retry_steps,
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
    highest_peak: int | None = None
    largest_shape = 0
    events: list[dict[str, Any]] = []
    for record in records:
        if "peak_allocated" not in record:
            continue
        peak = int(record["peak_allocated"])
        key = shape_key(record.get("labels") or {})
        size = shape_size(key)
        if highest_peak is not None and key and size > largest_shape and peak > highest_peak * (1 + NEW_PEAK_MARGIN):
            events.append(
                {
                    "step": int(record["step"]),
                    "peak_bytes": peak,
                    "previous_peak_bytes": highest_peak,
                    "shape": ", ".join(f"{name}={list(dims)}" for name, dims in key),
                }
            )
        highest_peak = peak if highest_peak is None else max(highest_peak, peak)
        largest_shape = max(largest_shape, size)
    if not events:
        return None
    first, last = events[0], events[-1]
    return MemoryFinding(
        kind="shape_peak",
        title=f"New peak from a new largest input: {format_size(last['peak_bytes'])}",
        summary=(
            f"The peak rose {_times(len(events))} with a new largest input shape, from "
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
