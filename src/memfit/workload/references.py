"""Workload references: the strings every memfit command accepts, resolved to a Workload.

- a zoo name with options: ``gpt``, ``gpt2:n_layer=2,seq_len=128`` (see :mod:`memfit.workload.zoo`);
- ``path/to/file.py:function`` or ``package.module:function``: the function takes no
  required arguments and returns a :class:`~memfit.workload.spec.Workload`.

A reference is resolved once, where it enters memfit (a command, a public function); a
Workload travels down from there.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from memfit.errors import WorkloadError
from memfit.workload import zoo
from memfit.workload.spec import Workload

__all__ = ["load_workload"]


def load_workload(ref: str | Workload | None) -> Workload:
    """Resolve a workload reference to a :class:`~memfit.workload.spec.Workload`.

    Args:
        ref: a zoo name with options (``"gpt2:n_layer=2,seq_len=128"``),
            ``"path/to/file.py:function"`` or ``"package.module:function"``; a Workload is
            returned as it is. The reference is kept in ``Workload.reference``.
    """
    if isinstance(ref, Workload):
        return ref
    if ref is None:
        raise WorkloadError(
            "no workload reference (None): a memfit.lock made for a Workload object records none; "
            "build that Workload in your script as when it was fitted"
        )
    if not isinstance(ref, str) or not ref.strip():
        raise WorkloadError("empty workload reference: give a zoo name (such as mlp or gpt) or file.py:function")
    ref = ref.strip()
    workload = _resolve(ref)
    # Remembered so that a lock can record what the user gave, and load it again.
    workload.reference = ref
    return workload


def _resolve(ref: str) -> Workload:
    head, sep, tail = ref.partition(":")
    if head in zoo.ENTRIES:
        return zoo.build(head, tail if sep else "")
    if head.endswith(".py") or "/" in head or "\\" in head:
        return _from_file(head, tail, ref)
    if sep and "=" not in tail:
        return _from_module(head, tail, ref)
    raise WorkloadError(
        f"unknown workload {ref!r}: not a zoo name ({', '.join(zoo.ENTRIES)}), "
        "nor file.py:function, nor package.module:function"
    )


def _from_file(path_text: str, function: str, ref: str) -> Workload:
    path = Path(path_text)
    if not function:
        raise WorkloadError(f"workload {ref!r}: name the function, as {path_text}:make_workload")
    if not path.is_file():
        raise WorkloadError(f"workload {ref!r}: file {path_text} not found")
    module_name = f"_memfit_workload_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"workload {ref!r}: cannot import {path_text}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # errors in the user's file propagate unchanged
    return _call_factory(module, function, ref)


def _from_module(module_name: str, function: str, ref: str) -> Workload:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise WorkloadError(f"workload {ref!r}: module {module_name} not found") from None
        raise
    return _call_factory(module, function, ref)


def _call_factory(module: Any, function: str, ref: str) -> Workload:
    factory = getattr(module, function, None)
    if factory is None:
        raise WorkloadError(f"workload {ref!r}: function {function} not found in {module.__name__}")
    if not callable(factory):
        raise WorkloadError(f"workload {ref!r}: {function} is not a function")
    required = [
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if required:
        raise WorkloadError(
            f"workload {ref!r}: {function} must take no required arguments (it needs {', '.join(required)})"
        )
    workload = factory()
    if not isinstance(workload, Workload):
        raise WorkloadError(f"workload {ref!r}: {function} returned {type(workload).__name__}, not a memfit.Workload")
    if workload.name == "workload":
        workload.name = ref
    return workload
