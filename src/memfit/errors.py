"""The errors memfit raises on purpose.

A :class:`MemfitError` is a user error (a bad size, an unknown workload, a device that is
not there): the command line prints it as one line ``memfit: error: ...`` and exits with
status 2, without a traceback. Everything else is a bug, in memfit or in the user's code,
and propagates unchanged.

An exception raised inside the user's own workload code (its model, its batches, its
loss) is such a bug: it keeps its traceback, since that is where the bug is. memfit
remembers which files hold workload code (:func:`register_workload_source`, as a workload
file or module is loaded); :func:`workload_code_of` finds the innermost frame of an
exception's traceback in one of them, so the command line can name that function in one
line before the traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import CodeType, FrameType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: this module comes before the handlers
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "MemfitError",
    "WorkloadError",
    "DeviceError",
    "DoesNotFitError",
    "RankTimeoutError",
    "Terminated",
    "interrupt",
    "install_handlers",
    "interrupted_by",
    "register_workload_source",
    "workload_code_of",
]

#: source files of the user's workload code (absolute path) -> the reference loaded from them
_WORKLOAD_SOURCES: dict[str, str] = {}


class MemfitError(Exception):
    """A user error: one clear line, exit status 2."""


class WorkloadError(MemfitError):
    """A workload reference that cannot be resolved, or a workload that is malformed."""


class DeviceError(MemfitError):
    """A device spec that is unknown, or names hardware this machine does not have."""


class DoesNotFitError(MemfitError):
    """The workload does not fit even at the smallest batch (or micro-batch) possible."""


class RankTimeoutError(MemfitError):
    """Another rank of a distributed job did not answer a memfit collective in time."""


class Terminated(BaseException):
    """SIGTERM arrived: end the command as Ctrl-C would (``finally`` blocks run, files stay whole).

    A BaseException, like KeyboardInterrupt, so no ``except Exception`` swallows it. Here,
    at the base, so the entry point can install its handler before importing anything else.
    """


#: how long an interrupt may wait for a moment it can be raised at (seconds)
INTERRUPT_WAIT = 0.5

#: functions torch's C++ calls back into: an exception raised inside them can end the process
_CALLBACKS = ("__torch_dispatch__", "__torch_function__")

#: the signal waiting for a safe call (at most one: a second one ends the command the same way)
_waiting: list[int] = []

#: signal -> when it first came and has not been raised yet (its wait is counted from then)
_first_seen: dict[int, float] = {}


def interrupt(signum: int, frame: FrameType | None) -> None:
    """The handler of SIGINT and SIGTERM while memfit runs a command: raise KeyboardInterrupt
    (SIGINT) or :class:`Terminated` (SIGTERM), at a moment where raising is safe.

    Why a safe moment: Python runs a handler wherever the main thread is, and much of a
    step runs in Python that torch's C++ calls back (``__torch_dispatch__``, fake tensors'
    dispatch rules, memfit's tracker); an exception raised there can cross C++ that
    cannot pass it on, and the process aborts (``terminate called after throwing an
    instance of 'python_error'``, SIGABRT, no line); one raised inside memfit's allocator
    model left its tables half-updated (a KeyError from every later free). So when the
    interrupted frame (past the standard library's) is torch's, or any frame under way is
    one torch's C++ calls back, the interrupt is raised at the next call the main thread
    makes from other code (the user's, the model's, memfit's command): a trace function
    waits for it and is gone once it raised. After :data:`INTERRUPT_WAIT` it is raised at
    the next call wherever it lands.
    Only the moment moves: the interrupt, its ``finally`` blocks and the user's
    tracebacks stay Python's own. (Under a debugger or coverage, whose trace function
    must stay, the signal is sent again 10 ms later instead.)

    Args:
        signum: the signal.
        frame: the frame it interrupted (None: called directly, so raised at once).
    """
    now = time.monotonic()
    first = _first_seen.get(signum)
    if first is None or (not _waiting and now - first > 2 * INTERRUPT_WAIT):  # a new signal, not one sent again
        first = _first_seen[signum] = now
    deadline = first + INTERRUPT_WAIT
    if (
        frame is not None
        and _unsafe_moment(frame, deadline)
        and (_waiting or _raise_at_a_safe_call(signum, frame, deadline))
    ):
        return
    _stop_waiting(frame)
    raise _interrupt_of(signum)


def install_handlers() -> None:
    """SIGINT and SIGTERM raise through :func:`interrupt` from now on (a SIGINT already ignored stays so).

    The first thing the ``memfit`` command does (``memfit.__main__.run``); a harness that
    starts commands in-process calls it too. Only the main thread has signals: elsewhere
    this does nothing.
    """
    try:
        signal.signal(signal.SIGTERM, interrupt)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, interrupt)
    except ValueError:  # not the main thread
        pass


def _interrupt_of(signum: int) -> BaseException:
    _first_seen.pop(signum, None)
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _unsafe_moment(frame: FrameType, deadline: float) -> bool:
    """Whether raising in ``frame`` could cross C++ that cannot pass an exception on, before
    ``deadline`` (a ``time.monotonic()``; after it every moment counts as safe).

    Unsafe: the innermost frame (past the standard library's) is torch's, or any frame
    under way is code that torch's C++ calls back (a ``__torch_dispatch__`` or
    ``__torch_function__``, torch's dispatch, fake-tensor and TorchDynamo machinery,
    memfit's memory accounting and CUDA kernels). Module-level code (an import) is safe.
    """
    if time.monotonic() >= deadline:
        return False
    innermost = True
    current: FrameType | None = frame
    while current is not None:
        if not _in_stdlib(current.f_code.co_filename):
            if _called_back(current.f_code, innermost):
                return True
            innermost = False
        current = current.f_back
    return False


def _in_stdlib(filename: str) -> bool:
    return filename.startswith("<frozen") or (filename.startswith(_STDLIB) and "-packages" not in filename)


def _called_back(code: CodeType, innermost: bool) -> bool:
    """Whether ``code`` is code torch's C++ calls back (or, ``innermost``, any of torch's)."""
    if code.co_name in _CALLBACKS:
        return True
    if code.co_name == "<module>":
        return False
    callbacks, torch_dir = _callback_paths()
    name = code.co_filename
    return name.startswith(callbacks) or bool(innermost and torch_dir and name.startswith(torch_dir))


_STDLIB = os.path.dirname(os.__file__)

#: memfit's code that torch's C++ calls (the tracker's modes, the dispatcher's kernels), and torch's
_MEMFIT_CALLBACKS = ("memory", "cuda")
_TORCH_CALLBACKS = (
    "_subclasses",
    "_library",
    "_dynamo",
    "_decomp",
    "_refs",
    "_prims",
    "_prims_common",
    "_higher_order_ops",
    "_functorch",
    "fx",
    "utils/_python_dispatch.py",
    "_ops.py",
    "overrides.py",
    "_meta_registrations.py",
)


def _callback_paths() -> tuple[tuple[str, ...], str]:
    """(path prefixes of code torch's C++ calls back, torch's folder or "" before torch is imported)."""
    if _paths:
        return _paths[0]
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(here, part, "") for part in _MEMFIT_CALLBACKS]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if not torch_file:
        return tuple(paths), ""
    torch_dir = os.path.join(os.path.dirname(torch_file), "")
    for part in _TORCH_CALLBACKS:
        path = os.path.join(torch_dir, *part.split("/"))
        paths.append(path if part.endswith(".py") else os.path.join(path, ""))
    _paths.append((tuple(paths), torch_dir))  # torch is imported: they stay
    return _paths[0]


_paths: list[tuple[tuple[str, ...], str]] = []


def _raise_at_a_safe_call(signum: int, frame: FrameType, deadline: float) -> bool:
    """Raise the interrupt of ``signum`` at the next call the main thread makes from a safe frame
    (a trace function, on this thread only); where a trace function is set already (a
    debugger's, coverage's), the signal comes again in 10 ms instead. False: neither can be.

    Safe frames: the frames under way that are safe, then each function called from a safe
    frame that is not itself a callback. A function torch's C++ calls has the last Python
    frame as its caller, so a callback is told by its own code. The interrupt is raised as
    the call begins, before the function's first instruction: to its caller, the call
    raised, as a call can (Python itself delivers a signal there); never at a line
    boundary (which could fall between a ``with`` block's end and its ``__exit__``), never
    into a resumed generator (its ``finally`` would not run) nor in the standard library.
    """
    if sys.gettrace() is not None:
        return _send_again(signum)

    def trace(here: FrameType, event: str, _arg: Any) -> Any:
        if not _waiting or event != "call":
            return trace if _waiting else None
        late = time.monotonic() >= deadline
        caller = here.f_back
        if not late and not (caller is not None and caller.f_trace is trace and not _called_back(here.f_code, False)):
            return None  # a callback, or called from one: its own calls are not traced either
        code = here.f_code
        if code.co_flags & _RESUMABLE or (not late and _in_stdlib(code.co_filename)):
            here.f_trace_lines = False
            return trace  # safe, but not the place: the calls it makes are
        _stop_waiting(here)
        raise _interrupt_of(signum)

    _waiting.append(signum)
    current: FrameType | None = frame
    while current is not None:  # the frames under way: the safe ones' calls can raise
        if not _unsafe_moment(current, deadline):
            current.f_trace = trace
            current.f_trace_lines = False
        current = current.f_back
    sys.settrace(trace)
    return True


#: generators and coroutines, whose call event resumes them: inspect's CO_GENERATOR, CO_COROUTINE,
#: CO_ITERABLE_COROUTINE and CO_ASYNC_GENERATOR (inspect itself is too slow to import before the handlers)
_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200


def _stop_waiting(frame: FrameType | None) -> None:
    """No interrupt waits any more: the trace function is removed from this thread and its frames."""
    if not _waiting:
        return
    _waiting.clear()
    sys.settrace(None)
    while frame is not None:
        frame.f_trace = None
        frame = frame.f_back


def _send_again(signum: int) -> bool:
    """Send ``signum`` to this process in 10 ms, from a helper thread; False where none can start."""
    import threading

    timer = threading.Timer(0.01, os.kill, (os.getpid(), signum))
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # the interpreter is shutting down: no thread, raise now
        return False
    return True


def interrupted_by(error: BaseException) -> type[BaseException] | None:
    """The interrupt (KeyboardInterrupt or Terminated) that ``error`` arose from, or None.

    Why: an interrupt that lands in the middle of clean-up code can make that code raise
    something else (a KeyError from a half-updated table); the command was still
    interrupted, and must end as one, not with that error's traceback.

    >>> try:
    ...     try:
    ...         raise KeyboardInterrupt
    ...     finally:
    ...         {}["gone"]
    ... except KeyError as error:
    ...     interrupted_by(error).__name__
    'KeyboardInterrupt'
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (KeyboardInterrupt, Terminated)):
            return type(item)
        pending.extend((item.__context__, item.__cause__))
    return None


def register_workload_source(path: str | os.PathLike[str], ref: str) -> None:
    """Remember that ``path`` holds workload code, loaded for the reference ``ref``.

    Args:
        path: the source file (a workload file, or a module's ``__file__``).
        ref: the reference the user gave (``"train.py:make_workload"``).
    """
    _WORKLOAD_SOURCES[os.path.realpath(path)] = ref


def workload_code_of(error: BaseException) -> str | None:
    """Where in the user's workload code ``error`` was raised, in words; None when not there.

    The innermost frame of the traceback that lies in a registered workload source: that
    is the user's function that raised it (or called what raised it).

    >>> import tempfile, pathlib
    >>> source = pathlib.Path(tempfile.mkdtemp()) / "train.py"
    >>> _ = source.write_text(chr(10).join(["def loss(model, batch):", "    return batch[0] / 0", ""]))
    >>> namespace = {}
    >>> exec(compile(source.read_text(), str(source), "exec"), namespace)
    >>> register_workload_source(source, "train.py:make")
    >>> try:
    ...     namespace["loss"](None, [1])
    ... except ZeroDivisionError as error:
    ...     print(workload_code_of(error))
    loss (train.py, line 2) of the workload train.py:make
    """
    found = None
    frame = error.__traceback__
    while frame is not None:
        code = frame.tb_frame.f_code
        ref = _WORKLOAD_SOURCES.get(os.path.realpath(code.co_filename))
        if ref is not None:
            found = (code.co_name, code.co_filename, frame.tb_lineno, ref)
        frame = frame.tb_next
    if found is None:
        return None
    name, filename, line, ref = found
    what = {"<module>": "the top level", "<lambda>": "a lambda"}.get(name, name)
    return f"{what} ({os.path.basename(filename)}, line {line}) of the workload {ref}"
