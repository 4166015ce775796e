"""A torch.compile'd workload is estimated as eager, and the estimate says so (result, JSON,
text) instead of saying nothing. Nothing here compiles: under memfit's dispatch modes
TorchDynamo runs the eager code (which is why the estimate is eager)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.cli import main
from memfit.estimator.compiled import CompileWatch, is_compiled_callable
from memfit.estimator.estimate import estimate
from memfit.run.measure import measure

SIM = "sim:256MiB"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batch(n: int) -> Any:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


def _workload(model: Any, loss: Callable[..., torch.Tensor] = _loss) -> memfit.Workload:
    return memfit.Workload(model=model, make_batch=_batch, loss=loss)


@torch.compile
def _fused_gelu(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x) * 2


class WithCompiledHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_fused_gelu(self.inp(x)))


def _compiled_in_place() -> nn.Module:
    model = _net()
    model[0].compile()
    return model


def _compiled_forward() -> nn.Module:
    model = _net()
    model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    return model


@pytest.mark.parametrize(
    ("model", "loss", "part"),
    [
        (lambda: torch.compile(_net()), _loss, "the model (torch.compile)"),
        (_compiled_in_place, _loss, "module '0' (Module.compile)"),
        (_compiled_forward, _loss, "the model's forward (torch.compile)"),
        (WithCompiledHelper, _loss, "a function called while the step runs (torch.compile)"),
        (_net, torch.compile(_loss), "loss (torch.compile)"),
    ],
)
def test_a_compiled_workload_is_estimated_as_eager_and_says_so(model: Any, loss: Any, part: str) -> None:
    est = estimate(_workload(model, loss), 16, device=SIM, search=False)
    assert est.compile_note.startswith("estimated as eager: ")
    assert part in est.compile_note and "TorchDispatchMode" in est.compile_note
    # the eager step's figures, as the simulated GPU measures them (it runs eager too)
    run = measure(_workload(model, loss), 16, SIM)
    assert (est.peak_allocated, est.peak_reserved) == (run.peak_allocated, run.peak_reserved)


def test_the_figures_are_the_eager_models() -> None:
    compiled = estimate(_workload(lambda: torch.compile(_net())), 16, device=SIM, search=False)
    eager = estimate(_workload(_net), 16, device=SIM, search=False)
    assert compiled.peak_allocated == eager.peak_allocated and compiled.breakdown == eager.breakdown
    assert eager.compile_note == ""


def test_a_compiled_model_instance_is_named_too() -> None:
    est = estimate(_workload(torch.compile(_net())), 16, device=SIM, search=False)
    assert "the model (torch.compile)" in est.compile_note


def test_the_watch_knows_compiled_callables_from_plain_ones() -> None:
    assert is_compiled_callable(torch.compile(_loss)) and not is_compiled_callable(_loss)
    watch = CompileWatch()
    watch.inspect_model(_net())
    watch.inspect_functions({"loss": _loss})
    assert watch.parts == [] and watch.note() == ""


WORKLOAD_FILE = """
import torch
from torch import nn
import memfit

def make():
    model = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    return memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
    )
"""


def test_the_command_line_shows_it_in_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "compiled_workload.py"
    path.write_text(textwrap.dedent(WORKLOAD_FILE))
    assert main(["estimate", f"{path}:make", "--device", SIM, "--batch-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["compile_note"].startswith("estimated as eager: the model (torch.compile)")
    assert main(["estimate", f"{path}:make", "--device", SIM, "--batch-size", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "torch.compile: estimated as eager" in out
