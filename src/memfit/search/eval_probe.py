"""The evaluation step probe searches with ``evaluation=`` (``memfit probe --eval``): the
workload's loss on a batch with the model in eval mode under ``torch.no_grad()`` (or
``torch.inference_mode()``): no gradients, no optimizer state, no activations kept for
backward, so a larger batch fits than in training.

Why the loss: it is the forward the workload already describes, and a validation loop
computes it (the metric's own memory, a few numbers, is not the peak). Why real trials
only: the answer must be exact on a simulated GPU too, and the forward alone is cheap
(fake trials run the training step, :mod:`memfit.search.trials`). A trial runs
:data:`EVAL_STEPS` evaluation batches, so the second meets the cache the first left, as a
validation loop does.

>>> import memfit
>>> m = eval_measure(memfit.load_workload("mlp:layers=1,width=16,features=8"), 4, "sim:64MiB")
>>> m.fits, m.peak_allocated > 0
(True, True)
"""

from __future__ import annotations

import itertools
import time
from typing import Literal

import torch
from torch import nn

from memfit.errors import MemfitError, WorkloadError
from memfit.memory.devices import Device
from memfit.memory.devices import device as make_device
from memfit.memory.oom import is_oom, release_cached_memory
from memfit.run.measure import Measurement, measurement_of
from memfit.run.settings import Settings, autocast
from memfit.search.trials import Say, Trials
from memfit.workload import Workload, move_to

__all__ = ["EVALUATION_MODES", "EvaluationMode", "EVAL_STEPS", "check_evaluation", "eval_measure", "EvalTrials"]

#: how the evaluation runs: ``torch.no_grad()`` (what validation loops use) or ``torch.inference_mode()``
EvaluationMode = Literal["no_grad", "inference_mode"]
EVALUATION_MODES: tuple[EvaluationMode, ...] = ("no_grad", "inference_mode")
#: evaluation batches per trial
EVAL_STEPS = 2


def check_evaluation(evaluation: bool | str, settings: Settings) -> EvaluationMode | None:
    """The evaluation mode asked for (None: probe the training step), checked in one line.

    Args:
        evaluation: False, True (``"no_grad"``), ``"no_grad"`` or ``"inference_mode"``.
        settings: the probe's settings (evaluation is one GPU's: no world size above 1).
    """
    if evaluation is False:
        return None
    mode = "no_grad" if evaluation is True else evaluation
    if mode not in EVALUATION_MODES:
        raise MemfitError(f"invalid evaluation {evaluation!r}: True, or one of {', '.join(EVALUATION_MODES)}")
    if settings.world_size > 1:
        raise MemfitError(
            f"the evaluation batch is one GPU's (no gradients to reduce): drop world size {settings.world_size}"
        )
    return mode


def _on(model: nn.Module, where: torch.device) -> bool:
    index = where.index if where.index is not None else (0 if where.type == "cuda" else None)
    return all(
        t.device.type == where.type and (t.device.index if t.device.index is not None else index) == index
        for t in itertools.chain(model.parameters(), model.buffers())
    )


def _evaluate(workload: Workload, settings: Settings, gpu: Device, mode: EvaluationMode, steps: int) -> list[float]:
    """``steps`` evaluation batches on ``gpu``; the losses (the model left in its mode)."""
    assert settings.micro_batch_size is not None
    model = workload.build_model()
    if not _on(model, gpu.torch_device):
        model.to(gpu.torch_device)
    gpu.adopt(list(model.parameters()) + list(model.buffers()))
    was_training = model.training
    model.eval()
    losses: list[float] = []
    grad_mode = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    try:
        with grad_mode:
            for _ in range(steps):
                batch = move_to(workload.make_batch(settings.micro_batch_size), gpu.torch_device)
                with autocast(settings.precision, gpu.autocast_device_type):
                    loss = workload.loss(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise WorkloadError(f"workload {workload.name!r}: its loss must return one number as a tensor")
                losses.append(float(loss))
                del loss, batch
    finally:
        model.train(was_training)
    return losses


def eval_measure(
    workload: Workload,
    batch_size: int,
    device: Device | str,
    settings: Settings | None = None,
    *,
    mode: EvaluationMode = "no_grad",
    steps: int = EVAL_STEPS,
) -> Measurement:
    """Evaluate ``steps`` batches of ``batch_size`` on ``device``: memory and time.

    An OOM is a result (``fits=False``); every other error propagates unchanged.

    Args:
        workload: the workload (its model, batches and loss).
        batch_size: samples per evaluation batch.
        device: where it runs (see :func:`memfit.device`).
        settings: the precision (autocast); checkpointing and accumulation do not apply.
        mode: ``"no_grad"`` or ``"inference_mode"``.
        steps: evaluation batches (at least 1).
    """
    gpu = make_device(device) if isinstance(device, str) else device
    settings = (settings or Settings()).replace(micro_batch_size=batch_size)
    if not gpu.supports(settings.precision):
        raise MemfitError(f"{gpu.describe()} does not support {settings.precision}")
    gpu.empty_cache()
    gpu.reset_peak_memory_stats()
    fits, losses, seconds = True, [], None
    try:
        with gpu:
            gpu.synchronize()
            started = time.perf_counter()
            losses = _evaluate(workload, settings, gpu, mode, steps)
            gpu.synchronize()
            seconds = (time.perf_counter() - started) / steps
    except Exception as error:
        if not is_oom(error):
            raise
        fits = False
    if not fits:
        release_cached_memory()  # outside the except block, so the failed batch can be freed
    result = measurement_of(gpu, batch_size, fits, seconds, losses)
    gpu.empty_cache()
    return result


class EvalTrials(Trials):
    """Probe's trials for the evaluation batch: each one :func:`eval_measure`, on the device."""

    def __init__(
        self, workload: Workload, device: Device, settings: Settings, mode: EvaluationMode, say: Say | None = None
    ) -> None:
        super().__init__(workload, device, settings, steps=EVAL_STEPS, fake=False, say=say)
        self.mode = mode

    def real(self, batch_size: int, settings: Settings | None = None) -> Measurement:
        return eval_measure(
            self.workload, batch_size, self.device, settings or self.settings, mode=self.mode, steps=self.steps
        )
