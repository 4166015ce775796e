"""Shared test fixtures (tiny zoo references, a CLI runner) and the one place ``cuda`` tests are skipped."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest

from memfit.workload.zoo import TINY as TINY_ZOO

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Why absolute: tests start `python -m memfit` in a temporary folder; a relative PYTHONPATH
# (`PYTHONPATH=src`, as a checkout runs the suite) would then point nowhere, and the child
# would import another copy of memfit (an editable install's) instead of this checkout's.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(part) for part in os.environ["PYTHONPATH"].split(os.pathsep) if part
    )


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT is Python's (KeyboardInterrupt) in the suite, even where the run was started ignoring it.

    Why: the interrupt tests send SIGINT to this process and to the ``memfit`` processes it
    starts, as Ctrl-C reaches a command in the foreground. A suite started as a background
    job of a shell without job control (``./dev test &`` in a script, a runner that starts
    it so) inherits SIGINT ignored (POSIX), and so would every child, and ``memfit`` keeps an
    ignored SIGINT ignored, as Python does: those tests then failed only in such runs (issue 21).
    """
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``cuda`` on a machine without a CUDA GPU (the real path is bench/'s)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


#: the benchmark scripts, which some tests import
BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="session")
def bench_module() -> Callable[[str], ModuleType]:
    """Import a script of bench/ by name (bench/ on sys.path while it loads, as the scripts
    import one another; a test that calls code importing more of bench/ later keeps the path
    itself, as test_timing_bench.py does)."""

    def load(name: str) -> ModuleType:
        sys.path.insert(0, str(BENCH))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))

    return load


@pytest.fixture
def tiny_zoo() -> dict[str, str]:
    return dict(TINY_ZOO)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]):
    """Run ``memfit ARGS`` in-process; return (exit status, stdout, stderr)."""
    from memfit.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        status = main(list(args))
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: small steps on a shared 2-core machine run many
    times faster without a thread pool contending for the cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def run_ranks() -> Callable[..., list[str]]:
    """``run_ranks(script, arguments, world, deadline_s)``: see :func:`_run_ranks`."""
    return _run_ranks


def _run_ranks(script: str, arguments: Callable[[int], Sequence[str]], world: int, deadline_s: float) -> list[str]:
    """Start ``python script --worker RANK *arguments(RANK)`` for every rank; return their outputs.

    The test fails when a rank is still running after ``deadline_s`` (a rank blocked in a
    collective: every process is killed) or when any rank exits with a non-zero status
    (every rank's output is shown).

    A worker ends with ``os._exit(0)`` once its results are written. Why: DDP and
    ZeroRedundancyOptimizer keep the gloo group alive after ``destroy_process_group``, and
    a gloo worker thread releases each collective's tensors just after the collective
    completes; when the process exits right after its last collective, that release can
    come while Python is finalizing, and the thread aborts the process ("terminate called
    without an active exception", pytorch#190489). It did so in 6 of 40 runs of
    test_distributed_trace's ZeRO-1 worker pair on this 2-core machine.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    processes = [
        subprocess.Popen(
            [sys.executable, script, "--worker", str(rank), *arguments(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=deadline_s)
            outputs.append(output.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"the ranks did not finish within {deadline_s} s: a rank is blocked in a collective")
    assert [p.returncode for p in processes] == [0] * world, "\n".join(outputs)
    return outputs


@pytest.fixture
def torchrun_env() -> Callable[..., list[dict[str, str]]]:
    """``torchrun_env(world, **extra)``: the environment of each of ``world`` ranks as torchrun
    would set it (one free local port for the rendezvous), plus ``extra``."""

    def environments(world: int, **extra: str) -> list[dict[str, str]]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        common = {
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        return [{**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank), **extra} for rank in range(world)]

    return environments


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test ends with the SIGINT and SIGTERM handlers it started with, installed again.

    Why: some tests run memfit's entry points in this process (``final=True`` ignores both
    signals once a command has its outcome); the interrupt tests after them expect Python's
    handling. A test that leaves another handler is named in $MEMFIT_SIGNAL_LOG when that is set.
    """
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and os.environ.get("MEMFIT_SIGNAL_LOG"):
            with open(os.environ["MEMFIT_SIGNAL_LOG"], "a") as out:
                out.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {sig!r} left as {signal.getsignal(sig)!r}\n")
        if handler is not None:
            signal.signal(sig, handler)
