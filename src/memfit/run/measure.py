"""Measure one batch size: does it fit, how much memory, how fast.

This is the unit every search in memfit is made of (probe's trials, plan's checks): run
``steps`` optimizer steps at one batch size from a clean peak, and report the peak
allocated and reserved memory and the time of the last step. An OOM is a result
(``fits=False``), not an error; every other exception propagates unchanged. A loss that
is NaN or infinite is a warning here (``finite_loss=False``, ``loss`` holds the value):
the step ran, but what it trains is broken; probe and plan refuse such a trial.

>>> import memfit
>>> m = memfit.measure("mlp:layers=2,width=64", batch_size=8, device="sim:1GiB")
>>> m.fits, m.peak_reserved > 0
(True, True)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

from memfit._html import HtmlRepr
from memfit.errors import MemfitError
from memfit.memory.devices import Device
from memfit.memory.devices import device as make_device
from memfit.memory.oom import is_oom, release_cached_memory
from memfit.run.retained import Resident, resident, retained_message
from memfit.run.settings import Settings
from memfit.run.steps import run_steps
from memfit.workload import Workload, load_workload

__all__ = ["measure", "Measurement", "non_finite_loss_message"]


@dataclass(frozen=True)
class Measurement(HtmlRepr):
    """One batch size's result. Bytes are ints; ``seconds_per_step`` is None on an OOM.

    ``loss`` is the last step's loss, or the first that was not finite (None on an OOM);
    ``finite_loss`` is False when some step's loss was NaN or infinite.
    ``fake`` marks a trial run on fake tensors (:mod:`memfit.search.trials`): the allocator
    model's fits and peaks, and no time.
    """

    batch_size: int
    fits: bool
    peak_allocated: int
    peak_reserved: int
    seconds_per_step: float | None
    loss: float | None = None
    finite_loss: bool = True
    fake: bool = False
    #: device memory the run left allocated beyond what the workload's model instance and
    #: optimizer state keep (0: the device is back where it started)
    retained: int = 0
    #: None, or one line naming what holds ``retained`` (see :mod:`memfit.run.retained`)
    retained_by: str | None = None

    @property
    def samples_per_second(self) -> float | None:
        if not self.seconds_per_step:
            return None
        return self.batch_size / self.seconds_per_step

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``fake`` only when set (``memfit measure`` always runs the real step)."""
        data = asdict(self)
        if not self.fake:
            del data["fake"]
        if not self.retained:
            del data["retained"], data["retained_by"]
        return data

    def refuse_if_retained(self) -> None:
        """Raise the one-line :class:`MemfitError` when the run left memory behind: a search's
        later trials would see a smaller device (probe and plan call this after each real run)."""
        if self.retained and self.retained_by:
            raise MemfitError(self.retained_by)


def measure(
    workload: Workload | str,
    batch_size: int,
    device: Device | str = "auto",
    settings: Settings | None = None,
    *,
    steps: int = 2,
) -> Measurement:
    """Run ``steps`` optimizer steps at ``batch_size`` and report memory and time.

    An OOM is a result (``fits=False``); every other error propagates unchanged.

    Args:
        workload: a :class:`memfit.Workload` or a reference, resolved once here.
        batch_size: the micro-batch: the samples of one forward/backward pass.
        device: where to run (see :func:`memfit.device`).
        settings: precision, checkpointing and accumulation.
        steps: optimizer steps to run (the second one has the optimizer state alive).
    """
    workload = load_workload(workload)
    gpu = make_device(device)
    settings = (settings or Settings()).replace(micro_batch_size=batch_size)
    gpu.empty_cache()
    gpu.reset_peak_memory_stats()
    start = gpu.memory_allocated(), resident(workload, gpu)
    fits = True
    seconds = None
    losses: list[float] = []
    try:
        run = run_steps(workload, settings, gpu, steps=steps)
        seconds = run.step_seconds[-1]
        losses = run.losses
    except Exception as error:
        if not is_oom(error):
            raise
        fits = False
    if not fits:
        # Outside the except block, so the failed step's tensors can be freed.
        release_cached_memory()
    result = measurement_of(gpu, batch_size, fits, seconds, losses)
    gpu.empty_cache()
    not_finite = [value for value in losses if not math.isfinite(value)]
    result = _with_retained(result, workload, gpu, start)
    if result.retained_by:
        warnings.warn(result.retained_by, UserWarning, stacklevel=2)
    if not_finite:
        warnings.warn(non_finite_loss_message(workload.name, batch_size, not_finite[0]), UserWarning, stacklevel=2)
    return result


def measurement_of(gpu: Device, batch_size: int, fits: bool, seconds: float | None, losses: list[float]) -> Measurement:
    """The :class:`Measurement` of steps just run on ``gpu``: its peaks since the last reset, and the losses.

    Args:
        gpu: the device the steps ran on (its peak statistics were reset before them).
        batch_size: the micro-batch the steps ran.
        fits: False when the steps ran out of memory.
        seconds: the time of one step, or None when none completed.
        losses: the losses of the steps that completed; the first non-finite one is reported.
    """
    stats = gpu.memory_stats()
    not_finite = [value for value in losses if not math.isfinite(value)]
    return Measurement(
        batch_size=batch_size,
        fits=fits,
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
        peak_reserved=int(stats.get("reserved_bytes.all.peak", 0)),
        seconds_per_step=seconds,
        loss=not_finite[0] if not_finite else (losses[-1] if losses else None),
        finite_loss=not not_finite,
    )


def _with_retained(result: Measurement, workload: Workload, gpu: Device, start: tuple[int, Resident]) -> Measurement:
    """The measurement, with the memory the run left on the device and what holds it.

    Why "beyond the model instance and optimizer state": a script's own model and
    optimizer stay on the device between runs by design (the first run may put them
    there); anything else still allocated after the run was kept by the workload (or by
    an exception still alive), and every later run would see a smaller device.
    """
    allocated, before = start
    if gpu.memory_allocated() <= allocated:
        return result
    release_cached_memory()  # reference cycles (a model holding itself) are freed by a collection
    after = resident(workload, gpu)
    retained = gpu.memory_allocated() - allocated - max(0, after.kept - before.kept)
    if retained <= 0:
        return result
    message = retained_message(workload.name, result.batch_size, retained, before, after)
    return replace(result, retained=retained, retained_by=message)


def non_finite_loss_message(name: str, batch_size: int, loss: float) -> str:
    """One line for a loss that is NaN or infinite: what it usually means, and what to check.

    Why not "out of memory": a NaN at one batch size is a broken step (a division by a
    count that is zero, log of zero, an fp16 overflow), which no batch size fixes.
    """
    return (
        f"{name}: the loss at batch {batch_size} is {loss} (not finite): the training step is broken, "
        "not short of memory; check the loss (log of 0, division by 0), the inputs and fp16 overflow"
    )
