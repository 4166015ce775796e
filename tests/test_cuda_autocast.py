"""CUDA's autocast lists applied to CPU tensors on the simulated GPU, op by op."""

import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit.cuda.autocast import BANNED_MESSAGE, policy_of
from memfit.cuda.autocast_lists import CPU_LOWER_PRECISION, for_torch
from memfit.cuda.semantics import cuda_semantics
from memfit.cuda.target import CudaTarget, torch_version

LISTS = for_torch(torch_version())
BF16 = torch.bfloat16


def registered(key: str) -> set[str]:
    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key(key)}


def test_the_table_is_what_this_torch_registers_for_cuda():
    # The CPU-only build compiles autocast_mode.cpp too: its CUDA registrations are the truth.
    assert LISTS.all_ops() == registered("AutocastCUDA")
    assert registered("AutocastCPU") >= CPU_LOWER_PRECISION


def test_every_listed_op_gets_cudas_policy_while_a_sim_run_is_entered():
    with cuda_semantics(CudaTarget()):
        for name in LISTS.all_ops() | registered("AutocastCPU"):
            op = name.partition(".")
            overload = f"aten::{op[0]}" + (f".{op[2]}" if op[2] else "")
            assert torch._C._dispatch_has_kernel_for_dispatch_key(overload, "AutocastCPU"), name


def sim_autocast(dtype=BF16):
    """A sim device entered with CUDA-policy autocast, as memfit's steps and a user's loop get it."""
    gpu = memfit.device("sim:1GiB")
    settings = memfit.Settings(precision="bf16" if dtype == BF16 else "fp16")
    return gpu, settings


x = torch.randn(4, 8)
w = torch.randn(8, 8, requires_grad=True)
target = torch.randint(0, 8, (4,))


@pytest.mark.parametrize(
    ("name", "call", "cuda_dtype"),
    [
        # lower precision (both devices)
        ("linear", lambda: F.linear(x, w), BF16),
        ("matmul", lambda: x @ w, BF16),
        # lower precision on CUDA only
        ("addmv", lambda: torch.addmv(torch.randn(8), w, torch.randn(8)), BF16),
        ("einsum", lambda: torch.einsum("ij,jk->ik", x, w), BF16),
        # fp32 on CUDA; CPU autocast leaves them in bf16
        ("softmax.int", lambda: torch.softmax(x.to(BF16), -1), torch.float32),
        ("log_softmax.int", lambda: F.log_softmax(x.to(BF16), -1), torch.float32),
        ("layer_norm", lambda: F.layer_norm(x.to(BF16), (8,)), torch.float32),
        ("group_norm", lambda: F.group_norm(x.to(BF16).view(4, 8, 1), 2), torch.float32),
        ("rms_norm", lambda: F.rms_norm(x.to(BF16), (8,)), torch.float32),
        ("exp", lambda: x.to(BF16).exp(), torch.float32),
        ("pow.Tensor_Scalar", lambda: x.to(BF16).pow(2), torch.float32),
        ("rsqrt", lambda: x.to(BF16).abs().rsqrt(), torch.float32),
        ("sum", lambda: x.to(BF16).sum(), torch.float32),
        ("cumsum", lambda: x.to(BF16).cumsum(0), torch.float32),
        ("norm.Scalar", lambda: x.to(BF16).norm(), torch.float32),
        ("mse_loss", lambda: F.mse_loss(x.to(BF16), x.to(BF16)), torch.float32),
        ("nll_loss", lambda: F.nll_loss(x.to(BF16), target), torch.float32),
        ("cross_entropy_loss", lambda: F.cross_entropy(x @ w, target), torch.float32),  # log_softmax + nll_loss
        # promote: the widest input
        ("addcmul", lambda: torch.addcmul(x, x.to(BF16), x.to(BF16)), torch.float32),
        # not listed for CUDA: run as given (CPU autocast would cast cat's inputs)
        ("gelu", lambda: F.gelu(x.to(BF16)), BF16),
    ],
)
def test_op_follows_cudas_list(name, call, cuda_dtype):
    gpu, settings = sim_autocast()
    with gpu, settings.autocast():  # "cuda" on a CPU-only build: CPU autocast with CUDA's lists
        assert call().dtype == cuda_dtype, name
    if name != "cross_entropy_loss":
        assert policy_of(name, LISTS) != "none" or cuda_dtype == BF16


def test_outside_a_sim_run_cpu_autocast_is_the_cpus():
    with torch.autocast("cpu", dtype=BF16):
        assert torch.softmax(x.to(BF16), -1).dtype == BF16
        assert F.layer_norm(x.to(BF16), (8,)).dtype == BF16


def test_binary_cross_entropy_is_refused_as_cuda_refuses_it():
    gpu, settings = sim_autocast()
    with gpu, settings.autocast(), pytest.raises(RuntimeError) as raised:
        F.binary_cross_entropy(torch.rand(4), torch.rand(4))
    assert str(raised.value) == BANNED_MESSAGE


def test_softmax_saves_its_fp32_output_for_backward():
    # CUDA keeps an fp32 softmax output where CPU autocast keeps bf16: twice the bytes
    scores = torch.randn(16, 1024, requires_grad=True)
    gpu = memfit.device("sim:1GiB")
    with gpu:
        gpu.adopt([scores])
        with torch.autocast("cpu", dtype=BF16):
            half = scores.to(BF16)
            before = gpu.memory_allocated()
            probs = torch.softmax(half, -1)
            held = gpu.memory_allocated() - before
    assert probs.dtype == torch.float32
    assert held == 16 * 1024 * 4


def test_a_users_loop_gets_cudas_policy_through_settings_autocast():
    lock_settings = memfit.Settings(precision="fp16")
    with memfit.device("sim:1GiB"), lock_settings.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert F.linear(x, w).dtype == torch.float16
    assert not torch.is_autocast_enabled("cpu")
