"""A table of GPU models: memory, compute capability, peak throughput, memory bandwidth, and
the fixed costs that PyTorch's caching allocator never sees.

Why a table: ``memfit estimate --gpu "RTX 3090"`` answers "will it fit, and how fast will it
train, on a card I do not have?", so the card's numbers must be known without the card.

Names: a card is found by the name ``torch.cuda.get_device_name()`` or ``nvidia-smi`` prints
("NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"), by its short
name ("RTX 4090", "h100 sxm", "a100-80gb-pcie"), tolerant of case, spaces, hyphens and vendor
words. A name may leave out a size or a form factor ("4090", "A100 40GB") but not a model
word ("3090" is not the 3090 Ti). A name that fits several cards ("A100", "V100", "H100",
"RTX 3080": their memory or speed differ) is refused with their names: memfit does not pick
one silently.

- ``memory`` is the total CUDA reports to PyTorch
  (``torch.cuda.get_device_properties(i).total_memory``). ``memory_source`` says where it
  comes from: ``"torch"`` is a value ``get_device_properties`` printed in public logs;
  ``"smi"`` is nvidia-smi's ``memory.total`` in public logs, less the gap between the two
  where it was known; ``"spec"`` is the datasheet capacity (GB read as GiB, as nvidia-smi
  shows these cards) less 2 %, the largest gap between nvidia-smi's total and
  ``get_device_properties`` among the ``torch`` rows (T4: 15,360 MiB against 15,102 MiB,
  1.7 %), so that the figure errs low. ``--memory SIZE`` overrides it.
- ``fp32``, ``tf32``, ``bf16_tensor``, ``fp16_tensor``: published peak **dense** throughput
  in FLOP/s (never the 2:4-sparsity figure NVIDIA often prints beside it): fp32 on the CUDA
  cores; tf32, bf16 and fp16 on the tensor cores, with fp32 accumulation (what PyTorch's
  matmuls use; GeForce cards run it at half their fp16-accumulate rate). ``None``: the card
  has no such tensor-core mode (Pascal and the GTX 16 cards have no tensor cores: their
  fp16 matmuls are timed at the fp32 peak). ``bandwidth``: peak memory bandwidth in bytes/s.
  ``spec_source`` names the NVIDIA datasheet or whitepaper the figures come from; where a
  whitepaper has no column for the card, the peaks are the product page's SM count and boost
  clock times the architecture's per-SM rates (``_rates``). A laptop part has no peaks
  (``fp32 == 0``, :attr:`GPU.has_peaks` False): its clocks depend on the laptop's power
  limit, so memfit predicts its memory and says it cannot predict its speed.
- ``sms``: streaming multiprocessors (0 where the table does not say).
- A card the table lacks: ``custom:memory=12GiB,cc=8.6[,fp32=..,fp16=..,bf16=..,tf32=..,bandwidth=..]``
  (:func:`custom_gpu`; peaks in TFLOP/s, bandwidth in GB/s; ``memory_source`` ``"custom"``).
- ``context`` is the CUDA context and ``cublas_workspace`` PyTorch's cuBLAS workspace
  (:mod:`memfit.cuda.context`): memory the card loses before PyTorch allocates anything.

>>> gpu = lookup("NVIDIA GeForce RTX 3090")
>>> gpu.name, gpu.memory // 2**20, gpu.bf16, gpu.fp16_tensor / 1e12
('RTX 3090', 24268, True, 71.0)
>>> lookup("a100")
Traceback (most recent call last):
    ...
memfit.errors.MemfitError: 'a100' fits several GPUs: A100 40GB, A100 80GB PCIe, A100 80GB SXM; name one (or give --memory SIZE)
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from typing import Any

from memfit.cuda.context import CONTEXT_BY_FAMILY, cublas_workspace
from memfit.errors import MemfitError
from memfit.units import MiB

__all__ = [
    "GPU",
    "GPUS",
    "lookup",
    "custom_gpu",
    "normalize_name",
    "fixed_costs",
    "CONTEXT_BY_FAMILY",
    "cublas_workspace",
]

#: FLOP/s and bytes/s in the table's units
TFLOPS = 1e12
GBPS = 1e9

# -- where the figures come from (NVIDIA datasheets and whitepapers) ---------------------

_V100 = "NVIDIA Tesla V100 datasheet (volta-v100-datasheet-update-us-1165301-r5)"
_T4 = "NVIDIA T4 datasheet (T4-Datasheet-951643)"
_TURING = "NVIDIA Turing GPU architecture whitepaper (WP-09183-001), reference clocks"
_A10 = "NVIDIA A10 datasheet (nvidia-a10-datasheet)"
_A10G = (
    "AWS publishes no A10G datasheet: figures as collected by Baseten, "
    "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/"
)
_A30 = "NVIDIA A30 datasheet (nvidia-a30-datasheet)"
_A40 = "NVIDIA A40 datasheet (proviz-print-nvidia-a40-datasheet-us-nvidia-1469711)"
_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web)"
_GA102 = "NVIDIA Ampere GA102 GPU architecture whitepaper (V2), Table: GeForce RTX 3090/3080/3070, RTX A6000"
_GA10X_DERIVED = (
    "NVIDIA product page (SM count, boost clock, memory) x the GA10x per-SM rates of the "
    "GA102 whitepaper (128 fp32 FMA/2, 256 fp16-tensor FMA with fp32 accumulate per SM per clock)"
)
_RTX_AMPERE = "NVIDIA RTX A4000/A5000 datasheets (tensor figure halved: the datasheets print the sparse one)"
_ADA = "NVIDIA Ada GPU architecture whitepaper (v2.1), Tables: RTX 4090, RTX 4080, RTX 6000 Ada"
_ADA_DERIVED = (
    "NVIDIA product page (SM count, boost clock, memory) x the Ada per-SM rates of the Ada "
    "whitepaper (fp16 tensor with fp32 accumulate at half rate on GeForce)"
)
_L4 = "NVIDIA L4 datasheet (nvidia-l4-datasheet-2595652), sparse figures halved"
_L40 = "NVIDIA L40 datasheet (nvidia-l40-datasheet-web-2370580), sparse figures halved"
_L40S = "NVIDIA L40S datasheet (nvidia-l40s-datasheet-28413), sparse figures halved"
_H100 = "NVIDIA H100 datasheet (h100-datasheet-2430615), sparse figures halved"
_H200 = "NVIDIA H200 datasheet (nvidia-h200-datasheet), sparse figures halved"
_GH200 = "NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 version), sparse figures halved"
_B200 = "NVIDIA HGX B200 datasheet: the 8-GPU figures divided by 8, sparse figures halved"
_RTX_BLACKWELL = "NVIDIA RTX Blackwell GPU architecture whitepaper, Table: GeForce RTX 5090"
_BLACKWELL_DERIVED = (
    "NVIDIA product page (CUDA cores, boost clock, memory, bandwidth) x the per-SM rates of the "
    "RTX Blackwell whitepaper's GeForce RTX 5090 (128 fp32 FMA, 256 fp16-tensor FMA with fp32 accumulate per SM per clock)"
)
_TURING_DERIVED = (
    "NVIDIA product page (CUDA cores, boost clock, memory, bandwidth) x the per-SM rates of the Turing "
    "whitepaper (64 fp32 FMA; on GeForce 256 fp16-tensor FMA with fp32 accumulate per SM per clock)"
)
_QUADRO_RTX_8000 = (
    "NVIDIA Quadro RTX 8000 datasheet (48 GB GDDR6 at 672 GB/s, 16.3 fp32 TFLOPS, 130.5 tensor TFLOPS); the "
    "TU102 of the Turing whitepaper's Quadro RTX 6000 (72 SMs, 1770 MHz boost, fp32 accumulate at the full rate)"
)
_TITAN_RTX = (
    "NVIDIA TITAN RTX product page (4608 CUDA cores, 1770 MHz boost, 24 GB at 672 GB/s, 130 tensor TFLOPS: "
    "fp32 accumulate at the full rate, as on the Quadro RTX 6000 of the Turing whitepaper)"
)
_GTX16 = (
    "NVIDIA GeForce GTX 16-series product pages (CUDA cores, boost clock, memory, bandwidth) x 2 FLOP per CUDA core "
    "per clock; TU116/TU117 have no tensor cores"
)
_PASCAL = (
    "NVIDIA GeForce GTX 10-series product pages (CUDA cores, boost clock, memory, bandwidth) x 2 FLOP per CUDA core "
    "per clock; Pascal has no tensor cores"
)
_P100 = "NVIDIA Tesla P100 datasheets (PCIe: tesla-p100-pcie-datasheet; SXM2: the P100 for NVLink-optimized servers)"
_P40 = "NVIDIA Tesla P40 datasheet (nvidia-tesla-p40-datasheet)"
_LAPTOP = (
    "NVIDIA laptop GPU product pages (CUDA cores, memory); no peaks: each laptop sets its own power limit and "
    "boost clock within the range NVIDIA publishes, so the table cannot tell its speed"
)


def _rates(sms: int, boost_ghz: float, fp32_per_sm: int, tensor_per_sm: int | None, tf32: bool) -> dict[str, Any]:
    """Dense peaks (TFLOP/s) from a product page's SM count and boost clock and the per-SM rates
    (FLOP per SM per clock) of the architecture's whitepaper; GeForce's tf32 runs at its fp32 rate."""
    fp32 = round(sms * fp32_per_sm * boost_ghz / 1e3, 1)
    tensor = None if tensor_per_sm is None else round(sms * tensor_per_sm * boost_ghz / 1e3, 1)
    return {"fp32": fp32, "tf32": fp32 if tf32 else None, "bf16": tensor if tf32 else None, "fp16": tensor, "sms": sms}


def _turing(sms: int, boost_ghz: float, tensor: int | None = 512) -> dict[str, Any]:
    return _rates(sms, boost_ghz, 128, tensor, tf32=False)


def _geforce(sms: int, boost_ghz: float) -> dict[str, Any]:
    """Ampere GA10x, Ada and Blackwell GeForce: 256 fp32 and 512 fp16-tensor (fp32 accumulate) FLOP per SM per clock."""
    return _rates(sms, boost_ghz, 256, 512, tf32=True)


def _pascal(sms: int, boost_ghz: float) -> dict[str, Any]:
    return _rates(sms, boost_ghz, 256, None, tf32=False)


#: a laptop part: no peaks (see :data:`_LAPTOP`); the tensor-core modes it has are still named
_NO_PEAKS: dict[str, Any] = {"fp32": 0.0, "tf32": None, "bf16": None, "fp16": None, "bandwidth": 0.0}


@dataclass(frozen=True)
class GPU:
    """One GPU model. Bytes are ints; throughput in FLOP/s, bandwidth in bytes/s."""

    name: str
    memory: int
    compute_capability: tuple[int, int]
    bf16: bool
    family: str
    memory_source: str  # "torch", "smi" or "spec" (see the module)
    aliases: tuple[str, ...] = ()
    fp32: float = 0.0
    tf32: float | None = None
    bf16_tensor: float | None = None
    fp16_tensor: float | None = None
    bandwidth: float = 0.0
    spec_source: str = ""
    #: streaming multiprocessors (0: not in the table)
    sms: int = 0

    @property
    def has_peaks(self) -> bool:
        """True when the table knows the card's fp32 peak and bandwidth (a step time can be
        predicted); a laptop part's depend on the laptop's power limit, so it has none."""
        return self.fp32 > 0 and self.bandwidth > 0

    @property
    def source(self) -> str:
        """Where ``memory`` comes from (the older name of :attr:`memory_source`)."""
        return self.memory_source

    @property
    def context(self) -> int:
        # A family without a context figure of its own (Blackwell) takes Hopper's, itself an
        # assumption (no published figure: see memfit.cuda.context.CONTEXT_FIGURES).
        return CONTEXT_BY_FAMILY.get(self.family, CONTEXT_BY_FAMILY["hopper"])

    @property
    def cublas_workspace(self) -> int:
        return cublas_workspace(self.compute_capability[0])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compute_capability"] = f"{self.compute_capability[0]}.{self.compute_capability[1]}"
        data["context"] = self.context
        data["cublas_workspace"] = self.cublas_workspace
        return data


def _spec(gigabytes: float) -> int:
    """A datasheet capacity as the table's conservative figure (see the module)."""
    return int(gigabytes * 1024 * 0.98) * MiB


def _card(
    name: str,
    memory: int,
    cc: tuple[int, int],
    family: str,
    memory_source: str,
    aliases: tuple[str, ...],
    *,
    fp32: float,
    tf32: float | None,
    bf16: float | None,
    fp16: float | None,
    bandwidth: float,
    source: str,
    sms: int = 0,
) -> GPU:
    return GPU(
        name=name,
        memory=memory,
        compute_capability=cc,
        bf16=cc >= (8, 0),  # bf16 is an Ampere-on capability, whether or not its peak is known
        family=family,
        memory_source=memory_source,
        aliases=aliases,
        fp32=fp32 * TFLOPS,
        tf32=None if tf32 is None else tf32 * TFLOPS,
        bf16_tensor=None if bf16 is None else bf16 * TFLOPS,
        fp16_tensor=None if fp16 is None else fp16 * TFLOPS,
        bandwidth=bandwidth * GBPS,
        spec_source=source,
        sms=sms,
    )


_VOLTA = {"tf32": None, "bf16": None}

# fmt: off
GPUS: tuple[GPU, ...] = (
    # -- data centre ------------------------------------------------------------------
    _card("V100 SXM2 16GB", 16_160 * MiB, (7, 0), "volta", "torch", ("Tesla V100-SXM2-16GB",),
          fp32=15.7, **_VOLTA, fp16=125, bandwidth=900, source=_V100, sms=80),
    _card("V100 SXM2 32GB", 32_510 * MiB, (7, 0), "volta", "smi", ("Tesla V100-SXM2-32GB",),
          fp32=15.7, **_VOLTA, fp16=125, bandwidth=900, source=_V100, sms=80),
    _card("V100 PCIe 16GB", 16_160 * MiB, (7, 0), "volta", "smi", ("Tesla V100-PCIE-16GB",),
          fp32=14.0, **_VOLTA, fp16=112, bandwidth=900, source=_V100, sms=80),
    _card("V100 PCIe 32GB", 32_510 * MiB, (7, 0), "volta", "smi", ("Tesla V100-PCIE-32GB",),
          fp32=14.0, **_VOLTA, fp16=112, bandwidth=900, source=_V100, sms=80),
    _card("V100S PCIe 32GB", 32_510 * MiB, (7, 0), "volta", "smi", ("Tesla V100S-PCIE-32GB",),
          fp32=16.4, **_VOLTA, fp16=130, bandwidth=1134, source=_V100, sms=80),
    _card("T4", 15_102 * MiB, (7, 5), "turing", "torch", ("Tesla T4",),
          fp32=8.1, **_VOLTA, fp16=65, bandwidth=320, source=_T4, sms=40),
    _card("A10", 22_731 * MiB, (8, 6), "ampere", "smi", ("NVIDIA A10",),
          fp32=31.2, tf32=62.5, bf16=125, fp16=125, bandwidth=600, source=_A10, sms=72),
    _card("A10G", 22_731 * MiB, (8, 6), "ampere", "smi", ("NVIDIA A10G",),
          fp32=35.0, tf32=35.0, bf16=70, fp16=70, bandwidth=600, source=_A10G),
    _card("A30", _spec(24), (8, 0), "ampere", "spec", ("NVIDIA A30",),
          fp32=10.3, tf32=82, bf16=165, fp16=165, bandwidth=933, source=_A30, sms=56),
    _card("A40", _spec(48), (8, 6), "ampere", "spec", ("NVIDIA A40",),
          fp32=37.4, tf32=74.8, bf16=149.7, fp16=149.7, bandwidth=696, source=_A40, sms=84),
    # The 40 GB PCIe and SXM4 cards share every figure: one entry.
    _card("A100 40GB", 40_536 * MiB, (8, 0), "ampere", "torch",
          ("NVIDIA A100-PCIE-40GB", "NVIDIA A100-SXM4-40GB", "A100 40GB PCIe", "A100 40GB SXM"),
          fp32=19.5, tf32=156, bf16=312, fp16=312, bandwidth=1555, source=_A100, sms=108),
    _card("A100 80GB PCIe", 81_050 * MiB, (8, 0), "ampere", "smi", ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
          fp32=19.5, tf32=156, bf16=312, fp16=312, bandwidth=1935, source=_A100, sms=108),
    _card("A100 80GB SXM", 81_050 * MiB, (8, 0), "ampere", "smi", ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
          fp32=19.5, tf32=156, bf16=312, fp16=312, bandwidth=2039, source=_A100, sms=108),
    _card("L4", 22_563 * MiB, (8, 9), "ada", "smi", ("NVIDIA L4",),
          fp32=30.3, tf32=60, bf16=121, fp16=121, bandwidth=300, source=_L4, sms=58),
    _card("L40", _spec(48), (8, 9), "ada", "spec", ("NVIDIA L40",),
          fp32=90.5, tf32=90.5, bf16=181, fp16=181, bandwidth=864, source=_L40, sms=142),
    _card("L40S", _spec(48), (8, 9), "ada", "spec", ("NVIDIA L40S",),
          fp32=91.6, tf32=183, bf16=362, fp16=362, bandwidth=864, source=_L40S, sms=142),
    _card("H100 PCIe", _spec(80), (9, 0), "hopper", "spec", ("NVIDIA H100 PCIe", "H100 80GB PCIe"),
          fp32=51, tf32=378, bf16=756, fp16=756, bandwidth=2000, source=_H100, sms=114),
    _card("H100 SXM", 81_090 * MiB, (9, 0), "hopper", "torch",
          ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB", "H100-SXM5-80GB"),
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, bandwidth=3350, source=_H100, sms=132),
    _card("H100 NVL", _spec(94), (9, 0), "hopper", "spec", ("NVIDIA H100 NVL",),
          fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, bandwidth=3900, source=_H100, sms=132),
    _card("H200", 143_156 * MiB, (9, 0), "hopper", "torch", ("NVIDIA H200", "H200 SXM", "H200 141GB"),
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, bandwidth=4800, source=_H200, sms=132),
    _card("GH200", _spec(96), (9, 0), "hopper", "spec", ("NVIDIA GH200 480GB", "GH200 96GB"),
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, bandwidth=4000, source=_GH200, sms=132),
    _card("B200", _spec(180), (10, 0), "blackwell", "spec", ("NVIDIA B200",),
          fp32=75, tf32=1125, bf16=2250, fp16=2250, bandwidth=8000, source=_B200),
    # -- consumer and workstation --------------------------------------------------------
    _card("RTX 2080 Ti", _spec(11), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2080 Ti",),
          fp32=13.4, **_VOLTA, fp16=53.8, bandwidth=616, source=_TURING, sms=68),
    # "NVIDIA GeForce RTX 3060" is the 12 GB card (the rare 8 GB one is not in the table).
    _card("RTX 3060 12GB", 11_910 * MiB, (8, 6), "ampere", "smi", ("NVIDIA GeForce RTX 3060",),
          fp32=12.7, tf32=12.7, bf16=25.5, fp16=25.5, bandwidth=360, source=_GA10X_DERIVED, sms=28),
    _card("RTX 3070", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3070",),
          fp32=20.3, tf32=20.3, bf16=40.6, fp16=40.6, bandwidth=448, source=_GA102, sms=46),
    _card("RTX 3080 10GB", _spec(10), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3080 10GB",),
          fp32=29.8, tf32=29.8, bf16=59.5, fp16=59.5, bandwidth=760, source=_GA102, sms=68),
    _card("RTX 3080 12GB", _spec(12), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3080 12GB",),
          fp32=30.6, tf32=30.6, bf16=61.3, fp16=61.3, bandwidth=912, source=_GA10X_DERIVED, sms=70),
    _card("RTX 3090", 24_268 * MiB, (8, 6), "ampere", "torch", ("NVIDIA GeForce RTX 3090",),
          fp32=35.6, tf32=35.6, bf16=71, fp16=71, bandwidth=936, source=_GA102, sms=82),
    _card("RTX 3090 Ti", _spec(24), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3090 Ti",),
          fp32=40.0, tf32=40.0, bf16=80, fp16=80, bandwidth=1008, source=_GA10X_DERIVED, sms=84),
    _card("RTX 4060 Ti 8GB", _spec(8), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4060 Ti 8GB",),
          fp32=22.1, tf32=22.1, bf16=44.1, fp16=44.1, bandwidth=288, source=_ADA_DERIVED, sms=34),
    _card("RTX 4060 Ti 16GB", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4060 Ti 16GB",),
          fp32=22.1, tf32=22.1, bf16=44.1, fp16=44.1, bandwidth=288, source=_ADA_DERIVED, sms=34),
    _card("RTX 4070", _spec(12), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4070",),
          fp32=29.1, tf32=29.1, bf16=58.3, fp16=58.3, bandwidth=504, source=_ADA_DERIVED, sms=46),
    _card("RTX 4080", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4080",),
          fp32=48.7, tf32=48.7, bf16=97.5, fp16=97.5, bandwidth=716.8, source=_ADA, sms=76),
    _card("RTX 4090", 24_563 * MiB, (8, 9), "ada", "torch", ("NVIDIA GeForce RTX 4090",),
          fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, bandwidth=1008, source=_ADA, sms=128),
    _card("RTX 5090", _spec(32), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5090",),
          fp32=104.8, tf32=104.8, bf16=209.5, fp16=209.5, bandwidth=1792, source=_RTX_BLACKWELL, sms=170),
    _card("RTX A4000", _spec(16), (8, 6), "ampere", "spec", ("NVIDIA RTX A4000",),
          fp32=19.2, tf32=38.4, bf16=76.7, fp16=76.7, bandwidth=448, source=_RTX_AMPERE, sms=48),
    _card("RTX A5000", _spec(24), (8, 6), "ampere", "spec", ("NVIDIA RTX A5000",),
          fp32=27.8, tf32=55.6, bf16=111.1, fp16=111.1, bandwidth=768, source=_RTX_AMPERE, sms=64),
    _card("RTX A6000", _spec(48), (8, 6), "ampere", "spec", ("NVIDIA RTX A6000",),
          fp32=38.7, tf32=77.4, bf16=154.8, fp16=154.8, bandwidth=768, source=_GA102, sms=84),
    _card("RTX 6000 Ada", _spec(48), (8, 9), "ada", "spec", ("NVIDIA RTX 6000 Ada Generation",),
          fp32=91.1, tf32=182.1, bf16=364.2, fp16=364.2, bandwidth=960, source=_ADA, sms=142),
    # -- issue 23: the cards students own ---------------------------------------------------
    # Turing GeForce (the 2070 and 2080 at NVIDIA's reference boost clock, as the whitepaper's)
    _card("RTX 2060", _spec(6), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2060",),
          **_turing(30, 1.680), bandwidth=336, source=_TURING_DERIVED),
    _card("RTX 2060 Super", _spec(8), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2060 SUPER",),
          **_turing(34, 1.650), bandwidth=448, source=_TURING_DERIVED),
    _card("RTX 2070", _spec(8), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2070",),
          **_turing(36, 1.620), bandwidth=448, source=_TURING_DERIVED),
    _card("RTX 2070 Super", _spec(8), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2070 SUPER",),
          **_turing(40, 1.770), bandwidth=448, source=_TURING_DERIVED),
    _card("RTX 2080", _spec(8), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2080",),
          **_turing(46, 1.710), bandwidth=448, source=_TURING_DERIVED),
    _card("RTX 2080 Super", _spec(8), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2080 SUPER",),
          **_turing(48, 1.815), bandwidth=496, source=_TURING_DERIVED),
    _card("Titan RTX", _spec(24), (7, 5), "turing", "spec", ("NVIDIA TITAN RTX",),
          **_turing(72, 1.770, tensor=1024), bandwidth=672, source=_TITAN_RTX),
    _card("Quadro RTX 8000", _spec(48), (7, 5), "turing", "spec", ("NVIDIA Quadro RTX 8000",),
          **_turing(72, 1.770, tensor=1024), bandwidth=672, source=_QUADRO_RTX_8000),
    # GTX 16 (Turing without tensor cores: fp16 matmuls are timed at the fp32 peak). The GTX
    # 1650 is the GDDR5 card; its GDDR6 version (192 GB/s, 1590 MHz) prints the same name.
    _card("GTX 1650", _spec(4), (7, 5), "turing", "spec", ("NVIDIA GeForce GTX 1650",),
          **_turing(14, 1.665, tensor=None), bandwidth=128, source=_GTX16),
    _card("GTX 1650 Super", _spec(4), (7, 5), "turing", "spec", ("NVIDIA GeForce GTX 1650 SUPER",),
          **_turing(20, 1.725, tensor=None), bandwidth=192, source=_GTX16),
    _card("GTX 1660", _spec(6), (7, 5), "turing", "spec", ("NVIDIA GeForce GTX 1660",),
          **_turing(22, 1.785, tensor=None), bandwidth=192, source=_GTX16),
    _card("GTX 1660 Super", _spec(6), (7, 5), "turing", "spec", ("NVIDIA GeForce GTX 1660 SUPER",),
          **_turing(22, 1.785, tensor=None), bandwidth=336, source=_GTX16),
    _card("GTX 1660 Ti", _spec(6), (7, 5), "turing", "spec", ("NVIDIA GeForce GTX 1660 Ti",),
          **_turing(24, 1.770, tensor=None), bandwidth=288, source=_GTX16),
    # Ampere GeForce ("NVIDIA GeForce RTX 3050" is the 8 GB desktop card)
    _card("RTX 3050 8GB", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3050",),
          **_geforce(20, 1.777), bandwidth=224, source=_GA10X_DERIVED),
    _card("RTX 3060 Ti", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3060 Ti",),
          **_geforce(38, 1.665), bandwidth=448, source=_GA10X_DERIVED),
    _card("RTX 3070 Ti", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3070 Ti",),
          **_geforce(48, 1.770), bandwidth=608, source=_GA10X_DERIVED),
    _card("RTX 3080 Ti", _spec(12), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3080 Ti",),
          **_geforce(80, 1.665), bandwidth=912, source=_GA10X_DERIVED),
    # Ada GeForce
    _card("RTX 4060", _spec(8), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4060",),
          **_geforce(24, 2.460), bandwidth=272, source=_ADA_DERIVED),
    _card("RTX 4070 Super", _spec(12), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4070 SUPER",),
          **_geforce(56, 2.475), bandwidth=504, source=_ADA_DERIVED),
    _card("RTX 4070 Ti", _spec(12), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4070 Ti",),
          **_geforce(60, 2.610), bandwidth=504, source=_ADA_DERIVED),
    _card("RTX 4070 Ti Super", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4070 Ti SUPER",),
          **_geforce(66, 2.610), bandwidth=672, source=_ADA_DERIVED),
    _card("RTX 4080 Super", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4080 SUPER",),
          **_geforce(80, 2.550), bandwidth=736, source=_ADA_DERIVED),
    # Blackwell GeForce
    _card("RTX 5060", _spec(8), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5060",),
          **_geforce(30, 2.497), bandwidth=448, source=_BLACKWELL_DERIVED),
    _card("RTX 5060 Ti 8GB", _spec(8), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5060 Ti 8GB",),
          **_geforce(36, 2.572), bandwidth=448, source=_BLACKWELL_DERIVED),
    _card("RTX 5060 Ti 16GB", _spec(16), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5060 Ti 16GB",),
          **_geforce(36, 2.572), bandwidth=448, source=_BLACKWELL_DERIVED),
    _card("RTX 5070", _spec(12), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5070",),
          **_geforce(48, 2.512), bandwidth=672, source=_BLACKWELL_DERIVED),
    _card("RTX 5070 Ti", _spec(16), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5070 Ti",),
          **_geforce(70, 2.452), bandwidth=896, source=_BLACKWELL_DERIVED),
    _card("RTX 5080", _spec(16), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5080",),
          **_geforce(84, 2.617), bandwidth=960, source=_BLACKWELL_DERIVED),
    # Pascal: GeForce GTX 10 and the Tesla P100 / P40 (fp16 matmuls timed at the fp32 peak)
    _card("GTX 1060 3GB", _spec(3), (6, 1), "pascal", "spec", ("NVIDIA GeForce GTX 1060 3GB",),
          **_pascal(9, 1.708), bandwidth=192, source=_PASCAL),
    _card("GTX 1060 6GB", _spec(6), (6, 1), "pascal", "spec", ("NVIDIA GeForce GTX 1060 6GB",),
          **_pascal(10, 1.708), bandwidth=192, source=_PASCAL),
    _card("GTX 1070", _spec(8), (6, 1), "pascal", "spec", ("NVIDIA GeForce GTX 1070",),
          **_pascal(15, 1.683), bandwidth=256, source=_PASCAL),
    _card("GTX 1070 Ti", _spec(8), (6, 1), "pascal", "spec", ("NVIDIA GeForce GTX 1070 Ti",),
          **_pascal(19, 1.683), bandwidth=256, source=_PASCAL),
    _card("GTX 1080", _spec(8), (6, 1), "pascal", "spec", ("NVIDIA GeForce GTX 1080",),
          **_pascal(20, 1.733), bandwidth=320, source=_PASCAL),
    _card("GTX 1080 Ti", _spec(11), (6, 1), "pascal", "spec", ("NVIDIA GeForce GTX 1080 Ti",),
          **_pascal(28, 1.582), bandwidth=484, source=_PASCAL),
    _card("P100 PCIe 16GB", _spec(16), (6, 0), "pascal", "spec", ("Tesla P100-PCIE-16GB",),
          fp32=9.3, tf32=None, bf16=None, fp16=None, bandwidth=732, source=_P100, sms=56),
    _card("P100 PCIe 12GB", _spec(12), (6, 0), "pascal", "spec", ("Tesla P100-PCIE-12GB",),
          fp32=9.3, tf32=None, bf16=None, fp16=None, bandwidth=549, source=_P100, sms=56),
    _card("P100 SXM2 16GB", _spec(16), (6, 0), "pascal", "spec", ("Tesla P100-SXM2-16GB",),
          fp32=10.6, tf32=None, bf16=None, fp16=None, bandwidth=732, source=_P100, sms=56),
    _card("P40", _spec(24), (6, 1), "pascal", "spec", ("Tesla P40",),
          fp32=12, tf32=None, bf16=None, fp16=None, bandwidth=346, source=_P40, sms=30),
    # Laptop parts: memory, capability and SMs; no peaks (see _LAPTOP), so no predicted speed
    _card("RTX 3050 Laptop", _spec(4), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3050 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=16),
    _card("RTX 3050 Ti Laptop", _spec(4), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3050 Ti Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=20),
    _card("RTX 3060 Laptop", _spec(6), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3060 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=30),
    _card("RTX 3070 Laptop", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3070 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=40),
    _card("RTX 3070 Ti Laptop", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3070 Ti Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=46),
    _card("RTX 3080 Ti Laptop", _spec(16), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3080 Ti Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=58),
    _card("RTX 4050 Laptop", _spec(6), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4050 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=20),
    _card("RTX 4060 Laptop", _spec(8), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4060 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=24),
    _card("RTX 4070 Laptop", _spec(8), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4070 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=36),
    _card("RTX 4080 Laptop", _spec(12), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4080 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=58),
    _card("RTX 4090 Laptop", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4090 Laptop GPU",),
          **_NO_PEAKS, source=_LAPTOP, sms=76),
)
# fmt: on

# -- names ------------------------------------------------------------------------------

#: words a name may carry or leave out without naming another card
_VENDOR = frozenset({"nvidia", "geforce", "tesla", "quadro", "rtx", "gtx", "gpu"})
_QUALIFIER = re.compile(r"^(\d+gb?|pcie|sxm\d?|hbm\d?e?|generation|gen\d)$")


def normalize_name(name: str) -> str:
    """Lower-case and drop spaces, hyphens, underscores and vendor words, so "RTX 3090",
    "rtx3090" and "NVIDIA GeForce RTX 3090" are one key."""
    text = name.lower()
    text = re.sub(r"\b(nvidia|geforce|tesla)\b", "", text)
    return re.sub(r"[\s\-_]+", "", text)


def _tokens(name: str) -> frozenset[str]:
    return frozenset(token for token in re.split(r"[\s\-_]+", name.lower()) if token)


def _model_tokens(tokens: frozenset[str]) -> frozenset[str]:
    """The tokens a name must keep: not a vendor word, a size or a form factor."""
    return frozenset(t for t in tokens if t not in _VENDOR and not _QUALIFIER.match(t))


def _index() -> dict[str, GPU]:
    index: dict[str, GPU] = {}
    for gpu in GPUS:
        for key in (gpu.name, *gpu.aliases):
            index[normalize_name(key)] = gpu
    return index


def _model_keys() -> dict[str, list[GPU]]:
    """Each spelling's key without sizes and form factors, with and without its vendor
    words ("rtx3080" and "3080" for both RTX 3080s): a short name glued together, or a
    typo of one, finds every card it may mean."""
    keys: dict[str, list[GPU]] = {}
    for gpu in GPUS:
        for spelling in (gpu.name, *gpu.aliases):
            tokens = [t for t in re.split(r"[\s\-_]+", spelling.lower()) if t and not _QUALIFIER.match(t)]
            for key in (normalize_name(" ".join(tokens)), "".join(t for t in tokens if t not in _VENDOR)):
                if key and gpu not in keys.setdefault(key, []):
                    keys[key].append(gpu)
    return keys


_INDEX = _index()
_MODELS = _model_keys()
_SPELLINGS: tuple[tuple[frozenset[str], GPU], ...] = tuple(
    (_tokens(spelling), gpu) for gpu in GPUS for spelling in (gpu.name, *gpu.aliases)
)


def candidates(name: str) -> list[GPU]:
    """Every card ``name`` may mean, in table order (one for a known name, none for an
    unknown one, several for a name too short to tell them apart)."""
    key = normalize_name(name)
    if key in _INDEX:
        return [_INDEX[key]]
    query = _tokens(name.replace("_", " "))
    found = [
        gpu
        for spelling, gpu in _SPELLINGS
        if query - _VENDOR and query - _VENDOR <= spelling and _model_tokens(spelling) <= query
    ]
    if not found:
        found = list(_MODELS.get(key, []))
    return list(dict.fromkeys(found))


#: the spelling of a card the table lacks: ``custom:memory=12GiB,cc=8.6[,fp32=..,fp16=..,...]``
CUSTOM_PREFIX = "custom:"
#: the keys a custom card takes: memory and compute capability, and (for a predicted speed)
#: the dense peaks in TFLOP/s and the bandwidth in GB/s, as the datasheet prints them
_CUSTOM_KEYS = ("memory", "cc", "fp32", "tf32", "bf16", "fp16", "bandwidth", "sms", "name")
#: the compute capabilities a custom card may have and their architecture (CUDA C++
#: Programming Guide, "Compute Capabilities")
_FAMILIES = {
    (6, 0): "pascal", (6, 1): "pascal", (6, 2): "pascal", (7, 0): "volta", (7, 2): "volta", (7, 5): "turing",
    (8, 0): "ampere", (8, 6): "ampere", (8, 7): "ampere", (8, 9): "ada", (9, 0): "hopper",
    (10, 0): "blackwell", (10, 3): "blackwell", (11, 0): "blackwell", (12, 0): "blackwell", (12, 1): "blackwell",
}  # fmt: skip


def _custom_number(key: str, text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise MemfitError(f"invalid GPU {spec!r}: {key}={text!r} must be a positive number")
    return value


def custom_gpu(spec: str) -> GPU:
    """A card the table lacks, described by its memory and compute capability (and, for a
    predicted step time, its peaks): ``custom:memory=12GiB,cc=8.6,fp32=30,fp16=60,bandwidth=900``.

    ``memory`` is what CUDA reports (nvidia-smi's ``memory.total``); ``fp32``, ``tf32``,
    ``bf16``, ``fp16`` are dense peaks in TFLOP/s (tensor cores with fp32 accumulation for
    the last three), ``bandwidth`` GB/s; ``sms`` and ``name`` are for people. Without
    ``fp32`` and ``bandwidth`` the card has memory but no speed (like a laptop part).

    Args:
        spec: the text after ``--gpu`` (it starts with ``custom:``).

    Raises:
        MemfitError: an unknown key, a bad value, a missing memory or capability, bf16 on a
            card before Ampere, or only one of fp32 and bandwidth.
    """
    from memfit.units import parse_size

    fields: dict[str, str] = {}
    for item in spec[len(CUSTOM_PREFIX) :].split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in _CUSTOM_KEYS or not value or key in fields:
            raise MemfitError(
                f"invalid GPU {spec!r}: {item.strip()!r} is not KEY=VALUE of {', '.join(_CUSTOM_KEYS)} (each once); "
                "e.g. custom:memory=12GiB,cc=8.6"
            )
        fields[key] = value
    if "memory" not in fields or "cc" not in fields:
        raise MemfitError(f"invalid GPU {spec!r}: give memory= and cc= at least (custom:memory=12GiB,cc=8.6)")
    match = re.fullmatch(r"(\d+)\.(\d)", fields["cc"])
    cc = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if cc not in _FAMILIES:
        known = ", ".join(f"{a}.{b}" for a, b in _FAMILIES)
        raise MemfitError(f"invalid GPU {spec!r}: cc={fields['cc']!r} is not a CUDA compute capability ({known})")
    try:
        memory = parse_size(fields["memory"])
    except MemfitError as error:
        raise MemfitError(f"invalid GPU {spec!r}: memory: {error}") from None
    peaks = {
        key: _custom_number(key, fields[key], spec)
        for key in ("fp32", "tf32", "bf16", "fp16", "bandwidth", "sms")
        if key in fields
    }
    if ("fp32" in peaks) != ("bandwidth" in peaks):
        raise MemfitError(f"invalid GPU {spec!r}: give fp32= and bandwidth= together (the step time needs both)")
    if cc < (8, 0) and ("bf16" in peaks or "tf32" in peaks):
        raise MemfitError(
            f"invalid GPU {spec!r}: compute capability {fields['cc']} has no bf16 or tf32 (they start at 8.0)"
        )
    name = fields.get("name") or f"custom GPU ({memory // MiB} MiB, cc {cc[0]}.{cc[1]})"
    return GPU(
        name=name,
        memory=memory,
        compute_capability=cc,
        bf16=cc >= (8, 0),
        family=_FAMILIES[cc],
        memory_source="custom",
        fp32=peaks.get("fp32", 0.0) * TFLOPS,
        tf32=peaks["tf32"] * TFLOPS if "tf32" in peaks else None,
        bf16_tensor=peaks["bf16"] * TFLOPS if "bf16" in peaks else None,
        fp16_tensor=peaks["fp16"] * TFLOPS if "fp16" in peaks else None,
        bandwidth=peaks.get("bandwidth", 0.0) * GBPS,
        spec_source="given on the command line (custom:)",
        sms=int(peaks.get("sms", 0)),
    )


def lookup(name: str) -> GPU:
    """The GPU called ``name`` (see the module for the names it accepts), or a card the
    table lacks described by ``custom:memory=SIZE,cc=X.Y[,...]`` (:func:`custom_gpu`).

    Why refuse a name that fits several cards: "A100" is a 40 GB or an 80 GB card, and the
    answer differs; the user knows which they rent.

    Raises:
        MemfitError: an unknown name (with the close names the table holds) or a name that
            fits several cards (with their names).
    """
    if name.strip().lower().startswith(CUSTOM_PREFIX):
        return custom_gpu(name.strip())
    found = candidates(name)
    if len(found) == 1:
        return found[0]
    if found:
        several = ", ".join(gpu.name for gpu in found)
        raise MemfitError(f"{name!r} fits several GPUs: {several}; name one (or give --memory SIZE)")
    key = normalize_name(name)
    spellings = {**_MODELS, **{k: [gpu] for k, gpu in _INDEX.items()}}
    close = difflib.get_close_matches(key, list(spellings), n=8, cutoff=0.5)
    names = list(dict.fromkeys(gpu.name for match in close for gpu in spellings[match]))[:4]
    hint = f"close names: {', '.join(names)}" if names else f"known: {', '.join(g.name for g in GPUS)}"
    raise MemfitError(f"unknown GPU {name!r}: {hint} (or give --memory SIZE, or custom:memory=SIZE,cc=X.Y)")


def fixed_costs(gpu: GPU) -> dict[str, int]:
    """Memory a process loses on ``gpu`` outside the tensors: the CUDA context and cuBLAS's workspace."""
    return {"cuda context": gpu.context, "cublas workspace": gpu.cublas_workspace}
