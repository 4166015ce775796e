"""The errors memfit raises on purpose.

A :class:`MemfitError` is a user error (a bad size, an unknown workload, a device that is
not there): the command line prints it as one line ``memfit: error: ...`` and exits with
status 2, without a traceback. Everything else is a bug, in memfit or in the user's code,
and propagates unchanged.
"""

from __future__ import annotations

__all__ = ["MemfitError", "WorkloadError", "DeviceError", "DoesNotFitError"]


class MemfitError(Exception):
    """A user error: one clear line, exit status 2."""


class WorkloadError(MemfitError):
    """A workload reference that cannot be resolved, or a workload that is malformed."""


class DeviceError(MemfitError):
    """A device spec that is unknown, or names hardware this machine does not have."""


class DoesNotFitError(MemfitError):
    """The workload does not fit even at the smallest batch (or micro-batch) possible."""
