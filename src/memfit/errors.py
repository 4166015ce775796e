"""The errors memfit raises on purpose.

A :class:`MemfitError` is a user error (a bad size, an unknown workload, a device that is
not there): the command line prints it as one line ``memfit: error: ...`` and exits with
status 2, without a traceback. Everything else is a bug, in memfit or in the user's code,
and propagates unchanged.

An exception raised inside the user's own workload code (its model, its batches, its
loss) is such a bug: it keeps its traceback, since that is where the bug is. memfit only
notes which workload function raised it (:func:`note_workload_code`), so the command line
can name that function in one line before the traceback.

>>> error = ValueError("shapes do not match")
>>> note_workload_code(error, "the loss of train.py:make_workload")
>>> workload_code_of(error)
'the loss of train.py:make_workload'
"""

from __future__ import annotations

import contextlib

__all__ = [
    "MemfitError",
    "WorkloadError",
    "DeviceError",
    "DoesNotFitError",
    "RankTimeoutError",
    "note_workload_code",
    "workload_code_of",
]

#: the attribute an exception raised in workload code carries: which function raised it
_WORKLOAD_CODE = "__memfit_workload_code__"


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


def note_workload_code(error: BaseException, where: str) -> None:
    """Record, on ``error``, the workload function it came from (the innermost one wins).

    Args:
        error: the exception, left otherwise unchanged (its type, message, traceback).
        where: the function, as people name it (``"the loss of train.py:make_workload"``).
    """
    if getattr(error, _WORKLOAD_CODE, None) is None:
        with contextlib.suppress(AttributeError, TypeError):  # a type that takes no attributes
            setattr(error, _WORKLOAD_CODE, where)


def workload_code_of(error: BaseException) -> str | None:
    """The workload function ``error`` came from, or None when it did not come from one."""
    where = getattr(error, _WORKLOAD_CODE, None)
    return where if isinstance(where, str) else None
