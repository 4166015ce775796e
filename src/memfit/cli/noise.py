"""torch's log records and the warnings a command provokes, kept out of the way of memfit's line.

Why: a workload whose loss raises under fake tensors made torch log the failure (dozens of
lines) before memfit's ``error in`` line; a NaN loss was refused after a two-line
UserWarning. While a command runs, records of the ``torch`` logger and warnings are held;
then they are shown after the command's results or its error and traceback, and dropped
after a one-line refusal or an interrupt (that line is the whole answer). ``memfit --verbose``
shows them as they come.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

__all__ = ["Held", "noise_held"]

#: the most records and warnings held (a long plan must not grow without bound)
_LIMIT = 200


class Held(logging.Handler):
    """What was held: log records and warnings, in the order they came."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.warnings: list[warnings.WarningMessage] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _LIMIT:
            self.records.append(record)

    def warn(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: object = None,
        line: str | None = None,
    ) -> None:
        """``warnings.showwarning`` while held: keep the warning to show later."""
        if len(self.warnings) < _LIMIT:
            self.warnings.append(warnings.WarningMessage(message, category, filename, lineno, None, line))

    def show(self) -> None:
        """Write what was held to stderr (after memfit's own output)."""
        formatter = logging.Formatter("%(name)s: %(levelname)s: %(message)s")
        for record in self.records:
            sys.stderr.write(formatter.format(record) + "\n")
        for caught in self.warnings:
            sys.stderr.write(
                warnings.formatwarning(caught.message, caught.category, caught.filename, caught.lineno, caught.line)
            )


@contextlib.contextmanager
def noise_held(verbose: bool, uses_torch: bool) -> Iterator[Held]:
    """Hold torch's log records (WARNING and up) and every warning while the block runs.

    Args:
        verbose: hold nothing (``memfit --verbose``).
        uses_torch: the command imports torch: import it now, so that the handlers torch
            gives its loggers when imported exist to be held (the command pays the import anyway).
    """
    held = Held()
    if verbose:
        yield held
        return
    if uses_torch:
        import torch  # noqa: F401 - its loggers' handlers are made at import
    # torch gives many of its loggers their own stderr handler (propagate off): hold each one's
    saved = _torch_loggers()
    for logger, handlers, _ in saved:
        for handler in handlers:
            logger.removeHandler(handler)
        logger.addHandler(held)
    # showwarning replaced, not catch_warnings: that resets every module's warning registry, so
    # warnings torch's C++ code raises once would run Python code again each time (where an
    # interrupt can land inside a C++ callback and abort the process)
    shown = warnings.showwarning
    warnings.showwarning = held.warn
    try:
        yield held
    finally:
        warnings.showwarning = shown
        for logger, handlers, propagate in saved:
            logger.removeHandler(held)
            for handler in handlers:
                logger.addHandler(handler)
            logger.propagate = propagate


def _torch_loggers() -> list[tuple[logging.Logger, list[logging.Handler], bool]]:
    """torch's loggers that write themselves (their handlers, their propagate), the ``torch`` logger first."""
    torch_logger = logging.getLogger("torch")
    found = [torch_logger]
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.") and isinstance(logger, logging.Logger) and logger.handlers:
            found.append(logger)
    saved = [(logger, list(logger.handlers), logger.propagate) for logger in found]
    torch_logger.propagate = False  # what no handler of torch's takes is held at the top
    return saved
