"""``python -m memfit`` (and ``torchrun -m memfit``, and the ``memfit`` command) runs the command line.

Under torchrun (WORLD_SIZE > 1) the process first joins the process group, so every
command works the same way on every rank; rank 0 alone prints.

Signals, from :func:`run`'s first line on (docs/design.md, "Signals", says what comes
before it): SIGTERM raises :class:`~memfit.errors.Terminated` (its default would end the
process without a word) and SIGINT raises KeyboardInterrupt, both through
:func:`memfit.errors.interrupt` (at a moment where raising cannot abort the process),
before memfit, click or torch is imported; an interrupt at any later moment, an import
included, ends with ``memfit: aborted`` and 130 (143 after SIGTERM). Once the outcome is
known, further signals are ignored, so the line and the status printed stay the ones of
the first. A SIGINT the process was started ignoring (``memfit ... &`` in a script: a
background job of a shell without job control) stays ignored, as Python itself leaves it.

Before the handlers come only Python's own start-up (``site``), the script's wrapper,
``memfit/__init__.py`` (which imports nothing), ``signal`` and ``memfit.errors``.
"""

import signal
import sys

from memfit.errors import Terminated, install_handlers


def run() -> None:
    """Run the command line as a process: install the handlers, run, exit with its status."""
    try:
        install_handlers()
        from memfit.cli import aborted, exit_with, ignore_signals
        from memfit.integrations.torchrun import main
    except (KeyboardInterrupt, Terminated) as interrupted:  # during the imports themselves
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stderr.write("memfit: aborted (SIGTERM)\n" if isinstance(interrupted, Terminated) else "memfit: aborted\n")
        sys.stderr.flush()
        sys.exit(143 if isinstance(interrupted, Terminated) else 130)
    try:
        status = main(final=True)
    except (KeyboardInterrupt, Terminated) as interrupted:  # between the imports and the command's own handling
        ignore_signals()
        status = aborted(type(interrupted))
    exit_with(status)


if __name__ == "__main__":
    run()
