"""The batch within the headroom, and when a throughput reading may decide. Pure, no torch.

Probe first proves the largest batch that fits; the batch it recommends must also leave
``headroom`` of the device free, so its peak reserved memory is at most a *budget*
``(1 - headroom) x capacity``. :func:`next_headroom_batch` proposes the trials that find
it, reusing every trial of the search for the maximum:

- the line is the *measured* memory of every trial that ran, the ones above the budget
  included (the maximum itself usually is one): where it crosses the budget is the first
  trial, so a curve that is flat at small batches (weights and optimizer state dominate)
  does not drag the answer down to them;
- with a single measured point there is no line: the next trial is half way down, which
  gives one (and usually a batch within the budget);
- once a trial lands above the budget, the next ones bisect: reserved memory is a
  staircase (CUDA's allocator reserves 2 and 20 MiB segments), so a line can keep landing
  on the same stair, and bisection still halves the interval;
- the answer is the largest batch *verified* within the budget, never a prediction, and
  never below the largest such trial already run.

>>> budget = 950
>>> def trial(b):                       # memory 100 + 3 per sample; 300 fits the device (1000)
...     return Outcome(b, 100 + 3 * b <= 1000, 100 + 3 * b)
>>> outcomes = [trial(300), trial(301)]  # the search for the maximum (a right guess)
>>> while (b := next_headroom_batch(outcomes, budget, maximum=300)) is not None:
...     outcomes.append(trial(b))
>>> [o.batch_size for o in outcomes[2:]], within_budget(outcomes, budget, maximum=300)
([150, 283, 284], 283)

:func:`repeatable` says whether two timings of each of two batches can tell them apart
by ``tolerance`` (the noise must leave a margin): a throughput rule applies only then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from memfit.batch_search import Outcome
from memfit.errors import MemfitError

__all__ = ["DEFAULT_HEADROOM", "check_headroom", "next_headroom_batch", "within_budget", "spread", "repeatable"]

#: the fraction of the device's memory a recommendation leaves free, unless told otherwise
#: (probe, plan, fit, the command line, the Lightning callback; a lock that does not say)
DEFAULT_HEADROOM = 0.05


def check_headroom(headroom: float) -> None:
    """Refuse a headroom that is not a fraction in [0, 1), in one line (before any work).

    >>> check_headroom(1.5)
    Traceback (most recent call last):
    ...
    memfit.errors.MemfitError: invalid headroom 1.5: use a fraction in [0, 1), such as 0.05
    """
    if not 0 <= headroom < 1:
        raise MemfitError(f"invalid headroom {headroom}: use a fraction in [0, 1), such as {DEFAULT_HEADROOM}")


def _units(outcomes: Sequence[Outcome], multiple_of: int) -> list[tuple[int, bool, int]]:
    return [(max(1, o.batch_size // multiple_of), o.fits, o.memory) for o in outcomes]


def within_budget(outcomes: Sequence[Outcome], budget: int, *, maximum: int, multiple_of: int = 1) -> int:
    """The largest batch up to ``maximum`` that fitted with memory at most ``budget`` (0: none)."""
    inside = [o.batch_size for o in outcomes if o.fits and o.memory <= budget and o.batch_size <= maximum]
    best = max(inside, default=0)
    return (best // multiple_of) * multiple_of


def _verify_guess(trials: Sequence[tuple[int, bool, int]], budget: int, guess: int, top: int) -> int | None:
    """The unit that verifies a predicted headroom batch: the guess itself, then the
    neighbour that proves it (the next unit above a guess within the budget, the one below
    a guess over it); None once both ran, or when the maximum's trials already decide."""
    ran = {u: fits and memory <= budget for u, fits, memory in trials}
    g = max(1, min(guess, top))
    if g not in ran:
        return g
    neighbour = g + 1 if ran[g] else g - 1
    if 1 <= neighbour <= top and neighbour not in ran:
        return neighbour
    return None


def next_headroom_batch(
    outcomes: Sequence[Outcome],
    budget: int,
    *,
    maximum: int,
    multiple_of: int = 1,
    phase_start: int | None = None,
    guess: int | None = None,
) -> int | None:
    """The next batch to try for the largest batch within ``budget``, or None once it is proven.

    With a ``guess`` (the estimator's headroom batch: where its memory line crosses the
    budget) the guess is tried first, then its neighbour (one multiple above when it kept
    the budget, below when it did not): with an exact estimate that proves the answer in
    two trials. When they disagree with the guess, the line and bisection below go on from
    every trial so far.

    Args:
        outcomes: every trial so far (memory: peak reserved bytes of a fitting trial).
        budget: the most memory the batch may use, ``(1 - headroom) x capacity``.
        maximum: the largest batch that fits at all (proven by the search before).
        multiple_of: only multiples of this are batches.
        phase_start: the index in ``outcomes`` of this search's first trial (default: the
            trials after the maximum's proof are found by themselves: any trial above the
            budget after the first one that is ``maximum`` or more).
        guess: a predicted headroom batch, verified first (None: the line from the trials).
    """
    trials = _units(outcomes, multiple_of)
    top = maximum // multiple_of
    if guess is not None and top >= 1:
        unit = _verify_guess(trials, budget, guess // multiple_of, top)
        if unit is not None:
            return unit * multiple_of
    inside = [u for u, fits, memory in trials if fits and memory <= budget and u <= top]
    lo = max(inside, default=0)
    if lo >= top:
        return None  # the maximum itself is within the budget
    over = [u for u, fits, memory in trials if u > lo and (not fits or memory > budget)]
    hi = min([*over, top + 1])
    if hi <= lo + 1:
        return None
    start = _phase_start(outcomes, maximum) if phase_start is None else phase_start
    # a guess and its neighbour over the budget were the estimate's, not the line's overshoot
    verified = set() if guess is None else {max(1, min(guess // multiple_of, top)) + d for d in (-1, 0, 1)}
    overshot = any(not fits or memory > budget for u, fits, memory in trials[start:] if u not in verified)
    points = sorted({u: memory for u, fits, memory in trials if fits and u <= top}.items())
    if overshot:
        unit = (lo + hi) // 2  # the line overshot once: a staircase, or a bend; halve from now on
    else:
        unit = _crossing(points, budget, lo, hi)
    return max(lo + 1, min(unit, hi - 1)) * multiple_of


def _phase_start(outcomes: Sequence[Outcome], maximum: int) -> int:
    """Where the headroom trials begin: after the last trial of ``maximum`` or above."""
    last = max((i for i, o in enumerate(outcomes) if o.batch_size >= maximum), default=-1)
    return last + 1


def _crossing(points: Sequence[tuple[int, int]], budget: int, lo: int, hi: int) -> int:
    """Where the memory line reaches ``budget``; half way down when there is no line.

    The line runs through the lowest point at or above ``hi``'s side of the budget (the
    smallest measured unit not below ``hi``, else the top point) and the highest point
    at or below half of it: two points far apart, so rounding does not drown the slope.
    """
    if not points:
        return (lo + hi) // 2
    above = [p for p in points if p[0] >= hi] or [points[-1]]
    top, top_memory = above[0]
    below = [p for p in points if p[0] <= top / 2] or [p for p in points if p[0] < top][:1]
    if not below:
        # only points at or above hi (a guess over the budget, its neighbour, the maximum):
        # the farthest of them from hi makes the line
        below = [p for p in points if p[0] > top][-1:]
    if not below:
        return (lo + hi) // 2  # one point: the trial half way down makes a line
    ref, ref_memory = below[-1]
    slope = (top_memory - ref_memory) / (top - ref)
    if slope <= 0:
        return (lo + hi) // 2
    return math.floor(top + (budget - top_memory) / slope)


def spread(timings: Sequence[float]) -> float:
    """How far apart repeated timings of one thing are, relative to the fastest.

    >>> round(spread([0.10, 0.11]), 3)
    0.1
    """
    fastest = min(timings)
    return (max(timings) - fastest) / fastest if fastest > 0 else math.inf


def repeatable(timings: Sequence[Sequence[float]], tolerance: float) -> tuple[bool, float]:
    """(True when every list of repeated timings agrees within ``tolerance``, the worst spread).

    Why: a throughput rule that calls two batches "as fast" within 2 % needs timings that
    repeat to better than 2 %; on a shared CPU one step can take three times another.
    A single timing shows no noise, so it is not repeatable.
    """
    if not timings or any(len(t) < 2 for t in timings):
        return False, math.inf
    worst = max(spread(t) for t in timings)
    return worst < tolerance, worst
