"""Measure one batch size: does it fit, how much memory, how fast.

This is the unit every search in memfit is made of (probe's trials, plan's checks): run
``steps`` optimizer steps at one batch size from a clean peak, and report the peak
allocated and reserved memory and the time of the last step. An OOM is a result
(``fits=False``), not an error; every other exception propagates unchanged.

>>> import memfit
>>> m = memfit.measure("mlp:layers=2,width=64", batch_size=8, device="sim:1GiB")
>>> m.fits, m.peak_reserved > 0
(True, True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memfit._html import HtmlRepr
from memfit.memory.devices import Device
from memfit.memory.devices import device as make_device
from memfit.memory.oom import is_oom, release_cached_memory
from memfit.run.settings import Settings
from memfit.run.steps import run_steps
from memfit.workload import Workload, load_workload

__all__ = ["measure", "Measurement"]


@dataclass(frozen=True)
class Measurement(HtmlRepr):
    """One batch size's result. Bytes are ints; ``seconds_per_step`` is None on an OOM."""

    batch_size: int
    fits: bool
    peak_allocated: int
    peak_reserved: int
    seconds_per_step: float | None

    @property
    def samples_per_second(self) -> float | None:
        if not self.seconds_per_step:
            return None
        return self.batch_size / self.seconds_per_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    try:
        run = run_steps(workload, settings, gpu, steps=steps)
        seconds = run.step_seconds[-1]
    except Exception as error:
        if not is_oom(error):
            raise
        fits = False
    if not fits:
        # Outside the except block, so the failed step's tensors can be freed.
        release_cached_memory()
    stats = gpu.memory_stats()
    result = Measurement(
        batch_size=batch_size,
        fits=fits,
        peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)),
        peak_reserved=int(stats.get("reserved_bytes.all.peak", 0)),
        seconds_per_step=seconds,
    )
    gpu.empty_cache()
    return result
