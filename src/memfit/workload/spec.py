"""Workload: one training step, described so memfit can run it at any batch size.

A workload is four things (and, optionally, which modules FSDP2 shards as units): the model (a module, or a zero-argument factory that builds a
fresh one), ``make_batch(batch_size)`` returning a batch at worst-case shapes (the
longest sequence, the largest image), ``loss(model, batch)`` returning a scalar, and
``optimizer(params)`` (AdamW by default).

A workload *reference* (a zoo name, ``file.py:function``, ``module:function``) is
resolved by :mod:`memfit.workload.references`.

>>> import torch, memfit
>>> wl = memfit.Workload(
...     model=lambda: torch.nn.Linear(8, 2),
...     make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
...     loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
... )
>>> isinstance(wl.build_model(), torch.nn.Module)
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import WorkloadError

__all__ = ["Workload", "default_optimizer", "move_to"]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: the optimizer most training scripts use."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass
class Workload:
    """One training step of a model, at any batch size."""

    model: nn.Module | Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    name: str = "workload"
    #: shapes and other facts for people (sequence length, image size, parameter count)
    info: dict[str, Any] = field(default_factory=dict)
    #: the reference this workload was loaded from (``"gpt2:n_layer=2"``, ``"train.py:make"``),
    #: set by :func:`~memfit.workload.references.load_workload`; None for a Workload made in
    #: code, which no string can load again
    reference: str | None = None
    #: which modules become FSDP2 units under sharding: ``fsdp_units(model)`` (default: the
    #: model's repeated blocks, as activation checkpointing finds them)
    fsdp_units: Callable[[nn.Module], Iterable[nn.Module]] | None = None

    @property
    def builds_fresh_models(self) -> bool:
        """True when ``model`` is a factory: every run gets a new instance."""
        return not isinstance(self.model, nn.Module)

    def batch(self, size: int, device: torch.device | str | None = None) -> Any:
        """A batch of ``size`` samples (``make_batch(size)``), moved to ``device`` when given.

        Args:
            size: samples in the batch.
            device: where its tensors go (``"cuda"``, ``torch.device("cuda", 1)``).
        """
        made = self.make_batch(size)
        return made if device is None else move_to(made, torch.device(device))

    def build_model(self) -> nn.Module:
        """The model to train: a fresh one from a factory, else the given instance."""
        if isinstance(self.model, nn.Module):
            return self.model
        model = self.model()
        if not isinstance(model, nn.Module):
            raise WorkloadError(
                f"workload {self.name!r}: the model factory returned {type(model).__name__}, not an nn.Module"
            )
        if _on_meta(model) and torch.empty(()).device.type != "meta":  # not memfit's own meta build
            raise WorkloadError(
                f"workload {self.name!r}: the model factory built its model on the meta device (no data to "
                "train): build it on the CPU, or call to_empty() and load its weights, before returning it"
            )
        return model


def _on_meta(model: nn.Module) -> bool:
    """True when a parameter or buffer of ``model`` has no data (the meta device)."""
    return any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers()))


def move_to(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; other values stay as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: move_to(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if hasattr(batch, "to") and callable(batch.to):  # transformers' BatchEncoding and friends
        return batch.to(device)
    return batch
