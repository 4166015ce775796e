"""Run memfit doctor's real NVML / nvidia-smi / torch path on a GPU machine and check it.

    python bench/gpu_doctor.py [--out DIR] [--hold 0.7]
    python bench/gpu_doctor.py --publish DIR/gpu_doctor.json   # write the docs section from a saved run

What it does on a GPU machine:
1. diagnoses the machine through the live probe and times it;
2. checks that doing so created no CUDA context here (torch.cuda.is_initialized() stays
   False, and NVML lists no process with this pid);
3. cross-checks NVML's name, memory and capability of GPU 0 against torch in a child;
4. starts a second process holding ``--hold`` of GPU 0 and checks the doctor names it with
   a warning (the "zombie notebook kernel" case);
5. runs ``memfit doctor --json`` and ``memfit env export`` + ``memfit env check`` as commands.
It prints a short table, writes every fact and finding to DIR/gpu_doctor.json and, when the
docs are writable, its section of docs/benchmarks.md. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from memfit.environment.doctor import check_gpu_memory, diagnose
from memfit.environment.system import LiveProbe
from memfit.units import format_size

COMMAND = "python bench/gpu_doctor.py --out bench/results"

_HOLDER = r"""
import sys, torch
fraction = float(sys.argv[1])
total = torch.cuda.get_device_properties(0).total_memory
block = torch.empty(int(total * fraction), dtype=torch.uint8, device="cuda:0")
props = torch.cuda.get_device_properties(0)
print(f"READY {props.name}|{props.total_memory}|{props.major}.{props.minor}|{block.numel()}", flush=True)
sys.stdin.read()
"""


def hold_memory(fraction: float) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """A child process that holds ``fraction`` of GPU 0 until its stdin closes."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(fraction)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline() if child.stdout else ""
    if not line.startswith("READY "):
        child.kill()
        raise RuntimeError(f"memory holder failed: {child.stderr.read() if child.stderr else ''}")
    name, total, capability, held = line.split(" ", 1)[1].strip().split("|")
    return child, {"pid": child.pid, "name": name, "total": int(total), "capability": capability, "held": int(held)}


def run_command(argv: list[str], cwd: Path | None = None) -> dict[str, object]:
    """A memfit command as a user runs it: exit status, seconds, parsed JSON when there is some."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd)
    seconds = time.perf_counter() - start
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        data = None
    return {
        "argv": argv,
        "status": done.returncode,
        "seconds": round(seconds, 2),
        "json": data,
        "stderr": done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else [],
    }


def measure(hold: float) -> dict[str, object]:
    probe = LiveProbe()
    start = time.perf_counter()
    diagnosis = diagnose(probe)
    doctor_seconds = time.perf_counter() - start
    import torch  # after the diagnosis: importing torch alone creates no context either

    pid = os.getpid()
    after = LiveProbe().nvidia()
    own_context = any(p.pid == pid for gpu in after.gpus for p in gpu.processes)
    results: dict[str, object] = {
        "command": COMMAND,
        "doctor_seconds": round(doctor_seconds, 2),
        "findings": [f.to_dict() for f in diagnosis.findings],
        "facts": diagnosis.facts,
        "no_context": {"torch_cuda_initialized": torch.cuda.is_initialized(), "pid_listed_by_nvml": own_context},
    }
    memfit = [sys.executable, "-m", "memfit"]
    results["cli_doctor"] = run_command([*memfit, "doctor", "--json"])
    with tempfile.TemporaryDirectory() as tmp:
        results["cli_env_export"] = run_command([*memfit, "env", "export", "-o", tmp, "--json"])
        results["cli_env_check"] = run_command([*memfit, "env", "check", str(Path(tmp) / "environment.json"), "--json"])
    child, held = hold_memory(hold)
    try:
        busy = LiveProbe().nvidia()
        gpu0 = busy.gpus[0]
        warnings = [f.to_dict() for f in check_gpu_memory(busy, pid) if f.severity == "warning"]
        results["holder"] = {
            **held,
            "nvml": {
                "name": gpu0.name,
                "total": gpu0.total_memory,
                "used": gpu0.used_memory,
                "capability": f"{gpu0.compute_capability[0]}.{gpu0.compute_capability[1]}",
                "processes": [asdict(p) for p in gpu0.processes],
            },
            "warnings": warnings,
            "named": any(f"pid {held['pid']} " in w["message"] for w in warnings),
        }
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(timeout=60)
    return results


def markdown(results: dict[str, object]) -> str:
    """The docs/benchmarks.md section: what ran, and what it found."""
    facts = results["facts"]
    nvidia, torch_facts = facts["nvidia"], facts["torch"]  # type: ignore[index]
    holder = results["holder"]  # type: ignore[assignment]
    nvml = holder["nvml"]  # type: ignore[index]
    lines = [
        "## memfit doctor on a real GPU (bench/gpu_doctor.py)",
        "",
        f"Command: `{results['command']}`",
        "",
        f"- driver {nvidia['driver_version']} (CUDA {'.'.join(map(str, nvidia['cuda_driver_version'] or []))}, "
        f"read through {nvidia['source']}); torch {torch_facts['version']} (CUDA {torch_facts['cuda']}, "
        f"cuDNN {torch_facts['cudnn']})",
        f"- doctor ran in {results['doctor_seconds']} s; afterwards torch.cuda.is_initialized() = "
        f"{results['no_context']['torch_cuda_initialized']}, NVML lists this pid: "  # type: ignore[index]
        f"{results['no_context']['pid_listed_by_nvml']}",  # type: ignore[index]
        f"- GPU 0 by NVML: {nvml['name']}, {format_size(nvml['total'])}, capability {nvml['capability']}; "
        f"by torch: {holder['name']}, {format_size(holder['total'])}, capability {holder['capability']}",  # type: ignore[index]
        f"- a second process holding {format_size(holder['held'])} of GPU 0: named in a warning = "  # type: ignore[index]
        f"{holder['named']}",  # type: ignore[index]
        f"- `memfit doctor --json` exit {results['cli_doctor']['status']}; `memfit env export` then "  # type: ignore[index]
        f"`memfit env check` exit {results['cli_env_check']['status']}",  # type: ignore[index]
        "",
        "| severity | finding |",
        "|---|---|",
    ]
    for finding in results["findings"]:  # type: ignore[union-attr]
        lines.append(f"| {finding['severity']} | {finding['message'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory for gpu_doctor.json")
    parser.add_argument("--hold", type=float, default=0.7, help="share of GPU 0 the second process holds")
    parser.add_argument("--publish", default=None, help="write the docs section from a saved gpu_doctor.json")
    args = parser.parse_args()
    from _results import write_section

    if args.publish:
        write_section("gpu_doctor", markdown(json.loads(Path(args.publish).read_text())))
        print(f"wrote the gpu_doctor section of docs/benchmarks.md from {args.publish}")
        return 0
    nvidia = LiveProbe().nvidia()
    if not nvidia.gpus:
        print(
            f"gpu_doctor: no NVIDIA GPU visible ({nvidia.error}); nothing to measure here. "
            "Run it on a GPU machine; `memfit doctor` itself runs anywhere."
        )
        return 0
    results = measure(args.hold)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_doctor.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"{'check':<44} result")
    holder = results["holder"]
    rows = [
        ("doctor seconds", results["doctor_seconds"]),
        ("CUDA context created here", results["no_context"]),
        ("second process named in a warning", holder["named"]),  # type: ignore[index]
        ("memfit doctor --json exit", results["cli_doctor"]["status"]),  # type: ignore[index]
        ("memfit env check exit", results["cli_env_check"]["status"]),  # type: ignore[index]
    ]
    for finding in results["findings"]:  # type: ignore[union-attr]
        rows.append((finding["severity"], finding["message"][:100]))
    for name, value in rows:
        print(f"{name:<44} {value}")
    write_section("gpu_doctor", markdown(results))
    print(f"full results: {out / 'gpu_doctor.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
