"""A training step run eager or as AOTAutograd's compiled graphs (``aot_eager``), and its peak.

``torch.compile(backend="aot_eager")`` runs AOTAutograd's partitioned forward and backward
graphs op by op: FX's generated code frees each value after its last use, the forward
graph's extra outputs are what autograd keeps for the backward graph, and the backward
graph returns every parameter's gradient at once. Here the module is traced by
``aot_module_simplified`` with compilers that return each graph's own code (boxed, as
aot_eager's ``boxed_nop``), partitioned as aot_eager partitions it (min-cut, without
inductor's decompositions) or with the default partitioner, and then the graphs RUN under
the storage tracker and the CUDA caching-allocator model: on fake tensors (an estimate,
shapes only) or on real CPU tensors (the simulated GPU), as the estimator's fake steps
run a model. TorchDynamo is not involved (it does not compile under memfit's dispatch
modes: :mod:`memfit.estimator.compiled`), so the whole forward is one graph, as it is for a
model without graph breaks.

The step is the one the TorchDynamo benchmark harness times (pytorch/pytorch
``benchmarks/dynamo/huggingface.py: forward_and_backward_pass``): the inputs cloned, the
forward, the loss (the first output, summed when it is not a scalar), backward. No
optimizer: the harness's ``init_optimizer`` of early 2023 set none, so its
``optimizer_zero_grad`` did nothing and gradients accumulated across iterations
(``set_to_none=True`` sets them to None before each step instead). The peak is the
allocator's peak allocated bytes over the steps, parameters and inputs included
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, as the harness reads
it).

>>> import torch
>>> def build():
...     layers = [torch.nn.Linear(256, 256, bias=False) for _ in range(2)]
...     return torch.nn.Sequential(*layers), (torch.randn(8, 256),)
>>> eager, compiled = step_peak(build, backend="eager"), step_peak(build, backend="aot_eager")
>>> compiled.peak_allocated - eager.peak_allocated  # both new 256 KiB gradients at once, not one
270336
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from memfit.cuda.target import CudaTarget
from memfit.memory.devices import SimDevice

__all__ = ["BACKENDS", "StepPeak", "step_peak"]

#: what :func:`step_peak` runs: ``eager``; ``aot_eager`` (AOTAutograd's graphs, min-cut
#: partitioner, as torch's aot_eager backend); ``aot_eager_default_partitioner``
BACKENDS = ("eager", "aot_eager", "aot_eager_default_partitioner")

Build = Callable[[], tuple[nn.Module, "tuple[Any, ...] | Mapping[str, Any]"]]


@dataclass(frozen=True)
class StepPeak:
    """The peak of training steps under one backend (see the module)."""

    backend: str
    #: peak allocated bytes over the steps (the allocator model's rounding included)
    peak_allocated: int
    #: peak reserved bytes over the steps (the allocator model's segments)
    peak_reserved: int
    steps: int


class _Call(nn.Module):
    """The module called with positional tensors, its outputs as a flat tuple.

    ``aot_module_simplified`` takes positional arguments and a tuple of outputs only; a
    model called with keywords (a transformers model) gets its names back here.
    """

    def __init__(self, module: nn.Module, names: Sequence[str] | None) -> None:
        super().__init__()
        self.module = module
        self.names = list(names) if names is not None else None

    def forward(self, *args: Any) -> tuple[Any, ...]:
        if self.names is None:
            return tuple(tree_leaves(self.module(*args)))
        return tuple(tree_leaves(self.module(**dict(zip(self.names, args, strict=True)))))


def _compiled(call: _Call, args: list[Any], backend: str) -> Callable[..., Any]:
    """``call`` as aot_eager runs it: AOTAutograd's graphs, each run as its own code."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    def own_code(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return make_boxed_func(gm.forward)

    partition = min_cut_rematerialization_partition if backend == "aot_eager" else default_partition
    # typed for a GraphModule, it traces any module (it reads named_parameters and calls it)
    wrapped: Any = call
    # TorchDynamo holds torch.compiler.is_compiling() True while it compiles, so the model's
    # code takes its compiled branches (transformers skips its data-dependent padding
    # check, which fake tensors cannot answer); torch without that session context traces
    # the model's eager code.
    session = getattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)
    with session():
        return aot_module_simplified(
            wrapped,
            args,
            fw_compiler=own_code,
            bw_compiler=own_code,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )


def _clone(args: list[Any]) -> list[Any]:
    """The inputs as the harness's ``clone_inputs`` gives them to each step."""
    return [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]


def _one_step(forward: Callable[..., Any], module: nn.Module, args: list[Any], set_to_none: bool) -> None:
    if set_to_none:
        module.zero_grad(set_to_none=True)
    outputs = forward(*_clone(args))
    loss = outputs[0] if outputs[0].dim() == 0 else outputs[0].sum()
    del outputs
    loss.backward()


def step_peak(
    build: Build,
    *,
    backend: str,
    steps: int = 2,
    fake: bool = True,
    cuda: CudaTarget | None = None,
    set_to_none: bool = False,
) -> StepPeak:
    """Run ``steps`` training steps of the module ``build`` makes under ``backend``; their peak.

    Args:
        build: returns ``(module, args)``, args a tuple (positional) or a mapping (keyword
            arguments, as a transformers model takes them); called under a fresh fake-tensor
            mode when ``fake``, so a model of any size costs no memory (build it from its
            configuration).
        backend: one of :data:`BACKENDS`.
        steps: how many steps run (the peak is over all of them; from the second on,
            accumulated gradients are held).
        fake: True for fake tensors (the estimate), False for real CPU tensors (the check).
        cuda: run with this CUDA GPU's semantics (:mod:`memfit.cuda.semantics`); None keeps
            the CPU's. The compiled graphs are traced outside them (AOTAutograd traces the
            operations the model calls; the semantics apply when the graphs run).
        set_to_none: set gradients to None before each step (an optimizer's ``zero_grad``)
            instead of accumulating them as the harness without an optimizer does.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        module, given = build()
        names = list(given) if isinstance(given, Mapping) else None
        args = list(given.values()) if isinstance(given, Mapping) else list(given)
        call = _Call(module, names)
        forward = _compiled(call, args, backend) if backend != "eager" else call
        device = SimDevice(None, "memfit:compiled-step", cuda=cuda)
        with device:
            device.adopt([*module.parameters(), *module.buffers()])
            device.adopt(arg for arg in args if isinstance(arg, torch.Tensor))
            device.reset_peak_memory_stats()
            for _ in range(steps):
                _one_step(forward, module, args, set_to_none)
        stats = device.memory_stats()
        module.zero_grad(set_to_none=True)
    return StepPeak(backend, stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"], steps)
