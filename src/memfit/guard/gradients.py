"""Gradients and optimizer state as the guard (and the integrations) handle them.

An OOM must discard only the failed batch's partial gradients: the gradients held before
the batch are set aside (``.grad`` becomes None), the batch runs, and they are added
back afterwards. The Lightning and transformers integrations use the same two helpers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = [
    "set_aside_gradients",
    "add_gradients",
    "drop_gradients",
    "merge_gradients",
    "restore_gradients",
    "tensor_bytes",
    "optimizer_state_tensors",
    "expected_optimizer_state_bytes",
    "reset_scaler_step_state",
]


def set_aside_gradients(params: Sequence[nn.Parameter]) -> list[torch.Tensor | None] | None:
    """Take the gradients out (``.grad`` becomes None) and return them (None when there were none).

    Why: an OOM must discard only this batch's partial gradients. With the old ones set
    aside, "discard" is "set to None", and they are added back after a successful batch.
    The Lightning integration uses it to keep the guard's gradient out of Lightning's
    ``zero_grad``.
    """
    if all(p.grad is None for p in params):
        return None
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    return kept


def drop_gradients(params: Sequence[nn.Parameter]) -> None:
    """Forget this batch's partial gradients (their memory goes back at once)."""
    for p in params:
        p.grad = None


def add_gradients(params: Sequence[nn.Parameter], gradients: Sequence[torch.Tensor | None] | None) -> None:
    """Add gradients set aside (by :func:`set_aside_gradients`) back onto ``.grad``,
    adopting them where ``.grad`` is None. The integrations use it too."""
    if gradients is None:
        return
    for p, old in zip(params, gradients):
        if old is None:
            continue
        if p.grad is None:
            p.grad = old
        else:
            p.grad.add_(old)


def merge_gradients(params: Sequence[nn.Parameter], gradients: Sequence[torch.Tensor | None] | None) -> None:
    """Add gradients set aside onto ``.grad`` without changing them (a copy where ``.grad`` is None).

    Why not :func:`add_gradients`: the guard keeps the set-aside tensors until the optimizer
    step is done, to give them back unchanged if it fails; clipping and unscaling work in
    place on ``.grad``, so ``.grad`` must never be one of them.
    """
    if gradients is None:
        return
    for p, old in zip(params, gradients):
        if old is None:
            continue
        if p.grad is None:
            p.grad = old.clone()
        else:
            p.grad.add_(old)


def restore_gradients(params: Sequence[nn.Parameter], gradients: Sequence[torch.Tensor | None] | None) -> None:
    """Make ``.grad`` exactly the gradients set aside (by :func:`set_aside_gradients`), dropping the rest."""
    for index, p in enumerate(params):
        p.grad = None if gradients is None else gradients[index]


def tensor_bytes(tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield value


#: tensors of optimizer state per parameter, for the common optimizers
_STATES_PER_PARAMETER = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "Adadelta": 2,
}


def expected_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int | None:
    """The optimizer state a full step needs, before the first step has made it.

    Why: an OOM in the very first ``optimizer.step()`` is the optimizer allocating its
    state; the error should say how much that state is. Known for torch's optimizers
    (AdamW: two tensors per parameter; SGD: one with momentum, none without); None else.
    """
    name = type(optimizer).__name__
    per: int | None
    if name == "SGD":
        per = 1 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    else:
        per = _STATES_PER_PARAMETER.get(name)
    if per is None:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return per * tensor_bytes(params)


def reset_scaler_step_state(scaler: torch.amp.GradScaler) -> None:
    """Forget what the GradScaler recorded for this step (unscaled? inf found?).

    Why: those records describe gradients the guard just threw away; the step that
    follows must start as if nothing had been unscaled. ``update()`` does the same reset.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None:
        states.clear()
