"""The tf32 matmul efficiencies measured in XLA's GEMM table (issue 22) and
bench/xla_matmul_table.py, which derives and checks them."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from memfit.estimator.kernel_rates import MEASURED_TF32_MATMUL, RATES, TF32_MATMUL_EFFICIENCY
from memfit.memory.gpus import lookup

UNIFORM = replace(RATES, tf32_matmul_by_card=())


@pytest.fixture
def table(bench_module) -> ModuleType:
    return bench_module("xla_matmul_table")


def _header(entries: dict[str, list[tuple[int, int, int, int, dict[str, float]]]]) -> str:
    """A header shaped as XLA's (its textproto between the markers, C++ around it)."""
    lines = ["// Copyright", 'constexpr char kDefaultMatmulPTable[] = R"pb(', "// BEGIN_DEFAULT_PERF_TABLE"]
    for key, products in entries.items():
        lines += ["  entries {", f'    key: "{key}"', "    value {"]
        for b, m, n, k, flops in products:
            lines += ["      entries {", f"        b: {b}", f"        m: {m}", f"        n: {n}", f"        k: {k}"]
            lines += [f'        flops {{ key: "{name}" value: {int(value)} }}' for name, value in flops.items()]
            lines.append("      }")
        lines += ["    }", "  }"]
    lines += ["// END_DEFAULT_PERF_TABLE", ')pb";']
    return "\n".join(lines)


def test_the_median_of_the_cards_is_every_other_cards_tf32_efficiency() -> None:
    assert round((MEASURED_TF32_MATMUL["H100 SXM"] + MEASURED_TF32_MATMUL["B200"]) / 2, 3) == TF32_MATMUL_EFFICIENCY
    assert RATES.for_card("H100 SXM").tf32_matmul == MEASURED_TF32_MATMUL["H100 SXM"]
    assert RATES.for_card("A100 80GB SXM").tf32_matmul == TF32_MATMUL_EFFICIENCY
    # the convolutions' tf32 rate is another (calibrated) one, on every card
    assert RATES.for_card("H100 SXM").tf32_conv == RATES.tf32_conv


def test_the_implied_efficiency_makes_the_prediction_exact(table: ModuleType) -> None:
    h100 = lookup("H100 SXM")
    product = table.Product("H100 SXM", "tf32", (4, 4096, 4096, 2048), 1.0)
    for efficiency in (0.3, 0.6, 0.9):
        seconds = table.predicted_seconds(product, h100, replace(UNIFORM, tf32_matmul=efficiency))
        measured = replace(product, flops_per_second=product.flops / seconds)
        assert measured.seconds == pytest.approx(seconds)
        assert table.implied_efficiency(measured, h100, UNIFORM) == pytest.approx(efficiency, rel=1e-6)
        assert table.implied_efficiency(measured, h100) == pytest.approx(efficiency, rel=1e-6)
    # faster than its bytes can move: no efficiency makes it exact
    floor = table.predicted_seconds(product, h100, replace(UNIFORM, tf32_matmul=1e6))
    assert math.isnan(table.implied_efficiency(replace(product, flops_per_second=product.flops / (0.5 * floor)), h100))


def test_the_headers_products_are_read_for_memfits_cards_and_bad_files_refused(
    table: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = tmp_path / "matmul_interpolator_data.h"
    header.write_text(
        _header({
            "sm_100_B200": [(1, 256, 256, 256, {"bf16xbf16->bf16": 6.7e12, "f32xf32->f32": 6.0e12})],
            "sm_90": [(4, 4096, 4096, 4096, {"bf16xbf16->bf16": 7.8e14, "f32xf32->f32": 3.3e14,
                                             "f8e4m3fnxf8e4m3fn->bf16": 1e15})],  # fp8: not read
            "sm_86": [(1, 512, 512, 512, {"bf16xbf16->bf16": 1e13})],  # a card the table lacks
        })
    )  # fmt: skip
    found = table.read(header)
    assert found == [
        table.Product("B200", "bf16", (1, 256, 256, 256), 6.7e12),
        table.Product("B200", "tf32", (1, 256, 256, 256), 6.0e12),
        table.Product("H100 SXM", "bf16", (4, 4096, 4096, 4096), 7.8e14),
        table.Product("H100 SXM", "tf32", (4, 4096, 4096, 4096), 3.3e14),
    ]
    # only the large tf32 product gives an efficiency: 330 TFLOP/s of the H100's 494.5
    efficiencies = table.tf32_efficiencies(found)
    assert set(efficiencies) == {"H100 SXM"} and efficiencies["H100 SXM"][1] == 1
    assert 0.6 < efficiencies["H100 SXM"][0] < 330 / 494.5 * 1.05
    errors = table.product_errors(found)
    assert set(errors) == {
        ("B200", "bf16", "under 10 GFLOP"),
        ("B200", "tf32", "under 10 GFLOP"),
        ("H100 SXM", "bf16", "from 100 GFLOP"),
        ("H100 SXM", "tf32", "from 100 GFLOP"),
    }

    empty = tmp_path / "empty.h"
    empty.write_text(_header({"sm_86": [(1, 512, 512, 512, {"bf16xbf16->bf16": 1e13})]}))
    for bad, message in ((tmp_path / "nothing.h", "no file"), (empty, "holds no sm_90 or sm_100 product")):
        with pytest.raises(SystemExit) as exit_:
            table.read(bad)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_a_table_that_differs_from_the_products_is_reported_and_nothing_written(
    table: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    agreeing = {card: (value, 15) for card, value in MEASURED_TF32_MATMUL.items()}
    assert table.disagreements(agreeing) == []
    assert table.disagreements({**agreeing, "H100 SXM": (MEASURED_TF32_MATMUL["H100 SXM"] + 4e-4, 15)}) == []
    assert table.disagreements({"H100 SXM": (0.5, 15)}) == [
        f"B200: the table has {MEASURED_TF32_MATMUL['B200']}, the products give None",
        f"H100 SXM: the table has {MEASURED_TF32_MATMUL['H100 SXM']}, the products give 0.5",
    ]

    header = tmp_path / "matmul_interpolator_data.h"
    header.write_text(_header({"sm_90": [(4, 4096, 4096, 4096, {"f32xf32->f32": 2.0e14})]}))
    written: list[str] = []
    monkeypatch.setitem(sys.modules, "_results", SimpleNamespace(write_section=written.append))
    assert table.main([str(header), "--docs"]) == 1
    assert written == []
    err = capsys.readouterr().err
    assert "memfit's rates differ" in err and "H100 SXM: the table has" in err
