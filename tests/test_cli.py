"""The command line: results, --json, and one-line user errors with exit status 2."""

import json
import subprocess
import sys

import pytest
import torch

import memfit
from memfit.run.settings import Settings
from memfit.units import format_size

TINY = "mlp:layers=2,width=32,features=16"


def test_measure_json(run_cli):
    status, out, err = run_cli("measure", TINY, "--device", "sim:256MiB", "--batch-size", "8", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert set(data) == {
        "batch_size",
        "fits",
        "peak_allocated",
        "peak_reserved",
        "seconds_per_step",
        "loss",
        "finite_loss",
    }
    assert data["batch_size"] == 8 and data["fits"] is True and data["finite_loss"] is True
    assert isinstance(data["peak_allocated"], int) and data["peak_reserved"] >= data["peak_allocated"]


def test_measure_oom_is_a_result_not_an_error(run_cli):
    status, out, _ = run_cli("measure", TINY, "--device", "sim:2MiB", "--batch-size", "4096", "--json")
    assert status == 0 and json.loads(out)["fits"] is False


def test_measure_table(run_cli):
    status, out, _ = run_cli("measure", TINY, "--device", "sim:256MiB", "--batch-size", "8", "--precision", "bf16")
    assert status == 0 and "peak reserved" in out and "sim:256MiB" in out
    expected = memfit.measure(TINY, 8, "sim:256MiB", Settings(precision="bf16"))  # the same run: sim is exact
    (row,) = [line for line in out.splitlines() if line.split("│")[1:2] == ["          8 "]]
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[:4] == ["8", "yes", format_size(expected.peak_allocated), format_size(expected.peak_reserved)]


USER_ERRORS = [
    (["measure", "gtp2", "--batch-size", "1", "--device", "sim:1GiB"], "unknown workload 'gtp2'"),
    (["measure", "gpt2:depth=2", "--batch-size", "1", "--device", "sim:1GiB"], "unknown option 'depth'"),
    (["measure", "nowhere.py:make", "--batch-size", "1", "--device", "sim:1GiB"], "file nowhere.py not found"),
    (["measure", "json:nope", "--batch-size", "1", "--device", "sim:1GiB"], "function nope not found"),
    (["measure", "json:dumps", "--batch-size", "1", "--device", "sim:1GiB"], "must take no required arguments"),
    (["measure", TINY, "--batch-size", "1", "--device", "sim:8GiG"], "invalid size '8GiG'"),
    (["measure", TINY, "--batch-size", "1", "--device", "sim:1GiB", "--memory", "lots"], "invalid size 'lots'"),
    (["measure", TINY, "--batch-size", "1", "--device", "tpu"], "unknown device 'tpu'"),
    (["measure", TINY, "--batch-size", "0", "--device", "sim:1GiB"], "--batch-size"),
    (["measure", TINY, "--device", "sim:1GiB"], "Missing option '--batch-size'"),
    (["measure", TINY, "--batch-size", "1", "--precision", "fp8"], "fp8"),
    (["nosuchcommand"], "No such command"),
]


@pytest.mark.parametrize(("args", "message"), USER_ERRORS)
def test_user_errors_are_one_line_and_exit_2(run_cli, args, message):
    status, out, err = run_cli(*args)
    assert status == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("memfit: error: ") and message in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu(run_cli):
    status, _, err = run_cli("measure", TINY, "--batch-size", "1", "--device", "cuda")
    assert status == 2 and "CUDA was asked for" in err and len(err.strip().splitlines()) == 1


def test_console_script_end_to_end():
    """The installed entry point, as a user runs it (no traceback on a user error)."""
    done = subprocess.run(
        [sys.executable, "-m", "memfit", "measure", "gtp2", "--batch-size", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("memfit: error: unknown workload")
    assert "Traceback" not in done.stderr
    version = subprocess.run([sys.executable, "-m", "memfit", "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and "memfit, version" in version.stdout
