"""The README's main job from a fresh clone: `./dev main` against the old bounded run.

In one run, in a fresh clone of this repository's HEAD (``git clone``; uncommitted changes
are not in it):

- **main job**: what ``./dev main`` runs, ``memfit fit`` on the default workload and device
  (the GPU, else a simulated 8 GiB GPU), no batch bound;
- **old bounded run**: the main job as it was, ``memfit fit --max-batch-size 64`` with every
  trial real (``--trials real``).

Each runs with this interpreter and ``PYTHONPATH`` set to the clone's ``src`` (the clone's
code, this environment's packages): ``./dev main`` minus its one-time set-up, whose time is
the network's (``--with-setup`` also times ``./dev setup`` in the clone: a venv and pip).

Run: ``python bench/main_job.py [--repeat 1] [--with-setup]`` (writes the "main-job" section of
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section

ROOT = Path(__file__).resolve().parent.parent

JOBS = {
    "main job": [],
    "old bounded run": ["--max-batch-size", "64", "--trials", "real"],
}


def _run(clone: Path, args: list[str]) -> dict[str, Any]:
    # COLUMNS: rich wraps at the terminal's width; one line per line is easier to read back
    env = {**os.environ, "PYTHONPATH": str(clone / "src"), "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "memfit", "fit", *args],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"memfit fit {' '.join(args)} failed:\n{completed.stderr[-3000:]}")
    out = " ".join(completed.stdout.split())
    largest = re.search(r"Probe: (the largest batch that fits is (\d+) \(exact\)|at least (\d+) fits)", out)
    plan = re.search(r"Plan for batch (\d+): micro-batch (\d+) x (\d+) accumulation step\(s\) in (\w+)", out)
    # one progress line per trial (rich may wrap a line: join the wrapped parts first)
    err = re.sub(r"\s*\n(?!memfit fit ·)\s*", " ", completed.stderr)
    trials = [line for line in err.splitlines() if re.match(r"memfit fit · (probe · batch|plan · micro-batch)", line)]
    return {
        "seconds": seconds,
        "largest": (largest.group(2) or largest.group(3)) if largest else "?",
        "exact": bool(largest and largest.group(2)),
        "plan": f"{plan.group(2)}×{plan.group(3)} {plan.group(4)} for batch {plan.group(1)}" if plan else "?",
        "fake trials": sum(1 for line in trials if "(fake tensors)" in line),
        "real trials": sum(1 for line in trials if "(fake tensors)" not in line),
        "summary": out,
    }


def _setup(clone: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["./dev", "setup"], cwd=clone, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each job, alternating")
    parser.add_argument("--with-setup", action="store_true", help="also time ./dev setup in the clone")
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in JOBS}
    setup_seconds = None
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="memfit-clone-") as temp:
        clone = Path(temp) / "memfit"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        if args.with_setup:
            setup_seconds = _setup(clone)
        for index in range(args.repeat):
            order = list(JOBS) if index % 2 == 0 else list(reversed(JOBS))
            for name in order:
                for leftover in ("memfit.lock", "memfit-report"):
                    subprocess.run(["rm", "-rf", str(clone / leftover)], check=True)
                results[name].append(_run(clone, JOBS[name]))
                print(name, {k: v for k, v in results[name][-1].items() if k != "summary"}, flush=True)
    total = time.time() - started
    main_s = [r["seconds"] for r in results["main job"]]
    old_s = [r["seconds"] for r in results["old bounded run"]]
    main_job = results["main job"][-1]
    lines = [
        "## The README's main job from a fresh clone",
        "",
        f"Command: `python bench/main_job.py --repeat {args.repeat}"
        f"{' --with-setup' if args.with_setup else ''}` (HEAD {head.strip()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, {total:.0f} s in all).",
        "",
        "In a fresh `git clone`, with this environment's packages (`./dev main` minus its one-time",
        "set-up): the main job (`memfit fit`, default workload and device, no bound; what `./dev main`",
        "runs) and the old bounded run (`memfit fit --max-batch-size 64 --trials real`, the main job",
        "before fake trials), back to back.",
        "",
        "| run | seconds | largest batch | plan | trials (fake / on the device) |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        last = runs[-1]
        seconds = " / ".join(f"{r['seconds']:.0f}" for r in runs)
        largest = f"{last['largest']} ({'exact: the next one does not fit' if last['exact'] else 'the bound'})"
        lines.append(
            f"| {name} | {seconds} | {largest} | {last['plan']} | {last['fake trials']} / {last['real trials']} |"
        )
    ratio = (sum(main_s) / len(main_s)) / (sum(old_s) / len(old_s))
    lines += [
        "",
        f"The main job, filling the device, took **{ratio:.2f}×** the time of the old bounded run "
        f"({sum(main_s) / len(main_s):.0f} s against {sum(old_s) / len(old_s):.0f} s).",
    ]
    if setup_seconds is not None:
        lines.append(f"`./dev setup` in the fresh clone (venv, pip) took {setup_seconds:.0f} s more.")
    lines += ["", "The main job's summary:", "", "```text", main_job["summary"], "```"]
    text = "\n".join(lines)
    print(text)
    write_section("main-job", text)


if __name__ == "__main__":
    main()
