"""The estimator is one way down: the walk along the workload leaves each of its files at most twice.

The walk is the one a reader makes following the workload from ``probe`` (or
``estimate``) call by call: the functions of memfit (code under ``src/memfit``) the
workload is handed to, in the order they are first called. A function follows the workload
when one of its parameters or captured variables is the :class:`~memfit.workload.Workload`,
a record carrying it (a dataclass or NamedTuple instance with a Workload field: a request
object), or, for a method, a field of ``self`` (a runner holding it). Each function is read
once, at its first call (later calls, a search's next batch size, a generator resumed,
add nothing to read). Not steps of the walk: the Workload's own methods (the workload is
asked, not handed on) and callables passed around (a runner is walked where its code runs).

A *stay* is a run of consecutive functions of the walk in one file; a file visited again
after the walk left it is a return. The estimator's entry decides once how a step is
traced (one GPU, one rank of N on a fake process group, a separate process, the formulas),
and that way runs down without coming back: so each estimator file has at most two stays
(the entry, and its own code after the workload's reference is resolved), and the
probe's own visits (its rehearsal, its fake trials) come on top of at most one. Before the
restructuring (issue 24) the same walk of ``probe`` on 4 ranks made ``estimate.py``,
``distributed_trace.py`` and ``fake.py`` 3, 3 and 2 stays, of ``estimate`` on one GPU
``estimate.py`` 5.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit.estimator.estimate import estimate
from memfit.search.probe import probe
from memfit.workload import Workload

SOURCE = Path(memfit.__file__).parent
MLP = "mlp:layers=2,width=16,features=16"
SIM = "sim:64MiB"
#: the most stays the walk makes in any one file of the estimator
MOST_STAYS = 2

_VARARGS, _VARKEYWORDS, _GENERATOR = 0x04, 0x08, 0x20


def _carries(value: Any) -> bool:
    """The workload itself, or a record (not a callable) with the workload as a field."""
    if isinstance(value, Workload):
        return True
    if callable(value) or isinstance(value, type):
        return False
    if dataclasses.is_dataclass(value):
        return any(isinstance(getattr(value, f.name, None), Workload) for f in dataclasses.fields(value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return any(isinstance(item, Workload) for item in value)
    return False


def follows_workload(frame: FrameType) -> bool:
    """True when the function just called was handed the workload (see the module)."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    if code.co_flags & _VARARGS:
        names.append(code.co_varnames[count])
        count += 1
    if code.co_flags & _VARKEYWORDS:
        names.append(code.co_varnames[count])
    found = frame.f_locals
    if names and names[0] == "self":
        me = found.get("self")
        if isinstance(me, Workload):
            return False  # the workload is asked, not handed on
        fields = getattr(me, "__dict__", {})
        if any(isinstance(value, Workload) for value in fields.values()):
            return True
        names = names[1:]
    values: list[Any] = []
    for name in [*names, *code.co_freevars]:
        value = found.get(name)
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            values.extend(value)
        elif isinstance(value, dict):
            values.extend(value.values())
        else:
            values.append(value)
    return any(_carries(value) for value in values)


def walk(call: Callable[[], object]) -> list[tuple[str, str]]:
    """``(file under src/memfit, function)`` of each function the workload is handed to,
    in the order of first calls, while ``call()`` runs (every thread)."""
    read: set[Any] = set()
    walked: list[tuple[str, str]] = []
    # where each generator's code starts: a call event elsewhere is a generator resumed. Why
    # not keep its frames: they hold the step's tensors, and measure counts what a run leaves
    # on the device.
    starts: dict[Any, int] = {}

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code in read or not code.co_filename.startswith(str(SOURCE)):
            return
        if code.co_flags & _GENERATOR and starts.setdefault(code, frame.f_lasti) != frame.f_lasti:
            return  # a generator resumed: its function was read at its first call
        if follows_workload(frame):
            read.add(code)
            walked.append((str(Path(code.co_filename).relative_to(SOURCE)), code.co_qualname))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return walked


def stays(walked: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """The walk as stays: runs of consecutive functions in one file."""
    runs: list[tuple[str, list[str]]] = []
    for file, function in walked:
        if runs and runs[-1][0] == file:
            runs[-1][1].append(function)
        else:
            runs.append((file, [function]))
    return runs


def estimator_stays(call: Callable[[], object]) -> tuple[collections.Counter[str], str]:
    """Stays per estimator file, and the whole walk (for a failure's message)."""
    runs = stays(walk(call))
    shown = "\n".join(f"{file}: {', '.join(functions)}" for file, functions in runs)
    return collections.Counter(file for file, _ in runs if file.startswith("estimator/")), shown


def test_the_walk_counts_a_return_to_a_file_already_left() -> None:
    """The measure can fail: a path that goes back and forth between two files is caught."""
    from memfit.estimator import distributed_trace, fake

    workload = memfit.load_workload(MLP)

    def back_and_forth() -> None:
        for _ in range(3):
            distributed_trace.child_reference(workload)  # estimator/distributed_trace.py
            fake.FakeSteps(workload)(memfit.Settings(micro_batch_size=1), None, False)  # estimator/fake.py

    counted, shown = estimator_stays(back_and_forth)
    # each function is read once: the loop's later turns add nothing
    assert counted == {"estimator/distributed_trace.py": 1, "estimator/fake.py": 1}, shown

    def ping_pong() -> None:
        one = memfit.Settings(micro_batch_size=1)
        distributed_trace.child_reference(workload)  # distributed_trace.py
        fake.run_fake_steps(workload, one, steps=1)  # fake.py
        distributed_trace.candidate_ranks(workload, memfit.Settings(world_size=2, shard="optimizer"))  # and back
        fake.FakeSteps(workload)(one, None, False)  # fake.py again
        distributed_trace.trace(workload, memfit.Settings(micro_batch_size=1, world_size=2))  # a third time

    counted, shown = estimator_stays(ping_pong)
    assert counted["estimator/distributed_trace.py"] == 3 > MOST_STAYS, shown
    assert counted["estimator/fake.py"] == 2, shown


@pytest.mark.parametrize(
    "settings",
    [memfit.Settings(), memfit.Settings(world_size=4, shard="full"), memfit.Settings(world_size=2, shard="optimizer")],
    ids=["one GPU", "FSDP2 on 4", "ZeRO-1 on 2"],
)
def test_probe_and_estimate_leave_each_estimator_file_at_most_twice(settings: memfit.Settings) -> None:
    workload = memfit.load_workload(MLP)
    calls = {
        "probe": lambda: probe(workload, SIM, settings, max_batch_size=8),
        "estimate": lambda: estimate(workload, 4, settings, device=SIM),
        "estimate with a GPU": lambda: estimate(workload, 4, settings, gpu="RTX 3090"),
    }
    for name, call in calls.items():
        counted, shown = estimator_stays(call)
        assert counted, name  # the walk went through the estimator
        assert max(counted.values()) <= MOST_STAYS, f"{name}:\n{shown}"
        if name == "estimate":
            # the entry (before the reference is resolved), then the rest of estimate.py; the rest once
            assert counted.pop("estimator/estimate.py") == 2 and set(counted.values()) == {1}, shown


@pytest.fixture
def user_group(tmp_path: Path) -> Iterator[None]:
    """A real (gloo, one rank) process group, as a torchrun or Lightning job has."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_formulas_way_leaves_each_estimator_file_at_most_twice(user_group: None) -> None:
    """In a user's process group a model instance cannot be traced: the formulas' way."""
    instance = memfit.Workload(
        model=nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)),
        make_batch=lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        name="instance",
    )
    settings = memfit.Settings(world_size=4, shard="full")
    result: list[memfit.Estimate] = []
    counted, shown = estimator_stays(lambda: result.append(estimate(instance, 4, settings, device=SIM)))
    assert result[0].method == "formulas"
    assert max(counted.values()) <= MOST_STAYS, shown
