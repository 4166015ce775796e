"""Recognising an out-of-memory error, in one place.

Why one place: probe, guard, plan and measure all decide "OOM or a real bug?" and must
decide it the same way. An OOM is ``torch.OutOfMemoryError`` first; then the messages
the other back ends and older builds raise as a plain ``RuntimeError``. Anything else is
not an OOM and must propagate unchanged.

>>> import torch
>>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
True
>>> is_oom(ValueError("shapes do not match"))
False
"""

from __future__ import annotations

import gc

import torch

__all__ = ["is_oom", "OOM_MESSAGES", "release_cached_memory"]

#: Substrings of messages that mean "out of memory" on some back end.
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # CUDA caching allocator
    "CUDA error: out of memory",  # a raw cudaMalloc failure outside the allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not get its workspace
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer when its workspace does not fit
    "HIP out of memory",  # ROCm
    "MPS backend out of memory",  # Apple silicon
    "XPU out of memory",  # Intel GPUs
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "DefaultCPUAllocator: not enough memory",
)


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory error on any device, else False."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    return any(text in message for text in OOM_MESSAGES)


def release_cached_memory() -> None:
    """Collect garbage and return cached blocks, so the next attempt starts clean.

    Call it *outside* an ``except`` block: while the exception is held, its traceback
    keeps the failed step's tensors alive and nothing can be freed.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
