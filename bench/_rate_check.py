"""What the scripts that derive memfit's rates from published measurements share
(bench/neusight_kernels.py, bench/xla_matmul_table.py): the rate that makes a prediction
exact, the median per card, the error band of a set of predictions, the lines where the
module's table and the derived rates differ, and the end of their runs."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """memfit's error on some measurements: how many, median |error| and median error (per cent).

    >>> Band.of([-10.0, 2.0, 4.0])
    Band(count=3, median_abs=4.0, median=2.0)
    """

    count: int
    median_abs: float
    median: float

    @classmethod
    def of(cls, errors: list[float]) -> Band:
        return cls(len(errors), statistics.median(abs(e) for e in errors), statistics.median(errors))


def exact_rate(rate: float, computing: float, moving: float, seconds: float) -> float:
    """The rate that makes memfit's time for a product exact, where its FLOPs take
    ``computing`` seconds at ``rate`` and its bytes ``moving`` seconds and it was measured at
    ``seconds`` (its own: the rest of a measured call taken off): ``rate`` x ``computing`` /
    ``seconds``, only the FLOPs' time scaling with the rate (a product takes the larger of the
    two); NaN where no rate can (no FLOPs, or its bytes alone take ``seconds`` or longer).

    >>> import math
    >>> exact_rate(0.8, 2.0, 0.5, 4.0), math.isnan(exact_rate(0.8, 2.0, 4.0, 4.0))
    (0.4, True)
    """
    if computing <= 0 or seconds <= moving:
        return float("nan")
    return rate * computing / seconds


def medians(found: Mapping[str, list[float]]) -> dict[str, tuple[float, int]]:
    """(median, how many) of each name's values, by name.

    >>> medians({"T4": [0.4, 0.5, 0.9], "L4": [0.26]})
    {'L4': (0.26, 1), 'T4': (0.5, 3)}
    """
    return {name: (statistics.median(values), len(values)) for name, values in sorted(found.items())}


def differences(table: Mapping[str, float], derived: Mapping[str, float], measured: str) -> list[str]:
    """One line for each name where ``table`` (the module's figures) and ``derived`` (what
    the ``measured`` things give, rounded to three places as the module holds them) differ,
    a name missing on either side included.

    >>> differences({"L4": 0.264, "T4": 0.47}, {"L4": 0.26412, "V100": 0.9}, "kernels")
    ['T4: the table has 0.47, the kernels give None', 'V100: the table has None, the kernels give 0.9']
    """
    rounded = {name: round(value, 3) for name, value in derived.items()}
    return [
        f"{name}: the table has {table.get(name)}, the {measured} give {rounded.get(name)}"
        for name in sorted(set(rounded) | set(table))
        if rounded.get(name) != table.get(name)
    ]


def finish(text: str, wrong: list[str], *, script: str, measured: str, section: str, docs: bool) -> int:
    """Print ``text`` (a docs section); end with status 1, writing nothing, where the module's
    figures differ from what was derived (``wrong``: :func:`differences`' lines), else write
    the section of docs/benchmarks.md when ``docs`` asks: the exit status."""
    print(text)
    if wrong:
        print(f"{script}: memfit's rates differ from these {measured}:", *wrong, sep="\n  ", file=sys.stderr)
        return 1
    if docs:
        from _results import write_section

        write_section(section, text)
    return 0
