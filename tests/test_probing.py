"""probe(): exact trial sequences on formula devices, exact maxima on sim:, state left untouched."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.batch_search import SearchSpace
from memfit.errors import DoesNotFitError, MemfitError
from memfit.run.measure import Measurement, measure
from memfit.search.probe import HEADROOM_TRIALS, TRIAL_STEPS, ProbeResult, probe, recommend, search
from memfit.workload import Workload

MiB = 2**20
#: pytorch/examples' models as workloads (tests/workloads), loaded by reference as a user's file is
EXAMPLES = Path(__file__).parent / "workloads" / "pytorch_examples.py"


def formula_trial(capacity: int, fixed: int = 100 * MiB, per_sample: int = 3 * MiB, seconds=lambda b: 0.01 + 0.001 * b):
    """A fake device: memory ``fixed + per_sample * b`` (reserved 10 % more), time by formula."""

    def trial(batch: int) -> Measurement:
        allocated = fixed + per_sample * batch
        reserved = allocated
        if reserved > capacity:
            return Measurement(batch, False, min(allocated, capacity), min(reserved, capacity), None)
        return Measurement(batch, True, allocated, reserved, seconds(batch))

    return trial


def test_search_finds_the_maximum_then_the_headroom_batch() -> None:
    capacity = 1000 * MiB  # maximum (1000 - 100) / 3 = 300; with 5 % headroom (950 - 100) / 3 = 283
    found = search(formula_trial(capacity), SearchSpace(capacity=capacity), capacity=capacity, headroom=0.05)
    assert [t.batch_size for t in found.trials] == [1, 7, 112, 300, 301, 283, 284]
    assert (found.max_batch_size, found.headroom_batch_size, found.recommended_batch_size) == (300, 283, 283)
    assert found.limit == "memory"
    assert "within 95% of capacity" in found.reason


def test_search_recommends_where_throughput_stops_growing() -> None:
    capacity = 1000 * MiB
    flat_after_100 = lambda b: 0.001 * max(b, 100)  # noqa: E731 - samples/s stops growing at 100
    found = search(
        formula_trial(capacity, seconds=flat_after_100),
        SearchSpace(capacity=capacity),
        capacity=capacity,
        headroom=0.05,
    )
    assert (found.max_batch_size, found.headroom_batch_size) == (300, 283)
    assert (found.recommended_batch_size, found.throughput_batch_size) == (112, 112)
    assert found.reason.startswith("throughput stops growing at batch 112")


def test_search_with_a_right_guess_proves_it_in_two_trials() -> None:
    capacity = 1000 * MiB
    found = search(formula_trial(capacity), SearchSpace(capacity=capacity, guess=300), capacity=capacity, headroom=0)
    assert [t.batch_size for t in found.trials] == [300, 301]
    assert found.max_batch_size == found.recommended_batch_size == 300


def test_search_stops_at_max_batch_size() -> None:
    capacity = 1000 * MiB
    found = search(
        formula_trial(capacity), SearchSpace(capacity=capacity, max_batch_size=200), capacity=capacity, headroom=0
    )
    assert [t.batch_size for t in found.trials] == [1, 7, 112, 200]
    assert (found.max_batch_size, found.limit) == (200, "max_batch_size")


def test_search_maximum_of_one() -> None:
    capacity = 1000 * MiB
    found = search(
        formula_trial(capacity, fixed=900 * MiB, per_sample=60 * MiB),
        SearchSpace(capacity=capacity),
        capacity=capacity,
        headroom=0,
    )
    assert [t.batch_size for t in found.trials] == [1, 2]
    assert found.max_batch_size == 1


def test_search_that_does_not_fit_at_batch_1_names_the_memory() -> None:
    capacity = 1000 * MiB
    with pytest.raises(DoesNotFitError) as raised:
        search(
            formula_trial(capacity, fixed=1200 * MiB),
            SearchSpace(capacity=capacity),
            capacity=capacity,
            describe="big on sim:1000MiB",
        )
    message = str(raised.value)
    assert message.startswith("big on sim:1000MiB does not fit even at batch size 1")
    assert "more than the 1000.00 MiB the device has" in message
    assert "with 1000.00 MiB reserved" in message


def timed(speeds: dict[int, float], repeats: int = 2, noise: float = 0.0) -> list[Measurement]:
    """Trials at ``speeds`` (samples/s), each batch timed ``repeats`` times, the last ``noise`` slower."""
    trials = []
    for _ in range(repeats):
        for b, s in speeds.items():
            trials.append(Measurement(b, True, 0, 0, b / s))
    if repeats > 1 and noise:
        last = trials[-len(speeds) :]
        trials[-len(speeds) :] = [Measurement(t.batch_size, True, 0, 0, t.seconds_per_step * (1 + noise)) for t in last]
    return trials


@pytest.mark.parametrize(
    ("speeds", "headroom_batch", "expected"),
    [
        ({8: 100.0, 16: 200.0, 32: 400.0}, 32, (32, 32)),  # still growing: the headroom batch
        ({8: 100.0, 16: 395.0, 32: 400.0}, 32, (16, 16)),  # within 2 % at 16, timings repeat exactly
        ({8: 100.0, 16: 200.0, 64: 900.0}, 32, (32, 16)),  # trials above the headroom batch do not count
        ({}, 32, (32, None)),
    ],
)
def test_recommend(speeds: dict[int, float], headroom_batch: int, expected: tuple[int, int | None]) -> None:
    choice = recommend(timed(speeds), headroom_batch, 0.05)
    assert (choice.batch, choice.throughput_batch) == expected
    assert choice.repeat == ()


def test_recommend_asks_to_repeat_a_single_timing_before_throughput_decides() -> None:
    once = timed({8: 100.0, 16: 395.0, 32: 400.0}, repeats=1)
    choice = recommend(once, 32, 0.05)
    assert (choice.batch, choice.repeat) == (32, (16, 32))


def test_a_noisy_timing_does_not_decide() -> None:
    """Issue 14, item 6: batch 24 at 10 samples/s and 20 at 30 on a shared CPU; timed again, 24 runs at 31."""
    speeds = {20: [30.0, 29.5], 21: [30.5], 24: [10.0, 31.0]}  # samples/s of each timing, in turn

    def trial(batch: int) -> Measurement:
        fits = batch <= 24
        memory = 10 * MiB * batch
        seconds = batch / speeds[batch].pop(0) if fits else None
        return Measurement(batch, fits, memory, memory, seconds)

    capacity = 250 * MiB  # 24 fits (240 MiB), 25 does not; no headroom rule here
    found = search(trial, SearchSpace(capacity=capacity, guess=20), capacity=capacity, headroom=0)
    assert [t.batch_size for t in found.trials] == [20, 21, 24, 25, 20, 24]  # 20 and 24 timed again
    assert (found.max_batch_size, found.recommended_batch_size) == (24, 24)
    assert "timings do not repeat closely enough for throughput to decide (batch 21 vs 24" in found.reason
    assert "repeated timings 210% apart" in found.reason


def test_repeatable_timings_let_throughput_decide() -> None:
    capacity = 1000 * MiB
    flat_after_100 = lambda b: 0.001 * max(b, 100)  # noqa: E731 - samples/s stops growing at 100
    found = search(formula_trial(capacity, seconds=flat_after_100), SearchSpace(capacity=capacity), capacity=capacity)
    assert (found.recommended_batch_size, found.throughput_batch_size) == (112, 112)
    assert found.reason.startswith("throughput stops growing at batch 112")
    assert "timings repeated 0.0% apart" in found.reason


# -- the headroom batch: from the measured memory line, verified ----------------------------------------


def test_headroom_batch_from_the_line_when_the_guess_was_the_maximum() -> None:
    """The search proved 300 in two trials; memory is flat-then-linear, so batches 1, 2, 5 say nothing."""
    capacity = 1000 * MiB
    found = search(formula_trial(capacity), SearchSpace(capacity=capacity, guess=300), capacity=capacity)
    assert [t.batch_size for t in found.trials] == [300, 301, 150, 283, 284]
    assert (found.max_batch_size, found.headroom_batch_size, found.recommended_batch_size) == (300, 283, 283)


def test_headroom_batch_on_a_staircase_is_verified_and_never_below_a_verified_fit() -> None:
    """Reserved memory in 20 MiB stairs: a line keeps landing on the top stair; bisection gets below it."""
    capacity = 128 * MiB

    def trial(batch: int) -> Measurement:
        allocated = 26 * MiB + batch * MiB // 2
        reserved = min(capacity, 42 * MiB + 20 * MiB * ((allocated - 26 * MiB) // (20 * MiB)))
        fits = allocated <= 90 * MiB
        return Measurement(batch, fits, allocated, reserved, 0.01 if fits else None)

    found = search(trial, SearchSpace(capacity=capacity, guess=128), capacity=capacity)
    budget = int(0.95 * capacity)
    verified = [t.batch_size for t in found.trials if t.fits and t.peak_reserved <= budget]
    assert found.headroom_batch_size == max(verified)
    assert trial(found.headroom_batch_size).peak_reserved <= budget
    assert found.headroom_batch_size >= found.max_batch_size // 2


def test_no_batch_within_the_headroom_says_so() -> None:
    capacity = 100 * MiB
    found = search(
        formula_trial(capacity, fixed=97 * MiB, per_sample=MiB), SearchSpace(capacity=capacity), capacity=capacity
    )
    assert (found.max_batch_size, found.recommended_batch_size) == (3, 1)
    assert found.reason == "no batch keeps 5% of memory free: even batch 1 reserves 98.0% of it"


def test_a_nan_loss_is_refused_naming_the_batch_and_the_value() -> None:
    def trial(batch: int) -> Measurement:
        loss = float("nan") if batch > 1 else 2.3
        return Measurement(batch, True, MiB * batch, MiB * batch, 0.01, loss, batch == 1)

    with pytest.raises(MemfitError) as caught:
        search(trial, SearchSpace(capacity=1000 * MiB), capacity=1000 * MiB, describe="net on sim:1000MiB")
    assert str(caught.value).startswith("net on sim:1000MiB: the loss at batch 16 is nan (not finite)")
    assert "not short of memory" in str(caught.value)
    assert not isinstance(caught.value, DoesNotFitError)


# -- on the simulated GPU ---------------------------------------------------------------------

#: zoo workloads and budgets with small maxima, so an exhaustive scan stays fast
ZOO = [
    ("mlp:layers=1,width=8,features=16384", "sim:4MiB"),
    ("convnet:blocks=2,channels=8,image_size=32", "sim:4MiB"),
    ("gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=64,vocab_size=128", "sim:4MiB"),
]
FAST = ZOO[0]


def scan_maximum(ref: str, spec: str, beyond: int = 2) -> int:
    """Every batch from 1 up to the first that does not fit, and ``beyond`` more that must not."""
    workload, gpu = memfit.load_workload(ref), memfit.device(spec)
    batch = 1
    while measure(workload, batch, gpu).fits:
        batch += 1
    assert not any(measure(workload, batch + k, gpu).fits for k in range(1, beyond + 1))
    return batch - 1


@pytest.mark.slow
@pytest.mark.parametrize(("ref", "spec"), ZOO)
def test_probe_equals_an_exhaustive_scan_on_sim(ref: str, spec: str) -> None:
    result = probe(ref, spec, headroom=0, guess=None, trials="real")
    assert result.max_batch_size == scan_maximum(ref, spec)
    assert result.trial_steps == TRIAL_STEPS * len(result.trials)


def test_probe_with_the_right_guess_proves_it_in_two_trials() -> None:
    ref, spec = FAST
    first = probe(ref, spec, headroom=0, trials="real")
    again = probe(ref, spec, headroom=0, guess=first.max_batch_size, trials="real")
    assert [t.batch_size for t in again.trials] == [first.max_batch_size, first.max_batch_size + 1]
    assert again.max_batch_size == first.max_batch_size


def test_probe_multiple_of() -> None:
    ref, spec = FAST
    result = probe(ref, spec, headroom=0, multiple_of=4, guess=None, trials="real")
    assert result.max_batch_size % 4 == 0
    assert all(t.batch_size % 4 == 0 for t in result.trials)
    assert memfit.measure(ref, result.max_batch_size, spec).fits
    assert not memfit.measure(ref, result.max_batch_size + 4, spec).fits


def test_device_is_back_at_baseline_after_every_trial() -> None:
    gpu = memfit.device("sim:4MiB")
    seen: list[tuple[int, bool, int, int]] = []

    def progress(batch: int, measurement: Measurement | None) -> None:
        if measurement is not None:
            seen.append((batch, measurement.fits, gpu.memory_allocated(), gpu.memory_reserved()))

    probe(FAST[0], gpu, progress=progress)
    assert {fits for _, fits, _, _ in seen} == {True, False}
    assert all((allocated, reserved) == (0, 0) for _, _, allocated, reserved in seen)


def convnet_in_a_training_script() -> tuple[Workload, torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A workload made from the script's own model instance and optimizer, one step trained."""
    torch.manual_seed(0)
    base = memfit.load_workload("convnet:blocks=2,channels=4,image_size=8")
    model = base.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    loss = base.loss(model, base.make_batch(4))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    workload = Workload(
        model=model, make_batch=base.make_batch, loss=base.loss, optimizer=lambda params: optimizer, name="script"
    )
    return workload, model, optimizer, scaler


def snapshot_everything(model, optimizer, scaler):
    tensors = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    state = [
        (i, k, v.clone())
        for i, entry in sorted(optimizer.state_dict()["state"].items())
        for k, v in sorted(entry.items())
    ]
    return tensors, grads, state, scaler.state_dict(), model.training


def assert_same(before, after) -> None:
    (t0, g0, s0, sc0, tr0), (t1, g1, s1, sc1, tr1) = before, after
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(t0, t1, strict=True))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert [(i, k) for i, k, _ in s0] == [(i, k) for i, k, _ in s1]
    assert all(torch.equal(a, b) for (*_, a), (*_, b) in zip(s0, s1, strict=True))
    assert (sc0, tr0) == (sc1, tr1)


def test_probing_a_model_instance_leaves_model_optimizer_scaler_and_rngs_bit_identical() -> None:
    workload, model, optimizer, scaler = convnet_in_a_training_script()
    model.eval()
    before = snapshot_everything(model, optimizer, scaler)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected_draws = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)

    result = probe(workload, "sim:4MiB", max_batch_size=32, preserve=[scaler])

    assert result.max_batch_size >= 1 and len(result.trials) >= 2
    assert_same(before, snapshot_everything(model, optimizer, scaler))
    draws = (random.random(), np.random.rand(), torch.rand(2))
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])


def test_a_real_error_propagates_unchanged_and_state_is_still_restored() -> None:
    workload, model, optimizer, scaler = convnet_in_a_training_script()
    before = snapshot_everything(model, optimizer, scaler)
    calls = []

    def loss(m, batch):
        calls.append(1)
        if len(calls) > 3:
            raise ValueError("a real bug")
        return workload_loss(m, batch)

    workload_loss = workload.loss
    workload.loss = loss
    with pytest.raises(ValueError, match="a real bug"):
        probe(workload, "sim:4MiB")
    assert_same(before, snapshot_everything(model, optimizer, scaler))


def test_does_not_fit_on_sim_is_a_clear_error() -> None:
    with pytest.raises(
        DoesNotFitError, match=r"does not fit even at batch size 1: one training step needs more than the 2\.00 MiB"
    ):
        probe("mlp:layers=2,width=32,features=16384", "sim:2MiB")


def test_result_to_dict_has_the_json_fields() -> None:
    result = probe(*FAST)
    data = json.loads(json.dumps(result.to_dict()))
    for key in ("max_batch_size", "recommended_batch_size", "trial_steps", "trials", "reason", "capacity"):
        assert key in data
    assert set(data["trials"][0]) >= {"batch_size", "fits", "peak_allocated", "peak_reserved", "samples_per_second"}
    assert [
        (t["batch_size"], t["fits"], t["peak_allocated"], t["peak_reserved"], t["samples_per_second"])
        for t in data["trials"]
    ] == [(t.batch_size, t.fits, t.peak_allocated, t.peak_reserved, t.samples_per_second) for t in result.trials]
    assert (data["max_batch_size"], data["recommended_batch_size"], data["reason"]) == (
        result.max_batch_size,
        result.recommended_batch_size,
        result.reason,
    )
    assert isinstance(result, ProbeResult) and data["capacity"] == 4 * MiB


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"headroom": 1.0}, "invalid headroom"),
        ({"multiple_of": 0}, "invalid multiple_of"),
        ({"max_batch_size": 4, "multiple_of": 8}, "invalid max_batch_size"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(MemfitError, match=match):
        probe(FAST[0], "sim:4MiB", **kwargs)


def test_a_device_without_a_limit_needs_max_batch_size() -> None:
    with pytest.raises(MemfitError, match="no memory limit"):
        probe(FAST[0], "cpu")


@pytest.mark.parametrize(
    ("ref", "spec"),
    [
        ("mlp:layers=2,width=64,features=64", "sim:6MiB"),
        ("convnet:blocks=1,channels=8,image_size=32", "sim:8MiB"),
    ],
)
def test_probe_starting_at_the_estimate_is_exact_in_at_most_three_trials(ref, spec):
    """Issue 4: with the device's memory known, probe starts at memfit.estimate's answer."""
    from_scratch = probe(ref, spec, headroom=0, guess=None, trials="real")
    from_estimate = probe(ref, spec, headroom=0, trials="real")  # the default: start at the estimate
    assert from_estimate.max_batch_size == from_scratch.max_batch_size
    assert len(from_estimate.trials) <= 3 < len(from_scratch.trials)


def test_mnist_cnn_recommends_the_largest_verified_batch_within_the_headroom(one_thread):
    """Issue 14, item 2: recommended 5 on sim:128MiB, since only 1, 2 and 5 were tried for the
    headroom (memory is flat at small batches: weights, Adadelta state, 20 MiB segments).
    The maximum is 148 with CUDA's 1-byte dropout masks (memfit.cuda), 142 with the CPU's fp32 ones."""
    result = probe(f"{EXAMPLES}:mnist", "sim:128MiB")
    assert result.max_batch_size == 148
    budget = 0.95 * 128 * MiB
    verified = [t.batch_size for t in result.trials if t.fits and t.peak_reserved <= budget]
    assert result.headroom_batch_size == max(verified)  # a trial proved it within the headroom
    assert result.headroom_batch_size >= result.max_batch_size // 2  # not a batch from the flat start
    # the search's trials (on sim: on fake tensors; the real runs that confirm them come on top)
    searched = [t for t in result.trials if t.fake] or list(result.trials)
    assert len(searched) <= 2 + HEADROOM_TRIALS + 2  # the guess, its proof, the headroom, repeats
    if result.recommended_batch_size != result.headroom_batch_size:  # only on timings that repeat
        assert result.reason.startswith("throughput stops growing") and "timings repeated" in result.reason
