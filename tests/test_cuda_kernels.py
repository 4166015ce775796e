"""CUDA's fused dropout and cuDNN RNNs on the simulated GPU: their memory, correct values."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.cuda.rnn import reserve_bytes
from memfit.cuda.semantics import cuda_semantics
from memfit.cuda.target import CudaTarget

BLOCK = 512


def blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def held_after(device, fn, *inputs):
    """(result, bytes the call allocated and still holds) on ``device``, inputs adopted first."""
    with device:
        device.adopt(list(inputs))
        before = device.memory_allocated()
        result = fn()
        return result, device.memory_allocated() - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_a_one_byte_mask_on_sim_and_the_inputs_dtype_on_cpu(dtype):
    x = torch.randn(64, 1024, dtype=dtype, requires_grad=True)
    elements, itemsize = x.numel(), x.element_size()
    _, on_sim = held_after(memfit.device("sim:1GiB"), lambda: F.dropout(x, 0.1), x)
    _, on_cpu = held_after(memfit.device("cpu"), lambda: F.dropout(x, 0.1), x)
    assert on_sim == blocks(elements * itemsize) + blocks(elements)  # output, bool mask
    assert on_cpu == 2 * blocks(elements * itemsize)  # output, mask in the input's dtype


def test_dropout_values_and_gradient_are_dropouts():
    x = torch.randn(32, 256, requires_grad=True)
    with cuda_semantics(CudaTarget()):
        y = F.dropout(x, 0.25)
    kept = y != 0
    assert 0.65 < kept.float().mean() < 0.85
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, kept.float() / 0.75)


def test_dropout_backward_allocates_only_the_gradient():
    x = torch.randn(64, 1024, requires_grad=True)
    gpu = memfit.memory.devices.SimDevice(None, "sim:test", record=True)
    with gpu:
        gpu.adopt([x])
        y = F.dropout(x, 0.5)
        g = torch.ones_like(y)
        start = len(gpu.events)
        y.backward(g)
    assert [n for kind, _, n, _ in gpu.events[start:] if kind == "alloc"] == [64 * 1024 * 4]


def lstm_and_input(layers=2, dropout=0.0, batch_first=False):
    torch.manual_seed(0)
    lstm = nn.LSTM(16, 32, num_layers=layers, dropout=dropout, batch_first=batch_first)
    x = torch.randn(8, 4, 16, requires_grad=True)  # (T, B, I), or (B, T, I) with batch_first
    return lstm, x


@pytest.mark.parametrize("batch_first", [False, True])
def test_lstm_output_hy_cy_and_reserve_are_what_cudnn_keeps(batch_first):
    lstm, x = lstm_and_input(batch_first=batch_first)
    gpu = memfit.device("sim:1GiB")
    (out, (hy, cy)), held = held_after(gpu, lambda: lstm(x), x, *lstm.parameters())
    seq, batch = (4, 8) if batch_first else (8, 4)
    output = seq * batch * 32 * 4
    state = 2 * batch * 32 * 4  # (layers, B, H) fp32: h0 and c0 (zeros made by nn.LSTM), hy and cy
    reserve = reserve_bytes("lstm", seq, batch, 32, 2, 1, 4)
    assert held == blocks(output) + 4 * blocks(state) + blocks(reserve)
    assert out.shape == (8, 4, 32) and hy.shape == cy.shape == (2, batch, 32)  # x is (8, 4, 16) either way


def test_lstm_values_and_gradients_match_the_cpus():
    lstm, x = lstm_and_input()
    expected, (eh, ec) = lstm(x)
    expected_grads = torch.autograd.grad((expected.sum(), eh.sum(), ec.sum()), [x, *lstm.parameters()])
    with cuda_semantics(CudaTarget()):
        got, (gh, gc) = lstm(x)
    grads = torch.autograd.grad((got.sum(), gh.sum(), gc.sum()), [x, *lstm.parameters()])
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_lstm_dropout_gradients_use_the_forwards_masks():
    # Reference: the recurrence itself with autograd, drawing its inter-layer dropout from the
    # same random state (CUDA's fused dropout inside, as in the emulated call).
    lstm, x = lstm_and_input(dropout=0.3)
    params, zeros = list(lstm._flat_weights), torch.zeros(2, 4, 32)
    with cuda_semantics(CudaTarget()):
        torch.manual_seed(1)
        expected, eh, ec = torch.ops.aten.lstm.input.decompose(
            x, [zeros, zeros], params, True, 2, 0.3, True, False, False
        )
        torch.manual_seed(1)
        got, (gh, gc) = lstm(x)
    inputs = [x, *lstm.parameters()]
    expected_grads = torch.autograd.grad((expected.sum(), eh.sum(), ec.sum()), inputs)
    grads = torch.autograd.grad((got.sum(), gh.sum(), gc.sum()), inputs)
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_gru_runs_the_cudnn_way_and_trains():
    torch.manual_seed(0)
    gru = nn.GRU(8, 16, num_layers=2)
    head = nn.Linear(16, 1)
    optimizer = torch.optim.Adam([*gru.parameters(), *head.parameters()], lr=0.01)
    x, y = torch.randn(12, 16, 8), torch.randn(16, 1)
    losses = []
    with memfit.device("sim:1GiB"):
        for _ in range(20):
            out, _ = gru(x)
            loss = F.mse_loss(head(out[-1]), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_lstm_under_autocast_runs_in_fp16_from_a_flat_fp16_weight_copy():
    lstm, x = lstm_and_input()
    gpu = memfit.device("sim:1GiB")
    with gpu, torch.autocast("cpu", dtype=torch.bfloat16):
        gpu.adopt([x, *lstm.parameters()])
        before = gpu.memory_allocated()
        out, _ = lstm(x)
        held = gpu.memory_allocated() - before
    assert out.dtype == torch.float16  # _cudnn_rnn_cast_reflatten casts to half, whatever the autocast dtype
    weights = sum(p.numel() for p in lstm.parameters())
    assert held > blocks(weights * 2)  # the fp16 flat weight buffer is kept for backward
