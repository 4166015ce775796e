"""CPU offload as a plan's last axis: when nothing fits on the GPU alone, the same
candidates with ``shard="offload"`` (FSDP2 with CPUOffloadPolicy: parameters, gradients
and optimizer state on the host, the optimizer step on the CPU).

On a simulated GPU an offload candidate cannot run for real (the host's tensors and the
simulated GPU's are the same CPU memory: :func:`memfit.run.parallel.check_offload_device`),
so its trial is the estimator's (:mod:`memfit.estimator.offload`: the step traced on fake
tensors, each allocation placed where CPUOffloadPolicy keeps it), which also predicts its
step on the card with the host copies and the CPU's optimizer step. On a real GPU the
trials run for real, as every other candidate's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.memory.devices import Device, SimDevice
from memfit.memory.gpus import GPU
from memfit.run.measure import Measurement
from memfit.run.settings import Settings
from memfit.run.strategy import OFFLOAD_SHARDS, Shard
from memfit.units import format_size
from memfit.workload import Workload

__all__ = ["OffloadTrials", "offload_axis", "needs_estimated_trials", "allocator_advice"]


def offload_axis() -> tuple[tuple[Shard, int | None], ...]:
    """The strategies of the fallback: FSDP2 with CPUOffloadPolicy over the plan's ranks."""
    return tuple((shard, None) for shard in OFFLOAD_SHARDS)


def needs_estimated_trials(device: Device) -> bool:
    """True where an offload candidate's trial is the estimator's (a simulated GPU)."""
    return isinstance(device, SimDevice)


@dataclass
class OffloadTrials:
    """Offload candidates' trials by the estimator, keeping what each found (its predicted
    step on the simulated GPU's card, its host memory) for the plan's ranking and advice.

    Why the predicted step is not computed by every trial: it is a fake step of its own
    (the unsharded step with its operations counted), as long as the memory's; a trial
    that does not fit needs none, and a fitting one with accumulation needs the step of
    its accumulation, not of one micro-batch. Only the first trial of each precision
    predicts it (for the host parameter bytes the copies move); :meth:`predict` gives
    each fitting candidate the same figure the estimator would
    (:func:`memfit.estimator.offload.offload_step_time` with those bytes).
    """

    #: settings -> (seconds per step, samples/s) predicted on ``card``
    speeds: dict[Settings, tuple[float, float]] = field(default_factory=dict)
    #: settings -> the most host memory its step holds
    host: dict[Settings, int] = field(default_factory=dict)
    #: precision -> the parameter bytes the host keeps (what the copies move)
    parameter_bytes: dict[str, int] = field(default_factory=dict)
    #: settings -> its peak reserved under each allocator setting compared
    reserved_by_setting: dict[Settings, dict[str, int | None]] = field(default_factory=dict)
    card: GPU | None = None

    def trial(self, workload: Workload, settings: Settings, device: Device) -> Measurement:
        """The candidate's memory on ``device`` (fake tensors, offload placed), as a trial reports it.

        Args:
            workload: the plan's workload.
            settings: an offload candidate (its micro-batch; accumulation 1, as trials run).
            device: the simulated GPU.
        """
        from memfit.estimator.estimate import estimate

        assert settings.micro_batch_size is not None
        one = settings.replace(accumulation_steps=1)
        # The predicted step (a fake step of its own) only until the precision's host parameter
        # bytes are known: :meth:`predict` computes a fitting candidate's from them, for its own
        # accumulation, and a candidate that does not fit needs none.
        speed = settings.precision not in self.parameter_bytes
        est = estimate(workload, settings.micro_batch_size, one, device=device, search=False, speed=speed)
        if est.host_memory is not None:
            self.host[settings] = est.host_memory
        self.reserved_by_setting[one] = dict(est.reserved_by_setting)
        if est.predicted_time is not None and "host_parameter_bytes" in est.predicted_time:
            self.parameter_bytes[settings.precision] = int(est.predicted_time["host_parameter_bytes"])
            if self.card is not None and est.speed_gpu == self.card.name:
                assert est.predicted_seconds_per_step is not None and est.predicted_samples_per_second is not None
                self.speeds[one] = (est.predicted_seconds_per_step, est.predicted_samples_per_second)
        return Measurement(
            batch_size=settings.micro_batch_size,
            fits=bool(est.fits),
            peak_allocated=est.peak_allocated,
            peak_reserved=est.peak_reserved,
            seconds_per_step=None,
            fake=True,
        )

    def predict(self, workload: Workload, settings: Settings, card: GPU) -> tuple[float, float]:
        """(seconds per step, samples/s) of an offload candidate on ``card``, with the host
        copies and the CPU's optimizer step (:func:`memfit.estimator.offload.offload_step_time`)."""
        from memfit.errors import MemfitError
        from memfit.estimator.offload import offload_step_time

        known = self.speeds.get(settings) if settings.accumulation_steps == 1 else None
        if known is not None and card is self.card:
            return known
        held = self.parameter_bytes.get(settings.precision)
        if held is None:
            raise MemfitError(f"no predicted step under CPU offload on {card.name}: its trial predicted none")
        step, _, _ = offload_step_time(workload, settings, card, held)
        return step.seconds_per_step, step.samples_per_second

    def advice(self, settings: Settings) -> list[str]:
        """What the recommended offload candidate asks of the host (empty for other candidates)."""
        if settings.shard not in OFFLOAD_SHARDS:
            return []
        held = max((v for s, v in self.host.items() if s.precision == settings.precision), default=None)
        if held is None:
            return []
        return [
            f"CPU offload keeps about {format_size(held)} in host memory per rank (parameters, gradients and "
            "optimizer state, the optimizer step on the CPU): the training machine needs that much free RAM"
        ]


def allocator_advice(by_setting: dict[str, int | None], current: str) -> list[str]:
    """One line recommending the allocator setting that reserves least for the recommended
    settings, with its predicted saving (empty when the current one is already the least).

    Args:
        by_setting: peak reserved bytes under each allocator setting (None: does not fit).
        current: the setting the plan ran with (``AllocatorConfig.describe()``).
    """
    ran = by_setting.get(current)
    fitting = {name: reserved for name, reserved in by_setting.items() if reserved is not None}
    if ran is None or not fitting:
        return []
    best, reserved = min(fitting.items(), key=lambda item: item[1])
    if reserved >= ran or best == current:
        return []
    value = "" if best == "torch's defaults" else best
    fix = f"export PYTORCH_CUDA_ALLOC_CONF={value}" if value else "unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF"
    return [
        f"allocator: {best} would reserve {format_size(reserved)} at the peak instead of {format_size(ran)} "
        f"(saves {format_size(ran - reserved)}): {fix}"
    ]
