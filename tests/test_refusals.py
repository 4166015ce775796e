"""Refused before any work, one line each: closure optimizers (L-BFGS) and Lightning's manual
optimization (issue 20, item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import memfit
from memfit import Workload
from memfit.errors import WorkloadError

LBFGS_LINE = r"LBFGS\.step needs a closure .* search with a first-order optimizer"


def lbfgs_workload(forwards: list[int]) -> Workload:
    """A small regression trained with L-BFGS, as pytorch/examples' time-series program does."""

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        forwards.append(1)
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    return Workload(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
        make_batch=lambda n: (torch.randn(n, 8), torch.randn(n, 1)),
        loss=loss,
        optimizer=lambda params: torch.optim.LBFGS(params, lr=0.8),
        name="lbfgs",
    )


@pytest.mark.parametrize("command", ["measure", "estimate", "probe", "plan"])
def test_a_closure_optimizer_is_refused_in_one_line_before_any_forward(command: str) -> None:
    forwards: list[int] = []
    workload = lbfgs_workload(forwards)
    with pytest.raises(WorkloadError, match=LBFGS_LINE) as caught:
        if command == "measure":
            memfit.measure(workload, 4, "sim:64MiB")
        elif command == "estimate":
            memfit.estimate(workload, 4, device="sim:64MiB", speed=False)
        elif command == "probe":
            memfit.probe(workload, "sim:64MiB", max_batch_size=64)
        else:
            memfit.plan(workload, 8, "sim:64MiB", precisions=["fp32"])
    assert forwards == [] and "\n" not in str(caught.value)


def test_fit_refuses_a_closure_optimizer_and_writes_nothing(tmp_path: Path) -> None:
    forwards: list[int] = []
    with pytest.raises(WorkloadError, match=LBFGS_LINE):
        memfit.fit(
            lbfgs_workload(forwards),
            "sim:64MiB",
            max_batch_size=64,
            lock_path=tmp_path / "memfit.lock",
            report_dir=tmp_path / "report",
            run_doctor=False,
        )
    assert forwards == [] and not (tmp_path / "memfit.lock").exists()


def test_the_cli_refuses_a_closure_optimizer_with_exit_status_2(tmp_path: Path, run_cli) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\nimport memfit\n\n"
        "def make():\n"
        "    return memfit.Workload(model=lambda: nn.Linear(4, 1),\n"
        "        make_batch=lambda n: (torch.randn(n, 4), torch.randn(n, 1)),\n"
        "        loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),\n"
        "        optimizer=lambda params: torch.optim.LBFGS(params))\n"
    )
    status, out, err = run_cli("probe", f"{script}:make", "--device", "sim:64MiB", "--max-batch-size", "16")
    assert status == 2 and out == ""
    assert err.strip().startswith("memfit: error: workload") and "LBFGS.step needs a closure" in err
    assert len(err.strip().splitlines()) == 1
