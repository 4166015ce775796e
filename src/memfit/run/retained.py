"""What a workload keeps on the device between runs: found by walking what it references.

Why: probe's and plan's trials each run a fresh step; a workload that keeps tensors from
one trial to the next (a model factory appending every model it builds to a global list,
a ``make_batch`` caching its last batch on the device) makes every later trial see a
smaller device, and the search then answers for a device that is not the one the user
has. :func:`measure` compares the device's allocated memory before and after a run; when
it grew by more than the workload's own model instance and optimizer state may keep, the
tensors responsible are looked for where a workload can hold them: the closures, default
arguments and referenced module globals of its functions, bound objects' attributes, and
what containers inside those hold, and named by the path that reaches them.

The walk is bounded (depth and objects visited) and read-only: it never calls user code.

>>> import torch, memfit
>>> def batches(cache):
...     return lambda n: cache[0][:n]
>>> wl = memfit.Workload(model=lambda: torch.nn.Linear(2, 2), make_batch=batches([torch.zeros(4, 2)]),
...                      loss=lambda m, b: m(b).sum())
>>> [path for path, _ in reachable_tensors(wl)]
['make_batch: closure variable cache[0]']
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.memory.allocator import round_size
from memfit.memory.devices import Device
from memfit.units import format_size
from memfit.workload import Workload

__all__ = ["reachable_tensors", "Resident", "resident", "retained_message", "MAX_DEPTH"]

#: how many references deep the walk goes from a workload's function
MAX_DEPTH = 8
#: objects visited at most per walk (a workload referencing a whole library stays fast)
MAX_OBJECTS = 20_000


def _roots(workload: Workload) -> Iterator[tuple[str, Any]]:
    yield ("the model" if isinstance(workload.model, nn.Module) else "the model factory"), workload.model
    yield "make_batch", workload.make_batch
    yield "loss", workload.loss
    yield "the optimizer factory", workload.optimizer


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(how it is reached, what) for each object ``obj`` references that may hold tensors."""
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        yield from _function_children(obj)
    elif isinstance(obj, dict):
        for key, value in list(obj.items())[:1000]:
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for index, value in enumerate(list(obj)[:1000]):
            yield f"[{index}]", value
    elif hasattr(obj, "func") and hasattr(obj, "args") and hasattr(obj, "keywords"):  # functools.partial
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
    elif isinstance(obj, nn.Module):
        for name, tensor in [*obj.named_parameters(), *obj.named_buffers()]:
            yield f".{name}", tensor
        yield from ((f".{k}", v) for k, v in vars(obj).items() if not k.startswith("_"))
    elif isinstance(obj, torch.optim.Optimizer):
        yield ".state", list(obj.state.values())
        yield ".param_groups", [group["params"] for group in obj.param_groups]
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
        yield from ((f".{k}", v) for k, v in list(vars(obj).items())[:1000])


def _function_children(fn: types.FunctionType | types.MethodType) -> Iterator[tuple[str, Any]]:
    if isinstance(fn, types.MethodType):
        yield ".__self__", fn.__self__
        fn = fn.__func__  # type: ignore[assignment]
    assert isinstance(fn, types.FunctionType)
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f": closure variable {name}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for index, default in enumerate(fn.__defaults__ or ()):
        yield f": default argument {index}", default
    module = fn.__globals__.get("__name__", "?")
    for name in sorted(_global_names(code)):
        if name in fn.__globals__:
            yield f" -> global {name} of {module}", fn.__globals__[name]


def _global_names(code: types.CodeType) -> set[str]:
    """The global names a function's code (and the code nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _skipped(obj: Any) -> bool:
    """Objects that hold no workload state worth walking: types, modules, builtins, scalars."""
    return isinstance(
        obj, (type, types.ModuleType, types.BuiltinFunctionType, str, bytes, int, float, bool, type(None))
    )


def reachable_tensors(workload: Workload) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a workload references, with the path that first reaches it.

    Args:
        workload: the workload whose functions and objects are walked.
    """
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    # Breadth first, from every root at once: each object is named by its shortest path
    # (a script's optimizer by its own closure variable, not through a snapshot holding it).
    queue: deque[tuple[str, Any, int]] = deque((root, obj, 0) for root, obj in _roots(workload))
    while queue and len(seen) < MAX_OBJECTS:
        path, current, depth = queue.popleft()
        if id(current) in seen or _skipped(current):
            continue
        seen.add(id(current))
        if isinstance(current, torch.Tensor):
            found.append((path, current))
            if current.grad is not None:
                found.append((f"{path}.grad", current.grad))
            continue
        if depth < MAX_DEPTH:
            queue.extend((path + how, child, depth + 1) for how, child in _children(current))
    return found


class Resident(NamedTuple):
    """A workload's tensors held by the device, by storage: each path's bytes, and the
    bytes its model instance and optimizer state hold (which stay on purpose)."""

    paths: dict[str, int]
    kept: int


def resident(workload: Workload, device: Device) -> Resident:
    """The device memory each path from ``workload`` holds (rounded as the allocator rounds).

    A storage reached twice counts once, under the first path. For a workload built
    around a model instance, what the instance holds (parameters, buffers, gradients)
    and any optimizer's state is ``kept``: a script's own model and optimizer stay on the
    device between trials by design.

    Args:
        workload: the workload walked.
        device: the device whose memory is counted.
    """
    paths: dict[str, int] = {}
    kept = 0
    instance = not workload.builds_fresh_models
    storages: set[tuple[str, int]] = set()
    for path, tensor in reachable_tensors(workload):
        if not device.holds(tensor):
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in storages or storage.nbytes() == 0:
            continue
        storages.add(key)
        nbytes = round_size(storage.nbytes())
        # only a script's own model instance and optimizer stay on purpose; a workload
        # that builds fresh models keeps nothing from one run to the next
        if instance and (path.startswith("the model.") or ".state[" in path):
            kept += nbytes
        else:
            group = _first_hop(path)
            paths[group] = paths.get(group, 0) + nbytes
    return Resident(paths, kept)


def _first_hop(path: str) -> str:
    """The part of a path people act on: the closure variable, default or global reached first."""
    for marker in (": closure variable ", ": default argument ", " -> global "):
        start = path.find(marker)
        if start >= 0:
            end = min((i for i in (path.find("[", start), path.find(".", start + len(marker))) if i >= 0), default=-1)
            return path if end < 0 else path[:end]
    return path


def retained_message(name: str, batch_size: int, retained: int, before: Resident, after: Resident) -> str:
    """One line: how much device memory a run left allocated, and which of the workload's
    references hold it (or that none of them does)."""
    grown = {p: b - before.paths.get(p, 0) for p, b in after.paths.items() if b > before.paths.get(p, 0)}
    where = ", ".join(f"{p} ({format_size(b)})" for p, b in sorted(grown.items(), key=lambda i: -i[1])[:3])
    held = (
        f"held by {where}"
        if where
        else "held by nothing the workload's functions reach (module globals of other code, a cache, "
        "an exception kept alive)"
    )
    return (
        f"{name}: {format_size(retained)} of device memory stayed allocated after the run at batch {batch_size}, "
        f"{held}; every later trial would see a smaller device: keep nothing of one step for the next "
        "(build each model inside the model factory; an optimizer that needs the model can take it: "
        "optimizer=lambda model: ...)"
    )
