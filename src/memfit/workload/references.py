"""Workload references: the strings every memfit command accepts, resolved to a Workload.

- a zoo name with options: ``gpt``, ``gpt2:n_layer=2,seq_len=128`` (see :mod:`memfit.workload.zoo`);
- ``path/to/file.py:function`` or ``package.module:function``: the function takes no
  required arguments and returns a :class:`~memfit.workload.spec.Workload`.

A reference is resolved once, where it enters memfit (a command, a public function); a
Workload travels down from there.

What goes wrong in the user's file is told apart from what goes wrong in their code:

- a file that cannot be imported at all (a syntax error, null bytes, a module that is not
  installed) is a :class:`~memfit.errors.WorkloadError`: one line, exit status 2;
- an exception raised *by* their code (the file's own top level, the workload function,
  the model factory, ``make_batch``, ``loss``, ``optimizer``) keeps its traceback, which
  is where their bug is; the file is registered as workload code
  (:func:`memfit.errors.register_workload_source`) so the command line names the
  function first. The Workload the user's function returns is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memfit.errors import WorkloadError, register_workload_source
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


def _import_problem(error: BaseException, shown: str, ref: str) -> WorkloadError | None:
    """A one-line error for a module that cannot be imported at all, or None for an error of its code.

    Why these: a syntax error, null bytes or a missing package are found before any of
    the user's code runs; their traceback would only show memfit's import machinery.
    """
    if isinstance(error, SyntaxError):
        place = (
            f"{Path(error.filename).name if error.filename else shown}, line {error.lineno}" if error.lineno else shown
        )
        return WorkloadError(f"workload {ref!r}: {place}: {error.msg}")
    if isinstance(error, ValueError) and "null bytes" in str(error):
        return WorkloadError(f"workload {ref!r}: {shown} is not Python source (it contains null bytes)")
    if isinstance(error, ModuleNotFoundError):
        missing = error.name or str(error)
        return WorkloadError(f"workload {ref!r}: {shown} imports {missing}, which is not installed here")
    if isinstance(error, ImportError):
        return WorkloadError(f"workload {ref!r}: {shown} cannot be imported: {error}")
    return None


@contextmanager
def _importing(shown: str, ref: str, module_name: str = "") -> Iterator[None]:
    """Turn an import that cannot happen into one line; note an error of the module's own code."""
    try:
        yield
    except ModuleNotFoundError as error:
        if module_name and error.name and module_name.startswith(error.name):
            raise WorkloadError(f"workload {ref!r}: module {module_name} not found") from None
        raise _import_problem(error, shown, ref) or error from None
    except (SyntaxError, ValueError, ImportError) as error:
        problem = _import_problem(error, shown, ref)
        if problem is None:
            raise  # an error of the module's own code: its traceback, named by the command line
        raise problem from None


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
    register_workload_source(path, ref)
    try:
        with _importing(path_text, ref):
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return _call_factory(module, function, ref)


def _from_module(module_name: str, function: str, ref: str) -> Workload:
    with _importing(module_name, ref, module_name):
        spec = importlib.util.find_spec(module_name)
        if spec is not None and spec.origin and spec.has_location:
            register_workload_source(spec.origin, ref)  # before its code runs, so its errors are named
        module = importlib.import_module(module_name)
    return _call_factory(module, function, ref)


def _call_factory(module: Any, function: str, ref: str) -> Workload:
    factory = getattr(module, function, None)
    if factory is None:
        raise WorkloadError(f"workload {ref!r}: function {function} not found in {module.__name__}")
    if not callable(factory):
        raise WorkloadError(f"workload {ref!r}: {function} is not a function")
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it and see
        parameters = []  # type: ignore[assignment]
    required = [
        p.name
        for p in parameters
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
