"""Split a batch into micro-batches along dimension 0, count its samples, join outputs back.

Why its own module: the guard (and anything that runs a batch in pieces) needs three pure
operations on a user's batch, whatever its shape: how many samples it holds, the
micro-batches of at most ``size`` samples, and the concatenation of per-micro-batch
outputs. They know nothing about models, memory or retries.

The rules, for the batches training loops pass around:

- a tensor is split along dimension 0 (views, no copies);
- a mapping (``dict``, ``OrderedDict``, transformers' ``BatchEncoding``), a list, a tuple,
  a namedtuple or a dataclass instance is a container: each of its values is split, and
  each micro-batch is a container of the same type;
- any other value (a string, a number, ``None``) is not per-sample data and is copied
  into every micro-batch unchanged;
- every tensor must have the same size along dimension 0 (that size is the number of
  samples); otherwise :class:`~memfit.errors.MemfitError` names the sizes that disagree.

>>> import torch
>>> batch = {"x": torch.arange(10).reshape(5, 2), "y": torch.arange(5), "tag": "train"}
>>> count_samples(batch)
5
>>> [count_samples(m) for m in split_batch(batch, 2)]
[2, 2, 1]
>>> split_batch(batch, 2)[2]["tag"]
'train'
>>> concat_outputs([torch.ones(2), torch.zeros(1)]).tolist()
[1.0, 1.0, 0.0]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from memfit.errors import MemfitError

__all__ = ["chunk_sizes", "count_samples", "split_batch", "slice_batch", "concat_outputs"]


# -- the pure arithmetic --------------------------------------------------------------------


def chunk_sizes(samples: int, size: int) -> list[int]:
    """The sample counts of the micro-batches of ``samples`` split at ``size``: full ones, then the rest.

    Why a function: the guard weights each micro-batch by its share of the samples, and
    must know those shares even when a user's own ``split=`` produced the micro-batches.

    >>> chunk_sizes(10, 4)
    [4, 4, 2]
    """
    if samples < 1:
        raise MemfitError(f"cannot split a batch of {samples} samples: it must hold at least one")
    if size < 1:
        raise MemfitError(f"invalid micro-batch size {size}: must be at least 1")
    full, rest = divmod(samples, size)
    return [size] * full + ([rest] if rest else [])


# -- walking a batch ------------------------------------------------------------------------


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _children(value: Any) -> tuple[list[Any], list[Any]] | None:
    """(keys, values) of a container, or None for a leaf.

    Why mappings before dataclasses: transformers' ``ModelOutput`` is both, and only its
    mapping view lists exactly the fields that are set.
    """
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, Mapping):
        keys = list(value.keys())
        return keys, [value[key] for key in keys]
    if isinstance(value, (list, tuple)):
        return list(range(len(value))), list(value)
    if _is_dataclass_instance(value):
        names = [f.name for f in dataclasses.fields(value) if f.init]
        return names, [getattr(value, name) for name in names]
    return None


def _assemble(template: Any, keys: list[Any], values: list[Any]) -> Any:
    """A container like ``template`` holding ``values`` under ``keys``."""
    if isinstance(template, Mapping):
        if type(template) is dict:
            return dict(zip(keys, values))
        if isinstance(template, MutableMapping):
            # copy.copy keeps the subclass and its extra attributes (defaultdict's
            # factory, BatchEncoding's tensor type); the values are then replaced.
            rebuilt = copy.copy(template)
            for key, value in zip(keys, values):
                rebuilt[key] = value
            return rebuilt
        return dict(zip(keys, values))
    if _is_namedtuple(template):
        return type(template)(*values)
    if isinstance(template, (list, tuple)):
        return type(template)(values)
    return dataclasses.replace(template, **dict(zip(keys, values)))


def _child_path(path: str, template: Any, key: Any) -> str:
    if _is_dataclass_instance(template) and not isinstance(template, Mapping):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def _tensor_leaves(value: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) batch with the path that names it in error messages."""
    parts = _children(value)
    if parts is None:
        if isinstance(value, torch.Tensor):
            yield path, value
        return
    for key, child in zip(*parts):
        yield from _tensor_leaves(child, _child_path(path, value, key))


def _map_leaves(values: Sequence[Any], fn: Callable[[list[Any], str], Any], path: str = "batch") -> Any:
    """Rebuild the structure of ``values[0]``, each leaf being ``fn(the leaves at that place)``.

    Why several structures at once: concatenating outputs walks all micro-batches' outputs
    in step; splitting walks one batch.
    """
    template = values[0]
    parts = _children(template)
    if parts is None:
        return fn(list(values), path)
    keys, _ = parts
    columns: list[list[Any]] = [[] for _ in keys]
    for value in values:
        other = _children(value)
        if other is None or type(value) is not type(template) or other[0] != keys:
            raise MemfitError(
                f"cannot concatenate outputs: {path} is a {type(template).__name__} with keys "
                f"{keys} in one micro-batch and {type(value).__name__} "
                f"{other[0] if other else ''} in another"
            )
        for column, child in zip(columns, other[1]):
            column.append(child)
    rebuilt = [_map_leaves(column, fn, _child_path(path, template, key)) for key, column in zip(keys, columns)]
    return _assemble(template, keys, rebuilt)


# -- what the guard calls -------------------------------------------------------------------


def _leading_sizes(value: Any, out: list[int]) -> None:
    """Append each tensor's size along dimension 0 (-1 for a 0-dimensional one).

    Why apart from :func:`_tensor_leaves`: this runs on every training step, so it builds
    no paths; they are only needed for an error message.
    """
    if isinstance(value, torch.Tensor):
        out.append(value.shape[0] if value.dim() else -1)
        return
    if isinstance(value, (list, tuple)):
        for child in value:
            _leading_sizes(child, out)
        return
    parts = _children(value)
    if parts is not None:
        for child in parts[1]:
            _leading_sizes(child, out)


def count_samples(batch: Any) -> int:
    """The number of samples in a batch: the common size of its tensors along dimension 0.

    Why strict: a batch whose tensors disagree cannot be split into micro-batches that
    keep samples together, so it is an error (naming the sizes), not a guess.
    """
    sizes: list[int] = []
    _leading_sizes(batch, sizes)
    if sizes and sizes[0] >= 0 and sizes.count(sizes[0]) == len(sizes):
        return sizes[0]
    raise MemfitError(_why_not_countable(batch))


def _why_not_countable(batch: Any) -> str:
    """The one-line reason :func:`count_samples` cannot count a batch, naming the tensors."""
    first_path: dict[int, str] = {}
    for path, tensor in _tensor_leaves(batch):
        if tensor.dim() == 0:
            return (
                f"{path} is a 0-dimensional tensor: it has no dimension 0 to split into micro-batches; "
                "pass split= to split this batch yourself"
            )
        first_path.setdefault(tensor.shape[0], path)
    if not first_path:
        return f"found no tensors in the batch (a {type(batch).__name__}); pass split= to split it yourself"
    described = ", ".join(f"{path} has {size}" for size, path in first_path.items())
    return (
        f"the batch's tensors disagree on dimension 0 (the sample count): {described}; "
        "pass split= to split this batch yourself"
    )


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch: every tensor sliced along dimension 0 (a view)."""

    def take(leaves: list[Any], _path: str) -> Any:
        leaf = leaves[0]
        return leaf[start:stop] if isinstance(leaf, torch.Tensor) else leaf

    return _map_leaves([batch], take)


def split_batch(batch: Any, size: int) -> list[Any]:
    """The micro-batches of at most ``size`` samples, in order; together they hold every sample once."""
    samples = count_samples(batch)
    micro_batches = []
    start = 0
    for length in chunk_sizes(samples, size):
        micro_batches.append(slice_batch(batch, start, start + length))
        start += length
    return micro_batches


def _same(a: Any, b: Any) -> bool:
    """True when two output values are equal; False when they cannot be compared (arrays)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an ambiguous truth value is not "equal"
        return False


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """Join per-micro-batch outputs into the output of the whole batch.

    Tensors with a dimension 0 are concatenated along it; 0-dimensional tensors (a loss
    per micro-batch) are stacked into one value per micro-batch; ``None`` stays ``None``;
    other values are kept when every micro-batch returned the same, else listed.
    """
    if not outputs:
        raise MemfitError("no outputs to concatenate")
    if len(outputs) == 1:
        return outputs[0]

    def join(leaves: list[Any], path: str) -> Any:
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
                raise MemfitError(f"cannot concatenate outputs: {path} is a tensor in some micro-batches only")
            if first.dim() == 0:
                return torch.stack(leaves)
            return torch.cat(leaves, dim=0)
        if all(leaf is None for leaf in leaves):
            return None
        if all(_same(leaf, first) for leaf in leaves):
            return first
        return list(leaves)

    return _map_leaves(list(outputs), join, "output")
