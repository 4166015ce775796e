"""Version tables that change with every torch, CUDA and driver release, and their helpers.

Why apart from the doctor: these facts are data (what was published, with its source);
the checks that read them are logic. When torch or CUDA ships, only this file changes.

>>> version_tuple("2.5.1+cu124")
(2, 5, 1)
"""

from __future__ import annotations

import re

__all__ = [
    "TORCH_CUDA_BUILDS",
    "LATEST_RELEASE",
    "MIN_LINUX_DRIVER",
    "ARCH_MIN_CUDA",
    "ALLOC_CONF_KEYS",
    "NATIVE_ONLY_KEYS",
    "WHEEL_INDEX",
    "version_tuple",
    "base_version",
    "cuda_tag_version",
    "cuda_builds",
    "pick_cuda_build",
    "install_command",
    "min_driver_for",
    "parse_cuda",
    "format_cudnn_version",
    "arch_supported",
]

WHEEL_INDEX = "https://download.pytorch.org/whl"

#: CUDA builds published for each torch release (download.pytorch.org); a release not
#: listed uses the nearest older one
TORCH_CUDA_BUILDS: dict[tuple[int, int], tuple[str, ...]] = {
    (1, 13): ("cu116", "cu117"),
    (2, 0): ("cu117", "cu118"),
    (2, 1): ("cu118", "cu121"),
    (2, 2): ("cu118", "cu121"),
    (2, 3): ("cu118", "cu121"),
    (2, 4): ("cu118", "cu121", "cu124"),
    (2, 5): ("cu118", "cu121", "cu124"),
    (2, 6): ("cu118", "cu124", "cu126"),
    (2, 7): ("cu118", "cu126", "cu128"),
    (2, 8): ("cu126", "cu128", "cu129"),
    (2, 9): ("cu126", "cu128", "cu130"),
    (2, 10): ("cu126", "cu128", "cu130"),
    (2, 13): ("cu126", "cu129", "cu130", "cu132"),
}

#: the newest release in the table, for installs that do not keep a version
LATEST_RELEASE = ".".join(map(str, max(TORCH_CUDA_BUILDS)))

#: the oldest Linux driver of each CUDA release (NVIDIA's CUDA toolkit release notes)
MIN_LINUX_DRIVER: dict[tuple[int, int], str] = {
    (11, 6): "510.39.01",
    (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
    (13, 2): "590.44.01",
}

#: the first CUDA release that compiles for each GPU architecture (sm_XY as XY)
ARCH_MIN_CUDA: dict[int, tuple[int, int]] = {
    80: (11, 0),
    86: (11, 1),
    87: (11, 4),
    89: (11, 8),
    90: (11, 8),
    100: (12, 8),
    101: (12, 8),
    120: (12, 8),
    103: (12, 9),
    121: (12, 9),
    110: (13, 0),
}

#: keys PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF accept (c10 AllocatorConfig, CUDAAllocatorConfig)
ALLOC_CONF_KEYS = frozenset(
    {
        "backend",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "large_segment_size_mb",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_use_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_max_round_threshold",
        "pinned_max_cached_size",
        "pinned_reserve_segment_size_mb",
        "pinned_free_catch_all",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
        "throw_on_cudamalloc_oom",
    }
)
#: keys the native caching allocator reads and backend:cudaMallocAsync ignores
NATIVE_ONLY_KEYS = frozenset(
    {
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
    }
)


def version_tuple(text: str | None) -> tuple[int, ...]:
    """Leading numbers of a version ("2.5.1+cu124" -> (2, 5, 1)), for ordering versions."""
    if not text:
        return ()
    numbers = []
    for part in re.split(r"[.+-]", text):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


def base_version(torch_version: str) -> str:
    """torch's version without the local build tag: "2.5.1+cu124" -> "2.5.1"."""
    return torch_version.split("+", 1)[0]


def cuda_tag_version(tag: str) -> tuple[int, int]:
    """A wheel tag as a CUDA version: "cu124" -> (12, 4), "cu118" -> (11, 8)."""
    digits = tag[2:]
    return int(digits[:-1]), int(digits[-1])


def cuda_builds(torch_version: str) -> tuple[str, ...]:
    """The CUDA wheel tags published for this torch release (nearest older known release)."""
    release = version_tuple(torch_version)[:2]
    known = sorted(TORCH_CUDA_BUILDS)
    older = [key for key in known if key <= release]
    return TORCH_CUDA_BUILDS[older[-1] if older else known[0]]


def pick_cuda_build(torch_version: str, driver_cuda: tuple[int, int] | None) -> str | None:
    """The newest CUDA wheel of this torch release the driver can run, or None if none.

    Why the newest: it carries kernels for the most GPU architectures.

    >>> pick_cuda_build("2.5.1", (12, 2)), pick_cuda_build("2.7.0", (12, 8)), pick_cuda_build("2.5.1", (11, 4))
    ('cu121', 'cu128', None)
    """
    builds = cuda_builds(torch_version)
    if driver_cuda is None:
        return builds[-1]
    runnable = [tag for tag in builds if cuda_tag_version(tag) <= driver_cuda]
    return runnable[-1] if runnable else None


def install_command(torch_version: str, tag: str) -> str:
    """pip command that replaces torch with the same release built for ``tag``."""
    return f"pip install --force-reinstall torch=={base_version(torch_version)} --index-url {WHEEL_INDEX}/{tag}"


def min_driver_for(cuda: tuple[int, int]) -> str | None:
    """The oldest Linux driver that runs CUDA ``cuda`` (None when not in the table)."""
    candidates = [version for key, version in sorted(MIN_LINUX_DRIVER.items()) if key >= cuda]
    return candidates[0] if candidates else None


def parse_cuda(text: str | None) -> tuple[int, int] | None:
    """torch.version.cuda ("12.4") as (12, 4)."""
    numbers = version_tuple(text)
    return (numbers[0], numbers[1] if len(numbers) > 1 else 0) if numbers else None


def format_cudnn_version(value: int) -> str:
    """cuDNN's integer version as text: 90100 -> "9.1.0" (cuDNN 9), 8902 -> "8.9.2" (cuDNN 8).

    >>> format_cudnn_version(90100), format_cudnn_version(8902)
    ('9.1.0', '8.9.2')
    """
    if value >= 10000:
        return f"{value // 10000}.{value % 10000 // 100}.{value % 100}"
    return f"{value // 1000}.{value % 1000 // 100}.{value % 100}"


def arch_supported(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """True when torch's kernels run on a GPU of this compute capability.

    Why these rules (CUDA's): a ``sm_XY`` cubin runs on the same major with minor >= Y
    (``sm_90a`` only on 9.0 itself); ``compute_XY`` PTX is compiled at load time for any GPU
    of capability >= XY.

    >>> arch_supported((8, 6), ("sm_80", "sm_90")), arch_supported((12, 0), ("sm_80", "sm_90"))
    (True, False)
    """
    device = 10 * capability[0] + capability[1]
    for entry in arch_list:
        kind, _, digits = entry.partition("_")
        number = int(re.sub(r"\D", "", digits) or 0)
        if kind == "compute" and device >= number:
            return True
        if kind == "sm":
            if digits.endswith("a") and device == number:
                return True
            if not digits.endswith("a") and device // 10 == number // 10 and device >= number:
                return True
    return False
