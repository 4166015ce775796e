"""``--json``: stdout carries the JSON alone; what the workload prints goes to stderr (issue 14, item 16).

nanoGPT prints its parameter count when its model is built; before, that line landed on
stdout ahead of the JSON and ``json.loads`` failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

PRINTING = """
import torch
import memfit

print("workload module imported")

def make():
    print("building the workload")

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        print("number of parameters: %.2fM" % (sum(p.numel() for p in m.parameters()) / 1e6,))  # as nanoGPT
        return m

    def loss(m, batch):
        print("loss computed")
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    return memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
        loss=loss,
    )
"""


@pytest.fixture
def printing(tmp_path: Path) -> str:
    path = tmp_path / "printing.py"
    path.write_text(PRINTING)
    return f"{path}:make"


COMMANDS = {
    "measure": ["--device", "sim:64MiB", "--batch-size", "4"],
    "estimate": ["--batch-size", "4", "--device", "sim:64MiB"],
    "probe": ["--device", "sim:64MiB", "--max-batch-size", "8", "--no-estimate"],
    "plan": ["--device", "sim:64MiB", "--target-batch", "8", "--precision", "fp32", "--checkpointing", "none"],
    "fit": ["--device", "sim:64MiB", "--max-batch-size", "8", "--no-doctor"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_json_on_stdout_parses_and_the_workloads_prints_go_to_stderr(run_cli, printing, tmp_path, command):
    args = [command, printing, *COMMANDS[command], "--json"]
    if command == "fit":
        args += ["--lock", str(tmp_path / "memfit.lock"), "--report-dir", str(tmp_path / "report")]
    status, out, err = run_cli(*args)
    assert status == 0, err
    assert isinstance(json.loads(out), dict)  # nothing but the JSON
    assert "workload module imported" in err and "building the workload" in err
    assert "number of parameters: 0.00M" in err
    if command != "estimate":  # fake tensors still call the loss; real steps print it
        assert "loss computed" in err


def test_tables_stay_on_stdout_while_the_workloads_prints_go_to_stderr(run_cli, printing):
    status, out, err = run_cli("measure", printing, "--device", "sim:64MiB", "--batch-size", "4")
    assert status == 0
    assert "peak reserved" in out and "number of parameters" not in out
    assert "number of parameters: 0.00M" in err


@pytest.mark.slow
def test_the_installed_command_keeps_stdout_for_the_json(printing, tmp_path):
    source = str(Path(memfit.__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "measure", printing, "--device", "sim:64MiB", "--batch-size", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": source},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["batch_size"] == 4
    assert "number of parameters: 0.00M" in done.stderr


# -- strict JSON and any encoding (issue 21) --------------------------------------------------


def test_json_output_is_strict_nan_and_infinity_become_null(capsys):
    from memfit.cli.options import print_json

    print_json({"seconds": float("nan"), "rows": [{"speed": float("inf")}, 1.5]})

    def refuse(constant: str) -> None:
        raise AssertionError(f"bare {constant} in the JSON")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {
        "seconds": None,
        "rows": [{"speed": None}, 1.5],
    }


def test_text_output_falls_back_to_ascii_where_the_stream_cannot_encode(monkeypatch):
    import io

    from memfit.cli import text_streams_that_always_encode

    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stream)
    text_streams_that_always_encode()
    print("memfit fit · 8 × 2 → done ✗ é")
    stream.flush()
    assert raw.getvalue() == b"memfit fit - 8 x 2 -> done x ?\n"


def test_check_prints_a_non_ascii_difference_under_an_ascii_stdout(tmp_path):
    from memfit.environment.envfile import Fingerprint, fingerprint
    from memfit.run.settings import Settings
    from memfit.search.lock import Lock, write_lock

    here = fingerprint()
    other = Fingerprint(python=here.python, os=here.os, torch="2.0·local×build", gpus=here.gpus)
    lock = write_lock(
        Lock(workload="mlp", settings=Settings(micro_batch_size=2), target_batch_size=2, environment=other),
        tmp_path / "memfit.lock",
    )
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "check", str(lock)], capture_output=True, env=env, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert b"Traceback" not in done.stderr and b"2.0-localxbuild" in done.stdout.replace(b"\n", b"")
