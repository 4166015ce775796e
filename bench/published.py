"""Published real-GPU memory figures against memfit, Accelerate's estimator and DeepSpeed's formula.

Each row is a measurement someone published with the GPU, the torch/CUDA versions, what was
measured and the training settings; it is reproduced here as a workload built from config
classes (no weights downloaded) with the published model shapes, batch size, sequence
length, precision, optimizer, checkpointing and loop order, and run on fake tensors
(``memfit.estimate``, no real memory). memfit's figure is the published quantity:

- ``nvidia-smi`` (what the whole process holds): peak reserved + fixed costs (CUDA
  context for the stated CUDA version and module loading, cuBLAS workspaces);
- ``max_memory_reserved``: peak reserved (+ cuBLAS workspaces, inside the allocator
  since torch 2.0);
- ``max_memory_allocated`` / a profiler's memory timeline: peak allocated (+ the same).

Beside it, the two rules people use: Accelerate's ``estimate-memory`` ("Training using
Adam", the largest of its model / gradients / optimizer / step sizes from the parameter
count: ``accelerate.commands.estimate.estimate_training_usage``), and DeepSpeed's model
states (``estimate_zero2_model_states_mem_needs`` on one GPU: 4 + 16 bytes a parameter,
``deepspeed/runtime/zero/stage_1_and_2.py``) plus the activation formula of Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198, Sec. 4.1: ``s*b*h*(34 + 5*a*s/h)`` bytes a layer with 16-bit
activations, ``2*s*b*h`` with full recomputation; doubled here for fp32 activations).

No number here is tuned to a row: the workloads follow the published scripts, the fixed
costs come from :mod:`memfit.cuda.context`, whose figures name their own sources. Where the
software that was measured kept other tensors than the installed torch does, the workload
reproduces it (the 2022 Trainer's in-place ``zero_grad``; torch 1.10's softmax, which kept
its input for backward): memfit itself models the installed torch. Rows
whose error depends on the CUDA-semantics layer (issue 13: 1 attention kernels, 2 CUDA
autocast lists, 5 bool dropout masks, 7 dtype-changing factories) say which.

Writes the "published" section of docs/benchmarks.md and prints the table.
Run: .venv/bin/python bench/published.py [--only KEY ...] [--no-write]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from torch import nn

import memfit
from _results import write_section
from memfit.cuda.context import cublas_workspace_in_allocator
from memfit.estimator.estimate import Estimate, estimate
from memfit.run.settings import Settings
from memfit.units import GiB, MiB, format_size
from memfit.workload import Workload

COMMAND = "python bench/published.py"
#: what the published runs had: none of these set (memfit's fixed costs read them)
_USER_SETTINGS = ("CUDA_MODULE_LOADING", "CUBLAS_WORKSPACE_CONFIG", "CUDNN_CONV_WSCAP_DBG")

Quantity = Literal["nvidia-smi", "max_memory_reserved", "max_memory_allocated"]


# -- loop semantics of the published scripts ----------------------------------------------


class KeepGradsAdamW(torch.optim.AdamW):
    """AdamW whose ``zero_grad`` zeroes gradients in place instead of freeing them.

    Why: the transformers Trainer of January 2022 called ``model.zero_grad()``, which on
    torch 1.x kept every gradient allocated (``set_to_none=False`` was the default until
    torch 2.0), so the next forward ran with the gradients still there.
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


def _keep_grads_adafactor(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The Trainer's ``optim="adafactor"`` of January 2022, gradients kept (see KeepGradsAdamW)."""
    import transformers

    class KeepGradsAdafactor(transformers.Adafactor):  # type: ignore[misc]
        def zero_grad(self, set_to_none: bool = True) -> None:
            super().zero_grad(set_to_none=False)

    return KeepGradsAdafactor(params, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False)


class Adam2023(torch.optim.Adam):
    """Adam (foreach, one param group, no weight decay, amsgrad or maximize) as the torch
    nightlies of June 2023 stepped it: two parameter-sized intermediates alive at once.

    Why: until July 2023 ``_multi_tensor_adam`` made ``exp_avg_sq_sqrt`` and then
    ``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``, a second copy the size of every
    parameter, held together through the update (pytorch/pytorch#97712, "Foreach optimizers
    use higher memory due to intermediates"; the Adam family reduced to one intermediate by
    janeyx99's PRs of July 2023, such as #104898 for AdamW, closed as done with #105193 on
    2023-07-31). Raschka's ViT runs used torch 2.1.0.dev20230623. memfit models the
    installed torch, whose Adam adds ``eps`` in place; this reproduces the software measured.
    Where the step sets the peak (small batches, bf16-true) the difference is one copy of the
    parameters.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None and len(self.param_groups) == 1
        group = self.param_groups[0]
        assert not group["amsgrad"] and not group["maximize"] and group["weight_decay"] == 0
        beta1, beta2 = group["betas"]
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            if not self.state[p]:
                self.state[p]["step"] = 0  # a Python number: no value read from a tensor
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.state[p]["step"] += 1
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        step_size = [-group["lr"] / (1 - beta1**n) for n in steps]
        bias_correction2_sqrt = [math.sqrt(1 - beta2**n) for n in steps]
        exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
        denom = torch._foreach_add(exp_avg_sq_sqrt, group["eps"])  # the second intermediate
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


class ZeroGradInLossAdam(Adam2023):
    """Adam (as of June 2023) whose ``zero_grad`` does nothing: the loss function frees the gradients instead.

    Why: Raschka's scripts call ``optimizer.zero_grad()`` after the forward and before
    ``backward()``, so the previous step's gradients are alive through the forward; memfit's
    step frees them right after ``optimizer.step()``. The loss (:func:`_loss_then_zero_grad`)
    frees them where the script does.
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class ZeroGradInLossTorchAdam(torch.optim.Adam):
    """The installed torch's Adam with the same ``zero_grad`` as :class:`ZeroGradInLossAdam`:
    the row without the reproduction of 2023's Adam."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _loss_then_zero_grad(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    features, targets = batch
    loss = F.cross_entropy(model(features), targets)
    for parameter in model.parameters():  # optimizer.zero_grad() with torch 2's set_to_none=True
        parameter.grad = None
    return loss


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


# -- BERT-large (transformers docs) ------------------------------------------------------------


class _SoftmaxKeepingInput(torch.autograd.Function):
    """``softmax`` as the autograd of torch <= 1.10 ran it: its backward node kept the input too.

    Why: torch up to 1.10 saved both ``self`` and ``result`` for softmax's backward
    (tools/autograd/derivatives.yaml: ``self: _softmax_backward_data(grad, result, dim,
    self)``), though the backward reads only the output: pytorch/pytorch#49600 ("softmax(input,
    dim) doesn't need to save input for backward computation"), fixed by pytorch/pytorch#65242
    (relanded as #66018 on 2021-10-01, after the 1.10 branch cut of 2021-09-21: first released
    in torch 1.11, March 2022). In BERT's eager attention that input is the (batch, heads,
    seq, seq) scores, kept for every layer until its backward. memfit models the installed
    torch, which frees them; this reproduces the software the docs measured.
    """

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, dim: int) -> torch.Tensor:
        probs = torch.softmax(scores, dim)
        ctx.dim = dim
        ctx.save_for_backward(scores, probs)  # the input as well: what torch 1.10 kept
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scores, probs = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, ctx.dim, scores.dtype), None


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cuda", "cpu"))


def _eager_attention_torch110(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager BERT attention (4.15's ``BertSelfAttention``: scores, softmax,
    dropout, product with the values) with torch 1.10's softmax (:class:`_SoftmaxKeepingInput`).

    Under autocast, CUDA's autocast ran softmax in fp32 (its fp32 list) and the cast sat
    above autograd, so the input kept was the fp32 scores: cast here before the node. (4.15
    added its all-zero fp32 mask to the fp16 scores, which made the same fp32 tensor.)
    """
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    if _autocast_on() and scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    probs = _SoftmaxKeepingInput.apply(scores, -1)
    probs = F.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return output, probs


#: the attention implementation the BERT rows register with transformers
BERT_ATTENTION = "eager-torch1.10"


def bert_large(
    adafactor: bool = False,
    *,
    layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    seq_len: int = 512,
    vocab: int = 30522,
    attention: str = BERT_ATTENTION,
) -> Workload:
    """``bert-large-uncased`` for sequence classification (2 labels) as the docs trained it.

    Eager attention: transformers 4.15 had no SDPA path; its softmax keeps its input, as the
    torch of January 2022 did (:class:`_SoftmaxKeepingInput`; ``attention="eager"`` gives
    the installed torch's softmax instead). The batch is the docs' dummy data: token ids in
    [100, 30000), sequences of 512, binary labels, no attention mask.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.AttentionInterface.register(BERT_ATTENTION, _eager_attention_torch110)
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
        num_labels=2,
        attn_implementation=attention,
    )

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(100, min(30000, vocab), (n, seq_len))
        return {"input_ids": ids, "labels": torch.randint(0, 2, (n,))}

    def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        # Trainer default in 4.15: AdamW, lr 5e-5, no weight decay, a per-parameter loop
        return KeepGradsAdamW(params, lr=5e-5, weight_decay=0.0, foreach=False)

    return Workload(
        model=lambda: transformers.BertForSequenceClassification(config),
        make_batch=make_batch,
        loss=_hf_loss,
        optimizer=_keep_grads_adafactor if adafactor else optimizer,
        name="bert-large-uncased (seq cls)",
    )


# -- ViT-L/16 (torchvision's architecture, pure torch) -------------------------------------


class EncoderBlock(nn.Module):
    """torchvision's ``EncoderBlock``: pre-norm attention (nn.MultiheadAttention) and MLP."""

    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden), nn.Dropout(0.0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """torchvision's ``VisionTransformer`` (``vit_l_16``: patch 16, 24 layers, width 1024,
    16 heads, MLP 4096), with the 10-class head Raschka's scripts put in place."""

    def __init__(
        self, image_size: int = 224, patch: int = 16, layers: int = 24, hidden: int = 1024, heads: int = 16,
        mlp: int = 4096, classes: int = 10,
    ) -> None:  # fmt: skip
        super().__init__()
        self.patch, self.hidden = patch, hidden
        self.conv_proj = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        tokens = (image_size // patch) ** 2 + 1
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(*(EncoderBlock(hidden, heads, mlp) for _ in range(layers)))
        self.ln = nn.LayerNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        x = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return self.head(x[:, 0])


def vit_l16(
    bf16_true: bool = False, zero_grad_after_forward: bool = True, *, layers: int = 24, hidden: int = 1024,
    heads: int = 16, image_size: int = 224, adam_2023: bool = True,
) -> Workload:  # fmt: skip
    """Raschka's ViT-L/16 fine-tuning on CIFAR-10 resized to 224: Adam, lr 5e-5.

    ``bf16_true``: Lightning Fabric's ``precision="bf16-true"``: the model and the inputs
    in bfloat16 (``model.to(torch.bfloat16)``), no autocast. ``adam_2023``: Adam as the
    measured torch stepped it (:class:`Adam2023`); False: the installed torch's Adam.
    """
    dtype = torch.bfloat16 if bf16_true else torch.float32

    def build() -> nn.Module:
        model = VisionTransformer(image_size, 16, layers, hidden, heads, 4 * hidden, 10)
        return model.to(torch.bfloat16) if bf16_true else model

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(n, 3, image_size, image_size, dtype=dtype), torch.randint(0, 10, (n,))

    def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if zero_grad_after_forward:
            return (ZeroGradInLossAdam if adam_2023 else ZeroGradInLossTorchAdam)(params, lr=5e-5)
        return (Adam2023 if adam_2023 else torch.optim.Adam)(params, lr=5e-5)

    def plain_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    return Workload(
        model=build,
        make_batch=make_batch,
        loss=_loss_then_zero_grad if zero_grad_after_forward else plain_loss,
        optimizer=optimizer,
        name="ViT-L/16 (torchvision)",
    )


# -- GPT-2 (Hugging Face forum) ------------------------------------------------------------


def gpt2(*, layers: int = 12, hidden: int = 768, heads: int = 12, seq_len: int = 512, vocab: int = 50257) -> Workload:
    """GPT-2 124M causal-LM fine-tuning with the Trainer's defaults of transformers 4.57.

    SDPA attention (the default), dropout 0.1 everywhere, blocks of 512 tokens with an
    all-ones attention mask (DataCollatorForLanguageModeling), fused AdamW (the Trainer's
    default optimizer for torch >= 2.8: ``transformers/training_args.py``), lr 5e-5.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, use_cache=False)

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq_len))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    return Workload(
        model=lambda: transformers.GPT2LMHeadModel(config),
        make_batch=make_batch,
        loss=_hf_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, fused=True),
        name="gpt2 (causal LM)",
    )


# -- the rows ------------------------------------------------------------------------------

_HF_DOCS = (
    "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one (also model_memory_anatomy), "
    "transformers docs/source/en/perf_train_gpu_one.mdx"
)
_HF_DOCS_GPU = "Tesla V100-SXM2 16GB (nvidia-smi 16160MiB), driver 460.91.03"
_HF_DOCS_VERSIONS = (
    "torch not stated: measured on 11 Jan 2022 (the page's nvidia-smi output), when the newest torch release was "
    "1.10.1 (1.11: March 2022); driver CUDA 11.2; transformers ~4.15"
)
_RASCHKA = "https://github.com/rasbt/pytorch-memory-optim (logs.md), the code of Raschka, 'Optimizing Memory Usage for Training LLMs and Vision Transformers in PyTorch' (Lightning AI blog, 2023)"
_RASCHKA_VERSIONS = "torch 2.1.0.dev20230623+cu118, lightning 2.1.0.dev0"
_FORUM = "https://discuss.huggingface.co/t/gpt-2-finetuning-peaks-at-8-gib-of-vram/172332"


@dataclass(frozen=True)
class Transformer:
    """Shapes for the activation formula of Korthikanti et al.: layers, hidden, heads, tokens."""

    layers: int
    hidden: int
    heads: int
    seq_len: int


@dataclass(frozen=True)
class Row:
    """One published measurement and how it is reproduced."""

    key: str
    family: str
    source: str
    section: str
    gpu: str  # as published
    gpu_table: str  # the name in memfit's GPU table
    versions: str
    cuda: str  # the CUDA of the torch build, for the CUDA context
    torch: str  # the torch release, for where cuBLAS's workspace lives
    quantity: Quantity
    measured: int
    setup: str  # the workload's shapes and settings, in words
    builder: Callable[..., Workload]
    options: dict[str, Any]
    batch_size: int
    settings: Settings
    shapes: Transformer
    accelerate_dtype: Literal["float32", "float16"]
    depends_on: tuple[int, ...]
    limits: str  # what keeps memfit from the figure, as far as known
    note: str = ""
    #: the builder options that replace the reproduction of the measured software (an older
    #: torch's softmax or Adam) with the installed torch's own; None: the row reproduces none
    installed: dict[str, Any] | None = None

    def workload(self) -> Workload:
        """The workload at the published shapes, as the measured software ran it."""
        return self.builder(**self.options)

    def installed_workload(self) -> Workload | None:
        """The same workload with the installed torch's semantics (None: no reproduction to remove)."""
        return None if self.installed is None else self.builder(**{**self.options, **self.installed})

    def tiny_workload(self) -> Workload:
        """The same workload (model code, optimizer, loop order, dtype) at a few-KiB size, for tests."""
        return self.builder(**self.options, **_TINY[self.family])

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation element: 4 in fp32, 2 under autocast or with a bf16 model."""
        return 4 if self.settings.precision == "fp32" and not self.options.get("bf16_true") else 2


_BERT = Transformer(24, 1024, 16, 512)
_VIT = Transformer(24, 1024, 16, 197)
_GPT2 = Transformer(12, 768, 12, 512)
#: shapes small enough that a fake step takes a fraction of a second
_TINY: dict[str, dict[str, int]] = {
    "BERT": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 1000},
    "ViT": {"layers": 2, "hidden": 64, "heads": 2, "image_size": 32},
    "GPT-2": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 1000},
}

#: what limits memfit on every row of a family (the table prints it once, under the sources)
FAMILY_LIMITS: dict[str, str] = {
    "BERT": (
        "Reproduced as the docs ran it: transformers 4.15's eager attention (it had no SDPA) with dropout 0.1, "
        "whose fused CUDA kernel memfit emulates (a 1-byte mask), CUDA autocast's lists (softmax in fp32), and "
        "softmax as torch <= 1.10's autograd ran it, keeping its input as well as its output: one fp32 (heads, "
        "seq, seq) tensor a layer more, 0.375 GiB a sample (pytorch/pytorch#49600, fixed by #65242 / #66018 "
        "after the 1.10 branch cut, first released in torch 1.11). The page names no torch version; it was "
        "measured when 1.10.1 was the newest release. With the installed torch's softmax instead (a scratch run, "
        "attention='eager'), the batch-4 rows come out 10-14 % low and the batch-1 row without checkpointing "
        "6 % low; with checkpointing no layer's softmax input outlives its recompute and those rows move by "
        "0.1 % or less. What is left (within -4 %, most in fp16 at batch 4) is not identified: candidates are cuBLAS's kernels, loaded at its "
        "first call with eager module loading (CUDA < 11.7), outside the 1343 MiB context the docs measured "
        "and with no published size, and torch 1.10's other kernels."
    ),
    "ViT": (
        "nn.MultiheadAttention's SDPA without a mask and no dropout (p = 0): CUDA's flash kernel in 16 bits, "
        "the memory-efficient one in fp32, as memfit emulates them; layer_norm in fp32 under fp16 autocast "
        "(CUDA's lists); the bf16 model made by model.to(torch.bfloat16); Adam stepped as the torch nightly "
        "of June 2023 stepped it, with two parameter-sized intermediates where the installed torch has one "
        "(pytorch/pytorch#97712; the workload's `Adam2023`): with the installed torch's Adam (a scratch run) "
        "the micro-batch-4 row, whose peak is the optimizer step, comes out 12.6 % low, one bf16 copy of the "
        "parameters, and the other rows move by 0.2 % or less. The fp32 row agrees within 1 %; the batch-64 "
        "and batch-16 16-bit rows are 0.25-1.0 GiB low, not identified. Fragmentation over the script's ~700 steps explains "
        "a part at most: memfit's allocator model run for 32 steps instead of its 2 (a scratch run) reserves "
        "0.13 GiB more on bf16 batch 16 (still growing, about 0.025 GiB each time the steps double), 0.1 GiB "
        "more on 16-mixed and nothing more on bf16 batch 64 and micro-batch 4. Other candidates: the cuDNN "
        "workspace of the 16-bit patch convolution (sized by cuDNN at run time, not modelled) and torch 2.1's "
        "kernels against the installed torch's."
    ),
    "GPT-2": (
        "SDPA with dropout 0.1 in fp32: CUDA's memory-efficient kernel, which keeps the output and the "
        "log-sum-exp (not the math path's (b, h, s, s) probabilities and masks), and the other dropouts' "
        "1-byte masks, as memfit emulates them. The figure is read off a profiler plot (about 8 GiB)."
    ),
}


def _bert_row(
    key: str, section: str, measured_mib: int, setup: str, batch_size: int, settings: Settings, adafactor: bool = False
) -> Row:
    """A row of the transformers docs' bert-large experiments (V100, nvidia-smi, CUDA 11.2)."""
    mixed = settings.precision != "fp32"
    limits = "-"
    return Row(
        key=key,
        family="BERT",
        source=_HF_DOCS,
        section=section,
        gpu=_HF_DOCS_GPU,
        gpu_table="V100 SXM2 16GB",
        versions=_HF_DOCS_VERSIONS,
        cuda="11.2",
        torch="1.10",
        quantity="nvidia-smi",
        measured=measured_mib * MiB,
        setup=setup,
        builder=bert_large,
        options={"adafactor": True} if adafactor else {},
        batch_size=batch_size,
        settings=settings,
        shapes=_BERT,
        accelerate_dtype="float16" if mixed else "float32",
        depends_on=(2, 5) if mixed else (5,),
        limits=limits,
        note="Accelerate and DeepSpeed assume Adam" if adafactor else "",
        installed={"attention": "eager"},  # transformers' eager attention, the installed torch's softmax
    )


def _vit_row(
    key: str, section: str, measured_gb: float, setup: str, batch_size: int, settings: Settings, **options: Any
) -> Row:
    """A row of Raschka's ViT-L/16 experiments (A100, ``max_memory_reserved`` printed in GB)."""
    bf16_true = bool(options.get("bf16_true"))
    if bf16_true:
        depends_on = (7, 1)
        limits = "16-bit: see the family's text"
    elif settings.precision == "fp16":
        depends_on = (1, 2)
        limits = "16-bit: see the family's text"
    else:
        depends_on = (1,)
        limits = "-"
    return Row(
        key=key,
        family="ViT",
        source=_RASCHKA,
        section=section,
        gpu="A100 (the article)",
        gpu_table="A100 40GB",
        versions=_RASCHKA_VERSIONS,
        cuda="11.8",
        torch="2.1",
        quantity="max_memory_reserved",
        measured=int(measured_gb * 1e9),
        setup=setup,
        builder=vit_l16,
        options=options,
        batch_size=batch_size,
        settings=settings,
        shapes=_VIT,
        accelerate_dtype="float32" if settings.precision == "fp32" and not bf16_true else "float16",
        depends_on=depends_on,
        limits=limits,
        installed={"adam_2023": False},
    )


_FP16 = Settings(precision="fp16")
_ACC4 = Settings(accumulation_steps=4)
_ACC4_CKPT = Settings(accumulation_steps=4, checkpointing="blocks")
_FP16_ACC4_CKPT = Settings(precision="fp16", accumulation_steps=4, checkpointing="blocks")
_BERT_SETUP = (
    "bert-large-uncased seq-cls, seq 512, AdamW (Trainer: lr 5e-5, per-parameter loop), grads kept by zero_grad"
)
_VIT_SETUP = "ViT-L/16 (torchvision), 224x224, 10 classes, Adam lr 5e-5 (foreach), zero_grad after the forward"

ROWS: tuple[Row, ...] = (
    _bert_row("bert-fp32-b4", "Vanilla Training", 14949, f"{_BERT_SETUP}; batch 4, fp32", 4, Settings()),
    _bert_row("bert-fp32-b1x4", "Gradient Accumulation", 8681, "batch 1, accumulation 4, fp32", 1, _ACC4),
    _bert_row(
        "bert-fp32-b1x4-ckpt",
        "Gradient Checkpointing",
        6775,
        "batch 1, accumulation 4, checkpointing (reentrant in 2022, non-reentrant here), fp32",
        1,
        _ACC4_CKPT,
    ),
    _bert_row("bert-fp16-b4", "FP16 Training", 13939, "batch 4, fp16 autocast + GradScaler", 4, _FP16),
    _bert_row(
        "bert-fp16-b1x4-ckpt", "FP16 Training (+ the previous)", 7275, "batch 1, acc. 4, ckpt, fp16", 1, _FP16_ACC4_CKPT
    ),
    _bert_row(
        "bert-adafactor-b4",
        "Adafactor",
        12295,
        "batch 4, fp32, Adafactor (Trainer optim='adafactor': lr 5e-5, no relative step)",
        4,
        Settings(),
        adafactor=True,
    ),
    _bert_row(
        "bert-adafactor-fp16-b1x4-ckpt",
        "Adafactor (+ the previous)",
        4847,
        "batch 1, acc. 4, ckpt, fp16, Adafactor",
        1,
        _FP16_ACC4_CKPT,
        adafactor=True,
    ),
    _vit_row("vit-fp32-b64", "01_pytorch-vit.py", 26.79, f"{_VIT_SETUP}; batch 64, fp32", 64, Settings()),
    _vit_row(
        "vit-fp16mixed-b64",
        "02_mixed-precision.py",
        18.21,
        "batch 64, Fabric precision='16-mixed' (fp16 autocast + GradScaler)",
        64,
        _FP16,
    ),
    _vit_row(
        "vit-bf16true-b64",
        "03-bfloat16.py",
        13.82,
        "batch 64, Fabric precision='bf16-true' (model, inputs and Adam states in bf16)",
        64,
        Settings(),
        bf16_true=True,
    ),
    _vit_row("vit-bf16true-b16", "04_lower-batchsize.py", 5.69, "bf16-true, batch 16", 16, Settings(), bf16_true=True),
    _vit_row(
        "vit-bf16true-b4x4",
        "05_gradient-accum.py",
        3.91,
        "bf16-true, micro-batch 4, accumulation 4, zero_grad after the step",
        4,
        _ACC4,
        bf16_true=True,
        zero_grad_after_forward=False,
    ),
    Row(
        key="gpt2-fp32-b8",
        family="GPT-2",
        source=_FORUM,
        section="first post (torch profiler memory timeline)",
        gpu="not stated",
        gpu_table="A100 40GB",
        versions="torch 2.9.1, transformers 4.57.3, accelerate 1.12.0; CUDA not stated",
        cuda="12.8",
        torch="2.9",
        quantity="max_memory_allocated",
        measured=8 * GiB,
        setup="gpt2 124M causal LM, block 512, batch 8 (Trainer default), fp32, AdamW (fused), dropout 0.1",
        builder=gpt2,
        options={},
        batch_size=8,
        settings=Settings(),
        shapes=_GPT2,
        accelerate_dtype="float32",
        depends_on=(1, 5),
        limits="the GPU is not stated: SDPA's kernel is the memory-efficient one for fp32 on every recent GPU",
        note="the profiler's timeline is allocated memory; the GPU only decides the attention kernel",
    ),
)


# -- the other estimators -------------------------------------------------------------------


def parameter_count(workload: Workload) -> int:
    """Parameters of the workload's model, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = workload.build_model()
    return sum(p.numel() for p in model.parameters())


def accelerate_estimate(workload: Workload, dtype: str) -> int:
    """``accelerate estimate-memory``'s "Training using Adam" for the fp32 checkpoint.

    The same functions its command calls: ``calculate_maximum_sizes`` on an empty model,
    then ``estimate_training_usage``, whose largest entry the command prints.
    """
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    with torch.device("meta"):
        model = workload.build_model().float()
    total, _ = calculate_maximum_sizes(model)
    return int(max(estimate_training_usage(total, dtype).values()))


def deepspeed_estimate(params: int, row: Row) -> int:
    """DeepSpeed's model states on one GPU plus Korthikanti et al.'s activations."""
    states = 4 * params + 16 * params  # estimate_zero2_model_states_mem_needs, 1 GPU, no offload
    shapes = row.shapes
    s, b, h, a = shapes.seq_len, row.batch_size, shapes.hidden, shapes.heads
    if row.settings.checkpointing == "blocks":
        per_layer = 2 * s * b * h
    else:
        per_layer = s * b * h * (34 + 5 * a * s / h)
    scale = row.activation_bytes // 2  # the paper counts 16-bit activations
    return int(states + shapes.layers * per_layer * scale)


# -- running a row --------------------------------------------------------------------------


@dataclass
class Result:
    row: Row
    memfit: int | None
    accelerate: int
    deepspeed: int
    seconds: float
    failure: str = ""
    estimate: Estimate | None = None
    #: memfit's figure for the installed torch's semantics (the row's own figure where it reproduces nothing)
    memfit_installed: int | None = None

    def error(self, predicted: int | None) -> float | None:
        if predicted is None:
            return None
        return 100.0 * (predicted - self.row.measured) / self.row.measured


def memfit_figure(row: Row, est: Estimate) -> int:
    """memfit's value of the quantity the row measured (see the module)."""
    in_allocator = est.fixed_costs.get("cublas workspace", 0) if cublas_workspace_in_allocator(row.torch) else 0
    if row.quantity == "nvidia-smi":
        return est.total
    if row.quantity == "max_memory_reserved":
        return est.peak_reserved + in_allocator
    return est.peak_allocated + in_allocator


def run_row(row: Row) -> Result:
    """memfit, Accelerate and DeepSpeed for one row; memfit's failure is reported, not raised."""
    started = time.perf_counter()
    workload = row.workload()
    params = parameter_count(workload)
    accelerate = accelerate_estimate(workload, row.accelerate_dtype)
    deepspeed = deepspeed_estimate(params, row)
    try:
        est = estimate(workload, row.batch_size, row.settings, gpu=row.gpu_table, cuda_version=row.cuda, search=False)
        installed = row.installed_workload()
        plain = est
        if installed is not None:
            plain = estimate(
                installed, row.batch_size, row.settings, gpu=row.gpu_table, cuda_version=row.cuda, search=False
            )
    except Exception as error:  # noqa: BLE001 - a row memfit cannot estimate yet is a result, with its reason
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        return Result(
            row, None, accelerate, deepspeed, time.perf_counter() - started, f"{type(error).__name__}: {message}"
        )
    return Result(
        row,
        memfit_figure(row, est),
        accelerate,
        deepspeed,
        time.perf_counter() - started,
        estimate=est,
        memfit_installed=memfit_figure(row, plain),
    )


#: the summary lines: memfit as measured (era reproductions), memfit on the installed torch, the others
HEADLINES = (
    ("memfit (the measured software reproduced)", "memfit"),
    ("memfit (the installed torch's semantics only)", "memfit_installed"),
    ("Accelerate", "accelerate"),
    ("DeepSpeed + activations", "deepspeed"),
)


def _pct(value: float | None) -> str:
    return "fails" if value is None else f"{value:+.1f} %"


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def summary(results: list[Result], attr: str) -> tuple[float, float, int]:
    """Median and worst |error| over the rows that ran, and how many did not."""
    errors = [abs(e) for r in results if (e := r.error(getattr(r, attr))) is not None]
    missing = len(results) - len(errors)
    if not errors:
        return math.nan, math.nan, missing
    return statistics.median(errors), max(errors), missing


def markdown(results: list[Result], seconds: float) -> str:
    families = sorted({r.row.family for r in results})
    lines = [
        "## Published real-GPU measurements: memfit, Accelerate, DeepSpeed",
        "",
        f"Command: `{COMMAND}` ({platform.machine()}, memfit {memfit.__version__}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; {seconds:.0f} s). Every row is a figure someone measured on a real GPU, "
        "reproduced as a workload built from config classes (no weights) and run on fake tensors; error = "
        "(predicted - measured) / measured. memfit's figure is the quantity the row measured: nvidia-smi = "
        "peak reserved + CUDA context (for the row's CUDA, module loading and GPU) + cuBLAS workspaces; "
        "max_memory_reserved = peak reserved (+ cuBLAS workspaces, inside the allocator since torch 2.0); "
        "allocated = peak allocated (+ the same). Accelerate: `accelerate estimate-memory`'s \"Training using "
        'Adam" (its `estimate_training_usage` on the fp32 parameter count; float16 column for mixed '
        "precision). DeepSpeed: `estimate_zero2_model_states_mem_needs` on one GPU (20 bytes a parameter) + "
        "Korthikanti et al. 2022 activations (`s*b*h*(34 + 5*a*s/h)` a layer, `2*s*b*h` with checkpointing, "
        "x2 for fp32). Target for memfit: median |error| <= 5 %, worst <= 10 %.",
        "",
    ]
    for label, attr in HEADLINES:
        median, worst, missing = summary(results, attr)
        extra = f" ({missing} row(s) memfit cannot estimate yet, left out)" if missing else ""
        lines.append(f"- **{label}: median |error| {median:.1f} %, worst {worst:.1f} %**{extra}")
    reproduced = sum(r.row.installed is not None for r in results)
    lines += [
        "",
        f"The first line reproduces the software each row was measured with where it differs from the "
        f"installed torch in what it keeps ({reproduced} of {len(results)} rows: torch <= 1.10's softmax for "
        "the BERT rows, the foreach Adam of June 2023 for the ViT rows; both were added after the residuals "
        "were seen, with their sources below); the second is memfit on the installed torch's semantics alone, "
        "the figure a user of today's torch gets for the same model.",
    ]
    lines += [
        "",
        f"{len(results)} rows, {len(families)} model families ({', '.join(families)}), fp32 and mixed precision.",
        "",
        "| row | measured | memfit | error | memfit, installed torch | error | Accelerate | error | "
        "DeepSpeed + act. | error | depends on (issue 13) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        items = ", ".join(str(i) for i in r.row.depends_on)
        installed = f"{_size(r.memfit_installed)} | {_pct(r.error(r.memfit_installed))}"
        if r.row.installed is None:
            installed = "(the same) | "
        lines.append(
            f"| `{r.row.key}` | {format_size(r.row.measured)} ({r.row.quantity}) | {_size(r.memfit)} | "
            f"{_pct(r.error(r.memfit))} | {installed} | {format_size(r.accelerate)} | {_pct(r.error(r.accelerate))} | "
            f"{format_size(r.deepspeed)} | {_pct(r.error(r.deepspeed))} | {items} |"
        )
    lines += ["", "The sources, and what limits memfit on all of a source's rows:", ""]
    lines += ["| family | source | GPU | versions | measured | what limits memfit |", "|---|---|---|---|---|---|"]
    for family in dict.fromkeys(r.row.family for r in results):
        row = next(r.row for r in results if r.row.family == family)
        lines.append(
            f"| {family} | {row.source} | {row.gpu} | {row.versions} | {row.quantity} | {FAMILY_LIMITS[family]} |"
        )
    lines += ["", "Each row: where in its source, the workload, and what else limits memfit on it:", ""]
    lines += ["| row | section | workload | what else limits memfit |", "|---|---|---|---|"]
    for r in results:
        limits = r.row.limits + (f" (memfit fails: {r.failure})" if r.failure else "")
        note = f" {r.row.note}." if r.row.note else ""
        lines.append(f"| `{r.row.key}` | {r.row.section} | {r.row.setup}.{note} | {limits} |")
    lines += [
        "",
        "Issue 13's items: 1 attention kernels (CUDA's flash / memory-efficient saves instead of the CPU's "
        "math path), 2 CUDA autocast lists, 5 CUDA's 1-byte dropout masks, 7 model factories that change "
        "dtype. The CUDA context figures are in `src/memfit/cuda/context.py` with their sources; the V100 "
        "rows' 1341 MiB context is the docs' own measurement of the same machine (1343 MiB less the 2 MiB "
        "segment of the tiny tensor). The BERT rows' softmax keeps its input as torch 1.10's did (the "
        "workload's `_SoftmaxKeepingInput`, with its sources), and the ViT rows' Adam keeps the intermediates "
        "of torch's foreach Adam before July 2023 (`Adam2023`, with its sources); memfit's own semantics are "
        "the installed torch's.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="row keys to run (default: all)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    for name in _USER_SETTINGS:
        os.environ.pop(name, None)
    rows = [row for row in ROWS if args.only is None or row.key in args.only]
    started = time.perf_counter()
    results = []
    for row in rows:
        result = run_row(row)
        results.append(result)
        print(
            f"{row.key:32s} measured {format_size(row.measured):>11s}  memfit {_size(result.memfit):>11s} "
            f"({_pct(result.error(result.memfit)):>9s}; installed torch {_pct(result.error(result.memfit_installed)):>9s})  accelerate {_pct(result.error(result.accelerate)):>9s}  "
            f"deepspeed {_pct(result.error(result.deepspeed)):>9s}  [{result.seconds:.0f} s]"
            + (f"  {result.failure}" if result.failure else ""),
            flush=True,
        )
    seconds = time.perf_counter() - started
    for label, attr in HEADLINES:
        median, worst, missing = summary(results, attr)
        print(
            f"{label:48s} median |error| {median:.1f} %, worst {worst:.1f} %"
            + (f", {missing} failed" if missing else "")
        )
    if not args.no_write and args.only is None:
        write_section("published", markdown(results, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ROWS", "Row", "Result", "run_row", "memfit_figure", "accelerate_estimate", "deepspeed_estimate", "main"]
