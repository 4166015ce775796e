"""Which class of CUDA kernel an ATen operation runs (:class:`KernelClass`), and the shape
the class is timed by: a matrix product's (m, n, k, batch), a convolution's kind (dense,
grouped, depthwise) and the NCHW activation bytes cuDNN transposes for its tensor-core
kernels.

Why here and not in the timing: the class is read from the operation's arguments while
the fake step runs (the only time they exist); the card is chosen later, and the timing
(:mod:`memfit.estimator.kernel_rates`) needs only these numbers.

- Convolutions: ``groups`` is read from the call; a weight of one input channel per group
  with more than one group is depthwise, other ``groups > 1`` grouped.
- NCHW activations of a convolution: NVIDIA's "Convolutional Layers User's Guide" (section
  "Tensor Layouts In Memory: NCHW vs NHWC"): cuDNN's tensor-core kernels work on NHWC, and
  NCHW tensors are transposed in and out (one more read and write each); channels_last
  tensors need none. Recorded here as the NCHW bytes; the timing charges them where the
  convolution runs on tensor cores (16 bits, as the guide states, and tf32: an assumption).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from memfit.estimator.kernel_rates import KernelClass

__all__ = ["Classified", "classify", "NORMALIZATION", "LAYER_NORM", "SOFTMAX", "REDUCTION"]

#: PyTorch's layer norm kernels (forward and backward): their own class, for their own rate
LAYER_NORM = frozenset({"native_layer_norm", "native_layer_norm_backward"})
#: the other normalization kernels (forward and backward)
NORMALIZATION = frozenset(
    {
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
        "cudnn_batch_norm",
        "native_batch_norm_backward",
        "cudnn_batch_norm_backward",
        "batch_norm_backward",
        "native_group_norm",
        "native_group_norm_backward",
        "_fused_rms_norm",
        "_fused_rms_norm_backward",
    }
)
SOFTMAX = frozenset({"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"})
REDUCTION = frozenset(
    {
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "norm",
        "linalg_vector_norm",
        "var",
        "var_mean",
        "std",
        "std_mean",
        "prod",
        "argmax",
        "argmin",
        "any",
        "all",
        "cumsum",
        "nll_loss_forward",
        "nll_loss2d_forward",
    }
)
#: products and where their operands sit among the tensors of the call
_GEMM_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2)}
#: where ``groups`` sits among the arguments of each convolution
_GROUPS_AT = {"convolution": 8, "_convolution": 8, "convolution_backward": 9, "cudnn_convolution": 5}


class Classified(NamedTuple):
    """An operation's class and the shape it is timed by (zeros where unknown)."""

    cls: KernelClass
    m: float = 0.0
    n: float = 0.0
    k: float = 0.0
    batch: float = 0.0
    #: bytes of its NCHW activations (convolutions; transposed on tensor cores)
    nchw: float = 0.0


def _gemm(name: str, inputs: list[torch.Tensor]) -> Classified:
    at = _GEMM_OPERANDS.get(name)
    if at is None or len(inputs) <= at[1]:
        return Classified(KernelClass.GEMM)
    a, b = inputs[at[0]], inputs[at[1]]
    if a.dim() == 2 and b.dim() == 2:
        return Classified(KernelClass.GEMM, a.shape[0], b.shape[1], a.shape[1], 1)
    if a.dim() == 3 and b.dim() == 3:
        batch = a.shape[0] if name != "addbmm" else 1
        return Classified(KernelClass.GEMM, a.shape[1], b.shape[2], a.shape[2] * (a.shape[0] // batch), batch)
    return Classified(KernelClass.GEMM)


def _nchw_bytes(tensors: list[torch.Tensor]) -> float:
    """Bytes of the NCHW activations among ``tensors`` (4-D, contiguous, more than one channel)."""
    return float(
        sum(
            t.numel() * t.element_size()
            for t in tensors
            if t.dim() == 4
            and t.shape[1] > 1
            and t.is_contiguous()
            and not t.is_contiguous(memory_format=torch.channels_last)
        )
    )


def _conv(name: str, args: tuple[Any, ...], inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Classified:
    at = _GROUPS_AT.get(name)
    groups = args[at] if at is not None and len(args) > at and isinstance(args[at], int) else 1
    weight_at = 2 if name == "convolution_backward" else 1
    weight = args[weight_at] if len(args) > weight_at and isinstance(args[weight_at], torch.Tensor) else None
    if groups > 1 and weight is not None and weight.dim() >= 3 and weight.shape[1] == 1:
        cls = KernelClass.CONV_DEPTHWISE
    elif groups > 1:
        cls = KernelClass.CONV_GROUPED
    else:
        cls = KernelClass.CONV_DENSE
    activations = [t for t in (*inputs, *outputs) if t is not weight and not _is_weight_like(t, weight)]
    return Classified(cls, nchw=_nchw_bytes(activations))


def _is_weight_like(tensor: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """A tensor shaped as the weight (its gradient): not an activation."""
    return weight is not None and tensor.shape == weight.shape


def classify(
    name: str, conv: bool, args: tuple[Any, ...], inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> Classified:
    """The class of ``name`` run on ``inputs`` into ``outputs`` (a kernel that launches).

    Args:
        name: the ATen operation (its overload packet's name).
        conv: a convolution of cuDNN (the counter's kind for it).
        args: the call's positional arguments (``groups`` of a convolution).
        inputs: its tensors, in the order of the call.
        outputs: the tensors it returns.
    """
    if conv:
        return _conv(name, args, inputs, outputs)
    if name in _GEMM_OPERANDS:
        return _gemm(name, inputs)
    if "scaled_dot_product" in name:
        return Classified(KernelClass.ATTENTION)
    # before the optimizers' prefixes: _fused_rms_norm is a norm, not a fused optimizer
    if name in NORMALIZATION:
        return Classified(KernelClass.NORMALIZATION)
    if name in LAYER_NORM:
        return Classified(KernelClass.LAYER_NORM)
    if name.startswith(("_foreach_", "_fused_")):
        return Classified(KernelClass.OPTIMIZER)
    if name in SOFTMAX:
        return Classified(KernelClass.SOFTMAX)
    if name in REDUCTION:
        return Classified(KernelClass.REDUCTION)
    return Classified(KernelClass.ELEMENTWISE)
