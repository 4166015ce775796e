"""The batch-size search of ``memfit probe``: which batch size to try next. Pure, no torch.

Given the outcomes so far (batch size, fits, peak memory) :func:`next_batch_size` proposes
the next batch size to try, or ``None`` once the answer is proven: the largest multiple
of ``multiple_of`` that fits, with the next multiple shown not to fit (or
``max_batch_size`` reached).

How: the first trial is the smallest batch (it surely fits, so a broken workload fails
fast and clearly). Peak memory is close to linear in the batch size, so the slope between
two fitting trials predicts where memory reaches the capacity; the search jumps there,
then tries one more batch to prove the boundary. When a prediction is wrong the interval
still narrows, and a safeguard bisects whenever a prediction failed to halve it, so a
curve that is not linear at all still takes O(log n) trials.

With a ``guess`` (a predicted maximum, such as the estimator's) the first trial is the
guess and the second the guess plus one multiple: a right guess ends the search in two.

>>> space = SearchSpace(capacity=1000)
>>> def trial(b):                       # memory 100 + 3 per sample: the maximum is 300
...     return Outcome(b, 100 + 3 * b <= 1000, 100 + 3 * b)
>>> [o.batch_size for o in run_search(space, trial)]
[1, 7, 112, 300, 301]
>>> answer(space, run_search(space, trial))
300
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memfit.errors import MemfitError

__all__ = [
    "Outcome",
    "SearchSpace",
    "next_batch_size",
    "answer",
    "bounds",
    "predict_max",
    "run_search",
    "DEFAULT_CEILING",
    "GUESS_BACKOFF",
    "DAMPING",
    "MAX_GROWTH",
    "FLAT_GROWTH",
]

#: the largest batch tried when neither a capacity nor ``max_batch_size`` bounds the search
DEFAULT_CEILING = 2**20
#: after a guess that does not fit, the next trial is this fraction of it (estimates
#: are usually a few percent off, so the maximum is likely just below)
GUESS_BACKOFF = 0.9
#: until a line is confirmed by three trials, jumps go this fraction of the way to the
#: predicted maximum, so the next trial most likely fits and lands close to it
DAMPING = 0.85
#: the most one jump multiplies the batch by before any trial has failed
MAX_GROWTH = 16
#: the factor a jump multiplies the batch by while memory has not grown at all
FLAT_GROWTH = 8


@dataclass(frozen=True)
class Outcome:
    """One trial: did ``batch_size`` fit, and its peak memory in bytes (when it fit)."""

    batch_size: int
    fits: bool
    memory: int = 0


@dataclass(frozen=True)
class SearchSpace:
    """What is searched: batch sizes ``multiple_of * n`` up to ``max_batch_size``, against
    ``capacity`` bytes (None: no memory limit, so ``max_batch_size`` bounds the search)."""

    capacity: int | None
    multiple_of: int = 1
    max_batch_size: int | None = None
    guess: int | None = None

    def __post_init__(self) -> None:
        if self.multiple_of < 1:
            raise MemfitError(f"invalid multiple_of {self.multiple_of}: must be at least 1")
        if self.max_batch_size is not None and self.max_batch_size < self.multiple_of:
            raise MemfitError(
                f"invalid max_batch_size {self.max_batch_size}: must be at least multiple_of ({self.multiple_of})"
            )
        if self.capacity is not None and self.capacity <= 0:
            raise MemfitError(f"invalid capacity {self.capacity}: must be positive")
        if self.guess is not None and self.guess < 1:
            raise MemfitError(f"invalid guess {self.guess}: must be at least 1")

    @property
    def max_units(self) -> int:
        """The largest batch allowed, in multiples of ``multiple_of``."""
        limit = self.max_batch_size if self.max_batch_size is not None else DEFAULT_CEILING
        return max(1, limit // self.multiple_of)

    @property
    def guess_units(self) -> int | None:
        if self.guess is None:
            return None
        return min(max(1, self.guess // self.multiple_of), self.max_units)


# -- pure helpers ---------------------------------------------------------------------------


def _units(space: SearchSpace, outcomes: Sequence[Outcome]) -> list[tuple[int, bool, int]]:
    """Outcomes in units of ``multiple_of`` (a batch that is not a multiple rounds down)."""
    return [(max(1, o.batch_size // space.multiple_of), o.fits, o.memory) for o in outcomes]


def _bounds_units(trials: Sequence[tuple[int, bool, int]]) -> tuple[int, int | None]:
    """(largest fitting unit below the smallest failing one, smallest failing unit).

    Why "below": on a real GPU a fit above a failure can happen (fragmentation differs
    from run to run); the smallest failure is the one to trust, so a fit above it is
    ignored and the answer stays one that fits with the next size shown not to.
    """
    failing = [u for u, fits, _ in trials if not fits]
    hi = min(failing) if failing else None
    fitting = [u for u, fits, _ in trials if fits and (hi is None or u < hi)]
    return (max(fitting) if fitting else 0), hi


def bounds(space: SearchSpace, outcomes: Sequence[Outcome]) -> tuple[int, int | None]:
    """(largest batch that fits, smallest batch that does not) so far; 0 / None when unknown."""
    lo, hi = _bounds_units(_units(space, outcomes))
    return lo * space.multiple_of, (None if hi is None else hi * space.multiple_of)


def answer(space: SearchSpace, outcomes: Sequence[Outcome]) -> int:
    """The largest batch shown to fit (0 when none did)."""
    return bounds(space, outcomes)[0]


def _is_done(space: SearchSpace, lo: int, hi: int | None) -> bool:
    if hi is not None and hi == lo + 1:  # includes hi == 1: nothing fits
        return True
    return lo >= space.max_units


def _line(points: Sequence[tuple[int, int]]) -> tuple[int, int, float] | None:
    """(top unit, its memory, slope per unit) from fitting points sorted by unit, or None.

    The slope runs from the top point to the highest point at or below half of it (else
    the lowest): two points far apart, so the allocator's rounding does not drown it.
    """
    if not points:
        return None
    top, top_memory = points[-1]
    below = [p for p in points[:-1] if p[0] <= top / 2] or [p for p in points[:1] if p[0] < top]
    if not below:
        return None
    ref, ref_memory = below[-1]
    return top, top_memory, (top_memory - ref_memory) / (top - ref)


def predict_max(points: Sequence[tuple[int, int]], capacity: int | None) -> float:
    """Predict the largest unit that fits from fitting (unit, memory) points, sorted by unit.

    A line through two of them (see :func:`_line`) where it reaches ``capacity``; one
    point, or a flat or falling line, gives the proportional estimate
    ``unit * capacity / memory``, which never overshoots a line with a positive intercept.

    >>> predict_max([(1, 103), (9, 127)], 1000)
    300.0
    >>> predict_max([(4, 100)], 1000)
    40.0
    """
    if capacity is None or not points:
        return math.inf
    top, top_memory = points[-1]
    if top_memory <= 0:
        return math.inf
    line = _line(points)
    if line is None or line[2] <= 0:
        return top * capacity / top_memory
    return top + (capacity - top_memory) / line[2]


def _fitting_points(trials: Sequence[tuple[int, bool, int]], hi: int | None) -> list[tuple[int, int]]:
    best: dict[int, int] = {}
    for unit, fits, memory in trials:
        if fits and (hi is None or unit < hi):
            best[unit] = memory
    return sorted(best.items())


def _prediction(trials: Sequence[tuple[int, bool, int]], capacity: int | None) -> float:
    _, hi = _bounds_units(trials)
    return predict_max(_fitting_points(trials, hi), capacity)


def _next_unit(space: SearchSpace, trials: list[tuple[int, bool, int]]) -> int | None:
    lo, hi = _bounds_units(trials)
    if not trials:
        return space.guess_units or 1
    if _is_done(space, lo, hi):
        return None
    guess = space.guess_units
    if guess is not None and len(trials) == 1 and trials[0][0] == guess:
        # The guess fitted: try one more to prove it; it did not: back off a little.
        if trials[0][1]:
            return min(guess + 1, space.max_units)
        return max(1, int(guess * GUESS_BACKOFF))
    if lo == 0:
        return 1  # nothing fits yet: the smallest batch tells "broken" from "too large"
    if space.capacity is None:
        # No memory limit: only max_batch_size bounds the search; prove it directly.
        return space.max_units if hi is None else (lo + hi) // 2
    predicted = _prediction(trials, space.capacity)
    if hi is None:
        return _grow(space, trials, lo, predicted)
    return _close_in(space, trials, lo, hi, predicted)


def _floor(value: float, default: int) -> int:
    """``floor(value)``, or ``default`` for an infinite prediction (no memory measured)."""
    return math.floor(value) if math.isfinite(value) else default


def _grow(space: SearchSpace, trials: list[tuple[int, bool, int]], lo: int, predicted: float) -> int:
    """No failure yet: jump towards the prediction, at most :data:`MAX_GROWTH` times.

    Why damped until confirmed: a slope measured from a point where memory was still
    flat (weights and optimizer temporaries dominate small batches) is too low and
    would overshoot; so the jump goes :data:`DAMPING` of the way unless the top three
    fitting trials lie on one line. Why gallop: when the last trial fitted beyond what
    the trials before it predicted, each step is at least twice the last one, so the
    boundary is passed in O(log n) trials; the same after a step of under 2 % that
    fitted (the line keeps saying "just one more", as on a staircase of memory).
    """
    points = _fitting_points(trials, None)
    line = _line(points)
    target = _floor(predicted, space.max_units)
    if line is not None and line[2] <= 0:
        step = lo * (FLAT_GROWTH - 1)  # memory did not grow between far-apart trials
    elif _confirmed_line(points):
        step = target - lo
    else:
        step = math.floor((target - lo) * DAMPING)
    last_unit, last_fits, _ = trials[-1]
    if last_fits and last_unit == lo and len(trials) >= 2:
        earlier = trials[:-1]
        previous_lo, _ = _bounds_units(earlier)
        undershot = last_unit > _floor(_prediction(earlier, space.capacity), space.max_units)
        if previous_lo and (undershot or _crept(trials)):
            step = max(step, 2 * (lo - previous_lo))
    step = min(max(step, 1), lo * (MAX_GROWTH - 1))
    return min(lo + step, space.max_units)


def _crept(trials: list[tuple[int, bool, int]]) -> bool:
    """True when the last two fitting trials each moved ``lo`` up by under 2 %."""
    tops: list[int] = []
    for index in range(len(trials) + 1):
        lo, _ = _bounds_units(trials[:index])
        if lo and (not tops or lo != tops[-1]):
            tops.append(lo)
    if len(tops) < 3:
        return False
    return all(0 < b - a <= max(1, b // 64) for a, b in zip(tops[-3:-1], tops[-2:]))


def _confirmed_line(points: Sequence[tuple[int, int]]) -> bool:
    """True when the top three fitting points are on one line (slopes within 2 %)."""
    if len(points) < 3:
        return False
    (u1, m1), (u2, m2), (u3, m3) = points[-3:]
    first, second = (m2 - m1) / (u2 - u1), (m3 - m2) / (u3 - u2)
    if first <= 0 or second <= 0:
        return False
    return abs(first - second) <= 0.02 * max(first, second)


def _close_in(space: SearchSpace, trials: list[tuple[int, bool, int]], lo: int, hi: int, predicted: float) -> int:
    """A fitting ``lo`` and a failing ``hi``: try the prediction, bisect when it is not helping.

    Predictions are trusted while they pay: after one that cut the interval by less
    than half, the next trial bisects, except one proof (``lo + 1``) right after a trial
    at the predicted maximum fitted. After a wrong proof, or a second failure near
    ``hi``, the line has shown it does not describe this curve, and bisection takes over.
    """
    midpoint = (lo + hi) // 2
    target = _floor(predicted, hi)
    unit, fits, _ = trials[-1]
    if _last_step_was_poor(trials):
        if fits and unit == lo and target <= lo and not _failed_proofs(trials):
            return lo + 1
        return midpoint
    if predicted >= hi:
        if sum(1 for _, f, _ in trials if not f) > 1:
            return midpoint
        # The line says "more" but hi failed: memory grows faster than the line; look
        # just below hi, where the boundary most likely is.
        return max(lo + 1, hi - max(1, (hi - lo) // 16))
    if target <= lo and _failed_proofs(trials):
        return midpoint  # the line keeps saying "lo is the maximum" and was wrong before
    return min(max(target, lo + 1), hi - 1)


def _last_step_was_poor(trials: list[tuple[int, bool, int]]) -> bool:
    """True when the last trial was a line's prediction inside an interval and cut it by
    less than half (a trial made from one point only, before any line, is exempt)."""
    previous_lo, previous_hi = _bounds_units(trials[:-1])
    if previous_hi is None or previous_lo == 0 or len(_fitting_points(trials[:-1], previous_hi)) < 2:
        return False
    if not previous_lo < trials[-1][0] < previous_hi:
        return False  # not a step inside the interval (a trial reused from another search)
    lo, hi = _bounds_units(trials)
    assert hi is not None  # the interval only narrows: previous_hi is still a failure
    return (hi - lo) * 2 > previous_hi - previous_lo


def _failed_proofs(trials: list[tuple[int, bool, int]]) -> bool:
    """True when some trial at ``lo + 1`` (a proof that lo is the maximum) fitted."""
    for index in range(1, len(trials)):
        lo, _ = _bounds_units(trials[:index])
        unit, fits, _ = trials[index]
        if fits and lo and unit == lo + 1:
            return True
    return False


def next_batch_size(space: SearchSpace, outcomes: Sequence[Outcome]) -> int | None:
    """The next batch size to try, or None when the answer is proven (see :func:`answer`)."""
    unit = _next_unit(space, _units(space, outcomes))
    return None if unit is None else unit * space.multiple_of


def run_search(space: SearchSpace, trial: Callable[[int], Outcome], limit: int = 200) -> list[Outcome]:
    """Run the search with ``trial(batch_size) -> Outcome``; return every outcome in order.

    Why a limit: every proposal lies strictly inside the open interval, so the search
    ends; the limit only turns a bug into an error instead of a hang.
    """
    outcomes: list[Outcome] = []
    while (batch := next_batch_size(space, outcomes)) is not None:
        if len(outcomes) >= limit:
            raise RuntimeError(f"batch search did not converge in {limit} trials")
        outcomes.append(trial(batch))
    return outcomes
