"""The guard: survive an OOM in training by splitting the batch, with the same update.

- :class:`Guard` (:mod:`memfit.guard.guard`): a training step for a plain loop;
- :class:`Splitter` (:mod:`memfit.guard.splitter`): one batch in micro-batches with OOM
  recovery, for loops memfit does not own (the Lightning and transformers integrations);
- :mod:`memfit.guard.policy`: which micro-batch size to run (pure);
- :mod:`memfit.guard.batching`: splitting a user's batch, counting its samples, joining outputs;
- :mod:`memfit.guard.gradients`: setting gradients aside and adding them back;
- :mod:`memfit.guard.fsdp`: FSDP2 models: heartbeats so ranks stop together, local
  accumulation and one reduce-scatter per batch.
"""

from memfit.guard.gradients import add_gradients, set_aside_gradients
from memfit.guard.guard import Guard
from memfit.guard.policy import SplitPolicy
from memfit.guard.splitter import GuardError, OOMEvent, SplitResult, Splitter

__all__ = [
    "Guard",
    "Splitter",
    "SplitPolicy",
    "SplitResult",
    "OOMEvent",
    "GuardError",
    "set_aside_gradients",
    "add_gradients",
]
