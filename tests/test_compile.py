"""A torch.compile'd workload is estimated as eager, and the estimate says so (result, JSON,
text) instead of saying nothing. Nothing here compiles: under memfit's dispatch modes
TorchDynamo runs the eager code (which is why the estimate is eager)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.cli import main
from memfit.estimator.compiled import CompileWatch, is_compiled_callable
from memfit.estimator.estimate import estimate
from memfit.run.measure import measure

SIM = "sim:256MiB"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batch(n: int) -> Any:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


def _workload(model: Any, loss: Callable[..., torch.Tensor] = _loss) -> memfit.Workload:
    return memfit.Workload(model=model, make_batch=_batch, loss=loss)


@torch.compile
def _fused_gelu(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x) * 2


class WithCompiledHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_fused_gelu(self.inp(x)))


def _compiled_in_place() -> nn.Module:
    model = _net()
    model[0].compile()
    return model


def _compiled_forward() -> nn.Module:
    model = _net()
    model.forward = torch.compile(model.forward)  # type: ignore[method-assign]
    return model


@pytest.mark.parametrize(
    ("model", "loss", "part"),
    [
        (lambda: torch.compile(_net()), _loss, "the model (torch.compile)"),
        (_compiled_in_place, _loss, "module '0' (Module.compile)"),
        (_compiled_forward, _loss, "the model's forward (torch.compile)"),
        (WithCompiledHelper, _loss, "a function called while the step runs (torch.compile)"),
        (_net, torch.compile(_loss), "loss (torch.compile)"),
    ],
)
def test_a_compiled_workload_is_estimated_as_eager_and_says_so(model: Any, loss: Any, part: str) -> None:
    est = estimate(_workload(model, loss), 16, device=SIM, search=False)
    assert est.compile_note.startswith("estimated as eager: ")
    assert part in est.compile_note and "TorchDispatchMode" in est.compile_note
    # the eager step's figures, as the simulated GPU measures them (it runs eager too)
    run = measure(_workload(model, loss), 16, SIM)
    assert (est.peak_allocated, est.peak_reserved) == (run.peak_allocated, run.peak_reserved)


def test_the_figures_are_the_eager_models() -> None:
    compiled = estimate(_workload(lambda: torch.compile(_net())), 16, device=SIM, search=False)
    eager = estimate(_workload(_net), 16, device=SIM, search=False)
    assert compiled.peak_allocated == eager.peak_allocated and compiled.breakdown == eager.breakdown
    assert eager.compile_note == ""


def test_a_compiled_model_instance_is_named_too() -> None:
    est = estimate(_workload(torch.compile(_net())), 16, device=SIM, search=False)
    assert "the model (torch.compile)" in est.compile_note


def test_the_watch_knows_compiled_callables_from_plain_ones() -> None:
    assert is_compiled_callable(torch.compile(_loss)) and not is_compiled_callable(_loss)
    watch = CompileWatch()
    watch.inspect_model(_net())
    watch.inspect_functions({"loss": _loss})
    assert watch.parts == [] and watch.note() == ""


WORKLOAD_FILE = """
import torch
from torch import nn
import memfit

def make():
    model = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    return memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
    )
"""


def test_the_command_line_shows_it_in_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "compiled_workload.py"
    path.write_text(textwrap.dedent(WORKLOAD_FILE))
    assert main(["estimate", f"{path}:make", "--device", SIM, "--batch-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["compile_note"].startswith("estimated as eager: the model (torch.compile)")
    assert main(["estimate", f"{path}:make", "--device", SIM, "--batch-size", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "torch.compile: estimated as eager" in out


# --- what a compiled forward keeps for backward (memfit.estimator.partitioner) ---------------


class _Cosines(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cos().cos()


class _GPTLayer(nn.Module):
    """A Megatron-style GPT layer in fp16: LayerNorm, fused QKV, math attention with a causal
    mask and dropout, projection, dropout, LayerNorm, 4h GeLU MLP, dropout."""

    def __init__(self, h: int, heads: int, s: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.ones(s, s, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1) * (h // self.heads) ** -0.5).masked_fill(self.mask, float("-inf"))
        y = (self.drop(scores.softmax(-1)) @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))


def test_the_partitioner_recomputes_a_pointwise_chain_eager_autograd_saves() -> None:
    from memfit.estimator.partitioner import saved_for_backward

    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _Cosines(), (torch.randn(1024, requires_grad=True),)

    eager = saved_for_backward(build, compiled=False)
    compiled = saved_for_backward(build, compiled=True)
    assert (eager.bytes, eager.storages) == (2 * 4096, 2)  # x and cos(x)
    assert (compiled.bytes, compiled.storages) == (4096, 1)  # x: cos(x) is recomputed in backward


def test_a_gpt_layer_keeps_megatrons_count_eager_and_compiled() -> None:
    """Korthikanti et al.'s 34sbh + 5as^2b bytes (16-bit activations, a 1-byte dropout mask)
    plus LayerNorm's saved statistics (2 x 2 x sb fp16 values), eager under CUDA's
    semantics; the min-cut partitioner keeps the same bytes for this layer (matmul outputs,
    random masks and softmax are not recomputed)."""
    from memfit.cuda.target import CudaTarget
    from memfit.estimator.partitioner import saved_for_backward
    from memfit.memory.gpus import lookup

    s, b, h, a = 64, 2, 64, 4

    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        try:
            layer = _GPTLayer(h, a, s)
        finally:
            torch.set_default_dtype(before)
        return layer, (torch.randn(b, s, h, dtype=torch.float16, requires_grad=True),)

    card = lookup("A100 80GB SXM")
    expected = 34 * s * b * h + 5 * a * s * s * b + 2 * 2 * s * b * 2
    eager = saved_for_backward(build, compiled=False, cuda=CudaTarget(card.compute_capability, name=card.name))
    assert eager.bytes == expected
    assert saved_for_backward(build, compiled=False).bytes > expected  # the CPU's dropout keeps a 2-byte mask
    assert saved_for_backward(build, compiled=True).bytes == expected


def _two_layers() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    layers = [nn.Linear(256, 256, bias=False), nn.GELU(), nn.Linear(256, 256, bias=False)]
    return nn.Sequential(*layers), (torch.randn(8, 256),)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "aot_eager_default_partitioner", "inductor_fusion"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_compiled_step_on_fake_tensors_peaks_as_the_same_graphs_on_real_ones(backend: str, set_to_none: bool) -> None:
    from memfit.estimator.compiled_step import step_peak

    fake = step_peak(_two_layers, backend=backend, set_to_none=set_to_none)
    real = step_peak(_two_layers, backend=backend, set_to_none=set_to_none, fake=False)
    assert (fake.peak_allocated, fake.peak_reserved) == (real.peak_allocated, real.peak_reserved)
    # what never leaves: both weights (256 KiB each) and the input, and with accumulation
    # both gradients; above it at most both new gradients and the 8 KiB activations
    weight = 256 * 256 * 4
    held = 2 * weight * (1 if set_to_none else 2) + 8 * 256 * 4
    assert held < fake.peak_allocated < held + 2 * weight + 64 * 1024


def test_aot_eagers_backward_graph_holds_every_new_gradient_at_once() -> None:
    """With gradients accumulating, eager autograd adds each layer's new gradient and frees
    it before the next layer's is made; the backward graph returns both together."""
    from memfit.estimator.compiled_step import step_peak

    eager = step_peak(_two_layers, backend="eager", fake=False)
    compiled = step_peak(_two_layers, backend="aot_eager", fake=False)
    assert compiled.peak_allocated - eager.peak_allocated >= 256 * 256 * 4
    # zeroed to None, AccumulateGrad keeps the new gradient itself: nothing to hold twice
    eager_none = step_peak(_two_layers, backend="eager", fake=False, set_to_none=True)
    compiled_none = step_peak(_two_layers, backend="aot_eager", fake=False, set_to_none=True)
    assert compiled_none.peak_allocated - eager_none.peak_allocated < 256 * 256 * 4


def test_an_unknown_backend_is_refused() -> None:
    from memfit.estimator.compiled_step import step_peak

    with pytest.raises(ValueError, match="backend must be one of"):
        step_peak(_two_layers, backend="inductor")


def test_inductors_fusion_model_allocates_no_pointwise_intermediate() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from memfit.estimator.compiled_step import fused_nodes

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x @ w) * 2.0).sum(0) @ w

    graph = make_fx(f)(torch.randn(4, 8), torch.randn(8, 8)).graph
    fused = {str(node.target).split(".")[1] for node in fused_nodes(graph)}
    # relu and mul feed only pointwise ops, tanh only a reduction; the matmul's result
    # is a kernel's output and the sum feeds a matmul: both written to memory
    assert fused == {"relu", "mul", "tanh"}


def test_the_fusion_model_holds_less_than_aot_eager_on_a_pointwise_chain() -> None:
    from memfit.estimator.compiled_step import step_peak

    def chain() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        layers = [nn.Linear(256, 1024, bias=False), nn.GELU(), nn.Tanh(), nn.Linear(1024, 256, bias=False)]
        return nn.Sequential(*layers), (torch.randn(64, 256),)

    aot = step_peak(chain, backend="aot_eager", fake=False, set_to_none=True)
    fused = step_peak(chain, backend="inductor_fusion", fake=False, set_to_none=True)
    # at least GELU's output (64 x 1024 floats), which only Tanh reads, is never written
    assert aot.peak_allocated - fused.peak_allocated >= 64 * 1024 * 4
