"""Run k optimizer steps of a workload under some settings on a device.

Why at least two steps: the optimizer allocates its state (AdamW: two tensors per
parameter) during the first ``step()``, so only the second step shows the memory a long
run needs. Each step runs ``accumulation_steps`` forward/backward passes of
``micro_batch_size`` samples, then the optimizer step, then ``zero_grad``.

>>> import memfit
>>> from memfit.run.steps import run_steps
>>> wl = memfit.load_workload("mlp:layers=2,width=32")
>>> with memfit.device("sim:1GiB") as gpu:
...     run = run_steps(wl, memfit.Settings(micro_batch_size=4), gpu, steps=2)
>>> len(run.step_seconds)
2
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.errors import MemfitError, WorkloadError
from memfit.memory.devices import Device
from memfit.memory.tracker import labelled, module_labels
from memfit.run.parallel import check_offload_device, collective_internals_untracked
from memfit.run.settings import Applied, Settings, autocast, make_scaler
from memfit.run.strategy import FSDP_SHARDS, OFFLOAD_SHARDS
from memfit.workload import Workload, move_to

__all__ = ["run_steps", "StepRun"]


@dataclass
class StepRun:
    """What :func:`run_steps` observed."""

    step_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    #: (dotted path, class name) of each module checkpointing recomputed
    checkpointed: list[tuple[str, str]] = field(default_factory=list)


def run_steps(
    workload: Workload,
    settings: Settings,
    device: Device,
    steps: int = 2,
    *,
    label_modules: bool = False,
    record: StepRun | None = None,
) -> StepRun:
    """Run ``steps`` optimizer steps; raise whatever the step raises (an OOM included).

    The model comes from ``workload.build_model()``: a factory gives a fresh model that
    is dropped at the end, so the device returns to its memory before the call.
    ``record``: the :class:`StepRun` to fill (what ran is kept there when a step raises).
    """
    if settings.micro_batch_size is None:
        raise MemfitError("run_steps needs settings.micro_batch_size")
    if steps < 1:
        raise MemfitError(f"invalid number of steps {steps}: must be at least 1")
    if not device.supports(settings.precision):
        raise MemfitError(f"{device.describe()} does not support {settings.precision}")
    result = StepRun() if record is None else record
    sharded = (settings.world_size > 1 and settings.shard in FSDP_SHARDS) or settings.shard in OFFLOAD_SHARDS
    check_offload_device(settings.shard, device)
    if sharded and not workload.builds_fresh_models:
        raise MemfitError(
            f"workload {workload.name!r}: FSDP2 shards a model in place for good; "
            "give the workload a model factory so each run builds its own"
        )
    early: tuple[nn.Module, Applied] | None = None
    if sharded:
        # FSDP2 is handed a model built off the device (the CPU, meta) and moves only
        # each rank's shards there, as sharded training at scale does: the whole model
        # never sits on one GPU, so its construction is not counted.
        model = workload.build_model()
        early = (model, _apply_on(settings, model, workload, device))
    with device:
        if early is None:
            model = workload.build_model()
            if not _is_on(model, device.torch_device):
                # Why the check: ``Module.to`` swaps every parameter of a fake-tensor model
                # (the estimator's) and fails; a model already in place needs no move.
                model.to(device.torch_device)
            device.adopt(list(model.parameters()) + list(model.buffers()))
            # Checkpointing, then the strategy (DDP, ZeRO-1) for settings.world_size ranks.
            applied = settings.apply(model, units=workload.fsdp_units)
        else:
            model, applied = early
            device.adopt(list(model.parameters()) + list(model.buffers()))  # the shards
        was_training = model.training
        model.train()
        trained = applied.model
        optimizer = None
        try:
            # optimizer(params) or optimizer(model): the workload reads which from its factory
            optimizer = applied.optimizer(functools.partial(workload.make_optimizer, model))
            scaler = make_scaler(settings.precision, device.autocast_device_type)
            with (
                module_labels(model) if label_modules else _nothing(),
                collective_internals_untracked() if settings.world_size > 1 else _nothing(),
            ):
                for step in range(steps):
                    device.synchronize()
                    started = time.perf_counter()
                    result.losses.append(
                        _one_step(workload, settings, device, trained, optimizer, scaler=scaler, step=step)
                    )
                    device.synchronize()
                    result.step_seconds.append(time.perf_counter() - started)
        finally:
            result.checkpointed = list(applied.checkpointed.modules)
            applied.undo()
            model.train(was_training)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            del optimizer, model, trained, applied
    return result


def _one_step(
    workload: Workload,
    settings: Settings,
    device: Device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: torch.amp.GradScaler,
    step: int,
) -> float:
    total = 0.0
    assert settings.micro_batch_size is not None  # run_steps checked it
    for _ in range(settings.accumulation_steps):
        with labelled(phase="forward", step=step):
            batch = move_to(workload.make_batch(settings.micro_batch_size), device.torch_device)
            with autocast(settings.precision, device.autocast_device_type):
                loss = workload.loss(model, batch)
            _check_loss(workload, loss)
            loss = loss / settings.accumulation_steps
        with labelled(phase="backward", step=step):
            scaler.scale(loss).backward()
        total += float(loss.detach())
        del loss, batch  # free the batch before the next micro-batch is made
    with labelled(phase="optimizer", step=step):
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return total


def _check_loss(workload: Workload, loss: object) -> None:
    """A loss memfit can call backward on: one element, connected to the parameters.

    Why here, with one line: what a workload's loss returns is the workload's contract;
    a tensor of losses, ``loss.item()`` or a detached copy would otherwise surface as
    autograd's traceback from inside memfit.
    """
    if not isinstance(loss, torch.Tensor):
        raise WorkloadError(
            f"workload {workload.name!r}: its loss returned {type(loss).__name__}, not a tensor "
            "(return the loss tensor, not loss.item())"
        )
    if loss.numel() != 1:
        raise WorkloadError(
            f"workload {workload.name!r}: its loss returned a tensor of shape {list(loss.shape)}, not one "
            "number (reduce it, with .mean() for instance)"
        )
    if not loss.requires_grad:
        raise WorkloadError(
            f"workload {workload.name!r}: its loss does not depend on the model's parameters "
            "(requires_grad is False: a detached copy, or computed under torch.no_grad())"
        )


def _apply_on(settings: Settings, model: nn.Module, workload: Workload, device: Device) -> Applied:
    """Checkpointing and FSDP2, with the shards placed on ``device`` (its current GPU)."""
    where = device.torch_device
    if where.type != "cuda":
        return settings.apply(model, units=workload.fsdp_units, device=where)
    previous = torch.cuda.current_device()
    torch.cuda.set_device(where)
    try:
        return settings.apply(model, units=workload.fsdp_units, device=where)
    finally:
        torch.cuda.set_device(previous)


def _is_on(model: nn.Module, where: torch.device) -> bool:
    """True when every parameter and buffer of ``model`` already lives on ``where``."""
    index = where.index if where.index is not None else (0 if where.type == "cuda" else None)
    return all(
        t.device.type == where.type and (t.device.index if t.device.index is not None else index) == index
        for t in itertools.chain(model.parameters(), model.buffers())
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield
