"""The fast subset of bench/fault_injection.py: bad input, an interrupt and an injected fault per group, all held.

The whole script (more than 400 cases, docs/benchmarks.md) runs in minutes; this subset
keeps its checks in the suite (issue 21's classes included: hostile files, user code).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "fault_injection.py"


@pytest.mark.slow
def test_the_quick_subset_of_fault_injection_holds():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-write"], capture_output=True, text=True, timeout=55
    )
    summary = re.search(r"held: (\d+) of (\d+)", done.stdout)
    assert summary is not None, done.stdout[-3000:] + done.stderr[-3000:]
    held, total = map(int, summary.groups())
    assert total >= 20
    assert held == total, done.stdout[-3000:]
    assert done.returncode == 0


def test_the_script_has_more_than_400_cases_covering_every_command_and_class(bench_module):
    cases = bench_module("fault_injection").all_cases(seed=14)
    assert len(cases) >= 400
    commands = {case.argv[0] for case in cases}
    assert {"doctor", "env", "estimate", "measure", "probe", "plan", "fit", "check", "report"} <= commands
    assert {case.group for case in cases} >= {
        "interrupts",
        "injected faults",
        "distributed",
        "output paths",
        "hostile files",
        "user code",
        "environment",
        "host memory",
    }
    names = " | ".join(case.name for case in cases)
    for example in (  # every example of issue 21
        "micro-batch 8.5",
        "micro-batch true",
        "micro-batch inf",
        "accumulation 1e308",
        "target -5",
        "target 0",
        "world size 0",
        "capacity huge",
        "schema_version true",
        "python null",
        "workload a list",
        "a 5000-digit number",
        "created a TOML date",
        "WORLD_SIZE=two",
        "RANK=abc",
        "MEMFIT_COLLECTIVE_TIMEOUT=1e-9",
        "PYTHONIOENCODING=ascii: fit",
        "past PATH_MAX",
        "PYTORCH_CUDA_ALLOC_CONF of 4400 characters",
        "a model built on the meta device",
        "sys.exit(0) in loss",
        "os.chdir in make_batch",
        "rank 1 never starts",
        "the master is unreachable",
        "a dangling link",
        "251-byte name",
        "a folder where the snapshot goes",
        "report -o: a folder where the viewer goes",
        "plan llama-7b --gpu 'RTX 4090'",
        "probe llama-7b --gpu 'RTX 4090'",  # probe's --gpu means the card too
        "--gpu Voodoo 5 6000",
        "SIGTERM after 0.0 s (at the start)",  # a signal 0 ms after the fork
        "SIGINT after 0.001 s (at the start)",
        "negative capacity",
    ):
        assert example in names, example
