"""SIGINT and SIGTERM at any moment leave no temp file and no half-written file; SIGTERM ends a
command like Ctrl-C (issue 14, item 11).

A child process writes a large file over and over through ``memfit._io.write_atomically``
(the one writer of reports, figures, locks and environment files) while the test sends it
a signal at a different moment each time; the folder must then hold the whole previous
file or the whole new one, and nothing else.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memfit
from memfit._io import signals_held, write_atomically
from memfit.cli import EXIT_SIGINT, EXIT_SIGTERM, sigterm_ends_like_sigint

SOURCE = str(Path(memfit.__file__).resolve().parents[1])
#: one payload of the writer: big enough that a write takes a while, so signals land inside it
PAYLOAD_BYTES = 8 * 2**20

WRITER = f"""
import os, sys
sys.path.insert(0, {SOURCE!r})
from memfit._io import write_atomically
from memfit.cli import main, sigterm_ends_like_sigint, Terminated

def payload(n):
    head = b"memfit payload %08d\\n" % n
    return head + bytes([n % 251]) * ({PAYLOAD_BYTES} - 2 * len(head)) + head

n = 0
try:
    with sigterm_ends_like_sigint():
        open("ready", "w").close()
        while True:
            write_atomically("report.html", payload(n))
            n += 1
except KeyboardInterrupt:
    sys.exit(130)
except Terminated:
    sys.exit(143)
"""


def whole(data: bytes) -> bool:
    """True when ``data`` is one complete payload of the writer."""
    head = data[: data.index(b"\n") + 1]
    return len(data) == PAYLOAD_BYTES and data.endswith(head) and head.startswith(b"memfit payload ")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_leaves_the_old_file_or_the_new_one_and_nothing_else(tmp_path, sig):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    chance = random.Random(20240 + sig)
    outcomes = []
    for moment in range(12):
        folder = tmp_path / f"run-{moment}"
        folder.mkdir()
        child = subprocess.Popen([sys.executable, str(script)], cwd=folder)
        try:
            while not (folder / "ready").exists() and child.poll() is None:
                time.sleep(0.005)
            time.sleep(chance.uniform(0.0, 0.4))  # a different moment of a write each time
            child.send_signal(sig)
            status = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        left = sorted(p.name for p in folder.iterdir())
        assert status == (EXIT_SIGINT if sig == signal.SIGINT else EXIT_SIGTERM)
        assert [name for name in left if name.endswith(".tmp") or name.startswith(".")] == [], left
        if "report.html" in left:
            assert whole((folder / "report.html").read_bytes())
        outcomes.append(left)
    assert any("report.html" in left for left in outcomes)  # the signals did land during the writes


def test_a_signal_held_during_a_write_is_delivered_after_it(tmp_path):
    target = tmp_path / "lock"
    with pytest.raises(KeyboardInterrupt), signals_held():
        os.kill(os.getpid(), signal.SIGINT)  # arrives mid-way: held
        write_atomically(target, "whole\n")
    assert target.read_text() == "whole\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]


def test_sigterm_raises_terminated_only_inside_the_block():
    from memfit.cli import Terminated

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_ends_like_sigint():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert signal.getsignal(signal.SIGTERM) is before


#: a workload whose batches take a while; the first one says the trials have started
SLOW = (
    "import pathlib, time, torch, memfit\n"
    "def make():\n"
    "    def make_batch(n):\n"
    "        pathlib.Path('started').touch()\n"
    "        time.sleep(0.2)\n"
    "        return torch.randn(n, 8), torch.randint(0, 2, (n,))\n"
    "    return memfit.Workload(model=lambda: torch.nn.Linear(8, 2), make_batch=make_batch,\n"
    "        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))\n"
)


def signalled_once_started(tmp_path: Path, argv: list[str], *signals: int) -> tuple[int, str]:
    """Run ``argv`` in ``tmp_path``, send ``signals`` once its workload wrote ``started``; (status, stderr)."""
    child = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": SOURCE},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 50
        while not (tmp_path / "started").exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for sig in signals:
            child.send_signal(sig)
        _, err = child.communicate(timeout=50)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "status", "line"),
    [(signal.SIGINT, 130, "memfit: aborted"), (signal.SIGTERM, 143, "memfit: aborted (SIGTERM)")],
)
def test_sigterm_ends_a_command_like_ctrl_c(tmp_path, sig, status, line):
    """A probe interrupted during its trials: one line, the documented status, no traceback, no file."""
    (tmp_path / "slow.py").write_text(SLOW)
    argv = ["-m", "memfit", "probe", "slow.py:make", "--device", "sim:64MiB", "--no-estimate", "--plot", "probe.png"]
    returncode, err = signalled_once_started(tmp_path, [sys.executable, *argv], sig)
    assert returncode == status, err[-2000:]
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow.py", "started"]  # no plot, no temp file


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_that_lands_in_a_finalizer_is_not_lost(sig):
    """The tracker frees tensors in weakref callbacks; a signal handled there used to be
    printed as "Exception ignored" and dropped, and the command ran on."""
    import weakref

    from memfit.cli import Terminated, interrupts_not_lost

    class Storage:
        pass

    def freed(_ref: object) -> None:
        os.kill(os.getpid(), sig)  # the handler runs here, inside the callback
        time.sleep(0.01)

    expected = KeyboardInterrupt if sig == signal.SIGINT else Terminated
    with pytest.raises(expected), sigterm_ends_like_sigint(), interrupts_not_lost():
        storage = Storage()
        watcher = weakref.ref(storage, freed)
        del storage  # the callback runs, its exception cannot propagate
        assert watcher() is None
        time.sleep(5)  # the signal comes again from the helper thread and ends the block


# -- every moment, and a second signal (issue 21) ---------------------------------------------

INTERRUPTED_CLEANUP = """
import atexit, os, signal, torch, memfit

def make():
    def batch(n):
        if os.environ.get("SECOND"):  # a second signal once the command has its outcome
            atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
        try:
            raise KeyboardInterrupt  # Ctrl-C, landing in the user's code
        finally:
            {}["half-updated"]  # the clean-up it interrupted then fails: a KeyError
    return memfit.Workload(model=lambda: torch.nn.Linear(8, 2), make_batch=batch,
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
"""


def test_an_error_that_an_interrupt_caused_in_clean_up_ends_as_the_interrupt(run_cli, tmp_path):
    """Ctrl-C during estimate ended now and then in a KeyError traceback: what the interrupt broke."""
    (tmp_path / "cleanup.py").write_text(INTERRUPTED_CLEANUP)
    status, out, err = run_cli(
        "measure", f"{tmp_path / 'cleanup.py'}:make", "--device", "sim:64MiB", "--batch-size", "2"
    )
    assert (status, out) == (EXIT_SIGINT, "")
    assert err.strip().splitlines()[-1] == "memfit: aborted" and "Traceback" not in err


def test_a_second_signal_after_the_outcome_keeps_the_line_and_the_status(tmp_path):
    (tmp_path / "cleanup.py").write_text(INTERRUPTED_CLEANUP)
    env = {**os.environ, "SECOND": "1", "PYTHONPATH": SOURCE, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "measure", "cleanup.py:make", "--device", "sim:64MiB", "--batch-size", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_SIGINT, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == "memfit: aborted" and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("sig", "status", "line"),
    [(signal.SIGINT, 130, "memfit: aborted"), (signal.SIGTERM, 143, "memfit: aborted (SIGTERM)")],
)
def test_a_signal_during_the_imports_ends_with_the_line(sig, status, line):
    """The handlers come first in memfit.__main__: a signal while click and memfit are imported is not silent."""
    code = (
        "import os, signal, sys, runpy\n"
        f"sys.path.insert(0, {SOURCE!r})\n"
        "import memfit.errors\n"
        "import builtins\n"
        "real_import = builtins.__import__\n"
        "def slow_import(name, *args, **kwargs):\n"
        "    if name == 'memfit.cli':\n"
        f"        os.kill(os.getpid(), {int(sig)})\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = slow_import\n"
        "sys.argv = ['memfit', 'doctor']\n"
        "runpy.run_module('memfit', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [line]


# -- the moment an interrupt is raised at, and a SIGINT the process was started ignoring (issue 21) --


def test_an_interrupt_inside_torch_s_callbacks_is_raised_once_control_is_back_in_ordinary_code():
    """A signal landing in Python that torch's C++ calls (``__torch_dispatch__``) is raised at the
    caller's next line, after the operation ended: raised inside, it could cross C++ that cannot
    pass it on (``memfit estimate`` ended in SIGABRT, no line)."""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    finished = []

    class Signalling(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs on one of the next lines, in here
            total = sum(range(1000))
            out = func(*args, **(kwargs or {}))
            finished.append(total)
            return out

    ones = torch.ones(3)
    with pytest.raises(KeyboardInterrupt) as caught, sigterm_ends_like_sigint():
        with Signalling():
            twos = ones + 1
        time.sleep(5)  # under a debugger's or coverage's trace function the signal comes again here
    assert finished == [sum(range(1000))] and twos.tolist() == [2.0, 2.0, 2.0]
    assert "__torch_dispatch__" not in [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert sys.gettrace() is None  # the trace function that waited for the line is gone


def test_an_interrupt_handled_in_ordinary_code_is_raised_at_once():
    from memfit.errors import interrupt

    with pytest.raises(KeyboardInterrupt):
        interrupt(signal.SIGINT, sys._getframe())
    from memfit.cli import Terminated

    with pytest.raises(Terminated):
        interrupt(signal.SIGTERM, None)


@pytest.mark.slow
def test_a_sigint_the_process_was_started_ignoring_stays_ignored(tmp_path):
    """A background job of a shell without job control starts with SIGINT ignored, so that Ctrl-C
    meant for the foreground spares it: memfit keeps it so (as Python does); SIGTERM still ends it."""
    (tmp_path / "slow.py").write_text(SLOW)
    command = [sys.executable, "-m", "memfit", "probe", "slow.py:make", "--device", "sim:64MiB", "--no-estimate"]
    ignoring = (
        f"import os, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv({sys.executable!r}, {command!r})"
    )
    # the SIGINT is ignored, so the SIGTERM ends it (a SIGINT handled would come first: 130)
    returncode, err = signalled_once_started(tmp_path, [sys.executable, "-c", ignoring], signal.SIGINT, signal.SIGTERM)
    assert returncode == EXIT_SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == "memfit: aborted (SIGTERM)"


def test_the_command_s_handlers_are_memfit_s_and_an_ignored_sigint_stays_ignored():
    from memfit.errors import install_handlers, interrupt

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        install_handlers()
        assert signal.getsignal(signal.SIGINT) is interrupt and signal.getsignal(signal.SIGTERM) is interrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        install_handlers()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_what_comes_before_the_handlers_imports_next_to_nothing():
    """memfit/__init__.py and memfit/__main__.py are imported before run() installs the handlers:
    a SIGINT there is Python's traceback, so they import only signal and memfit.errors."""
    code = (
        "import sys; before = set(sys.modules); import memfit.__main__; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], env={**os.environ, "PYTHONPATH": SOURCE}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    memfit_modules = {name for name in done.stdout.split() if name.startswith("memfit")}
    assert memfit_modules == {"memfit", "memfit.__main__", "memfit.errors"}
    assert not {"typing", "importlib.metadata", "click", "torch", "threading", "inspect"} & set(done.stdout.split())
