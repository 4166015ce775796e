"""HTML tables for results: what ``_repr_html_`` shows in Jupyter, and what reports embed.

Why a base-layer module: every result class renders itself as a table in a notebook,
and none should import matplotlib (or the reporting package) to do so. :class:`HtmlRepr`
gives a class with ``to_dict()`` its ``_repr_html_``; the reporting package builds its
pages from the same tables.

>>> print(html_table([{"batch_size": 8, "peak_allocated": 3 * 2**20}]))
<table class="memfit"><thead><tr><th>batch_size</th><th>peak_allocated</th></tr></thead><tbody><tr><td>8</td><td title="3145728 bytes">3.00 MiB</td></tr></tbody></table>
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memfit.units import format_size

__all__ = ["HtmlRepr", "to_html", "html_table", "is_byte_key", "inline_code"]

_BYTE_NAMES = frozenset(
    {"allocated", "reserved", "total", "memory", "capacity", "free", "unallocated", "breakdown", "bytes"}
)
_BYTE_SUFFIXES = ("_allocated", "_reserved", "_bytes", "_memory", "_capacity", "_unallocated", "_total")


def is_byte_key(key: str) -> bool:
    """True when a field of that name holds bytes (``peak_allocated``, ``total``, ``memory``).

    Why by name: memfit's JSON keeps bytes as plain ints, so a table shows "3.00 MiB"
    instead of 3145728 only when the field's name says it is a size.
    """
    name = key.lower()
    return name in _BYTE_NAMES or name.endswith(_BYTE_SUFFIXES) or "bytes" in name


def _cell(value: Any, in_bytes: bool) -> str:
    """One table cell's HTML: sizes for people (bytes in the tooltip), nested values as tables."""
    if value is None:
        return "<td>-</td>"
    if isinstance(value, bool):
        return f"<td>{'yes' if value else 'no'}</td>"
    if isinstance(value, int) and in_bytes:
        return f'<td title="{value} bytes">{html.escape(format_size(value))}</td>'
    if isinstance(value, float):
        return f"<td>{value:.4g}</td>"
    if isinstance(value, (Mapping, list, tuple)) and not value:
        return "<td>-</td>"
    if isinstance(value, Mapping) or _is_rows(value):
        return f"<td>{to_html(value, _bytes=in_bytes)}</td>"
    if isinstance(value, (list, tuple)):
        if all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in value):
            return f"<td>{html.escape(', '.join(str(item) for item in value))}</td>"  # a shape
        return "<td>" + "<br>".join(html.escape(str(item)) for item in value) + "</td>"  # sentences
    return f"<td>{html.escape(str(value))}</td>"


def _is_rows(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, Mapping) for v in value)


def html_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A table with one row per mapping; columns are the union of keys, in first-seen order."""
    rows = list(rows)
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            for key in row:
                seen.setdefault(str(key), None)
        columns = list(seen)
    head = "".join(f"<th>{html.escape(str(column))}</th>" for column in columns)
    body = "".join(
        "<tr>" + "".join(_cell(row.get(column), is_byte_key(str(column))) for column in columns) + "</tr>"
        for row in rows
    )
    return f'<table class="memfit"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _as_data(obj: Any) -> Any:
    """A result object as plain data: its ``to_dict()``, a dataclass's fields, or itself."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def to_html(obj: Any, *, _bytes: bool = False) -> str:
    """Any memfit result, mapping or list of mappings as an HTML table (for ``_repr_html_``).

    A mapping becomes a two-column table (nested mappings and lists of mappings nest as
    tables); a list of mappings becomes one row per item; an object with its own
    ``_repr_html_`` (a finding, say) renders itself.
    """
    if isinstance(obj, (list, tuple)) and obj and all(_renders_itself(item) for item in obj):
        return "".join(item._repr_html_() for item in obj)
    if _renders_itself(obj):
        return str(obj._repr_html_())
    data = _as_data(obj)
    if _is_rows(data):
        return html_table([_as_data(row) for row in data])
    if isinstance(data, Mapping):
        rows = "".join(
            f"<tr><th>{html.escape(str(key))}</th>{_cell(_as_data(value), _bytes or is_byte_key(str(key)))}</tr>"
            for key, value in data.items()
        )
        return f'<table class="memfit"><tbody>{rows}</tbody></table>'
    return f"<pre>{html.escape(str(data))}</pre>"


def _renders_itself(obj: Any) -> bool:
    """True for an object with its own ``_repr_html_`` that is not the generic one."""
    method = getattr(type(obj), "_repr_html_", None)
    return method is not None and method is not HtmlRepr._repr_html_


def inline_code(text: str) -> str:
    """Escape text and turn `backquoted` spans into <code>."""
    pieces = html.escape(text).split("`")
    return "".join(f"<code>{piece}</code>" if index % 2 else piece for index, piece in enumerate(pieces))


class HtmlRepr:
    """Mixin: a result with ``to_dict()`` shows as a table in Jupyter."""

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def _repr_html_(self) -> str:
        return to_html(self.to_dict())
