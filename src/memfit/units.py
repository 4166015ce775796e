"""Sizes in bytes: parse "8GiB" / "8GB" / "512MiB" / "1024" and format bytes for people.

Inside memfit every size is an ``int`` of bytes; units exist only at the edges (command
line, tables, messages).

>>> parse_size("8GiB")
8589934592
>>> parse_size("8GB")
8000000000
>>> format_size(3 * 2**20)
'3.00 MiB'
"""

from __future__ import annotations

import re

from memfit.errors import MemfitError

__all__ = ["parse_size", "format_size", "KiB", "MiB", "GiB"]

KiB = 2**10
MiB = 2**20
GiB = 2**30

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 2**40,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size such as ``"8GiB"`` (2^30), ``"8GB"`` (10^9) or ``"1024"`` into bytes.

    Why strict: a typo such as ``8GiG`` must not silently become 8 bytes; it raises
    :class:`MemfitError` naming the accepted units.
    """
    if isinstance(text, bool):
        raise MemfitError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise MemfitError(f"invalid size {text}: must be positive")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise MemfitError(f"invalid size {text!r}: use a number with a unit such as 8GiB, 512MiB, 16GB or plain bytes")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise MemfitError(f"invalid size {text!r}: must be at least one byte")
    return round(value)


def format_size(nbytes: float) -> str:
    """Format bytes with binary units, two decimals, the way CUDA's OOM message does."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or (unit == "GiB" and value < 1024 * 1024):
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"
