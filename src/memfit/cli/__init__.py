"""The ``memfit`` command line: a thin layer over the Python API.

Every command lives in its own module of this package (``memfit probe`` in
``cli/probe.py``), which defines ``command``. ``COMMANDS`` names them explicitly, so a
helper module here (``options.py``) never becomes a command by accident, and a command's
module (and torch with it) is imported only when that command runs.
Every command takes ``--json``; stdout carries memfit's result alone (what the workload
prints goes to stderr). Exit status:

- 0: done (``doctor``, ``check`` and ``env check``: 1 when they found what matters);
- 2: a user error (a :class:`MemfitError`, a bad option, a file that cannot be read or
  written, a rank that did not answer): one line ``memfit: error: ...``, no traceback;
- 1: an exception raised by the workload's own code: one line naming the workload
  function, then its traceback (that is where the bug is); or a bug in memfit;
- 130 after SIGINT (Ctrl-C), 143 after SIGTERM: ``memfit: aborted``; every file memfit
  writes is whole or absent, never half-written.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import click

from memfit._version import __version__
from memfit.errors import MemfitError, Terminated, install_handlers, interrupt, interrupted_by, workload_code_of

__all__ = [
    "main",
    "cli",
    "COMMANDS",
    "entry_point",
    "exit_with",
    "user_error",
    "Terminated",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
]

#: exit statuses after an interrupt: 128 + the signal's number, as a shell reports it
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM

#: the commands that import torch (doctor, env and check answer without it)
_TORCH_COMMANDS = ("estimate", "fit", "measure", "plan", "probe", "report")

#: command name -> module that defines ``command``
COMMANDS: dict[str, str] = {
    "check": "memfit.cli.check",
    "doctor": "memfit.cli.doctor",
    "env": "memfit.cli.env",
    "estimate": "memfit.cli.estimate",
    "fit": "memfit.cli.fit",
    "measure": "memfit.cli.measure",
    "plan": "memfit.cli.plan",
    "probe": "memfit.cli.probe",
    "report": "memfit.cli.report",
}


class _LazyGroup(click.Group):
    """Imports a command's module only when that command runs (or help lists it).

    Why: ``memfit doctor`` should answer fast and not import torch for nothing.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        from memfit.cli.options import route_output

        return route_output(importlib.import_module(module).command)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memfit")
@click.option("--verbose", is_flag=True, help="Show torch's log messages and warnings as they come.")
def cli(verbose: bool) -> None:
    """memfit ends "CUDA out of memory": doctor, estimate, probe, plan, guard, monitor
    and lock the memory of PyTorch training."""


@contextlib.contextmanager
def sigterm_ends_like_sigint() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated`, and SIGINT (where Python's own
    handler has it) KeyboardInterrupt, both at a safe moment (:func:`memfit.errors.interrupt`);
    only the main thread has signals. A SIGINT handler of the caller's own, or SIG_IGN, is kept.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def interrupts_not_lost() -> Iterator[None]:
    """While the block runs, an interrupt that lands in a finalizer is delivered again.

    Why: Python runs a signal's handler wherever the main thread is, a weakref callback
    included (the storage tracker frees every tensor in one); an exception raised there
    cannot propagate, so Python prints "Exception ignored in ..." and Ctrl-C is lost while
    the command runs on. The hook sends the signal again from a helper thread a moment
    later, when the main thread is back in ordinary code, and prints nothing.
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        again = (
            signal.SIGINT
            if isinstance(error, KeyboardInterrupt)
            else signal.SIGTERM
            if isinstance(error, Terminated)
            else None
        )
        if again is None:
            previous(unraisable)
            return
        timer = threading.Timer(0.01, os.kill, (os.getpid(), again))
        timer.daemon = True
        timer.start()

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


#: what memfit's own text holds beyond ASCII, and what it reads as on a terminal that cannot show it
_ASCII = {"·": "-", "×": "x", "→": "->", "←": "<-", "≥": ">=", "≤": "<=", "…": "...", "—": "-", "–": "-", "≈": "~"}
_ASCII.update({"µ": "u", "✓": "ok", "✗": "x", "±": "+-", "‘": "'", "’": "'", "“": '"', "”": '"'})
_ASCII.update({"━": "-", "─": "-", "│": "|", "┃": "|", "█": "#", "▏": "|", "•": "*"})


def _ascii_fallback(error: UnicodeError) -> tuple[str, int]:
    """The codec error handler of memfit's streams: ``×`` becomes ``x``, anything else ``?``."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    text = error.object[error.start : error.end]
    return "".join(_ASCII.get(char, "?") for char in text), error.end


codecs.register_error("memfit-ascii", _ascii_fallback)


def text_streams_that_always_encode() -> None:
    """Make stdout and stderr write what their encoding cannot hold in ASCII, not raise.

    Why: under ``PYTHONIOENCODING=ascii`` or ``LANG=C`` a "·" in a title raised
    UnicodeEncodeError, after the lock was written, ending the command in a traceback.
    A stream already able to write every character (UTF-8) is left as it is.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "".join(_ASCII).encode(encoding)
            continue
        except (UnicodeError, LookupError):
            pass
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="memfit-ascii")


def main(
    argv: list[str] | None = None,
    within: Callable[[], AbstractContextManager[object]] | None = None,
    final: bool = False,
) -> int:
    """Run the command line; return the exit status instead of raising SystemExit.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        within: a context the command runs inside (torchrun's process group), so that
            its errors and interrupts end the same way as the command's.
        final: the process ends once this returns (the entry points): from the moment the
            command has its outcome, SIGINT and SIGTERM are ignored, so a second signal
            cannot put a traceback or another status after the line already printed.
    """
    try:
        from memfit.cli.noise import noise_held
        from memfit.cli.process_state import state_kept

        text_streams_that_always_encode()
        args = sys.argv[1:] if argv is None else list(argv)
        named = next((i for i, a in enumerate(args) if a in COMMANDS), len(args))
        uses_torch = named < len(args) and args[named] in _TORCH_COMMANDS
        held = noise_held("--verbose" in args[:named], uses_torch)
        with held as noise:
            try:
                around = within() if within is not None else contextlib.nullcontext()
                with sigterm_ends_like_sigint(), interrupts_not_lost(), around, state_kept():
                    result = cli.main(args=args, prog_name="memfit", standalone_mode=False)
            except BaseException:
                if final:
                    ignore_signals()
                raise
            if final:
                ignore_signals()
            noise.show()
    except BaseException as error:  # noqa: BLE001 - every way out ends in one status and its line
        if final:
            ignore_signals()
        status = _ended_by(error)
        if status == 1 and "noise" in locals():  # the user's traceback is shown: what torch said belongs with it
            noise.show()
        return status
    return result if isinstance(result, int) else 0


def ignore_signals() -> None:
    """SIGINT and SIGTERM do nothing from now on (the process is ending; only the main thread can)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def aborted(interrupt: type[BaseException]) -> int:
    """Print the line of an interrupted command; return its status (130 after SIGINT, 143 after SIGTERM)."""
    if issubclass(interrupt, Terminated):
        _say("memfit: aborted (SIGTERM)")
        return EXIT_SIGTERM
    _say("memfit: aborted")
    return EXIT_SIGINT


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr closed or gone: the status still tells
        click.echo(line, err=True)


def _ended_by(error: BaseException) -> int:
    """The exit status (and the one line) of a command that ended with ``error``."""
    if isinstance(error, SystemExit):
        where = workload_code_of(error)
        if where is None:
            raise error
        return user_error(
            f"{where} called sys.exit({error.code!r}) while memfit ran it: memfit's work did not finish, "
            "nothing was written; a workload must return, not exit"
        )
    if isinstance(error, click.exceptions.Abort):
        return aborted(KeyboardInterrupt)
    interrupt = interrupted_by(error)
    if interrupt is not None:  # the interrupt itself, or what clean-up raised because of it
        return aborted(interrupt)
    if isinstance(error, MemfitError):
        return user_error(str(error))
    if isinstance(error, click.ClickException):
        return user_error(error.format_message())
    if isinstance(error, Exception):
        where = workload_code_of(error)
        if where is not None:
            return _workload_code_error(error, where)
    raise error  # a bug in memfit: the whole traceback


def user_error(message: str) -> int:
    """Print ``memfit: error: MESSAGE`` on one line; return the exit status of a user error (2)."""
    first_line = " ".join(message.split())
    click.echo(f"memfit: error: {first_line}", err=True)
    return 2


def _workload_code_error(error: Exception, where: str) -> int:
    """One line naming the workload function that raised, then its traceback: exit status 1."""
    summary = " ".join(str(error).split())
    click.echo(f"memfit: error in {where}: {type(error).__name__}: {summary} (its traceback follows)", err=True)
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return 1


def exit_with(status: int) -> None:
    """End the process with ``status``; at once when a collective was left unfinished.

    Why at once: after a rank did not answer (or an interrupt during a collective), the
    process group still holds a thread waiting for that rank, and the interpreter's normal
    exit would wait for it. Every file memfit writes is complete by now (written and
    fsynced before the rename), so only the output streams need flushing.
    """
    distributed = sys.modules.get("memfit.distributed")  # not imported: no process group
    if distributed is not None and distributed.left_unfinished():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def entry_point() -> None:
    """An older ``memfit`` script's entry (the command is now :func:`memfit.__main__.run`, whose
    handlers are in place before any import); without torchrun's process group. Its handlers
    come once this package is imported, then as :func:`memfit.__main__.run`'s do."""
    try:
        install_handlers()
        status = main(final=True)
    except (KeyboardInterrupt, Terminated) as interrupted:  # before the command's own handling
        ignore_signals()
        status = aborted(type(interrupted))
    exit_with(status)
