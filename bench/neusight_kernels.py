"""memfit's kernel rates against single kernels NeuSight measured on six GPUs.

NeuSight's artifact (Lee et al., ASPLOS 2025; github.com/trsharm25/NeuSight, commit db1fdc9)
holds the test set its paper predicts: single PyTorch 2.1.0 operations timed on each GPU
(``scripts/asplos/data/dataset/test/{linear,bmm,elem,ln,softmax}.csv``; the loop of
``neusight/Dataset/collect.py``: CUDA events around one call, the mean of the fastest 5 of
25 calls, fp32 with tf32 off). Each kernel is recorded here as memfit records an operation
(fake tensors through :class:`memfit.estimator.timing.OpCounter`, the op as the script
called it) and predicted on its card with PyTorch 2.1's streaming kernels
(:func:`memfit.estimator.kernel_rates.elements_per_thread`).

Two things come out:

- **each card's fp32 matmul efficiency** (:func:`fp32_matmul_efficiencies`): for every
  product of at least :data:`LARGE_FLOPS`, the efficiency that would make memfit's time
  exact (its rate x predicted / measured, tile and wave quantization left in the model),
  and their median per card. These are the figures of
  :data:`memfit.estimator.kernel_rates.MEASURED_FP32_MATMUL`, rounded to three places; the
  script ends with status 1, writing nothing, where the table and what it derives differ
  (:func:`disagreements`).
- **the share of the streaming bandwidth PyTorch's layer norm and softmax reach**
  (:func:`streaming_shares`): for every such kernel of at least :data:`SHORTEST_SECONDS`,
  memfit's time at the full streaming rate / the time measured, and their median over the
  five cards that have them. These are
  :data:`~memfit.estimator.kernel_rates.LAYER_NORM_EFFICIENCY` and
  :data:`~memfit.estimator.kernel_rates.SOFTMAX_EFFICIENCY`, checked the same way.
- **memfit's error kernel by kernel** (:func:`kernel_errors`), per card and class, with the
  table's rates and with the one rate memfit takes for every card: the products below
  :data:`LARGE_FLOPS` are not the ones the efficiency was taken from, and the element-wise
  kernels had no part in any rate (the layer norm and softmax rows did, as a median over
  the cards).

The CSVs are not copied into this project (21 MB); the script reads them from a checkout.

Run: .venv/bin/python bench/neusight_kernels.py PATH_TO_NEUSIGHT [--docs]
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from _rate_check import Band, differences, exact_rate, finish, medians
from kernel_bench import record_call
from memfit.estimator.kernel_rates import (
    LAYER_NORM_EFFICIENCY,
    MEASURED_FP32_MATMUL,
    RATES,
    SOFTMAX_EFFICIENCY,
    Rates,
    elements_per_thread,
)
from memfit.estimator.timing import OpTrace, predict
from memfit.memory.gpus import GPU, lookup

#: NeuSight's device names (``torch.cuda.get_device_name()``) -> memfit's GPU table. Its
#: other test devices, the P100 PCIe and the P4, are not in the table.
CARDS = {
    "NVIDIA A100-PCIE-40GB": "A100 40GB",
    "NVIDIA A100 80GB PCIe": "A100 80GB PCIe",
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA L4": "L4",
    "Tesla T4": "T4",
    "Tesla V100-PCIE-32GB": "V100 PCIe 32GB",
}
#: the PyTorch the kernels ran (every row of the test set says p2.1.0)
TORCH = "2.1.0"
#: products of at least this many FLOPs give a card's efficiency (0.1 TFLOP: 5 ms on an L4,
#: 1.5 ms on an H100; long enough that a launch is nothing beside it)
LARGE_FLOPS = 1e11
#: kernels shorter than this are left out of the error table (a launch and CUDA events'
#: resolution are a few microseconds, which memfit does not count in a kernel's time)
SHORTEST_SECONDS = 50e-6
#: the CSVs the script reads
FILES = ("linear", "bmm", "elem", "ln", "softmax")
#: NeuSight's element-wise operations with a second tensor; the others take a Python number
_BINARY = {"add", "mul", "div", "pow"}


@dataclass(frozen=True)
class Kernel:
    """One measured operation: NeuSight's name, memfit's card, its dimensions, seconds."""

    op: str
    card: str
    dims: tuple[int, ...]
    seconds: float

    @property
    def flops(self) -> float:
        """A product's FLOPs (2 x b x m x n x k), 0 for the others."""
        if self.op not in ("linear", "bmm"):
            return 0.0
        b, m, n, k = self.dims
        return 2.0 * b * m * n * k

    @property
    def kind(self) -> str:
        """The row of the error table: ``matmul`` (linear and bmm), ``elementwise``, ``ln``,
        ``softmax``."""
        if self.op in ("linear", "bmm"):
            return "matmul"
        return self.op if self.op in ("ln", "softmax") else "elementwise"


def read(root: Path) -> list[Kernel]:
    """The test set's kernels on the cards of :data:`CARDS`.

    Args:
        root: a checkout of NeuSight (the folder holding ``scripts/``).

    Raises:
        SystemExit: the checkout lacks a CSV (one line, status 2).
    """
    folder = root / "scripts" / "asplos" / "data" / "dataset" / "test"
    missing = [name for name in FILES if not (folder / f"{name}.csv").is_file()]
    if missing:
        print(f"neusight_kernels: no {', '.join(missing)} CSV under {folder}", file=sys.stderr)
        raise SystemExit(2)
    kernels = []
    for name in FILES:
        with open(folder / f"{name}.csv", newline="") as f:
            for row in csv.DictReader(f):
                card = CARDS.get(row["Device"])
                if card is None:
                    continue
                if row["Torch Version"] != f"p{TORCH}":
                    raise ValueError(f"{name}.csv: a row of PyTorch {row['Torch Version']}, not {TORCH}")
                if name in ("linear", "bmm"):
                    dims: tuple[int, ...] = tuple(int(row[k]) for k in ("B", "M", "N", "K"))
                else:
                    dims = (int(row["B"]), int(row["H"]))
                kernels.append(Kernel(row["OPName"], card, dims, float(row["Latency"]) / 1e3))
    return kernels


def _operation(kernel: Kernel) -> Callable[[], Any]:
    """The call NeuSight's collect.py timed, on fake tensors (fp32)."""
    if kernel.op == "linear":
        b, m, n, k = kernel.dims
        x, w, bias = torch.empty(b, m, n), torch.empty(k, n), torch.empty(k)
        return lambda: torch.nn.functional.linear(x, w, bias)
    if kernel.op == "bmm":
        b, m, n, k = kernel.dims
        x, y = torch.empty(b, m, n), torch.empty(b, n, k)
        return lambda: torch.bmm(x, y)
    x = torch.empty(kernel.dims)
    if kernel.op == "ln":
        w, bias = torch.empty(kernel.dims[-1]), torch.empty(kernel.dims[-1])
        return lambda: torch.nn.functional.layer_norm(x, (kernel.dims[-1],), w, bias)
    if kernel.op == "softmax":
        return lambda: torch.softmax(x, dim=-1)
    if kernel.op in _BINARY:
        y = torch.empty(kernel.dims)
        return lambda: getattr(torch, kernel.op)(x, y)
    unary: dict[str, Callable[[torch.Tensor], Any]] = {
        "addu": lambda t: torch.add(t, 0.5),
        "mulu": lambda t: torch.mul(t, 0.5),
        "divu": lambda t: torch.div(t, 0.5),
        "powu": lambda t: torch.pow(t, 0.5),
        "relu": torch.relu,
        "gelu": torch.nn.functional.gelu,
        "tanh": torch.tanh,
    }
    if kernel.op not in unary:
        raise ValueError(f"an operation this script does not know: {kernel.op!r}")
    op = unary[kernel.op]
    return lambda: op(x)


@functools.cache
def _trace(op: str, dims: tuple[int, ...]) -> OpTrace:
    """The operation as memfit records it (the same on every card)."""
    return record_call(lambda: _operation(Kernel(op, "", dims, 0.0)))


def predicted_seconds(kernel: Kernel, gpu: GPU, rates: Rates = RATES) -> tuple[float, float]:
    """(memfit's GPU seconds for the kernel on ``gpu``, of which matrix products')."""
    time = predict(_trace(kernel.op, kernel.dims), gpu, 1, tf32_matmul=False, tf32_conv=False, rates=rates,
                   per_thread=elements_per_thread(TORCH))  # fmt: skip
    return sum(time.by_class.values()), time.by_class.get("gemm", 0.0)


def implied_efficiency(kernel: Kernel, gpu: GPU, rates: Rates = RATES) -> float:
    """The fp32 matmul efficiency that makes memfit's time for ``kernel`` exact, the rest of
    its predicted time (a bias's add, say) taken as right; NaN where no efficiency can (the
    product's bytes alone take longer than measured).

    A product's time is the larger of its FLOPs' and its bytes' (``kernel_seconds``), so the
    efficiency scales only the first: each is predicted apart, the other made free.
    """
    rates = rates.for_card(gpu.name)
    total, gemm = predicted_seconds(kernel, gpu, rates)
    _, computing = predicted_seconds(kernel, gpu, replace(rates, stream=1e6, latency=0.0, layout=1e6))
    _, moving = predicted_seconds(kernel, gpu, replace(rates, gemm_fp32=1e6, fp32_matmul_by_card=()))
    return exact_rate(rates.gemm_fp32, computing, moving, kernel.seconds - (total - gemm))


def fp32_matmul_efficiencies(kernels: Iterable[Kernel]) -> dict[str, tuple[float, int]]:
    """(median implied efficiency, products) per card over the products of at least
    :data:`LARGE_FLOPS` (those no efficiency can make exact left out: none in the test set)."""
    found: dict[str, list[float]] = defaultdict(list)
    rates = replace(RATES, fp32_matmul_by_card=())
    for kernel in kernels:
        if kernel.flops >= LARGE_FLOPS:
            efficiency = implied_efficiency(kernel, lookup(kernel.card), rates)
            if not math.isnan(efficiency):
                found[kernel.card].append(efficiency)
    return medians(found)


#: the rate of :class:`~memfit.estimator.kernel_rates.Rates` each streaming operation gives
SHARES = {"ln": "layer_norm", "softmax": "softmax"}


def streaming_shares(kernels: Iterable[Kernel]) -> dict[str, tuple[float, int]]:
    """(median share, kernels) per rate of :data:`SHARES`: memfit's time for each layer norm
    or softmax of at least :data:`SHORTEST_SECONDS` at the full streaming rate (share 1) /
    the time measured, over every card."""
    found: dict[str, list[float]] = defaultdict(list)
    full = replace(RATES, **dict.fromkeys(SHARES.values(), 1.0))
    for kernel in kernels:
        if kernel.op in SHARES and kernel.seconds >= SHORTEST_SECONDS:
            total, _ = predicted_seconds(kernel, lookup(kernel.card), full)
            found[SHARES[kernel.op]].append(total / kernel.seconds)
    return medians(found)


def disagreements(efficiencies: dict[str, tuple[float, int]], shares: dict[str, tuple[float, int]]) -> list[str]:
    """Where :data:`~memfit.estimator.kernel_rates.MEASURED_FP32_MATMUL` (``efficiencies``:
    :func:`fp32_matmul_efficiencies`), :data:`~memfit.estimator.kernel_rates.LAYER_NORM_EFFICIENCY`
    or :data:`~memfit.estimator.kernel_rates.SOFTMAX_EFFICIENCY` (``shares``:
    :func:`streaming_shares`) is not what the kernels give, rounded to three places as the
    module holds them: one line each."""
    table = {**MEASURED_FP32_MATMUL, "layer_norm": LAYER_NORM_EFFICIENCY, "softmax": SOFTMAX_EFFICIENCY}
    derived = {name: value for name, (value, _) in {**efficiencies, **shares}.items()}
    return differences(table, derived, "kernels")


def kernel_errors(kernels: Iterable[Kernel], rates: Rates = RATES) -> dict[tuple[str, str], Band]:
    """memfit's error on each kernel's time, (predicted - measured) / measured in per cent, by
    (card, row): ``matmul, large`` (the products the efficiency came from), ``matmul,
    smaller``, ``elementwise``, ``ln``, ``softmax``; kernels under :data:`SHORTEST_SECONDS`
    left out."""
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    for kernel in kernels:
        if kernel.seconds < SHORTEST_SECONDS:
            continue
        total, _ = predicted_seconds(kernel, lookup(kernel.card), rates)
        row = kernel.kind
        if row == "matmul":
            row += ", large" if kernel.flops >= LARGE_FLOPS else ", smaller"
        found[(kernel.card, row)].append(100.0 * (total - kernel.seconds) / kernel.seconds)
    return {key: Band.of(v) for key, v in sorted(found.items())}


def report(
    kernels: list[Kernel],
    efficiencies: dict[str, tuple[float, int]],
    shares: dict[str, tuple[float, int]],
    started: float,
) -> str:
    """The docs section: each card's efficiency (``efficiencies``: :func:`fp32_matmul_efficiencies`
    of ``kernels``), the layer norm's and softmax's shares (``shares``: :func:`streaming_shares`),
    and the error table with and without the cards' efficiencies (``started``:
    ``time.perf_counter()`` when the run began)."""
    with_table = kernel_errors(kernels)
    without = kernel_errors(kernels, replace(RATES, fp32_matmul_by_card=()))
    seconds = time.perf_counter() - started
    lines = [
        "## Kernel by kernel: memfit against single kernels NeuSight measured",
        "",
        f"Command: `python bench/neusight_kernels.py PATH_TO_NEUSIGHT --docs` (torch {torch.__version__}, "
        f"{seconds:.0f} s; no GPU).",
        "",
        "NeuSight's test set (its artifact's `scripts/asplos/data/dataset/test/*.csv`, commit db1fdc9): "
        f"{len(kernels)} single fp32 operations of PyTorch {TORCH} (tf32 off) timed by CUDA events on six "
        "cards of memfit's table, each predicted as memfit predicts that operation in a step. "
        f"The fp32 matmul efficiency of each card is the median, over its products of at least "
        f"{LARGE_FLOPS / 1e9:.0f} GFLOP, of the efficiency that makes memfit's time exact "
        "(`memfit.estimator.kernel_rates.MEASURED_FP32_MATMUL`; memfit takes "
        f"{RATES.gemm_fp32:.3f} on every other card):",
        "",
        "| card | datasheet fp32 peak | products | fp32 matmul efficiency | achieved |",
        "|---|---:|---:|---:|---:|",
    ]
    for card, (efficiency, count) in efficiencies.items():
        peak = lookup(card).fp32
        lines.append(
            f"| {card} | {peak / 1e12:.1f} TFLOP/s | {count} | {efficiency:.3f} | {efficiency * peak / 1e12:.1f} TFLOP/s |"
        )
    lines += [
        "",
        "PyTorch's layer norm and softmax against an element-wise kernel: the median, over their "
        f"kernels of {SHORTEST_SECONDS * 1e6:.0f} us and more on every card, of memfit's time at the full "
        "streaming rate / the time measured (`LAYER_NORM_EFFICIENCY`, `SOFTMAX_EFFICIENCY`; "
        "forward kernels only, given to the backward ones too):",
        "",
        "| kernel | kernels | share of the streaming bandwidth |",
        "|---|---:|---:|",
        *(f"| {rate} | {count} | {share:.3f} |" for rate, (share, count) in shares.items()),
        "",
        "Error on each kernel's time, (predicted - measured) / measured, median |error| (median error), "
        f"kernels of {SHORTEST_SECONDS * 1e6:.0f} us and more; 'large' products are the ones the "
        "efficiency was taken from, so their median error is near 0 by construction; the smaller "
        "products and the element-wise kernels had no part in any rate, the ln and softmax rows only "
        "through the median over the cards:",
        "",
        "| card | kernels | kernels timed | with the card's efficiency | with one efficiency for every card |",
        "|---|---|---:|---:|---:|",
    ]
    for (card, row), band in with_table.items():
        other = without[(card, row)]
        lines.append(
            f"| {card} | {row} | {band.count} | {band.median_abs:.1f} % ({band.median:+.1f} %) | "
            f"{other.median_abs:.1f} % ({other.median:+.1f} %) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("neusight", type=Path, help="a checkout of github.com/trsharm25/NeuSight")
    parser.add_argument("--docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    kernels = read(args.neusight)
    efficiencies, shares = fp32_matmul_efficiencies(kernels), streaming_shares(kernels)
    text = report(kernels, efficiencies, shares, started)
    wrong = disagreements(efficiencies, shares)
    return finish(
        text, wrong, script="neusight_kernels", measured="kernels", section="neusight-kernels", docs=args.docs
    )


if __name__ == "__main__":
    sys.exit(main())
