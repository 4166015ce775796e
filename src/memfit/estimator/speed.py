"""The predicted speed of a workload's training step on a GPU of the table, without the GPU.

One fake step (:mod:`memfit.estimator.fake`, shapes only) records the operations of a
micro-batch and of the optimizer, with the card's CUDA semantics (:mod:`memfit.cuda`: the
attention kernel CUDA picks on it, fused dropout, cuDNN RNNs);
:func:`memfit.estimator.timing.predict` times them on the card. Accumulation reuses the one recorded micro-batch, so a candidate of plan with 64
micro-batches per step costs one fake micro-batch, not 64.

>>> import memfit
>>> time = step_time("mlp:layers=1,width=16,features=16", memfit.Settings(micro_batch_size=8), "RTX 4090")
>>> time.gpu, time.samples_per_second > 0
('RTX 4090', True)
"""

from __future__ import annotations

from memfit.cuda.target import CudaTarget
from memfit.errors import MemfitError
from memfit.estimator.fake import run_fake_steps
from memfit.estimator.kernel_rates import RATES, Rates
from memfit.estimator.timing import OpTrace, StepTime, predict
from memfit.memory.gpus import GPU, lookup
from memfit.run.settings import Settings
from memfit.workload import Workload, load_workload

__all__ = ["step_time", "record_step", "DEFAULT_SPEED_GPU", "speed_gpu", "speed_card", "no_speed_reason"]

#: the card whose speed ranks plan's candidates on a simulated GPU that names none
#: (``sim:8GiB``): the A100 80GB SXM, the card most published training figures use.
DEFAULT_SPEED_GPU = "A100 80GB SXM"


def speed_gpu(gpu: str | GPU | None) -> GPU:
    """The card ``gpu`` names, or :data:`DEFAULT_SPEED_GPU`."""
    if isinstance(gpu, GPU):
        return gpu
    return lookup(gpu or DEFAULT_SPEED_GPU)


def speed_card(card: GPU | None, settings: Settings) -> GPU | None:
    """The card whose step time an estimate on ``card`` predicts: ``card``, when it can.

    None without a card (``memory=``), for a card without peaks, over several ranks
    (communication is not modelled), or for bf16 on a card without it
    (:func:`no_speed_reason` says which).
    """
    if card is None or not card.has_peaks or settings.world_size > 1:
        return None
    if settings.precision == "bf16" and not card.bf16:
        return None
    return card


def no_speed_reason(card: GPU | None, settings: Settings) -> str:
    """Why :func:`speed_card` gave none although there is a card ("" when there is none:
    then there is nothing to predict for)."""
    if card is None:
        return ""
    if not card.has_peaks:
        why = (
            "no fp32= and bandwidth= were given"
            if card.memory_source == "custom"
            else "the table has none: a laptop part's clocks depend on the laptop's power limit"
        )
        return (
            f"no peak throughput and bandwidth for the {card.name} ({why}); give them with "
            "--gpu custom:memory=..,cc=..,fp32=..,bandwidth=.."
        )
    if settings.world_size > 1:
        return (
            f"no step time for {settings.world_size} ranks: communication is not modelled, "
            "so one rank's would be too fast"
        )
    if settings.precision == "bf16" and not card.bf16:
        return f"the {card.name} has no bf16"
    return ""


def record_step(
    workload: Workload, settings: Settings, *, foreach: bool = True, gpu: str | GPU | None = None
) -> OpTrace:
    """The operations of one micro-batch and one optimizer step of ``workload``, as CUDA runs
    them on ``gpu``.

    Args:
        workload: the workload.
        settings: its settings (the micro-batch is recorded once, whatever the accumulation).
        foreach: give optimizers CUDA's default implementation (what a GPU runs).
        gpu: the card whose CUDA semantics the step follows (its compute capability decides
            the attention kernel); default :data:`DEFAULT_SPEED_GPU`.
    """
    card = speed_gpu(gpu)
    run = run_fake_steps(
        workload,
        settings.replace(accumulation_steps=1),
        foreach=foreach,
        cuda=CudaTarget(card.compute_capability, name=card.name),
        count_ops=True,
    )
    assert run.ops is not None  # no budget: the run always completes
    return run.ops


def step_time(
    workload: Workload | str,
    settings: Settings,
    gpu: str | GPU | None = None,
    *,
    foreach: bool = True,
    tf32_matmul: bool | None = None,
    tf32_conv: bool | None = None,
    trace: OpTrace | None = None,
    rates: Rates = RATES,
    per_thread: int | None = None,
) -> StepTime:
    """Predicted seconds per step and samples/s of ``workload`` at ``settings`` on ``gpu``.

    Args:
        workload: a :class:`memfit.Workload` or a reference.
        settings: precision, checkpointing, micro-batch and accumulation (the micro-batch
            is required).
        gpu: a card of the table (default: :data:`DEFAULT_SPEED_GPU`).
        foreach: optimizers take CUDA's default (foreach) implementation.
        tf32_matmul: fp32 matmuls on tf32 (default: this process's PyTorch setting).
        tf32_conv: fp32 convolutions on tf32 (default: this process's PyTorch setting).
        trace: a step already recorded at these settings' micro-batch (skips the fake step).
        rates: the efficiency of each kernel class (default: memfit's sourced and
            calibrated ones; the calibration of ``bench/predicted_speed.py`` varies them).
        per_thread: elements each thread of PyTorch's streaming kernels loads (default: the
            installed torch's; ``bench/predicted_speed.py`` gives the published rows' own).

    Raises:
        MemfitError: no micro-batch, a card without peaks (a laptop part), or a precision
            the card does not have.
    """
    if settings.micro_batch_size is None:
        raise MemfitError("a predicted step time needs a micro-batch size")
    card = speed_gpu(gpu)
    if not card.has_peaks:
        raise MemfitError(
            f"no step time for the {card.name}: its peak throughput and bandwidth are not in the table; "
            "give a card that has them (or custom:memory=..,cc=..,fp32=..,bandwidth=..)"
        )
    if settings.precision == "bf16" and not card.bf16:
        raise MemfitError(f"{card.name} does not support bf16: use fp16 or fp32")
    if trace is None:
        trace = record_step(load_workload(workload), settings, foreach=foreach, gpu=card)
    assert settings.batch_size is not None
    return predict(
        trace,
        card,
        settings.batch_size,
        accumulation=settings.accumulation_steps,
        tf32_matmul=tf32_matmul,
        tf32_conv=tf32_conv,
        rates=rates,
        per_thread=per_thread,
    )
