"""memfit doctor and memfit env on the command line: real runs here, recorded GPU machines, exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memfit.environment import system
from memfit.environment.system import GpuInfo, GpuProcess, LiveProbe, NvidiaFacts, RecordedProbe, TorchFacts

GiB = 2**30
A100 = GpuInfo(
    0,
    "NVIDIA A100-SXM4-80GB",
    "GPU-1",
    "00000000:07:00.0",
    80 * GiB,
    57 * GiB,
    23 * GiB,
    (8, 0),
    (GpuProcess(4242, "python", 56 * GiB),),
)
CPU_WHEEL_ON_A100 = RecordedProbe(
    nvidia=NvidiaFacts("nvml", "550.54.14", (12, 4), (A100,)), torch=TorchFacts(version="2.5.1+cpu"), pid=1
)
#: one live probe for the in-process runs: torch's facts are read (in a child) once
LIVE = LiveProbe()
NVML_HERE = LIVE.nvidia().source is not None


@pytest.fixture
def recorded(monkeypatch):
    """Make the commands ask ``probe`` (recorded answers, or the shared live probe) instead of a new LiveProbe."""

    def use(probe: system.SystemProbe) -> None:
        monkeypatch.setattr(system, "current_probe", lambda: probe)

    return use


@pytest.mark.skipif(NVML_HERE, reason="this machine has an NVIDIA driver")
def test_doctor_on_this_machine_reports_no_gpu_visible(run_cli, recorded):
    recorded(LIVE)
    status, out, _ = run_cli("doctor")
    assert status == 0
    assert f"· info    no GPU visible (NVML: NVML Shared Library Not Found); torch {torch.__version__}" in out
    assert out.rstrip().endswith("0 errors, 0 warnings")


@pytest.mark.slow
@pytest.mark.skipif(NVML_HERE, reason="this machine has an NVIDIA driver")
def test_doctor_json_through_the_installed_entry_point():
    memfit = Path(sys.executable).with_name("memfit")
    completed = subprocess.run([str(memfit), "doctor", "--json"], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    data = json.loads(completed.stdout)
    assert data["exit_status"] == 0 and data["errors"] == 0
    [torch_finding] = [f for f in data["findings"] if f["check"] == "torch"]
    assert torch_finding["severity"] == "info" and torch_finding["message"].startswith("no GPU visible")
    assert data["facts"]["nvidia"]["gpus"] == [] and data["facts"]["torch"]["version"] == torch.__version__


def test_doctor_exits_1_on_a_cpu_wheel_with_a_gpu(run_cli, recorded):
    recorded(CPU_WHEEL_ON_A100)
    status, out, _ = run_cli("doctor")
    assert status == 1
    assert "✗ error   torch 2.5.1+cpu is a CPU-only build, but 1 NVIDIA GPU(s) are visible" in out
    assert "fix: pip install --force-reinstall torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124" in out
    assert "! warning other processes hold 56.00 GiB (70 %) of GPU 0: pid 4242 python (56.00 GiB)" in out
    assert out.rstrip().endswith("1 error, 1 warning")


def test_doctor_json_lists_every_finding_with_its_fix(run_cli, recorded):
    recorded(CPU_WHEEL_ON_A100)
    status, out, _ = run_cli(
        "doctor", "--json", "--variable-shapes", "--cudnn-benchmark", "--workers", "8", "--batch-bytes", "1GiB"
    )
    data = json.loads(out)
    assert status == 1 and data["exit_status"] == 1
    by_check = {(f["check"], f["severity"]): f for f in data["findings"] if f["fix"]}
    assert by_check[("torch", "error")]["fix"].endswith("/whl/cu124")
    assert by_check[("cudnn-benchmark", "warning")]["fix"].startswith("torch.backends.cudnn.benchmark = False")
    assert by_check[("allocator", "info")]["fix"] == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert data["facts"]["hints"] == {
        "variable_shapes": True,
        "cudnn_benchmark": True,
        "workers": 8,
        "batch_bytes": GiB,
        "prefetch_factor": 2,
    }


def test_doctor_bad_size_is_a_one_line_user_error(run_cli, recorded):
    recorded(CPU_WHEEL_ON_A100)
    status, _, err = run_cli("doctor", "--batch-bytes", "lots")
    assert status == 2 and err.startswith("memfit: error: invalid size 'lots'") and err.count("\n") == 1


def test_env_export_then_check_here_and_after_a_change(run_cli, recorded, tmp_path):
    recorded(LIVE)
    status, out, _ = run_cli("env", "export", "-o", str(tmp_path), "--json")
    assert status == 0
    assert [Path(p).name for p in json.loads(out)["paths"]] == [
        "environment.yml",
        "requirements.lock.txt",
        "environment.json",
    ]
    fingerprint = tmp_path / "environment.json"
    status, out, _ = run_cli("env", "check", str(fingerprint))
    assert status == 0 and out.strip() == f"no difference from {fingerprint}: this environment matches it"

    data = json.loads(fingerprint.read_text())
    data["torch"] = "2.4.0+cu121"
    fingerprint.write_text(json.dumps(data))
    status, out, _ = run_cli("env", "check", str(fingerprint), "--json")
    assert status == 1
    assert json.loads(out)["differences"] == [
        {
            "field": "torch",
            "old": "2.4.0+cu121",
            "new": torch.__version__,
            "matters": True,
            "note": "another build runs other kernels and allocates differently",
        }
    ]


def test_env_check_reports_another_gpu_model(run_cli, recorded, tmp_path):
    h100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-2", "00000000:19:00.0", 80 * GiB, GiB, 79 * GiB, (9, 0))
    cuda = TorchFacts(version="2.5.1+cu124", cuda="12.4", cudnn=90100)
    recorded(RecordedProbe(nvidia=NvidiaFacts("nvml", "550.54.14", (12, 4), (A100,)), torch=cuda))
    assert run_cli("env", "export", "-o", str(tmp_path))[0] == 0
    recorded(RecordedProbe(nvidia=NvidiaFacts("nvml", "560.35.03", (12, 6), (h100,)), torch=cuda))
    status, out, _ = run_cli("env", "check", str(tmp_path / "environment.json"), "--json")
    differences = json.loads(out)["differences"]
    assert status == 1
    assert [(d["field"], d["matters"]) for d in differences] == [
        ("driver", False),
        ("cuda_driver", False),
        ("gpus[0].name", True),
        ("gpus[0].capability", True),
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"schema": ', "is not valid JSON (line 1, column 12)"),
        ('{"name": "train", "channels": ["conda-forge"]}', "is not a memfit environment fingerprint"),
    ],
)
def test_env_check_corrupt_or_foreign_file_is_one_line_and_exit_2(run_cli, tmp_path, content, message):
    path = tmp_path / "environment.json"
    path.write_text(content)
    status, out, err = run_cli("env", "check", str(path))
    assert status == 2 and out == ""
    assert err.startswith(f"memfit: error: {path} {message}") and err.count("\n") == 1
