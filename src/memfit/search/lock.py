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
import functools
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from memfit._io import write_atomically
from memfit._read import MAX_RESULT_BYTES, read_text
from memfit._schema import MAX_BYTES, MAX_COUNT, Field, Table, shown
from memfit._version import __version__
from memfit.environment.envfile import EnvironmentCheck, Fingerprint, compare, fingerprint
from memfit.errors import MemfitError
from memfit.run.settings import PRECISIONS, Settings
from memfit.run.strategy import SHARDS
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


#: the most ranks a lock plans for (far above any job, far below what would overflow a product)
MAX_WORLD_SIZE = 2**20
#: the largest target batch memfit plans for (``search.candidates.MAX_TARGET_BATCH``, which
#: imports torch: `memfit check` must not); a micro-batch or accumulation is at most as large
MAX_TARGET_BATCH = 2**24
MAX_STEPS = MAX_TARGET_BATCH


def _lock_schema() -> Table:
    """What memfit writes into a lock, field by field (the environment table: the fingerprint's)."""
    count = functools.partial(Field, "int", low=1, high=MAX_STEPS)
    size = functools.partial(Field, "int", required=False, low=0, high=MAX_BYTES)
    optional_text = functools.partial(Field, "str", required=False)
    return Table(
        {
            "schema": Field("str"),
            "schema_version": Field("int", low=1, high=SCHEMA_VERSION),
            "memfit_version": optional_text(high=200),
            "created": optional_text(high=200),
            "workload": Field(
                "table",
                fields=Table(
                    {"ref": optional_text(low=1), "name": optional_text(), "note": optional_text()}, strict=True
                ),
            ),
            "settings": Field(
                "table",
                fields=Table(
                    {
                        "precision": optional_text(choices=PRECISIONS),
                        "checkpointing": optional_text(high=500),  # a policy: Settings checks it
                        "micro_batch_size": count(),
                        "accumulation_steps": count(required=False),
                        "world_size": Field("int", required=False, low=1, high=MAX_WORLD_SIZE),
                        "shard": optional_text(choices=SHARDS),
                        "shard_group_size": Field("int", required=False, low=1, high=MAX_WORLD_SIZE),
                    },
                    strict=True,
                ),
            ),
            "target": Field(
                "table",
                fields=Table(
                    {
                        "batch_size": Field("int", low=1, high=MAX_TARGET_BATCH),
                        "world_size": Field("int", required=False, low=1, high=MAX_WORLD_SIZE),
                    },
                    strict=True,
                ),
            ),
            "measured": Field(
                "table",
                required=False,
                fields=Table(
                    {
                        "device": optional_text(high=200),
                        "capacity": size(),
                        "peak_allocated": size(),
                        "peak_reserved": size(),
                        "samples_per_second": Field("number", required=False, low=0, high=1e15),
                        "headroom": Field("number", required=False, low=0, high=0.99),
                        "max_batch_size": Field("int", required=False, low=0, high=MAX_COUNT),
                    },
                    strict=True,
                ),
            ),
            "predicted": Field(
                "table",
                required=False,
                fields=Table(
                    {
                        "peak_allocated": size(),
                        "peak_reserved": size(),
                        "seconds_per_step": Field("number", required=False, low=0, high=1e15),
                        "samples_per_second": Field("number", required=False, low=0, high=1e15),
                        "speed_gpu": optional_text(high=200),
                    },
                    strict=True,
                ),
            ),
            "environment": Field("table"),  # Fingerprint.from_dict checks it, field by field
        },
        strict=True,
    )


def _read_toml(path: Path) -> dict[str, Any]:
    """The lock's TOML, parsed; a one-line MemfitError when it is not TOML memfit could read."""
    try:
        text = read_text(path, "file", MAX_RESULT_BYTES)  # a folder, a device, a binary file
    except MemfitError as error:
        raise MemfitError(f"{path} is not a valid memfit.lock: {error}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise MemfitError(f"{path} is not a valid memfit.lock (TOML error: {str(error).splitlines()[0]})") from None
    except RecursionError:
        raise MemfitError(f"{path} is not a valid memfit.lock (nested too deeply)") from None
    except ValueError:  # int(): more digits than Python converts
        raise MemfitError(f"{path} is not a valid memfit.lock (a number too long for any field)") from None


def _consistent(path: Path, settings: Settings, target: int, world_size: int) -> None:
    """Refuse a lock whose numbers disagree with each other (memfit never writes one)."""
    if settings.world_size != world_size:
        raise MemfitError(
            f"{path} is a damaged memfit.lock: settings.world_size {settings.world_size} "
            f"is not target.world_size {world_size}"
        )
    product = (settings.micro_batch_size or 0) * settings.accumulation_steps * world_size
    if product != target:
        raise MemfitError(
            f"{path} is a damaged memfit.lock: target.batch_size {target} is not micro_batch_size x "
            f"accumulation_steps x world_size = {product}"
        )


def load_lock(path: str | os.PathLike[str] = "memfit.lock") -> Lock:
    """Read a lock; a missing, corrupt, foreign, newer-schema or damaged file is a one-line MemfitError.

    Every field is checked against what memfit writes (:func:`_lock_schema`): its type
    (``true`` is no number), its range, its finiteness; and the numbers against each other.
    """
    path = Path(path)
    if not path.exists():
        raise MemfitError(f"{path} not found: write one with `memfit fit`")
    data = _read_toml(path)
    if data.get("schema") != SCHEMA:
        raise MemfitError(f'{path} is not a memfit.lock (no schema = "{SCHEMA}")')
    version = data.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise MemfitError(
            f"{path} has schema_version {shown(version)}, newer than this memfit reads ({SCHEMA_VERSION}): "
            "upgrade memfit"
        )
    try:
        _lock_schema().check(data, f"{path} is a damaged memfit.lock")
        settings = Settings(**data["settings"])
        table = data["workload"]
        ref = table.get("ref")
        if ref is None and "name" not in table:
            raise MemfitError("workload.ref is missing (and no workload.name)")
        target = data["target"]
        world_size = target.get("world_size", 1)
        environment = Fingerprint.from_dict(
            data["environment"],
            source=f"{path} [environment]",
            prefix="environment.",
            damaged=f"{path} is a damaged memfit.lock",
        )
    except MemfitError as error:
        message = str(error)
        prefix = f"{path} is a damaged memfit.lock:"
        raise MemfitError(message if message.startswith(prefix) else f"{prefix} {message}") from None
    _consistent(path, settings, target["batch_size"], world_size)
    return Lock(
        workload=ref,
        workload_name=table.get("name", ref),
        settings=settings,
        target_batch_size=target["batch_size"],
        world_size=world_size,
        measured=Measured(**data.get("measured", {})),
        predicted=Predicted(**data.get("predicted", {})),
        environment=environment,
        memfit_version=data.get("memfit_version", ""),
        created=data.get("created", ""),
    )


def check_lock(path: str | os.PathLike[str] = "memfit.lock", current: Fingerprint | None = None) -> EnvironmentCheck:
    """Compare the environment recorded in a lock with this machine.

    Args:
        path: the lock file.
        current: the fingerprint to compare with (default: this machine's).
    """
    lock = load_lock(path)
    return EnvironmentCheck(str(path), compare(lock.environment, current if current is not None else fingerprint()))
