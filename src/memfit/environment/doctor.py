"""Environment findings: the causes of OOM (and of fake OOM) that are not the model.

Each check is a small pure function of probed facts (:mod:`memfit.environment.system`) returning
:class:`EnvironmentFinding` s: a severity (``error``, ``warning``, ``info``), one line saying what is
wrong and one line with the command or setting that fixes it. :func:`diagnose` runs them
all against a :class:`~memfit.environment.system.SystemProbe` (the live machine by default).

>>> from memfit.environment.system import NvidiaFacts, TorchFacts
>>> gpu = GpuInfo(0, "NVIDIA A100-SXM4-80GB", "GPU-1", "00000000:07:00.0", 80 * GiB, GiB, 79 * GiB, (8, 0))
>>> nvidia = NvidiaFacts("nvml", "550.54.14", (12, 4), (gpu,))
>>> [finding] = check_torch_build(TorchFacts(version="2.5.1+cpu"), nvidia)
>>> finding.severity, finding.fix
('error', 'pip install --force-reinstall torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124')
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from memfit.environment import system
from memfit.environment.system import (
    GpuInfo,
    HostFacts,
    NvidiaFacts,
    PythonFacts,
    SystemProbe,
    TorchFacts,
)
from memfit.environment.versions import (
    ALLOC_CONF_KEYS,
    ARCH_MIN_CUDA,
    LATEST_RELEASE,
    NATIVE_ONLY_KEYS,
    TORCH_CUDA_BUILDS,
    WHEEL_INDEX,
    arch_supported,
    base_version,
    cuda_builds,
    cuda_tag_version,
    format_cudnn_version,
    install_command,
    min_driver_for,
    parse_cuda,
    pick_cuda_build,
    version_tuple,
)
from memfit.units import GiB, format_size

__all__ = [
    "EnvironmentFinding",
    "TrainingHints",
    "Diagnosis",
    "diagnose",
    "parse_alloc_conf",
]

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")

#: share of a GPU that other processes (or unlisted users) may hold before we warn
FOREIGN_SHARE = 0.10

ALLOC_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class EnvironmentFinding:
    """One thing the doctor found: what is wrong (``message``) and what fixes it (``fix``)."""

    check: str
    severity: Severity
    message: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainingHints:
    """What the doctor cannot probe: how the training run feeds and shapes its data.

    ``cudnn_benchmark=None`` reads ``torch.backends.cudnn.benchmark`` from this process
    when torch is already imported (the Python API, called from the training script).
    """

    variable_shapes: bool = False
    cudnn_benchmark: bool | None = None
    workers: int | None = None
    batch_bytes: int | None = None
    prefetch_factor: int = 2


@dataclass(frozen=True)
class Diagnosis:
    """Every finding, and the facts they were drawn from."""

    findings: tuple[EnvironmentFinding, ...]
    facts: dict[str, Any] = field(default_factory=dict)

    def count(self, severity: Severity) -> int:
        return sum(1 for finding in self.findings if finding.severity == severity)

    @property
    def exit_status(self) -> int:
        """0 when no error was found, 1 otherwise."""
        return 1 if self.count("error") else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_status": self.exit_status,
            "errors": self.count("error"),
            "warnings": self.count("warning"),
            "findings": [finding.to_dict() for finding in self.findings],
            "facts": self.facts,
        }


# -- small pure helpers ------------------------------------------------------------------


def parse_alloc_conf(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``key:value,key:[a,b]`` as (key, value) pairs plus the entries that are malformed.

    >>> parse_alloc_conf("expandable_segments:True,roundup_power2_divisions:[256:1,>:8],oops")
    ([('expandable_segments', 'True'), ('roundup_power2_divisions', '[256:1,>:8]')], ['oops'])
    """
    entries, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    entries.append(current)
    pairs, malformed = [], []
    for entry in (item.strip() for item in entries):
        if not entry:
            continue
        key, colon, value = entry.partition(":")
        if not colon or not key.strip() or not value.strip():
            malformed.append(entry)
        else:
            pairs.append((key.strip(), value.strip()))
    return pairs, malformed


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else format_size(nbytes)


# -- the checks --------------------------------------------------------------------------


def check_python(python: PythonFacts) -> list[EnvironmentFinding]:
    """Which Python, and which environment manager can recreate it."""
    if python.manager == "conda":
        name = python.conda_env or python.prefix.rstrip("/").rsplit("/", 1)[-1]
        return [
            EnvironmentFinding("python", "info", f"Python {python.version} in conda env '{name}' ({python.prefix})")
        ]
    if python.manager == "venv":
        inside = f" (on conda env '{python.conda_env}')" if python.conda_env else ""
        return [EnvironmentFinding("python", "info", f"Python {python.version} in virtual env {python.prefix}{inside}")]
    major_minor = ".".join(python.version.split(".")[:2])
    return [
        EnvironmentFinding(
            "python",
            "warning",
            f"Python {python.version} is the system interpreter ({python.executable}): no venv or conda env isolates "
            "these packages, so memfit env export cannot name a reproducible environment",
            f"python{major_minor} -m venv .venv && . .venv/bin/activate  (or: conda create -n train python={major_minor})",
        )
    ]


def check_nvml(nvidia: NvidiaFacts) -> list[EnvironmentFinding]:
    """NVML present but failing usually means a driver upgraded without a reboot."""
    error = nvidia.error or ""
    if nvidia.gpus or not error or "Not Found" in error or "Driver Not Loaded" in error or "not found" in error:
        return []
    return [
        EnvironmentFinding(
            "driver",
            "error",
            f"the NVIDIA driver does not answer: {error}",
            "reboot (or reload the nvidia kernel modules) after a driver upgrade; check with: nvidia-smi",
        )
    ]


def check_torch_build(torch: TorchFacts, nvidia: NvidiaFacts) -> list[EnvironmentFinding]:
    """CPU-only wheels with a GPU present, CUDA wheels without one, torch missing."""
    gpus = nvidia.gpus
    if torch.version is None:
        tag = pick_cuda_build(LATEST_RELEASE, nvidia.cuda_driver_version) if gpus else "cpu"
        return [
            EnvironmentFinding(
                "torch",
                "error",
                torch.error or "torch is not importable",
                f"pip install torch --index-url {WHEEL_INDEX}/{tag or 'cpu'}",
            )
        ]
    if torch.hip:
        return [
            EnvironmentFinding(
                "torch", "info", f"torch {torch.version} is a ROCm build (HIP {torch.hip}): NVIDIA checks skipped"
            )
        ]
    if torch.cuda is None:
        if not gpus:
            reason = f" ({nvidia.error})" if nvidia.error else ""
            return [
                EnvironmentFinding(
                    "torch",
                    "info",
                    f"no GPU visible{reason}; torch {torch.version} is a CPU build, so training runs on the CPU",
                )
            ]
        names = ", ".join(sorted({gpu.name for gpu in gpus}))
        tag = pick_cuda_build(torch.version, nvidia.cuda_driver_version)
        fix = (
            install_command(torch.version, tag)
            if tag
            else f"upgrade the NVIDIA driver (it runs CUDA up to {_cuda_text(nvidia.cuda_driver_version)}), "
            f"then: {install_command(torch.version, cuda_builds(torch.version)[-1])}"
        )
        return [
            EnvironmentFinding(
                "torch",
                "error",
                f"torch {torch.version} is a CPU-only build, but {len(gpus)} NVIDIA GPU(s) "
                f"are visible ({names}): every tensor stays on the CPU",
                fix,
            )
        ]
    if not gpus:
        reason = f" ({nvidia.error})" if nvidia.error else ""
        return [
            EnvironmentFinding(
                "torch",
                "warning",
                f"torch {torch.version} is a CUDA {torch.cuda} build, but no NVIDIA GPU is visible{reason}",
                "check the driver with nvidia-smi; in a container, start it with --gpus all",
            )
        ]
    return [
        EnvironmentFinding(
            "torch",
            "info",
            f"torch {torch.version}: CUDA {torch.cuda} build; torch sees {torch.device_count} of {len(gpus)} GPU(s)",
        )
    ]


def _cuda_text(version: tuple[int, int] | None) -> str:
    return "?" if version is None else f"{version[0]}.{version[1]}"


def check_cuda_driver(torch: TorchFacts, nvidia: NvidiaFacts) -> list[EnvironmentFinding]:
    """torch's CUDA against the highest CUDA the driver runs (NVML's CUDA driver version)."""
    needed, driver = parse_cuda(torch.cuda), nvidia.cuda_driver_version
    if needed is None or driver is None or torch.version is None or not nvidia.gpus:
        return []
    tag = pick_cuda_build(torch.version, driver)
    minimum = min_driver_for(needed)
    upgrade = f"upgrade the NVIDIA driver to {minimum} or newer" if minimum else "upgrade the NVIDIA driver"
    fix = f"{install_command(torch.version, tag)}  (or {upgrade})" if tag else upgrade
    if needed[0] > driver[0]:
        return [
            EnvironmentFinding(
                "cuda-driver",
                "error",
                f"torch {torch.version} needs CUDA {torch.cuda}, but driver {nvidia.driver_version} "
                f"runs CUDA only up to {_cuda_text(driver)}: CUDA cannot start",
                fix,
            )
        ]
    if needed > driver:
        return [
            EnvironmentFinding(
                "cuda-driver",
                "warning",
                f"torch {torch.version} uses CUDA {torch.cuda}, driver {nvidia.driver_version} runs up to "
                f"{_cuda_text(driver)}: it works only through CUDA minor-version compatibility "
                "(kernels that need PTX JIT fail)",
                fix,
            )
        ]
    return [
        EnvironmentFinding(
            "cuda-driver",
            "info",
            f"driver {nvidia.driver_version} runs CUDA up to {_cuda_text(driver)}; torch uses CUDA {torch.cuda}",
        )
    ]


def check_torch_sees_gpus(
    torch: TorchFacts, nvidia: NvidiaFacts, environ: Mapping[str, str]
) -> list[EnvironmentFinding]:
    """A CUDA build that cannot use visible GPUs, when nothing else explains it."""
    needed, driver = parse_cuda(torch.cuda), nvidia.cuda_driver_version
    if torch.version is None or needed is None or not nvidia.gpus or torch.cuda_available or torch.error:
        return []
    if driver is not None and needed[0] > driver[0]:
        return []  # check_cuda_driver says why
    if environ.get("CUDA_VISIBLE_DEVICES", None) is not None and _visible_count(environ, nvidia) == 0:
        return []  # check_visible_devices says why
    why = torch.warnings[0] if torch.warnings else "torch.cuda.is_available() is False"
    return [
        EnvironmentFinding(
            "torch",
            "error",
            f"torch cannot use the GPU: {why}",
            "python -c 'import torch; torch.zeros(1, device=\"cuda\")'  shows the full CUDA error",
        )
    ]


def check_arch(torch: TorchFacts, nvidia: NvidiaFacts) -> list[EnvironmentFinding]:
    """Each GPU's compute capability against the architectures torch was compiled for."""
    if torch.version is None or torch.cuda is None or not torch.arch_list:
        return []
    findings = []
    for gpu in nvidia.gpus:
        if arch_supported(gpu.compute_capability, torch.arch_list):
            continue
        numbers = [int(re.sub(r"\D", "", entry.partition("_")[2]) or 0) for entry in torch.arch_list]
        if gpu.arch > max(numbers):
            hint = "a newer CUDA build has its kernels"
            fix = newer_arch_fix(torch.version, gpu.arch, nvidia.cuda_driver_version)
        else:
            hint = "an older CUDA build still ships its kernels"
            fix = install_command(torch.version, cuda_builds(torch.version)[0])
        findings.append(
            EnvironmentFinding(
                "arch",
                "error",
                f"GPU {gpu.index} {gpu.name} is sm_{gpu.arch} (compute capability {gpu.compute_capability[0]}."
                f"{gpu.compute_capability[1]}), torch {torch.version} has kernels for {' '.join(torch.arch_list)}: "
                f'{hint} ("no kernel image is available")',
                fix,
            )
        )
    return findings


def newer_arch_fix(torch_version: str, arch: int, driver_cuda: tuple[int, int] | None) -> str:
    """The install command for a GPU newer than torch's kernels: this release's build for a
    CUDA that knows the GPU when there is one, else the newest release's."""
    required = ARCH_MIN_CUDA.get(arch, (0, 0))
    runnable = [
        tag
        for tag in cuda_builds(torch_version)
        if cuda_tag_version(tag) >= required and (driver_cuda is None or cuda_tag_version(tag) <= driver_cuda)
    ]
    if runnable:
        return install_command(torch_version, runnable[-1])
    for release in sorted(TORCH_CUDA_BUILDS, reverse=True):
        fitting = [
            tag
            for tag in TORCH_CUDA_BUILDS[release]
            if cuda_tag_version(tag) >= required and (driver_cuda is None or cuda_tag_version(tag) <= driver_cuda)
        ]
        if fitting:
            wanted = ".".join(map(str, release))
            return (
                f'pip install --force-reinstall "torch=={wanted}.*" --index-url {WHEEL_INDEX}/{fitting[-1]}  '
                f"(torch {base_version(torch_version)} has no build for sm_{arch})"
            )
    minimum = min_driver_for(required) or "a newer release"
    newest = cuda_builds(LATEST_RELEASE)[-1]
    return (
        f"upgrade the NVIDIA driver to {minimum}, then: pip install --upgrade torch --index-url {WHEEL_INDEX}/{newest}"
    )


def check_cudnn(torch: TorchFacts) -> list[EnvironmentFinding]:
    """cuDNN as torch loads it (not the toolkit's copy on disk)."""
    if torch.cuda is None or torch.version is None:
        return []
    if torch.cudnn is None:
        if not torch.cuda_available:
            return []
        major = (parse_cuda(torch.cuda) or (12, 0))[0]
        return [
            EnvironmentFinding(
                "cudnn",
                "warning",
                f"torch {torch.version} finds no cuDNN: convolutions fall back to slow kernels",
                f"pip install --force-reinstall nvidia-cudnn-cu{major}",
            )
        ]
    return [EnvironmentFinding("cudnn", "info", f"cuDNN {format_cudnn_version(torch.cudnn)} (as torch loads it)")]


def check_gpu_memory(nvidia: NvidiaFacts, own_pid: int) -> list[EnvironmentFinding]:
    """Each GPU's memory, who else holds it, and memory held by processes NVML cannot list."""
    findings = []
    for gpu in nvidia.gpus:
        findings.append(
            EnvironmentFinding(
                "gpu-memory",
                "info",
                f"GPU {gpu.index} {gpu.name}: {format_size(gpu.total_memory)} total, "
                f"{format_size(gpu.used_memory)} used, {format_size(gpu.free_memory)} free",
            )
        )
        others = [p for p in gpu.processes if p.pid != own_pid]
        held = sum(p.used_memory or 0 for p in others)
        listed = sum(p.used_memory or 0 for p in gpu.processes)
        elsewhere = _other_gpu(nvidia, gpu)
        move = f", or use another GPU: CUDA_VISIBLE_DEVICES={elsewhere.uuid}" if elsewhere else ""
        if held > FOREIGN_SHARE * gpu.total_memory:
            who = ", ".join(f"pid {p.pid} {p.name} ({_gib(p.used_memory)})" for p in others)
            pids = " ".join(str(p.pid) for p in others)
            findings.append(
                EnvironmentFinding(
                    "gpu-memory",
                    "warning",
                    f"other processes hold {format_size(held)} ({100 * held / gpu.total_memory:.0f} %) of GPU {gpu.index}: {who}",
                    f"stop them (kill {pids}; a forgotten notebook kernel is the usual one){move}",
                )
            )
        unlisted = gpu.used_memory - listed
        if unlisted > FOREIGN_SHARE * gpu.total_memory:
            whom = (
                "NVML lists no process"
                if not gpu.processes
                else f"NVML's processes account for only {format_size(listed)}"
            )
            findings.append(
                EnvironmentFinding(
                    "gpu-memory",
                    "warning",
                    f"GPU {gpu.index} has {format_size(gpu.used_memory)} in use ({100 * gpu.used_memory / gpu.total_memory:.0f} %) "
                    f"but {whom}: processes in other containers or PID namespaces hold {format_size(unlisted)}",
                    f"run nvidia-smi on the host (outside the container) to find them{move}",
                )
            )
    return findings


def _other_gpu(nvidia: NvidiaFacts, busy: GpuInfo) -> GpuInfo | None:
    """The GPU with the most free memory other than ``busy`` (what to move to)."""
    candidates = [gpu for gpu in nvidia.gpus if gpu.index != busy.index and gpu.free_memory > busy.free_memory]
    return max(candidates, key=lambda gpu: gpu.free_memory) if candidates else None


def _visible_entries(value: str) -> list[str]:
    return [entry.strip() for entry in value.split(",")] if value.strip() else []


def _resolve_visible(value: str, nvidia: NvidiaFacts) -> tuple[list[GpuInfo | None], str | None]:
    """CUDA_VISIBLE_DEVICES entries as GPUs; CUDA stops at the first entry it cannot resolve."""
    resolved: list[GpuInfo | None] = []
    for entry in _visible_entries(value):
        if entry.isdigit():
            matches = [gpu for gpu in nvidia.gpus if gpu.index == int(entry)]
        elif entry.startswith(("GPU-", "MIG-")):
            matches = [gpu for gpu in nvidia.gpus if gpu.uuid.startswith(entry)] or [None]  # type: ignore[list-item]
        else:
            matches = []
        if not matches:
            return resolved, entry
        resolved.append(matches[0])
    return resolved, None


def _visible_count(environ: Mapping[str, str], nvidia: NvidiaFacts) -> int:
    resolved, _ = _resolve_visible(environ.get("CUDA_VISIBLE_DEVICES", ""), nvidia)
    return len(resolved)


def check_visible_devices(environ: Mapping[str, str], nvidia: NvidiaFacts) -> list[EnvironmentFinding]:
    """CUDA_VISIBLE_DEVICES that hides or misnames GPUs; CUDA_DEVICE_ORDER with several GPUs."""
    findings = []
    order = environ.get("CUDA_DEVICE_ORDER")
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None and nvidia.gpus:
        resolved, bad = _resolve_visible(value, nvidia)
        if not resolved:
            findings.append(
                EnvironmentFinding(
                    "visible-devices",
                    "warning",
                    f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU from torch",
                    "unset CUDA_VISIBLE_DEVICES  (or name a GPU: CUDA_VISIBLE_DEVICES=0)",
                )
            )
        elif bad is not None:
            good = ",".join(_visible_entries(value)[: len(resolved)])
            findings.append(
                EnvironmentFinding(
                    "visible-devices",
                    "warning",
                    f"CUDA_VISIBLE_DEVICES={value} names {bad!r}, which is not a GPU here: CUDA ignores "
                    f"it and every entry after it",
                    f"export CUDA_VISIBLE_DEVICES={good}",
                )
            )
        else:
            findings.append(
                EnvironmentFinding(
                    "visible-devices",
                    "info",
                    f"CUDA_VISIBLE_DEVICES={value}: torch sees {len(resolved)} of {len(nvidia.gpus)} GPUs",
                )
            )
    if order is not None and order not in ("PCI_BUS_ID", "FASTEST_FIRST"):
        findings.append(
            EnvironmentFinding(
                "device-order",
                "warning",
                f"CUDA_DEVICE_ORDER={order!r} is not a value CUDA knows",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
            )
        )
    elif order is None and len(nvidia.gpus) > 1:
        findings.append(
            EnvironmentFinding(
                "device-order",
                "warning",
                f"CUDA_DEVICE_ORDER is unset with {len(nvidia.gpus)} GPUs: CUDA numbers them fastest first, nvidia-smi by "
                "PCI bus, so cuda:0 (and CUDA_VISIBLE_DEVICES=0) may not be nvidia-smi's GPU 0",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
            )
        )
    return findings


def check_allocator(
    environ: Mapping[str, str], torch_version: str | None, variable_shapes: bool
) -> list[EnvironmentFinding]:
    """PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF, parsed and checked key by key."""
    findings: list[EnvironmentFinding] = []
    settings = {name: environ[name] for name in ALLOC_VARIABLES if environ.get(name, "").strip()}
    for name, text in settings.items():
        pairs, malformed = parse_alloc_conf(text)
        for entry in malformed:
            findings.append(
                EnvironmentFinding(
                    "allocator",
                    "error",
                    f"{name}: {entry!r} is not key:value; torch refuses to start",
                    f"fix or remove {entry!r} in {name}",
                )
            )
        for key, value in pairs:
            findings.extend(_check_alloc_pair(name, key, value))
        keys = {key: value for key, value in pairs}
        expandable = keys.get("expandable_segments", "").lower() == "true"
        if expandable and "max_split_size_mb" in keys:
            findings.append(
                EnvironmentFinding(
                    "allocator",
                    "warning",
                    f"{name} sets max_split_size_mb with expandable_segments:True: expandable segments already avoid the "
                    "fragmentation max_split_size_mb works around, and the split limit only keeps freed blocks from being reused",
                    f"export {name}={_without(text, 'max_split_size_mb')}",
                )
            )
        if keys.get("backend") == "cudaMallocAsync":
            ignored = sorted(NATIVE_ONLY_KEYS & keys.keys())
            if ignored:
                findings.append(
                    EnvironmentFinding(
                        "allocator",
                        "warning",
                        f"{name}: backend:cudaMallocAsync ignores {', '.join(ignored)} (native allocator options)",
                        f"remove {', '.join(ignored)} or the backend key from {name}",
                    )
                )
    if len(settings) == 2 and settings[ALLOC_VARIABLES[0]] != settings[ALLOC_VARIABLES[1]]:
        findings.append(
            EnvironmentFinding(
                "allocator",
                "warning",
                "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF differ: which one a CUDA run applies depends on the torch version",
                "keep one: unset PYTORCH_ALLOC_CONF  (PYTORCH_CUDA_ALLOC_CONF is read by every release)",
            )
        )
    release = version_tuple(torch_version)[:2]
    if list(settings) == ["PYTORCH_ALLOC_CONF"] and release and release < (2, 11):
        findings.append(
            EnvironmentFinding(
                "allocator",
                "warning",
                f"only PYTORCH_ALLOC_CONF is set, and torch {torch_version} may ignore it for CUDA (releases before 2.9 do "
                "not read it; 2.9 drops expandable_segments from it, pytorch#183387)",
                f"export PYTORCH_CUDA_ALLOC_CONF={settings['PYTORCH_ALLOC_CONF']}",
            )
        )
    effective = settings.get("PYTORCH_CUDA_ALLOC_CONF", settings.get("PYTORCH_ALLOC_CONF", ""))
    expandable_on = any(k == "expandable_segments" and v.lower() == "true" for k, v in parse_alloc_conf(effective)[0])
    if variable_shapes and not expandable_on:
        name = "PYTORCH_ALLOC_CONF" if release >= (2, 11) else "PYTORCH_CUDA_ALLOC_CONF"
        value = ",".join(
            part for part in (_without(effective, "expandable_segments"), "expandable_segments:True") if part
        )
        findings.append(
            EnvironmentFinding(
                "allocator",
                "info",
                "variable input shapes leave freed blocks of the wrong size in the cache (reserved but unusable memory); "
                "expandable segments grow and reuse one segment instead",
                f"export {name}={value}",
            )
        )
    if not settings:
        findings.append(
            EnvironmentFinding("allocator", "info", "allocator settings: torch's defaults (no PYTORCH_*ALLOC_CONF set)")
        )
    return findings


def _without(text: str, key: str) -> str:
    """An allocator setting string with one key removed (for a fix line)."""
    pairs, _ = parse_alloc_conf(text)
    return ",".join(f"{k}:{v}" for k, v in pairs if k != key)


def _check_alloc_pair(name: str, key: str, value: str) -> list[EnvironmentFinding]:
    """One key:value of an allocator setting: known key, and a value torch accepts."""
    if key not in ALLOC_CONF_KEYS:
        close = difflib.get_close_matches(key, sorted(ALLOC_CONF_KEYS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        fix = f"replace {key} with {close[0]} in {name}" if close else f"remove {key} from {name}"
        return [
            EnvironmentFinding(
                "allocator", "error", f"{name}: unknown key {key!r}{hint}; torch refuses to start with it", fix
            )
        ]
    problem = None
    if key == "expandable_segments" and value.lower() not in ("true", "false"):
        problem = "must be True or False"
    elif key in ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"):
        if not value.isdigit():
            problem = "must be a whole number of MiB"
        elif len(value) > 18:  # past size_t in bytes (and past what int() converts at 4300 digits)
            problem = f"must be a whole number of MiB torch can hold, not {len(value)} digits"
        elif key == "max_split_size_mb" and int(value) <= 20:
            problem = "must be more than 20 (MiB)"
    elif key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        try:
            ok = 0.0 < float(value) < 1.0 if key == "garbage_collection_threshold" else 0.0 < float(value) <= 1.0
        except ValueError:
            ok = False
        problem = None if ok else "must be a fraction between 0 and 1"
    elif key == "backend" and value not in ("native", "cudaMallocAsync"):
        problem = "must be native or cudaMallocAsync"
    if problem is None:
        return []
    # an error, not a warning: CUDA's allocator checks every value when it starts (TORCH_CHECK in
    # pytorch's c10/core/AllocatorConfig.cpp and c10/cuda/CUDAAllocatorConfig.cpp) and the
    # first CUDA tensor raises instead
    return [
        EnvironmentFinding(
            "allocator",
            "error",
            f"{name}: {key}:{value} {problem}; torch refuses to start with it",
            f"fix {key} in {name}",
        )
    ]


def dataloader_shm_need(hints: TrainingHints) -> int | None:
    """Bytes of /dev/shm the DataLoader's prefetched batches occupy (workers × prefetch × batch)."""
    if not hints.workers or not hints.batch_bytes:
        return None
    return hints.workers * hints.prefetch_factor * hints.batch_bytes


def check_host(host: HostFacts, hints: TrainingHints) -> list[EnvironmentFinding]:
    """/dev/shm and host RAM against what DataLoader workers need."""
    findings = []
    need = dataloader_shm_need(hints)
    ram = (
        f"host RAM {_gib(host.ram_total)} total, {_gib(host.ram_available)} available; /dev/shm {_gib(host.shm_total)}"
    )
    findings.append(EnvironmentFinding("host", "info", ram))
    suggested = max(8 * GiB, 2 * (need or 0))
    docker_fix = f"docker run --shm-size={-(-suggested // GiB)}g ...  (or --ipc=host)"
    if host.shm_total is not None:
        if need is not None and host.shm_total < need:
            findings.append(
                EnvironmentFinding(
                    "shm",
                    "warning",
                    f"/dev/shm holds {format_size(host.shm_total)}, but {hints.workers} DataLoader workers × prefetch "
                    f"{hints.prefetch_factor} × {format_size(hints.batch_bytes or 0)} batches need {format_size(need)} "
                    '("Bus error" / "No space left on device" in a worker)',
                    f"{docker_fix}, or fewer workers: num_workers={max(0, host.shm_total // (hints.prefetch_factor * (hints.batch_bytes or 1)))}",
                )
            )
        elif need is None and host.shm_total < GiB:
            findings.append(
                EnvironmentFinding(
                    "shm",
                    "warning",
                    f"/dev/shm holds only {format_size(host.shm_total)} (Docker's default is 64 MiB): DataLoader workers "
                    'pass every batch through it and die with "Bus error"',
                    docker_fix,
                )
            )
    if need is not None and host.ram_available is not None and host.ram_available < need:
        findings.append(
            EnvironmentFinding(
                "host",
                "warning",
                f"host RAM available ({format_size(host.ram_available)}) is less than the {format_size(need)} the "
                "DataLoader's prefetched batches take",
                "lower num_workers or prefetch_factor, or the batch size",
            )
        )
    return findings


def check_cudnn_benchmark(benchmark: bool | None, variable_shapes: bool) -> list[EnvironmentFinding]:
    """cudnn.benchmark autotunes per input shape: with variable shapes it re-tunes (and allocates) constantly."""
    if not (benchmark and variable_shapes):
        return []
    return [
        EnvironmentFinding(
            "cudnn-benchmark",
            "warning",
            "torch.backends.cudnn.benchmark is True with variable input shapes: every new shape re-runs the autotuner, "
            "whose workspace trials can run out of memory and slow each step",
            "torch.backends.cudnn.benchmark = False  (or pad inputs to a few fixed shapes)",
        )
    ]


# -- putting it together -----------------------------------------------------------------


def _live_cudnn_benchmark() -> bool | None:
    """torch.backends.cudnn.benchmark of this process, without importing torch for it."""
    torch = sys.modules.get("torch")
    return bool(torch.backends.cudnn.benchmark) if torch is not None else None


def diagnose(probe: SystemProbe | None = None, hints: TrainingHints | None = None) -> Diagnosis:
    """Run every environment check; never creates a CUDA context in this process.

    Args:
        probe: where the machine's facts come from (default: the live machine).
        hints: what the doctor cannot probe: data loader workers, batch size in bytes,
            variable input shapes, cudnn.benchmark.
    """
    probe = probe or system.current_probe()
    hints = hints or TrainingHints()
    nvidia, torch, python, host, environ = probe.nvidia(), probe.torch(), probe.python(), probe.host(), probe.environ()
    benchmark = hints.cudnn_benchmark if hints.cudnn_benchmark is not None else _live_cudnn_benchmark()
    findings = [
        *check_python(python),
        *check_nvml(nvidia),
        *check_torch_build(torch, nvidia),
        *check_cuda_driver(torch, nvidia),
        *check_torch_sees_gpus(torch, nvidia, environ),
        *check_arch(torch, nvidia),
        *check_cudnn(torch),
        *check_gpu_memory(nvidia, probe.pid()),
        *check_visible_devices(environ, nvidia),
        *check_allocator(environ, torch.version, hints.variable_shapes),
        *check_host(host, hints),
        *check_cudnn_benchmark(benchmark, hints.variable_shapes),
    ]
    facts = {
        "nvidia": asdict(nvidia),
        "torch": asdict(torch),
        "python": {**asdict(python), "manager": python.manager},
        "host": asdict(host),
        "environ": environ,
        "hints": asdict(hints),
    }
    return Diagnosis(tuple(findings), facts)
