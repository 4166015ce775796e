"""Adapters on a frozen base (hand-written LoRA, peft's LoRA, an int8 base): no gradient and
no optimizer state for frozen weights, estimated to the byte of what the simulated GPU
measures; a quantized weight class fake tensors cannot hold (bitsandbytes') refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.estimator.estimate import estimate
from memfit.estimator.fake import UnsupportedOperation
from memfit.memory.allocator import round_size
from memfit.run.measure import measure

SIM = "sim:1GiB"


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (W x + B A x)."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Int8Linear(nn.Module):
    """A weight-only int8 base (per-row scales), dequantized in forward: plain torch ops."""

    def __init__(self, n: int) -> None:
        super().__init__()
        weight = torch.randn(n, n)
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.qweight.float() * self.scale).t()


def _mlp(base: Callable[[int], nn.Module], width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    blocks = [LoRALinear(base(width), width, width) for _ in range(3)]
    return nn.Sequential(*[m for block in blocks for m in (block, nn.ReLU())], nn.Linear(width, 10))


def _workload(model: Any, optimizer: Any = None) -> memfit.Workload:
    extra = {} if optimizer is None else {"optimizer": optimizer}
    return memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        **extra,
    )


def _adamw_state(model: nn.Module) -> int:
    """What AdamW keeps on the GPU for ``model``: exp_avg and exp_avg_sq per trainable parameter
    (its step counts are host tensors, as on CUDA: memory/tracker.py's rule)."""
    return sum(2 * round_size(p.nbytes) for p in model.parameters() if p.requires_grad)


def _agree(workload: memfit.Workload, batch: int = 8) -> memfit.Estimate:
    est = estimate(workload, batch, device=SIM, search=False)
    run = measure(workload, batch, SIM)
    assert (est.peak_allocated, est.peak_reserved) == (run.peak_allocated, run.peak_reserved)
    return est


@pytest.mark.parametrize("trainable_only", [True, False])
def test_a_lora_on_a_frozen_base_estimates_to_the_byte_with_state_only_for_the_adapters(trainable_only: bool) -> None:
    """Whether the user hands AdamW every parameter or only the trainable ones, frozen
    weights get neither a gradient nor optimizer state."""
    make = lambda: _mlp(lambda n: nn.Linear(n, n))  # noqa: E731
    optimizer = (lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad])) if trainable_only else None
    est = _agree(_workload(make, optimizer))
    model = make()
    frozen = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    trainable = sum(round_size(p.nbytes) for p in model.parameters() if p.requires_grad)
    assert frozen > 10 * trainable  # the base dominates, as in any LoRA
    assert est.breakdown["optimizer state"] == _adamw_state(model)
    assert est.breakdown["gradients"] <= trainable
    assert est.breakdown["parameters"] >= frozen


def test_the_same_model_fully_trained_holds_the_base_weights_state_too() -> None:
    """The control: unfreezing the base adds its gradients and AdamW state, so the tests
    above do tell frozen weights apart."""

    def unfrozen() -> nn.Module:
        model = _mlp(lambda n: nn.Linear(n, n))
        for p in model.parameters():
            p.requires_grad_(True)
        return model

    est = _agree(_workload(unfrozen))
    assert est.breakdown["optimizer state"] == _adamw_state(unfrozen())
    assert est.breakdown["optimizer state"] > 10 * _adamw_state(_mlp(lambda n: nn.Linear(n, n)))


def test_a_lora_on_an_int8_base_estimates_to_the_byte() -> None:
    """A quantized base whose kernels are torch ops runs on fake tensors: int8 weights are
    counted as int8 (a quarter of fp32), the dequantized copy as a temporary."""
    make = lambda: _mlp(Int8Linear)  # noqa: E731
    est = _agree(_workload(make))
    model = make()
    assert est.breakdown["optimizer state"] == _adamw_state(model)
    int8 = sum(b.nbytes for b in model.buffers() if b.dtype == torch.int8)
    assert int8 == 3 * 256 * 256


def test_a_model_instance_keeps_its_frozen_parameters_on_fake_tensors() -> None:
    est = _agree(_workload(_mlp(lambda n: nn.Linear(n, n))))
    assert est.breakdown["optimizer state"] == _adamw_state(_mlp(lambda n: nn.Linear(n, n)))


def test_peft_lora_on_a_tiny_llama_estimates_to_the_byte() -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def model() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (n, 32))
        return {"input_ids": ids, "labels": ids}

    workload = memfit.Workload(model=model, make_batch=batch, loss=lambda m, b: m(**b).loss)
    est = _agree(workload, batch=4)
    built = model()
    trainable = [name for name, p in built.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert est.breakdown["optimizer state"] == _adamw_state(built)


class PackedWeight(nn.Parameter):
    """A weight class made as bitsandbytes makes Params4bit and Int8Params
    (``Tensor._make_subclass`` over real storage)."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = False) -> PackedWeight:
        return torch.Tensor._make_subclass(cls, torch.empty(0) if data is None else data, requires_grad)


class PackedLinear(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = PackedWeight(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


@pytest.mark.parametrize("instance", [False, True])
def test_a_weight_class_fake_tensors_cannot_hold_is_refused_in_one_line(instance: bool) -> None:
    make = lambda: _mlp(PackedLinear)  # noqa: E731
    with pytest.raises(UnsupportedOperation) as info:
        estimate(_workload(make() if instance else make), 2, device=SIM, search=False)
    message = str(info.value)
    assert "\n" not in message and "PackedWeight" in message and "bitsandbytes" in message
    assert "memfit measure" in message
    assert measure(_workload(make), 2, SIM).fits  # the real steps run: only fake tensors cannot
