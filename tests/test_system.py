"""The seam to the machine: NVML (recorded answers), nvidia-smi (a recorded script), torch in a child.

NVML and nvidia-smi are what this machine lacks; their answers below were shaped after an
H100 node (pynvml's API, nvidia-smi's CSV). torch, /dev/shm, RAM and the Python facts are real.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pynvml
import pytest
import torch

from memfit.environment.system import (
    GpuProcess,
    LiveProbe,
    PythonFacts,
    RecordedProbe,
    TorchFacts,
    _literal_assignments,
    parse_cuda_driver_version,
    parse_smi_cuda_version,
    parse_smi_gpus,
    parse_smi_processes,
    torch_build_in_process,
)

GiB, MiB = 2**30, 2**20
UUID0, UUID1 = "GPU-5f0e5b1c-2d7a-4c1e-9b1a-0a1b2c3d4e5f", "GPU-77aa8e21-93c4-4f0b-8e61-6a7b8c9d0e1f"


@pytest.mark.parametrize("value, expected", [(12040, (12, 4)), (11080, (11, 8)), (12090, (12, 9)), (13000, (13, 0))])
def test_parse_cuda_driver_version(value, expected):
    assert parse_cuda_driver_version(value) == expected


SMI_GPUS = (
    f"0, NVIDIA H100 80GB HBM3, {UUID0}, 00000000:19:00.0, 81559, 40964, 40054, 9.0\n"
    f"1, NVIDIA H100 80GB HBM3, {UUID1}, 00000000:3B:00.0, 81559, 4, 81014, 9.0\n"
)
SMI_APPS = f"{UUID0}, 31337, /usr/bin/python3, 40950\n{UUID0}, 4040, jupyter, [N/A]\n"
SMI_BANNER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_parse_smi_gpus():
    first, second = parse_smi_gpus(SMI_GPUS)
    assert first == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": UUID0,
        "pci_bus_id": "00000000:19:00.0",
        "total_memory": 81559 * MiB,
        "used_memory": 40964 * MiB,
        "free_memory": 40054 * MiB,
        "compute_capability": (9, 0),
    }
    assert second["index"] == 1 and second["used_memory"] == 4 * MiB


@pytest.mark.parametrize(
    "csv, expected",
    [
        (
            SMI_APPS,
            [(UUID0, GpuProcess(31337, "/usr/bin/python3", 40950 * MiB)), (UUID0, GpuProcess(4040, "jupyter", None))],
        ),
        ("No running processes found\n", []),
        ("", []),
    ],
)
def test_parse_smi_processes(csv, expected):
    assert parse_smi_processes(csv) == expected


@pytest.mark.parametrize(
    "banner, expected", [(SMI_BANNER, (12, 4)), ("CUDA Version: 11.8", (11, 8)), ("no banner", None)]
)
def test_parse_smi_cuda_version(banner, expected):
    assert parse_smi_cuda_version(banner) == expected


# -- NVML through pynvml (recorded answers) ----------------------------------------------


class _Memory:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used, self.free = total, used, total - used


class _Proc:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


def recorded_nvml(fail_init: pynvml.NVMLError | None = None) -> types.ModuleType:
    """pynvml's API answering what an H100 node answered: old-style bytes names, a process in
    another PID namespace (no name), one with no memory figure, one both compute and graphics."""
    module = types.ModuleType("pynvml")
    module.NVMLError = pynvml.NVMLError
    calls: list[str] = []
    module.calls = calls

    def init() -> None:
        calls.append("init")
        if fail_init is not None:
            raise fail_init

    def process_name(pid: int) -> bytes:
        if pid == 777:
            raise pynvml.NVMLError_NotFound()
        return {31337: b"/usr/bin/python3", 4040: b"Xorg"}[pid]

    handles = {0: "h0", 1: "h1"}
    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    module.nvmlSystemGetCudaDriverVersion = lambda: 12040
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = handles.__getitem__
    module.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    module.nvmlDeviceGetUUID = lambda h: UUID0 if h == "h0" else UUID1
    module.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId="00000000:19:00.0" if h == "h0" else "00000000:3B:00.0"
    )
    module.nvmlDeviceGetMemoryInfo = lambda h: _Memory(80 * GiB, 42 * GiB if h == "h0" else 500 * MiB)
    module.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: (
        [_Proc(31337, 40 * GiB), _Proc(777, None), _Proc(4040, GiB)] if h == "h0" else []
    )

    def graphics(h: str) -> list[_Proc]:
        if h == "h1":
            raise pynvml.NVMLError_NotSupported()
        return [_Proc(4040, GiB)]

    module.nvmlDeviceGetGraphicsRunningProcesses = graphics
    module.nvmlSystemGetProcessName = process_name
    return module


def test_nvml_facts_from_recorded_answers(monkeypatch):
    fake = recorded_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    facts = LiveProbe().nvidia()
    assert facts.source == "nvml" and facts.error is None
    assert facts.driver_version == "550.54.15" and facts.cuda_driver_version == (12, 4)
    first, second = facts.gpus
    assert (first.index, first.name, first.uuid, first.pci_bus_id) == (
        0,
        "NVIDIA H100 80GB HBM3",
        UUID0,
        "00000000:19:00.0",
    )
    assert (first.total_memory, first.used_memory, first.free_memory) == (80 * GiB, 42 * GiB, 38 * GiB)
    assert first.compute_capability == (9, 0) and first.arch == 90
    assert first.processes == (
        GpuProcess(31337, "/usr/bin/python3", 40 * GiB),
        GpuProcess(777, "?", None),
        GpuProcess(4040, "Xorg", GiB),
    )
    assert second.processes == () and second.used_memory == 500 * MiB
    assert fake.calls == ["init", "shutdown"]


def write_script(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_nvidia_smi_answers_when_nvml_cannot(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", recorded_nvml(fail_init=pynvml.NVMLError_LibraryNotFound()))
    (tmp_path / "gpus.csv").write_text(SMI_GPUS)
    (tmp_path / "apps.csv").write_text(SMI_APPS)
    (tmp_path / "banner.txt").write_text(SMI_BANNER)
    write_script(
        tmp_path,
        "nvidia-smi",
        f"""case "$1" in
  --query-gpu=driver_version) echo 550.54.15 ;;
  --query-gpu=*) cat {tmp_path}/gpus.csv ;;
  --query-compute-apps=*) cat {tmp_path}/apps.csv ;;
  *) cat {tmp_path}/banner.txt ;;
esac
""",
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = LiveProbe().nvidia()
    assert facts.source == "nvidia-smi" and facts.driver_version == "550.54.15"
    assert facts.cuda_driver_version == (12, 4)
    assert [gpu.uuid for gpu in facts.gpus] == [UUID0, UUID1]
    assert facts.gpus[0].processes == (
        GpuProcess(31337, "/usr/bin/python3", 40950 * MiB),
        GpuProcess(4040, "jupyter", None),
    )
    assert facts.gpus[1].processes == ()


def test_failing_nvidia_smi_keeps_both_messages(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", recorded_nvml(fail_init=pynvml.NVMLError_DriverNotLoaded()))
    write_script(
        tmp_path,
        "nvidia-smi",
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver' >&2\nexit 9\n",
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = LiveProbe().nvidia()
    assert facts.gpus == () and facts.source is None
    assert facts.error == (
        "NVML: Driver Not Loaded; nvidia-smi: nvidia-smi failed: "
        "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver"
    )


def test_no_nvml_and_no_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", recorded_nvml(fail_init=pynvml.NVMLError_LibraryNotFound()))
    monkeypatch.setenv("PATH", str(tmp_path))
    facts = LiveProbe().nvidia()
    assert facts.gpus == () and facts.error == "NVML: NVML Shared Library Not Found"


# -- torch, in a child process (real) ----------------------------------------------------


def test_torch_facts_come_from_a_child_and_match_this_torch():
    facts = LiveProbe().torch()
    assert facts.error is None
    assert facts.version == torch.__version__ and facts.cuda == torch.version.cuda
    assert facts.arch_list == tuple(torch.cuda.get_arch_list())
    assert facts.cuda_available == torch.cuda.is_available()
    assert facts.cudnn == (torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    assert not torch.cuda.is_initialized()  # the caller's CUDA state is untouched


def test_torch_facts_from_a_python_without_torch():
    base = Path(sys.base_prefix) / "bin" / "python3"
    if not base.exists():
        pytest.skip("no base interpreter next to this venv")
    facts = LiveProbe(python_executable=str(base)).torch()
    if facts.version is not None:
        pytest.skip("the base interpreter has torch too")
    assert facts.error == "torch is not importable: No module named 'torch'"


def test_torch_facts_when_the_interpreter_cannot_run(tmp_path):
    facts = LiveProbe(python_executable=str(tmp_path / "missing-python")).torch()
    assert facts.version is None and facts.error.startswith(f"could not run {tmp_path / 'missing-python'}")


_BUILD_HERE = """
import json, sys
from memfit.environment.system import LiveProbe
probe = LiveProbe()
facts = probe.torch_build()
print(json.dumps([facts.version, facts.cuda, facts.hip, facts.cudnn, "torch" in sys.modules, probe._torch is None]))
"""


def test_the_build_facts_are_read_without_importing_torch_or_a_child_and_match_the_childs():
    """memfit check's fingerprint: the same torch, CUDA and cuDNN versions, in a fraction of the time."""
    completed = subprocess.run([sys.executable, "-c", _BUILD_HERE], capture_output=True, text=True, check=True)
    version, cuda, hip, cudnn, torch_imported, no_child = json.loads(completed.stdout)
    child = LiveProbe().torch()
    assert (version, cuda, hip, cudnn) == (child.version, child.cuda, child.hip, child.cudnn)
    assert version == torch.__version__
    assert not torch_imported and no_child


def test_the_build_facts_with_torch_imported_ask_it_and_a_probe_that_ran_the_child_reuses_it():
    assert torch_build_in_process() == TorchFacts(
        version=torch.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    )
    probe = LiveProbe()
    here = probe.torch_build()  # no child yet: read in this process
    child = probe.torch()  # runs the child once
    assert (here.version, here.cuda, here.cudnn) == (child.version, child.cuda, child.cudnn)
    assert probe.torch_build() is child  # the child's answer, once there, is the answer
    recorded = TorchFacts(version="2.5.1+cu124", cuda="12.4", cudnn=90100, arch_list=("sm_90",))
    assert RecordedProbe(torch=recorded).torch_build() is recorded


def test_literal_assignments_of_a_version_file():
    source = (
        "from typing import Optional\n__version__ = '2.5.1+cu124'\ncuda: Optional[str] = '12.4'\nhip = None\nx = f()\n"
    )
    assert _literal_assignments(source) == {"__version__": "2.5.1+cu124", "cuda": "12.4", "hip": None}


# -- Python, host, environment (real) ----------------------------------------------------


def test_python_facts_of_this_interpreter(monkeypatch):
    monkeypatch.setenv("CONDA_PREFIX", "/opt/conda/envs/train")
    monkeypatch.setenv("CONDA_DEFAULT_ENV", "train")
    facts = LiveProbe().python()
    assert facts.version == "{}.{}.{}".format(*sys.version_info[:3])
    assert facts.implementation.lower() == sys.implementation.name
    assert (facts.executable, facts.prefix, facts.base_prefix) == (sys.executable, sys.prefix, sys.base_prefix)
    assert (facts.conda_prefix, facts.conda_env) == ("/opt/conda/envs/train", "train")
    # which manager that makes is test_python_manager's


@pytest.mark.parametrize(
    "prefix, base, conda_prefix, expected",
    [
        ("/opt/conda/envs/a", "/opt/conda/envs/a", "/opt/conda/envs/a", "conda"),
        ("/work/.venv", "/opt/conda/envs/a", "/opt/conda/envs/a", "venv"),
        ("/work/.venv", "/usr", None, "venv"),
        ("/usr", "/usr", None, "system"),
        ("/usr", "/usr", "/opt/conda", "system"),
    ],
)
def test_python_manager(prefix, base, conda_prefix, expected):
    assert PythonFacts("3.11.7", "CPython", "python", prefix, base, conda_prefix).manager == expected


def test_host_facts_of_this_machine():
    facts = LiveProbe().host()
    assert facts.cpu_count == os.cpu_count()
    if os.path.isdir("/dev/shm"):
        shm = os.statvfs("/dev/shm")
        assert facts.shm_total == shm.f_blocks * shm.f_frsize
    if os.path.exists("/proc/meminfo"):  # Linux: the kernel's page count says the same as meminfo
        assert facts.ram_total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert facts.ram_total >= (facts.ram_available or 0) > 0
    else:
        assert (facts.ram_total, facts.ram_available) == (None, None)


def test_environ_reads_only_the_relevant_variables(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("HOME_SECRET_TOKEN", "x")
    environ = LiveProbe().environ()
    assert environ["CUDA_VISIBLE_DEVICES"] == "1" and "HOME_SECRET_TOKEN" not in environ


def test_conda_export_is_none_outside_conda():
    if LiveProbe().python().manager == "conda":
        pytest.skip("running inside conda")
    assert LiveProbe().conda_export() is None


def test_recorded_probe_answers_what_it_was_given():
    torch_facts = TorchFacts(version="2.5.1+cu124", cuda="12.4")
    probe = RecordedProbe(torch=torch_facts, environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, conda={"name": "x"}, pid=7)
    assert probe.torch() is torch_facts and probe.environ() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert probe.conda_export() == {"name": "x"} and probe.pid() == 7 and probe.nvidia().gpus == ()
