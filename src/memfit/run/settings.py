"""Settings: what memfit may change about a training step, and how each is applied.

- ``precision``: ``fp32``; ``bf16`` or ``fp16`` through ``torch.amp.autocast`` (fp16 with
  a ``torch.amp.GradScaler``).
- ``checkpointing``: which activations backward recomputes: ``none``; ``blocks`` (the
  repeated blocks that run in forward, found by running it); ``every:K``, ``first:N``,
  ``modules:NAME[+NAME...]``; ``selective`` (op-level selective checkpointing of every
  block). See :mod:`memfit.run.checkpointing` (non-reentrant ``torch.utils.checkpoint``;
  a transformers model's ``blocks`` through its own ``gradient_checkpointing_enable``).
- ``micro_batch_size`` and ``accumulation_steps``: one optimizer step sees
  ``micro_batch_size * accumulation_steps`` samples.
- ``world_size``, ``shard`` and ``shard_group_size``: how many ranks train together and
  how they share the model (DDP, ZeRO-1, FSDP2, hybrid sharding; see
  :mod:`memfit.run.parallel`). With ``world_size=1`` (the default) nothing is wrapped,
  even inside a process group: each rank then trains on its own.

>>> s = Settings(precision="bf16", micro_batch_size=8, accumulation_steps=4)
>>> s.batch_size
32
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from memfit.errors import MemfitError
from memfit.run import checkpointing as _checkpointing
from memfit.run.strategy import SHARDS, Shard, check_strategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from memfit.run.parallel import Parallel, Units

# torch (and memfit.cuda, which imports it) is imported inside the functions that run a
# step: Settings itself is plain data, and reading a memfit.lock (`memfit check`) should
# not cost torch's import (seconds).

__all__ = [
    "Settings",
    "Precision",
    "Checkpointing",
    "PRECISIONS",
    "CHECKPOINTING",
    "find_blocks",
    "autocast",
    "make_scaler",
    "Applied",
    "Shard",
    "SHARDS",
]

#: how forward and loss run: fp32, or bf16/fp16 autocast (fp16 with a GradScaler)
Precision = Literal["fp32", "bf16", "fp16"]
#: which activations backward recomputes: a policy of :mod:`memfit.run.checkpointing`
#: (``none``, ``blocks``, ``every:K``, ``first:N``, ``modules:NAME``, ``selective``)
Checkpointing = str
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")
#: the checkpointing a plan considers by default (others are asked for by name)
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "blocks")


@dataclass(frozen=True)
class Settings:
    """The knobs memfit turns. Frozen: change one with :meth:`replace`.

    Args:
        precision: ``fp32``, or ``bf16`` / ``fp16`` autocast (fp16 with a GradScaler).
        checkpointing: ``none``, ``blocks``, ``every:K``, ``first:N``,
            ``modules:NAME[+NAME...]`` or ``selective`` (see
            :mod:`memfit.run.checkpointing`).
        micro_batch_size: samples per forward/backward pass (None: not chosen yet).
        accumulation_steps: micro-batches per optimizer step.
        world_size: ranks training together (the process group must have as many).
        shard: how ranks share the model: ``none`` (DDP), ``optimizer`` (ZeRO-1),
            ``gradients`` (FSDP2 keeping full parameters from forward to backward),
            ``full`` (FSDP2).
        shard_group_size: FSDP2 shards within groups of this many ranks and replicates
            across groups (hybrid sharding); None: one group of every rank.
    """

    precision: Precision = "fp32"
    checkpointing: Checkpointing = "none"
    micro_batch_size: int | None = None
    accumulation_steps: int = 1
    world_size: int = 1
    shard: Shard = "none"
    shard_group_size: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise MemfitError(f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        _checkpointing.check(self.checkpointing)
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise MemfitError(f"invalid micro-batch size {self.micro_batch_size}: must be at least 1")
        if self.accumulation_steps < 1:
            raise MemfitError(f"invalid accumulation steps {self.accumulation_steps}: must be at least 1")
        check_strategy(self.shard, self.world_size, self.shard_group_size)

    @property
    def batch_size(self) -> int | None:
        """Samples per optimizer step (on one device)."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.accumulation_steps

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- applying the settings in a user's own loop ------------------------------------

    def apply(self, model: nn.Module, *, units: Units | None = None, device: torch.device | None = None) -> Applied:
        """Apply checkpointing to ``model``, then wrap it for the ranks of the process group
        (with ``world_size > 1``: the process group must have that many ranks).

        Returns an :class:`Applied`: ``.model`` is what to train (a DDP wrapper, or the
        model itself, sharded in place by FSDP2), ``.optimizer(make)`` makes its optimizer
        (ZeRO-1 under ``shard="optimizer"``), ``.checkpointed`` names the modules that
        recompute (after the model's first forward with gradients); calling it undoes the
        checkpointing.

        Args:
            model: the model, already on its device.
            units: the modules that become FSDP2 units (default: the repeated blocks).
            device: where FSDP2 puts each rank's shards (default: where the parameters
                are; give ``"cuda"`` for a model built on the CPU).
        """
        from memfit.run.parallel import parallelize  # torch: see the note at the imports

        checkpointed = _checkpointing.enable(model, self.checkpointing)
        undo = checkpointed.undo
        try:
            parallel = parallelize(
                model,
                self.shard,
                self.world_size,
                units=units or find_blocks,
                group_size=self.shard_group_size,
                precision=self.precision,
                device=device,
            )
        except BaseException:
            undo()
            raise
        return Applied(parallel, checkpointed)

    def autocast(self, device_type: str = "cuda") -> contextlib.AbstractContextManager[None]:
        """The autocast context for forward and loss (a no-op for fp32)."""
        return autocast(self.precision, device_type)

    def scaler(self, device_type: str = "cuda") -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16."""
        return make_scaler(self.precision, device_type)


class Applied:
    """What :meth:`Settings.apply` did to a model.

    ``model`` is what to train; :meth:`optimizer` makes its optimizer; calling the object
    (or :meth:`undo`) undoes the checkpointing. A strategy is not undone: DDP is a wrapper
    to drop, and FSDP2 shards the model in place for good.
    """

    def __init__(self, parallel: Parallel, checkpointed: _checkpointing.Checkpointed) -> None:
        self.parallel = parallel
        #: the modules that recompute in backward (known after the first forward with gradients)
        self.checkpointed = checkpointed
        self._undo = checkpointed.undo

    @property
    def model(self) -> nn.Module:
        """The module to call in forward: DDP around the model, or the model itself."""
        return self.parallel.model

    def optimizer(
        self, make_optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.AdamW(params)
    ) -> torch.optim.Optimizer:
        """``make_optimizer(model.parameters())``, sharded by ZeRO-1 under ``shard="optimizer"``."""
        return self.parallel.optimizer(make_optimizer)

    def undo(self) -> None:
        """Undo the checkpointing (the strategy stays)."""
        self._undo()

    def __call__(self) -> None:
        self._undo()


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager[None]:
    """``torch.amp.autocast`` for bf16/fp16; a null context for fp32.

    On a simulated GPU (inside :func:`memfit.cuda.semantics.cuda_semantics`) without
    CUDA, ``"cuda"`` means CPU autocast, which then follows CUDA's lists.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    import torch

    from memfit.cuda.semantics import autocast_device_type

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.amp.autocast(device_type=autocast_device_type(device_type), dtype=dtype)


def make_scaler(precision: str, device_type: str) -> torch.amp.GradScaler:
    """fp16 needs loss scaling to keep small gradients; bf16 and fp32 do not."""
    import torch

    from memfit.cuda.semantics import autocast_device_type

    return torch.amp.GradScaler(autocast_device_type(device_type), enabled=precision == "fp16")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks as its containers list them (no forward run): the
    children of the ModuleList or Sequential whose children all share one class, and which
    holds the most parameters.

    Why still a static rule: FSDP2 needs its units before any forward runs. Checkpointing
    finds its blocks by running the model (:mod:`memfit.run.checkpointing`), across
    containers.
    """
    from torch import nn

    best: list[nn.Module] = []
    best_params = -1
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or any(type(child) is not type(children[0]) for child in children):
            continue
        params = sum(p.numel() for child in children for p in child.parameters())
        if params > best_params:
            best, best_params = children, params
    return best


@contextlib.contextmanager
def applied(settings: Settings, model: nn.Module) -> Iterator[None]:
    """Apply the settings' checkpointing for the duration of the block."""
    undo = settings.apply(model)
    try:
        yield
    finally:
        undo()
