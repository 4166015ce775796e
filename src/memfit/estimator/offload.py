"""CPU offload (``shard="offload"``: FSDP2 with ``CPUOffloadPolicy``): what stays on the GPU,
what the host holds, and what the transfers cost.

Method: the step is traced as FSDP2 trains it (one rank of a fake process group, one rank
for one GPU), where every tensor is counted alike; then each allocation is placed where
``CPUOffloadPolicy`` keeps it, by its category (:func:`memfit.estimator.breakdown.classify`):

==========================================  ==========================================
on the host                                  on the GPU
==========================================  ==========================================
the sharded parameters (and the model's      each unit's gathered full parameters and
buffers: allocated before the first step),   FSDP2's all-gather / reduce-scatter buffers,
the sharded gradients, everything the        activations, temporaries of forward and
optimizer step allocates (it runs on the     backward
CPU)
==========================================  ==========================================

The GPU's allocations are replayed through the allocator model within the budget (so
"fits" is the caching allocator's verdict on them alone); the host's peak is the largest
sum of its live bytes. Not counted on the GPU: FSDP2's staging copies of a unit's shard
(host to GPU before its all-gather, GPU to host after its reduce-scatter), each one
unit's shard at a time; the model's buffers, which FSDP2 leaves on the GPU, are counted
on the host.

The predicted step adds what the offload costs to the GPU's compute (no overlap, an upper
bound): every micro-batch copies the parameters to the GPU twice (forward, and again in
backward: FSDP2 reshards after forward) and the gradients back once, over the card's host
link (:data:`HOST_LINK`), and the optimizer step runs on the CPU, bound by host memory
bandwidth (:data:`HOST_OPTIMIZER_BANDWIDTH`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from memfit.estimator.breakdown import classify
from memfit.estimator.fake import FakeRun, Runner
from memfit.estimator.speed import step_time
from memfit.estimator.timing import StepTime
from memfit.memory.allocator import AllocationFailed, CachingAllocatorModel
from memfit.memory.gpus import GPU
from memfit.memory.tracker import Labels
from memfit.run.settings import Settings
from memfit.workload import Workload

__all__ = [
    "split_events",
    "gpu_side",
    "GpuSide",
    "OffloadRun",
    "offloaded",
    "offload_step_time",
    "Placed",
    "HOST_CATEGORIES",
    "HOST_LINK",
    "host_link_bandwidth",
    "HOST_OPTIMIZER_BANDWIDTH",
    "OPTIMIZER_BYTES_PER_PARAMETER",
    "transfer_seconds",
]

Event = tuple[str, int, int, Labels]

#: the categories CPUOffloadPolicy keeps on the host (besides the optimizer phase's memory)
HOST_CATEGORIES = ("parameters", "gradients", "optimizer state")

#: the host link by GPU family: PCIe generation (x16) and the share of its bandwidth a
#: pinned copy reaches (a stated assumption: PCIe 3.0 x16 is 15.75 GB/s, 4.0 is 31.5 GB/s,
#: 5.0 is 63 GB/s per direction; copies reach about 80 % of that)
HOST_LINK = {"pascal": 3, "volta": 3, "turing": 3, "ampere": 4, "ada": 4, "hopper": 5, "blackwell": 5}
_PCIE_GBPS = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9}
_COPY_EFFICIENCY = 0.8

#: the host memory bandwidth PyTorch's CPU AdamW reaches (a stated assumption: a desktop's
#: dual-channel DDR4/DDR5 gives 40-90 GB/s; an element-wise optimizer reaches about half)
HOST_OPTIMIZER_BANDWIDTH = 20e9
#: bytes AdamW reads and writes per fp32 parameter: parameter, gradient and two moments
#: read, parameter and two moments written (7 x 4 bytes)
OPTIMIZER_BYTES_PER_PARAMETER = 28


@dataclass(frozen=True)
class Placed:
    """A traced step's allocations placed as CPUOffloadPolicy places them."""

    #: the events of the GPU's allocations (and their frees), in order
    gpu_events: list[Event]
    #: the most bytes the host holds at once
    host_peak: int
    #: bytes of the parameters kept on the host (the sharded parameters)
    host_parameters: int


def split_events(events: Sequence[Event], host: Sequence[str] = HOST_CATEGORIES) -> Placed:
    """The GPU's events and the host's peak of a step traced under ``shard="offload"``.

    Args:
        events: the trace's ``(kind, handle, nbytes, labels)`` events, in order.
        host: the categories kept on the host besides the optimizer phase's allocations
            (the default: ``CPUOffloadPolicy``'s; ``("optimizer state",)`` is an optimizer
            offloaded as ZeRO-Offload or torchao's ``CPUOffloadOptimizer`` offload it).
    """
    born: dict[int, tuple[Labels, bool, int]] = {}
    died: dict[int, Labels] = {}
    started = False
    for kind, handle, nbytes, labels in events:
        if kind == "alloc":
            started = started or labels.step >= 0
            born[handle] = (labels, not started, nbytes)
        else:
            died[handle] = labels
    on_host = {
        handle
        for handle, (labels, early, _) in born.items()
        if labels.phase == "optimizer" or classify(labels, died.get(handle), early) in host
    }
    host_parameters = sum(
        nbytes
        for handle, (labels, early, nbytes) in born.items()
        if handle in on_host and classify(labels, died.get(handle), early) == "parameters"
    )
    gpu_events: list[Event] = []
    live = peak = 0
    for event in events:
        kind, handle, nbytes, _ = event
        if handle not in on_host:
            gpu_events.append(event)
        elif kind == "alloc":
            live += nbytes
            peak = max(peak, live)
        else:
            live -= born[handle][2]
    return Placed(gpu_events, peak, host_parameters)


def host_link_bandwidth(card: GPU) -> float:
    """Bytes per second one copy between the host and ``card`` reaches (see :data:`HOST_LINK`)."""
    return _PCIE_GBPS[HOST_LINK.get(card.family, 4)] * _COPY_EFFICIENCY


def transfer_seconds(
    parameter_bytes: int, gradient_bytes: int, parameters: int, micro_batches: int, card: GPU
) -> tuple[float, float]:
    """(seconds copying over the host link, seconds of the CPU's optimizer step) per step.

    Args:
        parameter_bytes: the parameters FSDP2 copies to the GPU (in their training dtype).
        gradient_bytes: the gradients it copies back.
        parameters: the number of parameters the CPU optimizer updates.
        micro_batches: forward/backward passes per optimizer step (accumulation).
        card: the GPU, for its host link.
    """
    link = host_link_bandwidth(card)
    copies = micro_batches * (2 * parameter_bytes + gradient_bytes) / link
    optimizer = parameters * OPTIMIZER_BYTES_PER_PARAMETER / HOST_OPTIMIZER_BANDWIDTH
    return copies, optimizer


@dataclass
class GpuSide:
    """What the GPU holds of a placed trace (:func:`gpu_side`)."""

    #: the GPU's events replayed up to where the budget ran out (all of them when it fits)
    events: list[Event]
    peak_allocated: int
    peak_reserved: int
    fits: bool
    #: the most bytes the host holds at once
    host_peak: int
    host_parameters: int


def gpu_side(events: Sequence[Event], host: Sequence[str] = HOST_CATEGORIES, budget: int | None = None) -> GpuSide:
    """The GPU's peaks when the allocations of ``host``'s categories and of the optimizer
    phase are kept on the host (:func:`split_events`), the rest replayed through the
    allocator model within ``budget``.

    Args:
        events: a step's ``(kind, handle, nbytes, labels)`` events, traced with every
            tensor on the GPU.
        host: the categories on the host (see :func:`split_events`).
        budget: the bytes the GPU's allocator may reserve (None: unbounded).
    """
    placed = split_events(events, host)
    allocator = CachingAllocatorModel(budget=budget)
    handles: dict[int, int] = {}
    fits, kept = True, []
    try:
        for event in placed.gpu_events:
            kind, handle, nbytes, _ = event
            if kind == "alloc":
                handles[handle] = allocator.malloc(nbytes)
            else:
                allocator.free(handles.pop(handle))
            kept.append(event)
    except AllocationFailed:
        fits = False  # the events stop there, as a budgeted run's do
    stats = allocator.stats()
    return GpuSide(
        kept,
        stats["allocated_bytes.all.peak"],
        stats["reserved_bytes.all.peak"],
        fits,
        placed.host_peak,
        placed.host_parameters,
    )


@dataclass
class OffloadRun(FakeRun):
    """A fake run's GPU side under CPU offload, with what the host holds."""

    host_peak: int = 0
    host_parameters: int = 0


def offloaded(run: Runner) -> Runner:
    """A runner whose runs report the GPU's side of ``run``'s: traced without a budget (the
    host's tensors count against none), placed (:func:`split_events`), and the GPU's
    allocations replayed within the budget.

    Args:
        run: traces the step under ``shard="offload"`` (FSDP2 with CPUOffloadPolicy).
    """

    # The trace is always unlimited, so a budgeted run that does not fit and the unlimited
    # re-run that says what it would need (memfit.estimator.estimate) trace the same step:
    # the last trace is kept and placed again instead of traced twice.
    last: list[tuple[tuple[Settings, bool], FakeRun]] = []

    def runner(settings: Settings, budget: int | None, count_ops: bool) -> FakeRun:
        if last and last[0][0] == (settings, count_ops):
            whole = last[0][1]
        else:
            last.clear()  # one trace held at a time: a 7B step's events are not small
            whole = run(settings, None, count_ops)
            last.append(((settings, count_ops), whole))
        side = gpu_side(whole.events, HOST_CATEGORIES, budget)
        return OffloadRun(
            events=side.events,
            peak_allocated=side.peak_allocated,
            peak_reserved=side.peak_reserved,
            fits=side.fits,
            ops=whole.ops,
            rank=whole.rank,
            host_peak=side.host_peak,
            host_parameters=side.host_parameters,
        )

    return runner


def offload_step_time(
    workload: Workload, settings: Settings, card: GPU, host_parameters: int
) -> tuple[StepTime, float, float]:
    """The predicted step under CPU offload: the GPU's compute for the same step unsharded,
    plus the copies over the host link and the CPU's optimizer step (see the module); returns
    the step and those two parts (seconds).

    Args:
        workload: the workload.
        settings: the offload settings (their micro-batch and accumulation).
        card: the GPU.
        host_parameters: the bytes of parameters kept on the host (fp32: 4 bytes each).
    """
    base = step_time(workload, settings.replace(shard="none", world_size=1, shard_group_size=None), card)
    copies, optimizer = transfer_seconds(
        host_parameters, host_parameters, host_parameters // 4, settings.accumulation_steps, card
    )
    seconds = base.seconds_per_step + copies + optimizer
    samples = (settings.micro_batch_size or 1) * settings.accumulation_steps
    step = dataclasses.replace(base, seconds_per_step=seconds, samples_per_second=samples / seconds)
    return step, copies, optimizer
