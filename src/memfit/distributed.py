"""Rank agreement: make every process of a torch.distributed job decide the same thing.

Why: when ranks decide alone (one rank runs out of memory, the others do not), they call
different collectives and the job hangs. Each helper here is one all-reduce that every
rank must call at the same point; without an initialized process group they answer
for this process alone, so single-GPU code needs no special case.

It also joins the process group torchrun describes (:func:`process_group`), so every
memfit command and function works the same way on every rank.

No hang: each of memfit's collectives waits at most :func:`collective_timeout` seconds
(``MEMFIT_COLLECTIVE_TIMEOUT``, default 600) for every rank, then raises
:class:`~memfit.errors.RankTimeoutError` naming the rank that did not come: frozen in its
own code, or dead. To name it, each rank notes in the job's store (torchrun's rendezvous)
how many of memfit's collectives it has entered; the ranks behind are the ones missing.

>>> agree_min(42)   # no process group: this process's own value
42
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from memfit.errors import MemfitError, RankTimeoutError

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "TIMEOUT_VARIABLE",
    "collective_timeout",
    "launched_by_torchrun",
    "check_environment",
    "process_group",
    "output_on_main_only",
    "is_distributed",
    "rank",
    "world_size",
    "is_main_process",
    "agree_min",
    "agree_max",
    "any_rank",
    "agree_min_each",
    "average_across_ranks_",
    "average_gradients_",
    "broadcast_from_main_",
]


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment describes a job of several processes (torchrun's variables).

    >>> launched_by_torchrun({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    True
    >>> launched_by_torchrun({"WORLD_SIZE": "1"})
    False
    """
    env = os.environ if environ is None else environ
    needed = ("RANK", "MASTER_ADDR", "MASTER_PORT")
    return _whole(env, "WORLD_SIZE", 1, _MOST_RANKS) > 1 and all(name in env for name in needed)


#: the most ranks a job of torchrun's can have, as memfit reads its variables
_MOST_RANKS = 2**20


def _whole(env: Mapping[str, str], name: str, low: int, high: int, default: str = "1") -> int:
    """The whole number in variable ``name``; a one-line MemfitError for anything else (``two``, ``-1``)."""
    text = env.get(name, default).strip()
    if not text.isdigit() or len(text) > 12 or not low <= int(text) <= high:
        raise MemfitError(
            f"{name}={text[:40]!r}: must be a whole number from {low} to {high}, as torchrun sets it; "
            "check the job's environment"
        )
    return int(text)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse, in one line, torchrun variables no launcher sets: ``WORLD_SIZE=two``, ``RANK=abc``,
    a rank past the world size, a port past 65535.

    Args:
        environ: the variables (default: this process's).

    >>> check_environment({"WORLD_SIZE": "2", "RANK": "abc"})
    Traceback (most recent call last):
    memfit.errors.MemfitError: RANK='abc': must be a whole number from 0 to 1, as torchrun sets it; check the job's environment
    """
    env = os.environ if environ is None else environ
    world = _whole(env, "WORLD_SIZE", 1, _MOST_RANKS)
    for name in ("RANK", "LOCAL_RANK"):
        if name in env:
            _whole(env, name, 0, world - 1, "0")
    if "MASTER_PORT" in env:
        _whole(env, "MASTER_PORT", 1, 65535)
    collective_timeout()


#: seconds memfit waits at one of its collectives for every rank: long enough for the
#: slowest rank's trial (a probe trial runs two optimizer steps), short of NCCL's 10 minutes
#: plus the 30 of gloo's default by which a frozen job would otherwise be noticed
DEFAULT_COLLECTIVE_TIMEOUT = 600.0
#: the environment variable that sets it (seconds), for every rank alike
TIMEOUT_VARIABLE = "MEMFIT_COLLECTIVE_TIMEOUT"
#: extra seconds an NCCL group memfit makes gives its own watchdog, so memfit's wait ends
#: first, with its one line, rather than the watchdog's abort
_NCCL_MARGIN = 60.0


class _State:
    """This process's view of memfit's collectives."""

    def __init__(self) -> None:
        self.timeout: float | None = None  # set by process_group(timeout=...)
        self.entered = 0  # memfit collectives this rank has entered
        self.own_gloo_group = False  # the group was made by process_group() with gloo's timeout
        self.broken = False  # a collective failed: the group can no longer agree on anything


_state = _State()


def collective_timeout(seconds: float | None = None) -> float:
    """The seconds memfit waits at a collective: ``seconds``, else the one
    :func:`process_group` was given, else ``MEMFIT_COLLECTIVE_TIMEOUT``, else 600.

    >>> collective_timeout(30)
    30.0
    >>> collective_timeout()
    600.0
    """
    if seconds is None:
        seconds = _state.timeout
    if seconds is None:
        text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
        if not text:
            return DEFAULT_COLLECTIVE_TIMEOUT
        try:
            seconds = float(text)
        except ValueError:
            raise MemfitError(f"{TIMEOUT_VARIABLE}={text!r}: give a number of seconds, such as 600") from None
        where = f"{TIMEOUT_VARIABLE}={text!r}"
    else:
        where = f"collective timeout {seconds!r}"
    if isinstance(seconds, bool) or not _LEAST_TIMEOUT <= seconds <= _MOST_TIMEOUT:
        raise MemfitError(
            f"{where}: must be a number of seconds from {_LEAST_TIMEOUT:g} to {_MOST_TIMEOUT:g} (a week), such as 600"
        )
    return float(seconds)


#: the shortest wait memfit accepts: a rank's first trial alone takes longer (1e-9 s failed every job)
_LEAST_TIMEOUT = 1.0
#: the longest: a week (timedelta overflows long before 1e300 s)
_MOST_TIMEOUT = 7 * 24 * 3600.0


@contextlib.contextmanager
def process_group(backend: str | None = None, *, timeout: float | None = None) -> Iterator[bool]:
    """Join the process group torchrun describes for the duration; yield True when distributed.

    Why leave it afterwards: a group this made is this block's; one that already
    existed (the user's, Lightning's) is used as it is and left alone.

    Args:
        backend: "nccl" or "gloo" (default: nccl with a GPU, gloo without).
        timeout: seconds memfit's collectives wait for every rank (default:
            ``MEMFIT_COLLECTIVE_TIMEOUT``, else 600); a rank that does not come within it
            ends the others with a :class:`~memfit.errors.RankTimeoutError` naming it.
    """
    seconds = collective_timeout(timeout)
    previous = _state.timeout
    _state.timeout = seconds if timeout is not None else previous
    try:
        if not launched_by_torchrun() or not dist.is_available() or dist.is_initialized():
            yield dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            return
        check_environment()
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # gloo's own timeout is memfit's: a collective that times out fails cleanly, and the
        # group can then be destroyed without waiting for it
        margin = _NCCL_MARGIN if chosen == "nccl" else 0.0
        _join(chosen, seconds, margin)
        _state.entered, _state.broken, _state.own_gloo_group = 0, False, chosen == "gloo"
        finished = False
        try:
            yield True
            finished = True
        finally:
            _leave(orderly=finished and not _state.broken)
    finally:
        _state.timeout = previous


def _join(backend: str, seconds: float, margin: float) -> None:
    """Join torchrun's job through a store memfit makes, so a rank that never comes is named.

    Why not ``init_process_group``'s own rendezvous: rank 0 then waits for the others and
    ends in torch's DistStoreError traceback ("1/2 clients joined"), not naming who is
    missing; a rank that cannot reach the master ends in DistNetworkError's. Here each rank
    notes itself in the store (``memfit/joined/RANK``), so the one line names the ranks
    that never joined, or the address that could not be reached.
    """
    me, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # checked by check_environment
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    wait = datetime.timedelta(seconds=seconds)
    # torchrun's agent already serves the store on MASTER_PORT: every rank is then its client
    master = me == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    if not master:
        _reach(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), me, seconds)
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, master, wait, wait_for_workers=False
        )
        store.set(f"memfit/joined/{me}", "1")
    except RuntimeError as error:  # DistNetworkError, DistStoreError: both RuntimeErrors
        reason = " ".join(str(error).split())[:160]
        raise RankTimeoutError(
            f"rank {me} could not reach the job's master at {address} within {seconds:g} s ({reason}); "
            f"check MASTER_ADDR and MASTER_PORT, and that rank 0 started"
        ) from None
    _wait_for_ranks(store, me, world, seconds, address)
    try:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=me,
            world_size=world,
            timeout=datetime.timedelta(seconds=seconds + margin),
        )
    except RuntimeError:
        raise RankTimeoutError(_missing(store, me, world, seconds, address)) from None


def _reach(host: str, port: int, me: int, seconds: float) -> None:
    """Wait until the master's store accepts a connection, or refuse in one line naming the address.

    Why a plain socket first: torch's client logs each failed try with a C++ stack of forty
    lines before it gives up; rank 0 not started yet is the common case, so keep trying.
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                reason = error.strerror or type(error).__name__
                raise RankTimeoutError(
                    f"rank {me} could not reach the job's master at {host}:{port} within {seconds:g} s ({reason}): "
                    "check MASTER_ADDR and MASTER_PORT, and that rank 0 started"
                ) from None
        time.sleep(0.1)


def _joined(store: Any, world: int) -> list[int]:
    """The ranks not yet noted in the store (all of them when the store is gone)."""
    missing = []
    for other in range(world):
        try:
            if not store.check([f"memfit/joined/{other}"]):
                missing.append(other)
        except Exception:  # noqa: BLE001 - the store's host ended: nobody can be seen
            return list(range(world))
    return missing


def _missing(store: Any, me: int, world: int, seconds: float, address: str) -> str:
    missing = [rank for rank in _joined(store, world) if rank != me]
    who = (
        f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}" if missing else "a rank"
    )
    return (
        f"{who} did not join the job at {address} within {seconds:g} s (rank {me} waited): it never started, "
        f"or ended before joining; {TIMEOUT_VARIABLE}=SECONDS sets the wait"
    )


def _wait_for_ranks(store: Any, me: int, world: int, seconds: float, address: str) -> None:
    """Wait until every rank noted itself in the store, answering Ctrl-C meanwhile; else name the missing."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while _joined(store, world):
        if time.monotonic() > deadline:
            raise RankTimeoutError(_missing(store, me, world, seconds, address))
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _leave(orderly: bool) -> None:
    """Destroy the group memfit made; in order when every rank got here.

    Why in order: rank 0 holds the job's store; if it left while another rank was still
    tearing its group down, that rank could be cut off mid-way (the rare
    "terminate called without an active exception" at exit). So every rank first meets the
    others, then ranks other than 0 leave and say so in the store, and rank 0 leaves last.
    After a failure (a rank missing, an interrupt) nobody waits for anybody.
    """
    store = _store()
    me = dist.get_rank()
    try:
        if orderly:
            with contextlib.suppress(RankTimeoutError):
                agree_max(0)  # everyone is here: no collective of anyone's is still running
    finally:
        orderly = orderly and not _state.broken
        if orderly and me == 0 and store is not None:
            others = [f"memfit/left/{rank}" for rank in range(1, dist.get_world_size())]
            with contextlib.suppress(Exception):  # a rank that died: leave anyway
                # the others only destroy their group now: seconds, so no need for the full timeout
                store.wait(others, datetime.timedelta(seconds=min(collective_timeout(), _LEAVE_WAIT)))
        dist.destroy_process_group()
        _state.own_gloo_group = False
        if orderly and me != 0 and store is not None:
            with contextlib.suppress(Exception):  # rank 0 gone: nothing to tell
                store.set(f"memfit/left/{me}", "1")


def left_unfinished() -> bool:
    """True when one of memfit's collectives failed or was interrupted in this process.

    Why it matters: the process group may still hold a thread blocked on the missing rank,
    and the interpreter would wait for it at exit (gloo: until its own timeout). A command
    line that ends then exits at once (:func:`memfit.cli.exit_with`).
    """
    return _state.broken


def _store() -> Any:
    """The job's store (torchrun's rendezvous), or None when this torch cannot say."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private helper: without it, ranks are not named
        return None


def _arrived_key(rank: int) -> str:
    return f"memfit/entered/{rank}"


def _enter() -> int:
    """Count one more memfit collective on this rank, and note it in the store."""
    _state.entered += 1
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):  # naming the missing rank is a courtesy
            store.set(_arrived_key(dist.get_rank()), str(_state.entered))
    return _state.entered


def _ranks_behind(entered: int) -> list[int] | None:
    """The ranks that have not entered this collective yet (None: the store cannot say)."""
    store = _store()
    if store is None:
        return None
    behind = []
    try:
        for other in range(dist.get_world_size()):
            if other == dist.get_rank():
                continue
            key = _arrived_key(other)
            count = int(store.get(key)) if store.check([key]) else 0
            if count < entered:
                behind.append(other)
    except Exception:  # noqa: BLE001 - the store's host (rank 0, or torchrun's agent) is gone
        return None
    return behind


def _describe_failure(name: str, entered: int, seconds: float, error: BaseException) -> str:
    """One line: which rank did not answer, and what to do."""
    me = dist.get_rank()
    others = [rank for rank in range(dist.get_world_size()) if rank != me]
    behind = _ranks_behind(entered)
    if behind is None:  # the store is gone with its host: rank 0 (or torchrun's agent) ended
        behind = [0] if me != 0 else others
    if not behind:  # every rank came: one of them ended inside the collective
        behind = others if len(others) == 1 else []
    who = (
        f"rank {behind[0]}"
        if len(behind) == 1
        else f"ranks {', '.join(map(str, behind))}"
        if behind
        else "another rank"
    )
    text = str(error)
    if any(word in text for word in ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")):
        return f"{who} did not answer at memfit's {name}: its process ended (rank {me} waited for it)"
    return (
        f"{who} did not answer within {seconds:g} s at memfit's {name} (rank {me} waited): frozen or stuck "
        f"in its own code; {TIMEOUT_VARIABLE}=SECONDS sets the wait"
    )


#: the most seconds rank 0 waits, when leaving, for the others to have left
_LEAVE_WAIT = 60.0
#: seconds past the timeout memfit's wait leaves a gloo group it made to fail on its own
_OWN_GROUP_GRACE = 5.0


def _wait(work: Any, seconds: float) -> None:
    """Wait for a collective's Work at most ``seconds``, still answering Ctrl-C and SIGTERM.

    Why poll rather than ``work.wait()``: a wait inside the C++ library holds the main
    thread, so Python's signal handlers would not run until the collective ended; polling
    with short sleeps (0.5 ms doubling up to 50 ms) lets an interrupt end the command now.
    """
    deadline = time.monotonic() + seconds
    pause = 0.0005
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"Timed out waiting {seconds:g} s for the collective to complete")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    work.wait()  # raises what the collective failed with, if it failed


def _collective(name: str, launch: Callable[[], Any]) -> None:
    """Run one asynchronous collective (``launch`` returns its Work), bounded in time.

    Why wait with a timeout here as well: a group the user made (Lightning's, their own
    ``init_process_group``) may wait 30 minutes; memfit's own waits are bounded either way.
    """
    if _state.broken:
        raise RankTimeoutError("an earlier collective failed: this process group cannot agree on anything now")
    seconds = collective_timeout()
    entered = _enter()
    try:
        work = launch()
        # a group memfit made with gloo fails the collective itself at the timeout (cleanly,
        # so it can be destroyed at once): give it that chance before giving up here
        _wait(work, seconds + (_OWN_GROUP_GRACE if _state.own_gloo_group else 0.0))
    except RuntimeError as error:  # DistBackendError and gloo's errors are RuntimeErrors
        _state.broken = True
        raise RankTimeoutError(_describe_failure(name, entered, seconds, error)) from None
    except BaseException:  # an interrupt (Ctrl-C, SIGTERM) while waiting: this group is done
        _state.broken = True
        raise


@contextlib.contextmanager
def output_on_main_only(rank: int | None = None) -> Iterator[None]:
    """Send stdout to nowhere on every rank but 0 (errors still reach stderr).

    Why: N processes printing the same agreed answer is noise, and N JSON documents on
    one stdout are not JSON.
    """
    rank = _whole(os.environ, "RANK", 0, _MOST_RANKS, "0") if rank is None else rank
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def is_distributed() -> bool:
    """True inside an initialized process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group; RANK when torchrun set it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _whole(os.environ, "RANK", 0, _MOST_RANKS, "0")


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _whole(os.environ, "WORLD_SIZE", 1, _MOST_RANKS)


def is_main_process() -> bool:
    return rank() == 0


def _reduce_device() -> torch.device:
    """nccl reduces CUDA tensors only; gloo reduces CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(value: int, op: Any) -> int:
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_reduce_device())
    _collective("agreement", lambda: dist.all_reduce(tensor, op=op, async_op=True))
    return int(tensor.item())


def agree_min(value: int) -> int:
    """The smallest value over all ranks (for example the largest batch that fits everywhere)."""
    return _all_reduce(value, dist.ReduceOp.MIN)


def agree_max(value: int) -> int:
    """The largest value over all ranks."""
    return _all_reduce(value, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True when the flag is set on at least one rank (for example "I ran out of memory")."""
    return bool(agree_max(int(flag)))


def agree_min_each(values: Sequence[int]) -> list[int]:
    """The element-wise minimum of several ints over all ranks, in one all-reduce.

    Why one call: the guard decides several things at once after each attempt (did anyone
    run out of memory, at which size, on which rank, which gradients exist anywhere); one
    collective keeps it cheap and keeps every rank in the same sequence of collectives.
    A maximum is the negated minimum of the negated values.
    """
    if not is_distributed():
        return [int(value) for value in values]
    tensor = torch.tensor(list(values), dtype=torch.int64, device=_reduce_device())
    _collective("agreement", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN, async_op=True))
    return [int(value) for value in tensor.tolist()]


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, about ``bucket_bytes`` per group."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        same_kind = groups and groups[-1][0].dtype == tensor.dtype and groups[-1][0].device == tensor.device
        if not same_kind or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return groups


def average_across_ranks_(tensors: Sequence[torch.Tensor], bucket_bytes: int = 25 * 2**20) -> None:
    """Replace each tensor, in place, by its mean over all ranks (DDP's gradient all-reduce, by hand).

    Why by hand: DDP all-reduces inside backward, so a rank that runs out of memory in
    backward leaves the others waiting in a collective forever. The guard accumulates
    gradients locally and averages them here, once, after every rank finished. Like DDP,
    each tensor is divided by the world size and then summed, in buckets of about
    ``bucket_bytes`` (a flat copy per bucket), so a few large collectives replace many
    small ones. Every rank must pass tensors of the same shapes in the same order.
    """
    if not is_distributed():
        return
    count = world_size()
    for group in _buckets(tensors, bucket_bytes):
        if len(group) == 1 and group[0].is_contiguous():
            single = group[0]
            single.div_(count)
            _collective("gradient average", functools.partial(dist.all_reduce, single, async_op=True))
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        flat.div_(count)
        _collective("gradient average", functools.partial(dist.all_reduce, flat, async_op=True))
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def average_gradients_(params: Sequence[torch.nn.Parameter], bucket_bytes: int = 0) -> None:
    """Each parameter's gradient becomes its mean over the ranks (a missing one: zeros).

    Why in place by default (``bucket_bytes=0``: one all-reduce per gradient, no copy):
    the step that calls this is often one that just ran short of memory, where even a
    bucket's flat copy can fail. Every rank must pass the same parameters in one order.
    """
    if not is_distributed():
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    average_across_ranks_(grads, bucket_bytes)


def broadcast_from_main_(tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite each tensor, in place, with rank 0's values (DDP's buffer broadcast, by hand)."""
    if not is_distributed():
        return
    for tensor in tensors:
        _collective("broadcast from rank 0", functools.partial(dist.broadcast, tensor, src=0, async_op=True))
