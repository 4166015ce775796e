"""The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``), parsed as PyTorch parses them.

Why here: the allocator model (:mod:`memfit.memory.allocator`) follows the settings a CUDA run
would follow, so that the simulated GPU, the estimator and a real card agree under each. The
keys and their checks follow ``c10/core/AllocatorConfig.cpp`` (``parseArgs``): the string is
cut at ``, : [ ]`` (whitespace dropped), values are checked as torch checks them, and an
invalid string is refused here as torch would refuse to start.

Modelled (they change what the allocator reserves):

- ``expandable_segments:True``: one segment per pool that grows by mapping pages (2 MiB in
  the small pool, 20 MiB in the large one) instead of one ``cudaMalloc`` per segment;
- ``max_split_size_mb:N`` (N >= 20): blocks of N MiB or more are never split, and a request
  under N MiB never takes one;
- ``max_non_split_rounding_mb:N`` (N >= 20, default 20): how much larger than a request of at
  least ``max_split_size`` a cached block it reuses may be;
- ``roundup_power2_divisions:N`` or ``[MB:N,...,>:N]``: requests rounded up to one of N
  steps between two powers of two (per size interval from 1 MiB to 64 GiB);
- ``garbage_collection_threshold:F`` (0 < F < 1): cached whole segments, oldest first, are
  released when reserved memory passes F of the allowed memory. PyTorch runs this only when
  a memory fraction is set (``set_fraction``), so it takes effect here only with
  ``per_process_memory_fraction:F`` (the same as ``torch.cuda.set_per_process_memory_fraction``);
- ``per_process_memory_fraction:F``: the allocator may reserve F of the memory.

Accepted without effect on device memory (host pinned memory, locking, graph capture):
``backend:native``, ``release_lock_on_cudamalloc``, ``pinned_*``,
``graph_capture_record_stream_reuse``, ``throw_on_cudamalloc_oom``. Refused, one line each:
``backend:cudaMallocAsync`` (the driver's pools, not this allocator) and
``large_segment_size_mb`` (not modelled).

>>> conf = parse("expandable_segments:True, roundup_power2_divisions:[256:1,>:4]")
>>> conf.expandable_segments, conf.divisions(300 * 2**20), conf.divisions(600 * 2**20)
(True, 1, 4)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from memfit.environment.versions import ALLOC_CONF_KEYS
from memfit.errors import MemfitError
from memfit.units import MiB

__all__ = [
    "AllocatorConfig",
    "DEFAULT",
    "EXPANDABLE",
    "COMPARED",
    "parse",
    "from_environment",
    "current",
    "use",
    "ENVIRONMENT_VARIABLES",
    "round_request",
    "divisions_round",
]

#: where torch reads the settings, first found first (``CUDAAllocatorConfig::instance``)
ENVIRONMENT_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

MIN_BLOCK_SIZE = 512
LARGE_BUFFER = 20 * MiB
#: ``roundup_power2_divisions`` has one entry per power-of-two interval from 1 MiB to 64 GiB
INTERVALS = 16
_INTERVAL_START_LOG2 = 20  # 1 MiB

#: keys the allocator model reads (or refuses with a reason); every other key torch accepts
#: changes nothing the device allocator reserves
_MODELLED = frozenset(
    {
        "backend",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "large_segment_size_mb",
        "per_process_memory_fraction",
    }
)
_NO_EFFECT = ALLOC_CONF_KEYS - _MODELLED


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings the allocator model follows; the defaults are torch's."""

    expandable_segments: bool = False
    #: blocks of this size or more are not split (None: no limit, torch's SIZE_MAX)
    max_split_size: int | None = None
    max_non_split_rounding: int = LARGE_BUFFER
    #: divisions per interval (1 MiB, 2 MiB, ... 32 GiB and up); 0 or 1: no power-of-two rounding
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * INTERVALS)
    garbage_collection_threshold: float = 0.0
    #: the share of the memory the allocator may reserve (None: no fraction set)
    per_process_memory_fraction: float | None = None
    #: the string it was parsed from ("" for the defaults)
    text: str = ""

    def divisions(self, size: int) -> int:
        """The divisions for a request of ``size`` bytes (``roundup_power2_divisions(size)``)."""
        index = size.bit_length() - 1 - _INTERVAL_START_LOG2
        return self.roundup_power2_divisions[min(max(index, 0), INTERVALS - 1)]

    @property
    def fraction_set(self) -> bool:
        return self.per_process_memory_fraction is not None

    def describe(self) -> str:
        """The settings as a user would write them ("torch's defaults" when there are none)."""
        return self.text or "torch's defaults"


DEFAULT = AllocatorConfig()
EXPANDABLE = AllocatorConfig(expandable_segments=True, text="expandable_segments:True")
#: the settings an estimate compares the step under (besides the one it ran with)
COMPARED = (DEFAULT, EXPANDABLE)


def divisions_round(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` equal steps
    between the powers of two around it."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_request(size: int, config: AllocatorConfig) -> int:
    """A request rounded as ``round_size`` rounds it under ``config``."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    divisions = config.divisions(size)
    if divisions > 1 and size > MIN_BLOCK_SIZE * divisions:
        return divisions_round(size, divisions)
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def _tokens(text: str) -> list[str]:
    return [token for token in re.split(r"([,:\[\]])", re.sub(r"\s+", "", text)) if token]


def _fail(text: str, why: str) -> MemfitError:
    return MemfitError(f"allocator setting {text!r}: {why}")


class _Reader:
    """The tokens of one setting string, read left to right as torch's parser reads them."""

    def __init__(self, text: str) -> None:
        self.text, self.tokens, self.i = text, _tokens(text), 0

    def take(self, expected: str | None = None) -> str:
        if self.i >= len(self.tokens):
            raise _fail(self.text, f"expected {expected or 'a value'!r} at the end")
        token = self.tokens[self.i]
        if expected is not None and token != expected:
            raise _fail(self.text, f"expected {expected!r}, found {token!r}")
        self.i += 1
        return token

    def value(self) -> str:
        self.take(":")
        return self.take()

    def done(self) -> bool:
        return self.i >= len(self.tokens)


def _number(reader: _Reader, key: str, kind: type) -> float:
    token = reader.value()
    try:
        return float(token) if kind is float else int(token)
    except ValueError:
        raise _fail(reader.text, f"{key} must be a number, not {token!r}") from None


def _mib_at_least_20(reader: _Reader, key: str) -> int:
    value = int(_number(reader, key, int))
    if value < LARGE_BUFFER // MiB:
        raise _fail(reader.text, f"{key} must be at least 20 (MiB), as torch requires")
    return value * MiB


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _divisions(reader: _Reader) -> tuple[int, ...]:
    """``N`` (every interval) or ``[MB:N, ..., >:N]`` (per interval), as torch reads them."""
    reader.take(":")
    first = reader.take()
    if first != "[":
        value = _int_token(reader, first)
        if not _power_of_two(value):
            raise _fail(reader.text, "roundup_power2_divisions must be a power of 2")
        return (value,) * INTERVALS
    table = [0] * INTERVALS
    last, started = 0, False
    while True:
        interval = reader.take()
        if interval == "]":
            break
        reader.take(":")
        value = _int_token(reader, reader.take())
        if value != 0 and not _power_of_two(value):
            raise _fail(reader.text, "each roundup_power2_divisions value must be 0 or a power of 2")
        if interval == ">":
            table[last + 1 if started else 0 :] = [value] * (INTERVALS - (last + 1 if started else 0))
        else:
            megabytes = _int_token(reader, interval)
            if not _power_of_two(megabytes):
                raise _fail(reader.text, "roundup_power2_divisions intervals must be powers of 2 (MB)")
            index = min(megabytes.bit_length() - 1, INTERVALS - 1)
            if not started:
                table[:index] = [value] * index
                started = True
            table[index], last = value, index
        if reader.tokens[reader.i : reader.i + 1] != ["]"]:
            reader.take(",")
    return tuple(table)


def _int_token(reader: _Reader, token: str) -> int:
    if not token.isdigit():
        raise _fail(reader.text, f"expected a whole number, not {token!r}")
    return int(token)


def _boolean(reader: _Reader, key: str) -> bool:
    token = reader.value()
    if token not in ("True", "False"):
        raise _fail(reader.text, f"{key} must be True or False, not {token!r}")
    return token == "True"


def _skip_value(reader: _Reader) -> None:
    reader.take(":")
    if reader.take() == "[":
        while reader.take() != "]":
            pass


def parse(text: str) -> AllocatorConfig:
    """The settings of one ``PYTORCH_CUDA_ALLOC_CONF`` string; a :class:`MemfitError` (one
    line) for a string torch would refuse, or one memfit cannot model.

    Args:
        text: such as ``"expandable_segments:True,max_split_size_mb:128"``.
    """
    reader = _Reader(text)
    values: dict[str, object] = {}
    while not reader.done():
        key = reader.take()
        if key == "expandable_segments":
            values["expandable_segments"] = _boolean(reader, key)
        elif key == "max_split_size_mb":
            values["max_split_size"] = _mib_at_least_20(reader, key)
        elif key == "max_non_split_rounding_mb":
            values["max_non_split_rounding"] = _mib_at_least_20(reader, key)
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"] = _divisions(reader)
        elif key in ("garbage_collection_threshold", "per_process_memory_fraction"):
            number = float(_number(reader, key, float))
            top_ok = number < 1.0 if key == "garbage_collection_threshold" else number <= 1.0
            if not (number > 0.0 and top_ok):
                raise _fail(text, f"{key} must be a fraction between 0 and 1")
            values[key] = number
        elif key == "backend":
            backend = reader.value()
            if backend != "native":
                raise _fail(
                    text,
                    f"backend:{backend} is not modelled (memfit models the native caching allocator); "
                    "drop the backend key to estimate with the native one",
                )
        elif key == "large_segment_size_mb":
            raise _fail(text, "large_segment_size_mb is not modelled: drop it to estimate with 20 MiB segments")
        elif key in _NO_EFFECT:
            _skip_value(reader)
        else:
            raise _fail(text, f"unknown key {key!r}: torch refuses to start with it")
        if not reader.done():
            reader.take(",")
    return AllocatorConfig(text=text.strip(), **values)  # type: ignore[arg-type]


def from_environment(environ: Mapping[str, str] | None = None) -> AllocatorConfig:
    """The settings a CUDA run started here would use: ``PYTORCH_CUDA_ALLOC_CONF``, else
    ``PYTORCH_ALLOC_CONF``, else torch's defaults.

    Args:
        environ: the environment (default: this process's).
    """
    environ = os.environ if environ is None else environ
    for name in ENVIRONMENT_VARIABLES:
        text = environ.get(name, "").strip()
        if text:
            try:
                return parse(text)
            except MemfitError as error:
                raise MemfitError(f"{name}: {error}") from None
    return DEFAULT


_current: contextvars.ContextVar[AllocatorConfig | None] = contextvars.ContextVar("memfit_alloc_conf", default=None)


def current() -> AllocatorConfig:
    """The settings a new allocator model follows: those of :func:`use`, else the environment's."""
    chosen = _current.get()
    return chosen if chosen is not None else from_environment()


@contextlib.contextmanager
def use(config: AllocatorConfig | str | None) -> Iterator[AllocatorConfig]:
    """Make allocator models created inside follow ``config`` (None: the environment's).

    Args:
        config: the settings, or a ``PYTORCH_CUDA_ALLOC_CONF`` string.
    """
    chosen = parse(config) if isinstance(config, str) else config
    token = _current.set(chosen)
    try:
        yield current()
    finally:
        _current.reset(token)
