"""``python -m memfit`` (and ``torchrun -m memfit``, and the ``memfit`` command) runs the command line.

Under torchrun (WORLD_SIZE > 1) the process first joins the process group, so every
command works the same way on every rank; rank 0 alone prints.

Signals, from the first line on: SIGTERM raises :class:`~memfit.errors.Terminated` (its
default would end the process without a word) and SIGINT raises KeyboardInterrupt, before
memfit, click or torch is imported; an interrupt at any moment, an import included, ends
with ``memfit: aborted`` and 130 (143 after SIGTERM). Once the outcome is known, further
signals are ignored, so the line and the status printed stay the ones of the first.
"""

import signal
import sys
import threading
from types import FrameType

from memfit.errors import Terminated


def _terminate(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated()


def run() -> None:
    """Run the command line as a process: install the handlers, run, exit with its status."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from memfit.cli import aborted, exit_with, ignore_signals
        from memfit.integrations.torchrun import main
    except (KeyboardInterrupt, Terminated) as interrupt:  # during the imports themselves
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stderr.write("memfit: aborted (SIGTERM)\n" if isinstance(interrupt, Terminated) else "memfit: aborted\n")
        sys.stderr.flush()
        sys.exit(143 if isinstance(interrupt, Terminated) else 130)
    try:
        status = main(final=True)
    except (KeyboardInterrupt, Terminated) as interrupt:  # between the imports and the command's own handling
        ignore_signals()
        status = aborted(type(interrupt))
    exit_with(status)


if __name__ == "__main__":
    run()
