"""memfit.guard.batching: counting samples, splitting along dimension 0, joining outputs back."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

from memfit.errors import MemfitError
from memfit.guard.batching import chunk_sizes, concat_outputs, count_samples, slice_batch, split_batch


class Pair(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    source: str = "disk"


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    image: torch.Tensor
    extra: dict[str, torch.Tensor]


def _rows(n: int, width: int = 3) -> torch.Tensor:
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width)


@pytest.mark.parametrize(
    ("samples", "size", "expected"),
    [(10, 4, [4, 3, 3]), (9, 4, [3, 3, 3]), (8, 4, [4, 4]), (1, 1, [1]), (3, 8, [3]), (7, 1, [1] * 7), (5, 5, [5])],
)
def test_chunk_sizes(samples: int, size: int, expected: list[int]) -> None:
    assert chunk_sizes(samples, size) == expected


@pytest.mark.parametrize(("samples", "size"), [(0, 2), (4, 0), (-1, 1)])
def test_chunk_sizes_rejects_nonsense(samples: int, size: int) -> None:
    with pytest.raises(MemfitError):
        chunk_sizes(samples, size)


BATCHES: dict[str, Any] = {
    "tensor": _rows(5),
    "tuple": (_rows(5), torch.arange(5)),
    "list": [_rows(5), torch.arange(5)],
    "dict": {"x": _rows(5), "y": torch.arange(5), "tag": "train"},
    "ordered": collections.OrderedDict(x=_rows(5), y=torch.arange(5)),
    "namedtuple": Pair(_rows(5), torch.arange(5)),
    "dataclass": Sample(_rows(5), torch.arange(5)),
    "frozen-nested": FrozenSample(_rows(5), {"mask": torch.ones(5, 2), "ids": [torch.arange(5)]}),
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_count_samples(name: str) -> None:
    assert count_samples(BATCHES[name]) == 5


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("size", [1, 2, 3, 5, 9])
def test_split_keeps_type_and_every_sample_once(name: str, size: int) -> None:
    batch = BATCHES[name]
    micro_batches = split_batch(batch, size)
    assert [count_samples(m) for m in micro_batches] == chunk_sizes(5, size)
    assert all(type(m) is type(batch) for m in micro_batches)
    joined = concat_outputs(micro_batches)
    assert type(joined) is type(batch)
    original = _flat(batch)
    rebuilt = _flat(joined)
    assert len(original) == len(rebuilt)
    for a, b in zip(original, rebuilt):
        assert torch.equal(a, b)


def _flat(value: Any) -> list[torch.Tensor]:
    from memfit.guard.batching import _tensor_leaves

    return [tensor for _, tensor in _tensor_leaves(value)]


def test_split_returns_views_not_copies() -> None:
    batch = _rows(6)
    first = split_batch(batch, 4)[0]
    assert first.data_ptr() == batch.data_ptr()


def test_non_tensor_leaves_are_copied_into_every_micro_batch() -> None:
    micro_batches = split_batch({"x": _rows(4), "tag": "train", "n": 7, "none": None}, 3)
    assert [(m["tag"], m["n"], m["none"]) for m in micro_batches] == [("train", 7, None)] * 2


def test_defaultdict_keeps_its_factory() -> None:
    batch = collections.defaultdict(list, x=_rows(4))
    micro = split_batch(batch, 2)[0]
    assert isinstance(micro, collections.defaultdict) and micro.default_factory is list


def test_transformers_batch_encoding_splits() -> None:
    from transformers import BatchEncoding

    batch = BatchEncoding({"input_ids": torch.ones(4, 6, dtype=torch.long), "attention_mask": torch.ones(4, 6)})
    micro = split_batch(batch, 3)
    assert [type(m) for m in micro] == [BatchEncoding, BatchEncoding]
    assert [m["input_ids"].shape[0] for m in micro] == [2, 2]


@pytest.mark.parametrize("start, stop", [(0, 2), (1, 4), (3, 5)])
def test_slice_batch(start: int, stop: int) -> None:
    batch = {"x": _rows(5), "y": torch.arange(5)}
    part = slice_batch(batch, start, stop)
    assert part["y"].tolist() == list(range(start, stop))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"x": torch.zeros(8, 2), "mask": torch.zeros(4, 2)}, "batch['x'] has 8, batch['mask'] has 4"),
        ((torch.zeros(3), torch.zeros(5)), "batch[0] has 3, batch[1] has 5"),
        (Sample(torch.zeros(2, 1), torch.zeros(6)), "batch.image has 2, batch.label has 6"),
        ({"x": torch.zeros(3), "n": torch.tensor(3)}, "batch['n'] is a 0-dimensional tensor"),
        ({"text": ["a", "b"]}, "found no tensors"),
    ],
)
def test_unsplittable_batches_name_the_problem(batch: Any, message: str) -> None:
    with pytest.raises(MemfitError, match="pass split=") as caught:
        count_samples(batch)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_concat_outputs_of_model_outputs() -> None:
    from transformers.modeling_outputs import CausalLMOutput

    outs = [CausalLMOutput(loss=torch.tensor(float(i)), logits=torch.full((2, 3), float(i))) for i in range(3)]
    joined = concat_outputs(outs)
    assert isinstance(joined, CausalLMOutput)
    assert joined.logits.shape == (6, 3)
    assert joined.loss.tolist() == [0.0, 1.0, 2.0]  # one 0-d value per micro-batch, stacked


@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        ([{"n": 3, "x": torch.ones(1)}, {"n": 3, "x": torch.ones(2)}], {"n": 3}),
        ([{"n": 1, "x": torch.ones(1)}, {"n": 2, "x": torch.ones(2)}], {"n": [1, 2]}),
        ([{"n": None, "x": torch.ones(1)}, {"n": None, "x": torch.ones(2)}], {"n": None}),
    ],
)
def test_concat_outputs_non_tensor_leaves(outputs: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    joined = concat_outputs(outputs)
    assert joined["n"] == expected["n"]
    assert joined["x"].shape == (3,)


def test_concat_outputs_rejects_mismatched_structures() -> None:
    with pytest.raises(MemfitError, match="cannot concatenate"):
        concat_outputs([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(MemfitError, match="no outputs"):
        concat_outputs([])


# -- batch_dim: where the samples are -----------------------------------------------------------------

SEQ_FIRST = (torch.arange(35 * 6).reshape(35, 6), torch.arange(35 * 6).reshape(35, 6) + 1000)  # (sequence, batch)


def test_batch_dim_one_splits_sequence_first_tokens_along_the_batch() -> None:
    assert count_samples(SEQ_FIRST, 1) == 6
    micro_batches = split_batch(SEQ_FIRST, 4, batch_dim=1)
    assert [m[0].shape for m in micro_batches] == [(35, 3), (35, 3)]
    assert torch.equal(micro_batches[1][0], SEQ_FIRST[0][:, 3:])  # whole sequences, never cut
    assert micro_batches[0][0].data_ptr() == SEQ_FIRST[0].data_ptr()  # views
    joined = concat_outputs(micro_batches, batch_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(joined, SEQ_FIRST))


def test_per_element_batch_dim_with_shared_data() -> None:
    """Tokens (seq, batch), hidden state (layers, batch, hidden), a (seq, seq) mask every micro-batch gets whole."""
    mask = torch.zeros(35, 35)
    batch = {"tokens": SEQ_FIRST[0], "hidden": (torch.zeros(2, 6, 8), torch.ones(2, 6, 8)), "mask": mask}
    spec = {"tokens": 1, "hidden": 1, "mask": None}  # an int at a container applies to everything under it
    assert count_samples(batch, spec) == 6
    micro = split_batch(batch, 5, batch_dim=spec)
    assert [m["hidden"][1].shape for m in micro] == [(2, 3, 8), (2, 3, 8)]
    assert all(m["mask"] is mask for m in micro)
    assert count_samples(slice_batch(batch, 2, 5, spec), spec) == 3


def test_batch_dim_as_a_function_of_path_and_tensor() -> None:
    batch = (SEQ_FIRST[0], torch.arange(6))  # the second: one label per sequence

    def dim(path: str, tensor: torch.Tensor) -> int:
        return 1 if tensor.dim() == 2 else 0

    assert count_samples(batch, dim) == 6
    assert [m[1].tolist() for m in split_batch(batch, 3, batch_dim=dim)] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("batch", "batch_dim", "message"),
    [
        (SEQ_FIRST, (1,), "batch_dim has 1 entries where batch has 2"),
        ({"x": torch.zeros(3, 4)}, {"y": 0}, "batch_dim has keys ['y'] that batch does not have"),
        ({"x": torch.zeros(3, 4), "y": torch.zeros(4)}, {"x": 1}, "batch_dim gives no dimension for batch['y']"),
        ((torch.zeros(3), torch.zeros(3, 2)), 1, "batch[0] is a 1-dimensional tensor: it has no dimension 1"),
        (SEQ_FIRST, -1, "invalid batch_dim -1"),
        (SEQ_FIRST, (1, "x"), "invalid batch_dim 'x'"),
        ((torch.zeros(3, 4), torch.zeros(3, 5)), 1, "disagree on dimension 1 (the sample count)"),
    ],
)
def test_bad_batch_dims_are_one_line_errors(batch: Any, batch_dim: Any, message: str) -> None:
    with pytest.raises(MemfitError) as caught:
        count_samples(batch, batch_dim)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_outputs_join_along_the_batch_dim_of_a_per_element_spec() -> None:
    from memfit.guard.batching import output_batch_dim

    outputs = [torch.zeros(35, 4, 10), torch.ones(35, 2, 10)]
    assert concat_outputs(outputs, output_batch_dim((1, 1, None))).shape == (35, 6, 10)
    with pytest.raises(MemfitError, match="pass output_dim= to predict"):
        concat_outputs(outputs, output_batch_dim((1, 0)))
