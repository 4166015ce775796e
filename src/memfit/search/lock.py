"""memfit.lock: the chosen settings, what was measured, and the environment, frozen.

A lock is TOML with a schema version. It records the workload reference the user gave
(``memfit.load_workload(lock.workload)`` loads it again; None for a Workload made in
code, which the lock says in ``[workload] note``), the Settings
the plan chose (precision, checkpointing, micro-batch, accumulation, and for several GPUs
the world size and sharding strategy), the target batch,
the measured peak memory and samples/s with the headroom kept (``[measured]``: only what
real runs on the device gave; what fake-tensor trials or the step-time model gave is under
``[predicted]``, and a figure nobody measured is left out, never written as 0), and the environment
fingerprint (:mod:`memfit.environment.envfile`). :func:`check_lock` compares the fingerprint with this
machine, so a changed GPU, torch or driver is noticed before a run fails.

Use it in your own loop::

    lock = memfit.load_lock("memfit.lock")
    applied = lock.settings.apply(model)           # activation checkpointing, if chosen; under
    model = applied.model                          # torchrun, DDP / ZeRO-1 / FSDP2 as planned
    optimizer = applied.optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
    scaler = lock.settings.scaler("cuda")          # enabled for fp16 only
    for step, batch in enumerate(loader):          # loader yields micro-batches
        with lock.settings.autocast("cuda"):
            loss = loss_fn(model, batch) / lock.accumulation_steps
        scaler.scale(loss).backward()
        if (step + 1) % lock.accumulation_steps == 0:
            scaler.step(optimizer); scaler.update(); optimizer.zero_grad()

>>> import tempfile, pathlib
>>> from memfit.environment.envfile import Fingerprint
>>> lock = Lock(workload="mlp", settings=Settings(micro_batch_size=8, accumulation_steps=2),
...             target_batch_size=16, environment=Fingerprint(python="3.11.7", os="Linux x86_64"))
>>> path = pathlib.Path(tempfile.mkdtemp()) / "memfit.lock"
>>> _ = write_lock(lock, path)
>>> load_lock(path).settings == lock.settings
True
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomli_w

from memfit._io import write_atomically
from memfit._read import MAX_RESULT_BYTES, read_text
from memfit._version import __version__
from memfit.environment.envfile import EnvironmentCheck, Fingerprint, compare, fingerprint
from memfit.errors import MemfitError
from memfit.run.settings import Settings
from memfit.search.headroom import DEFAULT_HEADROOM

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Lock", "Measured", "Predicted", "write_lock", "load_lock", "check_lock", "SCHEMA", "SCHEMA_VERSION"]

SCHEMA = "memfit.lock"
SCHEMA_VERSION = 1
#: what a lock says in place of a reference when the workload was a Workload object
NO_REFERENCE = (
    "given as a Workload object, not a reference: memfit.load_workload cannot load it; "
    "build it in your script as when it was fitted"
)


@dataclass(frozen=True)
class Measured:
    """What real runs of the chosen settings measured on the device (None: not measured)."""

    device: str = ""
    capacity: int = 0
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    samples_per_second: float | None = None
    headroom: float = DEFAULT_HEADROOM
    max_batch_size: int = 0  # probe's largest batch for the default settings (0: not probed)


@dataclass(frozen=True)
class Predicted:
    """What fake-tensor trials and the step-time model predicted for the chosen settings
    (None: not predicted); never a measurement."""

    peak_allocated: int | None = None
    peak_reserved: int | None = None
    seconds_per_step: float | None = None
    samples_per_second: float | None = None
    #: the card the speed is predicted on
    speed_gpu: str | None = None

    def __bool__(self) -> bool:
        return any(value is not None for value in asdict(self).values())


def _present(table: object) -> dict[str, object]:
    """A table's fields that hold a value (TOML has no null: an absent key is "not known")."""
    return {key: value for key, value in asdict(table).items() if value is not None}  # type: ignore[call-overload]


@dataclass(frozen=True)
class Lock:
    """A memfit.lock in memory.

    ``workload`` is the reference the workload was loaded from (a zoo name with options,
    ``file.py:function``, ``module:function``), so ``memfit.load_workload(lock.workload)``
    loads it again; None when it was given as a Workload object, which no string can load
    (``workload_name`` then says which).
    """

    workload: str | None
    settings: Settings
    target_batch_size: int
    environment: Fingerprint
    world_size: int = 1
    measured: Measured = field(default_factory=Measured)
    predicted: Predicted = field(default_factory=Predicted)
    memfit_version: str = ""
    created: str = ""
    #: the workload's name, for people (defaults to the reference)
    workload_name: str = ""

    @property
    def micro_batch_size(self) -> int:
        assert self.settings.micro_batch_size is not None
        return self.settings.micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        return self.settings.accumulation_steps

    def to_toml(self) -> str:
        document = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "memfit_version": self.memfit_version or __version__,
            "created": self.created or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "workload": self._workload_table(),
            "settings": {k: v for k, v in self.settings.to_dict().items() if v is not None},
            "target": {"batch_size": self.target_batch_size, "world_size": self.world_size},
            "measured": _present(self.measured),
            **({"predicted": _present(self.predicted)} if self.predicted else {}),
            "environment": self.environment.to_dict(omit_missing=True),
        }
        return tomli_w.dumps(document)

    def _workload_table(self) -> dict[str, str]:
        name = self.workload_name or self.workload or "workload"
        if self.workload is None:
            return {"name": name, "note": NO_REFERENCE}
        return {"ref": self.workload, "name": name}


def write_lock(lock: Lock, path: str | os.PathLike[str] = "memfit.lock") -> Path:
    """Write the lock atomically: a reader sees the old file or the new one, never half."""
    return write_atomically(path, lock.to_toml())


def load_lock(path: str | os.PathLike[str] = "memfit.lock") -> Lock:
    """Read a lock; a missing, corrupt, foreign or newer-schema file is a one-line MemfitError."""
    path = Path(path)
    if not path.exists():
        raise MemfitError(f"{path} not found: write one with `memfit fit`")
    try:
        text = read_text(path, "file", MAX_RESULT_BYTES)  # a folder, a device, a binary file
    except MemfitError as error:
        raise MemfitError(f"{path} is not a valid memfit.lock: {error}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise MemfitError(f"{path} is not a valid memfit.lock (TOML error: {str(error).splitlines()[0]})") from None
    except RecursionError:
        raise MemfitError(f"{path} is not a valid memfit.lock (nested too deeply)") from None
    if data.get("schema") != SCHEMA:
        raise MemfitError(f'{path} is not a memfit.lock (no schema = "{SCHEMA}")')
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise MemfitError(f"{path} has an invalid schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise MemfitError(
            f"{path} has schema_version {version}, newer than this memfit reads ({SCHEMA_VERSION}): upgrade memfit"
        )
    try:
        settings = Settings(**data["settings"])
        if settings.micro_batch_size is None:
            raise KeyError("settings.micro_batch_size")
        table = data["workload"]
        ref = table.get("ref")
        if ref is None and "name" not in table:
            raise KeyError("workload.ref")
        return Lock(
            workload=None if ref is None else str(ref),
            workload_name=str(table.get("name", ref)),
            settings=settings,
            target_batch_size=int(data["target"]["batch_size"]),
            world_size=int(data["target"].get("world_size", 1)),
            measured=Measured(**data.get("measured", {})),
            predicted=Predicted(**data.get("predicted", {})),
            environment=Fingerprint.from_dict(data["environment"], source=f"{path} [environment]"),
            memfit_version=str(data.get("memfit_version", "")),
            created=str(data.get("created", "")),
        )
    except MemfitError as error:
        raise MemfitError(f"{path} is a damaged memfit.lock: {error}") from None
    except (KeyError, TypeError, ValueError) as error:
        raise MemfitError(f"{path} is a damaged memfit.lock: bad or missing {error}") from None


def check_lock(path: str | os.PathLike[str] = "memfit.lock", current: Fingerprint | None = None) -> EnvironmentCheck:
    """Compare the environment recorded in a lock with this machine.

    Args:
        path: the lock file.
        current: the fingerprint to compare with (default: this machine's).
    """
    lock = load_lock(path)
    return EnvironmentCheck(str(path), compare(lock.environment, current if current is not None else fingerprint()))
