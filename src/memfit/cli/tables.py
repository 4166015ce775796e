"""Tables that stay readable in an 80-column terminal: short headers, short words, a legend.

Why here: rich shrinks a table wider than the terminal by cutting every cell ("measu…",
"239,0…"), so the key columns of a plan could not be read at 80 columns. Each command's
table is built from the helpers below: no vertical rules, one space of padding, numbers
in at most six characters, status words of at most eight, and the long names in one
legend line under the table.
"""

from __future__ import annotations

from rich import box
from rich.table import Table

__all__ = ["compact_table", "short_rate", "short_size", "STATUS_WORDS", "status_word", "status_legend"]


def compact_table(title: str | None = None) -> Table:
    """A table without vertical rules and with one space between columns."""
    # one space between columns, none at the edges: ten columns of a plan fit 80 with room to spare
    return Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, title_justify="left")


def short_rate(value: float | None) -> str:
    """A rate in at most six characters, or ``-`` without one.

    >>> [short_rate(v) for v in (None, 0.0, 7.25, 512.3, 2_390.4, 323_538.3, 4.2e7)]
    ['-', '-', '7.25', '512', '2.39k', '324k', '42.0M']
    """
    if not value:
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            shown = value / scale
            return f"{shown:#.3g}{suffix}" if shown < 100 else f"{shown:.0f}{suffix}"
    return f"{value:#.3g}" if value < 100 else f"{value:.0f}"


def short_size(nbytes: int | None) -> str:
    """A size in binary units in at most seven characters, or ``-``.

    >>> [short_size(n) for n in (None, 512, 4 * 2**20, 123_456_789, 81 * 2**30)]
    ['-', '512 B', '4.0 MiB', '118 MiB', '81 GiB']
    """
    if nbytes is None:
        return "-"
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"


#: a plan candidate's status -> the word its table shows (the legend spells them out)
STATUS_WORDS: dict[str, tuple[str, str]] = {
    "measured": ("fits", "measured within the headroom"),
    "over headroom": ("headroom", "fits, but over the headroom"),
    "out of memory": ("OOM", "out of memory"),
    "too large (estimate)": ("est. OOM", "too large by the estimate, not run"),
    "dominated": ("beaten", "a measured candidate is smaller and faster, not run"),
}


#: statuses that carry their detail after a fixed start -> (word, meaning)
STATUS_PREFIXES: dict[str, tuple[str, str]] = {
    "failed": ("failed", "the trial raised (its reason is in --json)"),
    "saves nothing": ("no gain", "this checkpointing saves no memory here, not run"),
}


def status_word(status: str) -> str:
    """The short word for a status (one with its detail after a fixed start: that start's word)."""
    for start, (word, _) in STATUS_PREFIXES.items():
        if status.startswith(start):
            return word
    return STATUS_WORDS.get(status, (status, ""))[0]


def status_legend(statuses: set[str]) -> str:
    """One line naming what each shown word means, in the table's order of words."""
    parts = [f"{word}: {meaning}" for status, (word, meaning) in STATUS_WORDS.items() if status in statuses]
    for start, (word, meaning) in STATUS_PREFIXES.items():
        if any(s.startswith(start) for s in statuses):
            parts.append(f"{word}: {meaning}")
    return " · ".join(parts)
