"""Drawing helpers shared by every figure memfit makes (matplotlib, imported on first use).

Figures are drawn on matplotlib's Agg canvas: no display, no pyplot state, so they render
headless and in any thread.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from memfit.units import GiB, KiB, MiB

__all__ = ["LEGEND_OUTSIDE", "binary_unit", "new_figure", "png_bytes", "png_data_uri"]

#: legends right of the plot, so they never hide a line
LEGEND_OUTSIDE: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8, "frameon": False}


def binary_unit(largest: float) -> tuple[str, int]:
    """The binary unit that keeps a chart's numbers readable."""
    for name, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if largest >= size:
            return name, size
    return "B", 1


def new_figure(width: float = 10.0, height: float = 4.2) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png_bytes(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # Agg: a Figure made without pyplot renders headless
    return buffer.getvalue()


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
