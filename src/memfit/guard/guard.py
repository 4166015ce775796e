"""The Guard: one optimizer step per batch that survives OOMs by splitting the batch.

The splitter (:mod:`memfit.guard.splitter`) runs forward and backward over the batch in
as many micro-batches as OOMs demand; the Guard adds the optimizer step (through the
``GradScaler`` if given) and ``zero_grad``, and names what does not fit when even one
sample or the optimizer step runs out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit import distributed
from memfit.guard.gradients import (
    expected_optimizer_state_bytes,
    optimizer_state_tensors,
    reset_scaler_step_state,
    tensor_bytes,
)
from memfit.guard.splitter import GuardError, OOMEvent, SplitFn, SplitResult, Splitter, WeightFn
from memfit.memory.devices import Device
from memfit.memory.oom import is_oom
from memfit.units import format_size

__all__ = ["Guard"]


class Guard:
    """One optimizer step per batch that survives OOMs by splitting the batch.

    :meth:`step` runs forward and backward over the whole batch, split on OOM (see
    :class:`~memfit.guard.splitter.Splitter`), then ``optimizer.step()`` (through
    ``scaler`` if given) and ``zero_grad``, and returns the batch's loss. The update equals
    the whole batch's: each micro-batch's loss is weighted by its share of the samples.

    Args:
        model: the model being trained (a DDP-wrapped model is supported).
        optimizer: its optimizer.
        loss_fn: ``loss_fn(model, micro_batch)`` returns the mean loss over the
            micro-batch (run autocast inside it for mixed precision).
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
        self.splitter = Splitter(
            model,
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

    def predict(self, batch: Any, fn: Callable[[Any], Any]) -> Any:
        """``fn(batch)`` under ``torch.no_grad()``, split on OOM, outputs concatenated."""
        return self.splitter.predict(batch, fn)

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
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        except BaseException as error:
            if not is_oom(error):
                raise
            failed = True
        failed_anywhere = distributed.any_rank(failed) if distributed.is_distributed() else failed
        if failed_anywhere:
            self.splitter._release_memory()
            raise GuardError(*self._optimizer_oom_message(failed))
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_oom_message(self, here: bool) -> tuple[str, dict[str, int | None]]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        parts: dict[str, int | None] = {
            "capacity": self.splitter._capacity(),
            "parameters": tensor_bytes(list(self.model.parameters())),
            "gradients": tensor_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer_state": tensor_bytes(list(optimizer_state_tensors(self.optimizer))),
            "optimizer_state_needed": expected_optimizer_state_bytes(self.optimizer),
        }
        if not here:
            return (
                "out of memory in optimizer.step() on another rank: splitting the batch cannot fix it; "
                "see that rank's error",
                parts,
            )
        needed = parts["optimizer_state_needed"]
        state = format_size(needed) if needed is not None else f"{format_size(parts['optimizer_state'] or 0)} so far"
        capacity = f" on a device of {format_size(parts['capacity'])}" if parts["capacity"] else ""
        return (
            "out of memory in optimizer.step(): splitting the batch cannot fix it, the model states do not fit; "
            f"they need parameters {format_size(parts['parameters'] or 0)} + gradients "
            f"{format_size(parts['gradients'] or 0)} + {type(self.optimizer).__name__} state {state}{capacity}; "
            "try bf16 weights and optimizer states, sharding (FSDP, ZeroRedundancyOptimizer), "
            "or a lighter optimizer (SGD, Adafactor, 8-bit Adam)",
            parts,
        )
