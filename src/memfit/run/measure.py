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
from dataclasses import asdict, dataclass
from typing import Any

from memfit._html import HtmlRepr
from memfit.memory.devices import Device
from memfit.memory.devices import device as make_device
from memfit.memory.oom import is_oom, release_cached_memory
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
        return data


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
    stats = gpu.memory_stats()
    not_finite = [value for value in losses if not math.isfinite(value)]
    result = Measurement(
        batch_size=batch_size,
        fits=fits,
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
        peak_reserved=int(stats.get("reserved_bytes.all.peak", 0)),
        seconds_per_step=seconds,
        loss=not_finite[0] if not_finite else (losses[-1] if losses else None),
        finite_loss=not not_finite,
    )
    gpu.empty_cache()
    if not_finite:
        warnings.warn(non_finite_loss_message(workload.name, batch_size, not_finite[0]), UserWarning, stacklevel=2)
    return result


def non_finite_loss_message(name: str, batch_size: int, loss: float) -> str:
    """One line for a loss that is NaN or infinite: what it usually means, and what to check.

    Why not "out of memory": a NaN at one batch size is a broken step (a division by a
    count that is zero, log of zero, an fp16 overflow), which no batch size fixes.
    """
    return (
        f"{name}: the loss at batch {batch_size} is {loss} (not finite): the training step is broken, "
        "not short of memory; check the loss (log of 0, division by 0), the inputs and fp16 overflow"
    )
