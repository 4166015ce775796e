"""memfit in Lightning: probe the batch at fit start, survive OOMs, log memory per step.

``MemfitCallback`` does three things Lightning's own tools do not:

- **probe** (``on_fit_start``): finds the batch that fits by running the module's own
  ``training_step`` and ``configure_optimizers`` on the device (every rank probes its own
  and all agree on the smallest, so it works under DDP, where ``BatchSizeFinder``
  refuses), then sets ``batch_size`` where Lightning's ``BatchSizeFinder`` would (the
  module, its ``hparams``, the datamodule). With ``target_batch_size`` it keeps the
  effective batch exact: per-device batch x ``accumulate_grad_batches`` x ranks equals
  the target.
- **guard**: the callback wraps the module's ``training_step`` (an instance attribute,
  removed at the end of fit). The wrapper runs forward *and* backward of the batch itself
  through :class:`memfit.guard.Splitter`: on an OOM it drops the partial gradients, halves
  the micro-batch and runs the same batch again, each micro-batch's loss weighted by its
  share (and divided by ``accumulate_grad_batches``, as Lightning does). It returns the
  batch's loss as a leaf tensor, so Lightning's own ``backward`` adds nothing and the
  optimizer step, clipping, schedulers and hooks run as usual. Under DDP it turns off
  DDP's gradient hooks (``require_backward_grad_sync``) and the splitter averages the
  gradients once per batch after every rank agreed, so an OOM on one rank cannot leave
  the others in a collective.
- **monitor**: a :class:`memfit.Monitor` records each batch, and ``memfit/allocated``,
  ``memfit/reserved``, ``memfit/peak_allocated`` and ``memfit/peak_reserved`` (bytes) go to
  every logger of the trainer.

The device: ``device=`` takes a memfit device or spec (``"sim:4GiB"`` to rehearse a
smaller GPU on the CPU, ``"cuda:0"``), or a function of the rank returning one; by
default it is the module's own CUDA device, or none on a CPU (then nothing is probed or
monitored; the guard still catches real OOMs).

>>> import lightning
>>> callback = MemfitCallback(device="sim:1GiB", target_batch_size=64)
>>> isinstance(callback, lightning.pytorch.Callback)
True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from torch import nn

from memfit import distributed
from memfit.cuda.counting import not_counted
from memfit.errors import MemfitError
from memfit.guard import Splitter, add_gradients, set_aside_gradients
from memfit.guard.check import checking
from memfit.integrations.effective_batch import split_target
from memfit.memory.devices import CudaDevice, Device
from memfit.memory.devices import device as make_device
from memfit.monitor.monitor import Monitor
from memfit.run.measure import Measurement
from memfit.run.settings import Applied, Settings
from memfit.search.headroom import DEFAULT_HEADROOM
from memfit.search.probe import TRIAL_STEPS, ProbeResult
from memfit.search.probe import probe as run_probe
from memfit.search.trials import trial_line
from memfit.workload import Workload

__all__ = [
    "MemfitCallback",
    "loss_of",
    "first_optimizer",
    "batch_maker",
    "set_aside_gradients",
    "add_gradients",
    "MEMORY_METRICS",
]

DeviceChoice = Device | str | Callable[[int], "Device | str"] | None

#: the logged metric names, and the monitor record field each one reads
MEMORY_METRICS = {
    "memfit/allocated": "allocated",
    "memfit/reserved": "reserved",
    "memfit/peak_allocated": "peak_allocated",
    "memfit/peak_reserved": "peak_reserved",
}


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a ``training_step`` output: the tensor itself, or ``output["loss"]``.

    Why strict: a step that returns ``None`` (skip) cannot be split into micro-batches
    whose gradients add up to the batch's.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise MemfitError(
        f"training_step returned {type(output).__name__}: memfit needs the loss as a tensor or as {{'loss': tensor}}"
    )


def first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The first optimizer in whatever ``configure_optimizers`` returned.

    Why only the first: a probe needs the optimizer state a step allocates; modules with
    several optimizers (GANs) use manual optimization, which memfit does not wrap.
    """
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping) and "optimizer" in configured:
        return first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return first_optimizer(configured[0])
    raise MemfitError(f"configure_optimizers returned {type(configured).__name__}: found no optimizer to probe with")


def refuse_manual_optimization(module: pl.LightningModule, *, probe: bool, guard: bool) -> None:
    """Refuse, in one line and before any step, to probe or guard a manual-optimization module.

    Why: the probe and the guard run ``training_step`` for its loss and leave backward
    and the optimizer step to memfit (probe) or to Lightning (guard); a module with
    ``automatic_optimization = False`` calls ``manual_backward`` and its optimizers' steps
    itself, through the trainer, which neither can stand in for.

    Args:
        module: the LightningModule being fitted.
        probe: whether the callback probes.
        guard: whether the callback guards.
    """
    if module.automatic_optimization or not (probe or guard):
        return
    raise MemfitError(
        f"MemfitCallback(probe=..., guard=...) drives automatic optimization; {type(module).__name__} uses manual "
        "optimization (automatic_optimization = False), whose training_step steps its own optimizers: pass "
        "MemfitCallback(probe=False, guard=False) to keep the memory monitor, probe a Workload of one step "
        "with memfit.probe, or use memfit.Guard inside training_step"
    )


def takes_batch_idx(training_step: Callable[..., Any]) -> bool:
    """True when a bound ``training_step`` takes a second argument (``batch_idx``), as Lightning checks.

    Args:
        training_step: the module's bound ``training_step``.
    """
    import inspect

    try:
        parameters = list(inspect.signature(training_step).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def batch_maker(dataloader: Any) -> Callable[[int], Any]:
    """``make_batch(n)``: ``n`` samples of the loader's dataset (cycled), collated as the loader does.

    Why the dataset: a probe must run real samples through the real collate function,
    at any batch size; a map-style dataset gives that without iterating the loader.
    """
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    if dataset is None or collate is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise MemfitError(
            "the train dataloader has no map-style dataset to draw probe batches from; "
            "pass make_batch=(lambda n: a batch of n samples) to MemfitCallback"
        )
    size = len(dataset)
    if size == 0:
        raise MemfitError("the training dataset is empty: nothing to probe with")

    def make_batch(n: int) -> Any:
        return collate([dataset[i % size] for i in range(n)])

    return make_batch


@contextlib.contextmanager
def _without_trainer(module: pl.LightningModule) -> Iterator[None]:
    """Run the module's hooks outside the trainer's loops (for probe trials).

    Why: ``self.log`` inside ``training_step`` needs a running loop; without a trainer it
    only warns, and the trials' values must not reach the logs anyway.
    """
    trainer = module._trainer
    module._trainer = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        module._trainer = trainer


@contextlib.contextmanager
def _logging_muted(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing inside (the guard's check of the loss).

    Why: the check runs ``training_step`` on parts of a batch once, before the first split;
    what it logs would reach Lightning's epoch accumulators as if they were batches.
    """
    module.log = _ignore
    module.log_dict = _ignore
    try:
        yield
    finally:
        del module.log, module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _ddp_model(trainer: pl.Trainer) -> nn.parallel.DistributedDataParallel | None:
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, nn.parallel.DistributedDataParallel) else None


class MemfitCallback(pl.Callback):
    """Probe the batch size at fit start, guard each training step against OOM, log memory.

    Args:
        probe: find the batch that fits and set the module's ``batch_arg_name``.
        guard: recover from an OOM in a training step by splitting the batch (same
            gradient, no sample lost).
        monitor: record memory per batch and log it to the trainer's loggers.
        target_batch_size: samples per optimizer step over all ranks, kept exact with
            ``accumulate_grad_batches`` (needs ``probe``).
        device: where memory is measured (see the module docstring).
        batch_arg_name: the attribute (or hparam) that holds the batch size.
        make_batch: ``make_batch(n)`` gives probe batches (default: samples of the train
            dataloader's dataset).
        max_batch_size: as in :func:`memfit.probe`.
        multiple_of: as in :func:`memfit.probe`.
        headroom: as in :func:`memfit.probe`.
        grow_after: as in :class:`memfit.Guard`.
        split: as in :class:`memfit.Guard`.
        weight: as in :class:`memfit.Guard`.
        exact: as in :class:`memfit.Guard`: refuse a split that would change the gradient.
        monitor_path: JSON lines for ``memfit report`` (``{rank}`` is the rank).
        checkpointing: a checkpointing policy (``blocks``, ``every:2``, ``selective``,
            ``modules:NAME``...; see :mod:`memfit.run.checkpointing`), applied to the
            module through :meth:`memfit.Settings.apply` at fit start and undone at its end.
    """

    def __init__(
        self,
        probe: bool = True,
        guard: bool = True,
        monitor: bool = True,
        target_batch_size: int | None = None,
        *,
        device: DeviceChoice = None,
        batch_arg_name: str = "batch_size",
        make_batch: Callable[[int], Any] | None = None,
        max_batch_size: int | None = None,
        multiple_of: int = 1,
        headroom: float = DEFAULT_HEADROOM,
        grow_after: int | None = None,
        split: Callable[[Any, int], Any] | None = None,
        weight: Callable[[Any], Any] | None = None,
        exact: bool = True,
        monitor_path: str | None = None,
        checkpointing: str = "none",
    ) -> None:
        Settings(checkpointing=checkpointing)  # a bad policy is refused here, in one line
        if target_batch_size is not None and not probe:
            raise MemfitError("target_batch_size needs probe=True: the per-device batch comes from the probe")
        self.probe = probe
        self.guard = guard
        self.monitor = monitor
        self.target_batch_size = target_batch_size
        self.device_choice = device
        self.batch_arg_name = batch_arg_name
        self.make_batch = make_batch
        self.max_batch_size = max_batch_size
        self.multiple_of = multiple_of
        self.headroom = headroom
        self.grow_after = grow_after
        self.split = split
        self.weight = weight
        self.exact = exact
        self.monitor_path = monitor_path
        self.checkpointing = checkpointing
        #: what checkpointing applied (its ``modules`` once the first training forward ran)
        self.applied: Applied | None = None
        #: what the probe found (None before fit start or with probe=False)
        self.result: ProbeResult | None = None
        #: the per-device batch and accumulation the callback set
        self.batch_size: int | None = None
        self.accumulation: int | None = None
        #: the guard's splitter during fit (its ``events`` list every OOM recovered)
        self.splitter: Splitter | None = None
        #: the memory monitor of the last fit (its records and findings stay readable)
        self.memory: Monitor | None = None
        self._device: Device | None = None
        self._entered = False
        self._monitoring = False
        self._ddp_sync: bool | None = None
        self._pending: list[torch.Tensor | None] | None = None

    # -- Lightning hooks -----------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before anything runs: the probe and the guard drive automatic optimization only.
        refuse_manual_optimization(pl_module, probe=self.probe, guard=self.guard)
        # Entered here, after the strategy set up (DDP's wrapping and its first broadcast
        # are not training memory), and before the probe and the first step.
        self._device = self._resolve_device(pl_module)
        if self._device is not None:
            self._device.__enter__()
            self._entered = True
            self._device.adopt(list(pl_module.parameters()) + list(pl_module.buffers()))
        if self.checkpointing != "none":
            # before the probe, so the probe measures the step that will train
            self.applied = Settings(checkpointing=self.checkpointing).apply(pl_module)
        original = type(pl_module).training_step.__get__(pl_module)
        if self.probe:
            self._probe_and_set_batch(trainer, pl_module, original)
        if self.guard:
            self._install_guard(trainer, pl_module, original)
        if self.monitor and self._device is not None:
            self.memory = Monitor(self._device, path=self.monitor_path)
            self.memory.__enter__()
            self._monitoring = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        ddp = _ddp_model(trainer) if self.guard else None
        if ddp is not None:
            # DDP's gradient hooks would all-reduce inside backward, per micro-batch, and
            # hang when one rank runs out of memory; the splitter averages once instead.
            if self._ddp_sync is None:
                self._ddp_sync = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._monitoring or self.memory is None:
            return
        record = self.memory.step(phase="train", batch_idx=batch_idx)
        if record is None:
            return
        metrics = {name: float(record[key]) for name, key in MEMORY_METRICS.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:
            add_gradients([p for p in pl_module.parameters() if p.requires_grad], self._pending)
            self._pending = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(trainer, pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish(trainer, pl_module)

    # -- the pieces ----------------------------------------------------------------------

    def _resolve_device(self, pl_module: pl.LightningModule) -> Device | None:
        choice = self.device_choice
        if callable(choice) and not isinstance(choice, Device):
            choice = choice(distributed.rank())
        if choice is not None:
            return make_device(choice)
        if pl_module.device.type == "cuda":
            return CudaDevice(pl_module.device.index or 0)
        return None

    def _probe_and_set_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, training_step: Callable[..., Any]
    ) -> None:
        if self._device is None:
            raise MemfitError(
                "MemfitCallback(probe=True) needs a device to probe: train on a GPU, or pass device='sim:SIZE'"
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MemfitError(
                f"cannot set the batch size: {self.batch_arg_name!r} is neither an attribute of the module, "
                "nor in its hparams, nor in the datamodule; add it, or pass batch_arg_name="
            )
        if self.make_batch is not None:
            make_batch = self.make_batch
        else:
            # The module's train_dataloader builds its dataset here, inside the entered
            # device: a dataset a GPU run keeps on the host is not charged to it.
            with not_counted():
                make_batch = batch_maker(trainer.fit_loop._data_source.dataloader())

        # training_step(batch, batch_idx) or training_step(batch): Lightning passes batch_idx
        # only when the method takes it, and so does the probe
        index = (0,) if takes_batch_idx(training_step) else ()

        def loss(model: nn.Module, batch: Any) -> torch.Tensor:
            with _without_trainer(pl_module):
                return loss_of(training_step(batch, *index))

        def optimizer(_params: Any) -> torch.optim.Optimizer:
            return first_optimizer(pl_module.configure_optimizers())

        workload = Workload(pl_module, make_batch, loss, optimizer, name=type(pl_module).__name__)
        # One line per trial (rank 0, Lightning's console logger): a probe of real steps
        # takes minutes on a slow device, and a silent one looks hung.
        rank_zero_info(
            f"memfit: probing the batch size of {workload.name} on {self._device.describe()} "
            f"(each trial runs {TRIAL_STEPS} training steps)"
        )

        def progress(batch_size: int, measurement: Measurement | None) -> None:
            if measurement is not None:
                rank_zero_info(f"memfit: probe · batch {batch_size}: {trial_line(measurement)}")

        self.result = run_probe(
            workload,
            self._device,
            max_batch_size=self.max_batch_size,
            multiple_of=self.multiple_of,
            headroom=self.headroom,
            progress=progress,
            say=lambda text: rank_zero_info(f"memfit: probe · {text}"),
        )
        # The largest batch within the headroom, not the throughput pick: that depends on
        # timings (so runs would differ), and with a target a larger micro-batch only
        # means fewer accumulation steps.
        fits = self.result.headroom_batch_size
        if self.target_batch_size is None:
            self.batch_size, self.accumulation = fits, trainer.accumulate_grad_batches
        else:
            self.batch_size, self.accumulation = split_target(self.target_batch_size, trainer.world_size, fits)
            trainer.accumulate_grad_batches = self.accumulation
        lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
        if trainer.is_global_zero:
            rank_zero_info(
                f"memfit: batch size {self.batch_size} (largest that fits: {self.result.max_batch_size}), "
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
            )

    def _install_guard(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, training_step: Callable[..., Any]
    ) -> None:
        if not pl_module.automatic_optimization:
            raise MemfitError(
                "MemfitCallback(guard=True) wraps automatic optimization; with manual optimization "
                "use memfit.Guard inside training_step"
            )
        ddp = _ddp_model(trainer)
        # The splitter gets the module itself: its ranks still agree after every attempt,
        # and the gradients are averaged here, tensor by tensor, in place (DDP's hooks
        # are off; see on_train_batch_start), so averaging needs no flat copy in memory.
        self.splitter = Splitter(
            pl_module,
            split=self.split,
            weight=self.weight,
            grow_after=self.grow_after,
            device=self._device,
            exact=self.exact,
            # With a GradScaler (16-mixed), inf gradients are the scaler's to skip, not an error.
            check_finite=getattr(trainer.precision_plugin, "scaler", None) is None,
        )
        splitter = self.splitter

        def guarded_training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            accumulation = trainer.accumulate_grad_batches
            extras: dict[str, Any] = {}

            def forward_backward(micro: Any, share: float) -> torch.Tensor:
                with _logging_muted(pl_module) if checking() else contextlib.nullcontext():
                    output = training_step(micro, *args, **kwargs)
                loss = loss_of(output)
                if isinstance(output, Mapping):
                    extras.clear()
                    extras.update((k, v) for k, v in output.items() if k != "loss")
                # Lightning divides the loss by accumulate_grad_batches before backward.
                weighted = loss * (share / accumulation)
                if scaler is not None:
                    weighted = scaler.scale(weighted)
                weighted.backward()
                return loss.detach()

            # Lightning zeroes gradients *after* training_step and before backward; the
            # batch's gradients wait aside and are added back in on_after_backward.
            params = [p for p in pl_module.parameters() if p.requires_grad]
            earlier = set_aside_gradients(params)
            batch_idx = args[0] if args and isinstance(args[0], int) else kwargs.get("batch_idx")
            if batch_idx is not None and batch_idx % accumulation == 0:
                # Lightning zeroes them before this batch's backward anyway; dropped now,
                # their memory is free for this batch, as in a plain Lightning step.
                earlier = [None] * len(params)
            try:
                seen = len(splitter.events)
                result = splitter.run(batch, forward_backward)
                for event in splitter.events[seen:]:
                    rank_zero_info(event.describe())  # a recovery re-runs the batch: say why it took longer
                if ddp is not None:
                    distributed.average_gradients_(params)
                self._pending = set_aside_gradients(params)
            finally:
                add_gradients(params, earlier)
            # A leaf: Lightning's backward on it reaches no parameter.
            loss = torch.tensor(result.loss, device=pl_module.device, requires_grad=True)
            return {"loss": loss, **extras} if extras else loss

        pl_module.training_step = guarded_training_step

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Undo everything fit start did; safe to call more than once."""
        try:
            self._pending = None
            if self.applied is not None:
                self.applied.undo()
            if "training_step" in vars(pl_module):
                del pl_module.training_step
            ddp = _ddp_model(trainer)
            if ddp is not None and self._ddp_sync is not None:
                ddp.require_backward_grad_sync = self._ddp_sync
            self._ddp_sync = None
            if self._monitoring and self.memory is not None:
                self._monitoring = False
                self.memory.__exit__(None, None, None)
        finally:
            if self._entered and self._device is not None:
                self._entered = False
                self._device.__exit__(None, None, None)
