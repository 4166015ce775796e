"""Memory a CUDA process spends outside the tensors: the context and the library workspaces.

What a training process holds on the card beyond its tensors, by CUDA version, module
loading, architecture and the user's settings, each figure with its source:

- **the CUDA context** (driver state and the kernel images loaded into it): memory the
  card loses before PyTorch allocates anything, never seen by ``torch.cuda.memory_*``.
  Since CUDA 11.7 kernels can be loaded lazily (``CUDA_MODULE_LOADING=LAZY``), which
  PyTorch sets by default since 1.13 when the user has not (pytorch/pytorch#86509) and
  CUDA makes its own default on Linux since 12.2 (NVIDIA, CUDA Programming Guide,
  "Lazy Loading"); before it, every kernel of the process was loaded at once and the
  context was three to five times larger. See :data:`CONTEXT_FIGURES`.
- **cuBLAS's workspace**: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs),
  by default ``:4096:2:16:8`` (8320 KiB) before Hopper and 32 MiB on Hopper
  (``aten/src/ATen/cuda/CublasHandlePool.cpp: parseChosenWorkspaceSize``). One per
  cuBLAS handle and stream; handles are per thread, and autograd runs backward on its
  own device thread, so a training step holds two (:data:`CUBLAS_WORKSPACES_IN_TRAINING`).
  Since PyTorch 2.0 it is allocated through the caching allocator (pytorch/pytorch#95668:
  8,519,680 bytes left allocated after a ``Linear`` on 2.0, none on 1.13); before, cuBLAS
  kept its own default 4 MiB pool per handle (pytorch/pytorch#74159).
- **cuDNN's convolution workspace** (:mod:`memfit.cuda.cudnn`): transient, through the
  caching allocator, sized by the algorithm cuDNN picks; counted only as the cap the user
  set with ``CUDNN_CONV_WSCAP_DBG``.

The CUDA version of the estimate (``--cuda-version`` / ``cuda_version=``) is, in order:
what the user gives, the installed torch's CUDA, the lock's, else
:data:`DEFAULT_CUDA_VERSION`.

>>> cublas_workspace(9) // 2**20, cublas_workspace(8) // 2**10
(32, 8320)
>>> parse_cuda_version("cu118"), parse_cuda_version("12.4.1"), parse_cuda_version("12")
((11, 8), (12, 4), (12, 0))
>>> module_loading((11, 2), None), module_loading((12, 4), None), module_loading((12, 4), "EAGER")
('eager', 'lazy', 'eager')
>>> cuda_context((11, 2), "eager", "volta").bytes // 2**20
1341
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from memfit.environment.versions import version_tuple
from memfit.errors import MemfitError
from memfit.units import KiB, MiB

__all__ = [
    "CONTEXT_BY_FAMILY",
    "CONTEXT_FIGURES",
    "CUBLAS_WORKSPACES_IN_TRAINING",
    "ContextFigure",
    "DEFAULT_CUDA_VERSION",
    "LAZY_LOADING_SINCE",
    "ModuleLoading",
    "cublas_workspace",
    "cublas_workspace_in_allocator",
    "cuda_context",
    "fixed_costs",
    "installed_cuda_version",
    "module_loading",
    "parse_cublas_workspace_config",
    "parse_cuda_version",
    "resolve_cuda_version",
]

#: how kernel images reach the context: all at once ("eager") or on first use ("lazy")
ModuleLoading = Literal["lazy", "eager"]

#: the CUDA version assumed when neither the user, the installed torch nor a lock says:
#: a current CUDA 12 release (PyTorch's default wheels are CUDA 12 builds). Every figure
#: below is the same for all CUDA >= 12.2, so the exact minor does not change an estimate.
DEFAULT_CUDA_VERSION: tuple[int, int] = (12, 8)

#: lazy loading needs a CUDA 11.7 runtime (NVIDIA, CUDA Programming Guide, "Lazy Loading")
LAZY_LOADING_SINCE: tuple[int, int] = (11, 7)
#: CUDA's own default is LAZY on Linux since 12.2 (same guide, "Change History")
_CUDA_DEFAULT_LAZY_SINCE: tuple[int, int] = (12, 2)

#: cuBLAS workspaces a training step holds: one per (handle, stream), handles are per
#: thread (``CublasHandlePool.cpp``: a thread-local ``PoolWindow``), and the forward runs on
#: the caller's thread while autograd runs backward on its device thread.
CUBLAS_WORKSPACES_IN_TRAINING = 2

#: CUDA context with lazy loading, per architecture family (PyTorch 2.x, CUDA 12). Why
#: these: NVIDIA's ptrblck reports "~300MB" (pytorch/pytorch#107667) and "around 400MB"
#: (#109888) for CUDA >= 11.7 with lazy loading; the Hopper figure has no published source
#: (memfit's earlier assumption) and is what bench/gpu_accuracy.py measures on a lent GPU.
#: gpus.py reads this table for its per-card ``context``.
CONTEXT_BY_FAMILY: dict[str, int] = {
    "volta": 300 * MiB,
    "turing": 300 * MiB,
    "ampere": 400 * MiB,
    "ada": 400 * MiB,
    "hopper": 500 * MiB,
}


@dataclass(frozen=True)
class ContextFigure:
    """One published size of the CUDA context, and where it comes from.

    ``since`` / ``before``: the CUDA versions it holds for; ``family``: the architecture
    it was measured on (None: any, the GPU not being named or the figure applying to all).
    """

    bytes: int
    loading: ModuleLoading
    since: tuple[int, int]
    before: tuple[int, int] | None
    family: str | None
    source: str

    def covers(self, cuda: tuple[int, int], loading: ModuleLoading) -> bool:
        return self.loading == loading and self.since <= cuda and (self.before is None or cuda < self.before)


def _lazy(family: str, source: str) -> ContextFigure:
    return ContextFigure(CONTEXT_BY_FAMILY[family], "lazy", LAZY_LOADING_SINCE, None, family, source)


#: Every figure is what the card lost at the first CUDA call, less the caching allocator's
#: first segment where the measurement held a tensor (2 MiB for a small one, 20 MiB for one
#: between 1 and 10 MiB). Family-specific figures come first; a figure without a family
#: answers for a family that has none of its own.
CONTEXT_FIGURES: tuple[ContextFigure, ...] = (
    _lazy("volta", "ptrblck, pytorch/pytorch#107667: ~300 MB with lazy loading (CUDA >= 11.7)"),
    _lazy("turing", "ptrblck, pytorch/pytorch#107667: ~300 MB with lazy loading (CUDA >= 11.7)"),
    _lazy("ampere", "ptrblck, pytorch/pytorch#109888: around 400 MB with lazy loading (CUDA >= 11.7)"),
    _lazy("ada", "ptrblck, pytorch/pytorch#109888: around 400 MB with lazy loading (CUDA >= 11.7)"),
    _lazy("hopper", "ASSUMED: no published figure; bench/gpu_accuracy.py measures it on a lent GPU (not run yet)"),
    ContextFigure(
        int(253.75 * MiB),
        "lazy",
        LAZY_LOADING_SINCE,
        None,
        None,
        "pytorch/pytorch#86509 (torch 1.13, CUDA 11.7): 287,047,680 B used with a 6.4 MB tensor (20 MiB segment)",
    ),
    ContextFigure(
        int(615.75 * MiB),
        "eager",
        LAZY_LOADING_SINCE,
        None,
        None,
        "pytorch/pytorch#86509 (torch 1.13, CUDA 11.7, CUDA_MODULE_LOADING=DEFAULT): 666,632,192 B "
        "used with a 6.4 MB tensor (20 MiB segment)",
    ),
    ContextFigure(
        1341 * MiB,
        "eager",
        (11, 0),
        LAZY_LOADING_SINCE,
        "volta",
        "transformers docs, 'Model training anatomy' (V100 16GB, driver 460.91, CUDA 11.2): "
        "1343 MiB in nvidia-smi after torch.ones((1, 1)).to('cuda') (2 MiB segment)",
    ),
    ContextFigure(
        999 * MiB,
        "eager",
        (11, 0),
        LAZY_LOADING_SINCE,
        "ampere",
        "pytorch/pytorch#54564 (RTX 3090, driver 455.23, CUDA 11.1): 1001 MiB in nvidia-smi "
        "with a 100x100 tensor (2 MiB segment); #49877 saw about 1486 MiB on torch 1.7.1",
    ),
    ContextFigure(
        1341 * MiB,
        "eager",
        (11, 0),
        LAZY_LOADING_SINCE,
        None,
        "no figure for this architecture: the V100's (transformers docs, CUDA 11.2)",
    ),
    ContextFigure(
        int(1005.25 * MiB),
        "eager",
        (10, 0),
        (11, 0),
        None,
        "pytorch/pytorch#28394 (Titan V, torch 1.3, CUDA 10.1): 1008.19 MiB used, "
        "0.94 MiB before, 2 MiB cached by the allocator",
    ),
)


def parse_cuda_version(value: str | tuple[int, ...] | None) -> tuple[int, int]:
    """A CUDA version as ``(major, minor)`` from ``"12.4"``, ``"12.4.1"``, ``"12"``, ``"cu124"``.

    Args:
        value: the text (or a tuple of ints) to read.
    """
    if isinstance(value, tuple):
        numbers: tuple[int, ...] = value
    else:
        text = (value or "").strip().lower()
        tag = re.fullmatch(r"cu(\d{2,3})", text)
        numbers = (int(tag.group(1)[:-1]), int(tag.group(1)[-1])) if tag else version_tuple(text)
        if not re.fullmatch(r"(cu\d{2,3}|\d+(\.\d+){0,2})", text):
            numbers = ()
    if not numbers or not 7 <= numbers[0] <= 99:
        raise MemfitError(f"invalid CUDA version {value!r}: write it as 12.4 (or cu124)")
    return numbers[0], numbers[1] if len(numbers) > 1 else 0


def installed_cuda_version() -> tuple[int, int] | None:
    """The CUDA the installed torch was built with (None for a CPU build)."""
    import torch

    cuda = torch.version.cuda
    return parse_cuda_version(cuda) if cuda else None


def resolve_cuda_version(
    given: str | tuple[int, ...] | None = None, locked: str | None = None
) -> tuple[tuple[int, int], str]:
    """The CUDA version an estimate is for, and where it came from.

    Args:
        given: what the user asked for (``--cuda-version``), first.
        locked: a lock's recorded ``torch_cuda``, used when torch here has no CUDA.

    >>> resolve_cuda_version("11.8")
    ((11, 8), 'given')
    """
    if given is not None:
        return parse_cuda_version(given), "given"
    installed = installed_cuda_version()
    if installed is not None:
        return installed, "installed torch"
    if locked:
        return parse_cuda_version(locked), "memfit.lock"
    return DEFAULT_CUDA_VERSION, "default"


def module_loading(cuda: tuple[int, int], setting: str | None) -> ModuleLoading:
    """Whether kernels load lazily, from the CUDA version and ``CUDA_MODULE_LOADING``.

    Why each case: lazy loading exists from CUDA 11.7; PyTorch sets LAZY when the user
    has not (pytorch/pytorch#86509, torch >= 1.13); ``DEFAULT`` is CUDA's own default,
    LAZY on Linux from 12.2. (A driver older than 515 cannot load lazily at all.)

    Args:
        cuda: the CUDA version of the torch build.
        setting: the value of ``CUDA_MODULE_LOADING`` (None when unset).
    """
    if cuda < LAZY_LOADING_SINCE:
        return "eager"
    value = (setting or "").strip().upper()
    if value == "EAGER":
        return "eager"
    if value == "DEFAULT":
        return "lazy" if cuda >= _CUDA_DEFAULT_LAZY_SINCE else "eager"
    if value in ("", "LAZY"):
        return "lazy"
    raise MemfitError(f"invalid CUDA_MODULE_LOADING={setting!r}: use LAZY, EAGER or DEFAULT")


def cuda_context(cuda: tuple[int, int], loading: ModuleLoading, family: str | None) -> ContextFigure:
    """The published context figure for this CUDA version, loading and architecture family.

    Args:
        cuda: the CUDA version of the torch build.
        loading: ``lazy`` or ``eager`` (see :func:`module_loading`).
        family: ``volta``, ``turing``, ``ampere``, ``ada``, ``hopper`` (None: not known).
    """
    covering = [figure for figure in CONTEXT_FIGURES if figure.covers(cuda, loading)]
    for figure in covering:
        if figure.family is not None and figure.family == family:
            return figure
    for figure in covering:
        if figure.family is None:
            return figure
    raise MemfitError(
        f"no published CUDA context figure for CUDA {cuda[0]}.{cuda[1]} with {loading} loading: give --fixed-costs SIZE"
    )


def parse_cublas_workspace_config(text: str) -> int | None:
    """Bytes of one workspace under ``CUBLAS_WORKSPACE_CONFIG`` (None when PyTorch cannot parse it).

    PyTorch sums ``SIZE KiB x COUNT`` over every ``:SIZE:COUNT`` pair; a value with no pair
    is warned about and replaced by the default (``parseChosenWorkspaceSize``).

    >>> parse_cublas_workspace_config(":4096:2:16:8") // KiB, parse_cublas_workspace_config(":0:0")
    (8320, 0)
    """
    pairs = re.findall(r":([0-9]+):([0-9]+)", text)
    if not pairs:
        return None
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def cublas_workspace(major: int, config: str | None = None) -> int:
    """One cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` when set, else PyTorch's default.

    Why the major version: PyTorch picks ``:4096:8`` (32 MiB) for Hopper (sm90) and
    ``:4096:2:16:8`` (8320 KiB) before it; Blackwell (sm100, sm120) took 32 MiB in some
    releases and went back (pytorch/pytorch#175344, #182669), so it follows Hopper here.

    Args:
        major: the compute capability's major version.
        config: the value of ``CUBLAS_WORKSPACE_CONFIG`` (None when unset).
    """
    if config is not None:
        parsed = parse_cublas_workspace_config(config)
        if parsed is not None:
            return parsed
    if major >= 9:
        return 4096 * KiB * 8
    return 4096 * KiB * 2 + 16 * KiB * 8


def cublas_workspace_in_allocator(torch_version: str) -> bool:
    """True when PyTorch allocates cuBLAS's workspace through its caching allocator (2.0 on).

    Then the workspace is part of ``memory_allocated``/``memory_reserved``; before, cuBLAS
    held its own pool, seen only by nvidia-smi (pytorch/pytorch#95668).
    """
    return version_tuple(torch_version)[:1] >= (2,)


def fixed_costs(
    family: str | None,
    major: int,
    cuda: tuple[int, int],
    env: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """What a training process holds outside its tensors, by part name.

    ``cuda context`` (:func:`cuda_context`), ``cublas workspace`` (two, see
    :data:`CUBLAS_WORKSPACES_IN_TRAINING`) and ``cudnn workspace`` (the cap set by
    ``CUDNN_CONV_WSCAP_DBG``, else 0: see :mod:`memfit.cuda.cudnn`).

    Args:
        family: the GPU's architecture family (None: not known).
        major: its compute capability's major version.
        cuda: the CUDA version of the torch build.
        env: the environment to read the user's settings from (default: this process's).
    """
    from memfit.cuda.cudnn import conv_workspace_cap

    env = os.environ if env is None else env
    loading = module_loading(cuda, env.get("CUDA_MODULE_LOADING"))
    return {
        "cuda context": cuda_context(cuda, loading, family).bytes,
        "cublas workspace": CUBLAS_WORKSPACES_IN_TRAINING * cublas_workspace(major, env.get("CUBLAS_WORKSPACE_CONFIG")),
        "cudnn workspace": conv_workspace_cap(env.get("CUDNN_CONV_WSCAP_DBG")) or 0,
    }
