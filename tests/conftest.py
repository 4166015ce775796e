"""Shared test fixtures (tiny zoo references, a CLI runner) and the one place ``cuda`` tests are skipped."""

from __future__ import annotations

import os

import pytest

from memfit.workload.zoo import TINY as TINY_ZOO

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Why absolute: tests start `python -m memfit` in a temporary folder; a relative PYTHONPATH
# (`PYTHONPATH=src`, as a checkout runs the suite) would then point nowhere, and the child
# would import another copy of memfit (an editable install's) instead of this checkout's.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(part) for part in os.environ["PYTHONPATH"].split(os.pathsep) if part
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``cuda`` on a machine without a CUDA GPU (the real path is bench/'s)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def tiny_zoo() -> dict[str, str]:
    return dict(TINY_ZOO)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]):
    """Run ``memfit ARGS`` in-process; return (exit status, stdout, stderr)."""
    from memfit.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        status = main(list(args))
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run
