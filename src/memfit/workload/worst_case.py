"""Worst-case batches from a dataset: the largest samples, collated as training collates them.

Why: the batch size a finder picks at the start runs out of memory hours later on the
longest sequence or the largest image (the most reported failure of every batch-size
finder). A workload's ``make_batch(n)`` must give the worst case; given the dataset (or
its DataLoader), :func:`worst_case_batches` finds it without loading the data into memory:

- the size of every sample, the cheapest way there is: ``sample_size(i)`` when given (a
  length from an index, a metadata column), else the dataset's own ``sizes`` or
  ``lengths`` (fairseq's and many bucketing datasets' per-sample sizes), else each sample
  loaded once by ``dataset[i]``, measured (its largest tensor's shape) and dropped;
- the worst samples first: for sizes with several dimensions (C, H, W), the sample with
  the largest of each dimension comes first (a batch padded to its longest is as large
  as the largest of each dimension), then the rest by size;
- ``make_batch(n)``: the first ``n`` of that order (cycled when ``n`` is larger than the
  dataset), loaded by index and collated by the DataLoader's ``collate_fn`` (or
  ``collate``), so its padding rules (to the longest, to a multiple of 8, to a fixed
  length) are the ones training meets. :func:`pad_collate` is one such rule.

:meth:`WorstCase.describe` names the sample that sets the limit; probe reports it.

>>> import torch
>>> data = [torch.ones(n, dtype=torch.long) for n in (3, 9, 5)]
>>> batches = worst_case_batches(data, collate=pad_collate(multiple_of=4))
>>> batches.largest, tuple(batches(2).shape)
(1, (2, 12))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import WorkloadError

__all__ = ["WorstCase", "worst_case_batches", "pad_collate", "sample_shape"]

#: a sample's size: a length, or a shape
Size = tuple[int, ...]


def sample_shape(sample: Any) -> Size:
    """The shape of the largest tensor in a sample (a tensor, a list of ints, or a tuple,
    list or dict of them): what padding and memory follow.

    Args:
        sample: one item of the dataset.
    """
    if isinstance(sample, torch.Tensor):
        return tuple(sample.shape)
    if isinstance(sample, Mapping):
        return max((sample_shape(v) for v in sample.values()), key=math.prod, default=())
    if isinstance(sample, (list, tuple)):
        if sample and all(isinstance(v, (int, float, bool)) for v in sample):
            return (len(sample),)  # a tokenized sequence as a list
        return max((sample_shape(v) for v in sample), key=math.prod, default=())
    return ()


def _as_size(value: Any, index: int) -> Size:
    size = tuple(int(v) for v in value) if isinstance(value, (tuple, list, torch.Size)) else (int(value),)
    if any(v < 0 for v in size):
        raise WorkloadError(f"the size of sample {index} is {size}: sizes are not negative")
    return size


def _worst_first(sizes: Sequence[Size]) -> list[int]:
    """Indices, the worst first: the largest of each dimension, then by number of elements."""
    by_elements = sorted(range(len(sizes)), key=lambda i: (-math.prod(sizes[i]), i))
    ranks = {len(s) for s in sizes}
    if len(ranks) != 1 or ranks == {1}:
        return by_elements
    varying = [d for d in range(ranks.pop()) if len({s[d] for s in sizes}) > 1]  # (not the 3 channels)
    # per varying dimension, the first sample holding its largest value
    largest = {d: max(s[d] for s in sizes) for d in varying}
    firsts = [next(i for i, s in enumerate(sizes) if s[d] == largest[d]) for d in varying]
    leading = list(dict.fromkeys(firsts))
    return leading + [i for i in by_elements if i not in leading]


@dataclass(frozen=True, eq=False)  # eq=False: compared (and hashed) by identity, as the dataset is
class WorstCase:
    """``make_batch(n)`` of a dataset's worst case (see the module)."""

    dataset: Any
    sizes: tuple[Size, ...]
    order: tuple[int, ...]
    collate: Callable[[list[Any]], Any]
    #: how the sizes were found ("sample_size(i)", "dataset.sizes", "loaded each sample once")
    found_by: str

    @property
    def largest(self) -> int:
        """The index of the sample that sets the limit (the first of the worst)."""
        return self.order[0]

    def indices(self, n: int) -> list[int]:
        """The samples of the worst batch of ``n``."""
        return [self.order[i % len(self.order)] for i in range(n)]

    def padded_size(self, n: int) -> Size:
        """The largest of each dimension among the worst ``n`` samples (before the collate's rounding)."""
        chosen = [self.sizes[i] for i in self.indices(n)]
        if len({len(s) for s in chosen}) != 1:
            return max(chosen, key=math.prod)
        return tuple(max(dims) for dims in zip(*chosen, strict=True))

    def __call__(self, n: int) -> Any:
        return self.collate([self.dataset[i] for i in self.indices(n)])

    def describe(self) -> dict[str, Any]:
        """The sample that sets the limit, its size, of how many, and how the sizes were found."""
        return {
            "sample": self.largest,
            "size": list(self.sizes[self.largest]),
            "samples": len(self.sizes),
            "found_by": self.found_by,
        }


def _dataset_of(data: Any, collate: Callable[[list[Any]], Any] | None) -> tuple[Any, Callable[[list[Any]], Any]]:
    """The map-style dataset and the collate function of a dataset or a DataLoader."""
    if isinstance(data, torch.utils.data.DataLoader):
        return data.dataset, collate or data.collate_fn
    return data, collate or torch.utils.data.default_collate


def _sizes(dataset: Any, sample_size: Callable[[int], Any] | None) -> tuple[tuple[Size, ...], str]:
    count = len(dataset)
    if sample_size is not None:
        return tuple(_as_size(sample_size(i), i) for i in range(count)), "sample_size(i)"
    for name in ("sizes", "lengths"):
        given = getattr(dataset, name, None)
        if given is not None and not callable(given) and len(given) == count:
            return tuple(_as_size(given[i], i) for i in range(count)), f"dataset.{name}"
    # The one way left costs a read of every sample: one at a time, each dropped once measured.
    return tuple(sample_shape(dataset[i]) for i in range(count)), "loaded each sample once"


def worst_case_batches(
    data: Any,
    *,
    sample_size: Callable[[int], Any] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
) -> WorstCase:
    """A workload's ``make_batch`` at the dataset's worst case (see the module).

    Args:
        data: a map-style dataset (``len`` and ``dataset[i]``) or a DataLoader over one
            (its ``collate_fn`` is used).
        sample_size: the size of sample ``i`` without loading it: a length, or a shape.
        collate: turns a list of samples into a batch (default: the DataLoader's, else
            PyTorch's ``default_collate``).

    Raises:
        WorkloadError: an iterable dataset (no index to look samples up by), an empty one,
            or a negative size.
    """
    dataset, collate_fn = _dataset_of(data, collate)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise WorkloadError(
            "an iterable dataset has no index to find its largest samples by: give a map-style dataset, "
            "or a make_batch(n) that returns the worst case"
        )
    if len(dataset) == 0:
        raise WorkloadError("the dataset is empty: there is no worst case to find")
    sizes, found_by = _sizes(dataset, sample_size)
    return WorstCase(dataset, sizes, tuple(_worst_first(sizes)), collate_fn, found_by)


def pad_collate(pad_value: float | Mapping[str, float] = 0, multiple_of: int = 1) -> Callable[[list[Any]], Any]:
    """A collate that pads every dimension to the batch's longest, rounded up to ``multiple_of``.

    Samples are tensors, or dicts or tuples of tensors (padded key by key); a scalar stacks.

    Args:
        pad_value: the padding value (per key for dict samples: ``{"labels": -100}``; 0 elsewhere).
        multiple_of: round each padded dimension up to a multiple of this (8 suits tensor cores).
    """
    if multiple_of < 1:
        raise WorkloadError(f"invalid multiple_of {multiple_of}: must be at least 1")

    def pad(tensors: list[torch.Tensor], value: float) -> torch.Tensor:
        tensors = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
        if tensors[0].dim() == 0:
            return torch.stack(tensors)
        target = [-(-max(dims) // multiple_of) * multiple_of for dims in zip(*(t.shape for t in tensors), strict=True)]
        out = tensors[0].new_full((len(tensors), *target), value)
        for row, tensor in zip(out, tensors, strict=True):
            row[tuple(slice(0, d) for d in tensor.shape)] = tensor
        return out

    def value_of(key: str) -> float:
        return pad_value.get(key, 0) if isinstance(pad_value, Mapping) else pad_value

    def collate(samples: list[Any]) -> Any:
        first = samples[0]
        if isinstance(first, Mapping):
            return {key: pad([s[key] for s in samples], value_of(key)) for key in first}
        if isinstance(first, tuple):
            return tuple(pad([s[i] for s in samples], value_of("")) for i in range(len(first)))
        return pad(samples, value_of(""))

    return collate
