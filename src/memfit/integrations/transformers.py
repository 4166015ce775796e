"""memfit in the transformers Trainer: a training step that survives OOMs, memory per step.

Trainer callbacks cannot catch exceptions, so the guard is a subclass:
``MemfitTrainer.training_step`` runs the Trainer's own ``training_step`` (forward,
``compute_loss``, ``accelerator.backward``) over the batch through
:class:`memfit.guard.Splitter`. On an OOM the partial gradients are dropped and the same
batch runs again in halves; the learning-rate schedule, the global step and the
effective batch stay as they were (the Trainer's ``auto_find_batch_size`` instead
restarts the loop with a smaller batch).

The gradient is the unsplit one, with the Trainer's own normalization:

- when the loss is normalized by ``num_items_in_batch`` (models that accept loss kwargs,
  such as GPT-2 and Llama, or a ``compute_loss_func``), every micro-batch gets the same
  ``num_items_in_batch``, so its loss is its part of the batch's token sum and the
  micro-batches' gradients add up to the batch's as they are;
- otherwise the loss is a mean over the micro-batch: it is weighted by the micro-batch's
  share of the samples (or of ``memfit_weight(inputs)``, such as a token count), and the
  Trainer divides it by the accumulation steps as usual.

``MemoryCallback`` records memory at every step end with a :class:`memfit.Monitor` and
adds ``memfit/allocated``, ``memfit/reserved``, ``memfit/peak_allocated`` and
``memfit/peak_reserved`` (bytes) to each log the Trainer reports.

``memfit_device`` (a memfit device or spec; ``"sim:4GiB"`` rehearses a smaller GPU on
the CPU) is entered for the whole of ``train()``; by default the Trainer's own CUDA device
is watched, and on a CPU nothing is (the guard still catches real OOMs).

>>> from memfit.integrations.transformers import MemoryCallback
>>> MemoryCallback("sim:1GiB").records
[]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

from memfit import distributed
from memfit.guard import OOMEvent, Splitter
from memfit.memory.devices import CudaDevice, Device
from memfit.memory.devices import device as make_device
from memfit.monitor.monitor import Monitor

#: transformers' own logger for this module (its verbosity settings apply)
logger = transformers.utils.logging.get_logger(__name__)

__all__ = ["MemfitTrainer", "MemoryCallback", "MemfitCallback", "micro_batch_factor", "MEMORY_METRICS"]

#: the logged metric names, and the monitor record field each one reads
MEMORY_METRICS = {
    "memfit/allocated": "allocated",
    "memfit/reserved": "reserved",
    "memfit/peak_allocated": "peak_allocated",
    "memfit/peak_reserved": "peak_reserved",
}


def micro_batch_factor(loss_is_normalized_by_batch: bool, share: float) -> float:
    """What a micro-batch's loss is multiplied by so the micro-batches add up to the batch.

    Why two cases: a loss already divided by the batch's ``num_items_in_batch`` is a part
    of the batch's sum and adds up as it is; a mean over the micro-batch must be
    weighted by the micro-batch's share.

    >>> micro_batch_factor(True, 0.25), micro_batch_factor(False, 0.25)
    (1.0, 0.25)
    """
    return 1.0 if loss_is_normalized_by_batch else share


class MemoryCallback(transformers.TrainerCallback):
    """Record memory at each optimizer step and add it to the Trainer's logs.

    ``device``: the memfit device to watch (a spec or a Device; the same object the
    training runs on for ``sim:``); None watches the Trainer's CUDA device, and does
    nothing on a CPU. ``path``: JSON lines for ``memfit report``.
    """

    def __init__(self, device: Device | str | None = None, *, path: str | None = None) -> None:
        self.device = device
        self.path = path
        self.monitor: Monitor | None = None
        self._running = False

    @property
    def records(self) -> list[dict[str, Any]]:
        """One record per optimizer step (see :class:`memfit.Monitor`)."""
        return self.monitor.records if self.monitor is not None else []

    def on_train_begin(self, args: transformers.TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        device = self.device
        if device is None and args.device.type == "cuda":
            device = CudaDevice(args.device.index or 0)
        if device is None:
            return
        self.monitor = Monitor(device, path=self.path)
        self.monitor.__enter__()
        self._running = True

    def on_step_end(self, args: transformers.TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self._running and self.monitor is not None:
            self.monitor.step(phase="train", global_step=state.global_step)

    def on_log(
        self,
        args: transformers.TrainingArguments,
        state: Any,
        control: Any,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Callbacks run in order and share ``logs``: put this callback before the
        # reporting ones (MemfitTrainer does) so they see the memory too.
        if logs is not None:
            self.add_memory(logs)

    def add_memory(self, logs: dict[str, Any]) -> None:
        """Put the last recorded step's memory (bytes) into ``logs``."""
        if self.records:
            record = self.records[-1]
            logs.update({name: int(record[key]) for name, key in MEMORY_METRICS.items()})

    def on_train_end(self, args: transformers.TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self._running and self.monitor is not None:
            self._running = False
            self.monitor.__exit__(None, None, None)


#: the name the issue uses for the callback
MemfitCallback = MemoryCallback


class MemfitTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose training step survives OOMs by splitting the batch.

    Extra keyword arguments (all optional): ``memfit_device`` (see the module docstring),
    ``memfit_monitor`` (default True: add a :class:`MemoryCallback` on that device),
    ``memfit_grow_after``, ``memfit_split`` and ``memfit_weight`` (as ``grow_after``,
    ``split`` and ``weight`` of :class:`memfit.Guard`). ``trainer.memfit_events`` lists
    the OOMs recovered.
    """

    def __init__(
        self,
        *args: Any,
        memfit_device: Device | str | None = None,
        memfit_monitor: bool = True,
        memfit_grow_after: int | None = None,
        memfit_split: Callable[[Any, int], Any] | None = None,
        memfit_weight: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.memfit_device = make_device(memfit_device) if memfit_device is not None else None
        self._memfit_options: dict[str, Any] = {
            "grow_after": memfit_grow_after,
            "split": memfit_split,
            "weight": memfit_weight,
        }
        self._memfit_splitter: Splitter | None = None
        self._memfit_factor = 1.0
        self.memory_callback: MemoryCallback | None = None
        super().__init__(*args, **kwargs)
        if memfit_monitor:
            self.memory_callback = MemoryCallback(self.memfit_device)
            # First, so the reporting callbacks' on_log sees the memory metrics.
            self.callback_handler.callbacks.insert(0, self.memory_callback)

    @property
    def memfit_events(self) -> list[OOMEvent]:
        """Every OOM the training step recovered from, oldest first."""
        return self._memfit_splitter.events if self._memfit_splitter is not None else []

    @property
    def memfit_micro_batch_size(self) -> int | None:
        """The largest micro-batch the next step runs (None: whole batches)."""
        return self._memfit_splitter.micro_batch_size if self._memfit_splitter is not None else None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train`` with the memfit device entered (for ``sim:``, that counts the tensors)."""
        gpu = self.memfit_device
        if gpu is None:
            return super().train(*args, **kwargs)
        with gpu:
            gpu.adopt(list(self.model.parameters()) + list(self.model.buffers()))
            return super().train(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` with the last step's memory added, so ``log_history`` has it too."""
        if self.memory_callback is not None:
            self.memory_callback.add_memory(logs)
        super().log(logs, start_time)

    def compute_loss(
        self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        factor = self._memfit_factor
        if factor == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * factor, outputs
        return result * factor

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        splitter = self._splitter()
        normalized = self._loss_is_normalized_by_batch(num_items_in_batch)
        parent: Any = super()  # transformers.Trainer (untyped to the checker)

        def forward_backward(micro: Any, share: float) -> float:
            self._memfit_factor = micro_batch_factor(normalized, share)
            try:
                loss = parent.training_step(model, micro, num_items_in_batch)
            finally:
                self._memfit_factor = 1.0
            # The splitter weights what this returns by ``share`` to report the batch's
            # loss; undo that for a loss that is already the micro-batch's part.
            return float(loss) / share if share > 0 else 0.0

        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        seen = len(splitter.events)
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
            result = splitter.run(inputs, forward_backward)
        if self.is_world_process_zero():
            # A recovered OOM re-runs the batch in halves, a long step: say so, once per event.
            for event in splitter.events[seen:]:
                logger.warning(event.describe())
        if ddp is not None:
            distributed.average_gradients_([p for p in model.parameters() if p.requires_grad])
        return torch.tensor(result.loss, device=self.args.device)

    # -- the pieces ----------------------------------------------------------------------

    def _splitter(self) -> Splitter:
        if self._memfit_splitter is None:
            module = self.accelerator.unwrap_model(self.model)
            self._memfit_splitter = Splitter(module, device=self.memfit_device, **self._memfit_options)
        return self._memfit_splitter

    def _loss_is_normalized_by_batch(self, num_items_in_batch: Any) -> bool:
        """The Trainer's own test (``Trainer.training_step``): is the loss divided by ``num_items_in_batch``?"""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool(
            (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
            or getattr(self, "compute_loss_func", None) is not None
        )
