"""preserved(): parameters, buffers, gradients, optimizer, GradScaler and RNGs come back bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from memfit.run.state import Snapshot, preserved, restore_rng, save_rng


def make_training_state() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A model with a BatchNorm (buffers), gradients, AdamW state and an fp16 GradScaler, one step in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaler.scale(model(torch.randn(6, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    model(torch.randn(6, 4)).sum().backward()  # gradients present at snapshot time
    return model, optimizer, scaler


def train_some_more(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    model.eval()
    model.train()
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(torch.randn(6, 4)).pow(2).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.param_groups[0]["lr"] = 0.5
    model.eval()


def tensors_of(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, torch.Tensor]]:
    state = optimizer.state_dict()["state"]
    return [
        (index, key, value.clone()) for index, entry in sorted(state.items()) for key, value in sorted(entry.items())
    ]


def assert_bit_identical(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_model_optimizer_scaler_and_rngs_come_back_bit_identical() -> None:
    model, optimizer, scaler = make_training_state()
    params_before = list(model.parameters())
    values, grads = tensors_of(model), grads_of(model)
    opt_before = optimizer_tensors(optimizer)
    scaler_before = scaler.state_dict()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    rng_before = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(1), np.random.seed(2), torch.manual_seed(3)

    with preserved(model, optimizer, scaler):
        train_some_more(model, optimizer, scaler)
        random.random(), np.random.rand(), torch.rand(5)
        assert not torch.equal(next(model.parameters()), values[0])

    assert list(model.parameters()) == params_before  # the same objects: the optimizer still holds them
    assert_bit_identical(tensors_of(model), values)
    for after, before in zip(grads_of(model), grads):
        assert before is not None and after is not None and torch.equal(after, before)
    after = optimizer_tensors(optimizer)
    assert [(i, k) for i, k, _ in after] == [(i, k) for i, k, _ in opt_before]
    assert_bit_identical([t for *_, t in after], [t for *_, t in opt_before])
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert scaler.state_dict() == scaler_before
    assert model.training
    assert (random.random(), np.random.rand(), torch.rand(1)) == rng_before


def test_restored_even_when_the_block_raises() -> None:
    model = nn.Linear(3, 3)
    before = tensors_of(model)
    with pytest.raises(ValueError, match="boom"), preserved(model):
        with torch.no_grad():
            model.weight.mul_(2)
        raise ValueError("boom")
    assert_bit_identical(tensors_of(model), before)


def test_gradients_that_were_absent_stay_absent() -> None:
    model = nn.Linear(3, 1)
    with preserved(model):
        model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_without_state_is_emptied_again() -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    with preserved(optimizer):
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        assert optimizer.state
    assert not optimizer.state


def test_rng_round_trip() -> None:
    state = save_rng()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    restore_rng(state)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_snapshot_add_skips_none_and_duplicates() -> None:
    model = nn.Linear(2, 2)
    snapshot = Snapshot.take([model, None])
    count = len(snapshot.tensors)
    snapshot.add(model)
    snapshot.add(None)
    assert len(snapshot.tensors) == count == 2


def test_unsupported_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="cannot preserve a int"):
        Snapshot.take([3])


def test_requires_grad_and_a_frozen_parameter_come_back() -> None:
    model, optimizer, _ = make_training_state()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    with preserved(model, optimizer):
        frozen.requires_grad_(True)
        model[2].bias.requires_grad_(False)
    assert not frozen.requires_grad and model[2].bias.requires_grad
