"""Reading the files a user hands memfit: text and JSON, refused with one line when wrong.

Every input file (``environment.json``, a monitor's ``RUN.jsonl``, a ``--probe`` result,
``memfit.lock``) is read through here, so each bad case ends in one ``MemfitError`` line
instead of a traceback:

- not a regular file (a folder, ``/dev/zero``, a pipe that would block forever);
- larger than the caller allows (a JSON result is kilobytes, not gigabytes);
- not UTF-8 text (a binary file given by mistake);
- JSON nested so deeply that the parser would exhaust Python's stack;
- numbers no memfit file holds: ``NaN``, ``Infinity``, ``1e400`` (infinite once read) and
  integers too long for Python to convert (5000 digits).

What each field must hold is checked after parsing, by the file's schema (:mod:`memfit._schema`).

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "deep.json"
>>> _ = path.write_text("[" * 100_000 + "]" * 100_000)
>>> load_json(path, "environment file")
Traceback (most recent call last):
memfit.errors.MemfitError: ...deep.json is nested too deeply to be a memfit file
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError

__all__ = [
    "read_text",
    "parse_json",
    "strict_loads",
    "NotFiniteError",
    "load_json",
    "nesting_depth",
    "MAX_RESULT_BYTES",
    "MAX_DEPTH",
]

#: the deepest nesting of lists and objects accepted: a memfit file nests four levels or
#: so; a few hundred would already exhaust the stack of the code that renders it
MAX_DEPTH = 64

#: the largest result file (``--json`` output, environment.json) memfit reads: far above
#: any real one, far below what would make reading it a problem
MAX_RESULT_BYTES = 64 * 2**20


def read_text(path: str | os.PathLike[str], what: str, max_bytes: int | None = None) -> str:
    """The UTF-8 text of a regular file; a one-line MemfitError for anything else.

    Args:
        path: the file to read.
        what: how the message names it (such as ``"environment file"``).
        max_bytes: refuse larger files (None: no limit).
    """
    source = Path(path)
    try:
        info = source.stat()
    except OSError as error:
        raise MemfitError(f"cannot read the {what} {source}: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise MemfitError(f"the {what} {source} is {kind}")
    if max_bytes is not None and info.st_size > max_bytes:
        raise MemfitError(f"the {what} {source} is {info.st_size} bytes, more than a memfit file ever is")
    try:
        data = source.read_bytes()
    except OSError as error:
        raise MemfitError(f"cannot read the {what} {source}: {error.strerror or error}") from None
    if b"\x00" in data:
        raise MemfitError(f"the {what} {source} is a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MemfitError(f"the {what} {source} is not UTF-8 text (byte {error.start})") from None


def nesting_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (iterative: no recursion).

    >>> nesting_depth({"a": [1, {"b": []}]}), nesting_depth(3)
    (4, 0)
    """
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


class NotFiniteError(ValueError):
    """A JSON number that is not finite (its text is the message)."""


def _no_constant(text: str) -> float:
    raise NotFiniteError(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotFiniteError(text if len(text) <= 20 else "a number too large")
    return value


def strict_loads(text: str) -> Any:
    """``json.loads`` refusing what no memfit file holds: NaN, Infinity, numbers that overflow.

    Raises ``json.JSONDecodeError`` for text that is not JSON, :class:`NotFiniteError` for a
    number that is not finite, ``ValueError`` for an integer too long to convert and
    ``RecursionError`` for nesting too deep.
    """
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def parse_json(text: str, where: str, hint: str = "", max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON text; a one-line MemfitError names ``where`` (a file, or ``file:line``).

    Args:
        text: the JSON.
        where: the file name (with a line number for JSON lines).
        hint: what the file should have been, added to the message.
        max_depth: refuse lists and objects nested deeper than this.
    """
    ending = f"; {hint}" if hint else ""
    too_deep = MemfitError(f"{where} is nested too deeply to be a memfit file{ending}")
    try:
        data = strict_loads(text)
    except json.JSONDecodeError as error:
        raise MemfitError(f"{where} is not valid JSON (line {error.lineno}, column {error.colno}){ending}") from None
    except NotFiniteError as error:
        raise MemfitError(f"{where} holds {error}, which no memfit file holds{ending}") from None
    except ValueError:  # int(): more digits than Python converts (sys.get_int_max_str_digits)
        raise MemfitError(f"{where} holds a number too long to be a memfit file's{ending}") from None
    except RecursionError:
        raise too_deep from None
    if nesting_depth(data) > max_depth:
        raise too_deep
    return data


def load_json(
    path: str | os.PathLike[str],
    what: str,
    hint: str = "",
    max_bytes: int | None = MAX_RESULT_BYTES,
    where: str | None = None,
) -> Any:
    """Read and parse one JSON file (see :func:`read_text` and :func:`parse_json`).

    Args:
        path: the file to read.
        what: how the message names it when it cannot be read.
        hint: what the file should have been, added to a parse error.
        max_bytes: refuse larger files (None: no limit).
        where: how a parse error names the file (default: its path).
    """
    return parse_json(read_text(path, what, max_bytes), where or str(path), hint)
