"""memfit's matrix products against XLA's measured GEMM table (H100 and B200).

XLA's GPU compiler ships a table of matrix-product throughputs measured on the cards it
schedules for (openxla/xla, ``xla/service/gpu/model/matmul_interpolator_data.h``, written by
its ``xla/tools/matmul_perf_table_gen``: each batched product ``[b, m, k] x [b, k, n]`` run
as one HLO dot, its kernels timed by XLA's kernel tracer after a warm-up run). At commit
e97611c (February 2026) it holds 375 products a card, b in {1, 2, 4} and m, n, k from 256
to 4096, for ``sm_90`` (the H100 SXM: the file names no card, XLA's op profiles in the same
folder name the "NVIDIA H100 80GB HBM3" for sm_90) and ``sm_100_B200``, in bf16 and in f32.
XLA runs f32 dots at its default precision on tf32 tensor cores (403 TFLOP/s at 4096^3 on
the H100: six times its fp32 peak), so the f32 column is a tf32 one. Its fp8 columns are not
read (the H100's reach 2.4 PFLOP/s at 4096^3, above the card's dense fp8 peak of 1.98, so
they measure something other than what their name says).

Each product is recorded as memfit records a ``torch.bmm`` (fake tensors through
:class:`memfit.estimator.timing.OpCounter`) and predicted on its card. Two things come out:

- **each card's tf32 matmul efficiency** (:func:`tf32_efficiencies`): for every product of
  at least :data:`LARGE_FLOPS`, the efficiency that would make memfit's time exact (its
  rate x predicted / measured, tile and wave quantization left in the model), and their
  median per card. These are the figures of
  :data:`memfit.estimator.kernel_rates.MEASURED_TF32_MATMUL`, rounded to three places; the
  script ends with status 1, writing nothing, where the table and what it derives differ
  (:func:`disagreements`).
- **memfit's error product by product** (:func:`product_errors`), by card, arithmetic and
  size: the 16-bit rows check :data:`~memfit.estimator.kernel_rates.GEMM_EFFICIENCY` (taken
  from another source, Stas Bekman's maximum achievable matmul FLOPS) and the tile and wave
  model on shapes no rate was taken from.

The header is not copied into this project (Apache-2.0, 316 kB); the script reads it.

Run: .venv/bin/python bench/xla_matmul_table.py PATH_TO_matmul_interpolator_data.h [--docs]
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from _rate_check import Band, differences, exact_rate, finish, medians
from kernel_bench import record_call
from memfit.estimator.kernel_rates import MEASURED_TF32_MATMUL, RATES, Rates
from memfit.estimator.timing import OpTrace, predict
from memfit.memory.gpus import GPU, lookup

#: XLA's keys for the cards -> memfit's GPU table (see the module for the H100's)
CARDS = {"sm_90": "H100 SXM", "sm_100_B200": "B200", "sm_100": "B200"}
#: XLA's names of the two columns this script reads -> the arithmetic memfit times them in
MODES = {"bf16xbf16->bf16": "bf16", "f32xf32->f32": "tf32"}
#: products of at least this many FLOPs give a card's efficiency (as bench/neusight_kernels.py:
#: 0.1 TFLOP, 0.2 ms on an H100 in tf32; long enough that a launch is little beside it)
LARGE_FLOPS = 1e11

_TABLE = re.compile(r'entries\s*\{\s*key:\s*"(?P<key>sm_[0-9A-Za-z_]+)"')
_PRODUCT = re.compile(
    r"b:\s*(?P<b>\d+)\s+m:\s*(?P<m>\d+)\s+n:\s*(?P<n>\d+)\s+k:\s*(?P<k>\d+)\s+(?P<flops>(?:flops\s*\{[^}]*\}\s*)+)"
)
_FLOPS = re.compile(r'key:\s*"(?P<name>[^"]+)"\s+value:\s*(?P<value>\d+)')


@dataclass(frozen=True)
class Product:
    """One measured product: memfit's card, its arithmetic, b x (m x k)(k x n), FLOP/s."""

    card: str
    mode: str
    dims: tuple[int, int, int, int]
    flops_per_second: float

    @property
    def flops(self) -> float:
        b, m, n, k = self.dims
        return 2.0 * b * m * n * k

    @property
    def seconds(self) -> float:
        return self.flops / self.flops_per_second


def parse(text: str) -> list[Product]:
    """The products of the cards of :data:`CARDS` in the columns of :data:`MODES`.

    Args:
        text: the header's text (its textproto between ``BEGIN_DEFAULT_PERF_TABLE`` and
            ``END_DEFAULT_PERF_TABLE``; the rest is ignored).

    >>> parse('entries { key: "sm_90" value { entries { b: 1 m: 256 n: 512 k: 1024 '
    ...       'flops { key: "f32xf32->f32" value: 2000000000000 } } } }')
    [Product(card='H100 SXM', mode='tf32', dims=(1, 256, 512, 1024), flops_per_second=2000000000000.0)]
    """
    tables = list(_TABLE.finditer(text))
    products = []
    for table, following in zip(tables, [*tables[1:], None]):
        card = CARDS.get(table["key"])
        if card is None:
            continue
        body = text[table.end() : following.start() if following else len(text)]
        for found in _PRODUCT.finditer(body):
            dims = (int(found["b"]), int(found["m"]), int(found["n"]), int(found["k"]))
            for column in _FLOPS.finditer(found["flops"]):
                mode = MODES.get(column["name"])
                if mode is not None and int(column["value"]) > 0:
                    products.append(Product(card, mode, dims, float(column["value"])))
    return products


def read(path: Path) -> list[Product]:
    """The header's products (:func:`parse`).

    Raises:
        SystemExit: no such file, or no product of a card memfit knows (one line, status 2).
    """
    if not path.is_file():
        print(f"xla_matmul_table: no file {path}", file=sys.stderr)
        raise SystemExit(2)
    products = parse(path.read_text())
    if not products:
        print(f"xla_matmul_table: {path} holds no sm_90 or sm_100 product (is it matmul_interpolator_data.h?)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return products


@functools.cache
def _trace(mode: str, dims: tuple[int, int, int, int]) -> OpTrace:
    """``torch.bmm`` of the product as memfit records it (the same on every card)."""
    b, m, n, k = dims
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32

    def build() -> Callable[[], torch.Tensor]:
        x, y = torch.empty(b, m, k, dtype=dtype), torch.empty(b, k, n, dtype=dtype)
        return lambda: torch.bmm(x, y)

    return record_call(build)


def predicted_seconds(product: Product, gpu: GPU, rates: Rates = RATES) -> float:
    """memfit's GPU seconds for the product on ``gpu`` (tf32 on for the f32 column)."""
    time = predict(_trace(product.mode, product.dims), gpu, 1, tf32_matmul=product.mode == "tf32", rates=rates)
    return sum(time.by_class.values())


def implied_efficiency(product: Product, gpu: GPU, rates: Rates = RATES) -> float:
    """The tf32 matmul efficiency that makes memfit's time for a tf32 ``product`` exact; NaN
    where none can (its bytes alone take longer than measured).

    A product's time is the larger of its FLOPs' and its bytes' (``kernel_seconds``), so the
    efficiency scales only the first: each is predicted apart, the other made free.
    """
    rates = rates.for_card(gpu.name)
    computing = predicted_seconds(product, gpu, replace(rates, stream=1e6, latency=0.0))
    moving = predicted_seconds(product, gpu, replace(rates, tf32_matmul=1e6, tf32_matmul_by_card=()))
    return exact_rate(rates.tf32_matmul, computing, moving, product.seconds)


def tf32_efficiencies(products: Iterable[Product]) -> dict[str, tuple[float, int]]:
    """(median implied efficiency, products) per card over the tf32 products of at least
    :data:`LARGE_FLOPS` (those no efficiency can make exact left out)."""
    found: dict[str, list[float]] = defaultdict(list)
    rates = replace(RATES, tf32_matmul_by_card=())
    for product in products:
        if product.mode == "tf32" and product.flops >= LARGE_FLOPS:
            efficiency = implied_efficiency(product, lookup(product.card), rates)
            if not math.isnan(efficiency):
                found[product.card].append(efficiency)
    return medians(found)


def disagreements(efficiencies: dict[str, tuple[float, int]]) -> list[str]:
    """Where :data:`~memfit.estimator.kernel_rates.MEASURED_TF32_MATMUL` is not what the
    products give (``efficiencies``: :func:`tf32_efficiencies`), rounded to three places as
    the module holds them: one line each."""
    return differences(MEASURED_TF32_MATMUL, {card: value for card, (value, _) in efficiencies.items()}, "products")


def size_band(flops: float) -> str:
    """The row of the error table a product of ``flops`` falls in.

    >>> size_band(3e9), size_band(5e10), size_band(2e11)
    ('under 10 GFLOP', '10-100 GFLOP', 'from 100 GFLOP')
    """
    if flops >= LARGE_FLOPS:
        return "from 100 GFLOP"
    return "10-100 GFLOP" if flops >= LARGE_FLOPS / 10 else "under 10 GFLOP"


def product_errors(products: Iterable[Product], rates: Rates = RATES) -> dict[tuple[str, str, str], Band]:
    """memfit's error on each product's time, (predicted - measured) / measured in per cent,
    by (card, arithmetic, :func:`size_band`)."""
    found: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for product in products:
        predicted = predicted_seconds(product, lookup(product.card), rates)
        key = (product.card, product.mode, size_band(product.flops))
        found[key].append(100.0 * (predicted - product.seconds) / product.seconds)
    order = {"under 10 GFLOP": 0, "10-100 GFLOP": 1, "from 100 GFLOP": 2}
    return {
        key: Band.of(v)
        for key, v in sorted(found.items(), key=lambda item: (item[0][0], item[0][1], order[item[0][2]]))
    }


def report(products: list[Product], efficiencies: dict[str, tuple[float, int]], started: float) -> str:
    """The docs section: each card's tf32 efficiency (``efficiencies``: :func:`tf32_efficiencies`
    of ``products``) and the error table with the cards' tf32 efficiencies and with the
    calibrated convolution rate memfit gave tf32 products before (``started``:
    ``time.perf_counter()`` when the run began)."""
    with_table = product_errors(products)
    before = product_errors(products, replace(RATES, tf32_matmul=RATES.tf32_conv, tf32_matmul_by_card=()))
    seconds = time.perf_counter() - started
    lines = [
        "## Matrix products: memfit against XLA's measured GEMM table",
        "",
        f"Command: `python bench/xla_matmul_table.py PATH_TO_matmul_interpolator_data.h --docs` "
        f"(torch {torch.__version__}, {seconds:.0f} s; no GPU).",
        "",
        "XLA's default GEMM performance table (openxla/xla commit e97611c, "
        "`xla/service/gpu/model/matmul_interpolator_data.h`): "
        f"{len(products)} measured products (b x m x n x k, b 1 to 4, m, n, k 256 to 4096) on the H100 "
        "(its `sm_90` table) and the B200, in bf16 and in f32, which XLA runs on tf32 tensor cores "
        "(its fp8 columns are not read: the H100's exceed that card's dense fp8 peak). "
        "Each is predicted as memfit predicts a `torch.bmm` of that shape. The tf32 matmul efficiency of "
        "each card is the median, over its products of at least "
        f"{LARGE_FLOPS / 1e9:.0f} GFLOP, of the efficiency that makes memfit's time exact "
        "(`memfit.estimator.kernel_rates.MEASURED_TF32_MATMUL`; every other card takes their median, "
        f"{RATES.tf32_matmul:.3f}):",
        "",
        "| card | datasheet tf32 peak | products | tf32 matmul efficiency | achieved |",
        "|---|---:|---:|---:|---:|",
    ]
    for card, (efficiency, count) in efficiencies.items():
        peak = lookup(card).tf32 or 0.0
        lines.append(
            f"| {card} | {peak / 1e12:.1f} TFLOP/s | {count} | {efficiency:.3f} | {efficiency * peak / 1e12:.1f} TFLOP/s |"
        )
    lines += [
        "",
        "Error on each product's time, (predicted - measured) / measured, median |error| (median error). "
        "The bf16 rows use memfit's 16-bit efficiency, taken from another source (Bekman's maximum "
        f"achievable matmul FLOPS, {RATES.gemm_half:.3f}), so no bf16 product here had a part in any rate; "
        "the tf32 rows 'from 100 GFLOP' are the products the efficiency was taken from (median error near "
        "0 by construction). Products under 10 GFLOP last a few microseconds, where a kernel's fixed costs, "
        "which memfit counts between kernels and not in their time, dominate. 'Before': tf32 products at "
        f"the calibrated tf32 convolution rate ({RATES.tf32_conv:.2f}), which memfit gave them until this table "
        "was read.",
        "",
        "| card | arithmetic | size | products | memfit | before |",
        "|---|---|---|---:|---:|---:|",
    ]
    for (card, mode, band_name), band in with_table.items():
        other = before[(card, mode, band_name)]
        was = f"{other.median_abs:.1f} % ({other.median:+.1f} %)" if mode == "tf32" else "the same"
        lines.append(
            f"| {card} | {mode} | {band_name} | {band.count} | {band.median_abs:.1f} % ({band.median:+.1f} %) | {was} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("header", type=Path, help="XLA's xla/service/gpu/model/matmul_interpolator_data.h")
    parser.add_argument("--docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    products = read(args.header)
    efficiencies = tf32_efficiencies(products)
    text = report(products, efficiencies, started)
    wrong = disagreements(efficiencies)
    return finish(
        text, wrong, script="xla_matmul_table", measured="products", section="xla-matmul-table", docs=args.docs
    )


if __name__ == "__main__":
    sys.exit(main())
