"""The process state a workload must leave as it found it, watched while a command runs.

memfit runs the user's code (the workload file, its model factory, ``make_batch``,
``loss``) many times in one process. Code that changes the process on the way (``os.chdir``,
``torch.set_default_dtype``, ``torch.set_grad_enabled(False)``,
``torch.use_deterministic_algorithms``) makes each later trial run under other conditions
than the run the user will train, so its figures are not that run's. The state is taken
when the command starts; before every file memfit writes (``_io.write_guards``) and when
the command ends, it is compared: a change is put back and the command refused in one line,
so no lock or report is written from a changed process.

torch's part is read only when torch is imported; a process that had not imported it yet
starts from torch's own defaults (float32, grad mode on, deterministic algorithms off).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memfit._io import write_guards
from memfit.errors import MemfitError

__all__ = ["ProcessState", "state_kept", "ProcessStateChanged"]


class ProcessStateChanged(MemfitError):
    """The user's code changed the process state while memfit ran it (memfit put it back)."""


@dataclass(frozen=True)
class ProcessState:
    """What a training step's result depends on beyond its arguments."""

    cwd: str
    default_dtype: str = "torch.float32"
    grad_enabled: bool = True
    deterministic: tuple[bool, bool] = (False, False)

    @classmethod
    def now(cls) -> ProcessState:
        """This process's state now (torch's part: its defaults when torch is not imported)."""
        try:
            cwd = os.getcwd()
        except OSError:  # the folder was removed under us
            cwd = "(a removed folder)"
        torch: Any = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "get_default_dtype"):
            return cls(cwd)
        return cls(
            cwd,
            str(torch.get_default_dtype()),
            bool(torch.is_grad_enabled()),
            (
                bool(torch.are_deterministic_algorithms_enabled()),
                bool(torch.is_deterministic_algorithms_warn_only_enabled()),
            ),
        )

    def differences(self, other: ProcessState) -> list[str]:
        """What differs from ``self`` (the state at the start) in ``other``, in words."""
        names = {
            "cwd": "the working directory",
            "default_dtype": "torch's default dtype",
            "grad_enabled": "torch's grad mode",
            "deterministic": "torch's deterministic-algorithms flag",
        }
        return [
            f"{what} from {getattr(self, name)} to {getattr(other, name)}"
            for name, what in names.items()
            if getattr(self, name) != getattr(other, name)
        ]

    def restore(self) -> None:
        """Put the process back as it was (torch's part only when torch is imported)."""
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        torch: Any = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "set_default_dtype"):
            return
        torch.set_default_dtype(getattr(torch, self.default_dtype.removeprefix("torch.")))
        torch.set_grad_enabled(self.grad_enabled)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])


def _check(start: ProcessState) -> None:
    changed = start.differences(ProcessState.now())
    if changed:
        start.restore()
        raise ProcessStateChanged(
            f"the workload's code changed {'; '.join(changed)} while memfit ran it (memfit put it back); "
            "nothing was written: later trials would not run as your training does, so a workload "
            "must leave the process as it found it"
        )


@contextlib.contextmanager
def state_kept() -> Iterator[ProcessState]:
    """Refuse, before any write and at the end, a command whose workload changed the process.

    Whatever ends the block, the state is put back; a change found at the end of a block
    that ended normally raises :class:`ProcessStateChanged`.
    """
    start = ProcessState.now()
    with write_guards(lambda: _check(start)):
        try:
            yield start
        except BaseException:
            start.restore()
            raise
    _check(start)
