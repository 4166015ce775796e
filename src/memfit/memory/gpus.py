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
  has no such tensor-core mode. ``bandwidth``: peak memory bandwidth in bytes/s.
  ``spec_source`` names the NVIDIA datasheet or whitepaper the figures come from.
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

__all__ = ["GPU", "GPUS", "lookup", "normalize_name", "fixed_costs", "CONTEXT_BY_FAMILY", "cublas_workspace"]

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
    fp16: float,
    bandwidth: float,
    source: str,
) -> GPU:
    return GPU(
        name=name,
        memory=memory,
        compute_capability=cc,
        bf16=bf16 is not None,
        family=family,
        memory_source=memory_source,
        aliases=aliases,
        fp32=fp32 * TFLOPS,
        tf32=None if tf32 is None else tf32 * TFLOPS,
        bf16_tensor=None if bf16 is None else bf16 * TFLOPS,
        fp16_tensor=fp16 * TFLOPS,
        bandwidth=bandwidth * GBPS,
        spec_source=source,
    )


_VOLTA = {"tf32": None, "bf16": None}

# fmt: off
GPUS: tuple[GPU, ...] = (
    # -- data centre ------------------------------------------------------------------
    _card("V100 SXM2 16GB", 16_160 * MiB, (7, 0), "volta", "torch", ("Tesla V100-SXM2-16GB",),
          fp32=15.7, **_VOLTA, fp16=125, bandwidth=900, source=_V100),
    _card("V100 SXM2 32GB", 32_510 * MiB, (7, 0), "volta", "smi", ("Tesla V100-SXM2-32GB",),
          fp32=15.7, **_VOLTA, fp16=125, bandwidth=900, source=_V100),
    _card("V100 PCIe 16GB", 16_160 * MiB, (7, 0), "volta", "smi", ("Tesla V100-PCIE-16GB",),
          fp32=14.0, **_VOLTA, fp16=112, bandwidth=900, source=_V100),
    _card("V100 PCIe 32GB", 32_510 * MiB, (7, 0), "volta", "smi", ("Tesla V100-PCIE-32GB",),
          fp32=14.0, **_VOLTA, fp16=112, bandwidth=900, source=_V100),
    _card("V100S PCIe 32GB", 32_510 * MiB, (7, 0), "volta", "smi", ("Tesla V100S-PCIE-32GB",),
          fp32=16.4, **_VOLTA, fp16=130, bandwidth=1134, source=_V100),
    _card("T4", 15_102 * MiB, (7, 5), "turing", "torch", ("Tesla T4",),
          fp32=8.1, **_VOLTA, fp16=65, bandwidth=320, source=_T4),
    _card("A10", 22_731 * MiB, (8, 6), "ampere", "smi", ("NVIDIA A10",),
          fp32=31.2, tf32=62.5, bf16=125, fp16=125, bandwidth=600, source=_A10),
    _card("A10G", 22_731 * MiB, (8, 6), "ampere", "smi", ("NVIDIA A10G",),
          fp32=35.0, tf32=35.0, bf16=70, fp16=70, bandwidth=600, source=_A10G),
    _card("A30", _spec(24), (8, 0), "ampere", "spec", ("NVIDIA A30",),
          fp32=10.3, tf32=82, bf16=165, fp16=165, bandwidth=933, source=_A30),
    _card("A40", _spec(48), (8, 6), "ampere", "spec", ("NVIDIA A40",),
          fp32=37.4, tf32=74.8, bf16=149.7, fp16=149.7, bandwidth=696, source=_A40),
    # The 40 GB PCIe and SXM4 cards share every figure: one entry.
    _card("A100 40GB", 40_536 * MiB, (8, 0), "ampere", "torch",
          ("NVIDIA A100-PCIE-40GB", "NVIDIA A100-SXM4-40GB", "A100 40GB PCIe", "A100 40GB SXM"),
          fp32=19.5, tf32=156, bf16=312, fp16=312, bandwidth=1555, source=_A100),
    _card("A100 80GB PCIe", 81_050 * MiB, (8, 0), "ampere", "smi", ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
          fp32=19.5, tf32=156, bf16=312, fp16=312, bandwidth=1935, source=_A100),
    _card("A100 80GB SXM", 81_050 * MiB, (8, 0), "ampere", "smi", ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
          fp32=19.5, tf32=156, bf16=312, fp16=312, bandwidth=2039, source=_A100),
    _card("L4", 22_563 * MiB, (8, 9), "ada", "smi", ("NVIDIA L4",),
          fp32=30.3, tf32=60, bf16=121, fp16=121, bandwidth=300, source=_L4),
    _card("L40", _spec(48), (8, 9), "ada", "spec", ("NVIDIA L40",),
          fp32=90.5, tf32=90.5, bf16=181, fp16=181, bandwidth=864, source=_L40),
    _card("L40S", _spec(48), (8, 9), "ada", "spec", ("NVIDIA L40S",),
          fp32=91.6, tf32=183, bf16=362, fp16=362, bandwidth=864, source=_L40S),
    _card("H100 PCIe", _spec(80), (9, 0), "hopper", "spec", ("NVIDIA H100 PCIe", "H100 80GB PCIe"),
          fp32=51, tf32=378, bf16=756, fp16=756, bandwidth=2000, source=_H100),
    _card("H100 SXM", 81_090 * MiB, (9, 0), "hopper", "torch",
          ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB", "H100-SXM5-80GB"),
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, bandwidth=3350, source=_H100),
    _card("H100 NVL", _spec(94), (9, 0), "hopper", "spec", ("NVIDIA H100 NVL",),
          fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, bandwidth=3900, source=_H100),
    _card("H200", 143_156 * MiB, (9, 0), "hopper", "torch", ("NVIDIA H200", "H200 SXM", "H200 141GB"),
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, bandwidth=4800, source=_H200),
    _card("GH200", _spec(96), (9, 0), "hopper", "spec", ("NVIDIA GH200 480GB", "GH200 96GB"),
          fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, bandwidth=4000, source=_GH200),
    _card("B200", _spec(180), (10, 0), "blackwell", "spec", ("NVIDIA B200",),
          fp32=75, tf32=1125, bf16=2250, fp16=2250, bandwidth=8000, source=_B200),
    # -- consumer and workstation --------------------------------------------------------
    _card("RTX 2080 Ti", _spec(11), (7, 5), "turing", "spec", ("NVIDIA GeForce RTX 2080 Ti",),
          fp32=13.4, **_VOLTA, fp16=53.8, bandwidth=616, source=_TURING),
    # "NVIDIA GeForce RTX 3060" is the 12 GB card (the rare 8 GB one is not in the table).
    _card("RTX 3060 12GB", 11_910 * MiB, (8, 6), "ampere", "smi", ("NVIDIA GeForce RTX 3060",),
          fp32=12.7, tf32=12.7, bf16=25.5, fp16=25.5, bandwidth=360, source=_GA10X_DERIVED),
    _card("RTX 3070", _spec(8), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3070",),
          fp32=20.3, tf32=20.3, bf16=40.6, fp16=40.6, bandwidth=448, source=_GA102),
    _card("RTX 3080 10GB", _spec(10), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3080 10GB",),
          fp32=29.8, tf32=29.8, bf16=59.5, fp16=59.5, bandwidth=760, source=_GA102),
    _card("RTX 3080 12GB", _spec(12), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3080 12GB",),
          fp32=30.6, tf32=30.6, bf16=61.3, fp16=61.3, bandwidth=912, source=_GA10X_DERIVED),
    _card("RTX 3090", 24_268 * MiB, (8, 6), "ampere", "torch", ("NVIDIA GeForce RTX 3090",),
          fp32=35.6, tf32=35.6, bf16=71, fp16=71, bandwidth=936, source=_GA102),
    _card("RTX 3090 Ti", _spec(24), (8, 6), "ampere", "spec", ("NVIDIA GeForce RTX 3090 Ti",),
          fp32=40.0, tf32=40.0, bf16=80, fp16=80, bandwidth=1008, source=_GA10X_DERIVED),
    _card("RTX 4060 Ti 8GB", _spec(8), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4060 Ti 8GB",),
          fp32=22.1, tf32=22.1, bf16=44.1, fp16=44.1, bandwidth=288, source=_ADA_DERIVED),
    _card("RTX 4060 Ti 16GB", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4060 Ti 16GB",),
          fp32=22.1, tf32=22.1, bf16=44.1, fp16=44.1, bandwidth=288, source=_ADA_DERIVED),
    _card("RTX 4070", _spec(12), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4070",),
          fp32=29.1, tf32=29.1, bf16=58.3, fp16=58.3, bandwidth=504, source=_ADA_DERIVED),
    _card("RTX 4080", _spec(16), (8, 9), "ada", "spec", ("NVIDIA GeForce RTX 4080",),
          fp32=48.7, tf32=48.7, bf16=97.5, fp16=97.5, bandwidth=716.8, source=_ADA),
    _card("RTX 4090", 24_563 * MiB, (8, 9), "ada", "torch", ("NVIDIA GeForce RTX 4090",),
          fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, bandwidth=1008, source=_ADA),
    _card("RTX 5090", _spec(32), (12, 0), "blackwell", "spec", ("NVIDIA GeForce RTX 5090",),
          fp32=104.8, tf32=104.8, bf16=209.5, fp16=209.5, bandwidth=1792, source=_RTX_BLACKWELL),
    _card("RTX A4000", _spec(16), (8, 6), "ampere", "spec", ("NVIDIA RTX A4000",),
          fp32=19.2, tf32=38.4, bf16=76.7, fp16=76.7, bandwidth=448, source=_RTX_AMPERE),
    _card("RTX A5000", _spec(24), (8, 6), "ampere", "spec", ("NVIDIA RTX A5000",),
          fp32=27.8, tf32=55.6, bf16=111.1, fp16=111.1, bandwidth=768, source=_RTX_AMPERE),
    _card("RTX A6000", _spec(48), (8, 6), "ampere", "spec", ("NVIDIA RTX A6000",),
          fp32=38.7, tf32=77.4, bf16=154.8, fp16=154.8, bandwidth=768, source=_GA102),
    _card("RTX 6000 Ada", _spec(48), (8, 9), "ada", "spec", ("NVIDIA RTX 6000 Ada Generation",),
          fp32=91.1, tf32=182.1, bf16=364.2, fp16=364.2, bandwidth=960, source=_ADA),
)
# fmt: on

# -- names ------------------------------------------------------------------------------

#: words a name may carry or leave out without naming another card
_VENDOR = frozenset({"nvidia", "geforce", "tesla", "quadro", "rtx"})
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


def lookup(name: str) -> GPU:
    """The GPU called ``name`` (see the module for the names it accepts).

    Why refuse a name that fits several cards: "A100" is a 40 GB or an 80 GB card, and the
    answer differs; the user knows which they rent.

    Raises:
        MemfitError: an unknown name (with the close names the table holds) or a name that
            fits several cards (with their names).
    """
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
    raise MemfitError(f"unknown GPU {name!r}: {hint} (or give --memory SIZE)")


def fixed_costs(gpu: GPU) -> dict[str, int]:
    """Memory a process loses on ``gpu`` outside the tensors: the CUDA context and cuBLAS's workspace."""
    return {"cuda context": gpu.context, "cublas workspace": gpu.cublas_workspace}
