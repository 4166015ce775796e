"""CUDA's attention on the simulated GPU: the kernel PyTorch would pick, what it keeps, correct values."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import memfit
from memfit.cuda.attention import attention_values, keep_mask
from memfit.cuda.sdpa_choice import NoAttentionKernel, choose_backend
from memfit.cuda.semantics import cuda_semantics
from memfit.cuda.target import CudaTarget
from memfit.memory.devices import SimDevice

A100 = CudaTarget((8, 0), (12, 8))
BLOCK = 512  # the caching allocator's smallest block: every allocation is rounded up to it


def blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def qkv(b=2, h=4, s=128, d=64, dtype=torch.bfloat16, kv_heads=None, s_k=None):
    torch.manual_seed(0)
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv_heads or h, s_k or s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv_heads or h, s_k or s, d, dtype=dtype, requires_grad=True)
    return q, k, v


# -- which kernel: sdp_utils.cpp's rules ------------------------------------------------


@pytest.mark.parametrize(
    ("case", "target", "expected"),
    [
        ({}, A100, "flash"),  # bf16, no mask, head dim 64: flash first
        ({"dtype": torch.float32}, A100, "efficient"),  # flash is fp16/bf16 only
        ({"mask": "bool"}, A100, "efficient"),  # flash takes no mask
        ({"mask": "learned"}, A100, "efficient"),  # a bias that requires grad: efficient (cuDNN refuses it)
        ({"dtype": torch.float16}, CudaTarget((7, 5), (12, 8)), "efficient"),  # T4: flash needs sm80
        ({"s_k": 64, "causal": True}, A100, "efficient"),  # flash: no causal with L != S
        ({"d": 256, "dropout": 0.1}, CudaTarget((8, 6), (12, 8)), "efficient"),  # sm86 training, d > 192
        ({"d": 6, "dtype": torch.float32}, A100, "math"),  # efficient needs d % 4 == 0 in fp32
        ({}, CudaTarget((9, 0), (13, 0)), "cudnn"),  # H100, new cuDNN: cuDNN first
        ({"dropout": 0.1}, CudaTarget((9, 0), (13, 0)), "flash"),  # cuDNN: dropout in 1/16 steps only
        ({}, CudaTarget((9, 0), (12, 8)), "flash"),  # CUDA 12 wheels ship an older cuDNN
    ],
)
def test_backend_is_the_one_pytorch_picks(case, target, expected):
    q, k, v = qkv(d=case.get("d", 64), dtype=case.get("dtype", torch.bfloat16), s_k=case.get("s_k"))
    mask = None
    if case.get("mask") == "bool":
        mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()
    elif case.get("mask") == "learned":
        mask = torch.zeros(1, q.size(1), q.size(2), k.size(2), dtype=q.dtype, requires_grad=True)
    backend = choose_backend(q, k, v, mask, case.get("dropout", 0.0), case.get("causal", False), False, target)
    assert backend == expected


def test_the_users_kernel_settings_are_followed():
    q, k, v = qkv()
    with sdpa_kernel(SDPBackend.MATH):
        assert choose_backend(q, k, v, None, 0.0, True, False, A100) == "math"
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert choose_backend(q, k, v, None, 0.0, True, False, A100) == "efficient"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(NoAttentionKernel, match="No available kernel"):
        choose_backend(q.float(), k.float(), v.float(), None, 0.0, True, False, A100)  # fp32: flash cannot


# -- what each kernel keeps, computed by hand --------------------------------------------


def forward_bytes(backend_settings, q, k, v, **kwargs) -> int:
    """Bytes allocated by the forward and still held (the inputs were made before)."""
    gpu = SimDevice(None, "sim:test")
    with gpu, backend_settings:
        gpu.adopt([q, k, v])
        before = gpu.memory_allocated()
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        held = gpu.memory_allocated() - before
        del out
    return held


def test_flash_keeps_output_logsumexp_and_rng_state():
    b, h, s, d = 2, 4, 256, 64
    q, k, v = qkv(b, h, s, d, torch.bfloat16)
    held = forward_bytes(sdpa_kernel(SDPBackend.FLASH_ATTENTION), q, k, v, dropout_p=0.1, is_causal=True)
    output = b * h * s * d * 2  # bf16
    logsumexp = b * h * s * 4  # (B, H, L) fp32
    rng_state, offset = 2 * 8, 8  # uint64[2] and an unused uint64, on the GPU
    assert held == blocks(output) + blocks(logsumexp) + blocks(rng_state) + blocks(offset)


def test_efficient_keeps_output_and_padded_logsumexp():
    b, h, s, d = 2, 4, 100, 64  # 100 queries: the log-sum-exp is padded to 128 (kAlignLSE = 32)
    q, k, v = qkv(b, h, s, d, torch.float32)
    held = forward_bytes(sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), q, k, v, dropout_p=0.1, is_causal=True)
    output = b * h * s * d * 4
    logsumexp = b * h * 128 * 4
    assert held == blocks(output) + blocks(logsumexp)  # seed and offset live on the CPU


def test_cudnn_keeps_output_and_stats():
    b, h, s, d = 2, 4, 128, 64
    q, k, v = qkv(b, h, s, d, torch.bfloat16)
    gpu = SimDevice(None, "sim:h100", cuda=CudaTarget((9, 0), (13, 0)))
    with gpu:
        gpu.adopt([q, k, v])
        before = gpu.memory_allocated()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        held = gpu.memory_allocated() - before
    assert held == blocks(b * h * s * d * 2) + blocks(b * h * s * 1 * 4)  # output, softmax stats (B, H, L, 1)
    assert out.shape == (b, h, s, d)


def test_math_keeps_the_attention_matrices():
    b, h, s, d = 1, 2, 64, 16
    q, k, v = qkv(b, h, s, d, torch.float32)
    held = forward_bytes(sdpa_kernel(SDPBackend.MATH), q, k, v, dropout_p=0.5)
    # aten::_scaled_dot_product_attention_math: q·√scale (B,H,L,D), kᵀ·√scale (B,H,D,S), softmax output
    # (B,H,L,S), CUDA's fused dropout: output (B,H,L,S) and its bool mask, the result (B,H,L,D)
    by_hand = [
        b * h * s * d * 4,
        b * h * d * s * 4,
        b * h * s * s * 4,
        b * h * s * s * 4,
        b * h * s * s,
        b * h * s * d * 4,
    ]
    assert held == sum(blocks(n) for n in by_hand)


def test_flash_backward_allocates_gradients_and_documented_temporaries():
    b, h, s, d = 1, 2, 200, 40  # 200 rows round to 256 (128), head dim 40 rounds to 64 (32) in dq_accum
    q, k, v = qkv(b, h, s, d, torch.bfloat16)
    gpu = SimDevice(None, "sim:test", record=True)
    with gpu, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        gpu.adopt([q, k, v])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)  # already in the kernel's layout
        start = len(gpu.events)
        out.backward(grad)
    allocated = sorted(n for kind, _, n, _ in gpu.events[start:] if kind == "alloc")
    qkv_grads = [b * h * s * d * 2] * 3
    softmax_d = b * h * 256 * 4  # (B, H, L rounded to 128) fp32
    dq_accum = b * 256 * h * 64 * 4  # (B, L↑128, H, D↑32) fp32
    assert allocated == sorted([*qkv_grads, softmax_d, dq_accum])


# -- the values: correct, with and without dropout -----------------------------------------


@pytest.mark.parametrize(
    ("kernel", "dtype", "tolerance"),
    [
        (SDPBackend.FLASH_ATTENTION, torch.bfloat16, 3e-2),
        (SDPBackend.EFFICIENT_ATTENTION, torch.float32, 1e-5),
        (SDPBackend.MATH, torch.float32, 1e-5),
    ],
)
def test_values_and_gradients_match_torch_on_the_cpu(kernel, dtype, tolerance):
    q, k, v = qkv(2, 4, 48, 32, dtype)
    grad = torch.randn(2, 4, 48, 32, dtype=dtype)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    with cuda_semantics(A100), sdpa_kernel(kernel):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
def test_dropout_gradients_use_the_forwards_mask(kernel):
    dtype = torch.bfloat16 if kernel == SDPBackend.FLASH_ATTENTION else torch.float32
    q, k, v = qkv(1, 2, 32, 16, dtype)
    grad = torch.randn(1, 2, 32, 16, dtype=dtype)
    torch.manual_seed(7)
    with cuda_semantics(A100), sdpa_kernel(kernel):
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    keep = keep_mask((1, 2, 32, 32), 0.3, torch.Generator().manual_seed(7))  # the same draw
    assert 0.5 < keep.float().mean() < 0.9
    expected = attention_values(q, k, v, None, is_causal=True, scale=16**-0.5, keep=keep, dropout_p=0.3)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_a_learned_bias_runs_the_efficient_kernel_and_gets_its_gradient():
    q, k, v = qkv(2, 4, 40, 32, torch.float32)  # 40 keys: the bias is padded to 48 for the kernel
    bias = torch.randn(1, 4, 40, 40, requires_grad=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    expected_bias_grad = torch.autograd.grad(expected.sum(), bias)[0]
    gpu = SimDevice(None, "sim:test", record=True)
    with gpu:
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        assert not any(
            n == 2 * 4 * 40 * 40 * 4 for kind, _, n, _ in gpu.events if kind == "alloc"
        )  # no (B,H,L,S) scores
        bias_grad = torch.autograd.grad(got.sum(), bias)[0]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(bias_grad, expected_bias_grad, atol=1e-5, rtol=1e-5)


def test_multihead_attention_takes_the_fused_kernel_in_training():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    x = torch.randn(2, 256, 64)
    gpu = SimDevice(None, "sim:test", record=True)
    with gpu:
        gpu.adopt(list(layer.parameters()))
        layer(x).sum().backward()
    scores = 2 * 4 * 256 * 256  # one (B, H, L, S) matrix of elements
    largest = max(n for kind, _, n, _ in gpu.events if kind == "alloc")
    assert largest < scores  # the math path would keep several (B, H, L, S) fp32 matrices
    assert all(p.grad is not None for p in layer.parameters())


def test_the_cpu_device_keeps_the_cpus_semantics():
    q, k, v = qkv(1, 2, 64, 16, torch.float32)
    cpu = memfit.device("cpu")
    assert cpu.cuda is None
    with cpu:
        cpu.adopt([q, k, v])
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        held = cpu.memory_allocated() - 3 * blocks(1 * 2 * 64 * 16 * 4)
    assert held > 1 * 2 * 64 * 64 * 4  # the CPU's math path keeps (B, H, L, S) matrices
    assert out.shape == q.shape


def test_fake_tensors_skip_the_arithmetic_but_not_the_shape_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), cuda_semantics(A100):
        # as a transformer makes it: (B, L, H, D) heads split from a projection, then transposed
        q = torch.empty(2, 64, 4, 32, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert out.shape == q.shape and out.stride() == q.stride()  # flash: empty_like(q.transpose(1, 2))
        shorter = torch.empty(2, 4, 32, 32, dtype=torch.bfloat16)  # values for 32 keys, 64 keys given
        with pytest.raises(RuntimeError, match="do not make an attention"):
            F.scaled_dot_product_attention(q, q, shorter)
