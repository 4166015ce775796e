"""What the storage tracker counts: CUDA's allocations, not the CPU's scratch work.

Why: the simulated GPU and the estimator compute a CUDA kernel's values with CPU kernels
that allocate other tensors than CUDA's (the math attention path's probabilities, a
dropout mask in the input's dtype). Those CPU-only tensors are made inside
:func:`not_counted`, which :class:`memfit.memory.tracker.StorageTracker` skips; the
tensors CUDA's kernel would allocate are then made outside it with :func:`counted_like`
(the tracker sees their allocation) and filled from the CPU result with :func:`fill`
(inside :func:`not_counted`, so the CPU result is never counted as an input).

The flag is per thread, like the tracker's labels: the autograd engine runs a CPU
backward on the thread that called ``backward()``.

>>> counting()
True
>>> with not_counted():
...     counting()
False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["counting", "not_counted", "counted_empty", "fill", "has_values"]

_state = threading.local()


def counting() -> bool:
    """False inside :func:`not_counted` on this thread (the tracker then skips operations)."""
    return not getattr(_state, "hidden", False)


@contextlib.contextmanager
def not_counted() -> Iterator[None]:
    """Run the block without the storage tracker seeing its operations (CPU-only scratch work)."""
    previous = getattr(_state, "hidden", False)
    _state.hidden = True
    try:
        yield
    finally:
        _state.hidden = previous


def counted_empty(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """A tensor the tracker counts, laid out as CUDA's kernel lays it out.

    Args:
        shape: the logical shape.
        dtype: the element type.
        device: where the values live (the CPU, or fake tensors on it).
        order: the physical dimension order, outermost first (``(0, 2, 1, 3)``: a
            (B, H, S, D) tensor stored as (B, S, H, D), as the fused attention kernels
            write it); ``None`` is contiguous.
    """
    if order is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return torch.empty_permuted(tuple(shape), tuple(order), dtype=dtype, device=device)


def has_values(tensor: torch.Tensor) -> bool:
    """False for the estimator's fake tensors: a backward recompute there would only cost time.

    (A forward still runs its CPU computation on fake tensors: it checks the shapes as
    the real run does.)
    """
    return not isinstance(tensor, FakeTensor)


def fill(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Copy ``value`` (uncounted CPU work) into ``target`` (counted) without counting ``value``."""
    with not_counted(), torch.no_grad():
        target.copy_(value)
    return target
