"""The search policy against memory curves given as formulas: exact answers, exact trial sequences."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from memfit.batch_search import (
    DEFAULT_CEILING,
    Outcome,
    SearchSpace,
    answer,
    bounds,
    next_batch_size,
    predict_max,
    run_search,
)
from memfit.errors import MemfitError

MiB = 2**20


def fits_while(memory: Callable[[int], int], capacity: int) -> Callable[[int], Outcome]:
    """A fake device: a batch fits while ``memory(batch) <= capacity``; a failure reports no memory."""

    def trial(batch: int) -> Outcome:
        used = memory(batch)
        return Outcome(batch, used <= capacity, used if used <= capacity else 0)

    return trial


def true_max(memory: Callable[[int], int], capacity: int, ceiling: int = 10**8) -> int:
    """The exact maximum of a monotone curve, by bisection on the formula itself."""
    lo, hi = 0, 1
    while hi <= ceiling and memory(hi) <= capacity:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if memory(mid) <= capacity else (lo, mid)
    return lo


def linear(a: int, s: int) -> Callable[[int], int]:
    return lambda b: a + s * b


CASES = {
    # name: (memory, capacity, space options, expected batch sizes tried, expected answer)
    "linear, max 300": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {}, [1, 7, 112, 300, 301], 300),
    "linear, max 100": (linear(500 * MiB, MiB), 600 * MiB, {}, [1, 2, 32, 100, 101], 100),
    "linear, max 5000": (linear(2000 * MiB, 2**14), 2000 * MiB + 2**14 * 5000, {}, [1, 2, 32, 512, 5000, 5001], 5000),
    "quadratic": (
        lambda b: 100 * MiB + MiB * b + 2**12 * b * b,
        100 * MiB + 700 * MiB + 2**12 * 700 * 700,
        {},
        [1, 16, 256, 1122, 1068, 662, 714, 688, 704, 696, 701, 698, 699, 700],
        700,
    ),
    "step-wise (64 samples a step)": (
        lambda b: 100 * MiB + 20 * MiB * math.ceil(b / 64),
        100 * MiB + 20 * MiB * 30,
        {},
        [1, 4, 32, 256, 1905, 1906, 1908, 1912, 1920, 1936, 1928, 1924, 1922, 1921],
        1920,
    ),
    "maximum of 1": (linear(900 * MiB, 60 * MiB), 1000 * MiB, {}, [1, 2], 1),
    "does not fit at 1": (linear(1200 * MiB, MiB), 1000 * MiB, {}, [1], 0),
    "max_batch_size reached": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {"max_batch_size": 200}, [1, 7, 112, 200], 200),
    "multiple_of 8": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {"multiple_of": 8}, [8, 48, 256, 296, 304], 296),
    "right guess": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {"guess": 300}, [300, 301], 300),
    "guess too low": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {"guess": 280}, [280, 281, 297, 300, 301], 300),
    "guess too high": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {"guess": 320}, [320, 288, 298, 300, 301], 300),
    "guess 10x too high": (linear(100 * MiB, 3 * MiB), 1000 * MiB, {"guess": 3000}, [3000, 2700, 1, 9, 300, 301], 300),
    "guess, nothing fits": (linear(1200 * MiB, MiB), 1000 * MiB, {"guess": 50}, [50, 45, 1], 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_sequence_of_batch_sizes(name: str) -> None:
    memory, capacity, options, expected, expected_answer = CASES[name]
    space = SearchSpace(capacity=capacity, **options)
    outcomes = run_search(space, fits_while(memory, capacity))
    assert [o.batch_size for o in outcomes] == expected
    assert answer(space, outcomes) == expected_answer


@pytest.mark.parametrize("name", [n for n in CASES if "max_batch_size" not in n])
def test_answer_is_proven(name: str) -> None:
    """The answer fits and the next multiple was tried and did not fit."""
    memory, capacity, options, _, expected_answer = CASES[name]
    space = SearchSpace(capacity=capacity, **options)
    outcomes = run_search(space, fits_while(memory, capacity))
    step = space.multiple_of
    tried = {o.batch_size: o.fits for o in outcomes}
    assert tried[expected_answer + step] is False
    if expected_answer:
        assert tried[expected_answer] is True
    assert expected_answer == true_max(memory, capacity) // step * step


def test_linear_curves_with_maxima_from_100_to_5000_take_at_most_8_trials() -> None:
    rng = random.Random(1234)
    counts = []
    while len(counts) < 300:
        target = rng.randint(100, 5000)
        fixed, per_sample = rng.randint(MiB, 2**30), rng.randint(2**10, 2**20)
        capacity = fixed + per_sample * target
        space = SearchSpace(capacity=capacity)
        outcomes = run_search(space, fits_while(linear(fixed, per_sample), capacity))
        assert answer(space, outcomes) == target
        counts.append(len(outcomes))
    assert max(counts) <= 8


CURVES: dict[str, Callable[[random.Random], tuple[Callable[[int], int], int]]] = {
    "quadratic": lambda r: (
        (lambda a, s, q: lambda b: a + s * b + q * b * b)(
            r.randint(MiB, 2**30), r.randint(2**10, 2**20), r.randint(1, 2**9)
        ),
        r.randint(2**30, 2**33),
    ),
    "staircase": lambda r: (
        (lambda a, g, w: lambda b: a + g * math.ceil(b / w))(
            r.randint(MiB, 2**30), r.randint(MiB, 20 * MiB), r.randint(1, 40)
        ),
        r.randint(2**30, 2**33),
    ),
    "flat, then linear": lambda r: (
        (lambda a, s: lambda b: max(a, a // 3 + s * b))(r.randint(2**28, 2**30), r.randint(2**14, 2**20)),
        r.randint(2**30, 2**32),
    ),
}


@pytest.mark.parametrize("kind", list(CURVES))
def test_curves_that_are_not_linear_still_give_the_exact_maximum(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(60):
        memory, capacity = CURVES[kind](rng)
        space = SearchSpace(capacity=capacity)
        outcomes = run_search(space, fits_while(memory, capacity))
        maximum = true_max(memory, capacity)
        assert maximum < DEFAULT_CEILING
        assert answer(space, outcomes) == maximum
        assert len(outcomes) <= 40


def test_a_fit_above_a_failure_is_not_trusted() -> None:
    """Fragmentation can make a larger batch fit once; the smallest failure bounds the answer."""
    space = SearchSpace(capacity=1000)
    outcomes = [Outcome(1, True, 10), Outcome(50, False), Outcome(60, True, 900), Outcome(49, True, 990)]
    assert bounds(space, outcomes) == (49, 50)
    assert next_batch_size(space, outcomes) is None


def test_every_proposal_is_new() -> None:
    space = SearchSpace(capacity=10**9)
    outcomes = run_search(space, fits_while(lambda b: 10**6 * (b + b // 7 * 3), 10**9))
    sizes = [o.batch_size for o in outcomes]
    assert len(sizes) == len(set(sizes))


def test_no_memory_limit_goes_straight_to_max_batch_size() -> None:
    space = SearchSpace(capacity=None, max_batch_size=100)
    assert [o.batch_size for o in run_search(space, lambda b: Outcome(b, True, 0))] == [1, 100]


@pytest.mark.parametrize(
    ("points", "capacity", "expected"),
    [
        ([(1, 103), (9, 127)], 1000, 300.0),  # a line: where it reaches the capacity
        ([(4, 100)], 1000, 40.0),  # one point: proportional
        ([(1, 100), (8, 100)], 1000, 80.0),  # flat: proportional from the top
        ([(1, 10), (60, 400), (150, 550)], 1000, 420.0),  # the slope from the point at or below half
        ([(5, 100)], None, math.inf),  # no capacity: no bound
    ],
)
def test_predict_max(points: list[tuple[int, int]], capacity: int | None, expected: float) -> None:
    assert predict_max(points, capacity) == pytest.approx(expected)


@pytest.mark.parametrize(
    "options",
    [
        {"capacity": 100, "multiple_of": 0},
        {"capacity": 100, "multiple_of": 8, "max_batch_size": 4},
        {"capacity": 0},
        {"capacity": 100, "guess": 0},
    ],
)
def test_bad_search_spaces_are_user_errors(options: dict[str, int]) -> None:
    with pytest.raises(MemfitError):
        SearchSpace(**options)


# -- the headroom batch from a predicted memory line (issue 22) ------------------------------


def _headroom_trials(guess: int | None, memory=lambda b: 100 + 3 * b, budget: int = 950, maximum: int = 300):
    from memfit.search.headroom import next_headroom_batch, within_budget

    def trial(b: int) -> Outcome:
        return Outcome(b, memory(b) <= 1000, memory(b))

    outcomes = [trial(maximum), trial(maximum + 1)]  # the maximum's proof
    while (b := next_headroom_batch(outcomes, budget, maximum=maximum, phase_start=2, guess=guess)) is not None:
        outcomes.append(trial(b))
    return [o.batch_size for o in outcomes[2:]], within_budget(outcomes, budget, maximum=maximum)


def test_a_right_headroom_guess_is_proven_by_itself_and_the_next_batch() -> None:
    # 100 + 3b <= 950: b <= 283
    assert _headroom_trials(283) == ([283, 284], 283)


def test_a_guess_over_the_budget_is_proven_by_the_batch_below() -> None:
    assert _headroom_trials(284) == ([284, 283], 283)


def test_a_wrong_guess_falls_back_to_the_line_and_still_finds_the_answer() -> None:
    for guess in (150, 200, 290, 1000):
        tried, found = _headroom_trials(guess)
        assert found == 283, guess
        # a guess above the maximum is the maximum, tried already (over the budget): its neighbour next
        assert tried[0] == min(guess, 299) and len(tried) <= 4


def test_a_guess_at_the_maximum_within_the_budget_needs_no_other_trial() -> None:
    tried, found = _headroom_trials(300, budget=1000)
    assert (tried, found) == ([], 300)  # the maximum's own trial kept the budget
