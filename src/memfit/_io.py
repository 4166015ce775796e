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
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from memfit.errors import MemfitError

__all__ = [
    "write_atomically",
    "new_file_mode",
    "signals_held",
    "check_writable",
    "check_writable_folder",
    "write_guards",
    "check_before_output",
]

#: checks every write runs first (a command's: the process state its workload must keep)
_WRITE_GUARDS: list[Callable[[], None]] = []


@contextlib.contextmanager
def write_guards(check: Callable[[], None]) -> Iterator[None]:
    """While the block runs, :func:`write_atomically` calls ``check()`` before each write.

    Why: a command refused once the user's code broke its conditions must write nothing,
    and every file memfit writes passes here. ``check`` raises to refuse.

    Args:
        check: raises (a MemfitError) when the file must not be written.
    """
    _WRITE_GUARDS.append(check)
    try:
        yield
    finally:
        _WRITE_GUARDS.remove(check)


#: the signals that end a program politely; both must not cut a write in half
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_before_output() -> None:
    """Run every check of :func:`write_guards` (before a file is written, or a result printed)."""
    for check in list(_WRITE_GUARDS):
        check()


def new_file_mode() -> int:
    """The mode a newly created file gets under the current umask (``0o644`` for umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _deliver(signum: int, handler: Any) -> None:
    """Run what ``handler`` (a ``signal.signal`` value) does for ``signum``, outside any hold."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        # the default action (end the process): let the operating system take it
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
    # SIG_IGN (or None: a handler set outside Python) ignores it


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them in arrival order.

    Why: an interrupt between creating the temp file and renaming it would leave the temp
    file behind. Only the main thread can change signal handlers; elsewhere the block
    runs as it is (a signal is delivered to the main thread anyway).

    Why ``hold`` forwards once the block is over: restoring two handlers is two calls, and
    a signal between them must still reach the program's own handler, not vanish.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous: dict[int, Any] = {}
    holding = True

    def hold(signum: int, _frame: FrameType | None) -> None:
        if holding:
            arrived.append(signum)
        else:
            _deliver(signum, previous.get(signum, signal.SIG_DFL))

    try:
        for sig in _HELD_SIGNALS:
            if signal.getsignal(sig) is not None:  # None: a handler set outside Python, left alone
                previous[sig] = signal.signal(sig, hold)
        yield
    finally:
        holding = False
        for held, handler in previous.items():
            signal.signal(held, handler)
        for signum in arrived:
            _deliver(signum, previous[signum])


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

    An OSError (a full disk, a folder that cannot be written) becomes a one-line
    :class:`~memfit.errors.MemfitError`; the temp file is removed first.

    Args:
        path: the file to write; its folder is created when missing.
        data: the whole content; text is encoded with ``encoding``.
        encoding: the encoding of text data.
    """
    check_before_output()
    target = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else bytes(data)
    try:
        _write(target, payload)
    except OSError as error:  # a full disk, a read-only folder: the user's to fix, in one line
        raise MemfitError(f"cannot write {target}: {error.strerror or error}") from None
    return target


#: the most bytes of a file name kept in its temp file's name (mkstemp adds 8, memfit 6 more)
_TEMP_NAME_KEPT = 200


def _temp_prefix(name: str) -> str:
    """The temp file's prefix: ``.NAME.`` while that is short, else ``.memfit-``.

    Why: a legal 251-byte name gave a 265-byte temp name, which no file system takes.
    """
    return f".{name}." if len(os.fsencode(name)) <= _TEMP_NAME_KEPT else ".memfit-"


def _write(target: Path, payload: bytes) -> None:
    """The write itself: a temp file beside the target, fsynced, renamed, the folder fsynced."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()
    with signals_held():
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix(target.name), suffix=".tmp")
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


def _nearest_existing(path: Path) -> Path:
    """``path`` itself when it exists, else its closest existing ancestor."""
    for candidate in (path, *path.parents):
        if os.path.exists(candidate):  # False, not an error, for a name too long
            return candidate
    return Path(".")


def _limit(folder: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):
        return default


def _check_names(path: Path, shown: str, what: str) -> None:
    """Refuse a path the OS would refuse (a name or the whole path too long), or a dangling link.

    Why before the work: open() fails with ENAMETOOLONG only when the file is written,
    after the whole search; a link to nowhere fails at mkdir or is silently replaced.
    """
    absolute = Path(os.path.abspath(path))
    existing = _nearest_existing(absolute)
    most_name = _limit(existing, "PC_NAME_MAX", 255)
    for part in absolute.parts[1:]:
        if len(os.fsencode(part)) > most_name:
            raise MemfitError(
                f"{what} {shown}: the name {part[:40]}... is longer than the {most_name} bytes a name may be"
            )
    most_path = _limit(existing, "PC_PATH_MAX", 4096)
    if len(os.fsencode(str(absolute))) >= most_path:
        raise MemfitError(f"{what} {shown}: the path is longer than the {most_path} bytes this system allows")
    for candidate in (absolute, *absolute.parents):
        if os.path.islink(candidate) and not os.path.exists(candidate):
            raise MemfitError(
                f"{what} {shown}: {candidate} is a link to {os.readlink(candidate)}, which does not exist"
            )


def _check_folder_writable(folder: Path, shown: str, what: str) -> None:
    """Refuse when files cannot be created in ``folder`` or in the folders it would need.

    Why a real probe (a temp file created and removed) rather than ``os.access``: root
    passes every permission check, yet cannot write to a read-only file system or /proc.
    """
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise MemfitError(f"{what} {shown}: {existing} is not a folder")
    try:
        with signals_held():
            fd, temp = tempfile.mkstemp(dir=existing, prefix=".memfit-probe.", suffix=".tmp")
            os.close(fd)
            os.unlink(temp)
    except OSError as error:
        raise MemfitError(f"{what} {shown}: cannot write in {existing} ({error.strerror or error})") from None


def check_writable(path: str | os.PathLike[str], what: str = "output file") -> Path:
    """Refuse, with one line, an output file that :func:`write_atomically` could not write.

    Call it before the long work, so a typo in an output path costs seconds, not the
    whole search. Nothing is left behind: no folder is created, the probe file is removed.

    Args:
        path: the file memfit will write.
        what: how the message names it (such as ``"--plot"``).

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> check_writable(folder / "new" / "plot.png") == folder / "new" / "plot.png"
    True
    >>> check_writable(folder)
    Traceback (most recent call last):
    memfit.errors.MemfitError: output file ...: it is a folder, not a file
    """
    target = Path(path)
    shown = str(target)
    _check_names(target, shown, what)
    if target.is_dir():
        raise MemfitError(f"{what} {shown}: it is a folder, not a file")
    if target.exists() and not target.is_file():
        # a device or a pipe: replacing it (as root, /dev/null) would be a disaster
        raise MemfitError(f"{what} {shown}: not a regular file")
    _check_folder_writable(target.parent, shown, what)
    return target


def check_writable_folder(path: str | os.PathLike[str], what: str = "output folder") -> Path:
    """Refuse, with one line, a folder memfit could not create or write files in.

    Args:
        path: the folder memfit will write files into (created when missing).
        what: how the message names it (such as ``"--report-dir"``).
    """
    folder = Path(path)
    _check_names(folder, str(folder), what)
    if folder.exists() and not folder.is_dir():
        raise MemfitError(f"{what} {folder}: it is a file, not a folder")
    _check_folder_writable(folder, str(folder), what)
    return folder
