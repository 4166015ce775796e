"""A table of GPU models: usable memory, compute capability, bf16, and the fixed costs
that PyTorch's caching allocator never sees.

Why a table: ``memfit estimate --gpu "RTX 3090"`` answers "will it fit on a card I do
not have?", so the card's numbers must be known without the card.

- ``memory`` is the total CUDA reports to PyTorch
  (``torch.cuda.get_device_properties(i).total_memory``, printed by PyTorch as
  ``total_memory=24268MB`` in MiB). ``source`` says where each number comes from:
  ``"torch"`` is a value printed by ``get_device_properties`` in public logs; ``"smi"``
  is nvidia-smi's ``memory.total`` less the typical gap between the two (about 1-2 %),
  an approximation. Either way, ``--memory SIZE`` overrides it.
- ``context`` is the CUDA context (driver state, kernel images loaded lazily since CUDA
  11.7): it is memory the card loses before PyTorch allocates anything. The figures are
  typical values for PyTorch 2.x on CUDA 12 with lazy loading, per architecture family;
  they vary by a few hundred MiB with the driver, the CUDA version and the libraries
  loaded, hence ``fixed_costs=`` / ``--fixed-costs`` to override them.
- ``cublas_workspace`` is PyTorch's default cuBLAS workspace per handle
  (``CUBLAS_WORKSPACE_CONFIG`` ``:4096:2:16:8`` = 8320 KiB before Hopper, ``:4096:8`` =
  32 MiB on Hopper and later).

>>> gpu = lookup("rtx3090")
>>> gpu.name, gpu.memory // 2**20, gpu.bf16
('RTX 3090', 24268, True)
>>> normalize_name("A100-80GB") == normalize_name("a100 80gb")
True
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


@dataclass(frozen=True)
class GPU:
    """One GPU model. Bytes are ints."""

    name: str
    memory: int
    compute_capability: tuple[int, int]
    bf16: bool
    family: str
    source: str  # "torch" (get_device_properties in public logs) or "smi" (approximate)
    aliases: tuple[str, ...] = ()

    @property
    def context(self) -> int:
        return CONTEXT_BY_FAMILY[self.family]

    @property
    def cublas_workspace(self) -> int:
        return cublas_workspace(self.compute_capability[0])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compute_capability"] = f"{self.compute_capability[0]}.{self.compute_capability[1]}"
        data["context"] = self.context
        data["cublas_workspace"] = self.cublas_workspace
        return data


GPUS: tuple[GPU, ...] = (
    GPU("RTX 3060 12GB", 11_910 * MiB, (8, 6), True, "ampere", "smi", ("rtx3060", "3060", "rtx 3060")),
    GPU("RTX 3090", 24_268 * MiB, (8, 6), True, "ampere", "torch", ("3090",)),
    GPU("RTX 4090", 24_563 * MiB, (8, 9), True, "ada", "torch", ("4090",)),
    GPU("T4", 15_102 * MiB, (7, 5), False, "turing", "torch", ("tesla t4",)),
    GPU("V100 16GB", 16_160 * MiB, (7, 0), False, "volta", "torch", ("v100", "v100-sxm2-16gb", "tesla v100")),
    GPU("V100 32GB", 32_510 * MiB, (7, 0), False, "volta", "smi", ("v100-sxm2-32gb",)),
    GPU("A10", 22_731 * MiB, (8, 6), True, "ampere", "smi", ("a10g",)),
    GPU("L4", 22_563 * MiB, (8, 9), True, "ada", "smi", ()),
    GPU("A100 40GB", 40_536 * MiB, (8, 0), True, "ampere", "torch", ("a100-sxm4-40gb", "a100 40")),
    GPU("A100 80GB", 81_050 * MiB, (8, 0), True, "ampere", "smi", ("a100", "a100-sxm4-80gb", "a100 80")),
    GPU("H100 80GB", 81_090 * MiB, (9, 0), True, "hopper", "torch", ("h100", "h100 80gb hbm3", "h100 sxm")),
    GPU("H200", 143_156 * MiB, (9, 0), True, "hopper", "torch", ("h200 141gb",)),
)


def normalize_name(name: str) -> str:
    """Lower-case and drop spaces, hyphens, underscores and vendor words, so "RTX 3090",
    "rtx3090" and "NVIDIA GeForce RTX 3090" are one key."""
    text = name.lower()
    text = re.sub(r"\b(nvidia|geforce|tesla)\b", "", text)
    return re.sub(r"[\s\-_]+", "", text)


def _index() -> dict[str, GPU]:
    index: dict[str, GPU] = {}
    for gpu in GPUS:
        for key in (gpu.name, *gpu.aliases):
            index[normalize_name(key)] = gpu
    return index


_INDEX = _index()


def lookup(name: str) -> GPU:
    """The GPU called ``name`` (tolerant of case, spaces and hyphens).

    Why the close names: a typo ("rtx3080", "a100-80") should tell the user what the
    table does hold, in one line.
    """
    key = normalize_name(name)
    if key in _INDEX:
        return _INDEX[key]
    close = difflib.get_close_matches(key, list(_INDEX), n=8, cutoff=0.5)
    names = list(dict.fromkeys(_INDEX[match].name for match in close))[:4]
    hint = f"close names: {', '.join(names)}" if names else f"known: {', '.join(g.name for g in GPUS)}"
    raise MemfitError(f"unknown GPU {name!r}: {hint} (or give --memory SIZE)")


def fixed_costs(gpu: GPU) -> dict[str, int]:
    """Memory a process loses on ``gpu`` outside the tensors: the CUDA context and cuBLAS's workspace."""
    return {"cuda context": gpu.context, "cublas workspace": gpu.cublas_workspace}
