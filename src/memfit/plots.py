"""Figures for plan results (PNG, matplotlib's Agg back end: no display needed)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit.planning import Plan

__all__ = ["plan_figure", "save_png"]


def save_png(figure: object, path: str | os.PathLike[str]) -> Path:
    """Save a matplotlib figure atomically (temp file, then rename) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        figure.savefig(tmp, dpi=120, bbox_inches="tight")  # type: ignore[attr-defined]
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(figure)  # type: ignore[arg-type]
    return path


def plan_figure(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Peak reserved memory against samples/s for every measured candidate, with the
    Pareto front joined and the recommendation starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [c for c in plan.candidates if c.fits]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    markers = {"fp32": "o", "bf16": "s", "fp16": "^"}
    for c in measured:
        assert c.measurement is not None
        s = c.settings
        axes.scatter(
            c.measurement.peak_reserved / 2**30, c.samples_per_second,
            marker=markers.get(s.precision, "o"),
            facecolors="none" if s.checkpointing == "blocks" else None,
            edgecolors="C0", color="C0", s=50,
        )
        axes.annotate(f"{s.micro_batch_size}×{s.accumulation_steps}", (c.measurement.peak_reserved / 2**30, c.samples_per_second),
                      textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = plan.pareto
    if front:
        axes.plot([c.measurement.peak_reserved / 2**30 for c in front], [c.samples_per_second for c in front],
                  color="C1", linewidth=1, label="Pareto front")
    if plan.recommended is not None and plan.recommended.measurement is not None:
        axes.scatter(plan.recommended.measurement.peak_reserved / 2**30, plan.recommended.samples_per_second,
                     marker="*", s=250, color="C3", label="recommended", zorder=3)
    if plan.capacity:
        axes.axvline(plan.capacity / 2**30, color="grey", linestyle="--", label="capacity")
    for precision, marker in markers.items():
        axes.scatter([], [], marker=marker, color="C0", label=precision)
    axes.set_xlabel("peak reserved memory (GiB)")
    axes.set_ylabel("samples/s")
    axes.set_title(f"{plan.workload}: target batch {plan.target_batch_size} (hollow = checkpointing)")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    return save_png(figure, path)
