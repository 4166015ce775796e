"""Files memfit writes get the umask's mode, keep an existing file's mode, and are fsynced with
their folder before the write returns (issue 14, item 14).

The issue found ``memfit.lock`` and ``env export`` files created 0600 whatever the umask (an
existing 0644 lock became 0600) and nothing fsynced before the rename.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from memfit._io import write_atomically
from memfit.environment.envfile import FILES, Fingerprint, export_environment
from memfit.environment.system import NvidiaFacts, RecordedProbe
from memfit.run.settings import Settings
from memfit.search.lock import Lock, write_lock


@pytest.fixture
def umask() -> Iterator[object]:
    """Set the process umask for a test, restored afterwards."""
    previous = os.umask(0o022)
    os.umask(previous)

    def use(mask: int) -> None:
        os.umask(mask)

    yield use
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def a_lock() -> Lock:
    return Lock(
        workload="mlp",
        settings=Settings(micro_batch_size=8),
        target_batch_size=8,
        environment=Fingerprint(python="3.11.7", os="Linux x86_64"),
    )


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_lock_gets_the_mode_of_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    path = write_lock(a_lock(), tmp_path / "memfit.lock")
    assert mode(path) == expected


def test_an_existing_lock_keeps_its_mode_whatever_the_umask(tmp_path, umask):
    path = tmp_path / "memfit.lock"
    path.write_text("old\n")
    path.chmod(0o644)
    umask(0o077)
    write_lock(a_lock(), path)
    assert mode(path) == 0o644
    assert "schema" in path.read_text()


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640)])
def test_env_export_files_get_the_mode_of_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    probe = RecordedProbe(nvidia=NvidiaFacts(error="no GPU"))
    export_environment(tmp_path / "env", probe, dists=[])
    assert {name: mode(tmp_path / "env" / name) for name in FILES} == dict.fromkeys(FILES, expected)


def test_the_file_and_its_folder_are_fsynced_before_the_write_returns(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    write_atomically(tmp_path / "report.html", b"<html></html>")
    assert synced == ["file", "folder"]  # the data, then the rename
    assert (tmp_path / "report.html").read_bytes() == b"<html></html>"
