"""Which kernel CUDA's ``scaled_dot_product_attention`` picks: flash, memory-efficient, cuDNN or math.

PyTorch's own rules, in Python, for a CUDA target (CPU tensors are judged as if they lived
on it). Sources: ``aten/src/ATen/native/transformers/sdp_utils_cpp.h`` of the installed
torch (its headers ship with the wheel: ``torch/include/ATen/native/transformers/``) for
the shared checks, and ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(``can_use_flash_attention``, ``can_use_mem_efficient_attention``,
``can_use_cudnn_attention``, ``select_sdp_backend``; read at pytorch commit 001f694) for
the CUDA ones. The user's ``torch.nn.attention.sdpa_kernel`` / ``torch.backends.cuda.*_sdp_enabled``
settings and priority order are the global context's, which a CPU-only build keeps too.

>>> import torch
>>> q = torch.empty(2, 4, 128, 64, dtype=torch.bfloat16, requires_grad=True)
>>> choose_backend(q, q, q, None, 0.1, True, False, CudaTarget())
'flash'
>>> choose_backend(q.float(), q.float(), q.float(), None, 0.1, True, False, CudaTarget())
'efficient'
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from memfit.cuda.target import CudaTarget

__all__ = ["Backend", "choose_backend", "NoAttentionKernel", "cudnn_version"]

Backend = Literal["flash", "efficient", "cudnn", "math"]

# at::SDPBackend's values (aten/src/ATen/Context.h): the priority order is kept as these ints
_BY_VALUE: dict[int, Backend] = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
_DEFAULT_ORDER = [1, 2, 0, 3, 4]  # at::Context's default: flash, efficient, math, cudnn, overrideable


class NoAttentionKernel(RuntimeError):
    """No backend may run this call (CUDA raises "No available kernel. Aborting execution.")."""


def cudnn_version(target: CudaTarget) -> int:
    """The cuDNN runtime version (cuDNN's ``CUDNN_VERSION`` encoding) a target's torch wheel ships.

    Source: the comment in ``check_prefer_cudnn_attention`` (sdp_utils.cpp): "cuDNN 9.15.1
    required ..., CUDA <= 12.9 wheels ship with older cuDNN" (pytorch#169849): CUDA 12 wheels
    are taken as cuDNN 9.10.2 (``nvidia-cudnn-cu12==9.10.2.21``, the pin of torch 2.8-2.9's
    cu12x wheels), CUDA 13 wheels as 9.15.1.
    """
    return 91002 if target.cuda_version[0] < 13 else 91501


def _priority(target: CudaTarget) -> list[Backend]:
    order = list(torch._C._get_sdp_priority_order())
    if order == _DEFAULT_ORDER and target.prefers_cudnn_attention:
        order = [3, 1, 2, 0]  # priority_order(): cuDNN first on sm90/sm10x with a new cuDNN
    return [_BY_VALUE[value] for value in order if value in _BY_VALUE]


def _enabled(backend: Backend) -> bool:
    backends = torch.backends.cuda
    return {
        "flash": backends.flash_sdp_enabled,
        "efficient": backends.mem_efficient_sdp_enabled,
        "cudnn": backends.cudnn_sdp_enabled,
        "math": backends.math_sdp_enabled,
    }[backend]()


def _sm_in(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= capability <= high


def _requires_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``input_requires_grad``: an input requires grad and grad mode is on."""
    return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()


def _batch_and_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """``check_batch_size_and_num_heads_dense<supports_gqa=true>`` (all three CUDA backends support GQA)."""
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    qh, kh, vh = q.size(-3), k.size(-3), v.size(-3)
    if enable_gqa:
        return kh == vh and qh % kh == 0
    return qh == kh == vh


def _dense_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, ignore_1: bool) -> bool:
    """``check_nonzero_sequence_lengths_dense`` and ``check_last_dim_stride_equals_1_dense``."""
    if q.size(-2) == 0 or k.size(-2) == 0:
        return False
    strides_ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_1:
        strides_ok = strides_ok or q.size(-1) == 1
    # a GPU backend needs the mask's last dimension contiguous (the CPU's does not)
    return strides_ok and (mask is None or mask.stride(-1) == 1)


class _Call(NamedTuple):
    """One ``scaled_dot_product_attention`` call's arguments, as each backend's check reads them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    enable_gqa: bool


def _can_use_flash(call: _Call, target: CudaTarget) -> bool:
    q, k, v, mask, dropout_p, is_causal, enable_gqa = call
    if not _enabled("flash") or q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or mask is not None:
        return False
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1) and d <= 256):  # check_head_dim_size_flash
        return False
    cap = target.capability
    if not _sm_in(cap, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    sm86_89_or_120 = _sm_in(cap, (8, 6), (8, 9)) or _sm_in(cap, (12, 0), (12, 1))
    if _requires_grad(q, k, v) and sm86_89_or_120 and not (d <= 192 or (dropout_p == 0.0 and d > 224)):
        return False
    if is_causal and q.size(-2) != k.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)):
        return False  # check_dtypes_flash_attention (sm80+: fp16, bf16)
    return _batch_and_heads(q, k, v, enable_gqa) and _dense_common(q, k, v, None, ignore_1=True)


def gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """``minimum_gemm_alignment``: elements the mem-efficient kernel's head dims must divide by."""
    is_half = dtype in (torch.float16, torch.bfloat16)
    major = capability[0]
    use_tensor_cores = major >= 8 or (major >= 7 and is_half)
    alignment = 4 if major >= 8 else 1
    if use_tensor_cores:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def _can_use_efficient(call: _Call, target: CudaTarget) -> bool:
    q, k, v, mask, enable_gqa = call.q, call.k, call.v, call.mask, call.enable_gqa
    cap = target.capability
    if not _enabled("efficient") or not _sm_in(cap, (5, 0), (12, 1)):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    align = gemm_alignment(q.dtype, cap)
    dq, dv = q.size(-1), v.size(-1)
    if not (dq == k.size(-1) and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False  # check_head_dim_size_mem_efficient
    if cap[0] >= 8:  # check_data_ptr_alignment_mem_efficient: storage offsets aligned
        for t in (q, k, v):
            if t.numel() and (t.storage_offset() * t.element_size()) % (align * t.element_size()):
                return False
    if not (_dense_common(q, k, v, mask, ignore_1=False) and _batch_and_heads(q, k, v, enable_gqa)):
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cap[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype == k.dtype == v.dtype and q.dtype in allowed


def _mask_shape_ok(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """``check_attn_mask_shape`` (cuDNN): no mask that requires grad; 2-D or broadcastable 4-D."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.size(-2) not in (q.size(2), 1) or mask.size(-1) not in (k.size(2), 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1))


def _can_use_cudnn(call: _Call, target: CudaTarget) -> bool:
    q, k, v, mask, dropout_p, _causal, enable_gqa = call
    version = cudnn_version(target)
    if dropout_p > 0.0 and 91100 < version < 91400:
        return False
    if not _enabled("cudnn") or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    cap = target.capability
    if not _mask_shape_ok(q, k, mask) or not _sm_in(cap, (8, 0), (12, 1)):
        return False
    if dropout_p * 16.0 != int(dropout_p * 16.0):  # check_cudnn_dropout: multiples of 1/16
        return False
    if not (_dense_common(q, k, v, mask, ignore_1=True) and _batch_and_heads(q, k, v, enable_gqa)):
        return False
    # check_cudnn_tensor_shapes
    b, h, s_q, d_qk = q.size(0), q.size(1), q.size(2), q.size(3)
    s_k, d_v = k.size(2), v.size(3)
    if b > 65535 or h > 65535:
        return False
    sm90_or_10x = cap == (9, 0) or cap[0] == 10
    limit = 128
    if sm90_or_10x and version >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or s_k == 1:
        return False
    return not (dropout_p != 0.0 and s_q == 1)


def choose_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    target: CudaTarget,
) -> Backend:
    """The backend ``select_sdp_backend`` would pick for this call on ``target``.

    Args:
        query: (B, H, L, E), as given to ``scaled_dot_product_attention``.
        key: (B, H_kv, S, E).
        value: (B, H_kv, S, E_v).
        attn_mask: the mask as given (boolean or additive), or None.
        dropout_p: the dropout probability.
        is_causal: the causal flag.
        enable_gqa: grouped-query attention.
        target: the CUDA GPU and versions.

    Raises :class:`NoAttentionKernel` when every candidate is ruled out (as CUDA does).
    """
    if not any(_enabled(b) for b in ("flash", "efficient", "cudnn", "math")):
        raise NoAttentionKernel("No available kernel. Aborting execution. (every SDPA backend is disabled)")
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    for backend in _priority(target):
        if backend == "cudnn" and _can_use_cudnn(call, target):
            return "cudnn"
        if backend == "flash" and _can_use_flash(call, target):
            return "flash"
        if backend == "efficient" and _can_use_efficient(call, target):
            return "efficient"
        if backend == "math" and _enabled("math"):
            return "math"
    raise NoAttentionKernel(
        f"No available kernel. Aborting execution. (no enabled SDPA backend accepts this call on {target.describe()})"
    )
