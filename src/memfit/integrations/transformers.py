"""memfit in the transformers Trainer: a training step that survives OOMs, memory per step.

Trainer callbacks cannot catch exceptions, so the guard is a subclass:
``MemfitTrainer.training_step`` runs the Trainer's own ``training_step`` (forward,
``compute_loss``, ``accelerator.backward``) over the batch through
:class:`memfit.guard.Splitter`. On an OOM the partial gradients are dropped and the same
batch runs again in halves; the learning-rate schedule, the global step and the
effective batch stay as they were (the Trainer's ``auto_find_batch_size`` instead
restarts the loop with a smaller batch).

The gradient is the one the ordinary Trainer computes for the batch. Every micro-batch
gets the batch's ``num_items_in_batch``, and how the micro-batches must be weighted is not
read from the Trainer's flags (``model_accepts_loss_kwargs`` is true for any model whose
``forward`` takes ``**kwargs``, also when its loss ignores ``num_items_in_batch``, as BERT's
masked-LM loss does) but checked on the model's own loss before the first split (see
:mod:`memfit.guard.check`): a loss divided by the batch's ``num_items_in_batch`` adds up as it
is (weight 1), a mean over the micro-batch's valid tokens is weighted by its share of them,
a mean over samples by its share of the samples (or of ``memfit_weight(inputs)``). A loss
that does not split exactly is refused before anything is split. The Trainer's own
scaling (its division by the accumulation steps) applies to the micro-batches as to the batch.

``memfit_checkpointing`` (a policy of :mod:`memfit.run.checkpointing`: ``blocks``,
``every:K``, ``first:N``, ``modules:NAME``, ``selective``, or a lock's
``settings.checkpointing``) is applied to the model for the whole of ``train()`` through
:meth:`memfit.Settings.apply`, the path Lightning's callback and a user's own loop take,
and undone at its end. The trained weights are those of the run without it (the recompute
replays dropout's random state, and restores the buffers a forward changed). Refused in one
line before training: a policy that is not one, ``modules:NAME`` naming no module of the
model, and a model or ``TrainingArguments`` already using transformers' gradient
checkpointing (both would wrap the same layers: keep one). Policies that choose among the
blocks forward runs are refused at the first training forward, before any gradient, when
none runs. After the first step one line on transformers' logger says what recomputes, and
says so when that saves no memory (nothing chosen, or the whole model).

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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from torch import nn

from memfit import distributed
from memfit.errors import MemfitError
from memfit.guard import OOMEvent, Splitter
from memfit.memory.devices import CudaDevice, Device
from memfit.memory.devices import device as make_device
from memfit.monitor.monitor import Monitor
from memfit.run import checkpointing as _checkpointing
from memfit.run.settings import Applied, Settings

#: transformers' own logger for this module (its verbosity settings apply)
logger = transformers.utils.logging.get_logger(__name__)

__all__ = ["MemfitTrainer", "MemoryCallback", "MemfitCallback", "MEMORY_METRICS"]

#: the logged metric names, and the monitor record field each one reads
MEMORY_METRICS = {
    "memfit/allocated": "allocated",
    "memfit/reserved": "reserved",
    "memfit/peak_allocated": "peak_allocated",
    "memfit/peak_reserved": "peak_reserved",
}


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
    ``memfit_grow_after``, ``memfit_split``, ``memfit_weight`` and ``memfit_exact`` (as
    ``grow_after``, ``split``, ``weight`` and ``exact`` of :class:`memfit.Guard`),
    ``memfit_checkpointing`` (a checkpointing policy, see the module docstring; default
    ``none``). ``trainer.memfit_events`` lists the OOMs recovered; ``trainer.memfit_checkpointed``
    names the modules that recompute (after the first training step).
    """

    def __init__(
        self,
        *args: Any,
        memfit_device: Device | str | None = None,
        memfit_monitor: bool = True,
        memfit_grow_after: int | None = None,
        memfit_split: Callable[[Any, int], Any] | None = None,
        memfit_weight: Callable[[Any], Any] | None = None,
        memfit_exact: bool = True,
        memfit_checkpointing: str = "none",
        **kwargs: Any,
    ) -> None:
        Settings(checkpointing=memfit_checkpointing)  # a policy that is not one: refused here, in one line
        self.memfit_checkpointing = memfit_checkpointing
        self._memfit_applied: Applied | None = None
        #: what checkpointing applied in the last train() (its modules once the first step ran)
        self.memfit_checkpointed: _checkpointing.Checkpointed | None = None
        self._memfit_said = False
        self.memfit_device = make_device(memfit_device) if memfit_device is not None else None
        self._memfit_options: dict[str, Any] = {
            "grow_after": memfit_grow_after,
            "split": memfit_split,
            "weight": memfit_weight,
            "exact": memfit_exact,
        }
        self._memfit_splitter: Splitter | None = None
        self._memfit_factor = 1.0
        self.memory_callback: MemoryCallback | None = None
        super().__init__(*args, **kwargs)
        self._refuse_checkpointing()
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
        self._refuse_checkpointing()  # the arguments or the model may have changed since __init__
        gpu = self.memfit_device
        with gpu if gpu is not None else contextlib.nullcontext():
            if gpu is not None:
                gpu.adopt(list(self.model.parameters()) + list(self.model.buffers()))
            with self._checkpointing_applied():
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
        parent: Any = super()  # transformers.Trainer (untyped to the checker)

        def forward_backward(micro: Any, share: float) -> float:
            # share: the splitter's weight for this micro-batch, as checked on this loss
            self._memfit_factor = share
            try:
                loss = parent.training_step(model, micro, num_items_in_batch)
            finally:
                self._memfit_factor = 1.0
            # The Trainer returns the loss it backpropagated (times share); the splitter wants
            # the micro-batch's own, and weights it by share itself.
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
        self._say_checkpointed()
        return torch.tensor(result.loss, device=self.args.device)

    # -- the pieces ----------------------------------------------------------------------

    def _splitter(self) -> Splitter:
        if self._memfit_splitter is None:
            module = self.accelerator.unwrap_model(self.model)
            # With a GradScaler (fp16), inf gradients are the scaler's to skip, not an error.
            finite = getattr(self.accelerator, "scaler", None) is None
            self._memfit_splitter = Splitter(
                module, device=self.memfit_device, check_finite=finite, **self._memfit_options
            )
        return self._memfit_splitter

    def _refuse_checkpointing(self) -> None:
        """Refuse, before training, a checkpointing policy this model cannot take."""
        if self.memfit_checkpointing == "none":
            return
        if getattr(self.args, "gradient_checkpointing", False):
            raise MemfitError(
                f"memfit_checkpointing={self.memfit_checkpointing!r} and TrainingArguments(gradient_checkpointing=True) "
                "would both checkpoint the same layers: keep one (memfit_checkpointing='blocks' is transformers' own)"
            )
        _checkpointing.check_model(self.model, self.memfit_checkpointing)

    @contextlib.contextmanager
    def _checkpointing_applied(self) -> Iterator[None]:
        """The policy applied to the model for one ``train()`` (Settings.apply, as Lightning and
        a user's own loop), undone at its end whatever happens."""
        if self.memfit_checkpointing == "none":
            yield
            return
        applied = Settings(checkpointing=self.memfit_checkpointing).apply(self.model)
        self._memfit_applied, self.memfit_checkpointed, self._memfit_said = applied, applied.checkpointed, False
        try:
            yield
        finally:
            self._memfit_applied = None
            applied.undo()

    def _say_checkpointed(self) -> None:
        """Once per train(), after the first step: what recomputes, and when that saves nothing."""
        done = self.memfit_checkpointed
        if self._memfit_said or self._memfit_applied is None or done is None or not done.found:
            return
        self._memfit_said = True
        if not self.is_world_process_zero():
            return
        nothing = _checkpointing.saves_nothing(done)
        if nothing is not None:
            logger.warning(f"memfit: {nothing}")
        else:
            logger.info(f"memfit: checkpointing {done.policy}: {done.describe()} recompute in backward")
