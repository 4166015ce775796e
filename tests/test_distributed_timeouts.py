"""A frozen or dead rank ends the other ranks with one line naming it (issue 14, item 10).

Two real processes joined by gloo run ``python -m memfit probe`` (torchrun's environment)
on a workload whose batches freeze or kill rank 1. Before, rank 0 waited forever in the
agreement after its first trial (frozen peer) or died with gloo's traceback (dead peer).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import memfit
from memfit import distributed
from memfit.errors import MemfitError

pytestmark = pytest.mark.slow

#: the test's own bound on a run: the collective timeout (3 s) plus two interpreters starting
LIMIT = 50

WORKLOAD = """
import os, signal, time
import torch
import memfit

def make():
    def make_batch(n):
        if os.environ["RANK"] == "0":
            open("rank-0-ran-a-batch", "w").close()   # the test's cue: memfit's handlers are in place
        if os.environ["RANK"] == "1":
            if os.environ["FAULT"] == "freeze":
                time.sleep(3600)          # frozen in the user's own code
            else:
                os.kill(os.getpid(), signal.SIGKILL)   # dead
        return torch.randn(n, 8), torch.randint(0, 2, (n,))

    return memfit.Workload(
        model=lambda: torch.nn.Linear(8, 2),
        make_batch=make_batch,
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
    )
"""


def this_memfit(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout's memfit first on the path (a relative PYTHONPATH breaks with cwd)."""
    source = str(Path(memfit.__file__).resolve().parents[1])
    return {**env, "PYTHONPATH": os.pathsep.join([source, env.get("PYTHONPATH", "")])}


def start_two_ranks(
    tmp_path: Path, torchrun_env: Any, fault: str, *, timeout: str | None = None, extra: tuple[str, ...] = ()
) -> list[subprocess.Popen[str]]:
    """Start both ranks of a probe of the faulty workload (``FAULT`` tells rank 1 what to do)."""
    (tmp_path / "faulty.py").write_text(WORKLOAD)
    processes = []
    variables = {"FAULT": fault} if timeout is None else {"FAULT": fault, "MEMFIT_COLLECTIVE_TIMEOUT": timeout}
    for env in torchrun_env(2, **variables):
        argv = [sys.executable, "-m", "memfit", "probe", "faulty.py:make", "--device", "sim:64MiB"]
        argv += ["--max-batch-size", "4", "--no-estimate", *extra]
        processes.append(
            subprocess.Popen(
                argv, env=this_memfit(env), cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    return processes


def run_two_ranks(tmp_path: Path, torchrun_env: Any, fault: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Start both ranks; wait for rank 0 alone (rank 1 may be frozen for good); kill what is left."""
    processes = start_two_ranks(tmp_path, torchrun_env, fault, timeout="3", extra=("--json",))
    started = time.monotonic()
    try:
        out, err = processes[0].communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 still waited after {LIMIT} s: the {fault} rank 1 hung it")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    return subprocess.CompletedProcess(processes[0].args, processes[0].returncode, out, err), time.monotonic() - started


def test_a_frozen_rank_ends_the_other_within_the_timeout_with_one_line(tmp_path: Path, torchrun_env: Any) -> None:
    done, _seconds = run_two_ranks(tmp_path, torchrun_env, "freeze")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[-1]] and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("memfit: error: rank 1 did not answer within 3 s at memfit's agreement")
    assert "MEMFIT_COLLECTIVE_TIMEOUT" in lines[0]


def test_a_killed_rank_ends_the_other_with_one_line_not_glooss_traceback(tmp_path: Path, torchrun_env: Any) -> None:
    done, _seconds = run_two_ranks(tmp_path, torchrun_env, "kill")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith("memfit: error: rank 1 did not answer at memfit's agreement: its process ended")


def test_the_timeout_comes_from_the_argument_the_variable_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(distributed.TIMEOUT_VARIABLE, raising=False)
    assert distributed.collective_timeout() == distributed.DEFAULT_COLLECTIVE_TIMEOUT == 600.0
    monkeypatch.setenv(distributed.TIMEOUT_VARIABLE, "45")
    assert distributed.collective_timeout() == 45.0
    assert distributed.collective_timeout(7) == 7.0
    with distributed.process_group(timeout=9):  # not under torchrun: no group, the timeout still applies
        assert distributed.collective_timeout() == 9.0
    assert distributed.collective_timeout() == 45.0


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_bad_timeout_variable_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(distributed.TIMEOUT_VARIABLE, value)
    with pytest.raises(MemfitError, match=f"MEMFIT_COLLECTIVE_TIMEOUT={value!r}"):
        distributed.collective_timeout()


def test_a_bad_timeout_variable_under_torchrun_is_one_line_and_exit_2(tmp_path: Path, torchrun_env: Any) -> None:
    env = torchrun_env(2, MEMFIT_COLLECTIVE_TIMEOUT="soon")[0]  # rank 0 alone: it must stop before waiting
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "probe", "mlp:layers=1,width=8,features=8", "--device", "sim:8MiB"],
        env=this_memfit(env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "memfit: error: MEMFIT_COLLECTIVE_TIMEOUT='soon': give a number of seconds, such as 600"
    ]


def test_sigterm_during_the_wait_ends_the_rank_like_ctrl_c(tmp_path: Path, torchrun_env: Any) -> None:
    """torchrun sends SIGTERM to every rank when one fails: that ends the command cleanly (143)."""
    processes = start_two_ranks(tmp_path, torchrun_env, "freeze")
    try:
        cue = tmp_path / "rank-0-ran-a-batch"
        deadline = time.monotonic() + LIMIT
        while not cue.exists() and processes[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cue.exists(), processes[0].stderr.read() if processes[0].poll() is not None else "no batch"
        time.sleep(0.5)  # now (most likely) waiting for rank 1 in the agreement: either way it must end cleanly
        processes[0].send_signal(signal.SIGTERM)
        _, err = processes[0].communicate(timeout=LIMIT)
        assert processes[0].returncode == 143, err[-3000:]
        assert err.strip().splitlines()[-1] == "memfit: aborted (SIGTERM)" and "Traceback" not in err
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
        processes[1].send_signal(signal.SIGTERM)  # the frozen rank, in time.sleep: Python runs the handler
        _, err = processes[1].communicate(timeout=LIMIT)
        assert processes[1].returncode == 143 and err.strip().splitlines()[-1] == "memfit: aborted (SIGTERM)"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


# -- before the rendezvous (issue 21) ---------------------------------------------------------

TINY_PROBE = ["probe", "mlp:layers=1,width=8,features=8", "--device", "sim:64MiB", "--max-batch-size", "2"]


def one_rank(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "memfit", *TINY_PROBE],
        env=this_memfit(env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    return done, time.monotonic() - started


def test_a_rank_that_never_starts_is_named_by_rank_0_within_the_timeout(tmp_path: Path, torchrun_env: Any) -> None:
    done, _ = one_rank(tmp_path, torchrun_env(2, MEMFIT_COLLECTIVE_TIMEOUT="3")[0])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: rank 1 did not join the job at 127.0.0.1:")
    assert "within 3 s (rank 0 waited)" in lines[0]


def test_an_unreachable_master_is_named_by_the_other_rank(tmp_path: Path, torchrun_env: Any) -> None:
    done, _ = one_rank(tmp_path, torchrun_env(2, MEMFIT_COLLECTIVE_TIMEOUT="2")[1])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]  # no C++ stack of torch's
    assert lines[0].startswith("memfit: error: rank 1 could not reach the job's master at 127.0.0.1:")


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': must be a whole number from 1"),
        ({"RANK": "abc"}, "RANK='abc': must be a whole number from 0 to 1"),
        ({"RANK": "2"}, "RANK='2': must be a whole number from 0 to 1"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
        ({"MEMFIT_COLLECTIVE_TIMEOUT": "1e-9"}, "MEMFIT_COLLECTIVE_TIMEOUT='1e-9': must be a number of seconds from 1"),
        ({"MEMFIT_COLLECTIVE_TIMEOUT": "1e300"}, "MEMFIT_COLLECTIVE_TIMEOUT='1e300'"),
    ],
)
def test_torchrun_variables_are_checked_in_one_line(
    monkeypatch: pytest.MonkeyPatch, torchrun_env: Any, variables: dict[str, str], message: str
) -> None:
    for name, value in {**torchrun_env(2)[0], **variables}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MemfitError, match=re.escape(message)):
        distributed.check_environment()


def test_rank_abc_under_python_m_memfit_is_one_line_and_exit_2(tmp_path: Path, torchrun_env: Any) -> None:
    env = {**torchrun_env(2)[0], "RANK": "abc"}
    done, _ = one_rank(tmp_path, env)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "memfit: error: RANK='abc': must be a whole number from 0 to 1, as torchrun sets it; check the job's environment"
    ]
