"""The one seam between memfit and the machine: NVML, nvidia-smi, conda and torch's build.

Why one module: ``memfit doctor`` and ``memfit env`` decide from *facts* (plain
dataclasses); only :class:`LiveProbe` talks to the machine, so tests hand the same code a
:class:`RecordedProbe` holding answers recorded on GPU machines. Nothing here creates a
CUDA context in the calling process: GPUs are read through NVML (or nvidia-smi), and
torch's CUDA facts (arch list, cuDNN, ``is_available``) come from a child Python process,
so a DataLoader that forks later still works.

>>> facts = RecordedProbe(nvidia=NvidiaFacts(error="NVML Shared Library Not Found")).nvidia()
>>> facts.gpus, facts.error
((), 'NVML Shared Library Not Found')
>>> parse_cuda_driver_version(12040)
(12, 4)
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import glob
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "GpuProcess",
    "GpuInfo",
    "NvidiaFacts",
    "TorchFacts",
    "PythonFacts",
    "HostFacts",
    "SystemProbe",
    "LiveProbe",
    "RecordedProbe",
    "current_probe",
    "parse_cuda_driver_version",
    "RELEVANT_ENVIRONMENT",
]

#: environment variables the doctor and the fingerprint look at (nothing else is read)
RELEVANT_ENVIRONMENT = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "CONDA_EXE",
    "VIRTUAL_ENV",
)

_CHILD_TIMEOUT_S = 120


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU; ``used_memory`` is None when NVML will not say."""

    pid: int
    name: str
    used_memory: int | None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML numbers it (PCI bus order, like nvidia-smi; not CUDA's default order)."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    total_memory: int
    used_memory: int
    free_memory: int
    compute_capability: tuple[int, int]
    processes: tuple[GpuProcess, ...] = ()

    @property
    def arch(self) -> int:
        """Compute capability as torch writes it in sm_XY: 9.0 -> 90."""
        return 10 * self.compute_capability[0] + self.compute_capability[1]


@dataclass(frozen=True)
class NvidiaFacts:
    """The driver and its GPUs; ``gpus == ()`` with ``error`` saying why none were read."""

    source: str | None = None  # "nvml", "nvidia-smi" or None
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None
    gpus: tuple[GpuInfo, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class TorchFacts:
    """torch's build as a fresh child process sees it (``version`` None: torch not importable)."""

    version: str | None = None
    cuda: str | None = None
    hip: str | None = None
    cudnn: int | None = None
    arch_list: tuple[str, ...] = ()
    cuda_available: bool = False
    device_count: int = 0
    warnings: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class PythonFacts:
    """The interpreter and the environment manager around it."""

    version: str
    implementation: str
    executable: str
    prefix: str
    base_prefix: str
    conda_prefix: str | None = None
    conda_env: str | None = None

    @property
    def manager(self) -> str:
        """ "conda", "venv" or "system": what recreates this environment."""
        if self.prefix != self.base_prefix:
            return "venv"
        if self.conda_prefix and os.path.realpath(self.conda_prefix) == os.path.realpath(self.prefix):
            return "conda"
        if os.path.isdir(os.path.join(self.prefix, "conda-meta")):
            return "conda"
        return "system"


@dataclass(frozen=True)
class HostFacts:
    """The host: OS, CPUs, RAM and /dev/shm (where DataLoader workers pass batches)."""

    system: str
    release: str
    machine: str
    cpu_count: int
    ram_total: int | None
    ram_available: int | None
    shm_total: int | None
    shm_free: int | None


class SystemProbe:
    """Where facts come from. :class:`LiveProbe` asks the machine; tests use :class:`RecordedProbe`."""

    def nvidia(self) -> NvidiaFacts:
        raise NotImplementedError

    def torch(self) -> TorchFacts:
        raise NotImplementedError

    def torch_build(self) -> TorchFacts:
        """torch's version, its CUDA/HIP version and cuDNN's: what a fingerprint records.

        Only those four fields are set. The default asks :meth:`torch`; a live probe
        reads them without importing torch when it can (``memfit check`` answers fast).
        """
        return self.torch()

    def python(self) -> PythonFacts:
        raise NotImplementedError

    def host(self) -> HostFacts:
        raise NotImplementedError

    def environ(self) -> dict[str, str]:
        """The :data:`RELEVANT_ENVIRONMENT` variables that are set."""
        raise NotImplementedError

    def conda_export(self) -> dict[str, Any] | None:
        """``conda env export --no-builds --json`` of the active env, or None outside conda."""
        raise NotImplementedError

    def pid(self) -> int:
        """The process on whose behalf we ask (its own GPU memory is not "another process")."""
        return os.getpid()


# -- pure helpers ------------------------------------------------------------------------


def parse_cuda_driver_version(value: int) -> tuple[int, int]:
    """NVML's CUDA driver version integer (12040) as (major, minor) = (12, 4)."""
    return value // 1000, (value % 1000) // 10


def _text(value: bytes | str) -> str:
    """pynvml returns bytes in old releases and str in new ones."""
    return value.decode() if isinstance(value, bytes) else value


def parse_smi_gpus(csv: str) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,memory.used,
    memory.free,compute_cap --format=csv,noheader,nounits`` (memory in MiB) as dicts."""
    rows = []
    for line in csv.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 8:
            continue
        major, _, minor = parts[7].partition(".")
        rows.append(
            {
                "index": int(parts[0]),
                "name": parts[1],
                "uuid": parts[2],
                "pci_bus_id": parts[3],
                "total_memory": int(float(parts[4])) * 2**20,
                "used_memory": int(float(parts[5])) * 2**20,
                "free_memory": int(float(parts[6])) * 2**20,
                "compute_capability": (int(major), int(minor or 0)) if major.isdigit() else (0, 0),
            }
        )
    return rows


def parse_smi_processes(csv: str) -> list[tuple[str, GpuProcess]]:
    """Rows of ``--query-compute-apps=gpu_uuid,pid,process_name,used_memory`` as (uuid, process)."""
    result = []
    for line in csv.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 4 or not parts[1].isdigit():
            continue
        used = int(float(parts[3])) * 2**20 if re.fullmatch(r"\d+(\.\d+)?", parts[3]) else None
        result.append((parts[0], GpuProcess(int(parts[1]), parts[2], used)))
    return result


def parse_smi_cuda_version(banner: str) -> tuple[int, int] | None:
    """The "CUDA Version: 12.4" of nvidia-smi's banner (the driver's highest CUDA)."""
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", banner)
    return (int(match.group(1)), int(match.group(2))) if match else None


# -- the live machine ---------------------------------------------------------------------

#: run in a child so that torch's CUDA initialisation never happens in the caller
_TORCH_CHILD = r"""
import json, warnings
out = {}
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
        out["version"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["hip"] = getattr(torch.version, "hip", None)
        try:
            out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        except Exception:
            out["cudnn"] = None
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
        out["arch_list"] = list(torch.cuda.get_arch_list()) if out["cuda_available"] or out["cuda"] else []
    out["warnings"] = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
except ImportError as error:
    out = {"error": f"torch is not importable: {error}"}
print("MEMFIT-TORCH-FACTS " + json.dumps(out))
"""


class LiveProbe(SystemProbe):
    """Facts from this machine: NVML first, nvidia-smi when NVML is unusable, conda when active."""

    def __init__(self, python_executable: str | None = None) -> None:
        self.python_executable = python_executable or sys.executable
        self._torch: TorchFacts | None = None

    def nvidia(self) -> NvidiaFacts:
        try:
            return self._nvml()
        except Exception as error:  # noqa: BLE001 - any NVML failure: fall back, keep its message
            nvml_error = f"NVML: {_nvml_message(error)}"
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return NvidiaFacts(error=nvml_error)
        try:
            return self._smi(smi)
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            return NvidiaFacts(error=f"{nvml_error}; nvidia-smi: {error}")

    def _nvml(self) -> NvidiaFacts:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            cuda = parse_cuda_driver_version(pynvml.nvmlSystemGetCudaDriverVersion())
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(
                    GpuInfo(
                        index=index,
                        name=_text(pynvml.nvmlDeviceGetName(handle)),
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                        total_memory=int(memory.total),
                        used_memory=int(memory.used),
                        free_memory=int(memory.free),
                        compute_capability=_capability(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                        processes=_nvml_processes(pynvml, handle),
                    )
                )
            return NvidiaFacts("nvml", driver, cuda, tuple(gpus))
        finally:
            pynvml.nvmlShutdown()

    def _smi(self, smi: str) -> NvidiaFacts:
        query = "index,name,uuid,pci.bus_id,memory.total,memory.used,memory.free,compute_cap"
        gpus_csv = _run([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"])
        apps_csv = _run(
            [smi, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits"]
        )
        driver = _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"]).strip().splitlines()
        processes = parse_smi_processes(apps_csv)
        gpus = tuple(
            GpuInfo(**row, processes=tuple(p for uuid, p in processes if uuid == row["uuid"]))
            for row in parse_smi_gpus(gpus_csv)
        )
        return NvidiaFacts(
            "nvidia-smi", driver[0].strip() if driver else None, parse_smi_cuda_version(_run([smi])), gpus
        )

    def torch(self) -> TorchFacts:
        """Asked once per probe: importing torch in a child costs seconds."""
        if self._torch is None:
            self._torch = self._torch_from_child()
        return self._torch

    def torch_build(self) -> TorchFacts:
        """The build facts without a child process when this interpreter is the one asked.

        Why: importing torch (twice: here for the command, and in the child) was most of
        ``memfit check``'s 17 s. torch's ``version.py`` holds its version and CUDA/HIP
        versions as literals; cuDNN's version comes from the library torch loads
        (``cudnnGetVersion``, what ``torch.backends.cudnn.version()`` returns). Whatever
        cannot be read that way (another interpreter, a ROCm build, no cuDNN found) comes
        from the child process, as before.
        """
        if self._torch is not None:
            return self._torch
        if os.path.realpath(self.python_executable) == os.path.realpath(sys.executable):
            facts = torch_build_in_process()
            if facts is not None:
                return facts
        return self.torch()

    def _torch_from_child(self) -> TorchFacts:
        try:
            completed = subprocess.run(
                [self.python_executable, "-c", _TORCH_CHILD],
                capture_output=True,
                text=True,
                timeout=_CHILD_TIMEOUT_S,
                env=dict(os.environ),
            )
        except (OSError, subprocess.SubprocessError) as error:
            return TorchFacts(error=f"could not run {self.python_executable}: {error}")
        for line in completed.stdout.splitlines():
            if line.startswith("MEMFIT-TORCH-FACTS "):
                data = json.loads(line.split(" ", 1)[1])
                return TorchFacts(
                    version=data.get("version"),
                    cuda=data.get("cuda"),
                    hip=data.get("hip"),
                    cudnn=data.get("cudnn"),
                    arch_list=tuple(data.get("arch_list", ())),
                    cuda_available=bool(data.get("cuda_available")),
                    device_count=int(data.get("device_count", 0)),
                    warnings=tuple(data.get("warnings", ())),
                    error=data.get("error"),
                )
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        return TorchFacts(error=f"importing torch failed: {last}")

    def python(self) -> PythonFacts:
        return PythonFacts(
            version=platform.python_version(),
            implementation=platform.python_implementation(),
            executable=sys.executable,
            prefix=sys.prefix,
            base_prefix=sys.base_prefix,
            conda_prefix=os.environ.get("CONDA_PREFIX"),
            conda_env=os.environ.get("CONDA_DEFAULT_ENV"),
        )

    def host(self) -> HostFacts:
        total, available = _meminfo()
        shm_total = shm_free = None
        if os.path.isdir("/dev/shm"):
            stat = os.statvfs("/dev/shm")
            shm_total, shm_free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
        return HostFacts(
            platform.system(),
            platform.release(),
            platform.machine(),
            os.cpu_count() or 1,
            total,
            available,
            shm_total,
            shm_free,
        )

    def environ(self) -> dict[str, str]:
        return {name: os.environ[name] for name in RELEVANT_ENVIRONMENT if name in os.environ}

    def conda_export(self) -> dict[str, Any] | None:
        if self.python().manager != "conda":
            return None
        conda = os.environ.get("CONDA_EXE") or shutil.which("conda")
        if conda is None:
            return None
        output = _run([conda, "env", "export", "--no-builds", "--json", "--prefix", sys.prefix])
        data = json.loads(output)
        return data if isinstance(data, dict) else None


def torch_build_in_process() -> TorchFacts | None:
    """torch's version, CUDA version and cuDNN version, read without importing torch.

    None when they cannot all be read here (torch missing, a ROCm build, cuDNN not found
    where torch looks for it): the caller asks a child process instead.
    """
    if "torch" in sys.modules:  # imported already: ask it (no CUDA context is made)
        import torch

        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return TorchFacts(version=torch.__version__, cuda=torch.version.cuda, hip=torch.version.hip, cudnn=cudnn)
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    try:
        literals = _literal_assignments((package / "version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    version, cuda, hip = literals.get("__version__"), literals.get("cuda"), literals.get("hip")
    if not isinstance(version, str) or hip is not None:
        return None
    if cuda is None:
        return TorchFacts(version=version)  # a CPU build: no cuDNN
    cudnn = _cudnn_version(package)
    if cudnn is None:
        return None
    return TorchFacts(version=version, cuda=str(cuda), cudnn=cudnn)


def _literal_assignments(source: str) -> dict[str, Any]:
    """``name = literal`` (and ``name: type = literal``) assignments of a module's source."""
    values: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id, node.value
        else:
            continue
        try:
            values[name] = ast.literal_eval(value)
        except ValueError:
            continue
    return values


def _cudnn_version(torch_package: Path) -> int | None:
    """``cudnnGetVersion()`` of the cuDNN torch loads: pip's nvidia-cudnn wheel first (torch's
    own search order), then torch/lib, then the system's; None when none loads."""
    found: list[str] = []
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry or ".", "nvidia", "cudnn", "lib", "libcudnn.so.*[0-9]")))
    found += sorted(glob.glob(str(torch_package / "lib" / "libcudnn.so.*[0-9]")))
    system_library = ctypes.util.find_library("cudnn")
    if system_library:
        found.append(system_library)
    for path in found:
        try:
            get_version = ctypes.CDLL(path).cudnnGetVersion
        except (OSError, AttributeError):
            continue
        get_version.restype = ctypes.c_size_t
        return int(get_version())
    return None


def _capability(value: Any) -> tuple[int, int]:
    """NVML's (major, minor) compute capability as a tuple of two ints."""
    major, minor = value
    return int(major), int(minor)


def _nvml_message(error: BaseException) -> str:
    """NVML errors print as their class's text ("NVML Shared Library Not Found")."""
    return str(error) or type(error).__name__


def _nvml_processes(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    """Compute and graphics processes on one GPU, each once (a process may be both)."""
    seen: dict[int, GpuProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            entries = getattr(pynvml, getter)(handle)
        except pynvml.NVMLError:
            continue
        for entry in entries:
            try:
                name = _text(pynvml.nvmlSystemGetProcessName(entry.pid))
            except pynvml.NVMLError:
                name = "?"  # another PID namespace: NVML knows the pid, not the name
            used = entry.usedGpuMemory
            seen.setdefault(entry.pid, GpuProcess(int(entry.pid), name, int(used) if used is not None else None))
    return tuple(seen.values())


def _run(argv: list[str]) -> str:
    """Run a tool and return its stdout; a failure raises with the tool's own last line."""
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S)
    if completed.returncode != 0:
        last = (completed.stderr.strip().splitlines() or [f"exit status {completed.returncode}"])[-1]
        raise subprocess.SubprocessError(f"{os.path.basename(argv[0])} failed: {last}")
    return completed.stdout


def _meminfo() -> tuple[int | None, int | None]:
    """Host RAM total and available from /proc/meminfo (None off Linux)."""
    try:
        with open("/proc/meminfo") as handle:
            values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in handle if line.split()[1:]}
    except OSError:
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


# -- recorded answers ---------------------------------------------------------------------


class RecordedProbe(SystemProbe):
    """A probe that answers from recorded facts: GPU and conda answers on a machine without them.

    Facts left out (python, host) are read live: they exist on every machine.
    """

    def __init__(
        self,
        nvidia: NvidiaFacts | None = None,
        torch: TorchFacts | None = None,
        python: PythonFacts | None = None,
        host: HostFacts | None = None,
        environ: Mapping[str, str] | None = None,
        conda: dict[str, Any] | None = None,
        pid: int = 0,
    ) -> None:
        self.nvidia_facts = nvidia or NvidiaFacts(error="no GPU recorded")
        self.torch_facts = torch or TorchFacts()
        self.python_facts = python
        self.host_facts = host
        self.environment = dict(environ or {})
        self.conda = conda
        self.own_pid = pid

    def nvidia(self) -> NvidiaFacts:
        return self.nvidia_facts

    def torch(self) -> TorchFacts:
        return self.torch_facts

    def python(self) -> PythonFacts:
        return self.python_facts or LiveProbe().python()

    def host(self) -> HostFacts:
        return self.host_facts or LiveProbe().host()

    def environ(self) -> dict[str, str]:
        return dict(self.environment)

    def conda_export(self) -> dict[str, Any] | None:
        return self.conda

    def pid(self) -> int:
        return self.own_pid


def current_probe() -> SystemProbe:
    """The probe the commands use: the live machine (tests replace this one function)."""
    return LiveProbe()
