"""The allocator history of one training step, for PyTorch's memory viewer, without the GPU.

``memfit estimate ... --snapshot step.pickle`` writes what ``torch.cuda.memory._snapshot()``
would return after two optimizer steps on the target (segments and blocks, and the trace
of every allocation, free and ``cudaMalloc``), from the fake-tensor run the estimate
makes: the same allocator model, the target's budget (a step that does not fit ends at
its ``oom`` action). Open it at https://pytorch.org/memory_viz, or render it with
``torch.cuda._memory_viz``.

>>> import memfit
>>> snap = step_snapshot("mlp:layers=1,width=16,features=16", 4, device="sim:64MiB")
>>> sorted(snap), [entry["action"] for entry in snap["device_traces"][0]][:2]
(['device_traces', 'segments'], ['segment_alloc', 'alloc'])
"""

from __future__ import annotations

from typing import Any

from memfit.errors import MemfitError
from memfit.estimator.estimate import resolve_target
from memfit.estimator.fake import run_fake_steps
from memfit.memory.devices import Device
from memfit.memory.gpus import GPU
from memfit.run.settings import Settings
from memfit.workload import Workload, load_workload

__all__ = ["step_snapshot"]


def step_snapshot(
    workload: Workload | str,
    batch_size: int,
    settings: Settings | None = None,
    *,
    gpu: str | GPU | None = None,
    memory: int | str | None = None,
    device: str | Device | None = None,
    fixed_costs: int | str | None = None,
    steps: int = 2,
) -> dict[str, Any]:
    """The allocator's history over ``steps`` optimizer steps at ``batch_size`` on the target.

    Args:
        workload: a :class:`memfit.Workload` or a reference.
        batch_size: the micro-batch.
        settings: precision, checkpointing and accumulation.
        gpu: a GPU of the table; its usable memory less the fixed costs is the budget.
        memory: a CUDA GPU whose allocator may reserve this much.
        device: the simulated GPU itself (``"sim:8GiB"``).
        fixed_costs: override the memory the allocator never sees.
        steps: optimizer steps to record.

    Raises:
        UnsupportedOperation: fake tensors cannot run the step.
    """
    wl = load_workload(workload)
    if not wl.builds_fresh_models:
        raise MemfitError(
            "a memory snapshot runs the step on fake tensors, which a model instance with its own optimizer "
            "cannot: give the workload a model factory"
        )
    target = resolve_target(gpu, memory, device, fixed_costs)
    budget = target.budget
    if budget is not None and budget <= 0:
        raise MemfitError(f"the fixed costs leave no memory on {target.name}")
    run = run_fake_steps(
        wl,
        (settings or Settings()).replace(micro_batch_size=batch_size),
        steps=steps,
        foreach=target.cuda,
        budget=budget,
        cuda=target.semantics,
        history=True,
    )
    assert run.snapshot is not None
    return run.snapshot
