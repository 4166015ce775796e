"""memfit under torchrun: two gloo processes, simulated GPUs of different sizes, one answer.

Each rank probes its own ``sim:`` device (rank 0 the larger); the ranks agree on the
smaller maximum and only rank 0 prints, so stdout holds exactly one JSON document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import memfit
from memfit.integrations.torchrun import launched_by_torchrun, output_on_main_only, rank_device

WORKLOAD = "mlp:layers=1,width=64,features=64"
SIZES = ("5MiB", "3MiB")  # rank 0, rank 1
MULTIPLE = 16


@pytest.mark.parametrize(
    ("spec", "rank", "expected"),
    [
        ("sim:8GiB,4GiB", 0, "sim:8GiB"),
        ("sim:8GiB,4GiB", 1, "sim:4GiB"),
        ("sim:8GiB,4GiB", 5, "sim:4GiB"),
        ("sim:8GiB", 1, "sim:8GiB"),
        ("cpu", 1, "cpu"),
    ],
)
def test_rank_device(spec: str, rank: int, expected: str) -> None:
    assert rank_device(spec, rank=rank) == expected


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, True),
        ({"WORLD_SIZE": "2", "RANK": "1"}, False),
        ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, False),
        ({}, False),
    ],
)
def test_launched_by_torchrun(environ: dict[str, str], expected: bool) -> None:
    assert launched_by_torchrun(environ) is expected


@pytest.mark.parametrize(("rank", "printed"), [(0, "hello\n"), (1, "")])
def test_output_on_main_only(rank: int, printed: str, capsys: pytest.CaptureFixture[str]) -> None:
    with output_on_main_only(rank):
        print("hello")
    assert capsys.readouterr().out == printed


def _torchrun(*command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def alone() -> dict[str, int]:
    """Each device's maximum, probed in this one process."""
    return {size: memfit.probe(WORKLOAD, f"sim:{size}", multiple_of=MULTIPLE).max_batch_size for size in SIZES}


@pytest.mark.timeout(300)
def test_memfit_probe_under_torchrun_gives_one_agreed_answer(alone: dict[str, int]) -> None:
    # Each rank picks its own size from LOCAL_RANK (the per-rank recipe for plain -m memfit).
    script = (
        f'case "$LOCAL_RANK" in 0) size={SIZES[0]};; *) size={SIZES[1]};; esac; '
        f'exec "$0" -m memfit probe {WORKLOAD} --device "sim:$size" --multiple-of {MULTIPLE} --json'
    )
    completed = _torchrun("--no-python", "sh", "-c", script, sys.executable)
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout)  # one document: rank 1 printed nothing

    assert alone[SIZES[1]] < alone[SIZES[0]]
    assert result["world_size"] == 2
    assert result["max_batch_size"] == alone[SIZES[1]]  # the smaller device decides
    assert result["local_max_batch_size"] == alone[SIZES[0]]  # rank 0 reports its own device
    assert result["device"] == f"sim:{SIZES[0]}"


@pytest.mark.timeout(300)
def test_the_torchrun_module_gives_each_rank_its_device_from_one_list(alone: dict[str, int]) -> None:
    completed = _torchrun(
        "-m",
        "memfit.integrations.torchrun",
        "probe",
        WORKLOAD,
        "--device",
        f"sim:{SIZES[0]},{SIZES[1]}",
        "--multiple-of",
        str(MULTIPLE),
        "--json",
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(completed.stdout)
    assert (result["world_size"], result["max_batch_size"], result["local_max_batch_size"]) == (
        2,
        alone[SIZES[1]],
        alone[SIZES[0]],
    )
