"""Workload: one training step, described so memfit can run it at any batch size.

A workload is four things (and, optionally, which modules FSDP2 shards as units): the model (a module, or a zero-argument factory that builds a
fresh one), ``make_batch(batch_size)`` returning a batch at worst-case shapes (the
longest sequence, the largest image), ``loss(model, batch)`` returning a scalar, and
``optimizer(params)`` or ``optimizer(model)`` (AdamW by default).

Which one the optimizer factory receives is read from its signature, once, by
:func:`optimizer_takes_model`: the model when its first parameter is annotated as an
``nn.Module`` (or a subclass) or is named ``model`` or ``module``; otherwise the model's
parameters (``model.parameters()``, as ``torch.optim`` optimizers take them). The model
form is for code whose optimizer needs the modules themselves (minGPT's
``configure_optimizers`` sorts weights into decay / no-decay groups by module type):
``optimizer=lambda model: model.configure_optimizers(train_config)``.

Given the training data, make ``make_batch`` with :func:`memfit.workload.worst_case_batches`
(``make_batch=worst_case_batches(loader)``): the dataset's largest samples, collated as the
DataLoader collates them, found without loading the data; probe then names the sample that
sets the limit.

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

import contextlib
import inspect
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from memfit.errors import WorkloadError

__all__ = ["Workload", "default_optimizer", "move_to", "optimizer_takes_model", "needs_closure", "MODEL_ARGUMENT_NAMES"]

#: a factory whose first parameter has one of these names receives the model itself
MODEL_ARGUMENT_NAMES = ("model", "module")


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: the optimizer most training scripts use."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass
class Workload:
    """One training step of a model, at any batch size."""

    model: nn.Module | Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    #: ``optimizer(params)`` or ``optimizer(model)``: see :func:`optimizer_takes_model`
    optimizer: Callable[[Any], torch.optim.Optimizer] = default_optimizer
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

    def make_optimizer(self, model: nn.Module, params: Iterable[nn.Parameter] | None = None) -> torch.optim.Optimizer:
        """The optimizer for ``model``: ``optimizer(model)`` or ``optimizer(params)``.

        Args:
            model: the model being trained (the module the user built, not a wrapper).
            params: the parameters to optimize (default ``model.parameters()``; a
                strategy's wrapper hands its own, which are the same tensors).
        """
        if optimizer_takes_model(self.optimizer):
            made = self.optimizer(model)
        else:
            made = self.optimizer(model.parameters() if params is None else params)
        if not isinstance(made, torch.optim.Optimizer):
            raise WorkloadError(
                f"workload {self.name!r}: its optimizer factory returned {type(made).__name__}, "
                "not a torch.optim.Optimizer"
            )
        if needs_closure(made):
            # Refused here, as the optimizer is made and before any step: a search would
            # otherwise build models and run forwards before ``step()`` fails inside torch.
            raise WorkloadError(
                f"workload {self.name!r}: {type(made).__name__}.step needs a closure (it re-evaluates the loss "
                "within one step); memfit runs one forward and backward per optimizer step, so it cannot "
                "measure, search or split such a step: search with a first-order optimizer (SGD, AdamW) and "
                "the same model, or watch your own loop with memfit.Monitor"
            )
        return made

    def with_optimizer_hook(self, hook: Callable[[torch.optim.Optimizer], None]) -> Workload:
        """This workload, with ``hook(optimizer)`` called on every optimizer its factory makes
        (before it is used), the factory still receiving what it asked for.

        Args:
            hook: called with each optimizer made (probe and plan snapshot it to restore it).
        """
        make = self.optimizer

        def from_model(model: nn.Module) -> torch.optim.Optimizer:
            made = make(model)
            hook(made)
            return made

        def from_params(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
            made = make(params)
            hook(made)
            return made

        return replace(self, optimizer=from_model if optimizer_takes_model(make) else from_params)

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


def optimizer_takes_model(factory: Callable[..., Any]) -> bool:
    """True when an optimizer factory is to receive the model, False for its parameters.

    The rule, read from the signature: the first parameter is annotated as ``nn.Module``
    (or a subclass), or is named ``model`` or ``module``. Why the signature and not a
    trial call: calling the user's factory to see whether it fails would build an
    optimizer (and run the user's code) twice; the signature answers without running it.
    A factory whose signature cannot be read (a C builtin) receives the parameters.

    >>> optimizer_takes_model(lambda model: None), optimizer_takes_model(lambda params: None)
    (True, False)

    Args:
        factory: the workload's ``optimizer``.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return False
    first = next(iter(signature.parameters.values()), None)
    if first is None or first.kind in (first.VAR_POSITIONAL, first.VAR_KEYWORD, first.KEYWORD_ONLY):
        return False
    annotation = first.annotation
    if isinstance(annotation, str):
        # an annotation naming what cannot be imported here: the name decides
        with contextlib.suppress(Exception):
            annotation = typing.get_type_hints(factory).get(first.name, annotation)
    if isinstance(annotation, type) and issubclass(annotation, nn.Module):
        return True
    return first.name in MODEL_ARGUMENT_NAMES


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` cannot run without a closure (L-BFGS and its kind).

    The rule, read from the signature of the class's ``step``: a parameter ``closure``
    without a default is required (``torch.optim.LBFGS.step(closure)``), where first-order
    optimizers take ``closure=None``. An optimizer that declares ``closure=None`` but fails
    without one is not caught here: its first step raises its own error.

    >>> needs_closure(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]))
    True

    Args:
        optimizer: the optimizer a workload's factory made.
    """
    try:
        signature = inspect.signature(type(optimizer).step)
    except (TypeError, ValueError):
        return False
    closure = signature.parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
