"""memfit guard: survive an OOM in training by splitting the batch, with the same update.

A run that dies at epoch 3 because one batch held the longest sequences is the most
expensive OOM there is. The guard runs each optimizer step over the whole batch first;
when forward or backward runs out of memory it throws away the batch's partial
gradients, halves the micro-batch and runs the same batch again in micro-batches whose
losses are weighted as the loss reduces (checked once on the user's own loss: by their
share of the samples, by 1 for a sum, by their share of the valid tokens or of ``weight``;
a loss that cannot be split exactly is refused), so the gradient,
and the update, equal the whole batch's. No sample is dropped or counted twice, the
learning-rate schedule and the step count are untouched, and the smaller size stays
for the next steps (``grow_after=K`` tries a larger one again after K clean steps).

Three layers, each usable alone:

- the policy (:class:`SplitPolicy`, :func:`halve`, :func:`grow`): which micro-batch size
  to run, pure arithmetic;
- :class:`Splitter`: run one batch through a ``forward_backward(micro_batch, share)``
  function in micro-batches with OOM recovery, gradients discarded between attempts and,
  under DDP, every rank agreeing and gradients averaged once per step (under FSDP2, ranks
  that stop together and one reduce-scatter: :mod:`memfit.guard.fsdp`). It owns no
  optimizer, so a Lightning or transformers integration can call it from its own loop;
- :class:`Guard`: a training step for a plain loop: the splitter, then ``optimizer.step()``
  (through the ``GradScaler`` if given) and ``zero_grad``.

>>> import torch
>>> from memfit.guard import Guard
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Linear(4, 1)
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> def loss_fn(model, batch):
...     inputs, targets = batch
...     return torch.nn.functional.mse_loss(model(inputs), targets)
>>> guard = Guard(model, optimizer, loss_fn)
>>> loss = guard.step((torch.randn(8, 4), torch.randn(8, 1)))
>>> guard.micro_batch_size, guard.accumulation, guard.events
(None, 1, [])
"""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn

from memfit import distributed
from memfit.errors import MemfitError
from memfit.guard.batching import (
    BatchDim,
    chunk_sizes,
    concat_outputs,
    count_samples,
    output_batch_dim,
    slice_batch,
    split_batch,
    user_chunk_sizes,
)
from memfit.guard.check import SplitCheck, check_split
from memfit.guard.errors import GuardError, NonFiniteGradientError, SplitRefusedError
from memfit.guard.fsdp import FSDPGuarding, PeerOutOfMemory, guarding
from memfit.guard.gradients import (
    add_gradients,
    drop_gradients,
    optimizer_state_tensors,
    set_aside_gradients,
    tensor_bytes,
)
from memfit.guard.policy import SplitPolicy
from memfit.guard.reduction import Weighting, unchecked
from memfit.guard.sequence import LayoutCheck
from memfit.guard.snapshot import BufferSnapshots, RngState, SavedBuffers
from memfit.memory.allocator import round_size, segment_size
from memfit.memory.devices import Device, active_device
from memfit.memory.oom import is_oom, release_cached_memory
from memfit.units import format_size, parse_size

__all__ = ["Splitter", "SplitResult", "OOMEvent", "GuardError", "requested_bytes", "what_did_not_fit"]

ForwardBackward = Callable[[Any, float], "torch.Tensor | float"]
SplitFn = Callable[[Any, int], Sequence[Any]]
WeightFn = Callable[[Any], "float | int | torch.Tensor"]

# An int larger than any micro-batch size or rank: "no OOM here" in a minimum over ranks.
_NONE = 2**62
_WHERE = ("forward", "backward")


# -- what the guard reports --------------------------------------------------------------------


@dataclass(frozen=True)
class OOMEvent:
    """One out-of-memory error the guard recovered from (or gave up on).

    ``where`` is ``forward`` or ``backward`` (on rank ``rank``), or ``predict``;
    ``micro_batch_index`` is the micro-batch that failed on this rank (None when another
    rank failed); ``allocated`` and ``reserved`` are this rank's device memory at the time
    (None when the device does not report memory, such as a plain CPU).
    """

    step: int
    micro_batch_before: int
    micro_batch_after: int | None
    where: str
    rank: int
    micro_batch_index: int | None
    allocated: int | None
    reserved: int | None

    def describe(self) -> str:
        """One line for a log."""
        place = (
            self.where if self.micro_batch_index is None else f"{self.where} of micro-batch {self.micro_batch_index}"
        )
        memory = ""
        if self.allocated is not None and self.reserved is not None:
            memory = f" ({format_size(self.allocated)} allocated, {format_size(self.reserved)} reserved)"
        after = (
            "gave up"
            if self.micro_batch_after is None
            else f"micro-batch {self.micro_batch_before} -> {self.micro_batch_after}"
        )
        return f"memfit guard: out of memory at step {self.step} in {place} on rank {self.rank}{memory}; {after}"


@dataclass(frozen=True)
class SplitResult:
    """What one batch took: its loss, the samples used, and how it was split."""

    loss: float
    samples: int
    micro_batch_size: int
    micro_batches: int
    attempts: int


@dataclass
class _Failure:
    """An OOM caught in an attempt, kept as plain values (no traceback, no tensors)."""

    index: int
    where: str
    allocated: int | None
    reserved: int | None
    requested: int | None = None


@dataclass
class _Attempt:
    loss: float | torch.Tensor = 0.0
    samples: int = 0
    micro_batches: int = 0
    failure: _Failure | None = None


@dataclass
class _Verdict:
    """What every rank agreed after an attempt."""

    failed_size: int | None  # the smallest size that ran out of memory on some rank
    failed_rank: int
    where: str
    grad_anywhere: list[bool] = field(default_factory=list)


# -- small helpers ---------------------------------------------------------------------------


def _where_raised(tb: TracebackType | None) -> str:
    """``backward`` when the error came out of the autograd engine, else ``forward``.

    Why the traceback: a ``forward_backward`` function is one call, but every backward
    pass (``loss.backward()``, ``torch.autograd.backward``/``grad``) goes through
    torch.autograd's engine entry, which stays on the traceback whatever raised inside.
    """
    for frame, _ in traceback.walk_tb(tb):
        code = frame.f_code
        filename = code.co_filename.replace("\\", "/")
        if code.co_name == "_engine_run_backward" or (
            "torch/autograd/" in filename and code.co_name in ("backward", "grad")
        ):
            return "backward"
    return "forward"


_REQUESTED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?\s*[KMGTP]?i?B)")


def requested_bytes(error: BaseException) -> int | None:
    """The bytes an OOM asked for, read from CUDA's message ("Tried to allocate 4.50 MiB"); None if absent.

    >>> requested_bytes(RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 ..."))
    2097152
    """
    found = _REQUESTED.search(str(error))
    if found is None:
        return None
    try:
        return parse_size(found.group(1))
    except MemfitError:
        return None


def what_did_not_fit(capacity: int | None, allocated: int | None, reserved: int | None, requested: int | None) -> str:
    """Why a request failed, in CUDA's allocator's terms: too little free, or segment rounding.

    Why: "18 MiB of model states on a 40 MiB device" reads as if it should fit; what ran
    out is the request at the moment of the OOM, and the allocator's cache around it. A
    request of 1 to 10 MiB needs a whole new 20 MiB segment when no cached block serves
    it, so 18 MiB free is not enough for a 4.5 MiB tensor.

    >>> MiB = 2**20
    >>> print(what_did_not_fit(40 * MiB, 14 * MiB, 22 * MiB, 9 * MiB // 2))
    a request of 4.50 MiB needed a new 20.00 MiB segment (CUDA's allocator rounds requests of 1 to 10 MiB up to 20 MiB segments) with 18.00 MiB free; 8.00 MiB more were reserved but cached in blocks that could not serve it
    """
    if requested is None or capacity is None or reserved is None:
        return ""
    free = max(0, capacity - reserved)
    segment = segment_size(round_size(requested))
    if segment > requested and segment > free >= requested:
        text = (
            f"a request of {format_size(requested)} needed a new {format_size(segment)} segment "
            f"(CUDA's allocator rounds requests of 1 to 10 MiB up to 20 MiB segments) with {format_size(free)} free"
        )
    else:
        text = f"a request of {format_size(requested)} met {format_size(free)} free"
    if allocated is not None and reserved > allocated:
        text += f"; {format_size(reserved - allocated)} more were reserved but cached in blocks that could not serve it"
    return text


def _ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    return model if isinstance(model, nn.parallel.DistributedDataParallel) else None


@contextlib.contextmanager
def _no_collectives_in_forward_backward(model: nn.Module) -> Iterator[None]:
    """Under DDP: accumulate gradients locally and skip the buffer broadcast in forward.

    Why: DDP all-reduces gradients inside backward and broadcasts buffers at the start of
    forward. A rank that runs out of memory mid-batch stops calling them, and the others
    wait forever. With both off, forward and backward are local; the guard agrees and
    synchronises after the attempt.
    """
    ddp = _ddp(model)
    if ddp is None:
        yield
        return
    broadcast = ddp.broadcast_buffers
    ddp.broadcast_buffers = False
    try:
        with ddp.no_sync():
            yield
    finally:
        ddp.broadcast_buffers = broadcast


# -- the splitter: one batch, in micro-batches, with OOM recovery --------------------------


class Splitter:
    """Run batches through ``forward_backward`` in micro-batches, recovering from OOMs.

    ``forward_backward(micro_batch, share)`` must run forward and backward on the
    micro-batch with its loss multiplied by ``share`` before ``backward()``, and return
    the micro-batch's own (unweighted) loss. ``share`` is the micro-batch's weight under
    the loss's reduction, as the check found it (:attr:`weighting`): its fraction of the
    samples, of the valid tokens or of ``weight(batch)`` (shares summing to 1), or 1 for a
    summed loss; so the accumulated gradient is the whole batch's.

    After a successful :meth:`run` the parameters' ``.grad`` hold the whole batch's
    gradient (plus whatever gradient they held before, which an OOM never touches);
    under DDP it is already averaged over the ranks. The caller steps the optimizer.

    ``batch_dim`` says where the samples are (see :mod:`memfit.guard.batching`): 0 by
    default. Sequence-first modules in the model (``nn.LSTM`` and friends with
    ``batch_first=False``) are watched on the first steps: a batch whose samples they
    see along their sequence dimension is refused (:class:`~memfit.guard.sequence.LayoutError`)
    before anything is split. Memory for events and errors is read from ``device``, else
    from the memfit device entered (``with memfit.device(...)``), else from CUDA.

    Before the first split the user's loss is checked (:mod:`memfit.guard.check`, through
    ``forward_backward(part, 1.0)`` on a few samples): ``share`` is then the weight it found
    (``weighting``), and a loss that cannot split exactly is refused
    (:class:`~memfit.guard.errors.SplitRefusedError`) unless ``exact=False``. With
    ``check_finite`` (pass False under a GradScaler), a micro-batch that makes the gradient
    NaN or infinite raises :class:`~memfit.guard.errors.NonFiniteGradientError`. Buffers and
    generators are restored after every failed attempt and when an error escapes.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_dim: BatchDim | None = None,
        split: SplitFn | None = None,
        weight: WeightFn | None = None,
        grow_after: int | None = None,
        micro_batch_size: int | None = None,
        device: Device | None = None,
        logger: logging.Logger | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        on_discard: Callable[[], None] | None = None,
        exact: bool = True,
        check_finite: bool = True,
    ) -> None:
        self.model = model
        self.batch_dim: BatchDim = 0 if batch_dim is None else batch_dim
        self.split = split
        self.weight = weight
        self.layout = LayoutCheck(model, explicit=batch_dim is not None)
        self.policy = SplitPolicy(limit=micro_batch_size, grow_after=grow_after)
        self.predict_policy = SplitPolicy(limit=micro_batch_size)
        self.device = device
        self.logger = logger
        self.optimizer = optimizer
        self.on_discard = on_discard
        self.exact = exact
        self.check_finite = check_finite
        #: how micro-batches are weighted, found by the check before the first split (None: not yet)
        self.weighting: Weighting | None = None
        # Read once, as an optimizer does: walking the module tree every step costs more
        # than everything else the guard does. Frozen parameters simply have no gradient.
        self.params: list[nn.Parameter] = list(model.parameters())
        self.events: list[OOMEvent] = []
        self.steps = 0
        self.last: SplitResult | None = None
        #: FSDP2's heartbeats and local accumulation while a batch runs (None otherwise)
        self._fsdp: FSDPGuarding | None = None
        self._warned_batchnorm = False
        self._buffers = BufferSnapshots(model)
        #: the buffers and generators before the last batch (for :meth:`undo`)
        self._before: tuple[SavedBuffers, RngState] | None = None

    # -- what callers read -------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int | None:
        """The largest micro-batch the next step runs (None: whole batches)."""
        return self.policy.limit

    @property
    def accumulation(self) -> int:
        """Micro-batches the last step ran (1 before the first step)."""
        return self.last.micro_batches if self.last else 1

    # -- one training batch ----------------------------------------------------------------

    def run(self, batch: Any, forward_backward: ForwardBackward) -> SplitResult:
        """Forward and backward over the whole batch, splitting it as often as OOMs demand.

        In a process group every rank must call this for every step (it is a collective).
        """
        samples = self._count(batch)
        params = self.params
        self._broadcast_buffers()
        # What an attempt changes besides the gradients: buffers (BatchNorm's statistics)
        # and the generators. Saved first, restored after a failed attempt and when an
        # error escapes, so a retry (or the caller) starts from the state before the batch.
        saved, rng = self._buffers.take(), RngState()
        self._before = None
        kept = set_aside_gradients(params)
        limit = self.policy.limit
        attempts = 0
        had_oom = False
        finished = False
        try:
            with _no_collectives_in_forward_backward(self.model), guarding(self.model) as fsdp:
                self._fsdp = fsdp
                while True:
                    size = self.policy.size_for(samples)
                    # In a process group every rank checks at the same attempt (the check agrees
                    # on its verdict): a retry, or a preset limit, is the same on every rank,
                    # even where this rank's batch is small enough to run whole.
                    split_somewhere = size < samples or (
                        (attempts > 0 or limit is not None) and distributed.is_distributed()
                    )
                    total_weight = self._prepare_split(batch, samples, forward_backward) if split_somewhere else None
                    attempts += 1
                    attempt = self._attempt(batch, samples, size, total_weight, forward_backward)
                    if fsdp is not None:
                        fsdp.finish_attempt(attempt.failure is not None)
                    verdict = self._agree(attempt.failure, size, params)
                    if verdict.failed_size is None:
                        break
                    had_oom = True
                    self._recover(verdict, attempt.failure, params, kept)
                    del attempt
                    self._buffers.restore(saved)
                    rng.restore()
            self._average_gradients(params, verdict)
            add_gradients(params, kept)
            finished = True
        except SplitRefusedError:
            self.policy.limit = limit  # nothing was split: the next batch starts as this one did
            raise
        finally:
            if not finished:  # an error escapes: leave the gradients, buffers and generators as they were
                drop_gradients(params)
                add_gradients(params, kept)
                self._buffers.restore(saved)
                rng.restore()
        self._buffers.learn(saved)
        self._before = (saved, rng)
        self.last = SplitResult(
            loss=float(attempt.loss),
            samples=attempt.samples,
            micro_batch_size=size,
            micro_batches=attempt.micro_batches,
            attempts=attempts,
        )
        if self.policy.finish_step(samples, had_oom) and self.logger is not None:
            self.logger.info(
                "memfit guard: %d clean steps; trying micro-batch %s",
                self.policy.grow_after,
                self.policy.limit or samples,
            )
        self.steps += 1
        return self.last

    def undo(self) -> None:
        """Put the buffers and generators back as they were before the last :meth:`run`.

        Why: the guard calls it when the optimizer step after a batch fails (or the user's
        ``before_step`` raises), so a caller that catches the error retries from its own
        state; the gradients are the caller's to restore.
        """
        if self._before is not None:
            saved, rng = self._before
            self._buffers.restore(saved)
            rng.restore()
            self._before = None

    def _attempt(
        self, batch: Any, samples: int, size: int, total_weight: float | None, forward_backward: ForwardBackward
    ) -> _Attempt:
        """One pass over the batch at ``size``; stops at the first OOM (returned, not raised)."""
        micro_batches = self._split(batch, samples, size)
        sizes = self._sizes(samples, size)
        attempt = _Attempt(micro_batches=len(micro_batches))
        total: float | torch.Tensor | None = None
        runs = len(micro_batches) if self._fsdp is None else self._fsdp.agree_count(len(micro_batches))
        for index in range(runs):
            padding = index >= len(micro_batches)  # FSDP2: keeping step with a rank that has more
            micro = micro_batches[-1] if padding else micro_batches[index]
            count = 0 if padding else sizes[index]
            share = 0.0 if padding else self._share(micro, count, samples, total_weight)
            if self._fsdp is not None:
                self._fsdp.before_micro_batch(index, runs)
            try:
                with self.layout.expect(sizes[-1] if padding else count):
                    loss = forward_backward(micro, share)
            except PeerOutOfMemory:
                break  # FSDP2: another rank ran out of memory; its verdict comes in the agreement
            except BaseException as error:
                if not is_oom(error):
                    raise
                attempt.failure = self._failure(index, error)
                break  # leave the except block: the traceback holds this micro-batch's tensors
            if padding:
                continue
            if self.check_finite and len(micro_batches) > 1 and self._fsdp is None:  # FSDP2: sharded, collective
                self._refuse_non_finite(index, sizes, samples)
            loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
            weighted = loss if share == 1.0 else loss * share
            total = weighted if total is None else total + weighted
            attempt.samples += count
        attempt.loss = 0.0 if total is None else total
        return attempt

    def _recover(
        self,
        verdict: _Verdict,
        failure: _Failure | None,
        params: list[nn.Parameter],
        kept: list[torch.Tensor | None] | None,
    ) -> None:
        """After an OOM anywhere: free this attempt, give up at size 1, else halve."""
        failed_size = verdict.failed_size
        assert failed_size is not None
        breakdown = self._breakdown(failure, params, kept) if failed_size <= 1 else None
        if self._fsdp is not None:
            self._fsdp.discard()
        drop_gradients(params)
        self._release_memory()
        if self.on_discard is not None:
            self.on_discard()
        after = None if failed_size <= 1 else self.policy.shrink(failed_size)
        self._record(verdict, failure, failed_size, after)
        if breakdown is not None:
            raise GuardError(self._does_not_fit_message(verdict, failure, breakdown), breakdown)

    # -- DDP: agree after each attempt, synchronise once per step ----------------------------

    def _agree(self, failure: _Failure | None, size: int, params: list[nn.Parameter]) -> _Verdict:
        """Every rank learns the same: did some rank run out of memory, where, at which size.

        One all-reduce (a minimum over ranks) per attempt. Under DDP it also carries which
        parameters have a gradient on some rank, so every rank averages the same tensors.
        """
        if not distributed.is_distributed():  # one process: its own verdict, no collective
            if failure is None:
                return _Verdict(None, -1, "")
            return _Verdict(size, distributed.rank(), failure.where)
        me = distributed.rank()
        values = [_NONE, _NONE] if failure is None else [size, me * len(_WHERE) + _WHERE.index(failure.where)]
        syncing = _ddp(self.model) is not None
        if syncing:
            values += [0 if p.grad is not None else 1 for p in params]
        agreed = distributed.agree_min_each(values)
        if agreed[0] == _NONE:
            return _Verdict(None, -1, "", [flag == 0 for flag in agreed[2:]])
        failed_rank, where = divmod(agreed[1], len(_WHERE))
        return _Verdict(agreed[0], failed_rank, _WHERE[where])

    def _average_gradients(self, params: list[nn.Parameter], verdict: _Verdict) -> None:
        """DDP: average every gradient that exists on some rank, in one pass of all-reduces."""
        if _ddp(self.model) is None or not distributed.is_distributed():
            return
        grads = []
        for p, anywhere in zip(params, verdict.grad_anywhere):
            if not anywhere:
                continue  # unused on every rank: stays None, as DDP leaves it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        distributed.average_across_ranks_(grads)

    def _broadcast_buffers(self) -> None:
        """DDP with ``broadcast_buffers``: rank 0's buffers, once per step, before forward."""
        ddp = _ddp(self.model)
        if ddp is None or not ddp.broadcast_buffers or not distributed.is_distributed():
            return
        distributed.broadcast_from_main_(list(ddp.module.buffers()))

    # -- inference ---------------------------------------------------------------------------

    def predict(self, batch: Any, fn: Callable[[Any], Any], *, output_dim: BatchDim | None = None) -> Any:
        """``fn`` over the batch under ``torch.no_grad()``, split on OOM; outputs concatenated.

        Local to each process: no collectives, so one rank may predict alone.

        Args:
            batch: the inputs, split along ``batch_dim`` like a training batch.
            fn: ``fn(micro_batch)`` returns the outputs of a micro-batch.
            output_dim: where the samples are in the outputs (default: ``batch_dim``; for a
                per-element ``batch_dim``, the one dimension its elements share).
        """
        samples = self._count(batch)
        joined_along = output_dim if output_dim is not None else output_batch_dim(self.batch_dim)
        while True:
            size = self.predict_policy.size_for(samples)
            outputs: list[Any] = []
            failure = None
            with torch.no_grad(), _no_collectives_in_forward_backward(self.model):
                micro_batches = self._split(batch, samples, size)
                for index, (micro, count) in enumerate(zip(micro_batches, self._sizes(samples, size))):
                    try:
                        with self.layout.expect(count):
                            outputs.append(fn(micro))
                    except BaseException as error:
                        if not is_oom(error):
                            raise
                        failure = self._failure(index, error)
                        break
            if failure is None:
                return concat_outputs(outputs, joined_along)
            outputs.clear()  # this attempt's outputs go back before the retry
            self._release_memory()
            after = None if size <= 1 else self.predict_policy.shrink(size)
            verdict = _Verdict(size, distributed.rank(), "predict")
            self._record(verdict, failure, size, after)
            if after is None:
                raise GuardError(
                    "out of memory in predict at micro-batch size 1: one sample's forward pass does not fit; "
                    "try bf16 (torch.autocast) or a smaller input"
                )

    # -- the pieces ------------------------------------------------------------------------

    def _count(self, batch: Any) -> int:
        """Samples in the batch; with a custom ``split``, the number of one-sample micro-batches."""
        if self.split is None:
            return count_samples(batch, self.batch_dim)
        try:
            return count_samples(batch, self.batch_dim)
        except MemfitError:
            return len(self.split(batch, 1))

    def _split(self, batch: Any, samples: int, size: int) -> Sequence[Any]:
        if size >= samples:
            return [batch]  # the whole batch, untouched: the no-OOM path costs nothing
        if self.split is None:
            self.layout.before_split(f"batch_dim={self.batch_dim!r}" if self.batch_dim else "dimension 0")
            return split_batch(batch, size, self.batch_dim)
        micro_batches = self.split(batch, size)
        expected = len(chunk_sizes(samples, size))
        if len(micro_batches) != expected:
            raise MemfitError(
                f"split(batch, {size}) returned {len(micro_batches)} micro-batches for {samples} samples; "
                f"it must return {expected} (micro-batches of {size} samples, the last one the rest)"
            )
        return micro_batches

    def _sizes(self, samples: int, size: int) -> list[int]:
        """The micro-batches' sample counts: as equal as can be, or a user's ``split``'s (full ones, then the rest)."""
        return chunk_sizes(samples, size) if self.split is None else user_chunk_sizes(samples, size)

    def _prepare_split(self, batch: Any, samples: int, forward_backward: ForwardBackward) -> float | None:
        """Before the batch is split: the check (once), then the batch's total weight under its weighting."""
        if self.weighting is None:
            self.weighting = self._check(batch, samples, forward_backward)
            if self.on_discard is not None:
                self.on_discard()  # the check's passes leave nothing for the caller to keep
        total = self.weighting.total(batch)
        if total is not None and not total > 0 and self.policy.size_for(samples) < samples:
            raise MemfitError(
                f"{self.weighting.name} of the batch is {total}: it must be positive to weight micro-batches by it"
            )
        return total

    def _check(self, batch: Any, samples: int, forward_backward: ForwardBackward) -> Weighting:
        """Find the weighting on the user's loss (see :mod:`memfit.guard.check`); FSDP2: ``weight`` or samples."""
        if self._fsdp is not None:  # its passes would need every rank's collectives in step
            return unchecked(self.weight)
        if self.split is None:
            self.layout.before_split(f"batch_dim={self.batch_dim!r}" if self.batch_dim else "dimension 0")

        def pieces(m: int) -> tuple[Any, Sequence[Any]]:
            if self.split is not None:
                return self.split(batch, m)[0], self.split(batch, 1)[:m]
            return slice_batch(batch, 0, m, self.batch_dim), [
                slice_batch(batch, j, j + 1, self.batch_dim) for j in range(m)
            ]

        def run(micro: Any, count: int) -> None:
            with self.layout.expect(count):
                forward_backward(micro, 1.0)

        return check_split(
            SplitCheck(
                model=self.model,
                params=self.params,
                batch=batch,
                samples=samples,
                batch_dim=self.batch_dim,
                weight=self.weight,
                exact=self.exact,
                pieces=pieces,
                run=run,
                buffers=self._buffers,
                release=self._release_memory,
                one_does_not_fit=self._one_does_not_fit,
            )
        )

    def _one_does_not_fit(self, error: BaseException) -> GuardError:
        """The error for one sample that does not fit (as after an OOM at micro-batch size 1)."""
        failure = self._failure(0, error)
        verdict = _Verdict(1, distributed.rank(), failure.where)
        breakdown = self._breakdown(failure, self.params, None)
        self._record(verdict, failure, 1, None)
        return GuardError(self._does_not_fit_message(verdict, failure, breakdown), breakdown)

    def _share(self, micro: Any, count: int, samples: int, total_weight: float | None) -> float:
        """The micro-batch's part of the whole batch's loss."""
        if count == samples or self.weighting is None:
            return 1.0
        return self.weighting.share(micro, count, samples, total_weight)

    def _refuse_non_finite(self, index: int, sizes: list[int], samples: int) -> None:
        """Raise when the gradient is NaN or infinite after micro-batch ``index`` (one sync per micro-batch)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
            return
        start = sum(sizes[:index])
        raise NonFiniteGradientError(
            f"memfit guard: micro-batch {index + 1} of {len(sizes)} (samples {start} to {start + sizes[index] - 1} "
            f"of {samples}) made the gradient NaN or infinite at step {self.steps}: the optimizer did not step, "
            "the parameters are unchanged; a loss can be undefined on a part of a batch (std() of few samples), "
            "check it on micro-batches of that size, or free memory instead (bf16, activation checkpointing)"
        )

    def _device(self) -> Device | None:
        """The device given, else the memfit device entered in this thread (``with memfit.device(...)``)."""
        return self.device if self.device is not None else active_device()

    def _memory(self) -> tuple[int | None, int | None]:
        """(allocated, reserved) bytes on the device now, or (None, None) when unknown."""
        stats: dict[str, int] | None = None
        device = self._device()
        if device is not None:
            stats = device.memory_stats()
        else:
            param = next(self.model.parameters(), None)
            if param is not None and param.is_cuda:
                stats = dict(torch.cuda.memory_stats(param.device))
        if not stats:
            return None, None
        return stats.get("allocated_bytes.all.current"), stats.get("reserved_bytes.all.current")

    def _capacity(self) -> int | None:
        device = self._device()
        if device is not None and device.capacity is not None:
            return device.capacity
        param = next(self.model.parameters(), None)
        if param is not None and param.is_cuda:
            return torch.cuda.get_device_properties(param.device).total_memory
        return None

    def _failure(self, index: int, error: BaseException) -> _Failure:
        """The facts of an OOM, read while it is being handled (cheap; nothing is freed here)."""
        allocated, reserved = self._memory()
        return _Failure(
            index=index,
            where=_where_raised(error.__traceback__),
            allocated=allocated,
            reserved=reserved,
            requested=requested_bytes(error),
        )

    def _release_memory(self) -> None:
        """Return the failed attempt's memory: collect cycles, empty the allocator's cache."""
        release_cached_memory()
        device = self._device()
        if device is not None:
            device.empty_cache()

    def _record(self, verdict: _Verdict, failure: _Failure | None, before: int, after: int | None) -> None:
        event = OOMEvent(
            step=self.steps,
            micro_batch_before=before,
            micro_batch_after=after,
            where=verdict.where,
            rank=verdict.failed_rank,
            micro_batch_index=None if failure is None else failure.index,
            allocated=None if failure is None else failure.allocated,
            reserved=None if failure is None else failure.reserved,
        )
        self.events.append(event)
        if self.logger is not None:
            self.logger.warning(event.describe())

    def _breakdown(
        self, failure: _Failure | None, params: list[nn.Parameter], kept: list[torch.Tensor | None] | None
    ) -> dict[str, int | None]:
        """Bytes by category at the OOM: what one sample has to share the device with."""
        gradients = [p.grad for p in params if p.grad is not None] + [g for g in kept or [] if g is not None]
        parts: dict[str, int | None] = {
            "capacity": self._capacity(),
            "allocated": None if failure is None else failure.allocated,
            "reserved": None if failure is None else failure.reserved,
            "parameters": tensor_bytes(list(self.model.parameters())),
            "gradients": tensor_bytes(gradients),
            "optimizer_state": tensor_bytes(list(optimizer_state_tensors(self.optimizer))),
        }
        parts["requested"] = None if failure is None else failure.requested
        allocated = parts["allocated"]
        states = sum(int(parts[k] or 0) for k in ("parameters", "gradients", "optimizer_state"))
        parts["activations_and_temporaries"] = None if allocated is None else max(0, allocated - states)
        return parts

    def _does_not_fit_message(self, verdict: _Verdict, failure: _Failure | None, parts: dict[str, int | None]) -> str:
        if failure is None:
            return (
                f"out of memory at micro-batch size 1 on rank {verdict.failed_rank} (in {verdict.where}): "
                "one sample does not fit there; its error has the memory breakdown"
            )
        names = {"activations_and_temporaries": "the activations and temporaries of one sample"}
        sizes = ", ".join(
            f"{names.get(name, name.replace('_', ' '))} {format_size(value)}"
            for name in ("parameters", "gradients", "optimizer_state", "activations_and_temporaries")
            if (value := parts[name]) is not None
        )
        capacity = f" of {format_size(parts['capacity'])}" if parts["capacity"] else ""
        allocated = f"{format_size(parts['allocated'])}{capacity} allocated: " if parts["allocated"] is not None else ""
        cause = what_did_not_fit(parts["capacity"], parts["allocated"], parts["reserved"], parts["requested"])
        return (
            f"out of memory at micro-batch size 1 (in {failure.where}): one sample does not fit; "
            f"at the OOM {allocated}{sizes}" + (f"; {cause}" if cause else "") + "; "
            "try bf16, activation checkpointing, a shorter input or a smaller model"
        )
