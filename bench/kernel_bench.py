"""One microbenchmark per kernel class of ``memfit.estimator.kernel_rates``, predicted and
(on a GPU) measured, for ``bench/gpu_speed_check.py``.

Each case is a small function of tensors (a product, a convolution forward and backward,
element-wise kernels in 16 and 32 bits, a norm, a softmax, a reduction, an optimizer step). Its predicted
time comes from memfit's own model: the function runs once on fake tensors under a
dispatch mode that hands every ATen call to :class:`memfit.estimator.timing.OpCounter`
(as the estimator's fake steps do), and :func:`memfit.estimator.timing.predict` times the
operations on the card; the host's per-operation time is left out (the measured time is
the GPU's, by CUDA events). The measured efficiency of the class is then the rate memfit
uses times predicted / measured: what the rate would have to be for the prediction to be
exact on this card.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.estimator.kernel_rates import (
    RATES,
    SM_COUNT,
    TILE,
    KernelClass,
    Rates,
    elements_per_thread,
    streaming_bandwidth,
)
from memfit.estimator.timing import OpCounter, OpTrace, predict
from memfit.memory.gpus import GPU

#: a case: (name, the rate of Rates it checks, make(device) -> the function to time)
Make = Callable[[torch.device], Callable[[], Any]]


@dataclass(frozen=True)
class Case:
    name: str
    #: the field of memfit.estimator.kernel_rates.Rates this case measures
    rate: str
    #: the kernel class whose predicted time the rate scales
    cls: KernelClass
    make: Make
    tf32: bool = False


def _mm(m: int, n: int, k: int, dtype: torch.dtype) -> Make:
    def make(device: torch.device) -> Callable[[], Any]:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        return lambda: a @ b

    return make


def _conv(groups: int, dtype: torch.dtype, channels_last: bool, channels: int = 256) -> Make:
    def make(device: torch.device) -> Callable[[], Any]:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(64, channels, 28, 28, device=device, dtype=dtype).to(memory_format=fmt).requires_grad_()
        w = torch.randn(channels, channels // groups, 3, 3, device=device, dtype=dtype).to(memory_format=fmt)
        w.requires_grad_()

        def step() -> Any:
            y = torch.nn.functional.conv2d(x, w, padding=1, groups=groups)
            (gx, gw) = torch.autograd.grad(y, (x, w), torch.ones_like(y))
            return gx, gw

        return step

    return make


def _unary(op: Callable[[torch.Tensor], Any], shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> Make:
    def make(device: torch.device) -> Callable[[], Any]:
        x = torch.randn(*shape, device=device, dtype=dtype)
        return lambda: op(x)

    return make


def _batch_norm(device: torch.device) -> Callable[[], Any]:
    x = torch.randn(128, 256, 28, 28, device=device, dtype=torch.float16)
    mean, var = torch.zeros(256, device=device), torch.ones(256, device=device)
    return lambda: torch.nn.functional.batch_norm(x, mean, var, training=True)


def _sgd(device: torch.device) -> Callable[[], Any]:
    """SGD with momentum as torch.optim.SGD(foreach=True) steps it: two foreach kernels."""
    params = [torch.randn(1 << 20, device=device) for _ in range(64)]
    grads = [torch.randn(1 << 20, device=device) for _ in range(64)]
    buffers = [torch.zeros(1 << 20, device=device) for _ in range(64)]

    def step() -> None:
        torch._foreach_mul_(buffers, 0.9)
        torch._foreach_add_(buffers, grads)
        torch._foreach_add_(params, buffers, alpha=-0.1)

    return step


def _halves_rate(gpu: GPU) -> str:
    """The rate a 16-bit add measures on ``gpu``: ``latency`` where its bytes in flight bound it."""
    capped = streaming_bandwidth(gpu, 2, elements_per_thread()) < gpu.bandwidth * RATES.stream
    return "latency" if capped else "stream"


def cases(gpu: GPU) -> list[Case]:
    """The microbenchmarks for ``gpu`` (the wave case sized by its SM count)."""
    sms = SM_COUNT.get(gpu.name, 108)
    tm, tn = TILE
    half = torch.bfloat16 if gpu.bf16 else torch.float16
    return [
        Case("matmul 8192^3, 16-bit", "gemm_half", KernelClass.GEMM, _mm(8192, 8192, 8192, half)),
        # 4 x sms tiles of 128 x 512 outputs (compute-bound): 4 waves; one row more adds 4 tiles, a 5th wave
        Case(f"matmul, {4 * sms} tiles (4 waves)", "gemm_half", KernelClass.GEMM, _mm(tm * sms, 4 * tn, 8192, half)),
        Case(
            f"matmul, {4 * sms + 4} tiles (5 waves)",
            "gemm_half",
            KernelClass.GEMM,
            _mm(tm * sms + 1, 4 * tn, 8192, half),
        ),
        # BERT-base's products at Lambda's batch (320 x 384 tokens): K = 768 and 3072, where
        # memfit takes the large-product efficiency (the predicted-speed bench's BERT rows are
        # mostly predicted too fast, base more than large; docs/benchmarks.md)
        Case("matmul 122880x768x768, 16-bit", "gemm_half", KernelClass.GEMM, _mm(122880, 768, 768, half)),
        Case("matmul 122880x768x3072, 16-bit", "gemm_half", KernelClass.GEMM, _mm(122880, 768, 3072, half)),
        Case("matmul 8192^3, tf32", "tf32_matmul", KernelClass.GEMM, _mm(8192, 8192, 8192, torch.float32), tf32=True),
        Case("matmul 4096^3, fp32", "gemm_fp32", KernelClass.GEMM, _mm(4096, 4096, 4096, torch.float32)),
        Case("conv 3x3 dense, 16-bit NHWC", "conv_half", KernelClass.CONV_DENSE, _conv(1, torch.float16, True)),
        Case("conv 3x3 dense, 16-bit NCHW", "layout", KernelClass.LAYOUT, _conv(1, torch.float16, False)),
        Case(
            "conv 3x3 dense, tf32 NCHW", "tf32_conv", KernelClass.CONV_DENSE, _conv(1, torch.float32, False), tf32=True
        ),
        Case("conv 3x3 32 groups, 16-bit NHWC", "grouped", KernelClass.CONV_GROUPED, _conv(32, torch.float16, True)),
        Case(
            "conv 3x3 depthwise, 16-bit NHWC", "depthwise", KernelClass.CONV_DEPTHWISE, _conv(256, torch.float16, True)
        ),
        # the two kinds behind the bench's largest errors (docs/benchmarks.md): fp32 NCHW
        # depthwise runs PyTorch's own kernel (DepthwiseConv2d.cu), not cuDNN's, at the same
        # rate in memfit's model; a grouped convolution of fp32 data on tf32
        Case(
            "conv 3x3 depthwise, fp32 NCHW",
            "depthwise",
            KernelClass.CONV_DEPTHWISE,
            _conv(256, torch.float32, False),
        ),
        Case(
            "conv 3x3 32 groups, tf32 NCHW",
            "grouped",
            KernelClass.CONV_GROUPED,
            _conv(32, torch.float32, False),
            tf32=True,
        ),
        # the same bytes in fp32: a thread of PyTorch's element-wise kernel loads a fixed number
        # of elements, so 16 bits keep half the bytes in flight; where memfit predicts that
        # too few for the card's bandwidth (Rates.latency caps them) the halves measure the
        # latency, else the streaming rate as the floats do
        Case("add, 256M halves", _halves_rate(gpu), KernelClass.ELEMENTWISE, _unary(lambda x: x + 1, (1 << 28,))),
        Case(
            "add, 128M floats",
            "stream",
            KernelClass.ELEMENTWISE,
            _unary(lambda x: x + 1, (1 << 27,), dtype=torch.float32),
        ),
        Case("batch norm, 128x256x28x28", "stream", KernelClass.NORMALIZATION, _batch_norm),
        Case("softmax, 8192x8192", "softmax", KernelClass.SOFTMAX, _unary(lambda x: x.softmax(-1), (8192, 8192))),
        Case(
            "layer norm, 65536x1024",
            "layer_norm",
            KernelClass.LAYER_NORM,
            _unary(lambda x: torch.nn.functional.layer_norm(x, (1024,)), (65536, 1024)),
        ),
        Case("sum, 256M halves", "stream", KernelClass.REDUCTION, _unary(lambda x: x.sum(), (1 << 28,))),
        Case("SGD foreach, 64 x 1M", "stream", KernelClass.OPTIMIZER, _sgd),
    ]


class _Recording(TorchDispatchMode):
    """Hands every ATen call to the counter (as the estimator's tracker does)."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counter.record(func, args, kwargs, out)
        return out


def record_call(build: Callable[[], Callable[[], Any]]) -> OpTrace:
    """The operations of one call as memfit records them: ``build`` makes the call's
    tensors (on fake tensors: nothing is allocated) and returns the call, whose every ATen
    operation goes to an :class:`OpCounter`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = OpCounter(step=-1)  # operations outside any step carry step -1
    with FakeTensorMode():
        call = build()
        with _Recording(counter):
            call()
    return counter.trace()


def predicted(case: Case, gpu: GPU) -> tuple[float, float]:
    """(predicted GPU seconds of one call of the case, of which its class's) on ``gpu``."""
    trace = record_call(lambda: case.make(torch.device("cpu")))
    time = predict(trace, gpu, 1, tf32_matmul=case.tf32, tf32_conv=case.tf32)
    return sum(time.by_class.values()), time.by_class.get(case.cls.name.lower(), 0.0)


def measured(case: Case, repeats: int = 20) -> float:
    """The median GPU seconds of one call, by CUDA events, after warm-up calls."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = case.tf32
    try:
        step = case.make(torch.device("cuda"))
        for _ in range(3):
            step()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
        torch.cuda.empty_cache()


def implied_rate(case: Case, total: float, in_class: float, seconds: float, rates: Rates = RATES) -> float:
    """The rate that would make the prediction exact: memfit's rate x predicted / measured,
    counting only the case's own class (the rest of its predicted time is taken as right);
    the latency, which slows what it caps, x measured / predicted. ``rates``: the card's
    (:meth:`~memfit.estimator.kernel_rates.Rates.for_card`)."""
    rate = getattr(rates, case.rate)
    others = total - in_class
    if seconds <= others or in_class <= 0:
        return float("nan")
    if case.rate == "latency":
        return rate * (seconds - others) / in_class
    return rate * in_class / (seconds - others)
