"""The CUDA GPU and software whose semantics the simulated GPU and the estimator follow.

A :class:`CudaTarget` holds what decides what CUDA would hold: the compute capability
(which attention kernels exist), the CUDA version (which cuDNN the torch wheel ships, so
which kernel PyTorch prefers) and the torch version (whose rules and autocast lists apply).
The simulated GPU (``sim:SIZE``) is an sm80 card (A100 class) unless told otherwise; an
estimate for a named GPU uses that GPU's capability. The CUDA version, when not given, is
:func:`memfit.cuda.context.resolve_cuda_version`'s: the installed torch's CUDA, else a
lock's, else :data:`memfit.cuda.context.DEFAULT_CUDA_VERSION`.

>>> CudaTarget(capability=(9, 0), cuda_version=(13, 0)).prefers_cudnn_attention
True
>>> CudaTarget(capability=(9, 0), cuda_version=(12, 8)).prefers_cudnn_attention
False
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from memfit.cuda.context import resolve_cuda_version

__all__ = ["CudaTarget", "torch_version"]


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(re.match(r"\d+", minor).group(0))  # type: ignore[union-attr]


def _default_cuda() -> tuple[int, int]:
    return resolve_cuda_version()[0]


@dataclass(frozen=True)
class CudaTarget:
    """The CUDA GPU (and software) whose semantics a run follows.

    Args:
        capability: the compute capability, (8, 0) for an A100.
        cuda_version: the CUDA of the torch build, (12, 8).
        name: how reports name the target.
    """

    capability: tuple[int, int] = (8, 0)
    cuda_version: tuple[int, int] = field(default_factory=_default_cuda)
    name: str = "simulated GPU"

    @property
    def torch_version(self) -> tuple[int, int]:
        return torch_version()

    @property
    def prefers_cudnn_attention(self) -> bool:
        """Whether PyTorch puts cuDNN attention first (``check_prefer_cudnn_attention``).

        Source: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: cuDNN first on sm90
        and sm10x (sm9.0/10.0/10.3 with CUDA < 13) when the runtime cuDNN is newer than
        9.15.0; "CUDA <= 12.9 wheels ship with older cuDNN" (pytorch#169849), so that is
        taken as: CUDA 13 and later wheels prefer cuDNN there, CUDA 12 wheels do not.
        """
        return self.cuda_version[0] >= 13 and self.capability[0] in (9, 10)

    def describe(self) -> str:
        major, minor = self.capability
        cuda = "{}.{}".format(*self.cuda_version)
        return f"{self.name}, sm{major}{minor}, CUDA {cuda}, torch {'.'.join(map(str, self.torch_version))}"
