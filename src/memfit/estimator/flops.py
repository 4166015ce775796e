"""FLOP formulas for the operations where ``torch.utils.flop_counter``'s are wrong.

Why: the predicted step time (:mod:`memfit.estimator.timing`) divides each product's
FLOPs by a rate, so a formula that counts 16 times the work predicts a kernel 16 times too
slow. PyTorch's ``conv_backward_flop`` counts the weight gradient as a dense convolution
of the input with the output gradient, whatever ``groups`` is: a convolution of ``g``
groups does ``g`` times fewer multiply-adds there, as in its forward and its input
gradient (which PyTorch counts right, from the weight's shape ``[C_out, C_in / g, k...]``).
For a 3x3 convolution of 32 groups PyTorch's backward is (1 + 32) / 2 = 16.5 times the
true count; for a depthwise one of 96 channels (1 + 96) / 2 = 48.5 times.

The hand count, for a convolution (or a transposed one) of weight ``w`` (shape ``[C_out,
C_in / g, k...]``, or ``[C_in, C_out / g, k...]`` transposed) over a batch of ``N``:
every output element of the forward is a sum of ``(C_in / g) x prod(k)`` products, so the
forward is ``2 x N x prod(spatial) x prod(w.shape)`` FLOPs, where ``spatial`` is the output's
size (the input's for a transposed convolution, whose products run per input element).
The input gradient is the same products run backwards (a transposed convolution with the
same weight), and the weight gradient the same products summed over the batch: each is
one forward's FLOPs. Like PyTorch's forward, padding is not subtracted (products with the
padded zeros are counted: cuDNN's implicit-GEMM kernels run them too).

>>> conv_backward_flops([8, 256, 14, 14], [8, 256, 14, 14], [256, 8, 3, 3], None, [1, 1], [1, 1], [1, 1],
...                     False, [0, 0], 32, [True, True, False])  # 2 x forward
115605504
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["conv_forward_flops", "conv_backward_flops"]


def _shape(value: Any) -> list[int]:
    """A tensor's shape, or a shape given as such."""
    return [int(d) for d in (value.shape if hasattr(value, "shape") else value)]


def conv_forward_flops(
    x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool
) -> int:
    """FLOPs of one convolution's forward (see the module), groups included by the weight's shape.

    Args:
        x_shape: the input's shape ``[N, C_in, spatial...]``.
        w_shape: the weight's shape.
        out_shape: the output's shape ``[N, C_out, spatial...]``.
        transposed: a transposed convolution (its products run per input element).
    """
    spatial = (x_shape if transposed else out_shape)[2:]
    return 2 * int(x_shape[0]) * math.prod(spatial) * math.prod(w_shape)


def conv_backward_flops(
    grad_out: Any,
    x: Any,
    weight: Any,
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: int,
    output_mask: Sequence[bool],
    *args: Any,
    **kwargs: Any,
) -> int:
    """FLOPs of ``aten.convolution_backward``: one forward's for each gradient asked for
    (``output_mask``: input, weight; the bias's is a reduction, no product).

    Args:
        grad_out: the output's gradient (a tensor or its shape).
        x: the forward's input.
        weight: the weight (``[C_out, C_in / groups, k...]``): the groups are in its shape.
        transposed: a transposed convolution.
        output_mask: which of (input, weight, bias) gradients are computed.
    """
    x_shape, w_shape, g_shape = _shape(x), _shape(weight), _shape(grad_out)
    forward = conv_forward_flops(x_shape, w_shape, g_shape, transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))
