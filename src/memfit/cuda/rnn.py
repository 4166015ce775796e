"""LSTM, GRU and RNN as CUDA runs them: one cuDNN call per module, its outputs and reserve space.

On CUDA, ``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` send a cuDNN-acceptable input
to ``_cudnn_rnn`` (aten/src/ATen/native/RNN.cpp ``lstm_cudnn_stub``; aten/src/ATen/native/
cudnn/RNN.cpp ``_cudnn_rnn``), which allocates the output, hy (and cy), a byte
**reserve space** kept for backward, and a transient workspace; with ``batch_first`` it
also makes a transient time-major contiguous copy of the input. Its autograd formula keeps
input, weights, hx, cx, output, the flat weight buffer and the reserve. Backward
(``_cudnn_rnn_backward``) allocates dx, dhx, dcx and one flat, zeroed dw buffer of which
each weight's gradient is a view (plus time-major copies of x, y and dy with
``batch_first``). The CPU instead runs the native per-step implementation, which keeps
every step's gates and states as separate tensors.

Under autocast, CUDA's ``_cudnn_rnn`` is cast by ``_cudnn_rnn_cast_reflatten``
(aten/src/ATen/cudnn/AutocastRNN.cpp): input, hx and cx to **fp16** (whatever the autocast
dtype), and the weights copied into a new fp16 flat buffer, autograd-exposed.

Assumed (as ``nn.LSTM.cuda()`` does through ``flatten_parameters``): the module's weights
are one contiguous buffer, so the forward needs no copy of them. Not modelled: cuDNN's
workspace (transient, sized by cuDNN) and the dropout state cached once per process.
Packed sequences (``aten::lstm.data``) keep the CPU's implementation.

For the step time, the call reports the cuDNN calls CUDA makes (:mod:`memfit.cuda.kernels`),
not the CPU's per-step cells: ``_cudnn_rnn`` does, for every weight matrix W of every layer
and direction, one product of W with each step's (batch, ·) input — ``mm`` FLOPs (PyTorch's
formula) of a (steps × batch, in) by (in, out) product; its backward (``_cudnn_rnn_backward``:
cuDNN's backward-data and backward-weights) does two of each, for the inputs' and the
weights' gradients. The gates' element-wise work is small beside them and not counted in
FLOPs; bytes are the calls' inputs, outputs and reserve space once each, with
``batch_first``'s time-major copies as copy kernels of their own. The products run on
cuDNN's math type: tensor cores in fp16, tf32 in fp32 where ``torch.backends.cudnn.allow_tf32``
allows (``getCudnnMathType``, native/cudnn/RNN.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from memfit.cuda.counting import fill, has_values, not_counted
from memfit.cuda.cudnn import RNNMode, rnn_reserve_bytes
from memfit.cuda.kernels import Kernel, formula_flops, moved_bytes, report, reporting

__all__ = ["Mode", "cudnn_rnn", "reserve_bytes"]

Mode = Literal["lstm", "gru", "rnn_tanh", "rnn_relu"]

_CUDNN_MODES: dict[str, RNNMode] = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}


def reserve_bytes(
    mode: Mode,
    seq_len: int,
    batch: int,
    hidden: int,
    layers: int,
    directions: int,
    itemsize: int,
    dropout: float = 0.0,
) -> int:
    """The reserve space a training ``_cudnn_rnn`` call keeps: :func:`memfit.cuda.cudnn.rnn_reserve_bytes`.

    (cuDNN's own formula is not published; that function holds MIOpen's open one and its
    sources.)

    >>> reserve_bytes("lstm", seq_len=35, batch=20, hidden=256, layers=2, directions=1, itemsize=4)
    10035200
    """
    return rnn_reserve_bytes(
        _CUDNN_MODES[mode],
        hidden_size=hidden,
        num_layers=layers,
        seq_len=seq_len,
        batch=batch,
        dtype_bytes=itemsize,
        bidirectional=directions == 2,
        dropout=dropout,
    )


@dataclass(frozen=True)
class _Config:
    mode: Mode
    has_biases: bool
    num_layers: int
    dropout: float
    train: bool
    bidirectional: bool
    batch_first: bool


def _original(
    config: _Config, data: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """The CPU's own implementation (values only, or with autograd for the backward's recompute)."""
    op = getattr(torch.ops.aten, config.mode).input
    state: Any = hx if config.mode == "lstm" else hx[0]
    result: tuple[torch.Tensor, ...] = op.decompose(
        data, state, params, config.has_biases, config.num_layers, config.dropout,
        config.train, config.bidirectional, config.batch_first,
    )  # fmt: skip
    return result


def _forward_flops(params: list[torch.Tensor], steps: int) -> int:
    """FLOPs of a training forward: each weight matrix times every step's input (``mm``)."""
    return sum(
        formula_flops("mm", torch.Size([steps, w.size(1)]), torch.Size([w.size(1), w.size(0)]))
        for w in params
        if w.dim() == 2
    )


def _report_copies(*tensors: torch.Tensor) -> None:
    """``batch_first``'s time-major ``contiguous()`` copies: read and written once each."""
    for tensor in tensors:
        report(Kernel("copy_", 0, 2 * moved_bytes(tensor), tensor.dtype, "none"))


class _CudnnRnn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, config: _Config, n_hx: int, data: torch.Tensor, *rest: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        hx, params = list(rest[:n_hx]), list(rest[n_hx:])
        with not_counted():
            rng_state = torch.get_rng_state()
            values = _original(config, data, hx, params)
        time_major = data.transpose(0, 1) if config.batch_first else data
        seq_len, batch = time_major.size(0), time_major.size(1)
        if config.batch_first:
            copy = torch.empty(time_major.shape, dtype=data.dtype, device=data.device)  # x = input.contiguous()
        out_shape = (seq_len, batch, values[0].size(-1))
        output = torch.empty(out_shape, dtype=data.dtype, device=data.device)
        output = output.transpose(0, 1) if config.batch_first else output
        states = [torch.empty_like(h, memory_format=torch.contiguous_format) for h in hx]
        hidden = hx[-1].size(-1)  # cx holds the full hidden size (hx may be projected)
        directions = 2 if config.bidirectional else 1
        reserve = torch.empty(0, dtype=torch.uint8, device=data.device)
        if config.train:
            size = reserve_bytes(
                config.mode, seq_len, batch, hidden, config.num_layers, directions, data.element_size()
            )
            reserve = torch.empty(size, dtype=torch.uint8, device=data.device)
        if reporting():
            if config.batch_first:
                _report_copies(data)
            nbytes = moved_bytes(data, *hx, *params, output, *states, reserve)
            flops = _forward_flops(params, seq_len * batch)
            report(Kernel("_cudnn_rnn", flops, nbytes, data.dtype, "cudnn"))
        if config.batch_first:
            del copy
        fill(output, values[0])
        for state, value in zip(states, values[1:], strict=True):
            fill(state, value)
        del values
        ctx.config, ctx.n_hx, ctx.rng_state = config, n_hx, rng_state
        ctx.save_for_backward(data, *hx, *params, output, reserve)
        return (output, *states)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        config: _Config = ctx.config
        saved = ctx.saved_tensors
        data, hx = saved[0], list(saved[1 : 1 + ctx.n_hx])
        params = list(saved[1 + ctx.n_hx : -2])
        output = saved[-2]
        temps: list[torch.Tensor] = []
        if config.batch_first:  # time-major contiguous x, y and dy
            temps += [
                torch.empty(t.transpose(0, 1).shape, dtype=t.dtype, device=t.device) for t in (data, output, output)
            ]
        grad_data = torch.empty(
            data.transpose(0, 1).shape if config.batch_first else data.shape, dtype=data.dtype, device=data.device
        )
        grad_data = grad_data.transpose(0, 1) if config.batch_first else grad_data
        grad_hx = [torch.empty_like(h) for h in hx]
        total = sum(p.numel() for p in params)
        flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)  # dw = zeros_like(weight_buf)
        grad_params, offset = [], 0
        for p in params:
            grad_params.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        if reporting():
            if config.batch_first:
                _report_copies(data, output, output)
            steps = data.size(0) * data.size(1)
            read = moved_bytes(data, *hx, *params, output, saved[-1], *grads)
            written = moved_bytes(grad_data, *grad_hx, flat)
            flops = 2 * _forward_flops(params, steps)  # backward-data and backward-weights
            report(Kernel("_cudnn_rnn_backward", flops, read + written, data.dtype, "cudnn"))
        if has_values(data):
            with not_counted():
                computed = _recompute(config, ctx.rng_state, data, hx, params, grads)
            for target, value in zip([grad_data, *grad_hx, *grad_params], computed, strict=True):
                if value is not None:
                    fill(target, value)
            del computed
        del temps
        needs = ctx.needs_input_grad
        results = [grad_data, *grad_hx, *grad_params]
        return (None, None, *(g if needs[2 + i] else None for i, g in enumerate(results)))


def _recompute(
    config: _Config,
    rng_state: torch.Tensor,
    data: torch.Tensor,
    hx: list[torch.Tensor],
    params: list[torch.Tensor],
    grads: tuple[torch.Tensor | None, ...],
) -> list[torch.Tensor | None]:
    """The gradients, by autograd through the CPU implementation with the forward's random state."""
    inputs = [t.detach().requires_grad_(True) for t in (data, *hx, *params)]
    n_hx = len(hx)
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        torch.set_rng_state(rng_state)
        outputs = _original(config, inputs[0], inputs[1 : 1 + n_hx], inputs[1 + n_hx :])
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        found = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
    return list(found)


def cudnn_rnn(
    mode: Mode,
    data: torch.Tensor,
    hx: list[torch.Tensor],
    params: list[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
    *,
    autocast: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``aten::lstm`` (or gru, rnn_tanh, rnn_relu) as one emulated ``_cudnn_rnn`` call.

    Args:
        mode: which recurrence.
        data: the input, (T, B, I) or (B, T, I) with ``batch_first``.
        hx: [h0] or, for an LSTM, [h0, c0].
        params: the flat weights, as ``nn.LSTM._flat_weights``.
        has_biases: whether ``params`` holds biases.
        num_layers: stacked layers.
        dropout: dropout between layers.
        train: training mode (a reserve space is kept).
        bidirectional: two directions.
        batch_first: the input's layout.
        autocast: CUDA autocast is on: cast to fp16 and copy the weights into a flat fp16 buffer first.
    """
    if autocast and data.is_floating_point() and data.dtype != torch.float16:
        data = data.to(torch.float16)
        hx = [h.to(torch.float16) for h in hx]
        flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float16, device=data.device)
        views, offset = [], 0
        for p in params:  # copy_weights_to_flat_buf_views: autograd-exposed copies
            view = flat[offset : offset + p.numel()].view_as(p)
            view.copy_(p)
            views.append(view)
            offset += p.numel()
        params = views
    config = _Config(mode, has_biases, num_layers, float(dropout), bool(train), bool(bidirectional), bool(batch_first))
    result: tuple[torch.Tensor, ...] = _CudnnRnn.apply(config, len(hx), data, *hx, *params)
    return result
