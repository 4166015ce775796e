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

__all__ = [
    "MemfitError",
    "WorkloadError",
    "DeviceError",
    "DoesNotFitError",
    "RankTimeoutError",
    "Terminated",
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
