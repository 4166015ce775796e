"""One rank of N, traced on one CPU: DDP, ZeRO-1, FSDP2 and HSDP on a fake process group.

Why trace rather than divide: what a rank holds under FSDP2 is more than a share of the
states. Each unit's full parameters are gathered for its forward and again for its
backward (with ``reshard_after_forward=False`` they stay from one to the other), the
all-gather and reduce-scatter buffers come and go around them, and DDP keeps its own
flat gradient buckets. Formulas leave all of that out. So the estimator runs the
workload's real training step (:func:`memfit.run.steps.run_steps`, wrapped by
:mod:`memfit.run.parallel` exactly as a real run is) as rank ``r`` of ``N``:

- a **fake process group** of N ranks (PyTorch's ``"fake"`` backend, from
  ``torch.testing._internal.distributed.fake_pg``): every collective returns at once and
  moves nothing, so one process plays one rank;
- **fake tensors** (``FakeTensorMode``): shapes, no memory, no arithmetic;
- the same **storage tracker and caching-allocator model** as every estimate, so the
  per-rank peak allocated and reserved bytes mean what they mean on one GPU.

The device mesh is built outside fake mode (:func:`memfit.run.parallel.device_mesh`).
While tracing, FSDP2's all-gather, its copy-out into the unit's full parameters and its
reduce-scatter are labelled (``Labels.role``), so the breakdown names communication
buffers and unsharded parameters.

Which rank: every rank holds the same under DDP; under FSDP2 rank 0 holds the largest
shards (``torch.chunk`` gives the first ranks the larger pieces); under ZeRO-1
(``ZeroRedundancyOptimizer``) the ranks hold different parameters' optimizer state, and
the rank holding the most state is not always the one that peaks highest: the caching
allocator keeps small tensors (under 1 MiB) and large ones in separate pools, so a rank
whose state is many small tensors (biases, norms) can fill the small pool's segments
that the next step's activations then need again, and reserve more than a rank holding
one large state tensor (GPT-2 in bf16 on 2 ranks: rank 1 holds less state and peaks 4 MiB
higher, in the second step's forward). The same holds under FSDP2 for the last ranks'
shorter shards (an MLP on 4 ranks, ``reshard_after_forward=False``: rank 3 reserves a
2 MiB segment more than rank 0). So every rank keeping a distinct set of tensors is
traced (:func:`candidate_ranks`: one rank for each, ranks keeping the same shapes in the
same order trace alike) and the estimate is the largest over them, naming its rank.

The process state: the fake group is torch.distributed's *default* group, global to the
process. A process already in a real process group (under torchrun, inside a Lightning
DDP job) must keep its own: there the trace runs in a child process
(``python -m memfit.estimator.distributed_trace``), which needs a workload it can load
again by reference. The group made here is destroyed in ``finally`` whatever happens.

>>> import memfit
>>> run = trace(memfit.load_workload("mlp:layers=2,width=16,features=16"),
...             memfit.Settings(micro_batch_size=2, world_size=4, shard="full"))
>>> run.peak_allocated > 0
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from memfit._io import write_atomically
from memfit.cuda.target import CudaTarget
from memfit.errors import MemfitError
from memfit.estimator.fake import FakeRun, FakeSteps, Runner
from memfit.memory.tracker import labelled
from memfit.run.parallel import COMMUNICATION, UNSHARDED, fake_process_group
from memfit.run.settings import Settings
from memfit.run.strategy import FSDP_SHARDS, OFFLOAD_SHARDS
from memfit.workload import Workload, load_workload

__all__ = [
    "trace",
    "tracing",
    "heaviest_rank",
    "candidate_ranks",
    "unavailable_reason",
    "run_in_child",
    "TraceUnavailable",
]

#: seconds a child process may take to trace (a 7B model takes well under a minute)
CHILD_TIMEOUT_S = 600


class TraceUnavailable(MemfitError):
    """The strategy cannot be traced here (the estimator falls back to formulas, and says why)."""


def unavailable_reason(settings: Settings) -> str | None:
    """Why ``settings``' strategy cannot be traced in this PyTorch, or None when it can."""
    if settings.world_size <= 1 and settings.shard not in OFFLOAD_SHARDS:
        return None
    if not dist.is_available():
        return "this PyTorch build has no torch.distributed"
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    except ImportError:
        return "this PyTorch has no fake process group (torch.testing._internal.distributed.fake_pg)"
    if settings.shard in FSDP_SHARDS:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return "this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)"
    return None


@contextlib.contextmanager
def _fake_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """:func:`memfit.run.parallel.fake_process_group`, refused as :class:`TraceUnavailable`."""
    if dist.is_initialized():
        raise TraceUnavailable("this process is already in a process group")
    with fake_process_group(world_size, rank):
        yield


@contextlib.contextmanager
def fsdp_labels() -> Iterator[None]:
    """Label FSDP2's own memory while tracing: all-gather and reduce-scatter buffers, and the
    full parameters of a unit. Restored in ``finally``."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        yield
        return
    roles = {"unshard": COMMUNICATION, "wait_for_unshard": UNSHARDED, "post_backward": COMMUNICATION}
    originals = {name: getattr(FSDPParamGroup, name) for name in roles}

    def labelling(method: Callable[..., Any], role: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            with labelled(role=role):
                return method(*args, **kwargs)

        return run

    for name, role in roles.items():
        setattr(FSDPParamGroup, name, labelling(originals[name], role))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(FSDPParamGroup, name, method)


class _LazyChunks(list):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n``, each view made
    only when asked for.

    Why: FSDP2 chunks every parameter into one view per rank and keeps one; on fake
    tensors each view costs a fake tensor, and at 64 ranks the 63 unused views of every
    parameter were a quarter of a 7B trace. The views asked for are the same
    (``narrow`` over ``torch.chunk``'s sizes), so nothing allocated changes.
    """

    def __init__(self, tensor: Any, num_chunks: int, dim: int) -> None:
        length = tensor.size(dim)
        step = -(-length // num_chunks) if length else 0
        count = -(-length // step) if step else 0
        self._spans = [(i * step, min(step, length - i * step)) for i in range(count)]
        self._tensor, self._dim = tensor, dim
        super().__init__([None] * num_chunks)

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, int):
            return [self[i] for i in range(len(self))[index]]
        index = index % len(self)
        value = super().__getitem__(index)
        if value is None:
            if index < len(self._spans):
                start, size = self._spans[index]
                value = self._tensor.narrow(self._dim, start, size)
            else:
                value = self[0].new_empty(0)
            super().__setitem__(index, value)
        return value

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))


@contextlib.contextmanager
def lazy_fsdp_chunks() -> Iterator[None]:
    """While tracing, FSDP2 makes only the parameter chunks it uses (see :class:`_LazyChunks`)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = _LazyChunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


def heaviest_rank(workload: Workload, settings: Settings) -> int:
    """The rank holding the most parameter bytes: under ZeRO-1 the one with the most
    optimizer state, under FSDP2 rank 0 (``torch.chunk`` gives the first ranks the larger
    shards), under DDP any (all equal): 0.

    Not always the rank whose memory peaks highest (see the module's text): an estimate
    traces every :func:`candidate_ranks` rank; this one is the first of them.
    """
    return candidate_ranks(workload, settings)[0]


def candidate_ranks(workload: Workload, settings: Settings) -> list[int]:
    """The ranks to trace so that the largest of their traces is the largest of all ranks.

    One rank for each distinct set of tensors a rank keeps (the lowest rank keeping it),
    the one holding the most parameter bytes first:

    - DDP: ``[0]``, every rank holds the same;
    - ZeRO-1: one rank per distinct partition of ``ZeroRedundancyOptimizer`` (asked
      itself, on fake parameters): the ranks run the same model and collectives (which
      allocate nothing on the fake process group) and differ in the optimizer state they
      keep and their local optimizer's step over their own parameters, in order;
    - FSDP2 and HSDP: one rank per distinct list of shard shapes (``torch.chunk`` of every
      parameter's first dimension over the shard group; a rank's place in that group is
      ``rank % group size``): the last ranks' shorter or empty shards make smaller
      optimizer states, which the allocator may place worse.

    Ranks keeping tensors of the same shapes and dtypes in the same order allocate the
    same sizes in the same order, so their traces are the same.
    """
    if settings.world_size <= 1 or settings.shard == "none":
        return [0]
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.estimator.fake import _fake_workload
    from memfit.estimator.transformers_masks import watching_positions
    from memfit.run.parallel import wrap_optimizer

    kept: list[tuple[Any, ...]]  # per rank, the shapes and dtypes it keeps
    loads: list[int]  # per rank, the parameter bytes it keeps
    with _fake_group(settings.world_size):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            with watching_positions() as positions:
                model = _fake_workload(workload, mode, False, positions).build_model()
            if settings.shard == "optimizer":
                zero: Any = wrap_optimizer(workload.make_optimizer(model))
                partitions = [
                    [p for group in groups for p in group["params"]] for groups in zero._partition_parameters()
                ]
                kept = [tuple((tuple(p.shape), p.dtype) for p in params) for params in partitions]
                loads = [sum(p.numel() * p.element_size() for p in params) for params in partitions]
                del zero
            else:
                group = settings.shard_group_size or settings.world_size
                shapes = [(tuple(p.shape) or (1,), p.dtype, p.element_size()) for p in model.parameters()]
                kept, loads = [], []
                for rank in range(group):  # rank r of the first replica holds shard r of each
                    mine = [((_chunk(shape[0], group, rank), *shape[1:]), dtype, size) for shape, dtype, size in shapes]
                    kept.append(tuple((shape, dtype) for shape, dtype, _ in mine))
                    loads.append(sum(size * _numel(shape) for shape, _, size in mine))
            del model
    first: dict[tuple[Any, ...], int] = {}
    for rank, tensors in enumerate(kept):
        first.setdefault(tensors, rank)
    return sorted(first.values(), key=lambda r: (-loads[r], r))


def _chunk(length: int, chunks: int, index: int) -> int:
    """The length of ``torch.chunk``'s piece ``index`` (0 past the last piece), as FSDP2 shards.

    >>> [_chunk(10, 4, i) for i in range(4)], [_chunk(3, 4, i) for i in range(4)]
    ([3, 3, 3, 1], [1, 1, 1, 0])
    """
    step = -(-length // chunks)
    return max(0, min(step, length - index * step))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _heaviest(runs: list[FakeRun]) -> FakeRun:
    """The run that does not fit, or else the highest peak reserved (then allocated), the
    earlier candidate on a tie."""
    for run in runs:
        if not run.fits:
            return run
    return max(runs, key=lambda r: (r.peak_reserved, r.peak_allocated))


class _RankTracer:
    """The :data:`~memfit.estimator.fake.Runner` of :func:`tracing`: each candidate rank's
    fake steps, in its own fake process group unless one group is held for the only one."""

    def __init__(self, steps: FakeSteps, world_size: int, ranks: list[int], group_held: bool) -> None:
        self._steps, self._world, self._ranks, self._group_held = steps, world_size, ranks, group_held

    def __call__(self, settings: Settings, budget: int | None = None, count_ops: bool = False) -> FakeRun:
        heaviest: FakeRun | None = None
        for candidate in self._ranks:
            group = contextlib.nullcontext() if self._group_held else _fake_group(self._world, candidate)
            with group:
                one = dataclasses.replace(self._steps(settings, budget, count_ops), rank=candidate)
            # only the heaviest so far is kept: each run holds every event of its steps
            heaviest = one if heaviest is None else _heaviest([heaviest, one])
            if not one.fits:
                break
        assert heaviest is not None
        return heaviest


@contextlib.contextmanager
def tracing(
    workload: Workload,
    settings: Settings,
    *,
    rank: int | None = None,
    steps: int = 2,
    foreach: bool = False,
    cuda: CudaTarget | None = None,
) -> Iterator[Runner]:
    """Hold one rank of a fake process group of ``settings.world_size`` (> 1) for several traces.

    Yields a runner: ``run(settings, budget, count_ops)`` traces ``steps`` optimizer steps
    at ``settings``' micro-batch, following ``cuda``'s semantics (see
    :func:`memfit.estimator.fake.run_fake_steps`), and returns a
    :class:`~memfit.estimator.fake.FakeRun` naming the rank it is for. With ``rank`` given,
    that rank is traced; by default every rank of :func:`candidate_ranks` is (one under
    DDP), each in its own fake process group, and the run returned is the heaviest (or the
    first that does not fit within ``budget``: the others need not run). Why one group for
    several traces: the batch-size search traces the same strategy at several batch sizes,
    and DTensor's sharding decisions, cached per device mesh, then carry over from one
    trace to the next (with one candidate, as FSDP2 has where every shard has the same
    shape).

    Raises:
        TraceUnavailable: tracing cannot run here (see :func:`unavailable_reason`), or
            this process is already in a process group.
    """
    if settings.world_size <= 1 and settings.shard not in OFFLOAD_SHARDS:
        raise ValueError("tracing is for several ranks: one GPU's steps are memfit.estimator.fake.FakeSteps")
    reason = unavailable_reason(settings)
    if reason is not None:
        raise TraceUnavailable(reason)
    world = settings.world_size
    ranks = candidate_ranks(workload, settings) if rank is None else [rank]
    runner = _RankTracer(FakeSteps(workload, steps, foreach, cuda), world, ranks, group_held=len(ranks) == 1)
    with contextlib.ExitStack() as held:
        if len(ranks) == 1:
            held.enter_context(_fake_group(world, ranks[0]))
        held.enter_context(fsdp_labels())
        held.enter_context(lazy_fsdp_chunks())
        yield runner


def trace(
    workload: Workload,
    settings: Settings,
    *,
    rank: int | None = None,
    steps: int = 2,
    foreach: bool = False,
    budget: int | None = None,
    cuda: CudaTarget | None = None,
) -> FakeRun:
    """Run ``steps`` optimizer steps as one rank of ``settings.world_size`` on fake tensors.

    The same as :func:`memfit.estimator.fake.run_fake_steps` (whose arguments these are),
    on a fake process group, as rank ``rank`` (default: the heaviest of
    :func:`candidate_ranks`; the result's ``rank`` names it); with ``world_size=1`` it is
    that function. In a process already in a process group, the trace runs in a child
    process. ``cuda`` matters for a comparison: a simulated GPU (``sim:SIZE``) follows
    ``CudaTarget()``'s semantics, and a trace without ``cuda`` counts what the CPU's
    kernels keep (attention, autocast casts), not CUDA's.

    Raises:
        TraceUnavailable: tracing cannot run here (no torch.distributed, or a workload
            the child process cannot load).
    """
    if settings.world_size <= 1:
        return FakeSteps(workload, steps, foreach, cuda)(settings, budget, False)
    if dist.is_initialized():
        return _trace_in_child(workload, settings, rank=rank, steps=steps, foreach=foreach, budget=budget, cuda=cuda)
    with tracing(workload, settings, rank=rank, steps=steps, foreach=foreach, cuda=cuda) as run:
        return run(settings, budget, False)


# -- in a child process, when this one is in a real process group ------------------------------

#: environment variables of a launcher that would make the child join the parent's job
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _trace_in_child(
    workload: Workload,
    settings: Settings,
    *,
    rank: int | None,
    steps: int,
    foreach: bool,
    budget: int | None,
    cuda: CudaTarget | None,
) -> FakeRun:
    request = {
        "workload": child_reference(workload),
        "settings": settings.to_dict(),
        "rank": rank,
        "steps": steps,
        "foreach": foreach,
        "budget": budget,
        "cuda": cuda,
    }
    run: FakeRun = run_in_child("memfit.estimator.distributed_trace", request, f"tracing {settings.world_size} ranks")
    return run


#: why a process in a process group cannot trace a model instance (or a Workload made in code)
CHILD_CANNOT_LOAD = (
    "this process is in a process group and the workload is a model instance or made in "
    "code, which a separate process cannot load"
)


def child_reference(workload: Workload) -> str:
    """The reference a child process loads ``workload`` by; refused for a model instance."""
    if not workload.builds_fresh_models or workload.reference is None:
        raise TraceUnavailable(CHILD_CANNOT_LOAD)
    return workload.reference


def load_in_child(reference: str) -> Workload:
    """The workload in the child process (:class:`TraceUnavailable` when it cannot be loaded)."""
    try:
        return load_workload(reference)
    except MemfitError as error:
        raise TraceUnavailable(f"a separate process cannot load workload {reference!r} ({error})") from None


def run_in_child(module: str, request: Any, what: str) -> Any:
    """Run ``python -m module`` on ``request`` in a fresh process (no process group) and
    return its answer (see :func:`serve_child`).

    Why: a process in a real process group cannot also be rank ``r`` of a fake one.
    The child gets this environment less the launcher's variables, so it joins nothing.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC")}
    with tempfile.TemporaryDirectory(prefix="memfit-trace-") as folder:
        out = os.path.join(folder, "answer.pickle")
        done = subprocess.run(
            [sys.executable, "-m", module, out],
            input=pickle.dumps(request),
            capture_output=True,
            env=env,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exit status {done.returncode}"
        if done.returncode == _UNAVAILABLE:
            raise TraceUnavailable(last)
        if done.returncode == _USER_ERROR:
            raise MemfitError(last)
        if done.returncode != 0:
            raise MemfitError(f"{what} in a separate process failed: {last}")
        with open(out, "rb") as answer:
            return pickle.load(answer)


_UNAVAILABLE = 3
_USER_ERROR = 4


def serve_child(handler: Callable[[Any], Any]) -> int:
    """The child's side of :func:`run_in_child`: answer the request on stdin into ``argv[1]``."""
    request = pickle.loads(sys.stdin.buffer.read())
    try:
        answer = handler(request)
    except TraceUnavailable as error:
        print(error, file=sys.stderr)
        return _UNAVAILABLE
    except MemfitError as error:
        print(error, file=sys.stderr)
        return _USER_ERROR
    write_atomically(sys.argv[1], pickle.dumps(answer))
    return 0


def _answer_trace(request: dict[str, Any]) -> FakeRun:
    return trace(
        load_in_child(request["workload"]),
        Settings(**request["settings"]),
        rank=request["rank"],
        steps=request["steps"],
        foreach=request["foreach"],
        budget=request["budget"],
        cuda=request["cuda"],
    )


if __name__ == "__main__":
    sys.exit(serve_child(_answer_trace))
