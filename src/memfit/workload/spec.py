"""Workload: one training step, described so memfit can run it at any batch size.

A workload is four things: the model (a module, or a zero-argument factory that builds a
fresh one), ``make_batch(batch_size)`` returning a batch at worst-case shapes (the
longest sequence, the largest image), ``loss(model, batch)`` returning a scalar, and
``optimizer(params)`` (AdamW by default).

A workload *reference* is a string every memfit command accepts:

- a zoo name with options: ``gpt2``, ``gpt2:n_layer=2,seq_len=128`` (see :mod:`memfit.workload.zoo`);
- ``path/to/file.py:function`` or ``package.module:function``: the function takes no
  required arguments and returns a :class:`Workload`.

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

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import WorkloadError

__all__ = ["Workload", "load_workload", "default_optimizer", "move_to"]


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

    @property
    def builds_fresh_models(self) -> bool:
        """True when ``model`` is a factory: every run gets a new instance."""
        return not isinstance(self.model, nn.Module)

    def build_model(self) -> nn.Module:
        """The model to train: a fresh one from a factory, else the given instance."""
        if isinstance(self.model, nn.Module):
            return self.model
        model = self.model()
        if not isinstance(model, nn.Module):
            raise WorkloadError(f"workload {self.name!r}: the model factory returned {type(model).__name__}, not an nn.Module")
        return model


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


# -- references ---------------------------------------------------------------------------


def load_workload(ref: str | Workload) -> Workload:
    """Resolve a workload reference (a zoo name with options, ``file.py:fn`` or ``module:fn``)."""
    if isinstance(ref, Workload):
        return ref
    if not isinstance(ref, str) or not ref.strip():
        raise WorkloadError("empty workload reference: give a zoo name (such as mlp or gpt2) or file.py:function")
    ref = ref.strip()
    from memfit.workload import zoo  # the zoo imports this module

    head, sep, tail = ref.partition(":")
    if head in zoo.ENTRIES:
        return zoo.build(head, tail if sep else "")
    if head.endswith(".py") or "/" in head or "\\" in head:
        return _from_file(head, tail, ref)
    if sep and "=" not in tail:
        return _from_module(head, tail, ref)
    raise WorkloadError(
        f"unknown workload {ref!r}: not a zoo name ({', '.join(zoo.ENTRIES)}), "
        "nor file.py:function, nor package.module:function"
    )


def _from_file(path_text: str, function: str, ref: str) -> Workload:
    path = Path(path_text)
    if not function:
        raise WorkloadError(f"workload {ref!r}: name the function, as {path_text}:make_workload")
    if not path.is_file():
        raise WorkloadError(f"workload {ref!r}: file {path_text} not found")
    module_name = f"_memfit_workload_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"workload {ref!r}: cannot import {path_text}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # errors in the user's file propagate unchanged
    return _call_factory(module, function, ref)


def _from_module(module_name: str, function: str, ref: str) -> Workload:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise WorkloadError(f"workload {ref!r}: module {module_name} not found") from None
        raise
    return _call_factory(module, function, ref)


def _call_factory(module: Any, function: str, ref: str) -> Workload:
    factory = getattr(module, function, None)
    if factory is None:
        raise WorkloadError(f"workload {ref!r}: function {function} not found in {module.__name__}")
    if not callable(factory):
        raise WorkloadError(f"workload {ref!r}: {function} is not a function")
    required = [
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if required:
        raise WorkloadError(f"workload {ref!r}: {function} must take no required arguments (it needs {', '.join(required)})")
    workload = factory()
    if not isinstance(workload, Workload):
        raise WorkloadError(f"workload {ref!r}: {function} returned {type(workload).__name__}, not a memfit.Workload")
    if workload.name == "workload":
        workload.name = ref
    return workload
