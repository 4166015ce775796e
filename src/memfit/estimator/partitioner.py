"""What a module's forward keeps for backward, eager and compiled, on fake tensors.

Eager: every tensor autograd saves in forward (a saved-tensors hook sees each one).
Compiled: the tensors ``torch.compile``'s default backend keeps, which AOTAutograd's
min-cut partitioner chooses (``min_cut_rematerialization_partition``, with inductor's
recomputable operations and decompositions): the forward graph's outputs past the
module's own. The joint graph is traced by ``aot_module_simplified`` with compilers that
run nothing, so TorchDynamo is not involved and no kernel is generated; shapes only.

Counted: the bytes of the distinct storages those tensors keep alive, a view counted as
its base, the parameters' and buffers' storages not counted (they live anyway); the
module's inputs are counted (in a stack of layers, one layer's input is the previous
one's output). This is the figure the two executions differ by; the temporaries inside
inductor's fused kernels are not modelled here, so it is not yet a compiled step's peak
(:mod:`memfit.estimator.compiled` keeps the estimate eager and says so).

>>> import torch
>>> def build():
...     return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), (torch.randn(4, 8),)
>>> saved_for_backward(build, compiled=False).bytes  # the input (for the weight's gradient), GELU's input
256
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from memfit.cuda.semantics import cuda_semantics
from memfit.cuda.target import CudaTarget

__all__ = ["SavedTensors", "saved_for_backward"]

Build = Callable[[], tuple[nn.Module, tuple[Any, ...]]]


@dataclass(frozen=True)
class SavedTensors:
    """What a forward keeps for backward (see the module)."""

    #: bytes of the distinct storages kept, less the parameters' and buffers'
    bytes: int
    #: how many distinct storages
    storages: int


class _Outputs(nn.Module):
    """The module with its outputs as a tuple (``aot_module_simplified`` takes no other)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> tuple[Any, ...]:
        return tuple(tree_leaves(self.module(*args)))


def saved_for_backward(build: Build, *, compiled: bool, cuda: CudaTarget | None = None) -> SavedTensors:
    """What the forward of the module ``build`` makes keeps for backward.

    Args:
        build: returns ``(module, args)``; called under a fresh fake-tensor mode, so a
            model of any size costs no memory (build it from its configuration).
        compiled: True for what inductor's partitioner keeps, False for eager autograd.
        cuda: eager only: run with this CUDA GPU's semantics (fused dropout's 1-byte mask,
            its attention kernels: :mod:`memfit.cuda.semantics`); None keeps the CPU's.
            The compiled graph is traced with inductor's decompositions (dropout becomes
            a random draw and a 1-byte mask there too), not with CUDA's kernels.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        module, args = build()
        states = {StorageWeakRef(t.untyped_storage()) for t in [*module.parameters(), *module.buffers()]}
        if compiled:
            return _partitioned(module, args)
        if cuda is None:
            return _eager(module, args, states)
        with cuda_semantics(cuda):
            return _eager(module, args, states)


def _distinct(tensors: Iterator[torch.Tensor], states: set[StorageWeakRef]) -> SavedTensors:
    seen: dict[StorageWeakRef, int] = {}
    for tensor in tensors:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in states:
            seen[ref] = tensor.untyped_storage().nbytes()
    return SavedTensors(sum(seen.values()), len(seen))


def _eager(module: nn.Module, args: tuple[Any, ...], states: set[StorageWeakRef]) -> SavedTensors:
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*args)
    return _distinct(iter(saved), states)


def _partitioned(module: nn.Module, args: tuple[Any, ...]) -> SavedTensors:
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    seen: dict[str, Any] = {}

    def partition(joint: fx.GraphModule, inputs: Any, *, num_fwd_outputs: int, **options: Any) -> Any:
        forward, backward = min_cut_rematerialization_partition(
            joint, inputs, compiler="inductor", num_fwd_outputs=num_fwd_outputs, **options
        )
        seen["forward"], seen["outputs"] = forward, num_fwd_outputs
        return forward, backward

    def nothing(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return make_boxed_func(gm.forward)

    # typed for a GraphModule, it traces any module (it reads named_parameters and calls it)
    wrapped: Any = _Outputs(module)
    aot_module_simplified(
        wrapped,
        list(args),
        fw_compiler=nothing,
        bw_compiler=nothing,
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )
    graph: fx.Graph = seen["forward"].graph
    output = next(node for node in graph.nodes if node.op == "output")
    kept = [node for node in output.args[0][seen["outputs"] :] if isinstance(node, fx.Node)]
    bases = {_base(node) for node in kept}
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    # the primals are the parameters and buffers, then the inputs, in that order
    state_count = len(dict(module.named_parameters(remove_duplicate=False))) + len(
        dict(module.named_buffers(remove_duplicate=False))
    )
    state_nodes = set(placeholders[:state_count])
    tensors = (
        node.meta["val"] for node in bases if node not in state_nodes and isinstance(node.meta.get("val"), torch.Tensor)
    )
    return _distinct(tensors, set())


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself when it is no view)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args:
        source = node.args[0]
        if not isinstance(source, fx.Node):
            break
        node = source
    return node
