"""plan(): candidate generation, pruning, dominance, the exact trials run, advice."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import memfit
from memfit.errors import DoesNotFitError, MemfitError
from memfit.run.measure import Measurement
from memfit.run.settings import Settings
from memfit.search.candidates import MAX_TARGET_BATCH, candidates, divisors, dominates
from memfit.search.plan import plan
from memfit.search.plan_text import advice

MLP = "mlp:layers=4,width=64,features=32"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small steps on 2 shared cores


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

    def seconds(self, s: Settings) -> float:
        speed = self.SPEED[s.precision] * (0.75 if s.checkpointing == "blocks" else 1.0)
        return s.micro_batch_size / (speed * 100 * s.micro_batch_size / (s.micro_batch_size + 4))

    def trial(self, wl, s: Settings, device) -> Measurement:
        self.tried.append((s.micro_batch_size, s.precision, s.checkpointing))
        peak = self.memory(s)
        if peak > self.capacity:
            return Measurement(s.micro_batch_size, False, self.capacity, self.capacity, None)
        return Measurement(s.micro_batch_size, True, peak, peak, self.seconds(s))

    def predict_speed(self, wl, s: Settings, card) -> tuple[float, float]:
        """The simulated GPU's candidates rank by predicted speed: the same formula here."""
        step = s.accumulation_steps * self.seconds(s)
        return step, s.batch_size / step

    def predictor(self, exact: bool = True):
        self.predicted: list[tuple[str, str]] = []

        def predict(wl, s: Settings, device, limit: int) -> int:
            self.predicted.append((s.precision, s.checkpointing))
            per = self.per_sample * self.FACTOR[(s.precision, s.checkpointing)]
            guess = int((self.capacity - self.base) // per)
            return min(limit, guess if exact else guess * 2)  # exact, or an optimistic estimator

        return predict


def run_plan(fake: FormulaDevice, target: int, exact: bool = True, **kwargs):
    return plan(
        MLP,
        target,
        memfit.device("sim:1GiB"),
        predictor=fake.predictor(exact),
        run_trial=fake.trial,
        predict_speed=fake.predict_speed,
        **kwargs,
    )


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


# -- issue 14: headroom, candidates that fail for another reason, the target's bound ----------------------

#: pytorch/examples' models as workloads (tests/workloads), loaded by reference as a user's file is
EXAMPLES = Path(__file__).parent / "workloads" / "pytorch_examples.py"


def test_a_candidate_above_the_headroom_is_shown_but_not_recommended():
    """Issue 14, item 3: a lock recorded headroom 0.05 and a choice at 98.4 % of the device."""
    fake = FormulaDevice(per_sample=100, capacity=1000)  # micro-batch 9 peaks at 1000, 8 at 900
    device = memfit.device("sim:1000B")
    result = plan(MLP, 72, device, precisions=["fp32"], checkpointing=["none"], predictor=None, run_trial=fake.trial)
    status = {c.settings.micro_batch_size: c.status for c in result.candidates}
    assert status[9] == "over headroom" and status[8] == "measured"
    assert result.recommended.settings.micro_batch_size == 8
    assert result.recommended.measurement.peak_reserved <= 0.95 * 1000
    assert result.headroom == 0.05 and result.to_dict()["headroom"] == 0.05
    loose = plan(
        MLP, 72, device, precisions=["fp32"], checkpointing=["none"], predictor=None, run_trial=fake.trial, headroom=0
    )
    assert loose.recommended.settings.micro_batch_size == 9


def test_nothing_within_the_headroom_is_refused_with_the_closest_candidate():
    with pytest.raises(DoesNotFitError) as caught:
        plan("mlp:layers=1,width=8,features=16384", 64, "sim:4MiB", precisions=["fp32"], shards=["none"])
    message = str(caught.value)
    assert "within the 5% headroom" in message and "reserves 100.0% of it" in message


def test_fit_keeps_the_headroom_in_the_lock_or_writes_none(tmp_path):
    """On main this wrote a lock with headroom 0.05 for settings that reserve 100 % of the device."""
    lock = tmp_path / "memfit.lock"
    with pytest.raises(DoesNotFitError, match="within the 5% headroom"):
        memfit.fit("mlp:layers=1,width=8,features=16384", "sim:4MiB", lock_path=lock, report_dir=None, run_doctor=False)
    assert not lock.exists()
    result = memfit.fit(
        "mlp:layers=1,width=8,features=16384", "sim:4MiB", lock_path=lock, report_dir=None, run_doctor=False, headroom=0
    )
    assert result.lock.measured.headroom == 0 and lock.exists()


def _failing_lstm_precision() -> str:
    """The reduced precision this CPU cannot run an LSTM in (oneDNN: "could not create a primitive descriptor")."""
    for precision in ("bf16", "fp16"):
        try:
            memfit.measure(f"{EXAMPLES}:word_language_model", 2, "sim:64MiB", Settings(precision=precision))
        except RuntimeError as error:
            if "primitive descriptor" in str(error):
                return precision
    pytest.skip("this CPU runs the LSTM in bf16 and fp16 alike: no candidate fails here")


def test_a_candidate_that_fails_for_another_reason_is_shown_and_skipped():
    """Issue 14, item 7: an LSTM in a precision oneDNN cannot run on this CPU failed the whole plan."""
    failing = _failing_lstm_precision()
    result = plan(f"{EXAMPLES}:word_language_model", 4, "sim:64MiB", precisions=["fp32", failing])
    failed = [c for c in result.candidates if c.status.startswith("failed: ")]
    assert failed and {c.settings.precision for c in failed} == {failing}
    assert all("could not create a primitive descriptor" in c.status and "\n" not in c.status for c in failed)
    assert result.recommended.settings.precision == "fp32"
    assert any("failed for a reason other than memory" in note for note in result.advice)
    assert [c.to_dict()["status"] for c in failed] == [c.status for c in failed]


def test_when_every_candidate_fails_the_first_error_propagates_with_its_traceback():
    failing = _failing_lstm_precision()
    with pytest.raises(RuntimeError, match="could not create a primitive descriptor") as caught:
        plan(f"{EXAMPLES}:word_language_model", 4, "sim:64MiB", precisions=[failing], predictor=None)
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
    assert "run_steps" in frames and "forward" in frames  # down to the LSTM's forward


def test_failing_candidates_of_one_precision_do_not_stop_the_others():
    """Deterministic: a step that raises a real RuntimeError (not memory) in fp16 only."""
    wl = memfit.load_workload(MLP)
    plain = wl.loss

    def loss(model, batch):
        value = plain(model, batch)
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            raise RuntimeError("an op without a Half kernel\nsecond line")
        return value

    wl.loss = loss
    seen = []
    result = plan(
        wl, 32, "sim:8MiB", precisions=["fp32", "fp16"], checkpointing=["none"], predictor=None, progress=seen.append
    )
    statuses = {(c.settings.precision, c.status) for c in result.candidates if c.status != "not run"}
    assert ("fp16", "failed: RuntimeError: an op without a Half kernel") in statuses
    assert result.recommended.settings.precision == "fp32"
    assert any(c.status.startswith("failed: ") for c in seen)  # progress shows them as they fail
    wl.loss = lambda model, batch: (_ for _ in ()).throw(ValueError("broken everywhere"))
    with pytest.raises(ValueError, match="broken everywhere"):
        plan(wl, 32, "sim:8MiB", precisions=["fp32", "fp16"], checkpointing=["none"], predictor=None)


def test_a_nan_loss_refuses_the_plan():
    wl = memfit.load_workload(MLP)
    wl.loss = lambda model, batch: model(batch[0]).sum() * float("nan")
    with pytest.warns(UserWarning, match="not finite"), pytest.raises(MemfitError) as caught:
        plan(wl, 8, "sim:8MiB", precisions=["fp32"], checkpointing=["none"])
    assert "the loss at batch 8 is nan" in str(caught.value) and not isinstance(caught.value, DoesNotFitError)


@pytest.mark.parametrize("n", [1, 2, 36, 97, 720720, 2**24, 14414400])
def test_divisors_in_square_root_time_agree_with_trial_division(n):
    found = divisors(n)
    assert found == sorted(found, reverse=True) and len(set(found)) == len(found)
    assert all(n % d == 0 for d in found)
    if n <= 720720:
        assert found == [d for d in range(n, 0, -1) if n % d == 0]
    if n == 14414400:
        assert len(found) == 504  # the most divisors below the bound: at most 6 x 504 candidates


def test_targets_above_the_bound_are_refused_at_once(run_cli):
    """Issue 14, item 9: --target-batch 99999999999999 never ended (divisors by trial division)."""
    status, out, err = run_cli("plan", "mlp", "--device", "sim:4MiB", "--target-batch", "99999999999999")
    assert status == 2 and out == ""
    assert err.strip().splitlines() == [
        "memfit: error: target batch 99999999999999 is above the largest memfit plans for "
        "(16,777,216 = 2**24 samples per optimizer step)"
    ]
    # refused before anything else: a workload file that does not exist is not even looked for
    status, _, err = run_cli("plan", "missing.py:make", "--device", "sim:4MiB", "--target-batch", "99999999999999")
    assert status == 2 and "above the largest" in err
    status, _, err = run_cli("fit", "missing.py:make", "--device", "sim:4MiB", "--target-batch", "99999999999999")
    assert status == 2 and "above the largest" in err
    with pytest.raises(MemfitError, match="above the largest"):
        candidates(MAX_TARGET_BATCH + 1)
    assert len(candidates(MAX_TARGET_BATCH, precisions=["fp32"], checkpointing=["none"])) == 25  # 2**24: 25 divisors


def test_plan_command_takes_comma_lists_and_headroom(run_cli):
    status, out, err = run_cli(
        "plan", "mlp:layers=2,width=32,features=16", "--target-batch", "8", "--device", "sim:8MiB",
        "--precision", "fp32,bf16", "--checkpointing", "none", "--headroom", "0.1", "--json",
    )  # fmt: skip
    assert status == 0, err
    data = json.loads(out)
    assert {c["precision"] for c in data["candidates"]} == {"fp32", "bf16"} and data["headroom"] == 0.1
    status, _, err = run_cli("plan", "mlp", "--target-batch", "8", "--device", "sim:8MiB", "--precision", "fp32,fp64")
    assert status == 2 and "'fp64' is not one of fp32, bf16, fp16" in err
