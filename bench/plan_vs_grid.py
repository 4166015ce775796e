"""memfit plan against an exhaustive grid of the same candidates, on simulated GPUs.

For each workload the target batch does not fit at once in fp32. The grid measures every
candidate (micro-batch x accumulation = target, each precision, each checkpointing mode)
with the same trial plan uses (two optimizer steps of one micro-batch). Then plan runs on
a fresh device. Reported: the plan's recommendation's samples/s *as the grid measured it*
against the grid's best, and optimizer steps run by each. Targets: at least 95 % of the
best, with at most a third of the grid's steps.

Run: ``python bench/plan_vs_grid.py`` (writes the "plan" section of docs/benchmarks.md).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memfit
from _results import write_section
from memfit.search.candidates import candidates, checkpointing_modes
from memfit.search.plan import plan
from memfit.search.plan_trials import trial

CASES = [
    ("mlp:layers=4,width=256,features=256", "sim:8MiB", 512),
    ("convnet:blocks=2,channels=16,image_size=32", "sim:12MiB", 128),
    ("gpt2:n_layer=2,n_embd=64,n_head=2,seq_len=32,vocab_size=512", "sim:12MiB", 64),
]


def grid(ref: str, spec: str, target: int) -> tuple[dict, int]:
    """Every candidate measured; returns {settings: samples/s or None} and the steps run."""
    workload = memfit.load_workload(ref)
    model = workload.build_model()
    modes = checkpointing_modes(model)
    del model
    speeds: dict = {}
    steps = 0
    for settings in candidates(target, checkpointing=modes):
        result = trial(workload, settings, memfit.device(spec))
        steps += 2
        speeds[settings] = result.samples_per_second if result.fits else None
    return speeds, steps


def main() -> None:
    torch.manual_seed(0)
    rows = []
    started = time.time()
    for ref, spec, target in CASES:
        fp32 = memfit.measure(ref, target, spec)
        t0 = time.time()
        speeds, grid_steps = grid(ref, spec, target)
        grid_seconds = time.time() - t0
        t0 = time.time()
        result = plan(ref, target, memfit.device(spec), headroom=0)  # the grid counts every fit, so must the plan
        plan_seconds = time.time() - t0
        best_settings = max((s for s in speeds if speeds[s]), key=lambda s: speeds[s])
        chosen = result.recommended.settings
        chosen_speed = speeds.get(chosen)
        share = (chosen_speed or 0.0) / speeds[best_settings]
        rows.append(
            {
                "workload": ref,
                "device": spec,
                "target": target,
                "fp32 fits at once": fp32.fits,
                "candidates": len(speeds),
                "fit": sum(1 for v in speeds.values() if v),
                "grid best": _describe(best_settings),
                "grid best samples/s": speeds[best_settings],
                "plan chose": _describe(chosen),
                "plan choice in grid samples/s": chosen_speed,
                "share of best": share,
                "grid steps": grid_steps,
                "plan steps": result.trial_steps,
                "steps ratio": result.trial_steps / grid_steps,
                "grid s": grid_seconds,
                "plan s": plan_seconds,
            }
        )
        print(rows[-1], flush=True)
    total = time.time() - started
    lines = [
        "## memfit plan against an exhaustive grid",
        "",
        f"Command: `python bench/plan_vs_grid.py` ({platform.machine()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {total:.0f} s in all).",
        "",
        "The grid measures every candidate (micro-batch × accumulation = target; fp32, bf16, fp16;",
        "checkpointing none and blocks) with plan's own trial (two optimizer steps of one",
        "micro-batch). The plan's choice is scored by the grid's measurement of the same",
        "candidate, so both sides are judged by one set of timings. Targets: ≥ 95 % of the",
        "grid's best samples/s with ≤ 1/3 of its optimizer steps. Speeds are CPU timings of",
        "the simulated GPU (bf16/fp16 autocast is slow on this CPU), so they say which search",
        "finds the best candidate, not what a GPU would run.",
        "",
        "| workload | device | target | fp32 at once | candidates (fit) | grid best | plan chose | share of best | plan / grid steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['workload']}` | {r['device']} | {r['target']} | {'fits' if r['fp32 fits at once'] else 'OOM'} | "
            f"{r['candidates']} ({r['fit']}) | {r['grid best']} ({r['grid best samples/s']:.0f}/s) | {r['plan chose']} | "
            f"{r['share of best']:.1%} | {r['plan steps']} / {r['grid steps']} = {r['steps ratio']:.2f} |"
        )
    met = all(r["share of best"] >= 0.95 and r["steps ratio"] <= 1 / 3 and not r["fp32 fits at once"] for r in rows)
    lines += ["", f"Targets met on every row: **{'yes' if met else 'no'}**."]
    write_section("plan", "\n".join(lines))
    print("\n".join(lines))


def _describe(s: memfit.Settings) -> str:
    ckpt = "+ckpt" if s.checkpointing == "blocks" else ""
    return f"{s.micro_batch_size}×{s.accumulation_steps} {s.precision}{ckpt}"


if __name__ == "__main__":
    main()
