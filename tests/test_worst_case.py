"""Worst-case batches from a dataset or DataLoader: the largest samples found without
loading the data (a length function, the dataset's sizes, else one read per sample),
collated with the training padding rules; probe uses them and names the sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import memfit
from memfit.cli import main
from memfit.errors import WorkloadError
from memfit.run.measure import measure
from memfit.search.probe import probe
from memfit.workload import WorstCase, pad_collate, worst_case_batches
from memfit.workload.worst_case import sample_shape

#: sequence lengths: mostly short, one long sample (index 37) that a first batch rarely holds
LENGTHS = [16 + (i * 7) % 24 for i in range(64)]
LENGTHS[37] = 200
VOCAB = 100


class Tokens(Dataset):
    """Token sequences of ``LENGTHS``; counts every sample it loads."""

    def __init__(self, lengths: list[int] = LENGTHS, sizes: bool = False) -> None:
        self.lengths_ = lengths
        self.loads = 0
        if sizes:
            self.sizes = list(lengths)  # per-sample sizes, as fairseq's datasets keep them

    def __len__(self) -> int:
        return len(self.lengths_)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.loads += 1
        ids = (torch.arange(self.lengths_[index]) * (index + 1)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def _loader(dataset: Dataset, multiple_of: int = 8) -> DataLoader:
    return DataLoader(
        dataset, batch_size=8, shuffle=True, collate_fn=pad_collate({"labels": -100}, multiple_of=multiple_of)
    )


def test_the_longest_sample_leads_and_the_batch_is_padded_as_the_loader_pads() -> None:
    batches = worst_case_batches(_loader(Tokens()))
    assert batches.largest == 37 and batches.found_by == "loaded each sample once"
    batch = batches(4)
    assert batch["input_ids"].shape == (4, 200) and batch["labels"].shape == (4, 200)  # 200 is a multiple of 8
    odd = worst_case_batches(_loader(Tokens(), multiple_of=64))(4)
    assert odd["input_ids"].shape == (4, 256)  # padded to a multiple of 64
    assert (batch["labels"][1:, LENGTHS[batches.indices(4)[1]] :] == -100).all()  # the shorter ones padded
    assert batches.padded_size(4) == (200,)


def test_a_length_function_finds_it_without_loading_a_sample() -> None:
    dataset = Tokens()
    batches = worst_case_batches(dataset, sample_size=lambda i: LENGTHS[i], collate=pad_collate())
    assert dataset.loads == 0 and batches.found_by == "sample_size(i)" and batches.largest == 37
    batches(3)
    assert dataset.loads == 3  # only the batch's samples


def test_the_datasets_own_sizes_are_used_when_it_has_them() -> None:
    dataset = Tokens(sizes=True)
    batches = worst_case_batches(dataset, collate=pad_collate())
    assert dataset.loads == 0 and batches.found_by == "dataset.sizes" and batches.largest == 37


def test_images_of_several_shapes_pad_to_the_largest_of_each_dimension() -> None:
    """A tall and a wide image each hold one of the largest dimensions: both lead."""
    images = [torch.zeros(3, 32, 32), torch.zeros(3, 96, 40), torch.zeros(3, 40, 80), torch.zeros(3, 64, 64)]
    batches = worst_case_batches(images, collate=pad_collate())
    assert set(batches.order[:2]) == {1, 2}
    assert tuple(batches(2).shape) == (2, 3, 96, 80)
    assert batches.padded_size(2) == (3, 96, 80)


def test_a_batch_larger_than_the_dataset_cycles_the_worst_samples() -> None:
    batches = worst_case_batches([torch.ones(n) for n in (2, 5, 3)], collate=pad_collate())
    assert batches.indices(5) == [1, 2, 0, 1, 2] and batches(5).shape == (5, 5)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "empty"),
        (type("Stream", (IterableDataset,), {"__iter__": lambda self: iter([])})(), "iterable dataset"),
    ],
)
def test_what_has_no_worst_case_to_find_is_refused(data: Any, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        worst_case_batches(data)


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(WorkloadError, match="not negative"):
        worst_case_batches(Tokens(), sample_size=lambda i: -1)


def test_sample_shape_is_the_largest_tensor_of_a_sample() -> None:
    assert sample_shape({"input_ids": torch.zeros(7), "label": torch.tensor(1)}) == (7,)
    assert sample_shape((torch.zeros(3, 8, 8), 4)) == (3, 8, 8)
    assert sample_shape([1, 2, 3]) == (3,)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(VOCAB, 64), nn.Linear(64, 256), nn.Linear(256, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(ids))))


def _lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _workload(make_batch: Any) -> memfit.Workload:
    return memfit.Workload(model=TinyLM, make_batch=make_batch, loss=_lm_loss, name="tiny-lm")


def test_probe_on_the_worst_case_finds_a_batch_the_longest_sample_does_not_break() -> None:
    """The failure of batch finders: a batch found on a first (short) batch runs out of
    memory on the longest sample. Probed on the worst case, it does not, and the result
    says which sample set the limit."""
    loader = _loader(Tokens())
    collate = loader.collate_fn
    dataset = loader.dataset

    def first_batch(n: int) -> Any:  # what a finder sees at the start: the first samples
        return collate([dataset[i % 8] for i in range(n)])

    worst = worst_case_batches(loader)
    device = "sim:8MiB"
    naive = probe(_workload(first_batch), device, guess=None)
    found = probe(_workload(worst), device, guess=None)
    assert found.max_batch_size < naive.max_batch_size
    assert not measure(_workload(worst), naive.max_batch_size, device).fits  # the long sample breaks it
    assert measure(_workload(worst), found.max_batch_size, device).fits
    assert found.extra["worst_case"] == {
        "sample": 37,
        "size": [200],
        "samples": 64,
        "found_by": "loaded each sample once",
    }
    assert "worst_case" not in naive.extra


WORKLOAD_FILE = """
import torch
from torch import nn
import memfit
from memfit.workload import pad_collate, worst_case_batches

LENGTHS = [8, 12, 40, 10]

def make():
    data = [torch.arange(n) % 50 for n in LENGTHS]
    model = lambda: nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    loss = lambda m, b: nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())
    batches = worst_case_batches(data, sample_size=lambda i: LENGTHS[i], collate=pad_collate())
    return memfit.Workload(model=model, make_batch=batches, loss=loss)
"""


def test_the_command_line_names_the_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "worst.py"
    path.write_text(WORKLOAD_FILE)
    assert (
        main(["probe", f"{path}:make", "--device", "sim:4MiB", "--no-estimate", "--max-batch-size", "8", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["worst_case"] == {"sample": 2, "size": [40], "samples": 4, "found_by": "sample_size(i)"}
    assert isinstance(worst_case_batches([torch.ones(2)]), WorstCase)
