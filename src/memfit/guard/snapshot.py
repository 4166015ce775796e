"""What a failed attempt may change, saved before it and put back after it, bit for bit.

A step that runs out of memory has already done part of its work: BatchNorm's forward
updated ``running_mean``, ``running_var`` and ``num_batches_tracked``; dropout drew from the
generator; ``optimizer.step()`` may have made its state for the first time (Adam's moments)
or advanced its step counters before the allocation that failed; a ``GradScaler`` recorded
the step. The retry (or the user, who catches the error) must start from the state before
the attempt, so each of those is saved here before it and restored after a failure.

Why not a copy of everything: the guard runs where memory is short. Buffers are small
(normalization statistics), but some models hold large constant buffers (causal masks);
those are copied on the first step only, and once seen unchanged over a step (and outside
a normalization layer, whose statistics change without bumping the tensor's version
counter) they are watched through their version counter instead. Optimizer state is not
copied at all: state the failed step made is dropped, counters (0-dimensional tensors) are
copied, and larger state tensors and the parameters are watched through their version
counters; when the failed step had already changed one in place, :meth:`OptimizerSnapshot.restore`
says so instead of pretending.

>>> import torch
>>> bn = torch.nn.BatchNorm1d(2)
>>> buffers = BufferSnapshots(bn)
>>> saved = buffers.take()
>>> _ = bn(torch.randn(4, 2))
>>> int(bn.num_batches_tracked)
1
>>> buffers.restore(saved)
>>> int(bn.num_batches_tracked), bn.running_mean.tolist()
(0, [0.0, 0.0])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError

__all__ = ["BufferSnapshots", "SavedBuffers", "RngState", "OptimizerSnapshot", "ScalerSnapshot"]

#: layers whose buffers change in forward without bumping the tensor version counter
_STATISTICS = (nn.modules.batchnorm._NormBase,)


@dataclass
class _Saved:
    module: nn.Module
    name: str
    ref: torch.Tensor
    version: int
    copy: torch.Tensor | None


@dataclass
class SavedBuffers:
    """The buffers as they were before an attempt (see :class:`BufferSnapshots`)."""

    entries: list[_Saved] = field(default_factory=list)


class BufferSnapshots:
    """Save and restore a model's buffers around an attempt, copying only what can change.

    Args:
        model: the model whose buffers (``model.named_buffers()``) are saved.
    """

    def __init__(self, model: nn.Module) -> None:
        self._places: list[tuple[str, nn.Module, str, bool]] = []
        for module_name, module in model.named_modules():
            statistics = isinstance(module, _STATISTICS)
            for name in module._buffers:
                self._places.append((f"{module_name}.{name}" if module_name else name, module, name, statistics))
        #: buffers seen unchanged over a whole step: watched by version counter, not copied
        self._constant: set[int] = set()
        self._checked = False

    def take(self) -> SavedBuffers:
        """Save every buffer: a copy of those that may change, the version of the others."""
        saved = SavedBuffers()
        for index, (_, module, name, _) in enumerate(self._places):
            tensor = module._buffers.get(name)
            if tensor is None:
                continue
            copy = None if index in self._constant else tensor.detach().clone()
            saved.entries.append(_Saved(module, name, tensor, tensor._version, copy))
        return saved

    def learn(self, saved: SavedBuffers) -> None:
        """After the first successful step: buffers it left unchanged are watched from now on, not copied."""
        if self._checked:
            return
        self._checked = True
        by_place = {(id(e.module), e.name): e for e in saved.entries}
        for index, (_, module, name, statistics) in enumerate(self._places):
            entry = by_place.get((id(module), name))
            current = module._buffers.get(name)
            if statistics or entry is None or entry.copy is None or current is not entry.ref:
                continue
            if current._version == entry.version and torch.equal(current, entry.copy):
                self._constant.add(index)

    def restore(self, saved: SavedBuffers) -> None:
        """Put every buffer back as it was when ``saved`` was taken."""
        for entry in saved.entries:
            current = entry.module._buffers.get(entry.name)
            if current is not entry.ref:
                entry.module._buffers[entry.name] = entry.ref  # the attempt assigned a new tensor
            if entry.copy is not None:
                with torch.no_grad():
                    entry.ref.copy_(entry.copy)
            elif entry.ref._version != entry.version:
                name = next(p for p, m, n, _ in self._places if m is entry.module and n == entry.name)
                raise MemfitError(
                    f"memfit guard: buffer {name!r} changed in place during the failed attempt after staying "
                    "constant over the first step, and no copy of it was kept; it cannot be restored"
                )


class RngState:
    """The CPU generator's state and every initialized CUDA generator's, to put back after a failure."""

    def __init__(self) -> None:
        self.cpu = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class OptimizerSnapshot:
    """What ``optimizer.step()`` may change, saved before it (no copy of the state tensors).

    Why this cheap: it runs before every step. The counters (0-dimensional tensors, such
    as Adam's ``step``) are copied in one ``torch.stack`` per device; the rest is references
    and version counters.

    Args:
        optimizer: the optimizer about to step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_versions = [p._version for p in self.params]
        self.state: dict[int, dict[str, Any]] = {}
        self.watched: list[tuple[torch.Tensor, int]] = []
        counters: dict[torch.device, list[torch.Tensor]] = {}
        for param, state in optimizer.state.items():
            self.state[id(param)] = dict(state)
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    if value.dim() == 0:
                        counters.setdefault(value.device, []).append(value)
                    else:
                        self.watched.append((value, value._version))
        self.counters = [(tensors, torch.stack(tensors)) for tensors in counters.values()]

    def restore(self) -> str | None:
        """Put the state back; returns why it could not be (a tensor changed in place), else None."""
        changed = sum(1 for p, v in zip(self.params, self.param_versions) if p._version != v)
        changed += sum(1 for tensor, version in self.watched if tensor._version != version)
        for param in list(self.optimizer.state):
            refs = self.state.get(id(param))
            if refs is None:
                del self.optimizer.state[param]  # made by the failed step
                continue
            state = self.optimizer.state[param]
            state.clear()
            state.update(refs)
        with torch.no_grad():
            for tensors, saved in self.counters:
                for tensor, value in zip(tensors, saved):
                    tensor.copy_(value)
        if changed:
            return (
                f"optimizer.step() had already changed {changed} parameter or state tensor(s) in place when it "
                "failed: they are not as they were before the step (reload the last checkpoint)"
            )
        return None


class ScalerSnapshot:
    """A ``GradScaler``'s scale, growth tracker and per-step records, saved before a step.

    Args:
        scaler: the scaler (None: nothing to save).
    """

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler
        self.scale = self.tracker = None
        if scaler is not None:
            scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
            self.scale = None if scale is None else scale.detach().clone()
            self.tracker = None if tracker is None else tracker.detach().clone()

    def restore(self) -> None:
        scaler = self.scaler
        if scaler is None:
            return
        states = getattr(scaler, "_per_optimizer_states", None)
        if states is not None:
            states.clear()
        scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
        with torch.no_grad():
            if self.scale is not None and scale is not None:
                scale.copy_(self.scale)
            if self.tracker is not None and tracker is not None:
                tracker.copy_(self.tracker)
