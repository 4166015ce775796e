"""The timing model by kernel class (issue 22): matrix products with tile and wave
quantization for the card's SM count, convolutions by kind and layout, memory-bound kernels
at the achievable bandwidth, tf32 apart from 16 bits; and where the breakdown is shown."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import memfit
from memfit.cli import main
from memfit.estimator.kernel_classes import Classified, classify
from memfit.estimator.kernel_rates import (
    MEASURED_TF32_MATMUL,
    RATES,
    RESIDENT_THREADS,
    SM_COUNT,
    TF32_MATMUL_EFFICIENCY,
    TILE,
    KernelClass,
    elements_per_thread,
    gemm_utilisation,
    sm_count,
    streaming_bandwidth,
)
from memfit.estimator.speed import record_step
from memfit.estimator.timing import DType, Kind, OpCounter, predict
from memfit.memory.gpus import GPUS, lookup
from memfit.workload import Workload

A100 = lookup("A100 80GB SXM")


def product(m: int, n: int, k: int, dtype: DType = DType.HALF) -> OpCounter:
    counter = OpCounter(step=0)
    shape = Classified(KernelClass.GEMM, m, n, k, 1)
    counter.add(Kind.MATMUL, 2 * m * n * k, 2 * (m * k + k * n + m * n), dtype, phase="forward", shape=shape)
    return counter


def test_one_tile_more_than_the_card_has_sms_costs_a_second_wave() -> None:
    tm, tn = TILE
    sms = SM_COUNT[A100.name]
    assert sms == 108
    k = 1 << 16
    full = predict(product(tm * 12, tn * 9, k).trace(), A100, 1).compute_seconds
    over = predict(product(tm * 12 + 1, tn * 9, k).trace(), A100, 1).compute_seconds
    # 12 x 9 = 108 tiles: one wave; one row more: 13 x 9 = 117 tiles, two waves for 1/1536 more work
    assert full > 0 and over / full == pytest.approx(2.0, rel=1e-6)
    assert gemm_utilisation(tm * 12, tn * 9, k, 1, sms) == pytest.approx(1.0)


def test_a_product_of_few_tiles_is_split_along_k_and_tiles_are_filled_partly() -> None:
    # one 128x128 tile, K = 108 x 256: split K 108 ways, one full wave
    assert gemm_utilisation(128, 128, 108 * 256, 1, 108) == pytest.approx(1.0)
    # the same tile with a short K cannot be split: 1 of 108 SMs works
    assert gemm_utilisation(128, 128, 256, 1, 108) == pytest.approx(1 / 108)
    # a 129-row output fills two tiles' rows by 129 / 256
    assert gemm_utilisation(129, 128, 256, 1, None) == pytest.approx(129 / 256)


def test_every_card_of_the_table_has_an_sm_count() -> None:
    assert all(sm_count(gpu) for gpu in GPUS)
    # where both tables name a card they agree
    assert all(gpu.sms == SM_COUNT[gpu.name] for gpu in GPUS if gpu.sms and gpu.name in SM_COUNT)


def test_tf32_runs_at_its_own_efficiency_not_the_16_bit_one() -> None:
    big = 8192
    half = predict(product(big, big, big, DType.HALF).trace(), A100, 1).compute_seconds
    tf32 = predict(product(big, big, big, DType.SINGLE).trace(), A100, 1, tf32_matmul=True).compute_seconds
    assert A100.tf32 is not None and A100.fp16_tensor is not None
    assert tf32 / half == pytest.approx((A100.fp16_tensor * RATES.gemm_half) / (A100.tf32 * RATES.tf32_matmul))


def test_tf32_matmuls_take_the_measured_rate_and_tf32_convolutions_the_calibrated_one() -> None:
    big = 8192
    trace = product(big, big, big, DType.SINGLE).trace()
    h100 = lookup("H100 SXM")
    assert h100.tf32 is not None and A100.tf32 is not None
    # a card of XLA's table takes its own efficiency; another the median of those cards
    on_h100 = predict(trace, h100, 1, tf32_matmul=True).compute_seconds
    on_a100 = predict(trace, A100, 1, tf32_matmul=True).compute_seconds
    flops = 2 * big**3
    assert on_h100 == pytest.approx(
        flops / (h100.tf32 * MEASURED_TF32_MATMUL["H100 SXM"] * gemm_utilisation(big, big, big, 1, sm_count(h100)))
    )
    assert on_a100 == pytest.approx(
        flops / (A100.tf32 * TF32_MATMUL_EFFICIENCY * gemm_utilisation(big, big, big, 1, sm_count(A100)))
    )
    assert RATES.tf32_conv != TF32_MATMUL_EFFICIENCY  # not the convolutions' (calibrated) rate
    # a convolution on tf32 keeps the calibrated rate (its time without the transposes)
    conv = OpCounter(step=0)
    shape = Classified(KernelClass.CONV_DENSE, 0, 0, 0, 1)
    conv.add(Kind.CONV, 2 * big**3, 1e6, DType.SINGLE, phase="forward", shape=shape)
    seconds = predict(conv.trace(), A100, 1, tf32_conv=True).by_class["conv_dense"]
    assert seconds == pytest.approx(2 * big**3 / (A100.tf32 * RATES.tf32_conv))


def conv_net(groups: int, channels_last: bool) -> Workload:
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(64, 64, 3, padding=1, groups=groups, bias=False)
            self.norm = nn.BatchNorm2d(64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(x))

    return Workload(
        model=lambda: Net().to(memory_format=fmt),
        make_batch=lambda n: torch.randn(n, 64, 28, 28).to(memory_format=fmt),
        loss=lambda model, x: model(x).float().square().mean(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        name=f"conv groups={groups}",
    )


@pytest.mark.parametrize(("groups", "expected"), [(1, "conv_dense"), (8, "conv_grouped"), (64, "conv_depthwise")])
def test_a_convolution_is_timed_by_its_kind(groups: int, expected: str) -> None:
    trace = record_step(conv_net(groups, False), memfit.Settings(micro_batch_size=16, precision="fp16"))
    classes = {KernelClass(c).name.lower() for c in trace.forward_backward.classes}
    assert expected in classes and "normalization" in classes
    assert {"conv_dense", "conv_grouped", "conv_depthwise"} & classes == {expected}
    time = predict(trace, A100, 16)
    assert time.by_class[expected] > 0 and "normalization" in time.by_class


def test_cudnn_transposes_nchw_activations_on_tensor_cores_and_not_channels_last_ones() -> None:
    settings = memfit.Settings(micro_batch_size=16, precision="fp16")
    nchw = predict(record_step(conv_net(1, False), settings), A100, 16)
    nhwc = predict(record_step(conv_net(1, True), settings), A100, 16)
    # NCHW: the forward's input and output, the backward's gradient and input (the batch needs no
    # gradient);
    # channels_last: only the backward's NCHW gradient (of the loss), made channels_last first
    assert nhwc.by_class.get("layout", 0) == pytest.approx(nchw.by_class["layout"] / 4)
    fp32 = predict(record_step(conv_net(1, False), memfit.Settings(micro_batch_size=16)), A100, 16, tf32_conv=False)
    assert "layout" not in fp32.by_class  # CUDA-core fp32 kernels run NCHW as it is


def test_a_depthwise_convolution_in_nchw_is_not_transposed() -> None:
    # a depthwise convolution runs no tensor-core kernel: PyTorch's own NCHW kernel or
    # cuDNN's depthwise one, not the transposed tensor-core path of a dense or grouped one
    settings = memfit.Settings(micro_batch_size=16, precision="fp16")
    depthwise = record_step(conv_net(64, False), settings)
    assert any(c == KernelClass.CONV_DEPTHWISE and b > 0 for c, b in zip(depthwise.forward_backward.classes,
                                                                         depthwise.forward_backward.nchw))  # fmt: skip
    assert "layout" not in predict(depthwise, A100, 16).by_class
    grouped = predict(record_step(conv_net(8, False), settings), A100, 16)
    assert grouped.by_class["layout"] > 0


def test_memory_bound_kernels_stream_at_the_achievable_bandwidth_by_class() -> None:
    counter = OpCounter(step=0)
    classes = (KernelClass.ELEMENTWISE, KernelClass.SOFTMAX, KernelClass.REDUCTION, KernelClass.NORMALIZATION,
               KernelClass.LAYER_NORM)  # fmt: skip
    for cls in classes:
        counter.add(Kind.KERNEL, 0, 1e9, DType.HALF, phase="forward", shape=Classified(cls))
    counter.add(Kind.KERNEL, 0, 1e9, DType.SINGLE, phase="optimizer")
    time = predict(counter.trace(), A100, 1)
    expected = 1e9 / (A100.bandwidth * RATES.stream)
    for name in ("elementwise", "reduction", "normalization", "optimizer"):
        assert time.by_class[name] == pytest.approx(expected)
    # PyTorch's layer norm and softmax at their measured share of that bandwidth
    assert 0 < RATES.layer_norm < RATES.softmax < 1
    assert time.by_class["layer_norm"] == pytest.approx(expected / RATES.layer_norm)
    assert time.by_class["softmax"] == pytest.approx(expected / RATES.softmax)
    assert time.bound_by == "layer_norm"


def test_a_layer_norms_share_applies_where_bytes_in_flight_cap_the_bandwidth_too() -> None:
    # 16 bits of old PyTorch on an H100: capped below the achievable bandwidth; a layer norm
    # (forward and backward, recorded from the module) is slower than an element-wise kernel
    # of its bytes by its share, the cap included
    h100 = lookup("H100 SXM")
    counter = OpCounter(step=0)
    for cls in (KernelClass.ELEMENTWISE, KernelClass.LAYER_NORM):
        counter.add(Kind.KERNEL, 0, 1e9, DType.HALF, phase="forward", shape=Classified(cls))
    time = predict(counter.trace(), h100, 1, per_thread=4)
    assert time.by_class["elementwise"] > 1e9 / (h100.bandwidth * RATES.stream)
    assert time.by_class["layer_norm"] == pytest.approx(time.by_class["elementwise"] / RATES.layer_norm)
    recorded = record_step(Workload(model=lambda: nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)),
                                    make_batch=lambda n: torch.randn(n, 64),
                                    loss=lambda model, x: model(x).sum()), memfit.Settings(micro_batch_size=8))  # fmt: skip
    assert "layer_norm" in predict(recorded, h100, 8).by_class


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_fused_rms_norm", KernelClass.NORMALIZATION),
        ("_fused_rms_norm_backward", KernelClass.NORMALIZATION),
        ("native_layer_norm", KernelClass.LAYER_NORM),
        ("native_layer_norm_backward", KernelClass.LAYER_NORM),
        ("_fused_adam_", KernelClass.OPTIMIZER),
        ("_foreach_add_", KernelClass.OPTIMIZER),
        ("_softmax", KernelClass.SOFTMAX),
    ],
)
def test_a_kernel_is_classed_by_its_operation_not_its_prefix(name: str, expected: KernelClass) -> None:
    assert classify(name, False, (), [], []).cls == expected


def streamed(dtype: DType, gpu_name: str, per_thread: int) -> float:
    """Seconds of one 1 GB element-wise kernel of ``dtype`` on the card."""
    counter = OpCounter(step=0)
    counter.add(Kind.KERNEL, 0, 1e9, dtype, phase="forward")
    return predict(counter.trace(), lookup(gpu_name), 1, per_thread=per_thread).by_class["elementwise"]


def test_a_16_bit_kernel_of_old_pytorch_holds_too_few_bytes_in_flight_on_an_h100() -> None:
    h100 = lookup("H100 SXM")
    # by hand: 132 SMs x 2048 threads x 4 elements x 2 bytes / 1.3 us = 1.66 TB/s, below the
    # 3.35 TB/s x 750/900 = 2.79 TB/s an fp32 kernel (16 bytes a thread) reaches
    in_flight = 132 * 2048 * 4 * 2 / RATES.latency
    assert RESIDENT_THREADS[h100.compute_capability] == 2048 and RATES.latency == pytest.approx(1.3e-6)
    assert in_flight < h100.bandwidth * RATES.stream
    assert streamed(DType.HALF, "H100 SXM", per_thread=4) == pytest.approx(1e9 / in_flight)
    assert streamed(DType.SINGLE, "H100 SXM", per_thread=4) == pytest.approx(1e9 / (h100.bandwidth * RATES.stream))
    assert streaming_bandwidth(h100, 2, 4) == pytest.approx(in_flight)
    # recent PyTorch loads 8 elements a thread: 16 bytes, enough on this card
    assert streamed(DType.HALF, "H100 SXM", per_thread=8) == pytest.approx(1e9 / (h100.bandwidth * RATES.stream))


def test_bytes_in_flight_follow_the_cards_resident_threads_and_sm_count() -> None:
    # by hand, 16-bit data, 4 elements a thread (8 bytes), 1.3 us: SMs x threads x 8 / latency
    cases = {
        "T4": 40 * 1024 * 8,  # Turing: 1024 threads an SM -> 252 GB/s, below its 267
        "RTX 3090": 82 * 1536 * 8,  # 1536 threads -> 775 GB/s, just below its 780
        "A100 80GB SXM": 108 * 2048 * 8,  # 2048 threads -> 1.36 TB/s, well below its 1.70
    }
    for name, in_flight in cases.items():
        gpu = lookup(name)
        assert RESIDENT_THREADS[gpu.compute_capability] * sm_count(gpu) * 8 == in_flight  # type: ignore[operator]
        assert streaming_bandwidth(gpu, 2, 4) == pytest.approx(in_flight / RATES.latency)
        assert streaming_bandwidth(gpu, 2, 4) < gpu.bandwidth * RATES.stream
        # fp32 holds twice the bytes: each of these cards reaches its achievable bandwidth
        assert streaming_bandwidth(gpu, 4, 4) == pytest.approx(gpu.bandwidth * RATES.stream)


def test_no_elements_per_thread_is_refused_not_divided_by() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        streaming_bandwidth(A100, 2, 0)
    counter = OpCounter(step=0)
    counter.add(Kind.KERNEL, 0, 1e9, DType.HALF, phase="forward")
    with pytest.raises(ValueError, match="at least 1"):
        predict(counter.trace(), A100, 1, per_thread=0)


@pytest.mark.parametrize(
    ("version", "expected"),
    [("1.x", 4), ("1.13.1", 4), ("2.0.1+cu118", 4), ("2.6.0", 4), ("2.7.0", 8), ("2.13.0+cpu", 8)],
)
def test_elements_per_thread_follow_the_pytorch_version(version: str, expected: int) -> None:
    assert elements_per_thread(version) == expected


def test_a_tf32_convolution_takes_the_faster_of_the_tensor_core_and_the_fp32_kernel() -> None:
    # one NCHW fp32 convolution moving 1 GB: tf32 tensor cores (0.94 of the tf32 peak) plus
    # the transposes of its 0.5 GB of activations, or CUDA-core fp32 (0.826 of the fp32 peak)
    # on NCHW as it is; cuDNN's algorithm search takes the faster
    def conv(flops: float) -> dict[str, float]:
        counter = OpCounter(step=0)
        shape = Classified(KernelClass.CONV_DENSE, nchw=0.5e9)
        counter.add(Kind.CONV, flops, 1e9, DType.SINGLE, phase="forward", shape=shape)
        return predict(counter.trace(), A100, 1, tf32_conv=True).by_class

    assert A100.tf32 is not None
    moving = 1e9 / (A100.bandwidth * RATES.stream)
    transposes = 2 * 0.5e9 / (A100.bandwidth * RATES.layout)  # fp32: no bytes-in-flight cap on an A100
    heavy = 1e15  # 1 PFLOP: tf32 (145 TFLOP/s) is far ahead of fp32 (16 TFLOP/s)
    assert conv(heavy) == pytest.approx(
        {"conv_dense": heavy / (A100.tf32 * RATES.tf32_conv), "layout": transposes}, rel=1e-9
    )
    # 10 GFLOP: fp32 takes 0.62 ms, tf32 0.59 ms (its bytes) + 0.85 ms of transposes
    medium = 1e10
    fp32 = medium / (A100.fp32 * RATES.conv_fp32)
    assert moving < fp32 < moving + transposes
    assert conv(medium) == pytest.approx({"conv_dense": fp32})
    tiny = 1e9  # a 1x1 convolution of few channels: bound by its bytes either way, no transposes
    assert conv(tiny) == pytest.approx({"conv_dense": moving})
    # a GeForce card's tf32 peak is its fp32 one: the fp32 kernel wins a real convolution
    rtx3090 = lookup("RTX 3090")
    assert rtx3090.tf32 == rtx3090.fp32
    trace = record_step(conv_net(1, False), memfit.Settings(micro_batch_size=16))
    assert "layout" not in predict(trace, rtx3090, 16, tf32_conv=True).by_class
    assert predict(trace, A100, 16, tf32_conv=True).by_class["layout"] > 0


def test_a_step_of_tiny_kernels_is_bound_by_the_host() -> None:
    counter = OpCounter(step=0)
    for _ in range(50):
        counter.add(Kind.KERNEL, 0, 64, DType.SINGLE, phase="forward")
    assert predict(counter.trace(), A100, 1).bound_by == "host"


def test_estimate_json_and_text_show_the_time_by_kernel_class(capsys: pytest.CaptureFixture[str]) -> None:
    ref = "mlp:layers=2,width=256,features=256"
    assert main(["estimate", ref, "--gpu", "A100 80GB SXM", "--batch-size", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    classes = data["predicted_time"]["by_class"]
    assert "gemm" in classes and data["predicted_time"]["bound_by"] in {*classes, "host"}
    assert list(classes.values()) == sorted(classes.values(), reverse=True)
    assert main(["estimate", ref, "--gpu", "A100 80GB SXM", "--batch-size", "4096"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Bound by" in out and "GPU time by kernel class" in out and "gemm" in out


def test_the_report_page_shows_the_estimates_time_by_kernel_class() -> None:
    from memfit.reporting.pages import results_html

    estimate = memfit.estimate("mlp:layers=1,width=64,features=64", 64, gpu="RTX 4090", search=False)
    page = "\n".join(results_html(estimate=estimate.to_dict(), figures={}))
    assert "Predicted time by kernel class" in page and "gemm" in page
