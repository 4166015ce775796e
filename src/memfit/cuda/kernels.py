"""The CUDA kernel an emulation stands for, told to whoever times the step.

Why: an emulated kernel (:mod:`memfit.cuda.attention`, :mod:`memfit.cuda.dropout`,
:mod:`memfit.cuda.rnn`) computes its values with CPU operations that CUDA would not run
(the math attention's (B, H, S, S) scores for what CUDA runs as one flash kernel, an RNN's
per-step cells for one cuDNN call). Those run inside :func:`memfit.cuda.counting.not_counted`,
which the storage tracker, and the estimator's operation counter, skip. What CUDA runs
instead is reported here, as one :class:`Kernel` per CUDA kernel: its FLOPs (PyTorch's
flop-counter formula for the ATen operation CUDA dispatches to, :func:`formula_flops`), the
bytes it reads and writes, and the dtype its arithmetic runs in.

The seam is one thread-local observer: the estimator's counter registers itself with
:func:`observing` while its fake steps run (this package, layer 2, imports nothing of the
estimator). Reports on a thread without an observer go nowhere. The autograd engine runs a
CPU backward on the thread that called ``backward()``, so a kernel's backward reports to the
same observer as its forward.

>>> seen = []
>>> with observing(seen.append):
...     report(Kernel("native_dropout", 0, 3 * 1024, torch.float32, "none"))
>>> [k.name for k in seen]
['native_dropout']
>>> reporting()
False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Kernel", "Engine", "observing", "reporting", "report", "formula_flops", "moved_bytes"]

#: what a kernel's FLOPs run on: ``matmul``: the tensor cores of its dtype (fp32 on tf32
#: where ``torch.backends.cuda.matmul.allow_tf32`` allows); ``cudnn``: the same, fp32 on tf32
#: where ``torch.backends.cudnn.allow_tf32`` allows (cuDNN's math type); ``none``: no
#: products, the kernel is timed by the bytes it moves
Engine = Literal["matmul", "cudnn", "none"]


@dataclass(frozen=True)
class Kernel:
    """One CUDA kernel (or one library call) an emulation stands for.

    Args:
        name: the ATen operation CUDA runs (``_scaled_dot_product_flash_attention``).
        flops: its floating-point operations (0 for an element-wise kernel).
        nbytes: the bytes it reads and writes, each tensor once.
        dtype: the dtype its arithmetic runs in.
        engine: what its FLOPs run on (see :data:`Engine`).
    """

    name: str
    flops: int
    nbytes: int
    dtype: torch.dtype
    engine: Engine


_local = threading.local()


@contextlib.contextmanager
def observing(observer: Callable[[Kernel], Any]) -> Iterator[None]:
    """Send this thread's kernel reports to ``observer`` inside the block.

    Args:
        observer: called with each :class:`Kernel` an emulation reports.
    """
    previous = getattr(_local, "observer", None)
    _local.observer = observer
    try:
        yield
    finally:
        _local.observer = previous


def reporting() -> bool:
    """Whether this thread has an observer (an emulation may skip building its report)."""
    return getattr(_local, "observer", None) is not None


def report(kernel: Kernel) -> None:
    """Tell this thread's observer, if any, that CUDA runs ``kernel`` here."""
    observer = getattr(_local, "observer", None)
    if observer is not None:
        observer(kernel)


def formula_flops(op_name: str, *args: Any) -> int:
    """FLOPs of ``aten.<op_name>(*args)`` by PyTorch's own formula (``torch.utils.flop_counter``).

    The formulas read only shapes, so ``args`` may be fake tensors or ``torch.Size``s.

    Args:
        op_name: the ATen operation, ``_scaled_dot_product_flash_attention_backward``.
        args: its leading arguments, as the formula takes them (for attention: grad_out
            (backward only), query, key, value).

    >>> q = torch.Size([1, 2, 128, 64])
    >>> formula_flops("_scaled_dot_product_flash_attention", q, q, q) == 2 * (2 * 2 * 128 * 128 * 64)
    True
    """
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry[getattr(torch.ops.aten, op_name)]
    return int(formula(*args, out_val=None))


def moved_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes a kernel moves reading or writing each of ``tensors`` once.

    A broadcast view (a zero stride) is read from its storage, once.
    """
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        size = tensor.numel() * tensor.element_size()
        if 0 in tensor.stride():
            with contextlib.suppress(RuntimeError, NotImplementedError):
                size = min(size, tensor.untyped_storage().nbytes())
        total += size
    return total
