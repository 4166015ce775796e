"""The guard's errors: an OOM splitting cannot fix, and a split that would change the gradient."""

from __future__ import annotations

from memfit.errors import DoesNotFitError

__all__ = ["GuardError", "SplitRefusedError", "NonFiniteGradientError"]


class GuardError(DoesNotFitError):
    """An OOM that splitting cannot fix: at micro-batch size 1, or in ``optimizer.step()``."""

    def __init__(self, message: str, breakdown: dict[str, int | None] | None = None) -> None:
        super().__init__(message)
        #: bytes by category at the time of the OOM (None where unknown)
        self.breakdown = breakdown or {}


class SplitRefusedError(GuardError):
    """The batch ran out of memory and splitting it would not give the whole batch's gradient.

    Raised before anything was split: the parameters, gradients, buffers and generators
    are as they were before the step.
    """


class NonFiniteGradientError(GuardError):
    """A micro-batch made the gradient NaN or infinite; the optimizer did not step on it."""
