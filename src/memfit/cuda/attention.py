"""``scaled_dot_product_attention`` as CUDA runs it: its kernel's allocations, the CPU's arithmetic.

:func:`scaled_dot_product_attention` takes the call ``torch.nn.functional.scaled_dot_product_attention``
received, asks :mod:`memfit.cuda.sdpa_choice` which kernel CUDA would run, and then:

- **math**: the same composite CUDA runs (``aten::_scaled_dot_product_attention_math``,
  which is device independent; its dropout goes through :mod:`memfit.cuda.dropout`);
- **flash**, **efficient**, **cudnn**: a :class:`torch.autograd.Function` whose forward
  allocates what the CUDA kernel allocates and keeps what its autograd formula saves, and
  whose backward allocates the kernel's gradients and documented temporaries. The values
  are computed by CPU kernels inside :func:`memfit.cuda.counting.not_counted` (in fp32,
  as the fused kernels accumulate), then copied into the counted tensors. With dropout,
  the keep-mask is drawn from the default generator in forward and drawn again from the
  saved generator state in backward, so backward sees the same mask.

What each kernel allocates (sources under aten/src/ATen/native/transformers/ at pytorch
commit 001f694 unless said otherwise; shapes agree with ``torch/_meta_registrations.py``):

==========  ===========================================  ==================================================
backend     forward: kept for backward                   backward: allocated
==========  ===========================================  ==================================================
flash       output (B, L, H, D) laid out by              contiguous grad_out if needed, dq/dk/dv like q/k/v
            ``empty_like(q.transpose(1, 2))``;           (B, L, H, D); softmax_d (B, H, L↑128) fp32;
            logsumexp (B, H, L) fp32; rng_state          dq_accum (B, L↑128, H, D↑32 or ↑64) fp32; with
            2×uint64 and an unused uint64 on the GPU     GQA, dk/dv expanded to H heads
            (cuda/flash_attn/flash_api.cpp ``mha_fwd``)  (``mha_bwd``; cuda/attention_backward.cu)
efficient   output (B, L, H, Dv) contiguous; for         contiguous grad_out if needed; grad_q/k/v
            Dv > 128 in half precision a transient fp32  (B, L, H, ·) contiguous; grad_bias (…, S↑16) when
            accumulator (B, L, H, Dv); logsumexp         the bias requires grad; delta (B, H, L) fp32
            (B, H, L↑32) fp32 when inputs require grad;  (``_efficient_attention_backward``)
            seed/offset on the CPU (cuda/attention.cu)
cudnn       output laid out like the query; softmax      dq/dk/dv ``empty_like`` q/k/v; grad_out copied to
            stats (B, H, L, 1) fp32; seed and offset     the output's layout if it differs
            (1 int64 each) with dropout                  (``_cudnn_attention_backward``)
==========  ===========================================  ==================================================

Not modelled: the memory-efficient backward's and cuDNN's workspaces (sized by the
kernel template or cuDNN frontend chosen on the GPU) and flash's split-KV accumulators
(dropout-free forward with few (batch × heads × 64-row blocks) per multiprocessor).

For the step time, a fused call reports the one kernel CUDA runs in forward and the one
in backward (:mod:`memfit.cuda.kernels`): FLOPs by PyTorch's flop-counter formula for
``_scaled_dot_product_{flash,efficient,cudnn}_attention`` and their ``_backward`` (the
formulas count causal calls as full ones), bytes of its inputs, outputs and temporaries
once each (a temporary twice: written, then read); the CPU's arithmetic is not timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memfit.cuda.counting import fill, has_values, not_counted
from memfit.cuda.kernels import Kernel, formula_flops, moved_bytes, report, reporting
from memfit.cuda.sdpa_choice import Backend, choose_backend
from memfit.cuda.target import CudaTarget

__all__ = ["scaled_dot_product_attention", "attention_values", "keep_mask", "saved_bytes", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (the kernels' padding)."""
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class _Call:
    """One fused-kernel call: what the Function needs besides its tensors."""

    backend: Backend
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    compute_lse: bool


# -- values: the CPU computes what the kernel computes ---------------------------------


def keep_mask(shape: tuple[int, ...], dropout_p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """The dropout keep-mask of an attention call: True where a probability is kept.

    Drawn with ``torch.rand`` so that a generator set to the same state draws it again.
    """
    return torch.rand(shape, generator=generator) >= dropout_p


def attention_values(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    enable_gqa: bool = False,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) (· keep / (1 − p)) v, in fp32, returned in the query's dtype.

    Args:
        query: (B, H, L, E).
        key: (B, H_kv, S, E).
        value: (B, H_kv, S, E_v).
        bias: an additive mask broadcastable to (B, H, L, S), or None.
        is_causal: mask out keys after each query (top-left aligned, as PyTorch does).
        scale: the factor on q kᵀ.
        enable_gqa: repeat key and value heads to the query's.
        keep: the dropout keep-mask, or None for no dropout.
        dropout_p: the dropout probability (kept values are scaled by 1 / (1 − p)).
    """
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        allowed = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if bias is not None:
        scores = scores + bias.float()
    probs = scores.softmax(-1)
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    return (probs @ v).to(query.dtype)


# -- the fused kernels -------------------------------------------------------------------

#: the ATen operation each fused backend is on CUDA (its backward adds ``_backward``)
_KERNEL_NAMES: dict[str, str] = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}


def _report_forward(call: _Call, tensors: list[torch.Tensor | None]) -> None:
    """The forward kernel CUDA runs: q, k, v (and the bias) read; output and extras written."""
    query, key, value = tensors[:3]
    assert query is not None and key is not None and value is not None
    name = _KERNEL_NAMES[call.backend]
    flops = formula_flops(name, query, key, value)
    report(Kernel(name, flops, moved_bytes(*tensors), query.dtype, "matmul"))


def _report_backward(call: _Call, tensors: list[torch.Tensor | None], temps: list[torch.Tensor]) -> None:
    """The backward kernel: saved tensors and grad_out read, gradients written, temporaries both."""
    grad_out, query, key, value = tensors[:4]
    assert grad_out is not None and query is not None and key is not None and value is not None
    name = _KERNEL_NAMES[call.backend] + "_backward"
    flops = formula_flops(name, grad_out, query, key, value)
    nbytes = moved_bytes(*tensors) + 2 * moved_bytes(*temps)
    report(Kernel(name, flops, nbytes, query.dtype, "matmul"))


def _output(backend: Backend, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output tensor, laid out as the kernel writes it."""
    b, h, lq = q.size(0), q.size(1), q.size(2)
    if backend == "flash":
        return torch.empty_like(q.transpose(1, 2)).transpose(1, 2)  # mha_fwd: empty_like(q_padded)
    if backend == "efficient":
        return torch.empty(b, lq, h, v.size(-1), dtype=q.dtype, device=q.device).transpose(1, 2)
    # cudnn: alloc_with_matching_layout(query, (B, H, L, Dv))
    shape = (b, h, lq, v.size(-1))
    if tuple(q.shape) == shape:
        return torch.empty_like(q)
    order = sorted(range(4), key=lambda i: q.stride(i), reverse=True)
    return torch.empty_permuted(shape, order, dtype=q.dtype, device=q.device)


def _forward_extras(call: _Call, q: torch.Tensor, v: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(kept for backward, transient) tensors the kernel allocates besides its output."""
    b, h, lq, device = q.size(0), q.size(1), q.size(2), q.device
    kept: list[torch.Tensor] = []
    transient: list[torch.Tensor] = []
    if call.backend == "flash":
        kept.append(torch.empty(b, h, lq, dtype=torch.float32, device=device))  # softmax_lse
        kept.append(torch.empty(2, dtype=torch.uint64, device=device))  # rng_state
        kept.append(torch.empty((), dtype=torch.uint64, device=device))  # _unused (philox offset)
    elif call.backend == "efficient":
        if max(q.size(-1), v.size(-1)) > 128 and q.dtype != torch.float32:
            # kNeedsOutputAccumulatorBuffer: the kMaxK=65536 kernel in half precision
            transient.append(torch.empty(b, lq, h, v.size(-1), dtype=torch.float32, device=device))
        lse_len = round_up(lq, 32) if call.compute_lse else 0  # kAlignLSE = 32
        kept.append(torch.empty(b, h, lse_len, dtype=torch.float32, device=device))
    else:  # cudnn
        if call.compute_lse:
            kept.append(torch.empty(b, h, lq, 1, dtype=torch.float32, device=device))
        if call.dropout_p > 0.0:
            kept.append(torch.empty(1, dtype=torch.int64, device=device))  # seed
            kept.append(torch.empty(1, dtype=torch.int64, device=device))  # offset
    return kept, transient


def _flash_backward_temporaries(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """softmax_d and dq_accum of ``mha_bwd`` (non-deterministic), and GQA's expanded dk/dv."""
    b, h, lq, d = q.size(0), q.size(1), q.size(2), q.size(3)
    lq_rounded = round_up(lq, 128)
    d_rounded = round_up(d, 32 if d <= 128 else 64)
    temps = [
        torch.empty(b, h, lq_rounded, dtype=torch.float32, device=q.device),
        torch.empty(b, lq_rounded, h, d_rounded, dtype=torch.float32, device=q.device),
    ]
    if k.size(1) != h:
        temps += [torch.empty(b, k.size(2), h, d, dtype=q.dtype, device=q.device) for _ in range(2)]
    return temps


class _FusedAttention(torch.autograd.Function):
    """A fused CUDA attention kernel: CUDA's allocations, CPU arithmetic (see the module)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: torch.Tensor | None,
        call: _Call,
    ) -> torch.Tensor:
        rng_state = None
        values = None
        if has_values(query):
            with not_counted():
                rng_state = torch.get_rng_state() if call.dropout_p > 0.0 else None
                keep = _keep_for(query, key, call) if call.dropout_p > 0.0 else None
                values = attention_values(
                    query, key, value, bias, is_causal=call.is_causal, scale=call.scale,
                    enable_gqa=call.enable_gqa, keep=keep, dropout_p=call.dropout_p,
                )  # fmt: skip
                del keep
        else:
            _check_shapes(query, key, value, bias, call.enable_gqa)  # what the computation would refuse
        out = _output(call.backend, query, value)
        if values is not None:
            fill(out, values)
        del values
        kept, transient = _forward_extras(call, query, value)
        if reporting():
            _report_forward(call, [query, key, value, bias, out, *kept, *transient])
        del transient  # freed when the kernel returns
        ctx.call, ctx.rng_state = call, rng_state
        ctx.has_bias = bias is not None
        ctx.save_for_backward(query, key, value, bias, out, *kept)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        saved = ctx.saved_tensors  # read once: checkpointing's saved tensors unpack only once
        query, key, value, bias, out = saved[:5]
        needs = ctx.needs_input_grad
        temps: list[torch.Tensor] = []
        if call.backend in ("flash", "efficient"):
            if not grad_out.transpose(1, 2).is_contiguous():  # grad_out(_t).contiguous()
                temps.append(torch.empty_like(grad_out.transpose(1, 2), memory_format=torch.contiguous_format))
        elif grad_out.stride() != out.stride():  # cudnn: dO permuted to the output's layout
            temps.append(torch.empty_like(out))
        if call.backend == "flash":
            grads = [torch.empty_like(t.transpose(1, 2)).transpose(1, 2) for t in (query, key, value)]
            temps += _flash_backward_temporaries(query, key)
        elif call.backend == "efficient":
            grads = [
                torch.empty(t.transpose(1, 2).shape, dtype=t.dtype, device=t.device).transpose(1, 2)
                for t in (query, key, value)
            ]
        else:
            grads = [torch.empty_like(t) for t in (query, key, value)]
        grad_bias = None
        if ctx.has_bias and needs[3] and call.backend == "efficient":
            padded = [*bias.shape[:-1], round_up(bias.size(-1), 16)]
            grad_bias = torch.empty(padded, dtype=bias.dtype, device=bias.device)[..., : bias.size(-1)]
        if call.backend == "efficient":
            temps.append(
                torch.empty(query.size(0), query.size(1), query.size(2), dtype=torch.float32, device=query.device)
            )
        if reporting():
            lse = saved[5:6]  # flash, efficient: logsumexp; cudnn: its stats (or nothing)
            _report_backward(call, [grad_out, query, key, value, bias, out, *lse, *grads, grad_bias], temps)
        if has_values(grad_out):
            with not_counted():
                computed = _recompute_gradients(ctx, query, key, value, bias, grad_out)
            for target, value_ in zip([*grads, grad_bias], computed, strict=True):
                if target is not None and value_ is not None:
                    fill(target, value_)
            del computed
        del temps
        return (
            grads[0] if needs[0] else None,
            grads[1] if needs[1] else None,
            grads[2] if needs[2] else None,
            grad_bias,
            None,
        )


def _check_shapes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None, enable_gqa: bool
) -> None:
    """Refuse, as the computation would, shapes that do not make an attention (fake tensors: no computation)."""
    q_heads, k_heads = query.size(-3), key.size(-3)
    heads_ok = q_heads == k_heads or (enable_gqa and k_heads and q_heads % k_heads == 0)
    if query.size(-1) != key.size(-1) or key.size(-2) != value.size(-2) or key.size(-3) != value.size(-3):
        raise RuntimeError(
            f"scaled_dot_product_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and "
            f"value {tuple(value.shape)} do not make an attention"
        )
    if not heads_ok:
        raise RuntimeError(f"scaled_dot_product_attention: {q_heads} query heads, {k_heads} key/value heads")
    if bias is not None:
        torch.broadcast_shapes(bias.shape, (*query.shape[:-1], key.size(-2)))


def _keep_for(
    query: torch.Tensor, key: torch.Tensor, call: _Call, generator: torch.Generator | None = None
) -> torch.Tensor:
    shape = (query.size(0), query.size(1), query.size(2), key.size(2))
    return keep_mask(shape, call.dropout_p, generator)


def _recompute_gradients(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    grad_out: torch.Tensor,
) -> list[torch.Tensor | None]:
    """The gradients, by autograd through :func:`attention_values` with the forward's keep-mask."""
    call: _Call = ctx.call
    keep = None
    if ctx.rng_state is not None:
        generator = torch.Generator()
        generator.set_state(ctx.rng_state)
        keep = _keep_for(query, key, call, generator)
    inputs = [t.detach().requires_grad_(True) if t is not None else None for t in (query, key, value, bias)]
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        result = attention_values(
            inputs[0], inputs[1], inputs[2], inputs[3], is_causal=call.is_causal, scale=call.scale,  # type: ignore[arg-type]
            enable_gqa=call.enable_gqa, keep=keep, dropout_p=call.dropout_p,
        )  # fmt: skip
        wanted = [t for t in inputs if t is not None]
        grads = torch.autograd.grad(result, wanted, grad_out, allow_unused=True)
    found = iter(grads)
    return [next(found) if t is not None else None for t in inputs]


# -- the entry point ------------------------------------------------------------------


def _convert_boolean_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask becomes 0 / −inf in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _pad_last_dim(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    """``pad_last_dim<alignment, false>``: zero-pad the last dimension to a multiple (a copy)."""
    size = tensor.size(-1)
    if size % alignment == 0:
        return tensor
    return F.pad(tensor, (0, alignment - size % alignment))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` of the efficient kernel: expand, pad the last dim to 16, align strides."""
    mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    size = mask.size(-1)
    if size % 16:
        return F.pad(mask, (0, 16 - size % 16))[..., :size]  # pad_bias<16>
    if mask.stride(0) % 16 or mask.stride(1) % 16 or mask.stride(2) % 16:
        return mask.contiguous()
    return mask


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    target: CudaTarget,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with CUDA's kernel choice and memory.

    Args:
        query: (B, H, L, E).
        key: (B, H_kv, S, E).
        value: (B, H_kv, S, E_v).
        attn_mask: boolean (True: take part) or additive mask broadcastable to (B, H, L, S).
        dropout_p: dropout probability on the attention weights.
        is_causal: causal masking (no ``attn_mask`` then).
        scale: the factor on q kᵀ (default 1/√E).
        enable_gqa: grouped-query attention.
        target: the CUDA GPU whose kernels are emulated.
    """
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    backend = choose_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, target)
    mask = _convert_boolean_mask(attn_mask, query.dtype)
    if backend == "math" or query.dim() != 4:
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]
    compute_lse = (query.requires_grad or key.requires_grad or value.requires_grad) and torch.is_grad_enabled()
    og_scale = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    call = _Call(backend, float(dropout_p), bool(is_causal), og_scale, bool(enable_gqa), compute_lse)
    if backend == "flash":
        size = query.size(-1)
        padded = [_pad_last_dim(t, 8) for t in (query, key, value)]
        out = _FusedAttention.apply(padded[0], padded[1], padded[2], None, call)
        return out[..., :size] if out.size(-1) != size else out  # post_process_flash_output
    if backend == "efficient" and mask is not None:
        mask = _preprocess_mask(mask, query, key)
    return _FusedAttention.apply(query, key, value, mask, call)


def saved_bytes(
    backend: Backend,
    batch: int,
    heads: int,
    seq_q: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    requires_grad: bool = True,
    dropout: bool = False,
) -> int:
    """Bytes a fused kernel's forward allocates and keeps for backward besides its inputs.

    For a self-attention call with (B, H, L, D) query, key and value (head_dim a multiple
    of 8): the output, the log-sum-exp and the random-number state.

    >>> saved_bytes("flash", 1, 1, 1024, 64, torch.bfloat16)  # out + lse + rng_state + offset
    135192
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = batch * heads * seq_q * head_dim * itemsize
    if backend == "flash":
        return out + batch * heads * seq_q * 4 + 16 + 8
    if backend == "efficient":
        return out + (batch * heads * round_up(seq_q, 32) * 4 if requires_grad else 0)
    if backend == "cudnn":
        return out + (batch * heads * seq_q * 4 if requires_grad else 0) + (16 if dropout else 0)
    raise ValueError(f"saved_bytes is for the fused kernels, not {backend!r}")
