"""probe() under a real gloo process group: 2 processes, simulated GPUs of different sizes.

Each test starts two Python processes (RANK 0 and 1) and waits with a timeout, so a rank
left waiting in a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

CONVNET = "convnet:blocks=2,channels=8,image_size=32"  # maximum 14 on sim:4MiB, 21 on sim:6MiB
TIMEOUT = 240

WORKER = """
import json, os, sys
import torch.distributed as dist
from memfit.search.probe import probe

ref, specs, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
try:
    r = probe(ref, specs[rank], headroom=0)
    result = {"max": r.max_batch_size, "local": r.local_max_batch_size, "world": r.world_size,
              "recommended": r.recommended_batch_size}
except Exception as error:
    result = {"error": type(error).__name__, "message": str(error)}
dist.destroy_process_group()
with open(f"{out}.{rank}", "w") as handle:
    json.dump(result, handle)
os._exit(0)  # without finalizing Python: see conftest.py's run_ranks
"""


def launch(argv_for_rank, tmp_path: Path, torchrun_env) -> list[subprocess.CompletedProcess[str]]:
    """Run two ranks; kill both and fail if they do not finish within TIMEOUT seconds."""
    processes = [
        subprocess.Popen(
            argv_for_rank(rank), env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank, env in enumerate(torchrun_env(2))
    ]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=TIMEOUT)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail("a rank was left waiting (deadlock): the ranks did not finish in time")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def run_workers(ref: str, specs: list[str], tmp_path: Path, torchrun_env: Any) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "result"
    done = launch(lambda rank: [sys.executable, str(script), ref, ",".join(specs), str(out)], tmp_path, torchrun_env)
    for process in done:
        assert process.returncode == 0, process.stderr[-2000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def test_ranks_with_different_memory_agree_on_the_minimum(tmp_path: Path, torchrun_env: Any) -> None:
    results = run_workers(CONVNET, ["sim:6MiB", "sim:4MiB"], tmp_path, torchrun_env)
    assert [r["local"] for r in results] == [21, 14]
    assert [r["max"] for r in results] == [14, 14]
    assert [r["world"] for r in results] == [2, 2]
    assert results[0]["recommended"] == results[1]["recommended"] <= 14


def test_one_rank_that_does_not_fit_makes_every_rank_raise(tmp_path: Path, torchrun_env: Any) -> None:
    results = run_workers(CONVNET, ["sim:4MiB", "sim:1MiB"], tmp_path, torchrun_env)
    assert [r.get("error") for r in results] == ["DoesNotFitError", "DoesNotFitError"]
    assert "another rank" in results[0]["message"]
    assert "does not fit even at batch size 1" in results[1]["message"]


def test_cli_under_two_processes_prints_on_rank_0_only(tmp_path: Path, torchrun_env: Any) -> None:
    specs = ["sim:4MiB", "sim:6MiB"]
    done = launch(
        lambda rank: [
            sys.executable,
            "-m",
            "memfit",
            "probe",
            CONVNET,
            "--device",
            specs[rank],
            "--headroom",
            "0",
            "--json",
        ],
        tmp_path,
        torchrun_env,
    )
    assert [p.returncode for p in done] == [0, 0], done[1].stderr[-2000:]
    assert json.loads(done[0].stdout)["max_batch_size"] == 14
    assert json.loads(done[0].stdout)["world_size"] == 2
    assert done[1].stdout == ""
