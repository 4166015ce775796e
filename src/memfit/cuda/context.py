"""Memory a CUDA process loses outside PyTorch's allocator: the context and cuBLAS's workspace.

- the CUDA context (driver state, kernel images loaded lazily since CUDA 11.7): memory the
  card loses before PyTorch allocates anything;
- cuBLAS's workspace, which PyTorch allocates per handle outside the caching allocator's
  reserved bytes on older releases.

>>> cublas_workspace(9) // 2**20, cublas_workspace(8) // 2**10
(32, 8320)
"""

from __future__ import annotations

from memfit.units import KiB, MiB

__all__ = ["CONTEXT_BY_FAMILY", "cublas_workspace"]

#: CUDA context per architecture family (PyTorch 2.x, CUDA 12, lazy module loading).
CONTEXT_BY_FAMILY: dict[str, int] = {
    "volta": 300 * MiB,
    "turing": 300 * MiB,
    "ampere": 400 * MiB,
    "ada": 400 * MiB,
    "hopper": 500 * MiB,
}


def cublas_workspace(major: int) -> int:
    """PyTorch's default cuBLAS workspace for a compute capability major version.

    Why it depends on the major version: PyTorch picks ``:4096:8`` (32 MiB) from Hopper
    (sm90) on and ``:4096:2:16:8`` before it.
    """
    if major >= 9:
        return 4096 * KiB * 8
    return 4096 * KiB * 2 + 16 * KiB * 8
