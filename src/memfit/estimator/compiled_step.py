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

``inductor_fusion`` is a model of inductor, not inductor: the same graphs partitioned as
inductor's are, run node by node, a value that only fused kernels read computed where the
tracker does not see it (:data:`FUSION_ASSUMPTION`); no kernel is generated, no CUDA graph
is recorded, and inductor's own buffer reuse is not modelled beyond freeing after last use.

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
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from memfit.cuda.target import CudaTarget
from memfit.memory.devices import SimDevice

__all__ = ["BACKENDS", "FUSION_ASSUMPTION", "StepPeak", "fused_nodes", "step_peak"]

#: what :func:`step_peak` runs: ``eager``; ``aot_eager`` (AOTAutograd's graphs, min-cut
#: partitioner, as torch's aot_eager backend); ``aot_eager_default_partitioner`` (as
#: aot_eager partitioned before 2024); ``inductor_fusion`` (a model of inductor: see
#: :data:`FUSION_ASSUMPTION`)
BACKENDS = ("eager", "aot_eager", "aot_eager_default_partitioner", "inductor_fusion")

#: what ``inductor_fusion`` assumes of inductor's kernels (no kernel is generated)
FUSION_ASSUMPTION = (
    "the graphs are partitioned as inductor's are (min-cut with inductor's decompositions); "
    "a value made by a pointwise operation, a reduction or a random draw and read only by "
    "pointwise operations or reductions (directly or through views) is computed inside a fused "
    "kernel and never allocated; everything else (matmul and other library kernels' outputs, "
    "the saved tensors, the gradients, the graphs' outputs) is allocated as the graph runs and "
    "freed after its last use"
)

_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "prod", "any", "all"})
_RANDOM = frozenset({"rand", "rand_like", "randn", "randn_like", "bernoulli"})

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


def _kind(node: fx.Node) -> str:
    """``pointwise``, ``reduction``, ``random``, ``view`` or ``other`` (a kernel of its own)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return "view" if node.op == "call_function" and target is operator.getitem else "other"
    if torch.Tag.pointwise in target.tags:
        return "pointwise"
    if target.is_view:
        return "view"
    name = target.overloadpacket.__name__
    if name in _REDUCTIONS:
        return "reduction"
    return "random" if name in _RANDOM else "other"


def fused_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The values of ``graph`` that inductor is assumed to keep inside fused kernels.

    Args:
        graph: a partitioned forward or backward graph (see :data:`FUSION_ASSUMPTION`).
    """
    fused: set[fx.Node] = set()
    for node in graph.nodes:
        # a view allocates nothing: it is fused when what it views is
        if _kind(node) in ("other", "view") or not node.users:
            continue
        if all(_reads_in_kernel(user) for user in node.users):
            fused.add(node)
    return fused


def _reads_in_kernel(user: fx.Node) -> bool:
    """True when ``user`` reads its input inside a fused kernel (a view: when its readers do)."""
    kind = _kind(user) if user.op == "call_function" else "other"
    if kind == "view":
        return bool(user.users) and all(_reads_in_kernel(reader) for reader in user.users)
    return kind in ("pointwise", "reduction")


class _FusedRun(fx.Interpreter):
    """A graph run node by node, its fused values computed where the tracker does not see them.

    A fused value, and a value computed from one, runs with the dispatch modes off (the
    tracker sees nothing; a fake tensor still answers through its own mode); the latter is
    then adopted, so only what a kernel writes to memory is counted.
    """

    def __init__(self, gm: fx.GraphModule, device: SimDevice) -> None:
        super().__init__(gm)
        self.fused = fused_nodes(gm.graph)
        self.device = device

    def run_node(self, n: fx.Node) -> Any:
        reads_fused = any(isinstance(a, fx.Node) and a in self.fused for a in n.all_input_nodes)
        if n.op != "call_function" or (n not in self.fused and not reads_fused):
            return super().run_node(n)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            value = super().run_node(n)
        if n not in self.fused:  # written to memory (a view of a counted value stays counted once)
            leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            self.device.adopt(t for t in leaves if not self.device.holds(t))
        return value


def _compiled(call: _Call, args: list[Any], backend: str, device: SimDevice) -> Callable[..., Any]:
    """``call`` as ``backend`` runs it: AOTAutograd's graphs, each run as its own code."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def own_code(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return make_boxed_func(gm.forward)

    def fused_code(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        run = _FusedRun(gm, device)

        def boxed(args: list[Any]) -> Any:
            try:
                return run.boxed_run(args)
            finally:
                # the interpreter keeps its last environment (the outputs); a kept gradient
                # would make AccumulateGrad copy it instead of taking it
                run.env = {}

        marked: Any = boxed
        marked._boxed_call = True  # AOTAutograd hands it its argument list to clear
        return marked

    def inductor_partition(joint: fx.GraphModule, inputs: Any, **options: Any) -> Any:
        return min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **options)

    inductor = backend == "inductor_fusion"
    partition: dict[str, Callable[..., Any]] = {
        "aot_eager": min_cut_rematerialization_partition,
        "inductor_fusion": inductor_partition,
    }
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
            fw_compiler=fused_code if inductor else own_code,
            bw_compiler=fused_code if inductor else own_code,
            partition_fn=partition.get(backend, default_partition),
            decompositions=select_decomp_table() if inductor else None,
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
        device = SimDevice(None, "memfit:compiled-step", cuda=cuda)
        forward = _compiled(call, args, backend, device) if backend != "eager" else call
        with device:
            device.adopt([*module.parameters(), *module.buffers()])
            device.adopt(arg for arg in args if isinstance(arg, torch.Tensor))
            device.reset_peak_memory_stats()
            for _ in range(steps):
                _one_step(forward, module, args, set_to_none)
        stats = device.memory_stats()
        module.zero_grad(set_to_none=True)
    return StepPeak(backend, stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"], steps)
