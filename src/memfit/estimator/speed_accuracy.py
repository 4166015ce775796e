"""How far memfit's predicted step times were from published real-GPU throughputs: the
validation figures of ``bench/predicted_speed.py``, overall and by what bounds the step.

Why: a predicted samples/s is what a user plans a purchase or a rental on, and a figure
without its error band reads as exact. The band depends on what bounds the step: memfit
times each kernel class by its own rule (:mod:`memfit.estimator.kernel_rates`), and some
rules are checked better than others. So :func:`describe` gives the error of the published
rows whose predicted step was bound by the same class as the user's, beside the overall one.

The figures are data, never typed in: ``python bench/predicted_speed.py`` writes
``speed_accuracy.json`` beside this module from the same run that writes docs/benchmarks.md
(its validation rows only: no efficiency was fitted to them).

>>> table = SpeedAccuracy(Band(50, 9.0, 53.0), {"gemm": Band(12, 8.0, -17.5)}, 0.99, "python bench/x.py")
>>> describe(table, "gemm")
'checked against 50 published GPU throughputs: median error 9.0 %, worst +53.0 %; the 12 bound by gemm as this step is: median 8.0 %, worst -17.5 % (docs/benchmarks.md)'
>>> describe(table)
'checked against 50 published GPU throughputs: median error 9.0 %, worst +53.0 % (docs/benchmarks.md)'
>>> describe(table, "host")
'checked against 50 published GPU throughputs: median error 9.0 %, worst +53.0 %; none was bound by host as this step is (docs/benchmarks.md)'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["Band", "SpeedAccuracy", "load", "describe", "sentence", "for_step", "FILE"]

#: the data file beside this module, written by ``bench/predicted_speed.py``
FILE = "speed_accuracy.json"


@dataclass(frozen=True)
class Band:
    """The error of a set of published rows: how many, the median |error| and the worst
    (signed: + is predicted faster than published), in percent."""

    rows: int
    median_abs_error_pct: float
    worst_error_pct: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "median_abs_error_pct": self.median_abs_error_pct,
            "worst_error_pct": self.worst_error_pct,
        }


@dataclass(frozen=True)
class SpeedAccuracy:
    """The validation figures of the predicted-speed bench."""

    overall: Band
    #: by the kernel class that bounds the predicted step (``StepTime.bound_by``)
    by_bound: dict[str, Band]
    spearman: float
    #: the command that wrote them
    command: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "overall": self.overall.to_dict(),
            "by_bound": {name: band.to_dict() for name, band in self.by_bound.items()},
            "spearman": self.spearman,
            "command": self.command,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeedAccuracy:
        """Read :meth:`to_dict`'s form (KeyError, TypeError or ValueError when it is not)."""
        return cls(
            _band(data["overall"]),
            {str(name): _band(band) for name, band in data["by_bound"].items()},
            float(data["spearman"]),
            str(data["command"]),
        )


def _band(data: dict[str, Any]) -> Band:
    return Band(int(data["rows"]), float(data["median_abs_error_pct"]), float(data["worst_error_pct"]))


@cache
def load() -> SpeedAccuracy | None:
    """The figures installed with memfit; None when the file is missing or unreadable (a
    broken install: the prediction is then shown without its band, not refused)."""
    try:
        text = resources.files("memfit.estimator").joinpath(FILE).read_text()
        return SpeedAccuracy.from_dict(json.loads(text))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def describe(accuracy: SpeedAccuracy, bound_by: str | None = None) -> str:
    """One clause: the overall error, and that of the rows bound as this step is.

    Args:
        accuracy: the figures (:func:`load`).
        bound_by: what bounds the user's predicted step (a kernel class's name, or ``host``;
            None: the overall error alone, for a table of several steps).
    """
    o = accuracy.overall
    text = (
        f"checked against {o.rows} published GPU throughputs: median error {o.median_abs_error_pct:.1f} %, "
        f"worst {o.worst_error_pct:+.1f} %"
    )
    if bound_by is None:
        return text + " (docs/benchmarks.md)"
    text += "; "
    mine = accuracy.by_bound.get(bound_by)
    name = bound_by.replace("_", " ")
    if mine is None:
        text += f"none was bound by {name} as this step is"
    else:
        text += (
            f"the {mine.rows} bound by {name} as this step is: median {mine.median_abs_error_pct:.1f} %, "
            f"worst {mine.worst_error_pct:+.1f} %"
        )
    return text + " (docs/benchmarks.md)"


def sentence() -> str:
    """The overall band as a sentence (with its leading space) to append to a line that gives
    predicted speeds, plan's legend and fit's summary; "" without the installed figures."""
    table = load()
    return f" Such predictions were {describe(table)}." if table is not None else ""


def for_step(bound_by: str) -> dict[str, Any] | None:
    """The band an estimate reports beside a step bound by ``bound_by`` (its ``speed_accuracy``):
    the overall figures, those of the rows bound alike (None when none was), the sentence
    :func:`describe` makes of them, and where they come from; None without the installed figures.

    Args:
        bound_by: what bounds the predicted step (``StepTime.bound_by``).
    """
    table = load()
    if table is None:
        return None
    mine = table.by_bound.get(bound_by)
    return {
        "overall": table.overall.to_dict(),
        "bound_by": bound_by,
        "same_bound": mine.to_dict() if mine is not None else None,
        "text": describe(table, bound_by),
        "source": f"docs/benchmarks.md ({table.command})",
    }
