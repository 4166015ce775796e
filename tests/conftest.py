"""Shared test fixtures: tiny zoo references and a CLI runner."""

from __future__ import annotations

import os

import pytest

from memfit.workload.zoo import TINY as TINY_ZOO

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
