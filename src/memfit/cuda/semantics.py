"""Enter CUDA's semantics: attention kernels, autocast lists, fused dropout and cuDNN RNNs at once.

:func:`cuda_semantics` is what the simulated GPU and the estimator enter around a run
whose target is a CUDA GPU. While any run is inside it, Python kernels are registered on
the dispatcher (one ``torch.library.Library``, taken away when the last run leaves):

- on ``AutogradCPU`` (above autograd, so a kernel decides what is saved for backward):
  ``scaled_dot_product_attention`` (:mod:`memfit.cuda.attention`), ``dropout``
  (:mod:`memfit.cuda.dropout`), ``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``
  (:mod:`memfit.cuda.rnn`);
- on ``AutocastCPU``: CUDA's autocast policy (:mod:`memfit.cuda.autocast`).

The ``AutogradCPU`` kernels act on the threads that entered :func:`cuda_semantics`, with
that thread's :class:`~memfit.cuda.target.CudaTarget`; on any other thread they run the
operator's own CPU implementation. The autocast kernels, like CPU autocast itself, act on
every thread that enables CPU autocast while they are registered.

Why the dispatcher and not a ``TorchFunctionMode``: a function mode sees only calls made
from Python at the top level, not the ``dropout`` inside ``aten::_scaled_dot_product_attention_math``,
the ``log_softmax`` inside ``cross_entropy``, or the ``scaled_dot_product_attention`` inside
``nn.functional.multi_head_attention_forward``; a kernel sees every call. Not covered:
code under ``torch.inference_mode()`` (no autograd key: the CPU's implementations run,
which changes only transient memory since nothing is saved), and the inference-only fast
paths of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``.

>>> import torch
>>> with cuda_semantics(CudaTarget()):
...     active_target() is not None
True
>>> active_target() is None
True
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from memfit.cuda import attention, autocast, dropout, rnn
from memfit.cuda.autocast_lists import for_torch
from memfit.cuda.target import CudaTarget, torch_version

__all__ = ["cuda_semantics", "active_target", "autocast_device_type"]

_local = threading.local()
_lock = threading.Lock()
_users = 0
_library: torch.library.Library | None = None


def active_target() -> CudaTarget | None:
    """The CUDA target this thread's run follows, or None outside :func:`cuda_semantics`."""
    stack: list[CudaTarget] = getattr(_local, "targets", [])
    return stack[-1] if stack else None


def autocast_device_type(requested: str) -> str:
    """The ``device_type`` that gives ``torch.autocast`` / ``GradScaler`` CUDA's behaviour here.

    Inside :func:`cuda_semantics` on a machine without CUDA, ``"cuda"`` becomes ``"cpu"``,
    whose autocast then follows CUDA's lists (``torch.autocast("cuda")`` would be disabled).

    Args:
        requested: the device type the caller asked for.
    """
    if requested == "cuda" and active_target() is not None and not torch.cuda.is_available():
        return "cpu"
    return requested


# -- the AutogradCPU kernels ----------------------------------------------------------


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    target = active_target()
    if target is None:
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(*args, **kwargs)
    return attention.scaled_dot_product_attention(*args, **kwargs, target=target)


def _dropout(tensor: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if active_target() is None or not dropout.takes_fused_kernel(tensor, p, train):
        result: torch.Tensor = torch.ops.aten.dropout.default.decompose(tensor, p, train)
        return result
    return dropout.fused_dropout(tensor, p)


def _rnn_kernel(mode: rnn.Mode) -> Any:
    op = getattr(torch.ops.aten, mode).input

    def kernel(data: torch.Tensor, hx: Any, params: list[torch.Tensor], *rest: Any) -> Any:
        # cudnn_is_acceptable (aten/src/ATen/native/TensorProperties.cpp): cuDNN enabled, an
        # fp64, fp32 or fp16 tensor, not empty; anything else runs the native kernels on CUDA too
        acceptable = (
            torch.backends.cudnn.enabled
            and data.dtype in (torch.float32, torch.float16, torch.float64)
            and data.numel() > 0
        )
        if active_target() is None or not acceptable:
            return op.decompose(data, hx, params, *rest)
        states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        result = rnn.cudnn_rnn(mode, data, states, list(params), *rest, autocast=torch.is_autocast_enabled("cpu"))
        return result if mode == "lstm" else result[:2]

    return kernel


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": intended, and undone on exit
        warnings.simplefilter("ignore", UserWarning)
        library.impl("scaled_dot_product_attention", _sdpa, "AutogradCPU")
        library.impl("dropout", _dropout, "AutogradCPU")
        for mode in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
            library.impl(f"{mode}.input", _rnn_kernel(mode), "AutogradCPU")
        autocast.register_kernels(library, for_torch(torch_version()))
    return library


@contextlib.contextmanager
def cuda_semantics(target: CudaTarget) -> Iterator[CudaTarget]:
    """Run the block with CUDA's semantics for ``target`` on this thread (see the module).

    Args:
        target: the CUDA GPU and versions to follow.
    """
    global _users, _library
    with _lock:
        if _users == 0:
            _library = _register()
        _users += 1
    stack: list[CudaTarget] = getattr(_local, "targets", [])
    _local.targets = [*stack, target]
    try:
        yield target
    finally:
        _local.targets = stack
        with _lock:
            _users -= 1
            if _users == 0 and _library is not None:
                _library._destroy()
                _library = None
