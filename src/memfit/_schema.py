"""One schema per file memfit reads: every field checked for type, range, finiteness and size.

A file memfit reads back (``memfit.lock``, ``environment.json``, a monitor's ``RUN.jsonl``,
a ``--probe``/``--estimate``/``--plan`` result) is described once, as a :class:`Table` of
:class:`Field` s, and checked field by field when it is read. Whatever memfit could not have
written is refused with one line naming the field (``settings.micro_batch_size``), so a
damaged file never reaches the code that uses it:

- ``true`` is not a number (Python's ``bool`` is an ``int``: checked first);
- ``8.5`` is not a whole number, ``1e308`` neither, and ``inf`` / ``nan`` are no number;
- a whole number lies in its range (a batch of 0 or -5, a world size of 0, a byte count
  of ``10**5000``, a negative capacity are refused);
- text is text, and short (a 5000-character ``python`` is not a version);
- a TOML date where memfit writes text is refused like any other wrong type.

>>> LOCKED = Table({"micro_batch_size": Field("int", low=1, high=2**31)})
>>> LOCKED.check({"micro_batch_size": 8}, "memfit.lock")
{'micro_batch_size': 8}
>>> LOCKED.check({"micro_batch_size": True}, "memfit.lock")
Traceback (most recent call last):
memfit.errors.MemfitError: memfit.lock: micro_batch_size must be a whole number from 1 to 2147483648, not true
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import MemfitError

__all__ = ["Field", "Table", "Rows", "shown", "MAX_BYTES", "MAX_COUNT", "MAX_TEXT", "finite_or_none"]

#: the most bytes any memory figure can hold (1 EiB: far above any machine, far below overflow)
MAX_BYTES = 2**60
#: the most of anything countable (steps, samples, retries) a memfit file records
MAX_COUNT = 2**48
#: the longest text field memfit writes (a version, a device, a workload reference)
MAX_TEXT = 4096

_KINDS = {
    "int": "a whole number",
    "number": "a number",
    "str": "text",
    "bool": "true or false",
    "table": "an object",
    "rows": "a list of objects",
}


def shown(value: Any) -> str:
    """A short, safe rendering of a bad value for a one-line message (never a 5000-digit number)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return (
            str(value) if value.bit_length() <= 64 else f"a number of about {int(value.bit_length() * 0.30103)} digits"
        )
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"  # a TOML date or time


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinity inside it replaced by None (strict JSON has neither).

    >>> finite_or_none({"a": [1.5, float("nan")], "b": float("inf")})
    {'a': [1.5, None], 'b': None}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


@dataclass(frozen=True)
class Field:
    """One field: its kind, whether it may be missing or null, its range or choices.

    Args:
        kind: ``int``, ``number``, ``str``, ``bool``, ``table`` (with ``fields``) or
            ``rows`` (a list of tables, each with ``fields``).
        required: the field must be there.
        nullable: ``null`` is allowed (JSON only; TOML has no null).
        low: the smallest value (numbers), or the fewest characters (text).
        high: the largest value (numbers), or the most characters (text).
        choices: the only values allowed (text).
        fields: the schema of a table, or of each row.
    """

    kind: str
    required: bool = True
    nullable: bool = False
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    fields: Table | None = None

    def expected(self) -> str:
        what = _KINDS[self.kind]
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.kind in ("int", "number") and self.low is not None and self.high is not None:
            low = int(self.low) if float(self.low).is_integer() else self.low
            high = int(self.high) if float(self.high).is_integer() else self.high
            return f"{what} from {low} to {high}"
        if self.kind in ("int", "number") and self.low is not None:
            return f"{what} of at least {self.low:g}"
        if self.kind == "str" and self.high is not None:
            return f"{what} of at most {int(self.high)} characters"
        return what

    def problem(self, value: Any) -> bool:
        """True when ``value`` does not fit this field (rows and tables: their own type only)."""
        if value is None:
            return not self.nullable
        if self.kind == "bool":
            return not isinstance(value, bool)
        if self.kind in ("int", "number"):
            if isinstance(value, bool):
                return True
            if self.kind == "int" and not isinstance(value, int):
                return True
            if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
                return True
            return (self.low is not None and value < self.low) or (self.high is not None and value > self.high)
        if self.kind == "str":
            if not isinstance(value, str):
                return True
            high = MAX_TEXT if self.high is None else self.high
            return (
                len(value) > high
                or (self.low is not None and len(value) < self.low)
                or (bool(self.choices) and value not in self.choices)
            )
        if self.kind == "table":
            return not isinstance(value, Mapping)
        return not isinstance(value, list) or not all(isinstance(row, Mapping) for row in value)  # rows


@dataclass(frozen=True)
class Table:
    """A table's fields by name; ``strict``: a key not named here is refused too.

    Args:
        fields: name -> :class:`Field`.
        strict: refuse keys the schema does not name (a file memfit writes has no others).
    """

    fields: Mapping[str, Field] = field(default_factory=dict)
    strict: bool = False

    def check(self, data: Any, source: str, prefix: str = "") -> dict[str, Any]:
        """Return ``data`` (a dict) when every field fits; else a one-line MemfitError naming it.

        Args:
            data: the parsed table.
            source: the file, as the message names it.
            prefix: the path of this table inside the file (``settings.``).
        """
        if not isinstance(data, Mapping):
            where = prefix.rstrip(".") or "the file"
            raise MemfitError(f"{source}: {where} must be an object, not {shown(data)}")
        for name, spec in self.fields.items():
            where = f"{prefix}{name}"
            if name not in data:
                if spec.required:
                    raise MemfitError(f"{source}: {where} is missing")
                continue
            value = data[name]
            if spec.problem(value):
                raise MemfitError(f"{source}: {where} must be {spec.expected()}, not {shown(value)}")
            if spec.fields is not None and value is not None:
                if spec.kind == "table":
                    spec.fields.check(value, source, f"{where}.")
                else:
                    for index, row in enumerate(value):
                        spec.fields.check(row, source, f"{where}[{index}].")
        if self.strict:
            unknown = [str(key) for key in data if key not in self.fields]
            if unknown:
                where = f"{prefix}{unknown[0]}"
                raise MemfitError(f"{source}: {where} is not a field memfit writes")
        return dict(data)


def Rows(fields: Table, required: bool = True) -> Field:  # named like a kind, as Field is
    """A field holding a list of tables, each checked against ``fields``.

    Args:
        fields: the schema of each row.
        required: the field must be there.
    """
    return Field("rows", required=required, fields=fields)
