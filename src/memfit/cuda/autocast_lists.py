"""CUDA autocast's op lists, by torch version, with their source.

Each list names ATen operators as the dispatcher does (``"conv_transpose2d.input"``; no
dot for the default overload). Sources, for torch 2.13 (git cf30153): the
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` and ``AT_FORALL_PROMOTE`` macros of
``aten/src/ATen/autocast_mode.h`` (shipped in the wheel as
``torch/include/ATen/autocast_mode.h``), which ``aten/src/ATen/autocast_mode.cpp``
registers for the ``Autocast`` (CUDA) key, plus the CUDA-only registrations there:
``cudnn_convolution``, ``cudnn_convolution_transpose`` (lower precision) and
``binary_cross_entropy`` (banned). The same build lists what it registered:
``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")`` (tests compare).

``CPU_LOWER_PRECISION`` is CPU autocast's lower-precision list (autocast_mode.cpp,
``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``): where CUDA's list agrees, the CPU's own
kernel (and its weight-cast cache) is kept.

>>> lists = for_torch((2, 13))
>>> "softmax.int" in lists.fp32_set_opt_dtype and "layer_norm" in lists.fp32
True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AutocastLists", "CUDA_AUTOCAST", "CPU_LOWER_PRECISION", "for_torch"]


@dataclass(frozen=True)
class AutocastLists:
    """One torch version's CUDA autocast policy, op by op."""

    source: str
    lower_precision: frozenset[str]
    fp32: frozenset[str]
    fp32_set_opt_dtype: frozenset[str]
    fp32_append_dtype: frozenset[str]
    promote: frozenset[str]
    banned: frozenset[str]

    def all_ops(self) -> frozenset[str]:
        return (
            self.lower_precision
            | self.fp32
            | self.fp32_set_opt_dtype
            | self.fp32_append_dtype
            | self.promote
            | self.banned
        )


_TORCH_2_13 = AutocastLists(
    source="torch 2.13 (cf30153): aten/src/ATen/autocast_mode.h AT_FORALL_* and autocast_mode.cpp",
    lower_precision=frozenset(
        [
            "_convolution.deprecated",
            "_convolution",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_tbc",
            "conv_transpose1d",
            "conv_transpose2d.input",
            "conv_transpose3d.input",
            "convolution",
            "prelu",
            "addmm",
            "addmv",
            "addr",
            "matmul",
            "einsum",
            "mm",
            "mv",
            "linalg_vecdot",
            "linear",
            "addbmm",
            "baddbmm",
            "bmm",
            "chain_matmul",
            "linalg_multi_dot",
            "_thnn_fused_lstm_cell",
            "_thnn_fused_gru_cell",
            "lstm_cell",
            "gru_cell",
            "rnn_tanh_cell",
            "rnn_relu_cell",
            "_scaled_dot_product_flash_attention",
            "scaled_dot_product_attention",
            "cudnn_convolution",
            "cudnn_convolution_transpose",
        ]
    ),
    fp32=frozenset(
        [
            "acos",
            "asin",
            "cosh",
            "erfinv",
            "exp",
            "expm1",
            "log",
            "log10",
            "log2",
            "log1p",
            "reciprocal",
            "rsqrt",
            "sinh",
            "tan",
            "pow.Tensor_Scalar",
            "pow.Tensor_Tensor",
            "pow.Scalar",
            "softplus",
            "layer_norm",
            "native_layer_norm",
            "rms_norm",
            "group_norm",
            "frobenius_norm.dim",
            "nuclear_norm",
            "nuclear_norm.dim",
            "cosine_similarity",
            "poisson_nll_loss",
            "cosine_embedding_loss",
            "nll_loss",
            "nll_loss2d",
            "hinge_embedding_loss",
            "kl_div",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "mse_loss",
            "margin_ranking_loss",
            "multilabel_margin_loss",
            "soft_margin_loss",
            "triplet_margin_loss",
            "multi_margin_loss",
            "binary_cross_entropy_with_logits",
            "dist",
            "pdist",
            "cdist",
            "renorm",
            "logsumexp",
            "upsample_nearest1d",
            "_upsample_nearest_exact1d",
            "upsample_nearest2d",
            "_upsample_nearest_exact2d",
            "upsample_nearest3d",
            "_upsample_nearest_exact3d",
            "upsample_linear1d",
            "upsample_bilinear2d",
            "_upsample_bilinear2d_aa",
            "upsample_trilinear3d",
            "upsample_bicubic2d",
            "_upsample_bicubic2d_aa",
        ]
    ),
    fp32_set_opt_dtype=frozenset(
        [
            "prod",
            "prod.dim_int",
            "softmax.int",
            "log_softmax.int",
            "cumprod",
            "cumsum",
            "linalg_vector_norm",
            "linalg_matrix_norm",
            "linalg_matrix_norm.str_ord",
            "sum",
            "sum.dim_IntList",
        ]
    ),
    fp32_append_dtype=frozenset({"norm.Scalar", "norm.ScalarOpt_dim"}),
    promote=frozenset(
        [
            "addcdiv",
            "addcmul",
            "atan2",
            "bilinear",
            "cross",
            "dot",
            "vdot",
            "grid_sampler",
            "index_put",
            "tensordot",
            "scatter_add",
        ]
    ),
    banned=frozenset({"binary_cross_entropy"}),
)

#: CUDA autocast's lists by (major, minor) torch version
CUDA_AUTOCAST: dict[tuple[int, int], AutocastLists] = {(2, 13): _TORCH_2_13}

#: CPU autocast's lower-precision ops (autocast_mode.cpp, AutocastCPU), where both devices cast the same way
CPU_LOWER_PRECISION: frozenset[str] = frozenset(
    [
        "conv1d",
        "conv1d.padding",
        "conv2d",
        "conv2d.padding",
        "conv3d",
        "conv3d.padding",
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "addbmm",
        "linear",
        "_convolution.deprecated",
        "matmul",
        "conv_tbc",
        "mkldnn_rnn_layer",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "prelu",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
    ]
)


def for_torch(version: tuple[int, int]) -> AutocastLists:
    """The lists of ``version``, else of the newest known version before it.

    Args:
        version: the torch (major, minor) in use.

    Raises ``LookupError`` when the table holds no version at or before it.
    """
    known = sorted(v for v in CUDA_AUTOCAST if v <= version)
    if not known:
        raise LookupError(
            f"no CUDA autocast lists for torch {version[0]}.{version[1]} (known: {sorted(CUDA_AUTOCAST)})"
        )
    return CUDA_AUTOCAST[known[-1]]
