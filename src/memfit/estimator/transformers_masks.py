"""transformers' attention-mask shortcut on fake tensors: decide it as the real run does.

Why: transformers skips building a (batch, 1, seq, seq) causal mask, and lets SDPA use
``is_causal`` (the flash kernel), when the position ids are not packed sequences
(``masking_utils.find_packed_sequence_indices``). Deciding that reads the position ids'
values; on fake tensors it cannot, so transformers builds the mask (it treats a fake
tensor as tracing). The real run, the simulated GPU's and a GPU's alike, builds none
when the model made the position ids itself: they are ``arange(seq)``, never packed.

So during the estimator's fake steps, while the workload's batches carry no
``position_ids``, the detection answers "not packed" for fake position ids, as it does for
the real ones. A batch that gives its own ``position_ids`` keeps transformers' answer
(a mask: what a run with packed sequences builds).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["PositionsWatch", "watching_positions"]


class PositionsWatch:
    """Sees the workload's batches; answers transformers' packed-sequence question for fake positions."""

    def __init__(self) -> None:
        self.given = False  # a batch passed its own position_ids
        self._module: Any = None
        self._original: Any = None

    def observe(self, batch: Any) -> None:
        """Note whether ``batch`` gives ``position_ids``; install the answer once transformers is loaded."""
        self.given = self.given or (isinstance(batch, dict) and "position_ids" in batch)
        if self._module is None:
            masking: Any = sys.modules.get("transformers.masking_utils")
            if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
                self._module, self._original = masking, masking.find_packed_sequence_indices
                masking.find_packed_sequence_indices = self._find_packed_sequence_indices

    def _find_packed_sequence_indices(self, position_ids: Any) -> Any:
        if isinstance(position_ids, FakeTensor) and not self.given:
            # transformers' own steps (5.x), so their small temporaries are counted as in
            # the real run; only the value read (is any sequence packed?) is answered here
            first = position_ids[:, :1] - 1
            packed = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
            (packed[:, -1] == 0).all()
            return None
        return self._original(position_ids)

    def restore(self) -> None:
        if self._module is not None:
            self._module.find_packed_sequence_indices = self._original
            self._module = None


@contextlib.contextmanager
def watching_positions() -> Iterator[PositionsWatch]:
    """A :class:`PositionsWatch` for the block; transformers is left as it was afterwards."""
    watch = PositionsWatch()
    try:
        yield watch
    finally:
        watch.restore()
