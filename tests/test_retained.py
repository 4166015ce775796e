"""A trial after which device memory does not return to where it started names what holds it
(bytes, and the workload's reference), instead of the search answering for a smaller device
or blaming fake tensors (issue 20, items 6 and 9)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit import Workload
from memfit.errors import MemfitError
from memfit.run.measure import measure

#: what the leaking workload below keeps: every model it ever built
BUILT: list[nn.Module] = []


def leaking_gpt_like() -> Workload:
    """The way code written for ``optimizer(params)`` reached a model for its optimizer:
    the factory keeps each model in a global list, and no model is ever freed."""

    def build() -> nn.Module:
        BUILT.append(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
        return BUILT[-1]

    def optimizer(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(BUILT[-1].parameters(), lr=1e-3)

    return Workload(
        model=build,
        make_batch=lambda n: torch.randn(n, 64),
        loss=lambda m, b: m(b).pow(2).mean(),
        optimizer=optimizer,
        name="leaky",
    )


def test_measure_names_the_global_that_keeps_every_model() -> None:
    BUILT.clear()
    gpu = memfit.device("sim:64MiB")
    with pytest.warns(UserWarning, match=r"stayed allocated after the run at batch 4") as caught:
        first = measure(leaking_gpt_like(), 4, gpu)
    # the model (two Linear layers' weights and biases) stays, with its gradients set to None
    params = sum(p.numel() * 4 for p in BUILT[0].parameters())
    assert first.fits and params <= first.retained < params + 4 * 512
    assert "the model factory -> global BUILT of " in str(caught[0].message)
    with pytest.raises(MemfitError, match=r"global BUILT of .*every later trial would see a smaller device"):
        first.refuse_if_retained()


@pytest.mark.parametrize("trials", ["auto", "real"])
def test_probe_refuses_a_leaking_workload_in_one_line_naming_the_leak(trials: str) -> None:
    BUILT.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(
            MemfitError, match=r"leaky: .* stayed allocated .* held by the model factory -> global BUILT"
        ):
            memfit.probe(leaking_gpt_like(), "sim:16MiB", max_batch_size=64, trials=trials)


def test_plan_refuses_a_leaking_workload_instead_of_blaming_fake_tensors(tmp_path: Path) -> None:
    BUILT.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(MemfitError, match=r"held by the model factory -> global BUILT") as caught:
            memfit.plan(leaking_gpt_like(), 16, "sim:16MiB", precisions=["fp32"], checkpointing=["none"])
    assert "fake tensors" not in str(caught.value)


def test_a_workload_that_keeps_nothing_leaves_the_device_where_it_started() -> None:
    gpu = memfit.device("sim:16MiB")
    workload = memfit.load_workload("mlp:layers=2,width=64")
    for batch in (4, 4096, 8):  # 4096 runs out of memory: its failed step's tensors go too
        result = measure(workload, batch, gpu)
        assert result.retained == 0 and result.retained_by is None
        assert gpu.memory_allocated() == 0
    assert not measure(workload, 4096, gpu).fits


def test_a_scripts_own_model_and_optimizer_staying_on_the_device_is_not_a_leak() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    workload = Workload(
        model=model,
        make_batch=lambda n: torch.randn(n, 16),
        loss=lambda m, b: m(b).mean(),
        optimizer=lambda p: optimizer,
    )
    gpu = memfit.device("sim:64MiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        results = [measure(workload, 8, gpu) for _ in range(3)]
    assert [r.retained for r in results] == [0, 0, 0] and gpu.memory_allocated() > 0
