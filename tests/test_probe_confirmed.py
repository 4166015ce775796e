"""A probe's exact maximum is one a fresh measure confirms; after a trial that ran out of memory the
device is back where it started; the estimate names what fake tensors cannot run and the way
around it (issue 20, item 9)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit import Workload
from memfit.estimator.fake import UnsupportedOperation
from memfit.run.measure import Measurement

WORKLOAD = "convnet:blocks=2,channels=4,image_size=8"


@pytest.mark.parametrize("trials", ["auto", "real"])
def test_the_exact_maximum_is_confirmed_by_a_fresh_measure(trials: str) -> None:
    gpu = memfit.device("sim:4MiB")
    after: list[tuple[int, bool, int]] = []

    def progress(batch: int, measurement: Measurement | None) -> None:
        if measurement is not None and not measurement.fake:
            after.append((batch, measurement.fits, gpu.memory_allocated()))

    result = memfit.probe(WORKLOAD, gpu, progress=progress, trials=trials)
    assert result.limit == "memory"
    # every real trial, those that ran out of memory too, left the device as it found it
    assert {fits for _, fits, _ in after} == {True, False}
    assert all(allocated == 0 for *_, allocated in after)
    best = result.max_batch_size
    assert memfit.measure(WORKLOAD, best, "sim:4MiB").fits
    assert not memfit.measure(WORKLOAD, best + 1, "sim:4MiB").fits


def _normal_nll(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    mean = model(batch)
    return -torch.distributions.Normal(mean, torch.ones_like(mean)).log_prob(torch.zeros_like(mean)).mean()


def _ctc(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    log_probs = model(inputs).log_softmax(-1).transpose(0, 1)
    n = inputs.shape[0]
    return nn.functional.ctc_loss(log_probs, targets, [10] * n, [3] * n)


def test_a_distributions_value_read_names_the_validation_and_the_switch_that_turns_it_off() -> None:
    workload = Workload(
        model=lambda: nn.Linear(4, 2), make_batch=lambda n: torch.randn(n, 4), loss=_normal_nll, name="gaussian"
    )
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)  # the default (__debug__), whatever ran before
    try:
        with pytest.raises(UnsupportedOperation) as caught:
            memfit.estimate(workload, 4, device="sim:64MiB", speed=False)
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)
    line = str(caught.value)
    assert "\n" not in line and "aten._local_scalar_dense" in line and "in _normal_nll" in line
    assert "torch.distributions.Distribution.set_default_validate_args(False)" in line
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:  # the way around works, and gives what the device measures
        estimated = memfit.estimate(workload, 4, device="sim:64MiB", speed=False)
        assert estimated.peak_allocated == memfit.measure(workload, 4, "sim:64MiB").peak_allocated
    finally:
        torch.distributions.Distribution.set_default_validate_args(previous)


def test_a_ctc_loss_is_named_with_the_way_around() -> None:
    workload = Workload(
        model=lambda: nn.Linear(8, 5),
        make_batch=lambda n: (torch.randn(n, 10, 8), torch.randint(1, 5, (n, 3))),
        loss=_ctc,
        name="ctc",
    )
    with pytest.raises(UnsupportedOperation, match=r"aten\._ctc_loss.* in _ctc .*CTC loss has no fake-tensor kernel"):
        memfit.estimate(workload, 4, device="sim:64MiB", speed=False)
    # probe's trials fall back to real runs by themselves, and say why
    lines: list[str] = []
    result = memfit.probe(workload, "sim:8MiB", max_batch_size=16, say=lines.append)
    assert result.max_batch_size == 16 and any("CTC loss has no fake-tensor kernel" in line for line in lines)
