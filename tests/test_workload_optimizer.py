"""The optimizer factory may take the model (minGPT's configure_optimizers), or its parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit import Workload
from memfit.errors import WorkloadError
from memfit.workload.spec import optimizer_takes_model


class TinyGPT(nn.Module):
    """A minGPT-shaped model whose optimizer needs its modules to sort weights into groups."""

    def __init__(self, vocab: int = 32, width: int = 16, length: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(2)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.lm_head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.Optimizer:
        """minGPT's rule: Linear weights decay; biases, LayerNorm and Embedding weights do not."""
        decay, no_decay = set(), set()
        for module_name, module in self.named_modules():
            for name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if name.endswith("weight") and isinstance(module, nn.Linear):
                    decay.add(full)
                else:
                    no_decay.add(full)
        params = dict(self.named_parameters())
        assert decay | no_decay == set(params) and not decay & no_decay
        groups = [
            {"params": [params[n] for n in sorted(decay)], "weight_decay": weight_decay},
            {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


#: each optimizer made: its groups' weight decay and parameter count (not the optimizer
#: itself, which would keep every model alive: a leak probe and plan refuse)
made: list[list[tuple[float, int]]] = []


def gpt_workload(**kwargs: Any) -> Workload:
    def optimizer(model: TinyGPT) -> torch.optim.Optimizer:
        optimizer = model.configure_optimizers(weight_decay=0.1, lr=5e-4)
        made.append([(g["weight_decay"], len(g["params"])) for g in optimizer.param_groups])
        return optimizer

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = model(batch[0])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    return Workload(
        model=TinyGPT,
        make_batch=lambda n: (torch.randint(0, 32, (n, 8)), torch.randint(0, 32, (n, 8))),
        loss=loss,
        optimizer=optimizer,
        name="tiny-gpt",
        **kwargs,
    )


def test_which_form_a_factory_takes_is_read_from_its_signature() -> None:
    def annotated(net: nn.Module) -> None: ...

    def by_subclass(net: TinyGPT) -> None: ...

    assert optimizer_takes_model(lambda model: None) and optimizer_takes_model(lambda module: None)
    assert optimizer_takes_model(annotated) and optimizer_takes_model(by_subclass)
    assert not optimizer_takes_model(lambda params: None)
    assert not optimizer_takes_model(torch.optim.AdamW) and not optimizer_takes_model(memfit.workload.default_optimizer)


def test_an_optimizer_that_needs_the_model_gets_it_in_measure_estimate_and_plan() -> None:
    made.clear()
    workload = gpt_workload()
    measured = memfit.measure(workload, 4, "sim:64MiB")
    assert measured.fits and made, "measure ran the model-taking factory"
    assert made[-1] == [(0.1, 3), (0.0, 10)]  # the three Linear weights decay; biases, norms, embeddings not
    estimated = memfit.estimate(workload, 4, device="sim:64MiB", speed=False)
    assert estimated.peak_allocated == measured.peak_allocated  # fake and real agree to the byte
    plan = memfit.plan(workload, 8, "sim:64MiB", precisions=["fp32"], checkpointing=["none"])
    assert plan.recommended is not None and plan.recommended.fits


def test_a_factory_that_returns_no_optimizer_is_one_line() -> None:
    workload = Workload(
        model=TinyGPT,
        make_batch=lambda n: torch.randint(0, 32, (n, 8)),
        loss=lambda m, b: m(b).mean(),
        optimizer=lambda model: model.parameters(),
    )
    with pytest.raises(WorkloadError, match=r"its optimizer factory returned generator, not a torch\.optim\.Optimizer"):
        memfit.measure(workload, 2, "sim:64MiB")
