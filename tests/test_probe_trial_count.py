"""Probe's real trials with an exact estimate (issue 22): the maximum from the estimate
(2 trials: it fits, the next does not) and the headroom batch from the estimate's memory
line (2 trials: it keeps the headroom, the next does not): at most 4 real trials, on zoo
workloads and an RNN, with the trial count in the result."""

from __future__ import annotations

import json
import math

import pytest

import memfit
from memfit.cli import main
from memfit.search.probe import probe

CASES = [
    # every batch reserves the whole 4 MiB: no batch keeps the headroom (batch 1 proves it)
    ("mlp:layers=1,width=8,features=16384", "sim:4MiB"),
    ("convnet:blocks=1,channels=4,image_size=16", "sim:4MiB"),
    ("lstm-lm:vocab=64,emsize=16,hidden=16,layers=1,seq_len=8", "sim:4MiB"),
    pytest.param("gpt:layers=1,embd=16,heads=2,seq_len=16,vocab=64", "sim:4MiB", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("ref", "spec"), CASES)
def test_an_exact_estimate_costs_at_most_four_real_trials(ref: str, spec: str) -> None:
    result = probe(ref, spec, trials="real")
    assert result.extra["real_trials"] == len(result.trials) <= 4
    assert result.extra["fake_trials"] == 0
    ran = {t.batch_size: t for t in result.trials}
    # the maximum: it fits, the next batch does not
    assert ran[result.max_batch_size].fits and not ran[result.max_batch_size + 1].fits
    # the headroom batch: within the budget, and the next batch is not (or it is the maximum)
    budget = math.floor(0.95 * memfit.device(spec).capacity)
    h = result.headroom_batch_size
    if ran[h].peak_reserved > budget:
        assert h == 1 and "no batch keeps" in result.reason  # nothing keeps it: said so
        return
    assert ran[h].fits
    if h < result.max_batch_size:
        assert ran[h + 1].peak_reserved > budget or not ran[h + 1].fits


def test_the_trial_count_is_in_probes_json(capsys: pytest.CaptureFixture[str]) -> None:
    ref, spec = CASES[0]
    assert main(["probe", ref, "--device", spec, "--trials", "real", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["real_trials"] == len(data["trials"]) <= 4 and data["fake_trials"] == 0
