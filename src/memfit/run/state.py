"""Save and restore training state, so probing inside a real training script leaves no trace.

:func:`preserved` snapshots, on entry, a model's parameters, buffers and gradients (and
each one's ``requires_grad``, each module's train flag), any
object with ``state_dict`` / ``load_state_dict`` (optimizers, GradScalers, LR schedulers)
and the random number generators (Python's ``random``, NumPy's global generator, torch's
CPU generator and every initialized CUDA generator); on exit it puts every one of them
back, bit for bit, whatever happened inside. :func:`preserved_workload` is the one
mechanism probe, plan and fit use: it preserves a workload's model instance and every
optimizer its factory hands out during the block (a script's own optimizer included).

Why copies on the host: a snapshot kept on the GPU would take the very memory a probe is
measuring. Why copy into the same tensors: the caller's optimizer holds references to
its parameters, so a parameter must stay the same object with the same storage.

>>> import torch
>>> model = torch.nn.Linear(2, 2)
>>> before = model.weight.detach().clone()
>>> with preserved(model):
...     with torch.no_grad():
...         _ = model.weight.add_(1.0)
>>> torch.equal(model.weight, before)
True
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.cuda.counting import not_counted
from memfit.workload import Workload

__all__ = ["preserved", "preserved_workload", "Snapshot", "RngState", "save_rng", "restore_rng", "TensorSnapshot"]


@dataclass
class RngState:
    """Every random generator a training step may draw from."""

    python: Any
    numpy: Any | None
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None


def save_rng() -> RngState:
    """The state of Python's, NumPy's, torch's CPU and (when initialized) CUDA's generators.

    Why only initialized CUDA: asking for CUDA's state would create a CUDA context, which
    takes GPU memory and breaks a DataLoader that forks later.
    """
    try:
        import numpy
    except ImportError:  # numpy is a dependency, but the RNG snapshot must not need it
        numpy_state = None
    else:
        numpy_state = numpy.random.get_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return RngState(random.getstate(), numpy_state, torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    """Put every generator back where :func:`save_rng` found it."""
    random.setstate(state.python)
    if state.numpy is not None:
        import numpy

        numpy.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)


@dataclass
class TensorSnapshot:
    """A host copy of one tensor (a parameter, a buffer or a gradient) and where it lived."""

    tensor: torch.Tensor
    copy: torch.Tensor
    device: torch.device
    grad: torch.Tensor | None = None
    had_grad: bool = False
    requires_grad: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor, *, with_grad: bool) -> TensorSnapshot:
        grad = tensor.grad if with_grad else None
        return cls(
            tensor=tensor,
            copy=_host_copy(tensor.detach()),
            device=tensor.device,
            grad=None if grad is None else _host_copy(grad.detach()),
            had_grad=grad is not None,
            requires_grad=tensor.requires_grad,
        )

    def restore(self) -> None:
        """Copy the values back into the same tensor object (moving it back if it moved)."""
        with torch.no_grad():
            if self.tensor.device != self.device or self.tensor.shape != self.copy.shape:
                self.tensor.data = self.copy.to(self.device, copy=True)
            else:
                self.tensor.copy_(self.copy)
            if isinstance(self.tensor, nn.Parameter) or self.tensor.requires_grad:
                self.tensor.grad = None if self.grad is None else self.grad.to(self.device, copy=True)
        if self.tensor.is_leaf and self.tensor.requires_grad != self.requires_grad:
            self.tensor.requires_grad_(self.requires_grad)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    # Not counted: an optimizer handed out during a trial is snapshotted inside the
    # device, and on a simulated GPU (the CPU) a host copy would be charged to it.
    with not_counted():
        return tensor.to("cpu", copy=True)


@dataclass
class Snapshot:
    """Everything :func:`preserved` puts back."""

    rng: RngState
    tensors: list[TensorSnapshot] = field(default_factory=list)
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)
    states: list[tuple[Any, Any]] = field(default_factory=list)

    @classmethod
    def take(cls, objects: Iterable[Any]) -> Snapshot:
        snapshot = cls(rng=save_rng())
        for obj in objects:
            snapshot.add(obj)
        return snapshot

    def add(self, obj: Any) -> None:
        """Snapshot one more object now (None and objects already held are skipped)."""
        if obj is None or any(held is obj for held in self._held()):
            return
        if isinstance(obj, nn.Module):
            self.tensors.extend(TensorSnapshot.of(p, with_grad=True) for p in obj.parameters())
            self.tensors.extend(TensorSnapshot.of(b, with_grad=False) for b in obj.buffers())
            self.modes.extend((module, module.training) for module in obj.modules())
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            self.states.append((obj, _state_copy(obj.state_dict())))
        else:
            raise TypeError(
                f"cannot preserve a {type(obj).__name__}: give a module or an object with state_dict/load_state_dict"
            )

    def _held(self) -> Iterator[Any]:
        yield from (module for module, _ in self.modes)
        yield from (obj for obj, _ in self.states)

    def restore(self) -> None:
        for tensor in self.tensors:
            tensor.restore()
        for module, training in self.modes:
            module.training = training
        for obj, state in self.states:
            obj.load_state_dict(_state_copy(state))
        restore_rng(self.rng)


def _state_copy(state: Any) -> Any:
    """A deep copy of a state dict with every tensor on the host.

    Why host: an optimizer's state dict holds references to its live moment tensors; a
    copy on the GPU would double their memory while the probe runs. ``load_state_dict``
    moves the tensors back to their parameters' devices.
    """
    if isinstance(state, torch.Tensor):
        return _host_copy(state.detach())
    if isinstance(state, dict):
        return {key: _state_copy(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_state_copy(value) for value in state]
    if isinstance(state, tuple):
        return tuple(_state_copy(value) for value in state)
    return copy.deepcopy(state)


@contextmanager
def preserved(*objects: Any) -> Iterator[Snapshot]:
    """Snapshot ``objects`` (modules, optimizers, scalers, schedulers) and the RNGs; restore on exit."""
    snapshot = Snapshot.take(objects)
    try:
        yield snapshot
    finally:
        snapshot.restore()


@contextmanager
def preserved_workload(workload: Workload, *objects: Any) -> Iterator[Workload]:
    """Preserve a workload's model instance, the optimizers it hands out and ``objects``.

    Yields the workload to run inside the block: a workload built around a model instance
    comes back with its optimizer factory snapshotting each optimizer it returns, before
    it is stepped (a script's ``optimizer=lambda params: opt`` hands out its own, live
    optimizer); a fresh optimizer per trial is snapshotted too, harmlessly. The random
    generators are restored on exit whatever the workload, so a search draws nothing
    from the caller's streams. On exit, success or error, everything is put back.

    Args:
        workload: the workload probe, plan or fit will run.
        objects: further objects to restore (a GradScaler, an LR scheduler).
    """
    model = workload.model if isinstance(workload.model, nn.Module) else None
    with preserved(model, *objects) as snapshot:
        yield workload if workload.builds_fresh_models else workload.with_optimizer_hook(snapshot.add)
