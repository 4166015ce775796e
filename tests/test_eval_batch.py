"""``probe(evaluation=...)`` / ``memfit probe --eval``: the largest evaluation batch (eval
mode, no gradients, no optimizer state), exact on a simulated GPU and larger than the
training maximum."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import memfit
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.run.measure import measure
from memfit.search.eval_probe import eval_measure
from memfit.search.probe import probe
from memfit.workload import load_workload

ZOO = "mlp:layers=4,width=512,features=512"
SIM = "sim:24MiB"


@pytest.fixture(scope="module")
def both() -> tuple[memfit.ProbeResult, memfit.ProbeResult]:
    wl = load_workload(ZOO)
    return probe(wl, SIM, guess=None), probe(wl, SIM, guess=None, evaluation=True)


def test_the_evaluation_batch_is_larger_than_the_training_maximum(
    both: tuple[memfit.ProbeResult, memfit.ProbeResult],
) -> None:
    training, evaluation = both
    assert evaluation.max_batch_size > 1.5 * training.max_batch_size
    assert evaluation.extra["evaluation"] == "no_grad" and "evaluation" not in training.extra
    assert evaluation.limit == "memory"


def test_the_evaluation_maximum_is_exact_on_the_simulated_gpu(
    both: tuple[memfit.ProbeResult, memfit.ProbeResult],
) -> None:
    _, evaluation = both
    wl = load_workload(ZOO)
    top = evaluation.max_batch_size
    assert eval_measure(wl, top, SIM).fits
    assert not eval_measure(wl, top + 1, SIM).fits
    assert not measure(wl, top, SIM).fits  # the training step at that batch does not fit


def test_an_evaluation_holds_no_gradients_or_optimizer_state() -> None:
    """At one batch the evaluation peaks below the training step by at least the
    gradients and AdamW's two states (three copies of the parameters)."""
    wl = load_workload(ZOO)
    params = sum(p.numel() * p.element_size() for p in wl.build_model().parameters())
    trained, evaluated = measure(wl, 64, "sim:1GiB"), eval_measure(wl, 64, "sim:1GiB")
    assert trained.peak_allocated - evaluated.peak_allocated >= 3 * params
    under_inference = eval_measure(wl, 64, "sim:1GiB", mode="inference_mode")
    assert under_inference.fits and under_inference.peak_allocated <= evaluated.peak_allocated


def test_a_model_instance_is_left_in_training_mode_with_its_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1), nn.Linear(64, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wl = memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
    )
    result = probe(wl, "sim:4MiB", guess=None, evaluation="inference_mode")
    assert result.max_batch_size > 0 and result.extra["evaluation"] == "inference_mode"
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"evaluation": "eval"}, "invalid evaluation 'eval'"),
        ({"evaluation": True, "settings": memfit.Settings(world_size=2)}, "drop world size 2"),
    ],
)
def test_bad_evaluation_requests_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(MemfitError, match=message) as info:
        probe(ZOO, SIM, **kwargs)
    assert "\n" not in str(info.value)


def test_the_command_line_probes_the_evaluation_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "mlp:layers=1,width=64,features=64", "--device", "sim:8MiB", "--eval", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["evaluation"] == "no_grad" and data["max_batch_size"] > 0 and data["fake_trials"] == 0
    assert main(["probe", "mlp:layers=1,width=64,features=64", "--device", "sim:8MiB", "--inference-mode"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --eval" in err
