"""The predicted step time follows the CUDA kernel, not the CPU's emulation of it: the
operation counter times the kernel each emulation of memfit.cuda reports (fused attention,
fused dropout, cuDNN RNNs) and never the CPU scratch work inside not_counted()."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

import memfit
from memfit.cuda.kernels import Kernel, observing
from memfit.cuda.target import CudaTarget
from memfit.estimator.fake import run_fake_steps
from memfit.estimator.timing import Kind, OpTrace
from memfit.memory.devices import SimDevice
from memfit.workload import Workload

A100 = CudaTarget((8, 0), (12, 8))
T4 = CudaTarget((7, 5), (12, 8))
B, H, S = 1, 2, 2048


class Attention(nn.Module):
    """q, k and v are the batch scaled element-wise: every product of the step is the attention's."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(torch.ones(head_dim)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x * self.q, x * self.k, x * self.v)


def attention_workload(head_dim: int) -> Workload:
    return Workload(
        model=lambda: Attention(head_dim),
        make_batch=lambda n: torch.randn(n, H, S, head_dim),
        loss=lambda model, x: model(x).sum(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        name="attention",
    )


def trace_of(
    workload: Workload, settings: memfit.Settings, target: CudaTarget, backend: SDPBackend | None = None
) -> OpTrace:
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        run = run_fake_steps(workload, settings, cuda=target, count_ops=True)
    assert run.ops is not None
    return run.ops


def sdpa_shapes(head_dim: int) -> tuple[int, int]:
    """PyTorch's flop-counter formulas for a fused kernel's forward and backward."""
    shape = (B, H, S, head_dim)
    return sdpa_flop_count(shape, shape, shape), sdpa_backward_flop_count(shape, shape, shape, shape)


def test_flash_attention_is_timed_as_the_flash_kernel_with_no_attention_matrix() -> None:
    trace = trace_of(attention_workload(64), memfit.Settings(micro_batch_size=B, precision="bf16"), A100)
    _kinds, flops, nbytes, _dtypes = trace.forward_backward[:4]
    forward, backward = sdpa_shapes(64)
    assert sum(flops) == forward + backward  # _scaled_dot_product_flash_attention (+ _backward)
    assert sorted(f for f in flops if f) == sorted([forward, backward])
    scores = B * H * S * S * 2  # one bf16 (B, H, S, S) tensor: flash never makes one
    assert max(nbytes) < scores / 2


def test_a_checkpointed_flash_attention_is_timed_twice_forward_and_once_backward() -> None:
    class Checkpointed(Attention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            attend = F.scaled_dot_product_attention
            return checkpoint(attend, x * self.q, x * self.k, x * self.v, use_reentrant=False)

    workload = dataclasses.replace(attention_workload(64), model=lambda: Checkpointed(64))
    trace = trace_of(workload, memfit.Settings(micro_batch_size=B, precision="bf16"), A100)
    forward, backward = sdpa_shapes(64)
    assert sum(trace.forward_backward.flops) == 2 * forward + backward  # the recompute runs the kernel again


@pytest.mark.parametrize(
    ("target", "head_dim", "precision", "backend", "why"),
    [
        (A100, 64, "bf16", SDPBackend.MATH, "the user's sdpa_kernel(MATH)"),
        (A100, 6, "fp32", None, "fp32 with a head dim the efficient kernel cannot align"),
    ],
)
def test_where_cuda_takes_the_math_path_its_matrices_are_timed(
    target: CudaTarget, head_dim: int, precision: str, backend: SDPBackend | None, why: str
) -> None:
    settings = memfit.Settings(micro_batch_size=B, precision=precision)  # type: ignore[arg-type]
    trace = trace_of(attention_workload(head_dim), settings, target, backend)
    kinds, flops, nbytes, _ = trace.forward_backward[:4]
    forward, _ = sdpa_shapes(head_dim)
    # the math path's two batched products, and twice that in backward (no recompute)
    assert sum(flops) == 3 * forward, why
    scores = B * H * S * S * 2
    big = [b for k, b in zip(kinds, nbytes) if k == Kind.KERNEL and b >= scores]
    assert len(big) >= 2, why  # softmax and its backward each move (B, H, S, S) tensors
    assert sum(nbytes) > 10 * scores


def test_a_card_without_flash_times_the_memory_efficient_kernel() -> None:
    trace = trace_of(attention_workload(64), memfit.Settings(micro_batch_size=B, precision="fp16"), T4)
    _, flops, nbytes, _ = trace.forward_backward[:4]
    forward, backward = sdpa_shapes(64)
    assert sorted(f for f in flops if f) == sorted([forward, backward])  # _efficient_attention's formulas
    assert max(nbytes) < B * H * S * S * 2 / 2


def test_the_seam_reports_each_fused_kernel_once_on_a_simulated_gpu_too() -> None:
    # real tensors on sim: the CPU computes the values, the report names CUDA's kernels
    seen: list[Kernel] = []
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with SimDevice(None, "sim:test"), observing(seen.append):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1).sum().backward()
    names = [kernel.name for kernel in seen]
    assert names == ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"]
    assert all(kernel.dtype == torch.bfloat16 and kernel.engine == "matmul" for kernel in seen)


def test_fused_dropout_is_timed_as_one_kernel_each_way_with_a_bool_mask() -> None:
    n = 1 << 18

    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x * self.w, 0.5, training=True)

    workload = Workload(
        model=Dropped,
        make_batch=lambda b: torch.randn(b, n),
        loss=lambda model, x: model(x).square().sum(),  # a full gradient reaches the dropout
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        name="dropout",
    )
    trace = trace_of(workload, memfit.Settings(micro_batch_size=1), A100)
    kinds, _, nbytes, _ = trace.forward_backward[:4]
    # native_dropout: input and output (fp32) and a 1-byte mask; its backward: gradient in
    # and out and the mask. The CPU's dropout (an fp32 mask, several kernels) is not timed.
    fused = 4 * n + 4 * n + n
    assert [b for k, b in zip(kinds, nbytes) if k == Kind.KERNEL].count(fused) == 2


def test_an_lstm_is_timed_as_cudnn_calls_not_the_cpus_steps() -> None:
    steps, batch, features, hidden, layers = 35, 4, 16, 32, 2

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(features, hidden, num_layers=layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x)[0]

    workload = Workload(
        model=Recurrent,
        make_batch=lambda b: torch.randn(steps, b, features),
        loss=lambda model, x: model(x).sum(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        name="lstm",
    )
    trace = trace_of(workload, memfit.Settings(micro_batch_size=batch), A100)
    kinds, flops, _, _ = trace.forward_backward[:4]
    weights = [p for p in nn.LSTM(features, hidden, num_layers=layers).parameters() if p.dim() == 2]
    forward = sum(2 * steps * batch * w.numel() for w in weights)  # each W times every step's input
    calls = [f for k, f in zip(kinds, flops) if k == Kind.CONV]
    assert calls == [forward, 2 * forward]  # _cudnn_rnn, _cudnn_rnn_backward (data and weights)
    assert not [k for k in kinds if k == Kind.MATMUL]  # none of the CPU's per-step products
    kernels = [k for k in kinds if k != Kind.NO_KERNEL]
    assert len(kernels) < steps  # the CPU's cells would be several kernels a step and layer
