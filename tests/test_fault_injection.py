"""The fast subset of bench/fault_injection.py: bad input, an interrupt and an injected fault per group, all held.

The whole script (more than 150 cases, docs/benchmarks.md) runs in minutes; this subset
keeps its checks in the suite.
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


def test_the_script_has_more_than_150_cases_covering_every_command():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import fault_injection
    finally:
        sys.path.remove(str(BENCH.parent))
    cases = fault_injection.all_cases(seed=14)
    assert len(cases) >= 150
    commands = {case.argv[0] for case in cases}
    assert {"doctor", "env", "estimate", "measure", "probe", "plan", "fit", "check", "report"} <= commands
    assert {case.group for case in cases} >= {"interrupts", "injected faults", "distributed", "output paths"}
