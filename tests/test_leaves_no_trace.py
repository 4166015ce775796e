"""plan, fit and probe leave a model instance, its optimizer and every RNG bit-identical,
on success and when the user's loss raises (issue 20, item 5)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import memfit
from memfit import Workload


def script_state() -> tuple[Workload, torch.nn.Module, torch.optim.Optimizer]:
    """A training script's own model (one layer frozen, in eval mode) and AdamW, one step in."""
    torch.manual_seed(0)
    base = memfit.load_workload("convnet:blocks=2,channels=4,image_size=8")
    model = base.build_model()
    first = next(model.parameters())
    first.requires_grad_(False)  # a frozen layer: plan must not unfreeze it
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    base.loss(model, base.make_batch(4)).backward()
    optimizer.step()
    model.eval()
    workload = Workload(
        model=model, make_batch=base.make_batch, loss=base.loss, optimizer=lambda params: optimizer, name="script"
    )
    return workload, model, optimizer


def everything(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "tensors": [t.detach().clone() for t in [*model.parameters(), *model.buffers()]],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "state": [
            (i, k, v.clone()) for i, entry in sorted(optimizer.state_dict()["state"].items()) for k, v in entry.items()
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }


def assert_identical(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before["tensors"], after["tensors"], strict=True)
    )
    assert all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(before["grads"], after["grads"], strict=True)
    )
    assert before["requires_grad"] == after["requires_grad"] and before["training"] == after["training"]
    assert [(i, k) for i, k, _ in before["state"]] == [(i, k) for i, k, _ in after["state"]]
    assert all(torch.equal(a, b) for (*_, a), (*_, b) in zip(before["state"], after["state"], strict=True))
    assert before["groups"] == after["groups"]


def seeded_draws() -> tuple[float, float, torch.Tensor]:
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    return random.random(), float(np.random.rand()), torch.rand(3)


def assert_rng_untouched(expected: tuple[float, float, torch.Tensor]) -> None:
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    assert draws[:2] == expected[:2] and torch.equal(draws[2], expected[2])


def failing_after(workload: Workload, calls: int) -> Workload:
    seen: list[int] = []
    loss = workload.loss

    def broken(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        seen.append(1)
        value = loss(model, batch)  # the forward has run (BatchNorm's statistics moved)
        if len(seen) > calls:
            raise ValueError("a bug in the user's loss")
        return value

    workload.loss = broken
    return workload


def test_plan_leaves_a_model_instance_its_optimizer_and_every_rng_as_they_were() -> None:
    workload, model, optimizer = script_state()
    before = everything(model, optimizer)
    expected = seeded_draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)

    result = memfit.plan(workload, 8, "sim:4MiB", precisions=["fp32"])

    assert result.recommended is not None and result.trial_steps >= 2
    assert_identical(before, everything(model, optimizer))
    assert_rng_untouched(expected)


def test_plan_leaves_everything_as_it_was_when_the_users_loss_raises() -> None:
    workload, model, optimizer = script_state()
    before = everything(model, optimizer)
    expected = seeded_draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)

    with pytest.raises(ValueError, match="a bug in the user's loss"):
        memfit.plan(failing_after(workload, 0), 8, "sim:4MiB", precisions=["fp32"])

    assert_identical(before, everything(model, optimizer))
    assert_rng_untouched(expected)


def test_plan_of_a_model_factory_draws_nothing_from_the_callers_random_streams() -> None:
    expected = seeded_draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    memfit.plan("mlp:layers=1,width=16,features=8", 8, "sim:8MiB", precisions=["fp32"], checkpointing=["none"])
    assert_rng_untouched(expected)


@pytest.mark.parametrize("fails", [False, True])
def test_fit_leaves_a_model_instance_its_optimizer_and_every_rng_as_they_were(tmp_path: Path, fails: bool) -> None:
    workload, model, optimizer = script_state()
    before = everything(model, optimizer)
    expected = seeded_draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)

    def run() -> Any:
        return memfit.fit(
            failing_after(workload, 6) if fails else workload,
            "sim:4MiB",
            target_batch_size=8,
            max_batch_size=16,
            precisions=["fp32"],
            lock_path=tmp_path / "memfit.lock",
            report_dir=None,
            run_doctor=False,
        )

    if fails:
        with pytest.raises(ValueError, match="a bug in the user's loss"):
            run()
        assert not (tmp_path / "memfit.lock").exists()
    else:
        assert run().plan.recommended is not None
    assert_identical(before, everything(model, optimizer))
    assert_rng_untouched(expected)
