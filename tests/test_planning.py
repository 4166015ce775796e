"""plan(): candidate generation, pruning, dominance, the exact trials run, advice."""

from __future__ import annotations

from typing import ClassVar

import pytest

import memfit
from memfit.errors import DoesNotFitError, MemfitError
from memfit.run.measure import Measurement
from memfit.run.settings import Settings
from memfit.search.plan import advice, candidates, divisors, dominates, plan

MLP = "mlp:layers=4,width=64,features=32"


@pytest.mark.parametrize(
    ("n", "expected"), [(1, [1]), (12, [12, 6, 4, 3, 2, 1]), (13, [13, 1]), (16, [16, 8, 4, 2, 1])]
)
def test_divisors(n, expected):
    assert divisors(n) == expected


@pytest.mark.parametrize(("target", "world"), [(12, 1), (64, 2), (96, 4), (7, 7), (1, 1)])
def test_every_candidate_multiplies_to_the_target(target, world):
    pool = candidates(target, world_size=world)
    assert pool
    assert all(s.micro_batch_size * s.accumulation_steps * world == target for s in pool)
    assert {s.precision for s in pool} == {"fp32", "bf16", "fp16"}
    assert {s.checkpointing for s in pool} == {"none", "blocks"}
    assert len(pool) == len(set(pool)) == 6 * len(divisors(target // world))


@pytest.mark.parametrize(
    ("target", "world", "message"),
    [(13, 2, "choose a multiple of 2, such as 12"), (0, 1, "invalid target"), (3, 4, "such as 4")],
)
def test_impossible_targets(target, world, message):
    with pytest.raises(MemfitError, match=message):
        candidates(target, world_size=world)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Settings("fp32", "none", 8, 1), Settings("fp32", "none", 4, 2), True),
        (Settings("fp32", "none", 8, 1), Settings("fp32", "blocks", 8, 1), True),
        (Settings("fp32", "blocks", 8, 1), Settings("fp32", "none", 4, 2), False),
        (Settings("fp32", "none", 4, 2), Settings("fp32", "none", 8, 1), False),
        (Settings("bf16", "none", 8, 1), Settings("fp32", "none", 4, 2), False),
        (Settings("fp32", "none", 8, 1), Settings("fp32", "none", 8, 1), False),
    ],
)
def test_dominates(a, b, expected):
    assert dominates(a, b) is expected


class FormulaDevice:
    """Trials from a formula: memory per sample by precision and checkpointing, speed
    growing with the micro-batch. Records the candidates tried, in order."""

    FACTOR: ClassVar[dict[tuple[str, str], float]] = {
        ("fp32", "none"): 1.0,
        ("bf16", "none"): 0.5,
        ("fp16", "none"): 0.5,
        ("fp32", "blocks"): 0.3,
        ("bf16", "blocks"): 0.15,
        ("fp16", "blocks"): 0.15,
    }
    SPEED: ClassVar[dict[str, float]] = {"fp32": 1.0, "bf16": 1.6, "fp16": 1.5}

    def __init__(self, per_sample: int, capacity: int, base: int = 100) -> None:
        self.per_sample, self.capacity, self.base = per_sample, capacity, base
        self.tried: list[tuple[int, str, str]] = []

    def memory(self, s: Settings) -> int:
        return self.base + int(self.per_sample * s.micro_batch_size * self.FACTOR[(s.precision, s.checkpointing)])

    def trial(self, wl, s: Settings, device) -> Measurement:
        self.tried.append((s.micro_batch_size, s.precision, s.checkpointing))
        peak = self.memory(s)
        if peak > self.capacity:
            return Measurement(s.micro_batch_size, False, self.capacity, self.capacity, None)
        speed = self.SPEED[s.precision] * (0.75 if s.checkpointing == "blocks" else 1.0)
        seconds = s.micro_batch_size / (speed * 100 * s.micro_batch_size / (s.micro_batch_size + 4))
        return Measurement(s.micro_batch_size, True, peak, peak, seconds)

    def predictor(self, exact: bool = True):
        self.predicted: list[tuple[str, str]] = []

        def predict(wl, s: Settings, device, limit: int) -> int:
            self.predicted.append((s.precision, s.checkpointing))
            per = self.per_sample * self.FACTOR[(s.precision, s.checkpointing)]
            guess = int((self.capacity - self.base) // per)
            return min(limit, guess if exact else guess * 2)  # exact, or an optimistic estimator

        return predict


def run_plan(fake: FormulaDevice, target: int, exact: bool = True, **kwargs):
    return plan(MLP, target, memfit.device("sim:1GiB"), predictor=fake.predictor(exact), run_trial=fake.trial, **kwargs)


def test_trials_run_in_order_and_dominated_candidates_are_skipped():
    fake = FormulaDevice(per_sample=100, capacity=1000)  # fp32 fits 9, bf16 18, blocks fp32 30
    result = run_plan(fake, 32)
    assert fake.tried == [
        (8, "fp32", "none"),
        (16, "bf16", "none"),
        (16, "fp16", "none"),
        (16, "fp32", "blocks"),
        (32, "bf16", "blocks"),
        (32, "fp16", "blocks"),
    ]
    assert result.trial_steps == 12
    best = result.recommended.settings
    assert (best.micro_batch_size, best.accumulation_steps, best.precision, best.checkpointing) == (
        16,
        2,
        "bf16",
        "none",
    )
    statuses = {c.status for c in result.candidates}
    assert {"measured", "dominated", "too large (estimate)"} <= statuses


def test_an_optimistic_estimate_is_corrected_by_trials():
    fake = FormulaDevice(per_sample=100, capacity=1000)
    run_plan(fake, 16, exact=False, precisions=["fp32"], checkpointing=["none"])
    assert fake.tried == [(16, "fp32", "none"), (8, "fp32", "none")]


def test_target_that_fits_at_once_is_one_trial_per_group():
    fake = FormulaDevice(per_sample=1, capacity=10**6)
    result = run_plan(fake, 8)
    assert fake.tried == [(8, "fp32", "none"), (8, "bf16", "none"), (8, "fp16", "none")]
    # the checkpointing groups are all dominated: not even the estimator runs for them
    assert fake.predicted == [("fp32", "none"), ("bf16", "none"), ("fp16", "none")]
    assert all(c.status in ("measured", "dominated") for c in result.candidates)


def test_nothing_fits_is_a_clear_error():
    fake = FormulaDevice(per_sample=100, capacity=50)
    with pytest.raises(DoesNotFitError, match="even micro-batch 1"):
        run_plan(fake, 4)


def test_prime_target_gets_advice():
    fake = FormulaDevice(per_sample=100, capacity=500)  # micro-batch 4 fits in fp32, not 13
    result = run_plan(fake, 13, precisions=["fp32"], checkpointing=["none"])
    assert result.recommended.settings.micro_batch_size == 1
    assert any("13 is prime" in note and "12 or 14" in note for note in result.advice)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            dict(target_batch_size=256, micro_batch_size=32, reference_batch_size=64),
            "scale the learning rate by 4 (linear rule",
        ),
        (dict(target_batch_size=256, micro_batch_size=32, reference_batch_size=64), "or 2 (square-root rule"),
        (dict(target_batch_size=64, micro_batch_size=8, has_batchnorm=True), "consider GroupNorm"),
        (
            dict(target_batch_size=64, micro_batch_size=8, has_batchnorm=True, world_size=4),
            "SyncBatchNorm across ranks",
        ),
        (
            dict(target_batch_size=64, micro_batch_size=8, variable_shapes=True, cudnn_benchmark=True),
            "cudnn.benchmark is on",
        ),
    ],
)
def test_advice_rules(kwargs, expected):
    assert any(expected in note for note in advice(**kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(target_batch_size=64, micro_batch_size=8, reference_batch_size=64),
        dict(target_batch_size=64, micro_batch_size=16, has_batchnorm=True),
        dict(target_batch_size=64, micro_batch_size=8, variable_shapes=True),
    ],
)
def test_advice_is_silent_when_it_does_not_apply(kwargs):
    assert advice(**kwargs) == []


def test_plan_on_sim_with_the_real_estimator():
    """End to end: the target does not fit at once in fp32; the plan finds settings that do."""
    device = memfit.device("sim:8MiB")
    wl = "mlp:layers=4,width=256,features=256"
    full = memfit.measure(wl, 512, device)
    assert not full.fits
    result = plan(wl, 512, device, precisions=["fp32", "bf16"])
    best = result.recommended
    assert best.settings.batch_size == 512
    check = memfit.measure(wl, best.settings.micro_batch_size, device, best.settings)
    assert check.fits
    assert result.trial_steps < 2 * len([c for c in result.candidates])
