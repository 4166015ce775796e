"""Dropout as CUDA runs it: the fused kernel's 1-byte mask, not the CPU's mask in the input's dtype.

CUDA's ``aten::dropout`` (aten/src/ATen/native/Dropout.cpp) sends a training call with
0 < p < 1 on a non-empty CUDA tensor to the fused ``native_dropout``, which returns the
output and a **bool** mask; its autograd formula (tools/autograd/derivatives.yaml) keeps
only the mask, and its backward (``native_dropout_backward``, aten/src/ATen/native/cuda/
Dropout.cu: ``masked_scale``) allocates one tensor, the gradient. The CPU's ``dropout``
instead keeps a mask in the input's dtype (``_dropout_impl``: ``empty_like(input).bernoulli_``),
2× the bytes in fp16, 4× in fp32. Every other case (in-place, p = 0 or 1, evaluation,
feature and alpha dropout) runs the same code on both and is left alone.

The CPU's ``native_dropout`` kernel also returns a bool mask, but makes it through a
mask in the input's dtype first; :func:`fused_dropout` therefore computes the values
inside :func:`memfit.cuda.counting.not_counted` and allocates only CUDA's tensors, and
reports the two kernels CUDA runs (:mod:`memfit.cuda.kernels`): ``native_dropout`` reads
the input and writes the output and the mask; ``native_dropout_backward`` reads the
gradient and the mask and writes the input's gradient. Neither computes a product.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.cuda.counting import fill, not_counted
from memfit.cuda.kernels import Kernel, moved_bytes, report, reporting

__all__ = ["fused_dropout", "takes_fused_kernel"]


def takes_fused_kernel(tensor: torch.Tensor, p: float, train: bool) -> bool:
    """``train && is_fused_kernel_acceptable(input, p)`` for a tensor that would be on CUDA."""
    return bool(train) and 0.0 < p < 1.0 and tensor.numel() > 0


class _FusedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, p: float) -> torch.Tensor:
        with not_counted():
            values, keep = torch.native_dropout(tensor, p, True)
        out = fill(torch.empty_like(tensor), values)
        mask = fill(torch.empty_like(tensor, dtype=torch.bool), keep)
        del values, keep
        if reporting():
            report(Kernel("native_dropout", 0, moved_bytes(tensor, out, mask), tensor.dtype, "none"))
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (mask,) = ctx.saved_tensors
        grad_input = torch.empty_like(grad)
        if reporting():
            report(Kernel("native_dropout_backward", 0, moved_bytes(grad, mask, grad_input), grad.dtype, "none"))
        with not_counted():
            fill(grad_input, grad * mask * ctx.scale)
        return grad_input, None


def fused_dropout(tensor: torch.Tensor, p: float) -> torch.Tensor:
    """Training dropout through CUDA's fused kernel: output and bool mask, one-tensor backward.

    Args:
        tensor: the input (any floating dtype).
        p: the probability of zeroing an element, 0 < p < 1.
    """
    result: torch.Tensor = _FusedDropout.apply(tensor, p)
    return result
