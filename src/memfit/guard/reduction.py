"""How the micro-batches' losses must be weighted, found on the user's own loss, or a refusal.

A split gives the whole batch's gradient only if each micro-batch's gradient is weighted
as the loss reduces over the batch: by its share of the samples for a mean, by 1 for a
sum (a VAE's ``reduction="sum"``, or a loss already divided by the whole batch's
``num_items_in_batch``), by its share of the valid tokens for a mean over tokens that skips
``ignore_index``. Some losses cannot be split at all: in-batch negatives (contrastive
losses), statistics over the batch (``std()`` normalisation, BatchNorm in training).

Why check instead of reading flags or names: a model whose ``forward`` takes ``**kwargs``
may still ignore ``num_items_in_batch``; a loss named ``mean`` may divide by a fixed
count. So once, before the first split, :func:`find_weighting` runs the user's own
forward and backward on a few real samples of the batch, once together and once per
sample, and keeps the weighting (of those it can name) under which the samples'
gradients add up to the whole's. Gradients are compared on a fixed random subset of each
parameter's coordinates (a few thousand numbers, however large the model). While it
runs, random draws are replaced by constants (dropout keeps everything, ``randn`` gives
0.5), so draws that differ between a batch and its parts do not hide the reduction, and
BatchNorm layers normalize with their running statistics; buffers, generators and
gradients are put back afterwards by the caller.

>>> Weighting("samples").share(None, 2, 8, None)
0.25
>>> Weighting("sum").share(None, 2, 8, None)
1.0
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.guard.batching import BatchDim, tensor_leaves

__all__ = ["Weighting", "unchecked", "candidates", "choose", "coordinates", "deterministic_draws", "statistics_frozen"]

#: a best error under this is float rounding (fp32: about 1e-6)
EXACT = 1e-3
#: under this, a best error far below every other candidate's is accepted (reduced precision)
ROUGH = 2e-2
#: coordinates of each parameter the gradients are compared on
COORDINATES = 2048


@dataclass(frozen=True)
class Weighting:
    """One way to weight a micro-batch's loss: ``samples``, ``sum``, ``weight`` or a token count.

    ``weigh(micro)`` gives the micro-batch's weight (None for ``samples`` and ``sum``).
    """

    name: str
    weigh: Callable[[Any], float] | None = None

    def share(self, micro: Any, count: int, samples: int, total: float | None) -> float:
        """The factor of a micro-batch of ``count`` of ``samples`` (``total``: ``weigh(batch)``)."""
        if self.name == "sum":
            return 1.0
        if count == samples:
            return 1.0
        if self.weigh is None or total is None:
            return count / samples
        return float(self.weigh(micro)) / total

    def total(self, batch: Any) -> float | None:
        return None if self.weigh is None else float(self.weigh(batch))


def unchecked(weight: Callable[[Any], Any] | None) -> Weighting:
    """The weighting used without a check (FSDP2, ``exact=False``): the user's ``weight``, else samples.

    Args:
        weight: the user's ``weight(batch)``, or None.
    """
    if weight is None:
        return Weighting("samples")
    return Weighting("weight", lambda micro: float(weight(micro)))


def _valid(path: str, shift: bool, seq_dim: int) -> Callable[[Any], float]:
    def weigh(batch: Any) -> float:
        tensor = dict(tensor_leaves(batch))[path]
        if shift:
            tensor = tensor.narrow(seq_dim, 1, tensor.shape[seq_dim] - 1)
        return float((tensor != -100).sum())

    return weigh


def candidates(batch: Any, batch_dim: BatchDim, weight: Callable[[Any], Any] | None) -> list[Weighting]:
    """The weightings to try, preferred first: the user's ``weight``, token counts, samples, sum.

    Token counts come from the batch's integer tensors that hold ``-100`` (transformers'
    and PyTorch's ``ignore_index``): their entries other than -100, and the same without
    the first position (labels shifted by one inside the model, as causal LMs do).

    Args:
        batch: the batch about to be split.
        batch_dim: where its samples are (an int for the token counts; else none are tried).
        weight: the user's ``weight(batch)``, if given.
    """
    found: list[Weighting] = []
    if weight is not None:
        found.append(Weighting("weight", lambda micro: float(weight(micro))))
    if isinstance(batch_dim, int) and not isinstance(batch_dim, bool):
        seq_dim = 0 if batch_dim == 1 else 1
        for path, tensor in tensor_leaves(batch):
            if tensor.is_floating_point() or tensor.is_complex() or tensor.dim() <= max(batch_dim, seq_dim):
                continue
            if bool((tensor == -100).any()):
                found.append(Weighting(f"valid tokens of {path}", _valid(path, False, seq_dim)))
                found.append(Weighting(f"valid tokens of {path} after the first", _valid(path, True, seq_dim)))
    found += [Weighting("samples"), Weighting("sum")]
    return found


def coordinates(params: Sequence[nn.Parameter]) -> list[torch.Tensor | None]:
    """A fixed random subset of each parameter's flat indices (None: every index), on its device."""
    generator = torch.Generator().manual_seed(0)  # its own: the user's generators are not touched
    chosen: list[torch.Tensor | None] = []
    for p in params:
        n = p.numel()
        if n <= COORDINATES:
            chosen.append(None)
        else:
            chosen.append(torch.randint(0, n, (COORDINATES,), generator=generator).to(p.device))
    return chosen


def sampled_gradient(params: Sequence[nn.Parameter], chosen: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The gradients now in ``.grad`` at the chosen coordinates, as one float64 CPU vector (0 where None)."""
    parts = []
    for p, index in zip(params, chosen):
        size = p.numel() if index is None else index.numel()
        if p.grad is None:
            parts.append(torch.zeros(size, dtype=torch.float64))
            continue
        flat = p.grad.detach().reshape(-1)
        parts.append((flat if index is None else flat[index]).to("cpu", torch.float64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _error(whole: torch.Tensor, combined: torch.Tensor) -> float:
    scale = float(whole.norm())
    if not math.isfinite(scale) or not bool(torch.isfinite(combined).all()):
        return math.inf
    return float((combined - whole).norm()) / scale if scale > 0 else float(combined.norm())


def choose(
    found: Sequence[Weighting], whole: torch.Tensor, singles: Sequence[torch.Tensor], parts: Sequence[Any]
) -> tuple[Weighting | None, dict[str, float]]:
    """The weighting under which the single samples' gradients add up to the whole's (None: none does).

    Returns it and every candidate's relative error, by name.

    Args:
        found: the candidates, preferred first.
        whole: the sampled gradient of the sub-batch.
        singles: the sampled gradient of each of its samples alone.
        parts: the one-sample micro-batches (for ``weigh``).
    """
    errors: dict[str, float] = {}
    for weighting in found:
        if weighting.name == "sum":
            factors = [1.0] * len(singles)
        elif weighting.weigh is None:
            factors = [1.0 / len(singles)] * len(singles)
        else:
            weights = [float(weighting.weigh(part)) for part in parts]
            total = sum(weights)
            if not total > 0:
                errors[weighting.name] = math.inf
                continue
            factors = [w / total for w in weights]
        combined = sum((f * g for f, g in zip(factors, singles)), torch.zeros_like(whole))
        errors[weighting.name] = _error(whole, combined)
    best = min(errors.values(), default=math.inf)
    if not best <= ROUGH:
        return None, errors
    if best > EXACT and any(best < e < 10 * best for e in errors.values()):
        return None, errors  # rounding this large: another weighting is nearly as good
    for weighting in found:
        if errors[weighting.name] <= max(EXACT, 1.5 * best):
            return weighting, errors
    return None, errors


# -- making the check's passes comparable ------------------------------------------------------

_aten = torch.ops.aten
_KEEP = {_aten.bernoulli, _aten.bernoulli_}  # dropout's masks: keep every element
_FLOATS = {
    _aten.rand,
    _aten.rand_like,
    _aten.randn,
    _aten.randn_like,
    _aten.normal,
    _aten.normal_,
    _aten.uniform_,
    _aten.exponential_,
    _aten.log_normal_,
    _aten.cauchy_,
    _aten.geometric_,
}
_INTEGERS = {_aten.randint, _aten.randint_like, _aten.random_, _aten.multinomial}


class _Constants(TorchDispatchMode):
    """Random draws replaced by constants, so a batch and its parts draw the same per sample."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet is _aten.native_dropout:
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        if packet is _aten.randperm:
            return torch.arange(out.numel(), dtype=out.dtype, device=out.device)
        if packet in _KEEP:
            out.fill_(1)
        elif packet in _FLOATS:
            out.fill_(0.5)
        elif packet in _INTEGERS:
            out.fill_(0)
        return out


@contextlib.contextmanager
def deterministic_draws() -> Iterator[None]:
    """Random draws inside give constants (see :class:`_Constants`)."""
    with _Constants():
        yield


@contextlib.contextmanager
def statistics_frozen(model: nn.Module) -> Iterator[None]:
    """BatchNorm layers normalize with their running statistics while inside, whatever ``train()`` says.

    Why hooks and not ``eval()``: the user's step may call ``model.train()`` itself
    (the transformers Trainer does); a pre-hook sets ``training`` off just before each
    forward and the hook after it puts it back.
    """
    handles = []
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            handles.append(module.register_forward_pre_hook(_off))
            handles.append(module.register_forward_hook(_back))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _off(module: nn.Module, args: Any) -> None:
    module._memfit_training = module.training  # type: ignore[assignment]
    module.training = False


def _back(module: nn.Module, args: Any, output: Any) -> None:
    module.training = bool(module.__dict__.pop("_memfit_training", module.training))
