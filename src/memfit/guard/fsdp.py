"""FSDP2 under the guard: micro-batches without gradient sync, one reduce-scatter, ranks that stop together.

Under DDP the guard keeps forward and backward free of collectives (``no_sync``) and
agrees once per attempt. FSDP2 cannot: every unit all-gathers its parameters in forward
(and, fully sharded, again in backward). A rank that runs out of memory inside a unit
stops issuing those all-gathers, and the others would wait in theirs for ever. So, while
the guard runs a batch on an FSDP2 model:

- every unit's forward and backward, and every post-backward (the reduce-scatter), is
  preceded by a **heartbeat**: one all-reduce of a flag, "has some rank run out of
  memory?". A rank that runs out of memory leaves its step and sends the flag in its
  next heartbeat; every other rank is then waiting in a heartbeat (nothing else can come
  first: each collective has one before it), receives the flag and leaves its step with
  :class:`PeerOutOfMemory`. Every rank has issued the same collectives; they agree on the
  split (:class:`~memfit.guard.splitter.Splitter`'s one all-reduce) and run the batch
  again in smaller micro-batches;
- every rank runs as many micro-batches (a rank with fewer samples repeats its last one
  with its loss weighted 0); those before the last run with
  ``set_requires_gradient_sync(False)`` (FSDP2 accumulates the unsharded gradients
  locally), the last one with sync: one reduce-scatter of the whole batch's gradient, so
  the update equals the unsplit step's;
- a failed attempt is undone with FSDP2's ``reset_iter_state()`` on the root module, and
  the unsharded gradients accumulated so far are dropped.

The heartbeats cost one small all-reduce per unit in forward, in backward and after
backward. An out-of-memory inside FSDP2's own all-gather (allocating a unit's full
parameters, between a heartbeat and the collective it guards) cannot be recovered on one
rank: the others are already in the all-gather. It propagates there, as any error does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from memfit import distributed

__all__ = ["PeerOutOfMemory", "FSDPGuarding", "fsdp_root", "guarding"]


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this attempt; this rank stops at the same point."""


def fsdp_root(model: nn.Module) -> nn.Module | None:
    """``model`` when it is an FSDP2 (``fully_shard``) module, else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return model if isinstance(model, FSDPModule) else None


def _units(root: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in root.modules() if isinstance(module, FSDPModule)]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif hasattr(value, "values") and callable(value.values):  # a dict, transformers' ModelOutput
        for item in value.values():
            yield from _tensors(item)


class FSDPGuarding:
    """The guard's hooks on one FSDP2 model for one batch (see the module)."""

    def __init__(self, root: nn.Module) -> None:
        self.root: Any = root
        self.units = _units(root)
        self._handles: list[Any] = []
        self._post_backward: list[tuple[Any, Any]] = []
        #: this rank already received a peer's flag in a heartbeat (it must not send another)
        self.stopped = False

    # -- installed for the batch -------------------------------------------------------------

    def __enter__(self) -> FSDPGuarding:
        for unit in self.units:
            self._handles.append(unit.register_forward_pre_hook(self._before_forward, prepend=True))
            self._handles.append(unit.register_forward_hook(self._after_forward, prepend=True))
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                original = group.post_backward
                self._post_backward.append((group, original))
                group.post_backward = self._heartbeat_first(original)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for group, _original in self._post_backward:
            group.__dict__.pop("post_backward", None)
        self._post_backward.clear()
        self.root.set_requires_gradient_sync(True)

    # -- what the splitter calls ---------------------------------------------------------------

    def agree_count(self, count: int) -> int:
        """Micro-batches every rank runs in this attempt: the most any rank needs.

        Why: each micro-batch's forward and backward all-gather on every rank, so a rank
        with fewer samples runs its last micro-batch again with its loss weighted 0 (its
        gradient adds nothing) to keep step with the others.
        """
        return distributed.agree_max(count)

    def before_micro_batch(self, index: int, count: int) -> None:
        """Only the last micro-batch reduce-scatters: the others accumulate locally."""
        self.root.set_requires_gradient_sync(index == count - 1)

    def finish_attempt(self, failed_here: bool) -> None:
        """The attempt's last heartbeat: a rank that ran out of memory sends its flag here,
        and a rank that finished learns of a failure elsewhere here (unless it already did)."""
        if not self.stopped:
            distributed.any_rank(failed_here)
        self.stopped = False

    def discard(self) -> None:
        """Undo a failed attempt: FSDP2's per-iteration state, and the unsharded gradients."""
        self.root.reset_iter_state()
        for unit in self.units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
                    param.unsharded_accumulated_grad = None

    # -- the heartbeats ----------------------------------------------------------------------

    def heartbeat(self) -> None:
        """One all-reduce: when some rank has run out of memory, stop here."""
        if distributed.any_rank(False):
            self.stopped = True
            raise PeerOutOfMemory("memfit guard: another rank ran out of memory; this rank stops at the same point")

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        self.heartbeat()

    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        # Registered before FSDP2's own hooks on the outputs, so in backward this
        # heartbeat comes before the unit's all-gather and its prefetch.
        done = False

        def before_backward(grad: torch.Tensor) -> torch.Tensor:
            nonlocal done
            if not done:
                done = True
                self.heartbeat()
            return grad

        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(before_backward)

    def _heartbeat_first(self, post_backward: Any) -> Any:
        def run(*args: Any) -> Any:
            self.heartbeat()
            return post_backward(*args)

        return run


@contextmanager
def guarding(model: nn.Module) -> Iterator[FSDPGuarding | None]:
    """The guard's hooks on an FSDP2 model for the block; None for any other model."""
    root = fsdp_root(model)
    if root is None or not distributed.is_distributed():
        yield None
        return
    with FSDPGuarding(root) as hooks:
        yield hooks
