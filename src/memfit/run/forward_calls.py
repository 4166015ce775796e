"""Which module calls which in a model's forward: one look-ahead run, leaving no trace.

:func:`record_calls` runs ``model.forward`` once more on the arguments of a real call,
without gradients, with hooks on every submodule recording its caller; the model's buffers
and every random generator are put back afterwards and the storage tracker does not count
the run (:func:`memfit.cuda.counting.not_counted`): it is memfit's look, not the user's
step. :class:`CallTree` then answers what activation checkpointing asks
(:mod:`memfit.run.checkpointing`): the repeated blocks, and the outermost modules that
match a name.

>>> import torch
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc = nn.Linear(4, 4)
...     def forward(self, x):
...         return self.fc(x).relu()
>>> model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Block(), Block()), nn.Linear(4, 1))
>>> [path for path, _ in record_calls(model, (torch.zeros(2, 4),), {}).blocks()]
['1.0', '1.1']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.cuda.counting import not_counted
from memfit.run.state import restore_rng, save_rng

__all__ = ["CallTree", "record_calls"]


class CallTree:
    """The modules a forward ran, each under the module that called it, in call order."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.paths: dict[int, str] = {id(m): name for name, m in root.named_modules()}
        #: caller -> the modules it called, first call first
        self.children: dict[int, list[nn.Module]] = {}
        #: how many times each module ran
        self.calls: dict[int, int] = {}

    def add(self, caller: nn.Module, module: nn.Module) -> None:
        self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        called = self.children.setdefault(id(caller), [])
        if not any(m is module for m in called):
            called.append(module)

    def _composite(self, m: nn.Module) -> bool:
        """Computes something of its own: it calls submodules, or is user code with
        parameters (a block written with ``F.linear`` on its own weights)."""
        if self.children.get(id(m)):
            return True
        return not type(m).__module__.startswith("torch.") and any(True for _ in m.parameters(recurse=False))

    def _transparent(self, m: nn.Module) -> bool:
        """A container looked through: a Sequential whose members are blocks themselves
        (a ResNet stage), a ModuleList or ModuleDict (never called, but listed for safety)."""
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            return True
        return isinstance(m, nn.Sequential) and any(self._composite(c) for c in self.children.get(id(m), []))

    def _kind(self, m: nn.Module) -> Any:
        # Why by structure for Sequential: every Sequential is of one class; two are the
        # same kind of block only when they hold the same kinds of layers.
        if isinstance(m, nn.Sequential):
            return (nn.Sequential, tuple(type(c) for c in m.children()))
        return type(m)

    def _walk(self, take: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
        found: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()

        def visit(caller: nn.Module) -> None:
            for m in self.children.get(id(caller), []):
                if id(m) in seen:
                    continue
                seen.add(id(m))
                if take(m):
                    found.append((self.paths.get(id(m), "?"), m))
                else:
                    visit(m)

        visit(self.root)
        return found

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The outermost composite modules (not containers) whose kind runs at least twice,
        as (dotted path, module), in the order forward first runs them."""
        counts: dict[Any, int] = {}
        for m in self._all():
            if self._composite(m) and not self._transparent(m):
                counts[self._kind(m)] = counts.get(self._kind(m), 0) + self.calls.get(id(m), 0)
        return self._walk(
            lambda m: self._composite(m) and not self._transparent(m) and counts.get(self._kind(m), 0) >= 2
        )

    def outermost(self, match: Callable[[str, nn.Module], Any]) -> list[tuple[str, nn.Module]]:
        """The outermost modules that ran and match ``match(path, module)``."""
        return self._walk(lambda m: bool(match(self.paths.get(id(m), "?"), m)))

    def describe_blocks(self) -> str:
        counts: dict[str, int] = {}
        for _, m in self.blocks():
            name = type(m).__name__.removeprefix("FSDP")
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{n} x {name}" for name, n in counts.items())

    def _all(self) -> list[nn.Module]:
        out: dict[int, nn.Module] = {}
        for called in self.children.values():
            for m in called:
                out[id(m)] = m
        return list(out.values())


def record_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallTree:
    """Run ``model.forward(*args, **kwargs)`` once without gradients and record who called whom.

    The model's own hooks are not run for the root (``forward`` is called, not the
    module): this runs inside the root's call. Buffers are restored from host copies
    taken before, and so are the random
    generators; an error of the user's forward propagates unchanged.

    Args:
        model: the model (its submodules get temporary hooks).
        args: the positional arguments of the real call.
        kwargs: its keyword arguments.
    """
    tree = CallTree(model)
    stack: list[nn.Module] = [model]
    handles = []
    for _, module in model.named_modules():
        if module is model:
            continue

        def enter(m: nn.Module, _args: Any) -> None:
            tree.add(stack[-1], m)
            stack.append(m)

        def leave(m: nn.Module, _args: Any, _out: Any) -> None:
            if len(stack) > 1 and stack[-1] is m:
                stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    rng = save_rng()
    try:
        with not_counted(), torch.no_grad():
            # every buffer: a batch norm's kernel updates its running statistics without
            # moving their version counter, so "changed" cannot be told from it
            buffers = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
            try:
                model.forward(*args, **kwargs)
            finally:
                for b, copy in buffers:
                    b.copy_(copy)
    finally:
        for handle in handles:
            handle.remove()
        restore_rng(rng)
    return tree
