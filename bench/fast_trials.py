"""Probe and plan on a simulated GPU: trials on fake tensors (confirmed for real) against all-real trials.

For every zoo workload (``TINY`` shapes) on one simulated GPU, in one run:

- ``probe`` with ``trials="real"`` (every trial a real step on the CPU, as before) and with
  the default (``trials="auto"``: the search on fake tensors, the maximum and the next size
  then run for real); the answers compared are the largest batch, the headroom batch and
  what limited the search;
- ``plan`` to twice the probed maximum (so fp32 alone cannot reach it at once), both ways;
  compared: every candidate's status and peak reserved memory, and the recommendation.

The two paths of one workload run back to back, in alternating order, so a change in the
machine's load hits both alike. Wall times are this machine's; the ratio is the result.

Run: ``python bench/fast_trials.py [--device sim:128MiB] [--only mlp,gpt]`` (writes the
"fast-trials" section of docs/benchmarks.md unless ``--only`` is given).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memfit
from _results import write_section
from memfit.search.plan import Plan, plan
from memfit.search.probe import ProbeResult, probe
from memfit.workload.zoo import DEFAULT_WORKLOAD, TINY


def _probe(ref: str, spec: str, trials: str) -> tuple[ProbeResult, float]:
    started = time.perf_counter()
    result = probe(ref, memfit.device(spec), trials=trials)  # type: ignore[arg-type]
    return result, time.perf_counter() - started


def _plan(ref: str, spec: str, target: int, trials: str) -> tuple[Plan, float]:
    started = time.perf_counter()
    result = plan(ref, target, memfit.device(spec), trials=trials)  # type: ignore[arg-type]
    return result, time.perf_counter() - started


def _probe_answer(result: ProbeResult) -> tuple[int, int, str]:
    return result.max_batch_size, result.headroom_batch_size, result.limit


#: what a candidate's status says about memory: "too large (estimate)" (the estimator's
#: search) and "out of memory" (a trial) both say it does not fit
_VERDICT = {"measured": "fits", "out of memory": "does not fit", "too large (estimate)": "does not fit"}


def _plan_answer(result: Plan) -> list[tuple[Any, ...]]:
    """Each candidate: fits, does not fit, or skipped (dominated); and its peak when it fits."""
    return [
        (
            c.settings,
            _VERDICT.get(c.status, "skipped"),
            c.measurement.peak_reserved if c.fits and c.measurement else None,
        )
        for c in result.candidates
    ]


def _describe(s: memfit.Settings | None) -> str:
    if s is None:
        return "-"
    ckpt = "+ckpt" if s.checkpointing == "blocks" else ""
    return f"{s.micro_batch_size}×{s.accumulation_steps} {s.precision}{ckpt}"


def run_case(name: str, ref: str, spec: str, flip: bool) -> dict[str, Any]:
    order = ("auto", "real") if flip else ("real", "auto")
    probes = {kind: _probe(ref, spec, kind) for kind in order}
    target = 2 * probes["real"][0].max_batch_size
    plans = {kind: _plan(ref, spec, target, kind) for kind in order}
    (old_probe, old_probe_s), (new_probe, new_probe_s) = probes["real"], probes["auto"]
    (old_plan, old_plan_s), (new_plan, new_plan_s) = plans["real"], plans["auto"]
    old_best = old_plan.recommended.settings if old_plan.recommended else None
    new_best = new_plan.recommended.settings if new_plan.recommended else None
    return {
        "workload": name,
        "max": old_probe.max_batch_size,
        "probe same": _probe_answer(old_probe) == _probe_answer(new_probe),
        "probe recommended": (old_probe.recommended_batch_size, new_probe.recommended_batch_size),
        "probe trials": (len(old_probe.trials), sum(not t.fake for t in new_probe.trials), len(new_probe.trials)),
        "probe s": (old_probe_s, new_probe_s),
        "target": target,
        "plan memory same": _plan_answer(old_plan) == _plan_answer(new_plan),
        "plan differences": [
            f"{_describe(c_old.settings)}: {c_old.status} (real path) / {c_new.status} (fake path)"
            for c_old, c_new, a, b in zip(
                old_plan.candidates, new_plan.candidates, _plan_answer(old_plan), _plan_answer(new_plan), strict=True
            )
            if a != b
        ],
        "plan same": old_best == new_best,
        "plan chose": (_describe(old_best), _describe(new_best)),
        "ranked by": getattr(new_plan, "ranked_by", "measured"),
        "plan s": (old_plan_s, new_plan_s),
        "notes": sorted({n for n in (new_probe.extra.get("trials_note"), new_plan.trials_note) if n}),
    }


def default_size(spec: str) -> str:
    """Probe the default workload at its own size both ways: what a user's first probe costs."""
    started = time.time()
    runs = {kind: _probe(DEFAULT_WORKLOAD, spec, kind) for kind in ("auto", "real")}
    (new, new_s), (old, old_s) = runs["auto"], runs["real"]
    lines = [
        "## Probe at full size on a simulated GPU: fake-tensor trials against real ones",
        "",
        f"Command: `python bench/fast_trials.py --default-size --device {spec}` ({platform.machine()}, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, "
        f"{time.time() - started:.0f} s in all).",
        "",
        f"`memfit probe` on the default workload (`{DEFAULT_WORKLOAD}`), whose real steps at the batch",
        "sizes that fill the device cost seconds each: the case fake trials are for. The fake path's real",
        "runs are the smallest batch and its proof (the maximum fits, the next size does not), which it",
        "must run whatever the search costs.",
        "",
        "| path | seconds | largest batch | headroom batch | trials (real) |",
        "|---|---:|---:|---:|---|",
        f"| real trials | {old_s:.1f} | {old.max_batch_size} | {old.headroom_batch_size} | {len(old.trials)} "
        f"({len(old.trials)}) |",
        f"| fake trials, confirmed | {new_s:.1f} | {new.max_batch_size} | {new.headroom_batch_size} | "
        f"{len(new.trials)} ({sum(not t.fake for t in new.trials)}) |",
        "",
        f"Same answers: **{'yes' if _probe_answer(old) == _probe_answer(new) else 'no'}**; the fake path took "
        f"**{new_s / old_s:.2f}** of the time.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="default: sim:128MiB (sim:2GiB with --default-size)")
    parser.add_argument("--only", default=None, help="comma-separated zoo names (then nothing is written)")
    parser.add_argument("--default-size", action="store_true", help="probe the default workload at its own size")
    args = parser.parse_args()
    if args.default_size:
        text = default_size(args.device or "sim:2GiB")
        print(text)
        write_section("fast-trials-default", text)
        return
    args.device = args.device or "sim:128MiB"
    names = args.only.split(",") if args.only else list(TINY)
    torch.manual_seed(0)
    started = time.time()
    rows = []
    for index, name in enumerate(names):
        rows.append(run_case(name, TINY[name], args.device, flip=index % 2 == 1))
        print(rows[-1], flush=True)
    total = time.time() - started
    old = sum(r["probe s"][0] + r["plan s"][0] for r in rows)
    new = sum(r["probe s"][1] + r["plan s"][1] for r in rows)
    old_probe, new_probe = sum(r["probe s"][0] for r in rows), sum(r["probe s"][1] for r in rows)
    old_plan, new_plan = sum(r["plan s"][0] for r in rows), sum(r["plan s"][1] for r in rows)
    ranked = {r["ranked by"] for r in rows}
    lines = [
        "## Probe and plan on a simulated GPU: fake-tensor trials against real ones",
        "",
        f"Command: `python bench/fast_trials.py --device {args.device}` ({platform.machine()}, torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, "
        f"{total:.0f} s in all).",
        "",
        "Every zoo workload (`TINY` shapes). *real*: every trial a real step on the simulated GPU",
        '(`trials="real"`, the path before fake trials). *fake*: the default on `sim:`, the search on',
        "fake tensors, then the probe's maximum and the next size, and the plan's recommendation, run",
        "for real. Probe answers compared: the largest batch, the headroom batch, the limit. Plan",
        "(target: twice the maximum): every candidate's verdict (fits, does not fit, skipped as dominated)",
        "and the peak reserved memory of those that fit, and the",
        f"recommendation (ranked by {' / '.join(sorted(ranked))} speed). The two paths of a row ran back to",
        "back, in alternating order. Probe trials: real path's / fake path's real runs / fake path's all.",
        "",
        "| workload | max | probe same | probe trials | probe s real → fake | plan memory same | plan chose real / fake "
        "| plan s real → fake |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        (po, pn), (lo, ln) = r["probe s"], r["plan s"]
        lines.append(
            f"| {r['workload']} | {r['max']} | {'yes' if r['probe same'] else '**no**'} | "
            f"{r['probe trials'][0]} / {r['probe trials'][1]} / {r['probe trials'][2]} | "
            f"{po:.1f} → {pn:.1f} ({pn / po:.2f}) | {'yes' if r['plan memory same'] else '**no**'} | "
            f"{r['plan chose'][0]} / {r['plan chose'][1]} | {lo:.1f} → {ln:.1f} ({ln / lo:.2f}) |"
        )
    same = all(r["probe same"] and r["plan memory same"] for r in rows)
    chose_same = sum(r["plan same"] for r in rows)
    notes = sorted({note for r in rows for note in r["notes"]})
    lines += [
        "",
        f"Probe and plan together: {old:.0f} s real, {new:.0f} s fake: **{new / old:.2f}** of the time "
        f"(probe {new_probe / old_probe:.2f}, plan {new_plan / old_plan:.2f}). Same memory answers on every row: "
        f"**{'yes' if same else 'no'}**; the same recommended plan on {chose_same} of {len(rows)} rows.",
    ]
    differences = [(r["workload"], d) for r in rows for d in r["plan differences"]]
    if differences:
        lines += ["", "Plan candidates whose verdict or peak differs between the two paths:", ""]
        lines += [f"- {name}: {d}" for name, d in differences]
    if notes:
        lines += ["", "Where the fake path ran real trials, it said why:", ""]
        lines += [f"- {note}" for note in notes]
    text = "\n".join(lines)
    print(text)
    if not args.only:
        write_section("fast-trials", text)


if __name__ == "__main__":
    main()
