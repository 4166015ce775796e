"""What holds the memory at the peak: classify recorded allocations by when they live.

Pure bookkeeping over allocator events ``(kind, handle, nbytes, Labels(phase, step,
module))`` as :mod:`memfit.estimator.fake` records them (frees carry the labels of their
moment). The events are replayed through the caching-allocator model, which gives the
peak, the moment it happens and each allocation's block size (what the allocator
counts); each allocation alive at that moment gets one category from its phases:

=====================  =========================================================================
category               rule
=====================  =========================================================================
``parameters``         allocated before the first step (the model's parameters and buffers)
``gradients``          allocated in backward, still alive when backward ends (freed by
                       ``zero_grad`` in the optimizer phase, or never)
``optimizer state``    allocated in the optimizer phase, still alive when that phase ends
``activations``        allocated in forward, still alive when forward ends (saved for
                       backward, the batch, the loss); each is charged to the module whose
                       forward allocated it
``temporaries``        everything else (freed within the phase that made it: workspaces,
                       intermediate results, recomputed activations, optimizer scratch)
=====================  =========================================================================

Under a distributed strategy the code of DDP and FSDP2 labels its own memory (the
``role`` of :class:`~memfit.memory.tracker.Labels`, set by
:mod:`memfit.run.parallel` and :mod:`memfit.estimator.distributed_trace`):

==========================  ====================================================================
``communication buffers``   DDP's gradient buckets (and its broadcast buffers), FSDP2's
                            all-gather and reduce-scatter buffers; a reduce-scatter's output
                            that outlives backward is the sharded gradient (``gradients``)
``unsharded parameters``    FSDP2's full parameters of a unit, gathered for its forward and
                            backward
==========================  ====================================================================

>>> from memfit.memory.tracker import Labels
>>> events = [
...     ("alloc", 1, 4096, Labels()),                                  # a parameter
...     ("alloc", 2, 2048, Labels("forward", 0, "fc")),                # saved for backward
...     ("alloc", 3, 1024, Labels("forward", 0, "fc")),                # a temporary
...     ("free", 3, 0, Labels("forward", 0, "fc")),
...     ("alloc", 4, 4096, Labels("backward", 0)),                     # the gradient
...     ("free", 2, 0, Labels("backward", 0)),
... ]
>>> peak = analyze(events)
>>> peak.categories["parameters"], peak.categories["activations"], peak.categories["gradients"]
(4096, 2048, 4096)
>>> peak.top_modules
[('fc', 2048)]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.tracker import Labels
from memfit.run.parallel import COMMUNICATION, UNSHARDED

__all__ = [
    "analyze",
    "Peak",
    "classify",
    "CATEGORIES",
    "ROLES",
    "COMMUNICATION",
    "UNSHARDED",
    "PHASE_ORDER",
    "outlives_phase",
]

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "temporaries")
#: the categories DDP and FSDP2 name themselves (through ``Labels.role``)
ROLES = (COMMUNICATION, UNSHARDED)

#: order of the phases within one step, for "freed after its phase ended"
PHASE_ORDER = {"forward": 0, "backward": 1, "optimizer": 2}

Event = tuple[str, int, int, Labels]


@dataclass
class Peak:
    """The allocator's peaks and what was allocated at the moment of peak allocation."""

    peak_allocated: int
    peak_reserved: int
    categories: dict[str, int]
    top_modules: list[tuple[str, int]]
    #: block sizes of the gradients allocated in the first step, in allocation order
    gradient_sizes: list[int] = field(default_factory=list)
    #: index of the event at which allocated memory peaked
    peak_index: int = -1


def outlives_phase(born: Labels, died: Labels | None) -> bool:
    """True when an allocation made in ``born``'s phase is freed after that phase ended
    (or never: ``died`` None).

    Why "after the phase" rather than "at the end of the run": a saved activation dies in
    backward, a gradient in the optimizer phase, and both must be told from the
    temporaries that die in the phase that made them.
    """
    if died is None:
        return True
    if died.step != born.step:
        return died.step > born.step or died.step < 0
    if died.phase not in PHASE_ORDER:
        return True  # "other": after the steps (model and optimizer dropped)
    return PHASE_ORDER[died.phase] > PHASE_ORDER.get(born.phase, -1)


def classify(born: Labels, died: Labels | None, before_first_step: bool) -> str:
    """The category of one allocation (see the module's tables)."""
    if born.role == COMMUNICATION:
        # A reduce-scatter's output is the rank's shard of the gradient: it outlives backward.
        if born.phase == "backward" and outlives_phase(born, died):
            return "gradients"
        return COMMUNICATION
    if born.role:
        return born.role
    if before_first_step:
        return "parameters"
    if born.phase in ("backward", "optimizer", "forward") and outlives_phase(born, died):
        return {"backward": "gradients", "optimizer": "optimizer state", "forward": "activations"}[born.phase]
    return "temporaries"


def analyze(events: Sequence[Event], top: int = 10, budget: int | None = None, at: int | None = None) -> Peak:
    """Replay ``events`` through the allocator model; break the peak down by category.

    Why a replay: the recorded run keeps only the final counters; replaying the same
    sequence through the same (deterministic) model gives the moment of the peak and
    each allocation's block size, so the categories add up to the peak exactly. Give
    the ``budget`` the run had: within it the allocator releases cached segments.
    ``at`` breaks down the allocations alive just before event ``at`` instead of the
    peak (for instance at the end of a forward pass).
    """
    allocator = CachingAllocatorModel(budget=budget)
    handles: dict[int, int] = {}
    block: dict[int, int] = {}
    born: dict[int, tuple[Labels, bool]] = {}
    died: dict[int, Labels] = {}
    alive: set[int] = set()
    peak_alive: set[int] = set()
    peak_allocated = -1
    peak_index = -1
    started = False
    pending_peak = False
    for index, (kind, handle, nbytes, labels) in enumerate(events):
        if index == at:
            peak_alive = set(alive)
        if kind == "alloc":
            started = started or labels.step >= 0
            before = allocator.allocated
            handles[handle] = allocator.malloc(nbytes)
            block[handle] = allocator.allocated - before
            born[handle] = (labels, not started)
            alive.add(handle)
            if allocator.allocated > peak_allocated:
                peak_allocated, peak_index, pending_peak = allocator.allocated, index, True
        else:
            if pending_peak and at is None:
                peak_alive, pending_peak = set(alive), False  # snapshot only when the peak is final
            allocator.free(handles.pop(handle))
            died[handle] = labels
            alive.discard(handle)
    if pending_peak and at is None:
        peak_alive = set(alive)
    categories = dict.fromkeys(CATEGORIES, 0)  # a role appears only when something holds it
    modules: dict[str, int] = defaultdict(int)
    for handle in peak_alive:
        labels, early = born[handle]
        category = classify(labels, died.get(handle), early)
        categories[category] = categories.get(category, 0) + block[handle]
        if category == "activations":
            modules[labels.module or "<outside modules>"] += block[handle]
    gradient_sizes = [
        block[handle]
        for handle, (labels, early) in born.items()
        if labels.step == 0 and classify(labels, died.get(handle), early) == "gradients"
    ]
    ranked = sorted(modules.items(), key=lambda item: (-item[1], item[0]))[:top]
    return Peak(
        peak_allocated=max(peak_allocated, 0),
        peak_reserved=allocator.stats()["reserved_bytes.all.peak"],
        categories=categories,
        top_modules=ranked,
        gradient_sizes=gradient_sizes,
        peak_index=peak_index,
    )
