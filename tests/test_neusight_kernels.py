"""The rates measured on NeuSight's single kernels (issue 22): the fp32 matmul efficiency per
card and the layer norm's and softmax's shares of the streaming bandwidth, where the prediction
takes them, and bench/neusight_kernels.py, which derives and checks them."""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from memfit.estimator.kernel_classes import Classified
from memfit.estimator.kernel_rates import (
    GEMM_EFFICIENCY,
    LAYER_NORM_EFFICIENCY,
    MEASURED_FP32_MATMUL,
    RATES,
    SOFTMAX_EFFICIENCY,
    KernelClass,
)
from memfit.estimator.timing import DType, Kind, OpCounter, predict
from memfit.memory.gpus import lookup

UNIFORM = replace(RATES, fp32_matmul_by_card=())


@pytest.fixture
def kernels(bench_module) -> ModuleType:
    return bench_module("neusight_kernels")


def _product(kind: Kind, dtype: DType = DType.SINGLE) -> OpCounter:
    cls = KernelClass.GEMM if kind == Kind.MATMUL else KernelClass.CONV_DENSE
    counter = OpCounter(step=0)
    counter.add(kind, 2 * 8192**3, 1e6, dtype, phase="forward", shape=Classified(cls, 8192, 8192, 8192, 1))
    return counter


def test_an_fp32_matmul_takes_the_cards_measured_efficiency_and_nothing_else_does() -> None:
    l4, rtx3090 = lookup("L4"), lookup("RTX 3090")
    assert "RTX 3090" not in MEASURED_FP32_MATMUL and MEASURED_FP32_MATMUL["L4"] < GEMM_EFFICIENCY

    def gpu_seconds(counter: OpCounter, gpu, rates=RATES, tf32=False) -> float:
        return sum(predict(counter.trace(), gpu, 1, tf32_matmul=tf32, tf32_conv=tf32, rates=rates).by_class.values())

    matmul = _product(Kind.MATMUL)
    assert gpu_seconds(matmul, l4) / gpu_seconds(matmul, l4, UNIFORM) == pytest.approx(
        GEMM_EFFICIENCY / MEASURED_FP32_MATMUL["L4"]
    )
    # a card without a measurement, fp32 convolutions, 16-bit and tf32 products: unchanged
    assert gpu_seconds(matmul, rtx3090) == gpu_seconds(matmul, rtx3090, UNIFORM)
    for counter, tf32 in ((_product(Kind.CONV), False), (_product(Kind.MATMUL, DType.HALF), False), (matmul, True)):
        assert gpu_seconds(counter, l4, tf32=tf32) == gpu_seconds(counter, l4, UNIFORM, tf32=tf32)
    assert RATES.for_card("L4").gemm_fp32 == MEASURED_FP32_MATMUL["L4"]
    assert UNIFORM.for_card("L4") is UNIFORM


def test_the_implied_efficiency_makes_the_prediction_exact(kernels: ModuleType) -> None:
    l4 = lookup("L4")
    product = kernels.Kernel("linear", "L4", (1, 32768, 4096, 1024), 1.0)
    for efficiency in (0.2, 0.5, 0.9):
        # the time memfit gives this product at that efficiency, as if it had been measured
        seconds, _ = kernels.predicted_seconds(product, l4, replace(UNIFORM, gemm_fp32=efficiency))
        measured = replace(product, seconds=seconds)
        assert kernels.implied_efficiency(measured, l4, UNIFORM) == pytest.approx(efficiency, rel=1e-6)
        # the card's own rate is the reference wherever the table has one
        assert kernels.implied_efficiency(measured, l4) == pytest.approx(efficiency, rel=1e-6)
    # a product of 4096 x 4096 outputs reducing 8: bound by its bytes, whatever its efficiency
    thin = kernels.Kernel("bmm", "L4", (16, 4096, 8, 4096), 0.0)
    floor, _ = kernels.predicted_seconds(thin, l4, replace(UNIFORM, gemm_fp32=1e6))
    assert math.isnan(kernels.implied_efficiency(replace(thin, seconds=0.9 * floor), l4))
    assert kernels.implied_efficiency(replace(thin, seconds=3 * floor), l4) > 0


_HEADER = {
    "linear": ["OPName", "Latency", "Device", "Torch Version", "B", "M", "N", "K"],
    "bmm": ["OPName", "Latency", "Device", "Torch Version", "B", "M", "N", "K"],
    "elem": ["OPName", "Latency", "Device", "Torch Version", "B", "H"],
    "ln": ["OPName", "Latency", "Device", "Torch Version", "B", "H"],
    "softmax": ["OPName", "Latency", "Device", "Torch Version", "B", "H"],
}


def _checkout(root: Path, rows: dict[str, list[list[object]]]) -> Path:
    folder = root / "scripts" / "asplos" / "data" / "dataset" / "test"
    folder.mkdir(parents=True)
    for name, header in _HEADER.items():
        with open(folder / f"{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(rows.get(name, []))
    return root


def test_the_test_sets_rows_are_read_on_memfits_cards_and_bad_checkouts_refused(
    kernels: ModuleType, tmp_path: Path
) -> None:
    # rows as NeuSight's CSVs hold them (their other columns left out): the L4 one is the
    # second row of its test/linear.csv
    rows = {
        "linear": [
            ["linear", 26.540971120198567, "NVIDIA L4", "p2.1.0", 1, 32768, 4096, 1024],
            ["linear", 5.0, "Tesla P100-PCIE-16GB", "p2.1.0", 1, 32768, 4096, 1024],  # not in memfit's table
        ],
        "elem": [["gelu", 0.9, "Tesla V100-PCIE-32GB", "p2.1.0", 32768, 1600]],
    }
    found = kernels.read(_checkout(tmp_path / "a", rows))
    assert found == [
        kernels.Kernel("linear", "L4", (1, 32768, 4096, 1024), 26.540971120198567e-3),
        kernels.Kernel("gelu", "V100 PCIe 32GB", (32768, 1600), 0.9e-3),
    ]
    assert [k.kind for k in found] == ["matmul", "elementwise"]
    assert found[0].flops == 2.0 * 32768 * 4096 * 1024 and found[1].flops == 0.0
    # the L4 ran that product at about a third of the efficiency memfit takes for an unmeasured card
    assert kernels.fp32_matmul_efficiencies(found) == {
        "L4": (pytest.approx(kernels.implied_efficiency(found[0], lookup("L4"))), 1)
    }
    assert kernels.fp32_matmul_efficiencies(found)["L4"][0] < 0.5 * GEMM_EFFICIENCY

    with pytest.raises(SystemExit) as exit_:
        kernels.read(tmp_path / "nothing")
    assert exit_.value.code == 2
    other = {"ln": [["ln", 0.8, "NVIDIA L4", "p2.4.1", 32768, 1600]]}
    with pytest.raises(ValueError, match=r"PyTorch p2\.4\.1"):
        kernels.read(_checkout(tmp_path / "b", other))


def test_the_error_table_keeps_the_efficiencys_products_apart(kernels: ModuleType) -> None:
    l4 = lookup("L4")
    large = kernels.Kernel("linear", "L4", (1, 32768, 4096, 1024), 0.0)
    small = kernels.Kernel("linear", "L4", (1, 4096, 1024, 1024), 0.0)
    short = kernels.Kernel("relu", "L4", (64, 64), 1e-6)  # under SHORTEST_SECONDS: left out
    timed = [replace(k, seconds=2 * kernels.predicted_seconds(k, l4)[0]) for k in (large, small)] + [short]
    table = kernels.kernel_errors(timed)
    assert set(table) == {("L4", "matmul, large"), ("L4", "matmul, smaller")}
    assert table[("L4", "matmul, large")].median == pytest.approx(-50.0)
    assert table[("L4", "matmul, smaller")].count == 1


def test_the_layer_norms_and_softmaxs_shares_make_their_median_kernel_exact(kernels: ModuleType) -> None:
    l4, t4 = lookup("L4"), lookup("T4")
    full = replace(RATES, layer_norm=1.0, softmax=1.0)
    timed = []
    for op, dims, card, gpu, slower in (
        ("ln", (32768, 1024), "L4", l4, 1.25),
        ("ln", (16384, 2048), "T4", t4, 2.0),
        ("ln", (8192, 4096), "T4", t4, 1.5),
        ("softmax", (32768, 1024), "L4", l4, 1.1),
    ):
        kernel = kernels.Kernel(op, card, dims, 0.0)
        full_rate, _ = kernels.predicted_seconds(kernel, gpu, full)
        timed.append(replace(kernel, seconds=slower * full_rate))
    # a kernel under SHORTEST_SECONDS and a product: no part in the shares
    timed.append(kernels.Kernel("softmax", "L4", (64, 64), 1e-6))
    timed.append(kernels.Kernel("linear", "L4", (1, 4096, 1024, 1024), 1.0))
    shares = kernels.streaming_shares(timed)
    assert shares == {"layer_norm": (pytest.approx(1 / 1.5), 3), "softmax": (pytest.approx(1 / 1.1), 1)}
    # with its share, the median layer norm is predicted as measured
    median = timed[2]
    seconds, _ = kernels.predicted_seconds(median, t4, replace(RATES, layer_norm=shares["layer_norm"][0]))
    assert seconds == pytest.approx(median.seconds)


def test_a_table_that_differs_from_the_kernels_is_reported_and_nothing_written(
    kernels: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    agreeing = {card: (value, 10) for card, value in MEASURED_FP32_MATMUL.items()}
    shares = {"layer_norm": (LAYER_NORM_EFFICIENCY, 390), "softmax": (SOFTMAX_EFFICIENCY, 390)}
    assert kernels.disagreements(agreeing, shares) == []
    # within the module's three places: agrees; past them, or a name missing either side: one line each
    agreeing["L4"] = (MEASURED_FP32_MATMUL["L4"] + 4e-4, 10)
    assert kernels.disagreements(agreeing, shares) == []
    off = dict(agreeing, L4=(0.5, 10), **{"RTX 3090": (0.7, 3)})
    del off["T4"]
    assert kernels.disagreements(off, {"softmax": (0.5, 1)}) == [
        f"L4: the table has {MEASURED_FP32_MATMUL['L4']}, the kernels give 0.5",
        "RTX 3090: the table has None, the kernels give 0.7",
        f"T4: the table has {MEASURED_FP32_MATMUL['T4']}, the kernels give None",
        f"layer_norm: the table has {LAYER_NORM_EFFICIENCY}, the kernels give None",
        f"softmax: the table has {SOFTMAX_EFFICIENCY}, the kernels give 0.5",
    ]

    # one L4 product timed twice as fast as the table's efficiency makes it: refused, docs untouched
    l4 = lookup("L4")
    product = kernels.Kernel("linear", "L4", (1, 32768, 4096, 1024), 0.0)
    seconds, _ = kernels.predicted_seconds(product, l4)
    root = _checkout(tmp_path, {"linear": [["linear", seconds / 2 * 1e3, "NVIDIA L4", "p2.1.0", 1, 32768, 4096, 1024]]})
    written: list[str] = []
    monkeypatch.setitem(sys.modules, "_results", SimpleNamespace(write_section=written.append))
    assert kernels.main([str(root), "--docs"]) == 1
    assert written == []
    err = capsys.readouterr().err
    assert "memfit's rates differ" in err and "L4: the table has" in err
