"""The guard: survive an OOM in training by splitting the batch, with the same update.

- :class:`Guard` (:mod:`memfit.guard.guard`): a training step for a plain loop;
- :class:`Splitter` (:mod:`memfit.guard.splitter`): one batch in micro-batches with OOM
  recovery, for loops memfit does not own (the Lightning and transformers integrations);
- :mod:`memfit.guard.policy`: which micro-batch size to run (pure);
- :mod:`memfit.guard.batching`: splitting a user's batch, counting its samples, joining outputs;
- :mod:`memfit.guard.gradients`: setting gradients aside and adding them back;
- :mod:`memfit.guard.snapshot`: buffers, generators, optimizer and scaler state saved before
  an attempt and put back after a failure;
- :mod:`memfit.guard.reduction` and :mod:`memfit.guard.check`: the check, on the user's loss,
  of how micro-batches must be weighted (or why the batch cannot be split);
- :mod:`memfit.guard.fsdp`: FSDP2 models: heartbeats so ranks stop together, local
  accumulation and one reduce-scatter per batch.
"""

from memfit.guard.errors import GuardError, NonFiniteGradientError, SplitRefusedError
from memfit.guard.gradients import add_gradients, set_aside_gradients
from memfit.guard.guard import Guard
from memfit.guard.policy import SplitPolicy
from memfit.guard.splitter import OOMEvent, SplitResult, Splitter

__all__ = [
    "Guard",
    "Splitter",
    "SplitPolicy",
    "SplitResult",
    "OOMEvent",
    "GuardError",
    "SplitRefusedError",
    "NonFiniteGradientError",
    "set_aside_gradients",
    "add_gradients",
]
