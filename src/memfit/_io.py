"""The one way memfit writes a file: atomically, durably, with the user's permissions.

Every file memfit writes (``memfit.lock``, environment files, reports, figures, snapshots)
goes through :func:`write_atomically`:

- a reader sees the old file or the new one, never half of one (a temp file beside the
  target, then ``os.replace``);
- the data is on disk before the rename, and the rename before the function returns
  (``fsync`` of the file, then of its folder), so a power cut cannot leave an empty lock;
- a new file gets the mode the umask gives any new file (``0o666 & ~umask``), an existing
  one keeps its mode (``mkstemp``'s 0600 is never what the user meant);
- SIGINT and SIGTERM arriving while the file is written are held back until the rename
  (or the clean-up) is done, then delivered: no temp file is left behind at any moment.

>>> import tempfile, pathlib, stat
>>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
>>> write_atomically(target, "hello\\n") == target, target.read_text()
(True, 'hello\\n')
>>> sorted(p.name for p in target.parent.iterdir())
['out.txt']
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__ = ["write_atomically", "new_file_mode", "signals_held"]

#: the signals that end a program politely; both must not cut a write in half
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def new_file_mode() -> int:
    """The mode a newly created file gets under the current umask (``0o644`` for umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them in arrival order.

    Why: an interrupt between creating the temp file and renaming it would leave the temp
    file behind. Only the main thread can change signal handlers; elsewhere the block
    runs as it is (a signal is delivered to the main thread anyway).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[signal.Signals] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        arrived.append(signal.Signals(signum))

    previous = {sig: signal.signal(sig, hold) for sig in _HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in arrived:
            signal.raise_signal(sig)


def _fsync_directory(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike[str], data: bytes | str, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` atomically and durably; return the path.

    Args:
        path: the file to write; its folder is created when missing.
        data: the whole content; text is encoded with ``encoding``.
        encoding: the encoding of text data.
    """
    target = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else bytes(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()
    with signals_held():
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fchmod(handle.fileno(), mode)
                os.fsync(handle.fileno())
            os.replace(temp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        _fsync_directory(target.parent)
    return target
