"""The Guard: one optimizer step per batch that survives OOMs by splitting the batch.

The splitter (:mod:`memfit.guard.splitter`) runs forward and backward over the batch in
as many micro-batches as OOMs demand; the Guard adds what a real loop does between
backward and the step (unscaling and gradient clipping, or the user's own hook), the
optimizer step (through the ``GradScaler`` if given) and ``zero_grad``, and names what
does not fit when even one sample or the optimizer step runs out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit import distributed
from memfit.errors import MemfitError
from memfit.guard.batching import BatchDim, concat_outputs
from memfit.guard.gradients import (
    expected_optimizer_state_bytes,
    merge_gradients,
    optimizer_state_tensors,
    reset_scaler_step_state,
    restore_gradients,
    set_aside_gradients,
    tensor_bytes,
)
from memfit.guard.snapshot import OptimizerSnapshot, ScalerSnapshot
from memfit.guard.splitter import (
    GuardError,
    OOMEvent,
    SplitFn,
    SplitResult,
    Splitter,
    WeightFn,
    requested_bytes,
    what_did_not_fit,
)
from memfit.memory.devices import Device
from memfit.memory.oom import is_oom
from memfit.units import format_size

__all__ = ["Guard", "BeforeStep"]

#: ``before_step(model, optimizer)``: runs on the whole batch's gradient, before the step
BeforeStep = Callable[[nn.Module, torch.optim.Optimizer], None]


def split_loss(returned: Any) -> tuple[torch.Tensor, Any]:
    """The loss and the outputs (detached; None when none) in what ``loss_fn`` returned.

    >>> split_loss((torch.tensor(1.0), {"logits": torch.ones(2, requires_grad=True)}))[1]["logits"].requires_grad
    False
    """
    if isinstance(returned, torch.Tensor):
        return returned, None
    if isinstance(returned, Mapping) and isinstance(returned.get("loss"), torch.Tensor):
        rest = {k: v for k, v in returned.items() if k != "loss"}
        return returned["loss"], tree_map(_detach, rest)
    if isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], torch.Tensor):
        return returned[0], tree_map(_detach, returned[1])
    raise MemfitError(
        f"loss_fn returned {type(returned).__name__}: return the loss (a tensor), (loss, outputs), "
        "or a mapping with 'loss'"
    )


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class Guard:
    """One optimizer step per batch that survives OOMs by splitting the batch.

    :meth:`step` runs forward and backward over the whole batch, split on OOM (see
    :class:`~memfit.guard.splitter.Splitter`), then ``optimizer.step()`` (through
    ``scaler`` if given) and ``zero_grad``, and returns the batch's loss. The update equals
    the whole batch's: each micro-batch's loss is weighted as the check before the first
    split found the loss to reduce (by its share of the samples, 1 for a sum, its share of
    the valid tokens), or the split is refused (:class:`~memfit.guard.errors.SplitRefusedError`).
    Gradient clipping (``clip_grad_norm``, or any ``before_step``) runs on that whole
    gradient, so a clipped update equals the unsplit clipped update too.

    Args:
        model: the model being trained (a DDP-wrapped model is supported).
        optimizer: its optimizer.
        loss_fn: ``loss_fn(model, micro_batch)`` returns the micro-batch's loss (a mean,
            a sum, a mean over valid tokens: how it reduces is checked on the first split),
            or ``(loss, outputs)``, or a mapping with ``"loss"`` whose other entries are
            outputs; the outputs of the whole batch are then :attr:`outputs` (run autocast
            inside it for mixed precision).
        batch_dim: where the samples are in the batch: an int for every tensor (1 for
            ``(sequence, batch)`` data), a pytree of ints like the batch (None for data
            every micro-batch gets whole), or ``fn(path, tensor)``; 0 by default. A
            sequence-first module that would see the batch split along its sequence is
            refused before anything is split (see :mod:`memfit.guard.sequence`).
        clip_grad_norm: clip the whole batch's gradient to this total norm
            (``torch.nn.utils.clip_grad_norm_``, unscaled first when ``scaler`` is given).
        before_step: ``before_step(model, optimizer)`` runs after backward and before
            ``optimizer.step()`` on the whole batch's gradient (unscaled first when
            ``scaler`` is given), for clipping by value, logging norms, and the like.
        scaler: a ``torch.amp.GradScaler`` for fp16.
        split: ``split(batch, size)`` for batches memfit cannot split itself (see
            :mod:`memfit.guard.batching`).
        weight: ``weight(batch)`` weights micro-batches by, say, their token count instead
            of their sample count (for token-normalised losses).
        grow_after: after this many clean steps, try a micro-batch twice as large.
        logger: where OOM events are logged.
        device: where memory is read for events and errors (found by itself on CUDA).
        micro_batch_size: start below the whole batch.
        exact: refuse to split (:class:`~memfit.guard.errors.SplitRefusedError`) when the
            split would change the gradient (BatchNorm in training, a loss that couples the
            samples); False splits anyway, after a warning that says why it differs.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        batch_dim: BatchDim | None = None,
        clip_grad_norm: float | None = None,
        before_step: BeforeStep | None = None,
        scaler: torch.amp.GradScaler | None = None,
        split: SplitFn | None = None,
        weight: WeightFn | None = None,
        grow_after: int | None = None,
        logger: logging.Logger | None = None,
        device: Device | None = None,
        micro_batch_size: int | None = None,
        exact: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise MemfitError(f"invalid clip_grad_norm {clip_grad_norm}: a positive norm, such as 1.0")
        self.clip_grad_norm = clip_grad_norm
        self.before_step = before_step
        #: the whole batch's gradient norm before clipping, at the last step (with clip_grad_norm)
        self.grad_norm: float | None = None
        #: the model's outputs at the last step, joined over its micro-batches and detached,
        #: when ``loss_fn`` returns them (``(loss, outputs)`` or ``{"loss": ..., ...}``); else None
        self.outputs: Any = None
        self._outputs: list[Any] = []
        self.splitter = Splitter(
            model,
            batch_dim=batch_dim,
            split=split,
            weight=weight,
            grow_after=grow_after,
            micro_batch_size=micro_batch_size,
            device=device,
            logger=logger,
            optimizer=optimizer,
            on_discard=self._on_discard,
            exact=exact,
            check_finite=scaler is None,  # with a scaler, inf gradients are the scaler's to skip
        )

    @property
    def events(self) -> list[OOMEvent]:
        """Every OOM so far, oldest first."""
        return self.splitter.events

    @property
    def micro_batch_size(self) -> int | None:
        """The largest micro-batch the next step runs (None: whole batches)."""
        return self.splitter.micro_batch_size

    @property
    def accumulation(self) -> int:
        """Micro-batches the last step ran."""
        return self.splitter.accumulation

    @property
    def last(self) -> SplitResult | None:
        """How the last step went (samples used, micro-batches, attempts)."""
        return self.splitter.last

    def step(self, batch: Any) -> float:
        """One optimizer step over the whole batch; returns the batch's loss.

        All or nothing: when anything fails (an OOM splitting cannot fix, an error in
        ``loss_fn``, ``before_step`` or ``optimizer.step()``), the gradients, buffers,
        generators, optimizer and scaler state are put back as they were before the call,
        so a caller that catches the error and retries starts from its own state.
        """
        params = self.splitter.params
        # The gradients held before the step (the caller's own accumulation) wait aside,
        # untouched, until the step is done: a failed step gives them back as they were.
        kept = set_aside_gradients(params)
        self._outputs = []
        try:
            result = self.splitter.run(batch, self._forward_backward)
        except BaseException:
            restore_gradients(params, kept)
            raise
        merge_gradients(params, kept)
        self._optimizer_step(params, kept)
        outputs, self._outputs = self._outputs, []
        self.outputs = None if not outputs or outputs[0] is None else concat_outputs(outputs)
        return result.loss

    def predict(self, batch: Any, fn: Callable[[Any], Any], *, output_dim: BatchDim | None = None) -> Any:
        """``fn(batch)`` under ``torch.no_grad()``, split on OOM, outputs concatenated.

        Args:
            batch: the inputs, split along ``batch_dim`` as in training.
            fn: ``fn(micro_batch)`` returns the outputs of a micro-batch.
            output_dim: where the samples are in the outputs (default: ``batch_dim``).
        """
        return self.splitter.predict(batch, fn, output_dim=output_dim)

    def _forward_backward(self, micro: Any, share: float) -> torch.Tensor:
        loss, outputs = split_loss(self.loss_fn(self.model, micro))
        self._outputs.append(outputs)
        weighted = loss if share == 1.0 else loss * share
        if self.scaler is not None:
            weighted = self.scaler.scale(weighted)
        weighted.backward()
        return loss.detach()

    def _on_discard(self) -> None:
        self._outputs = []  # the failed attempt's (or the check's) outputs
        if self.scaler is not None:
            reset_scaler_step_state(self.scaler)

    def _optimizer_step(self, params: list[nn.Parameter], kept: list[torch.Tensor | None] | None) -> None:
        """``optimizer.step()``; an OOM here is the model states, which splitting cannot fix.

        In a process group the ranks agree on it, so no rank goes on to wait for a
        step the others abandoned. Whatever fails, the step is undone first (see :meth:`step`).
        """
        failed = False
        at_oom: dict[str, int | None] = {}
        optimizer_before = OptimizerSnapshot(self.optimizer)
        scaler_before = ScalerSnapshot(self.scaler)

        def undo() -> str | None:
            restore_gradients(params, kept)
            self.splitter.undo()
            scaler_before.restore()
            return optimizer_before.restore()

        try:
            self._before_step()
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        except BaseException as error:
            if not is_oom(error):
                undo()
                raise
            failed = True
            # Read while the step's temporaries are still alive: they are what did not fit.
            allocated, reserved = self.splitter._memory()
            at_oom = {"allocated": allocated, "reserved": reserved, "requested": requested_bytes(error)}
        failed_anywhere = distributed.any_rank(failed) if distributed.is_distributed() else failed
        if failed_anywhere:
            message, parts = self._optimizer_oom_message(failed, at_oom)
            self.splitter._release_memory()
            partial = undo()
            if partial is not None:
                message += f"; {partial}"
            raise GuardError(message, parts)
        self.optimizer.zero_grad(set_to_none=True)

    def _before_step(self) -> None:
        """Unscale (with a scaler), clip and run the user's hook, on the whole batch's gradient."""
        if self.clip_grad_norm is None and self.before_step is None:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clipping needs the true gradient
        if self.clip_grad_norm is not None:
            params = [p for p in self.splitter.params if p.grad is not None]
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm))
        if self.before_step is not None:
            self.before_step(self.model, self.optimizer)

    def _optimizer_oom_message(self, here: bool, at_oom: dict[str, int | None]) -> tuple[str, dict[str, int | None]]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        parts: dict[str, int | None] = {
            "capacity": self.splitter._capacity(),
            "parameters": tensor_bytes(list(self.model.parameters())),
            "gradients": tensor_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer_state": tensor_bytes(list(optimizer_state_tensors(self.optimizer))),
            "optimizer_state_needed": expected_optimizer_state_bytes(self.optimizer),
            "allocated": at_oom.get("allocated"),
            "reserved": at_oom.get("reserved"),
            "requested": at_oom.get("requested"),
        }
        if not here:
            return (
                "out of memory in optimizer.step() on another rank: splitting the batch cannot fix it; "
                "see that rank's error",
                parts,
            )
        needed = parts["optimizer_state_needed"]
        state_bytes = needed if needed is not None else parts["optimizer_state"] or 0
        state = format_size(state_bytes) if needed is not None else f"{format_size(state_bytes)} so far"
        states = (parts["parameters"] or 0) + (parts["gradients"] or 0) + state_bytes
        capacity = parts["capacity"]
        on = f" on a device of {format_size(capacity)}" if capacity else ""
        sizes = (
            f"parameters {format_size(parts['parameters'] or 0)} + gradients {format_size(parts['gradients'] or 0)} "
            f"+ {type(self.optimizer).__name__} state {state}"
        )
        if capacity is None or states > capacity:
            parts["optimizer_temporaries"] = None
            return (
                "out of memory in optimizer.step(): splitting the batch cannot fix it, the model states do not fit; "
                f"they need {sizes}{on}; try bf16 weights and optimizer states, sharding (FSDP, "
                "ZeroRedundancyOptimizer), or a lighter optimizer (SGD, Adafactor, 8-bit Adam)",
                parts,
            )
        # The states fit: what ran out is the step's own memory (the optimizer's temporaries,
        # made per parameter group by foreach implementations) and the allocator's rounding.
        allocated = parts["allocated"]
        held = (parts["parameters"] or 0) + (parts["gradients"] or 0) + (parts["optimizer_state"] or 0)
        temporaries = None if allocated is None else max(0, allocated - held)
        parts["optimizer_temporaries"] = temporaries
        at = ""
        if allocated is not None:
            at = f"; at the OOM {format_size(allocated)} were allocated"
            if temporaries:
                at += f", {format_size(temporaries)} of them the optimizer's temporaries"
        cause = what_did_not_fit(capacity, allocated, parts["reserved"], parts["requested"])
        return (
            f"out of memory in optimizer.step(): splitting the batch cannot fix it; the model states ({sizes} = "
            f"{format_size(states)}) fit{on}, but the step needs more{at}" + (f"; {cause}" if cause else "") + "; "
            "try the optimizer with foreach=False (fewer temporaries), "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (no segment rounding), "
            "bf16 optimizer states, or sharding (FSDP, ZeroRedundancyOptimizer)",
            parts,
        )
