"""How fast each class of CUDA kernel runs on a card: the efficiencies, their sources, and
the tile and wave quantization of matrix products.

Why classes: one roofline for every kernel hides two errors that cancel (issue 22). A
large matrix product reaches most of the tensor-core peak; a grouped convolution, whose
per-group products are narrow, far less; a depthwise convolution does so little arithmetic
per byte that it is a memory-bound kernel, and a slow one; element-wise kernels, norms,
softmax and the optimizer stream memory at what the card achieves, not its datasheet peak;
cuDNN transposes NCHW activations for its tensor-core kernels. Each class is timed here
by its own rule (:func:`kernel_seconds`).

Where each figure comes from (:data:`RATES` holds them; a reader can check each):

- **matrix products** (cuBLAS) in 16 bits: :data:`GEMM_EFFICIENCY` of the peak, the median
  of the NVIDIA rows of Stas Bekman's "Maximum Achievable Matmul FLOPS" table
  (ml-engineering, compute/accelerator/README.md: A100 SXM 85.9 %, GH200 83.0 %, A100 PCIe
  82.2 %, H100 SXM 80.1 %), for a product that fills the card; a smaller one loses to
  **tile and wave quantization** (NVIDIA, "Matrix Multiplication Background User's Guide",
  sections "Tile Quantization" and "Wave Quantization"): the output is cut into tiles of
  :data:`TILE` (the guide's 256x128 and 128x128 examples; 128x128 here), one tile per SM per
  wave, so a product of 120 tiles on a card of 108 SMs runs two waves for 1.11 waves' work.
  cuBLAS splits K when there are fewer tiles than SMs (split-K), which this model allows
  while each split keeps :data:`MIN_SPLIT_K` of K. fp32 without tf32 runs on the CUDA cores
  at the same fraction of the fp32 peak (an assumption, stated), products and convolutions
  alike, except the products of the cards where single fp32 kernels were timed
  (:data:`MEASURED_FP32_MATMUL`, from NeuSight's artifact: 0.26 of the L4's datasheet peak,
  0.99 of the V100 PCIe's; :meth:`Rates.for_card`).
- **tf32 matrix products** (matmuls on fp32 tensors where PyTorch allows tf32): the
  efficiency measured on the cards of XLA's default GEMM performance table
  (:data:`MEASURED_TF32_MATMUL`: the H100 SXM and the B200, from openxla/xla's
  ``xla/service/gpu/model/matmul_interpolator_data.h``: 375 products a card, timed kernel
  by kernel, f32 dots at XLA's default precision, which runs them on tf32 tensor cores),
  :data:`TF32_MATMUL_EFFICIENCY` (their median) on every other card.
- **tf32 convolutions** and **convolutions** (cuDNN) by kind: dense, grouped, depthwise. No
  published microbenchmark gives these per card for the kernels PyTorch's training step
  runs, so they come from a **calibration set** of published training throughputs
  (``bench/predicted_speed.py``, rows marked ``calibration``: the RTX 3090 rows of timm's
  benchmark CSVs for some models and Lambda's A100 80GB SXM ResNet-50 rows), fitted once by
  ``python bench/predicted_speed.py --calibrate`` and checked only on the other rows
  (other models, other cards, other sources). The fitted values are written below with
  the date of the fit.
- **memory-bound kernels** (element-wise, normalization, softmax, reductions, the
  optimizer's foreach and fused kernels, gathers): :data:`STREAM_EFFICIENCY` of the peak
  bandwidth, 750 GB/s of the V100's 900 GB/s measured by Jia et al., "Dissecting the NVIDIA
  Volta GPU Architecture via Microbenchmarking" (arXiv:1804.06826, 2018). Depthwise
  convolutions and NCHW<->NHWC transposes run below it (calibrated, as above). PyTorch's
  **layer norm** and **softmax** kernels reach a measured share of what an element-wise
  kernel streams (:data:`LAYER_NORM_EFFICIENCY`, :data:`SOFTMAX_EFFICIENCY`: the median over
  the single kernels NeuSight's artifact timed on five cards, as for
  :data:`MEASURED_FP32_MATMUL`); they were timed forward only, and their backward kernels
  are given the same share (an assumption). Batch, group and RMS norms keep the streaming
  rate: no source here times them.
- **bytes in flight** (Little's law: bandwidth = bytes in flight / latency; Volkov,
  "Understanding Latency Hiding on GPUs", 2016): a streaming kernel of PyTorch has each
  thread load a fixed number of *elements* (:func:`elements_per_thread`), so a 16-bit kernel
  keeps half the bytes of an fp32 one in flight, and a card with many fast SMs may not hold
  enough to reach its bandwidth (PyTorch pull request 190546 states the mechanism: "the
  amount of in-flight memory requests per SM" of "thread-based kernels such as the
  vectorized elementwise kernel"). :func:`streaming_bandwidth` caps a kernel's bandwidth at
  SMs x resident threads per SM (:data:`RESIDENT_THREADS`) x elements per thread x element
  bytes / latency; the latency under load is calibrated (above).

>>> round(gemm_utilisation(4096, 4096, 4096, 1, 108), 3)  # 1024 tiles: 9.48 waves in 10
0.948
>>> round(gemm_utilisation(8192, 8192, 8192, 1, None), 3)  # no SM count: no wave loss
1.0
>>> from memfit.memory.gpus import lookup
>>> h100 = lookup("H100 SXM")
>>> # fp16 with 4 elements per thread (PyTorch 1.x) holds too few bytes in flight; fp32 does not
>>> round(streaming_bandwidth(h100, 2, 4) / 1e12, 2), round(streaming_bandwidth(h100, 4, 4) / 1e12, 2)
(1.66, 2.79)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

from memfit.environment.versions import version_tuple
from memfit.memory.gpus import GPU

__all__ = [
    "KernelClass",
    "Rates",
    "RATES",
    "SM_COUNT",
    "TILE",
    "MIN_SPLIT_K",
    "GEMM_EFFICIENCY",
    "STREAM_EFFICIENCY",
    "MEASURED_FP32_MATMUL",
    "MEASURED_TF32_MATMUL",
    "TF32_MATMUL_EFFICIENCY",
    "LAYER_NORM_EFFICIENCY",
    "SOFTMAX_EFFICIENCY",
    "sm_count",
    "RESIDENT_THREADS",
    "elements_per_thread",
    "streaming_bandwidth",
    "gemm_utilisation",
    "kernel_seconds",
    "Mode",
]


class KernelClass(IntEnum):
    """What a kernel is, as this module times it (stored in an ``array("b")``)."""

    ELEMENTWISE = 0
    GEMM = 1
    CONV_DENSE = 2
    CONV_GROUPED = 3
    CONV_DEPTHWISE = 4
    NORMALIZATION = 5
    SOFTMAX = 6
    REDUCTION = 7
    OPTIMIZER = 8
    ATTENTION = 9
    #: a view, an allocation or a read of a value: no kernel
    NONE = 10
    #: cuDNN's NCHW<->NHWC transposes around a tensor-core convolution (time of a conv's
    #: layout bytes; never an operation's own class)
    LAYOUT = 11
    #: PyTorch's layer norm, forward and backward (apart from NORMALIZATION: its own rate)
    LAYER_NORM = 12


class Mode(IntEnum):
    """The arithmetic a product runs in."""

    HALF = 0  # fp16 or bf16 on the tensor cores
    TF32 = 1  # fp32 tensors on tf32 tensor cores
    FP32 = 2  # fp32 on the CUDA cores


#: the output tile of one thread block of a matrix product (see the module)
TILE = (128, 128)
#: the least K one split of a split-K product keeps
MIN_SPLIT_K = 256
#: a product that fills the card, in 16 bits: fraction of the peak (see the module)
GEMM_EFFICIENCY = 0.826
#: a streaming kernel: fraction of the peak bandwidth (see the module)
STREAM_EFFICIENCY = 750 / 900
#: PyTorch's layer norm and softmax kernels: the share of an element-wise kernel's bandwidth
#: (:func:`streaming_bandwidth`) they reach, the median over NeuSight's test-set kernels of at
#: least 50 us (fp32 ``layer_norm`` and ``softmax`` over the last dimension, PyTorch 2.1.0,
#: forward only) on five cards (A100 40GB PCIe, A100 80GB PCIe, L4, T4, V100 PCIe 32GB) of
#: memfit's time for the kernel at the full rate / the time measured. Derived by ``python
#: bench/neusight_kernels.py PATH_TO_NEUSIGHT``. Why they fall short is not separated here
#: (both reduce each row before they write it).
LAYER_NORM_EFFICIENCY = 0.721
SOFTMAX_EFFICIENCY = 0.851
#: fp32 matrix products on the CUDA cores, measured on the card: the median, over NeuSight's
#: test-set products of at least 0.1 TFLOP (single fp32 ``linear`` and ``bmm`` calls of PyTorch
#: 2.1.0 timed by CUDA events; its artifact's scripts/asplos/data/dataset/test/), of the
#: efficiency that makes this module's time exact (tile and wave quantization left in).
#: Derived by ``python bench/neusight_kernels.py PATH_TO_NEUSIGHT``; a card missing here takes
#: :data:`GEMM_EFFICIENCY`. The low ones are the 70-75 W cards: the L4 and the T4 cannot hold the
#: clock their datasheet peak is rated at under a sustained load. The A100 40GB row is the PCIe
#: card's (the table's one entry covers the SXM4 card too).
MEASURED_FP32_MATMUL: dict[str, float] = {
    "A100 40GB": 0.845,  # 1610 products
    "A100 80GB PCIe": 0.934,  # 1816
    "H100 SXM": 0.771,  # 1806
    "L4": 0.264,  # 1421
    "T4": 0.470,  # 1305
    "V100 PCIe 32GB": 0.988,  # 641
}

#: tf32 matrix products, measured on the card: the median, over the products of at least
#: 0.1 TFLOP of XLA's default GEMM performance table (openxla/xla commit e97611c, February
#: 2026, ``xla/service/gpu/model/matmul_interpolator_data.h``: batched products of
#: b x m x n x k from 1 x 256^3 to 4 x 4096^3 timed kernel by kernel on each card; its "f32"
#: dots run at XLA's default precision, on tf32 tensor cores: 403 TFLOP/s at 4096^3 on the
#: H100, six times its fp32 peak), of the efficiency that makes this module's time exact
#: (tile and wave quantization left in). Derived by ``python bench/xla_matmul_table.py
#: PATH_TO_THE_HEADER``. Its ``sm_90`` table is taken as the H100 SXM's (the file names no
#: card; XLA's op profiles of the same folder name the "NVIDIA H100 80GB HBM3" for sm_90),
#: its ``sm_100_B200`` one as the B200's. Below the fraction the 16-bit products of the same
#: sizes reach on the H100 (memfit's :data:`GEMM_EFFICIENCY` times them within 2.4 %): tf32
#: operands are twice the bytes a FLOP. Where the table's large products are few (15 a card,
#: 0.1 to 0.55 TFLOP), this is the median of those.
MEASURED_TF32_MATMUL: dict[str, float] = {
    "B200": 0.731,  # 15 products
    "H100 SXM": 0.685,  # 15
}
#: tf32 matrix products on a card :data:`MEASURED_TF32_MATMUL` lacks: the median of its cards
TF32_MATMUL_EFFICIENCY = round(statistics.median(MEASURED_TF32_MATMUL.values()), 3)

#: streaming multiprocessors per card (NVIDIA datasheets and architecture whitepapers: V100
#: 80, T4 40, A100 108, A10 72, A30 56, A40 84, L4 58, L40/L40S 142, H100 SXM 132, H100 PCIe
#: 114, B200 148; GeForce and RTX cards from their whitepapers' tables). A card missing here
#: is timed without wave quantization.
SM_COUNT: dict[str, int] = {
    "V100 SXM2 16GB": 80,
    "V100 SXM2 32GB": 80,
    "V100 PCIe 16GB": 80,
    "V100 PCIe 32GB": 80,
    "V100S PCIe 32GB": 80,
    "T4": 40,
    "A10": 72,
    "A10G": 80,
    "A30": 56,
    "A40": 84,
    "A100 40GB": 108,
    "A100 80GB PCIe": 108,
    "A100 80GB SXM": 108,
    "L4": 58,
    "L40": 142,
    "L40S": 142,
    "H100 PCIe": 114,
    "H100 SXM": 132,
    "H100 NVL": 132,
    "H200": 132,
    "GH200": 132,
    "B200": 148,
    "RTX 2080 Ti": 68,
    "RTX 3060 12GB": 28,
    "RTX 3070": 46,
    "RTX 3080 10GB": 68,
    "RTX 3080 12GB": 70,
    "RTX 3090": 82,
    "RTX 3090 Ti": 84,
    "RTX 4060 Ti 8GB": 34,
    "RTX 4060 Ti 16GB": 34,
    "RTX 4070": 46,
    "RTX 4080": 76,
    "RTX 4090": 128,
    "RTX 5090": 170,
    "RTX A4000": 48,
    "RTX A5000": 64,
    "RTX A6000": 84,
    "RTX 6000 Ada": 142,
}


#: the most threads resident on one SM, by compute capability (NVIDIA, CUDA C++ Programming
#: Guide, "Technical Specifications per Compute Capability": 2048 on 6.0-7.0, 8.0, 9.0 and
#: 10.0; 1024 on 7.5; 1536 on 8.6, 8.9 and 12.0). A capability missing here: 2048.
RESIDENT_THREADS: dict[tuple[int, int], int] = {
    (6, 0): 2048,
    (6, 1): 2048,
    (7, 0): 2048,
    (7, 5): 1024,
    (8, 0): 2048,
    (8, 6): 1536,
    (8, 7): 2048,
    (8, 9): 1536,
    (9, 0): 2048,
    (10, 0): 2048,
    (12, 0): 1536,
}


def elements_per_thread(torch_version: str | None = None) -> int:
    """Elements each thread of PyTorch's vectorized element-wise CUDA kernel loads per input.

    4 in PyTorch 1.x and 2.0 (``thread_work_size() { return 4; }``,
    aten/src/ATen/native/cuda/thread_constants.h), the software of every published row
    ``bench/predicted_speed.py`` checks; 8 in recent PyTorch (``elems_per_thread`` of
    aten/src/ATen/native/cuda/CUDALoops.cuh: 8, 16 for one-byte data; pull request 154558,
    May 2025, already refers to it; torch 2.13's headers say 8). Where between the change
    landed is not pinned down here: from 2.7 on memfit takes 8 (an assumption, stated).

    Args:
        torch_version: a version string (default: the installed torch's).

    >>> elements_per_thread("1.13.1"), elements_per_thread("2.13.0+cpu")
    (4, 8)
    """
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    return 8 if version_tuple(torch_version)[:2] >= (2, 7) else 4


@dataclass(frozen=True)
class Rates:
    """The efficiencies of each kernel class (fractions of a peak; see the module).

    Products: fractions of the peak of their :class:`Mode`. Memory-bound kernels:
    fractions of the peak bandwidth.
    """

    #: matrix products in 16 bits (sourced: :data:`GEMM_EFFICIENCY`)
    gemm_half: float = GEMM_EFFICIENCY
    #: matrix products in fp32 on the CUDA cores (assumed the 16-bit fraction, see the module)
    gemm_fp32: float = GEMM_EFFICIENCY
    #: convolutions in fp32 on the CUDA cores (assumed the 16-bit products' fraction too)
    conv_fp32: float = GEMM_EFFICIENCY
    # Fitted 2026-12-02 on the 10 calibration rows (mean squared log error 0.0009; 0.0058
    # before the bytes-in-flight cap and a tf32 convolution's fp32 alternative, both in
    # memfit.estimator.timing).
    # Two ended at the edge of their grids (tf32_conv and conv_half at 0.94): the calibration rows
    # would have them faster still, which no card's cuDNN reaches; read them as "at least
    # this fast on the RTX 3090 and the A100 SXM", not as measured efficiencies.
    #: tf32 convolutions, dense and grouped (calibrated)
    tf32_conv: float = 0.94
    #: dense convolutions in 16 bits (calibrated)
    conv_half: float = 0.94
    #: grouped convolutions, as a fraction of the dense rate of their mode (calibrated)
    grouped: float = 0.86
    #: depthwise convolutions: fraction of the bandwidth (calibrated)
    depthwise: float = 0.24
    #: cuDNN's NCHW<->NHWC transposes: fraction of the bandwidth (calibrated)
    layout: float = 0.58
    stream: float = STREAM_EFFICIENCY
    #: PyTorch's layer norm and softmax kernels: shares of the streaming bandwidth (measured)
    layer_norm: float = LAYER_NORM_EFFICIENCY
    softmax: float = SOFTMAX_EFFICIENCY
    #: the memory latency under load of Little's law (seconds; calibrated)
    latency: float = 1.3e-6
    #: tf32 matrix products (measured: :data:`TF32_MATMUL_EFFICIENCY`)
    tf32_matmul: float = TF32_MATMUL_EFFICIENCY
    #: (card, ``gemm_fp32``) where it was measured (:data:`MEASURED_FP32_MATMUL`; pairs, so
    #: that rates stay hashable); empty: ``gemm_fp32`` on every card
    fp32_matmul_by_card: tuple[tuple[str, float], ...] = tuple(MEASURED_FP32_MATMUL.items())
    #: (card, ``tf32_matmul``) where it was measured (:data:`MEASURED_TF32_MATMUL`)
    tf32_matmul_by_card: tuple[tuple[str, float], ...] = tuple(MEASURED_TF32_MATMUL.items())

    def with_values(self, **values: float) -> Rates:
        """These rates with some efficiencies replaced (the calibration's trials)."""
        # Any: mypy checks replace()'s keywords against every field, the tuple one too
        changes: dict[str, Any] = dict(values)
        return replace(self, **changes)

    def for_card(self, name: str) -> Rates:
        """These rates on the card ``name``: its measured fp32 and tf32 matmul efficiencies,
        where there are.

        >>> RATES.for_card("L4").gemm_fp32 < RATES.gemm_fp32 == RATES.for_card("RTX 3090").gemm_fp32
        True
        >>> RATES.for_card("H100 SXM").tf32_matmul < RATES.tf32_matmul == RATES.for_card("A100 40GB").tf32_matmul
        True
        """
        fp32 = dict(self.fp32_matmul_by_card).get(name, self.gemm_fp32)
        tf32 = dict(self.tf32_matmul_by_card).get(name, self.tf32_matmul)
        if (fp32, tf32) == (self.gemm_fp32, self.tf32_matmul):
            return self
        return replace(self, gemm_fp32=fp32, tf32_matmul=tf32)


#: the rates the prediction uses. The calibrated fields were fitted by
#: ``python bench/predicted_speed.py --calibrate`` on the calibration rows only.
RATES = Rates()


def sm_count(gpu: GPU) -> int | None:
    """The card's SM count: the GPU table's own (``GPU.sms``), else this module's, else None."""
    return gpu.sms or SM_COUNT.get(gpu.name)


def streaming_bandwidth(gpu: GPU, element_bytes: int, per_thread: int, rates: Rates = RATES) -> float:
    """Bytes/s a streaming kernel on ``element_bytes``-wide data reaches on ``gpu``: the
    achievable share of the peak, or less where too few bytes are in flight (see the module).

    Args:
        gpu: the card (its bandwidth, SM count and compute capability).
        element_bytes: the width of the kernel's elements (2 for fp16 and bf16, 4 for fp32).
        per_thread: elements each thread loads (:func:`elements_per_thread`).
        rates: the efficiencies (``stream`` and ``latency``).

    Raises:
        ValueError: an element width or elements per thread below one.
    """
    if element_bytes < 1 or per_thread < 1:
        raise ValueError(f"element bytes and elements per thread must be at least 1, not {element_bytes}, {per_thread}")
    achievable = gpu.bandwidth * rates.stream
    sms = sm_count(gpu)
    if not sms or rates.latency <= 0:
        return achievable
    threads = RESIDENT_THREADS.get(gpu.compute_capability, 2048)
    return min(achievable, sms * threads * per_thread * element_bytes / rates.latency)


def gemm_utilisation(m: float, n: float, k: float, batch: float, sms: int | None) -> float:
    """The fraction of a full-card product's rate a product of ``batch`` x (m x k)(k x n)
    reaches after tile and wave quantization (1.0 when the shape is unknown).

    Args:
        m: rows of the output.
        n: columns of the output.
        k: the reduced dimension.
        batch: independent products in the call (bmm's batch; 1 for mm).
        sms: the card's SM count (None: tiles only, no waves).
    """
    if m <= 0 or n <= 0:
        return 1.0
    tm, tn = TILE
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * max(1.0, batch)
    useful = (m * n * max(1.0, batch)) / (tiles * tm * tn)
    if sms is None:
        return useful
    blocks = tiles
    if tiles < sms and k > 0:
        split = max(1, min(sms // max(1, int(tiles)), int(k // MIN_SPLIT_K)))
        blocks = tiles * split
    waves = math.ceil(blocks / sms)
    return useful * blocks / (waves * sms)


def _product_rate(cls: KernelClass, mode: Mode, rates: Rates) -> float:
    product = cls in (KernelClass.GEMM, KernelClass.ATTENTION)
    if mode == Mode.TF32:
        base = rates.tf32_matmul if product else rates.tf32_conv
    elif product:
        base = rates.gemm_half if mode == Mode.HALF else rates.gemm_fp32
    else:
        base = rates.conv_half if mode == Mode.HALF else rates.conv_fp32
    return base * rates.grouped if cls == KernelClass.CONV_GROUPED else base


def _stream_share(cls: KernelClass, rates: Rates) -> float:
    """The share of the streaming bandwidth a memory-bound kernel of ``cls`` reaches."""
    if cls == KernelClass.LAYER_NORM:
        return rates.layer_norm
    if cls == KernelClass.SOFTMAX:
        return rates.softmax
    return 1.0


def kernel_seconds(
    cls: KernelClass,
    mode: Mode,
    flops: float,
    nbytes: float,
    *,
    peak: float,
    bandwidth: float,
    rates: Rates,
    utilisation: float = 1.0,
    streaming: float | None = None,
) -> tuple[float, bool]:
    """(seconds, bound by its FLOPs) of one kernel of ``cls``.

    Args:
        cls: the kernel's class.
        mode: the arithmetic its products run in.
        flops: its floating-point operations (0 for a memory-bound kernel).
        nbytes: the bytes it reads and writes.
        peak: the card's peak FLOP/s in ``mode`` (ignored without FLOPs).
        bandwidth: the card's peak bandwidth in bytes/s.
        rates: the efficiencies.
        utilisation: the tile and wave quantization of a product (:func:`gemm_utilisation`).
        streaming: bytes/s its memory traffic moves at (default: the achievable share of
            ``bandwidth``; :func:`streaming_bandwidth` where bytes in flight limit it).
    """
    if cls == KernelClass.CONV_DEPTHWISE:
        return nbytes / (bandwidth * rates.depthwise), False
    moving = nbytes / ((bandwidth * rates.stream if streaming is None else streaming) * _stream_share(cls, rates))
    if flops <= 0 or peak <= 0:
        return moving, False
    computing = flops / (peak * _product_rate(cls, mode, rates) * max(utilisation, 1e-3))
    return max(computing, moving), computing >= moving
