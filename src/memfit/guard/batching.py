"""Split a batch into micro-batches along its batch dimension, count its samples, join outputs back.

Why its own module: the guard (and anything that runs a batch in pieces) needs three pure
operations on a user's batch, whatever its shape: how many samples it holds, the
micro-batches of at most ``size`` samples, and the concatenation of per-micro-batch
outputs. They know nothing about models, memory or retries.

The rules, for the batches training loops pass around:

- a tensor is split along its batch dimension, 0 unless ``batch_dim`` says otherwise
  (views, no copies);
- a mapping (``dict``, ``OrderedDict``, transformers' ``BatchEncoding``), a list, a tuple,
  a namedtuple or a dataclass instance is a container: each of its values is split, and
  each micro-batch is a container of the same type;
- any other value (a string, a number, ``None``) is not per-sample data and is copied
  into every micro-batch unchanged;
- every tensor must have the same size along its batch dimension (that size is the number
  of samples); otherwise :class:`~memfit.errors.MemfitError` names the sizes that disagree.

``batch_dim`` says where the samples are: one int for every tensor (``1`` for
sequence-first data such as ``(sequence, batch)`` tokens); a pytree shaped like the batch
whose leaves are ints or None (``(1, 1, None)`` for tokens, targets and a shared
``(seq, seq)`` mask; an int at a container applies to everything under it; None means
"not per-sample: every micro-batch gets it whole"); or a function
``batch_dim(path, tensor) -> int | None`` (``path`` as in error messages: ``batch[0]``).

>>> tokens = torch.arange(12).reshape(3, 4)     # (sequence 3, batch 4)
>>> count_samples(tokens, batch_dim=1), [m.shape for m in split_batch(tokens, 3, batch_dim=1)]
(4, [torch.Size([3, 2]), torch.Size([3, 2])])

>>> import torch
>>> batch = {"x": torch.arange(10).reshape(5, 2), "y": torch.arange(5), "tag": "train"}
>>> count_samples(batch)
5
>>> [count_samples(m) for m in split_batch(batch, 3)]
[3, 2]
>>> split_batch(batch, 3)[1]["tag"]
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

__all__ = [
    "BatchDim",
    "chunk_sizes",
    "user_chunk_sizes",
    "tensor_leaves",
    "along_several_dims",
    "count_samples",
    "split_batch",
    "slice_batch",
    "concat_outputs",
    "batch_dims",
    "output_batch_dim",
]

#: where the samples are: an int for every tensor, a pytree of ints (None: not per-sample),
#: or ``fn(path, tensor) -> int | None``
BatchDim = Any
#: ``dim_of(path, tensor)``: the resolved batch dimension of one tensor (None: not split)
DimOf = Callable[[str, torch.Tensor], "int | None"]


# -- the pure arithmetic --------------------------------------------------------------------


def chunk_sizes(samples: int, size: int) -> list[int]:
    """The sample counts of the micro-batches of ``samples`` at most ``size`` each, as equal as they can be.

    Why equal: a micro-batch much smaller than the others (10 at 4 as 4 + 4 + 2, 9 at 4
    as 4 + 4 + 1) is where a loss that normalizes over its batch breaks down (the std()
    of one sample is NaN); the same number of micro-batches can always be made to differ
    by at most one sample. Why a function: the guard weights each micro-batch by its share.

    >>> chunk_sizes(10, 4), chunk_sizes(9, 4), chunk_sizes(8, 4)
    ([4, 3, 3], [3, 3, 3], [4, 4])
    """
    if samples < 1:
        raise MemfitError(f"cannot split a batch of {samples} samples: it must hold at least one")
    if size < 1:
        raise MemfitError(f"invalid micro-batch size {size}: must be at least 1")
    count = -(-samples // size)
    base, extra = divmod(samples, count)
    return [base + 1] * extra + [base] * (count - extra)


def user_chunk_sizes(samples: int, size: int) -> list[int]:
    """The sample counts a user's ``split(batch, size)`` returns: full micro-batches, then the rest.

    >>> user_chunk_sizes(10, 4)
    [4, 4, 2]
    """
    chunk_sizes(samples, size)  # the same checks
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


def tensor_leaves(value: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a (nested) batch, with the path that names it (``batch['labels']``).

    Args:
        value: the batch.
        path: the name of the root.
    """
    return list(_tensor_leaves(value, path))


def along_several_dims(batch: Any, samples: int, batch_dim: BatchDim = 0) -> list[str]:
    """Tensors whose size along another dimension than their batch dimension is also the sample count.

    Why: a whole-graph model's adjacency ``(N, N)`` carries the samples along both
    dimensions, and splitting one of them breaks it; an image batch ``(32, 3, 32, 32)``
    looks the same by shape. The guard names them when a check on a real sub-batch fails.

    >>> along_several_dims({"x": torch.ones(4, 3), "adj": torch.ones(4, 4)}, 4)
    ["batch['adj'] (4, 4)"]
    """
    dim_of = batch_dims(batch, batch_dim)
    found = []
    for path, tensor in _tensor_leaves(batch):
        dim = dim_of(path, tensor)
        if dim is None or tensor.dim() <= dim:
            continue
        if any(size == samples for d, size in enumerate(tensor.shape) if d != dim):
            found.append(f"{path} {tuple(tensor.shape)}")
    return found


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


# -- where the samples are: batch_dim ----------------------------------------------------------


def _check_dim(dim: Any, where: str) -> int | None:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise MemfitError(f"invalid batch_dim {dim!r} for {where}: use a dimension (0, 1, ...) or None")
    return dim


def _spec_children(spec: Any, value: Any, keys: list[Any], path: str) -> list[Any]:
    """The parts of a batch_dim pytree for the children ``keys`` of ``value``."""
    if isinstance(spec, Mapping):
        missing = [k for k in keys if k not in spec]
        extra = [k for k in spec if k not in keys]
        if extra:
            raise MemfitError(f"batch_dim has keys {extra} that {path} does not have (it has {keys})")
        for key in missing:
            child = value[key] if isinstance(value, Mapping) else getattr(value, key)
            if any(True for _ in _tensor_leaves(child)):
                raise MemfitError(
                    f"batch_dim gives no dimension for {_child_path(path, value, key)}: "
                    "add it (an int, or None for data every micro-batch gets whole)"
                )
        return [spec.get(k) for k in keys]
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(keys):
            raise MemfitError(f"batch_dim has {len(spec)} entries where {path} has {len(keys)}: give one per element")
        return list(spec)
    raise MemfitError(f"invalid batch_dim {spec!r} for {path}: an int, None, a function, or a list/dict like the batch")


def _resolve(value: Any, spec: Any, path: str, out: dict[str, int | None]) -> None:
    """Fill ``out`` with the batch dimension of every tensor leaf under ``value``, by path."""
    if spec is None or isinstance(spec, int):
        for leaf_path, _ in _tensor_leaves(value, path):
            out[leaf_path] = _check_dim(spec, leaf_path)
        return
    if callable(spec):
        for leaf_path, tensor in _tensor_leaves(value, path):
            out[leaf_path] = _check_dim(spec(leaf_path, tensor), leaf_path)
        return
    if not isinstance(spec, (Mapping, list, tuple)):
        raise MemfitError(f"invalid batch_dim {spec!r} for {path}: use a dimension (0, 1, ...) or None")
    parts = _children(value)
    if parts is None:
        if isinstance(value, torch.Tensor):
            raise MemfitError(f"batch_dim is a {type(spec).__name__} where {path} is a tensor: give an int there")
        return
    keys, children = parts
    for key, child, child_spec in zip(keys, children, _spec_children(spec, value, keys, path)):
        _resolve(child, child_spec, _child_path(path, value, key), out)


def batch_dims(batch: Any, batch_dim: BatchDim = 0, root: str = "batch") -> DimOf:
    """``dim_of(path, tensor)``: the batch dimension of each tensor of ``batch`` (None: not split).

    Args:
        batch: the batch (or an output) whose tensors are looked up.
        batch_dim: an int, a pytree of ints shaped like ``batch``, or ``fn(path, tensor)``.
        root: the name paths start with (``batch``, or ``output``).
    """
    if batch_dim is None or isinstance(batch_dim, int):
        dim = _check_dim(batch_dim, root)
        return lambda _path, _tensor: dim
    if callable(batch_dim):
        return lambda path, tensor: _check_dim(batch_dim(path, tensor), path)
    table: dict[str, int | None] = {}
    _resolve(batch, batch_dim, root, table)
    return lambda path, _tensor: table.get(path)


def output_batch_dim(batch_dim: BatchDim) -> BatchDim:
    """The batch dimension of outputs, by default: the same int or function; for a pytree,
    the one dimension its leaves share (``(1, 1, None)`` gives 1), else a request to say.

    Why: outputs are rarely shaped like the batch (a tuple of inputs gives one tensor), so
    a per-element ``batch_dim`` cannot be applied to them as it is.

    >>> output_batch_dim((1, 1, None)), output_batch_dim({"x": 0, "y": 0})
    (1, 0)
    """
    if batch_dim is None or isinstance(batch_dim, int) or callable(batch_dim):
        return batch_dim
    dims: set[int] = set()

    def collect(spec: Any) -> None:
        if isinstance(spec, int):
            dims.add(spec)
        elif isinstance(spec, Mapping):
            for value in spec.values():
                collect(value)
        elif isinstance(spec, (list, tuple)):
            for value in spec:
                collect(value)

    collect(batch_dim)
    if len(dims) == 1:
        return dims.pop()

    def ask(path: str, _tensor: torch.Tensor) -> int | None:
        raise MemfitError(
            f"batch_dim {batch_dim!r} gives the batch different dimensions, so where the samples are in "
            f"{path} is unknown: pass output_dim= to predict"
        )

    return ask


# -- what the guard calls -------------------------------------------------------------------


def _leading_sizes(value: Any, out: list[int], dim: int = 0) -> None:
    """Append each tensor's size along ``dim`` (-1 for a tensor without that dimension).

    Why apart from :func:`_tensor_leaves`: this runs on every training step, so it builds
    no paths; they are only needed for an error message.
    """
    if isinstance(value, torch.Tensor):
        out.append(value.shape[dim] if value.dim() > dim else -1)
        return
    if isinstance(value, (list, tuple)):
        for child in value:
            _leading_sizes(child, out, dim)
        return
    parts = _children(value)
    if parts is not None:
        for child in parts[1]:
            _leading_sizes(child, out, dim)


def count_samples(batch: Any, batch_dim: BatchDim = 0) -> int:
    """The number of samples in a batch: the common size of its tensors along the batch dimension.

    Why strict: a batch whose tensors disagree cannot be split into micro-batches that
    keep samples together, so it is an error (naming the sizes), not a guess.

    Args:
        batch: tensors, or containers of them.
        batch_dim: where the samples are (see the module's description); 0 by default.
    """
    sizes: list[int] = []
    if isinstance(batch_dim, int) and not isinstance(batch_dim, bool) and batch_dim >= 0:
        _leading_sizes(batch, sizes, batch_dim)  # the fast path, every step
    else:
        dim_of = batch_dims(batch, batch_dim)
        for path, tensor in _tensor_leaves(batch):
            dim = dim_of(path, tensor)
            if dim is not None:
                sizes.append(tensor.shape[dim] if tensor.dim() > dim else -1)
    if sizes and sizes[0] >= 0 and sizes.count(sizes[0]) == len(sizes):
        return sizes[0]
    raise MemfitError(_why_not_countable(batch, batch_dim))


def _why_not_countable(batch: Any, batch_dim: BatchDim = 0) -> str:
    """The one-line reason :func:`count_samples` cannot count a batch, naming the tensors."""
    dim_of = batch_dims(batch, batch_dim)
    first_path: dict[int, str] = {}
    dims: set[int] = set()
    for path, tensor in _tensor_leaves(batch):
        dim = dim_of(path, tensor)
        if dim is None:
            continue
        if tensor.dim() <= dim:
            return (
                f"{path} is a {tensor.dim()}-dimensional tensor: it has no dimension {dim} to split into "
                "micro-batches; pass split= to split this batch yourself, or batch_dim= to say where its "
                "samples are (None for data every micro-batch gets whole)"
            )
        dims.add(dim)
        first_path.setdefault(tensor.shape[dim], path)
    if not first_path:
        return f"found no tensors to split in the batch (a {type(batch).__name__}); pass split= to split it yourself"
    described = ", ".join(f"{path} has {size}" for size, path in first_path.items())
    along = f"dimension {dims.pop()}" if len(dims) == 1 else "their batch dimensions"
    return (
        f"the batch's tensors disagree on {along} (the sample count): {described}; "
        "pass split= to split this batch yourself, or batch_dim= to say where its samples are"
    )


def slice_batch(batch: Any, start: int, stop: int, batch_dim: BatchDim = 0) -> Any:
    """Samples ``start:stop`` of a batch: every tensor sliced along its batch dimension (a view)."""
    dim_of = batch_dims(batch, batch_dim)

    def take(leaves: list[Any], path: str) -> Any:
        leaf = leaves[0]
        if not isinstance(leaf, torch.Tensor):
            return leaf
        dim = dim_of(path, leaf)
        return leaf if dim is None else leaf.narrow(dim, start, stop - start)

    return _map_leaves([batch], take)


def split_batch(batch: Any, size: int, batch_dim: BatchDim = 0) -> list[Any]:
    """The micro-batches of at most ``size`` samples, in order; together they hold every sample once."""
    samples = count_samples(batch, batch_dim)
    micro_batches = []
    start = 0
    for length in chunk_sizes(samples, size):
        micro_batches.append(slice_batch(batch, start, start + length, batch_dim))
        start += length
    return micro_batches


def _same(a: Any, b: Any) -> bool:
    """True when two output values are equal; False when they cannot be compared (arrays)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an ambiguous truth value is not "equal"
        return False


def concat_outputs(outputs: Sequence[Any], batch_dim: BatchDim = 0) -> Any:
    """Join per-micro-batch outputs into the output of the whole batch.

    Tensors are concatenated along their batch dimension (``batch_dim``, as for
    :func:`split_batch`, over the outputs' structure); 0-dimensional tensors (a loss per
    micro-batch) are stacked into one value per micro-batch; ``None`` stays ``None``;
    other values are kept when every micro-batch returned the same, else listed.

    Args:
        outputs: one output per micro-batch, in order.
        batch_dim: where the samples are in the outputs; 0 by default.
    """
    if not outputs:
        raise MemfitError("no outputs to concatenate")
    if len(outputs) == 1:
        return outputs[0]
    dim_of = batch_dims(outputs[0], batch_dim, root="output")

    def join(leaves: list[Any], path: str) -> Any:
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
                raise MemfitError(f"cannot concatenate outputs: {path} is a tensor in some micro-batches only")
            if first.dim() == 0:
                return torch.stack(leaves)
            dim = dim_of(path, first)
            if dim is None:
                return first  # not per-sample: the same for every micro-batch
            if first.dim() <= dim:
                raise MemfitError(
                    f"cannot concatenate outputs: {path} has {first.dim()} dimension(s), no batch dimension {dim}; "
                    "pass output_dim= to predict"
                )
            return torch.cat(leaves, dim=dim)
        if all(leaf is None for leaf in leaves):
            return None
        if all(_same(leaf, first) for leaf in leaves):
            return first
        return list(leaves)

    return _map_leaves(list(outputs), join, "output")
