"""Run a workload's training steps on fake tensors: shapes and dtypes, no memory, no arithmetic.

Why: the estimator must know what a step allocates on a GPU this machine does not have,
for a model this machine could not hold (Llama 7B in seconds, under 1 GiB of RAM). The
steps are :func:`memfit.run.steps.run_steps`, the same code the simulated GPU runs, under
``torch._subclasses.fake_tensor.FakeTensorMode``; the storages they create are reported
to a :class:`~memfit.memory.devices.SimDevice` without a budget (the same storage tracker,
the same caching-allocator model) that records every allocation and free with its labels
(phase, step, module). The model is built under fake mode (a factory is called inside it;
a module instance is copied to fake tensors), so a 7B model costs no real memory.

What fake tensors cannot do is an error, never a silent under-count: an operation whose
output shape or value depends on the data (``nonzero``, ``.item()`` in forward), or a
custom kernel without a fake/meta implementation, raises :class:`UnsupportedOperation`
naming the operation and the module. The only values read back on purpose are the
loss (``float(loss)`` after backward) and the optimizer's own scalars (GradScaler's
found-inf flag), which do not change what is allocated; they read as 0.

>>> import memfit
>>> run = run_fake_steps(memfit.load_workload("mlp:layers=1,width=16,features=16"), memfit.Settings(micro_batch_size=2))
>>> run.peak_allocated > 0 and run.peak_reserved >= run.peak_allocated
True
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from memfit.cuda.counting import counting
from memfit.cuda.kernels import observing
from memfit.cuda.target import CudaTarget
from memfit.errors import MemfitError
from memfit.estimator.compiled import CompileWatch
from memfit.estimator.timing import OpCounter, OpTrace
from memfit.estimator.transformers_masks import PositionsWatch, watching_positions
from memfit.memory.devices import SimDevice
from memfit.memory.oom import is_oom
from memfit.memory.tracker import Labels, StorageTracker, current_labels
from memfit.run.settings import Settings
from memfit.run.steps import StepRun, run_steps
from memfit.workload import Workload

__all__ = ["run_fake_steps", "FakeRun", "FakeSteps", "Runner", "UnsupportedOperation", "Event"]

#: one recorded allocator event: ("alloc" | "free", handle, nbytes, labels)
Event = tuple[str, int, int, Labels]

#: the most allocator actions a recorded history keeps (the newest): a 7B model's two
#: steps make about 120,000
_HISTORY_ENTRIES = 1_000_000

#: phases whose scalar reads (loss logging, GradScaler's found-inf) do not steer allocation
_SCALAR_READ_PHASES = ("other", "optimizer")

_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class UnsupportedOperation(MemfitError):
    """An operation of the workload cannot run on fake tensors, so memory cannot be estimated."""


@dataclass
class FakeRun:
    """Every allocator event of the fake steps, and the allocator model's peaks.

    ``fits`` is False when the steps ran out of the budget (the events stop there).
    """

    events: list[Event]
    peak_allocated: int
    peak_reserved: int
    fits: bool = True
    #: the operations of the last step, for the predicted step time (``count_ops=True``)
    ops: OpTrace | None = None
    #: the allocator's history as ``torch.cuda.memory._snapshot()`` gives it (``history=True``)
    snapshot: dict[str, Any] | None = None
    #: the rank of N the run is for (:mod:`memfit.estimator.distributed_trace`); 0 on one GPU
    rank: int = 0
    #: what of the workload is torch.compile'd and ran eager (:mod:`memfit.estimator.compiled`); "" if nothing
    compile_note: str = ""
    #: (dotted path, class name) of each module checkpointing recomputed
    checkpointed: list[tuple[str, str]] = dataclasses.field(default_factory=list)


#: runs the fake steps at one settings (its micro-batch) within a budget, counting the last
#: step's operations when asked (for the predicted step time): :class:`FakeSteps` on one
#: GPU, :func:`memfit.estimator.distributed_trace.tracing`'s runner for one rank of N
Runner = Callable[[Settings, int | None, bool], FakeRun]


def unsupported_message(op: str, module: str, error: BaseException) -> str:
    """One line naming the operation, the module and the code that called it, why fake
    tensors cannot run it, and the way around it.

    Called while the operation fails, so the Python stack above is the user's code: the
    innermost frame outside torch and memfit is named (``file:line in function``), and a
    value read by ``torch.distributions``' argument validation (on by default) or a CTC
    loss (its work space sized by the target lengths' values) gets its own way around.
    """
    where = f"module {module!r}" if module else "code outside any module"
    frames = traceback.extract_stack()
    caller = next((f for f in reversed(frames) if not _library_frame(f.filename)), None)
    if caller is not None:
        where += f", called at {os.path.basename(caller.filename)}:{caller.lineno} in {caller.name}"
    if isinstance(error, DynamicOutputShapeException):
        why = "its output shape depends on the data"
    elif isinstance(error, DataDependentOutputException):
        why = "it reads a tensor's value (data-dependent control flow)"
    else:
        why = "it has no fake/meta implementation (a custom kernel?)"
    around = "measure on a device instead (memfit measure / probe)"
    if any(f"{os.sep}torch{os.sep}distributions{os.sep}" in f.filename for f in frames):
        why = "torch.distributions validates its arguments (validate_args, on by default), which reads their values"
        around = (
            "turn validation off for the estimate with torch.distributions.Distribution.set_default_validate_args(False) "
            "(or validate_args=False), or measure on a device (memfit measure / probe)"
        )
    elif "ctc_loss" in op:
        why = "CTC loss has no fake-tensor kernel (its work space is sized by the target lengths' values)"
        around = (
            "measure on a device instead (memfit measure, or memfit probe, whose trials run for real by themselves)"
        )
    return f"cannot estimate: operation {op} in {where} cannot run on fake tensors: {why}; {around}"


def _library_frame(filename: str) -> bool:
    """True for a frame of torch, memfit or Python's own library (not the user's code)."""
    parts = filename.replace("\\", "/").split("/")
    return any(part in ("torch", "memfit", "contextlib.py", "functools.py") for part in parts)


#: how a custom operator without a fake implementation refuses (a plain RuntimeError)
_NO_FAKE_MESSAGES = ("no fake impl registered", "no meta kernel", "does not have a meta", "cannot run on fake tensors")


def is_fake_limit(error: BaseException) -> bool:
    """True when ``error`` says fake tensors cannot run an operation (not the user's bug)."""
    if isinstance(error, _FAKE_LIMITS):
        return True
    return isinstance(error, (RuntimeError, NotImplementedError)) and any(
        text in str(error) for text in _NO_FAKE_MESSAGES
    )


class _FakeStepTracker(StorageTracker):
    """The storage tracker, plus the fake-tensor limits turned into a clear error.

    Why a subclass and not another mode: one dispatch mode less per operation (the fake
    steps of a 7B model run ~58,000 operations), and the tracker is where the operation
    and the current module are both known.
    """

    #: counts each operation's FLOPs and bytes for the predicted step time (None: off)
    counter: OpCounter | None = None

    # torch.tensor(0.0) (an optimizer's step count) is made outside fake mode and lifted to
    # its fake twin: a host tensor in both runs (memory/tracker.py's rule), counted only
    # once it meets a device tensor, as the real run counts it.

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            if not is_fake_limit(error):
                raise
            labels = current_labels()
            if func is torch.ops.aten._local_scalar_dense.default and labels.phase in _SCALAR_READ_PHASES:
                return _zero_like_scalar(args[0])
            message = unsupported_message(str(func), labels.module, error)
        else:
            # CPU scratch work of an emulated CUDA kernel is not timed: the emulation reports
            # the kernel CUDA runs instead (memfit.cuda.kernels, OpCounter.kernel)
            if self.counter is not None and counting():
                self.counter.record(func, args, kwargs, out)
            return out
        raise UnsupportedOperation(message)  # outside the except block: no chained traceback


#: how PyTorch refuses a Tensor subclass made from a fake tensor (``Tensor._make_subclass``,
#: the way bitsandbytes makes its 4-bit and 8-bit weights, Params4bit and Int8Params)
_SUBCLASS_REFUSAL = re.compile(
    r"Creating a new Tensor subclass (\w+) but the raw Tensor object is already associated to a python object of type FakeTensor"
)


def tensor_subclass_message(error: BaseException) -> str | None:
    """One line for a parameter class fake tensors cannot hold (a quantized base model's
    weights), or None when ``error`` is something else.

    Why refuse: the class wraps real storage and quantizes it with its own kernels, so a
    fake copy would count the weights unquantized, or not at all.
    """
    match = _SUBCLASS_REFUSAL.search(str(error)) if isinstance(error, RuntimeError) else None
    if match is None:
        return None
    return (
        f"cannot estimate: the model's {match.group(1)} weights (a Tensor subclass made from real storage, as "
        "bitsandbytes' 4-bit and 8-bit weights are) cannot be made on fake tensors; "
        "measure on a device instead (memfit measure / probe --trials real)"
    )


def _zero_like_scalar(tensor: torch.Tensor) -> float | int | bool:
    if tensor.dtype == torch.bool:
        return False
    return 0.0 if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 0


class _FakeDevice(SimDevice):
    """A simulated GPU (optionally with a budget) recording every event, on fake tensors."""

    def __init__(
        self, budget: int | None = None, cuda: CudaTarget | None = None, counter: OpCounter | None = None
    ) -> None:
        super().__init__(budget, "fake", record=True, cuda=cuda)
        tracker = _FakeStepTracker(self)
        tracker.counter = counter
        self.tracker = tracker

    def describe(self) -> str:
        return "fake tensors (CUDA allocator model, no limit)"


def _use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer use its foreach implementation unless the user chose one.

    Why: on CUDA, PyTorch's optimizers default to foreach (whole-list kernels whose
    temporaries span every parameter); on CPU and on fake tensors they default to the
    per-parameter loop. A GPU target must see CUDA's choice.
    """
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def _fake_workload(
    workload: Workload,
    mode: FakeTensorMode,
    foreach: bool,
    positions: PositionsWatch,
    compiled: CompileWatch | None = None,
) -> Workload:
    """The workload with its model made under fake mode and, for CUDA, foreach optimizers.

    Its batches are shown to ``positions`` (see :mod:`memfit.estimator.transformers_masks`);
    its model and functions to ``compiled`` (what of it is torch.compile'd).
    """
    changes: dict[str, Any] = {}
    compiled = compiled if compiled is not None else CompileWatch()
    compiled.inspect_functions({"loss": workload.loss, "make_batch": workload.make_batch})
    if isinstance(workload.model, nn.Module):
        compiled.inspect_model(workload.model)
        with FakeCopyMode(mode):
            changes["model"] = copy.deepcopy(workload.model)
    else:
        factory = workload.model

        def build() -> nn.Module:
            model = factory()
            if isinstance(model, nn.Module):  # else build_model says what it returned
                compiled.inspect_model(model)
            return model

        changes["model"] = build
    if foreach:  # the factory keeps its form: optimizer(params) or optimizer(model)
        changes["optimizer"] = workload.with_optimizer_hook(_use_foreach).optimizer
    make_batch = workload.make_batch

    def observed_batch(size: int) -> Any:
        batch = make_batch(size)
        positions.observe(batch)
        return batch

    changes["make_batch"] = observed_batch
    return dataclasses.replace(workload, **changes)


@contextlib.contextmanager
def _swappable_parameters(mode: FakeTensorMode) -> Iterator[None]:
    """Let ``Module.to(dtype)`` / ``.half()`` convert a model's fake parameters.

    Why: ``Module._apply`` converts a fake parameter with ``torch.utils.swap_tensors``,
    which refuses a tensor that has a weak reference, and fake mode's converter memo
    keeps one to every fake parameter made by ``nn.Parameter`` (its ``detach()``). A
    factory that changes the model's dtype would fail with "Couldn't swap Linear.weight".
    The memo entries of the two tensors being swapped are dropped first: they map tensors
    this run never converts again.
    """
    original = torch.utils.swap_tensors
    memo = mode.fake_tensor_converter.tensor_memo

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for key, value in list(memo.items()):
            if value is t1 or value is t2:
                del memo[key]
        original(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def run_fake_steps(
    workload: Workload,
    settings: Settings,
    *,
    steps: int = 2,
    foreach: bool = False,
    budget: int | None = None,
    cuda: CudaTarget | None = None,
    count_ops: bool = False,
    history: bool = False,
) -> FakeRun:
    """Run ``steps`` optimizer steps of ``workload`` on fake tensors; return the events.

    ``budget`` caps modeled reserved memory as the simulated GPU does (an OOM there is
    ``fits=False``, not an error). ``foreach=True`` gives optimizers CUDA's default
    implementation (see :func:`_use_foreach`). ``cuda`` is the CUDA GPU whose semantics
    the steps follow (:mod:`memfit.cuda.semantics`); None keeps the CPU's. ``count_ops=True``
    records the last step's operations (:class:`~memfit.estimator.timing.OpCounter`) for the
    predicted step time. ``history=True`` also records the allocator's history for
    PyTorch's memory viewer (:attr:`FakeRun.snapshot`). Raises :class:`UnsupportedOperation`
    for what fake tensors cannot run; any other error propagates unchanged.
    """
    counter = OpCounter(step=steps - 1, micro_batches=settings.accumulation_steps) if count_ops else None
    device = _FakeDevice(budget, cuda, counter)
    if history:
        device.allocator.record_history(max_entries=_HISTORY_ENTRIES)
    # allow_non_fake_inputs: a batch or a constant made outside fake mode is converted
    # (and its storage counted), as it would be copied to the GPU.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fits = True
    refusal = None
    compiled = CompileWatch()
    record = StepRun()
    try:
        observer = observing(counter.kernel) if counter is not None else contextlib.nullcontext()
        with mode, _swappable_parameters(mode), watching_positions() as positions, observer, compiled.watching():
            fake = _fake_workload(workload, mode, foreach, positions, compiled)
            run_steps(fake, settings, device, steps=steps, label_modules=True, record=record)
    except Exception as error:
        refusal = tensor_subclass_message(error)
        if refusal is None and not is_oom(error):
            raise
        fits = False
    finally:
        device.tracker.forget_all()  # nothing of a stopped run lingers in the tracker
    if refusal is not None:
        raise UnsupportedOperation(refusal)  # outside the except block: no chained traceback
    stats = device.memory_stats()
    assert device.events is not None
    return FakeRun(
        events=device.events,
        peak_allocated=stats["allocated_bytes.all.peak"],
        peak_reserved=stats["reserved_bytes.all.peak"],
        fits=fits,
        ops=counter.trace() if counter is not None and fits else None,
        snapshot=device.allocator.snapshot() if history else None,
        compile_note=compiled.note(),
        checkpointed=record.checkpointed,
    )


@dataclass(frozen=True)
class FakeSteps:
    """A :data:`Runner` on one GPU: :func:`run_fake_steps` of ``workload`` at any settings.

    >>> import memfit
    >>> run = FakeSteps(memfit.load_workload("mlp:layers=1,width=16,features=16"))
    >>> run(memfit.Settings(micro_batch_size=2), None, False).fits
    True
    """

    workload: Workload
    steps: int = 2
    foreach: bool = False
    cuda: CudaTarget | None = None

    def __call__(self, settings: Settings, budget: int | None = None, count_ops: bool = False) -> FakeRun:
        return run_fake_steps(
            self.workload,
            settings,
            steps=self.steps,
            foreach=self.foreach,
            budget=budget,
            cuda=self.cuda,
            count_ops=count_ops,
        )
