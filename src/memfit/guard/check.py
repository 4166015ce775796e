"""The check before the first split: does the user's loss split exactly, and with which weights?

Run once per splitter, when a batch first has to be split (after its OOM, before any
micro-batch runs): the user's own forward and backward on up to :data:`CHECK_SAMPLES` real
samples of that batch, once together and once per sample (see
:mod:`memfit.guard.reduction`). It returns the weighting the guard then uses, or refuses
with :class:`~memfit.guard.errors.SplitRefusedError` in one line: why the split would change
the gradient and what to do. Everything the check touches (gradients, buffers, generators)
is as it was before it, whatever happens.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit import distributed
from memfit.guard.batching import BatchDim, along_several_dims
from memfit.guard.errors import GuardError, SplitRefusedError
from memfit.guard.gradients import drop_gradients
from memfit.guard.reduction import (
    Weighting,
    candidates,
    choose,
    coordinates,
    deterministic_draws,
    sampled_gradient,
    statistics_frozen,
    unchecked,
)
from memfit.guard.snapshot import BufferSnapshots, RngState
from memfit.memory.oom import is_oom

__all__ = ["CHECK_SAMPLES", "SplitCheck", "check_split", "checking"]

_state = threading.local()


def checking() -> bool:
    """True while the check's passes run (in this thread): a loss can skip its logging then.

    >>> checking()
    False
    """
    return bool(getattr(_state, "active", False))


#: samples of the batch the check runs on (fewer when they run out of memory)
CHECK_SAMPLES = 8

#: ``pieces(m)``: the first ``m`` samples of the batch, and each of them alone
Pieces = Callable[[int], tuple[Any, Sequence[Any]]]
#: ``run(micro, count)``: forward and backward of a micro-batch of ``count`` samples, weight 1
RunPiece = Callable[[Any, int], Any]


@dataclass(frozen=True)
class SplitCheck:
    """What the check needs of the splitter: the model, the batch, and how to run parts of it."""

    model: nn.Module
    params: Sequence[nn.Parameter]
    batch: Any
    samples: int
    batch_dim: BatchDim
    weight: Callable[[Any], Any] | None
    exact: bool
    pieces: Pieces
    run: RunPiece
    buffers: BufferSnapshots
    release: Callable[[], None]
    #: ``one_does_not_fit(error)``: the splitter's error for an OOM on one sample (its memory breakdown)
    one_does_not_fit: Callable[[BaseException], GuardError]


def _batchnorm_in_training(model: nn.Module) -> list[str]:
    return [
        f"{type(m).__name__} {name!r}"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def check_split(check: SplitCheck) -> Weighting:
    """The weighting under which the split gradient is the whole batch's; refuses when there is none.

    With ``exact=False`` a loss that does not split exactly is split anyway, weighted by
    ``weight`` (or by samples), after a warning that says why it differs.

    Args:
        check: the model, the batch and the splitter's pieces (see :class:`SplitCheck`).
    """
    norms = _batchnorm_in_training(check.model)
    refusal = None
    if norms and check.exact:
        refusal = (
            f"{norms[0]} in training mode normalizes each micro-batch with its own statistics, so a split "
            "changes the gradient; use GroupNorm (SyncBatchNorm across ranks), a smaller batch, or "
            "Guard(..., exact=False) to split anyway"
        )
        weighting = None
    elif check.samples < 2:  # this rank runs its one sample whole; it only takes part in the agreement
        weighting = unchecked(check.weight)
    else:
        if norms:
            warnings.warn(
                f"memfit guard: splitting the batch of a model with BatchNorm layers in training mode ({norms[0]}); "
                "each micro-batch is normalized with its own statistics, so the update differs from the whole "
                "batch's. Use GroupNorm (or SyncBatchNorm) for an exact split.",
                UserWarning,
                stacklevel=5,
            )
        weighting, refusal = _measure_weighting(check)
    refused_anywhere = distributed.any_rank(refusal is not None) if distributed.is_distributed() else refusal
    if not refused_anywhere:
        assert weighting is not None
        return weighting
    if refusal is None:
        refusal = "another rank's check found that the loss does not split exactly; see that rank's error"
    if not check.exact:
        warnings.warn(f"memfit guard: splitting although {refusal}", UserWarning, stacklevel=5)
        return unchecked(check.weight)
    raise SplitRefusedError(
        f"memfit guard: out of memory on a batch of {check.samples} samples, and splitting it would change "
        f"the gradient: {refusal}"
    )


def _measure_weighting(check: SplitCheck) -> tuple[Weighting | None, str | None]:
    """Run the passes (halving the samples on an OOM) and choose; (weighting, None) or (None, why not)."""
    m = min(check.samples, CHECK_SAMPLES)
    while True:
        failed = False
        try:
            measured = _passes(check, m)
        except BaseException as error:
            if not is_oom(error):
                raise
            failed = True  # leave the except block: the traceback holds the passes' tensors
        if not failed:
            break
        check.release()
        m //= 2
        if m < 2:
            _one_sample(check)
            return None, (
                "two samples do not fit together, so how the loss splits cannot be checked (it needs "
                "two samples at once), and only one-sample micro-batches would run; free memory instead "
                "(bf16, activation checkpointing, a smaller model)"
            )
    _, singles, whole, grads = measured
    found = candidates(check.batch, check.batch_dim, check.weight)
    weighting, errors = choose(found, whole, grads, singles)
    if weighting is not None:
        return weighting, None
    tried = ", ".join(f"{name} {_percent(error)}" for name, error in errors.items())
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        why = "the gradient of a single sample is not finite (NaN or inf): the loss needs several samples"
    else:
        why = f"the samples' gradients do not add up to the whole's under any weighting (differences: {tried})"
    return None, (
        f"on {m} of its samples {why}; the loss couples the samples of a batch (in-batch negatives, "
        "statistics over the batch such as std()): make it per-sample, pass weight= if it is normalized by "
        "something else, or free memory instead (bf16, activation checkpointing, a smaller batch)"
    )


def _one_sample(check: SplitCheck) -> None:
    """Raise the splitter's one-sample error when one sample alone runs out of memory."""
    saved, rng = check.buffers.take(), RngState()
    failure: GuardError | None = None
    try:
        check.run(check.pieces(1)[1][0], 1)
    except BaseException as error:
        if not is_oom(error):
            raise
        failure = check.one_does_not_fit(error)  # read now: the memory at the OOM
    finally:
        drop_gradients(check.params)
        check.buffers.restore(saved)
        rng.restore()
    if failure is not None:
        check.release()
        raise failure


def _percent(error: float) -> str:
    return "not finite" if error == float("inf") else f"{error:.2%}"


def _passes(check: SplitCheck, m: int) -> tuple[Any, Sequence[Any], torch.Tensor, list[torch.Tensor]]:
    """Forward and backward of the first ``m`` samples together and one by one; every state put back."""
    saved, rng = check.buffers.take(), RngState()
    chosen = coordinates(check.params)
    sub, singles = check.pieces(m)
    _state.active = True
    try:
        with statistics_frozen(check.model), deterministic_draws():
            _run_or_name(check, sub, m)
            whole = sampled_gradient(check.params, chosen)
            drop_gradients(check.params)
            grads = []
            for single in singles:
                _run_or_name(check, single, 1)
                grads.append(sampled_gradient(check.params, chosen))
                drop_gradients(check.params)
    finally:
        _state.active = False
        drop_gradients(check.params)
        check.buffers.restore(saved)
        rng.restore()
    return sub, singles, whole, grads


def _run_or_name(check: SplitCheck, micro: Any, count: int) -> None:
    """One pass; an error on a part of a batch that carries its samples along several dimensions is named."""
    try:
        check.run(micro, count)
    except Exception as error:
        if is_oom(error):
            raise
        several = along_several_dims(check.batch, check.samples, check.batch_dim)
        if not several:
            raise
        raise SplitRefusedError(
            f"memfit guard: out of memory on a batch of {check.samples} samples, and it cannot be split: "
            f"{', '.join(several)} carries the sample count along more than one dimension, and the loss fails "
            f"on {count} of its samples ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "pass split= to split it yourself, or free memory instead (bf16, activation checkpointing)"
        ) from error
