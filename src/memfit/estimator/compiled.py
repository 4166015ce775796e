"""Find what of a workload is ``torch.compile``'d, so an estimate says it ran eager.

Why it runs eager: TorchDynamo does not compile a frame while a ``TorchDispatchMode`` is
active (``torch._dynamo.config.inline_torch_dispatch_torch_compile``), and the fake steps
run under two (fake tensors, the storage tracker), as the simulated GPU runs under the
tracker. A compiled model or function there runs its eager code, without a word from
PyTorch. Inductor's fused kernels keep fewer intermediates and its partitioner chooses
the saved tensors, so the compiled step on a GPU usually holds less: the estimate is for
the eager step, and says so (``Estimate.compile_note``).

What is found: a compiled module anywhere in the model (``torch.compile(module)``, an
``OptimizedModule``; ``module.compile()``; ``module.forward = torch.compile(...)``), a
compiled ``loss`` or ``make_batch``, and any compiled function entered while the steps run
(a ``@torch.compile`` helper called in forward), seen where TorchDynamo installs its frame
callback.

>>> import torch
>>> watch = CompileWatch()
>>> watch.inspect_model(torch.compile(torch.nn.Linear(2, 2)))
>>> watch.parts
['the model (torch.compile)']
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["CompileWatch", "is_compiled_callable"]

#: the attribute torch.compile's wrappers (functions and OptimizedModule) keep the original in
_ORIGINAL = "_torchdynamo_orig_callable"


def is_compiled_callable(value: Any) -> bool:
    """True for what ``torch.compile(fn)`` returns (it keeps the original callable)."""
    return callable(value) and hasattr(value, _ORIGINAL)


class CompileWatch:
    """What of one run is compiled: its parts, named for people, in the order found."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def _add(self, part: str) -> None:
        if part not in self.parts:
            self.parts.append(part)

    def inspect_model(self, model: nn.Module) -> None:
        """Record the compiled modules of ``model`` (the outermost of each compiled subtree).

        Args:
            model: the model as the workload built it.
        """
        if "torch._dynamo" not in sys.modules:  # nothing was compiled: torch.compile imports it
            return
        for name, module in model.named_modules():
            where = f"module {name!r}" if name else "the model"
            if is_compiled_callable(module):  # OptimizedModule
                self._add(f"{where} (torch.compile)")
            elif getattr(module, "_compiled_call_impl", None) is not None:
                self._add(f"{where} (Module.compile)")
            elif is_compiled_callable(module.__dict__.get("forward")):
                self._add(f"{where}'s forward (torch.compile)")

    def inspect_functions(self, functions: dict[str, Callable[..., Any]]) -> None:
        """Record the workload's compiled functions (``loss``, ``make_batch``).

        Args:
            functions: each function by the name people know it by.
        """
        for name, function in functions.items():
            if is_compiled_callable(function):
                self._add(f"{name} (torch.compile)")

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Record a compiled function entered while the steps run.

        Why at TorchDynamo's frame callback: a ``@torch.compile`` helper called in forward is
        not an attribute of anything the workload hands over; entering it installs the
        callback (``None`` is installed by ``torch._dynamo.disable``, which PyTorch's own
        optimizers use: not a compiled region). Where this torch has no such hook, only the
        parts :meth:`inspect_model` finds are named.
        """
        frames = sys.modules.get("torch._dynamo.eval_frame")
        original = getattr(frames, "_maybe_set_eval_frame", None)
        if frames is None or original is None:
            yield
            return

        def install(callback: Any) -> Any:
            if callback is not None and callback is not False:
                self._add("a function called while the step runs (torch.compile)")
            return original(callback)

        frames._maybe_set_eval_frame = install  # type: ignore[attr-defined]
        try:
            yield
        finally:
            frames._maybe_set_eval_frame = original  # type: ignore[attr-defined]

    def note(self) -> str:
        """The sentence an estimate shows ("" when nothing is compiled)."""
        if not self.parts:
            return ""
        return (
            f"estimated as eager: {', '.join(self.parts)} is compiled, and torch.compile does not compile under "
            "memfit's fake tensors and storage tracker (TorchDynamo skips frames while a TorchDispatchMode is active); "
            "inductor's fused kernels and its partitioner's saved tensors usually hold less than the eager step, "
            "so measure on the GPU for the compiled figure (memfit measure --device cuda)"
        )
