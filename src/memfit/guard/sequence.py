"""Sequence-first modules: tell the user before a batch is split along its sequence.

``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, ``nn.MultiheadAttention`` and the ``nn.Transformer``
family default to ``batch_first=False``: their inputs are ``(sequence, batch, ...)``. A
training loop built around them (pytorch/examples' word-language model) passes batches
of ``(35, 20)`` tokens, 20 sequences of 35. Splitting such a batch along dimension 0 cuts
every sequence in two and trains on something else, silently.

Why look at the inputs and not only at the modules: many models take batch-first data
and transpose it before a sequence-first LSTM; for them dimension 0 *is* right. So the
guard watches what each sequence-first module receives while it runs the first steps
(forward pre-hooks, removed once every module has been seen): its input must hold the
micro-batch's samples along dimension 1. When it holds them along dimension 0 instead,
the batch dimension is wrong and :class:`LayoutError` names the module and the fix
(``batch_dim=1``), before any micro-batch has been split or any update made.

>>> from torch import nn
>>> [name for name, _ in sequence_first_modules(nn.ModuleDict({"rnn": nn.LSTM(4, 4), "out": nn.Linear(4, 2)}))]
['rnn']
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from memfit.errors import MemfitError

__all__ = ["sequence_first_modules", "LayoutCheck", "LayoutError"]

_FAMILY = (
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)

Seen = Literal["unseen", "ambiguous", "ok"]


class LayoutError(MemfitError):
    """The batch is split along a dimension a sequence-first module treats as its sequence."""


def _batch_first(module: nn.Module) -> bool:
    """A module's ``batch_first``, read where torch keeps it for each kind."""
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        layers = list(module.layers)
        return bool(layers) and _batch_first(layers[0])
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return bool(module.self_attn.batch_first)
    return bool(getattr(module, "batch_first", True))


def sequence_first_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of the model that take ``(sequence, batch, ...)`` inputs.

    Args:
        model: the model (a DDP wrapper is looked through like any module).
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, _FAMILY) or _batch_first(module):
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found if outer):
            continue  # inside one already found: it sees the same layout
        found.append((name, module))
    return found


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    for key in ("input", "src", "query", "tgt"):
        if key in kwargs:
            return kwargs[key]
    return None


def _describe(name: str, module: nn.Module) -> str:
    return f"nn.{type(module).__name__} {name or '<the model>'!r} (batch_first=False)"


class LayoutCheck:
    """Watch what the model's sequence-first modules receive, until each has been seen.

    :meth:`expect` runs a forward pass with the number of samples it should see; each
    module's first input must then be ``(sequence, samples, ...)``.

    Args:
        model: the model the guard trains.
        explicit: True when the user gave ``batch_dim``; then a layout that cannot be
            told apart (sequence length equal to the sample count) is trusted.
    """

    def __init__(self, model: nn.Module, explicit: bool) -> None:
        self.modules = sequence_first_modules(model)
        self.explicit = explicit
        self.seen: dict[str, Seen] = {name: "unseen" for name, _ in self.modules}
        self._expected: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for name, module in self.modules:
            hook = self._make_hook(name, module)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    @property
    def done(self) -> bool:
        return not self._handles

    @contextlib.contextmanager
    def expect(self, samples: int) -> Iterator[None]:
        """Check the sequence-first modules' inputs during this block against ``samples``."""
        if self.done:
            yield
            return
        self._expected = samples
        try:
            yield
        finally:
            self._expected = None
        if all(state == "ok" for state in self.seen.values()):
            self.close()

    def before_split(self, batch_dim_text: str) -> None:
        """Refuse to split when a module's layout could not be told from what it received."""
        if self.explicit:
            return
        unclear = [(name, module) for name, module in self.modules if self.seen[name] == "ambiguous"]
        if unclear:
            name, module = unclear[0]
            raise LayoutError(
                f"memfit guard: {_describe(name, module)} takes (sequence, batch, ...) inputs, and its input had "
                f"as many rows along dimension 0 as along dimension 1, so which one holds the samples cannot be "
                f"told; splitting along {batch_dim_text} may cut sequences: pass batch_dim= (1 for "
                "(sequence, batch) data, 0 if your model transposes batch-first data itself)"
            )

    def close(self) -> None:
        """Remove the hooks (the check costs nothing from here on)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, name: str, module: nn.Module) -> Any:
        def check(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            expected = self._expected
            x = _first_input(args, kwargs)
            if expected is None or not isinstance(x, torch.Tensor) or x.dim() < 3:
                return  # outside the guard, a packed sequence, or an unbatched input
            along0, along1 = x.shape[0] == expected, x.shape[1] == expected
            if along1 and not along0:
                self.seen[name] = "ok"
            elif along0 and not along1:
                raise LayoutError(
                    f"memfit guard: {_describe(name, module)} takes (sequence, batch, ...) inputs, and its input "
                    f"{tuple(x.shape)} has the micro-batch's {expected} samples along dimension 0, its sequence: "
                    "the batch would be split along the sequence, not the samples; pass batch_dim=1 "
                    "(Guard(..., batch_dim=1)) for (sequence, batch) data, or build the module with batch_first=True"
                )
            elif along0 and along1 and self.seen[name] == "unseen":
                self.seen[name] = "ambiguous"

        return check
