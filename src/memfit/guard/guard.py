"""The Guard: one optimizer step per batch that survives OOMs by splitting the batch.

The splitter (:mod:`memfit.guard.splitter`) runs forward and backward over the batch in
as many micro-batches as OOMs demand; the Guard adds what a real loop does between
backward and the step (unscaling and gradient clipping, or the user's own hook), the
optimizer step (through the ``GradScaler`` if given) and ``zero_grad``, and names what
does not fit when even one sample or the optimizer step runs out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit import distributed
from memfit.errors import MemfitError
from memfit.guard.batching import BatchDim
from memfit.guard.gradients import (
    expected_optimizer_state_bytes,
    optimizer_state_tensors,
    reset_scaler_step_state,
    tensor_bytes,
)
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


class Guard:
    """One optimizer step per batch that survives OOMs by splitting the batch.

    :meth:`step` runs forward and backward over the whole batch, split on OOM (see
    :class:`~memfit.guard.splitter.Splitter`), then ``optimizer.step()`` (through
    ``scaler`` if given) and ``zero_grad``, and returns the batch's loss. The update equals
    the whole batch's: each micro-batch's loss is weighted by its share of the samples.
    Gradient clipping (``clip_grad_norm``, or any ``before_step``) runs on that whole
    gradient, so a clipped update equals the unsplit clipped update too.

    Args:
        model: the model being trained (a DDP-wrapped model is supported).
        optimizer: its optimizer.
        loss_fn: ``loss_fn(model, micro_batch)`` returns the mean loss over the
            micro-batch (run autocast inside it for mixed precision).
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
        """One optimizer step over the whole batch; returns the batch's loss."""
        result = self.splitter.run(batch, self._forward_backward)
        self._optimizer_step()
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
        loss = self.loss_fn(self.model, micro)
        weighted = loss if share == 1.0 else loss * share
        if self.scaler is not None:
            weighted = self.scaler.scale(weighted)
        weighted.backward()
        return loss.detach()

    def _on_discard(self) -> None:
        if self.scaler is not None:
            reset_scaler_step_state(self.scaler)

    def _optimizer_step(self) -> None:
        """``optimizer.step()``; an OOM here is the model states, which splitting cannot fix.

        In a process group the ranks agree on it, so no rank goes on to wait for a
        step the others abandoned.
        """
        failed = False
        at_oom: dict[str, int | None] = {}
        try:
            self._before_step()
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        except BaseException as error:
            if not is_oom(error):
                raise
            failed = True
            # Read while the step's temporaries are still alive: they are what did not fit.
            allocated, reserved = self.splitter._memory()
            at_oom = {"allocated": allocated, "reserved": reserved, "requested": requested_bytes(error)}
        failed_anywhere = distributed.any_rank(failed) if distributed.is_distributed() else failed
        if failed_anywhere:
            message = self._optimizer_oom_message(failed, at_oom)
            self.splitter._release_memory()
            raise GuardError(*message)
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
