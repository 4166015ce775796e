"""The workloads of ``bench/predicted_speed.py``: each published row's model, built from its
config with random weights (no download), with the batch, loss and optimizer its source ran.

Vision models come from transformers' config classes where they match the source's model
(parameter counts checked against timm's CSVs: ResNet-18 11.69 M, ResNet-50 25.56 M,
EfficientNet-B0 5.29 M, MobileNetV2 3.50 M, ConvNeXt-T 28.59 M, Swin-T 28.29 M, ViT-S/16
22.05 M, RegNetY-4.0GF 20.65 M); ResNeXt is built here (transformers has none), as
torchvision's ``resnext50_32x4d`` / ``resnext101_32x4d``: bottlenecks whose 3x3 convolution
has 32 groups of 4 x 2^stage channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.workload import Workload

#: (depths, layer type, widths) of transformers' ResNet for each torchvision depth
_RESNETS = {
    18: ([2, 2, 2, 2], "basic", [64, 128, 256, 512]),
    34: ([3, 4, 6, 3], "basic", [64, 128, 256, 512]),
    50: ([3, 4, 6, 3], "bottleneck", [256, 512, 1024, 2048]),
    101: ([3, 4, 23, 3], "bottleneck", [256, 512, 1024, 2048]),
    152: ([3, 8, 36, 3], "bottleneck", [256, 512, 1024, 2048]),
}


def trainer_style(optimizer: type[torch.optim.Optimizer], clip: float | None, **options: Any) -> Any:
    """An optimizer factory as the source's loop ran it: gradients clipped to ``clip`` before
    the step (the HF Trainer's max_grad_norm), and zeroed in place (``zero_grad()`` of the
    PyTorch of the time) rather than set to None."""

    class Stepped(optimizer):  # type: ignore[misc,valid-type]
        def step(self, closure: Any = None) -> Any:
            if clip is not None:
                params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
                nn.utils.clip_grad_norm_(params, clip, foreach=False)
            return super().step(closure)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.zero_()

    return lambda params: Stepped(params, **options)


class Bottleneck(nn.Module):
    """torchvision's ResNeXt bottleneck (stride in the grouped 3x3)."""

    def __init__(self, inp: int, width: int, out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inp, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.down = None
        if stride != 1 or inp != out:
            self.down = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + (x if self.down is None else self.down(x)))


def resnext(depths: list[int], groups: int = 32, group_width: int = 4, classes: int = 1000) -> nn.Module:
    """ResNeXt-(depths) 32x4d: the stem, four stages of bottlenecks, pooling and the head."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    inp = 64
    for stage, depth in enumerate(depths):
        width, out = groups * group_width * 2**stage, 256 * 2**stage
        for block in range(depth):
            layers.append(Bottleneck(inp, width, out, 2 if block == 0 and stage > 0 else 1, groups))
            inp = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, classes)]
    return nn.Sequential(*layers)


def _hf_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _vision_model(family: str) -> Callable[[], nn.Module]:
    """A factory of the vision model ``family`` names ("resnet50", "resnext50", "vit_s16", ...)."""
    import transformers

    transformers.logging.set_verbosity_error()
    T = transformers
    if family.startswith("resnext"):
        depths = [3, 4, 6, 3] if family == "resnext50" else [3, 4, 23, 3]
        return lambda: resnext(depths)
    if family.startswith("resnet"):
        depths, kind, widths = _RESNETS[int(family[6:])]
        config: Any = T.ResNetConfig(depths=depths, layer_type=kind, hidden_sizes=widths, num_labels=1000)
        return lambda: T.ResNetForImageClassification(config)
    vit = {"vit_t16": (192, 3), "vit_s16": (384, 6), "vit_b16": (768, 12)}
    if family in vit:
        hidden, heads = vit[family]
        config = T.ViTConfig(
            hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden, num_labels=1000
        )
        config._attn_implementation = "eager"  # timm's attention of the time: matmul, softmax, matmul
        return lambda: T.ViTForImageClassification(config)
    configs: dict[str, tuple[Any, Any]] = {
        "efficientnet_b0": (
            T.EfficientNetForImageClassification,
            T.EfficientNetConfig(
                width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280, num_labels=1000
            ),
        ),
        "mobilenetv2": (T.MobileNetV2ForImageClassification, T.MobileNetV2Config(tf_padding=False, num_labels=1000)),
        "convnext_t": (T.ConvNextForImageClassification, T.ConvNextConfig(num_labels=1000)),
        "convnext_s": (T.ConvNextForImageClassification, T.ConvNextConfig(depths=[3, 3, 27, 3], num_labels=1000)),
        "swin_t": (T.SwinForImageClassification, T.SwinConfig(num_labels=1000)),
        "swin_s": (T.SwinForImageClassification, T.SwinConfig(depths=[2, 2, 18, 2], num_labels=1000)),
        "regnety_040": (T.RegNetForImageClassification, T.RegNetConfig(num_labels=1000)),
    }
    cls, config = configs[family]
    return lambda: cls(config)


def vision(
    family: str,
    *,
    channels_last: bool,
    momentum: float,
    image: int = 224,
    nesterov: bool = False,
    rmsprop: bool = False,
    label_smoothing: float = 0.0,
) -> Workload:
    """An image classifier trained with SGD (or RMSprop) on random images, as timm's and
    NVIDIA's benchmarks.

    Args:
        family: the model (see :func:`_vision_model`).
        channels_last: model and batch in channels_last (NHWC) memory format.
        momentum: the optimizer's momentum (timm 0.9 with Nesterov, DeepLearningExamples
            0.875, DeepLearningExamples' EfficientNet 0.9).
        image: the image side.
        nesterov: Nesterov momentum.
        rmsprop: DeepLearningExamples' EfficientNet optimizer (configs.yml
            ``efficientnet_params``: RMSprop, alpha 0.9, eps 0.01, weight decay 1e-5) instead of SGD.
        label_smoothing: the cross-entropy's label smoothing.
    """
    make = _vision_model(family)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def model() -> nn.Module:
        return make().to(memory_format=fmt)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, image, image).to(memory_format=fmt), torch.randint(0, 1000, (n,))

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(_hf_logits(m, batch[0]), batch[1], label_smoothing=label_smoothing)

    if rmsprop:
        # torch.optim.RMSprop of the PyTorch of the time: its per-parameter loop (foreach=False)
        optimizer = trainer_style(
            torch.optim.RMSprop, None, lr=1e-4, alpha=0.9, eps=0.01, momentum=momentum, weight_decay=1e-5, foreach=False
        )
    else:
        optimizer = trainer_style(torch.optim.SGD, None, lr=1e-4, momentum=momentum, nesterov=nesterov)
    return Workload(
        model=model,
        make_batch=make_batch,
        loss=loss,
        optimizer=optimizer,
        name=f"{family}{' NHWC' if channels_last else ''}, {image}x{image}",
    )


def bert_large_classifier(optimizer: str = "adamw") -> Workload:
    """bert-large-uncased with a 2-class head, eager attention, sequences of 512 tokens."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, num_labels=2
    )
    config._attn_implementation = "eager"  # transformers 4.16 had no other

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(100, 30000, (n, 512)), "labels": torch.randint(0, 2, (n,))}

    if optimizer == "adafactor":
        make = trainer_style(
            transformers.Adafactor, 1.0, lr=5e-5, scale_parameter=False, relative_step=False, warmup_init=False
        )
    else:
        make = trainer_style(torch.optim.AdamW, 1.0, lr=5e-5, weight_decay=0.0, foreach=False)
    return Workload(
        model=lambda: transformers.BertForSequenceClassification(config),
        make_batch=make_batch,
        loss=lambda model, batch: model(**batch).loss,
        optimizer=make,
        name=f"bert-large-uncased classifier, seq 512, {optimizer}",
    )


class ApexO2Adam(torch.optim.Optimizer):
    """APEX amp's O2 with apex's FusedAdam, as DeepLearningExamples' ``run_squad.py`` ran them
    (``amp.initialize(model, FusedAdam(...), opt_level="O2", loss_scale="dynamic")``): the model
    in fp16, fp32 master copies of its parameters; each step the fp16 gradients become fp32
    master gradients, unscaled with the overflow check (a read on the host), clipped to norm 1.0
    (the script's ``GradientClipper``, multi-tensor), the masters stepped by a multi-tensor Adam,
    and copied back into the fp16 model. apex's multi-tensor kernels are PyTorch's foreach ones
    here (the same bytes; a launch a list instead of a launch a chunk). A stand-in for the cost:
    the step is always taken, where apex skips one on an overflow (now and then, as the
    dynamic scale grows)."""

    def __init__(self, params: Any, lr: float = 3e-5, loss_scale: float = 2.0**16) -> None:
        super().__init__(list(params), {"lr": lr})
        model = [p for group in self.param_groups for p in group["params"]]
        self.masters = [p.detach().float() for p in model]
        self.adam = torch.optim.Adam(self.masters, lr=lr, foreach=True)
        self.inv_scale = 1.0 / loss_scale

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        pairs = [
            (p, m) for group in self.param_groups for p, m in zip(group["params"], self.masters) if p.grad is not None
        ]
        for p, m in pairs:
            m.grad = p.grad.float()
        grads = [m.grad for _, m in pairs]
        found = torch.zeros(1, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found, torch.full((1,), self.inv_scale, device=found.device)
        )
        found.item()  # apex reads the overflow flag on the host before stepping
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        torch._foreach_mul_(grads, torch.clamp(1.0 / (total + 1e-6), max=1.0))
        self.adam.step()
        torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])


def bert_squad(size: str, precision: str) -> Workload:
    """DeepLearningExamples' BERT SQuAD fine-tuning as Lambda ran it (``run_squad.py``, NGC
    pytorch:22.09): ``BertForQuestionAnswering`` of BERT-base or -large, the vocabulary padded
    to a multiple of 8 (30528), sequences of 384 tokens, the loss the mean of the start and end
    cross-entropies. fp16: APEX O2 (:class:`ApexO2Adam`: an fp16 model, no autocast). fp32:
    the script's ``BertAdam`` (a per-parameter loop, as ``AdamW(foreach=False)`` runs one) after
    the ``GradientClipper``. transformers' BERT stands in for the script's ``modeling.py`` (the
    same products; its fused bias-GeLU and apex LayerNorm are one kernel each, as
    transformers' GeLU and LayerNorm are; eager attention)."""
    import transformers

    transformers.logging.set_verbosity_error()
    dims = {"base": (768, 12, 12, 3072), "large": (1024, 24, 16, 4096)}[size]
    hidden, layers, heads, inner = dims
    config = transformers.BertConfig(
        vocab_size=30528,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inner,
    )
    config._attn_implementation = "eager"
    half = precision == "fp16"

    def model() -> nn.Module:
        m = transformers.BertForQuestionAnswering(config)
        return m.half() if half else m

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(100, 30000, (n, 384)),
            "token_type_ids": torch.randint(0, 2, (n, 384)),
            "attention_mask": torch.ones(n, 384, dtype=torch.long),
            "start_positions": torch.randint(0, 384, (n,)),
            "end_positions": torch.randint(0, 384, (n,)),
        }

    if half:
        optimizer: Any = lambda params: ApexO2Adam(params)  # noqa: E731
    else:
        optimizer = trainer_style(torch.optim.AdamW, 1.0, lr=3e-5, weight_decay=0.01, foreach=False)
    return Workload(
        model=model,
        make_batch=make_batch,
        loss=lambda m, batch: m(**batch).loss,
        optimizer=optimizer,
        name=f"bert-{size} SQuAD, seq 384, {'APEX O2 fp16' if half else 'fp32'}",
    )


class NoStep(torch.optim.Optimizer):
    """No optimizer step and no ``zero_grad``: NeuSight's measured loop (``measure_e2e`` of
    neusight/Tracing/trace.py) timed forward and backward only, and never zeroed the
    gradients, so each backward adds into the ones the last left (what this reproduces)."""

    def __init__(self, params: Any) -> None:
        super().__init__(list(params), {})

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


#: NeuSight's model configs (scripts/asplos/data/DLmodel_configs/*.json): their shapes and
#: OPT's dropouts, as there; every other field of those files is the config class's default
_NEUSIGHT_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert_large": ("bert", {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                            "intermediate_size": 4096, "vocab_size": 30522}),
    "gpt2_large": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20, "n_positions": 1024}),
    "gpt3_xl": ("gpt2", {"n_embd": 3072, "n_layer": 24, "n_head": 24, "n_positions": 2048}),
    "gpt3_27": ("gpt2", {"n_embd": 2560, "n_layer": 32, "n_head": 32, "n_positions": 2048}),
    "opt_13": ("opt", {"hidden_size": 2048, "num_hidden_layers": 24, "ffn_dim": 8192, "num_attention_heads": 32,
                       "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 2048,
                       "do_layer_norm_before": True, "dropout": 0.1, "attention_dropout": 0.0,
                       "activation_function": "relu"}),
}  # fmt: skip


def neusight_lm(name: str, sequence: int) -> Workload:
    """A model of NeuSight's measured labels as its loop ran it: built from its config (eager
    attention, training mode), ``input_ids`` all ones, the loss the cross-entropy of the logits
    (BERT: the pre-training model's masked-LM logits) against the input ids, and
    :class:`NoStep` for the optimizer. The loss's forward is in memfit's step and was not in
    NeuSight's timed window (one log-softmax over the logits: well under 1 % of these steps)."""
    import transformers

    transformers.logging.set_verbosity_error()
    kind, fields = _NEUSIGHT_CONFIGS[name]
    if kind == "bert":
        config: Any = transformers.BertConfig(**fields)
        build: Callable[[], nn.Module] = lambda: transformers.BertForPreTraining(config)  # noqa: E731
    elif kind == "gpt2":
        config = transformers.GPT2Config(activation_function="gelu_new", **fields)
        build = lambda: transformers.GPT2LMHeadModel(config)  # noqa: E731
    else:
        config = transformers.OPTConfig(**fields)
        build = lambda: transformers.OPTForCausalLM(config)  # noqa: E731
    config._attn_implementation = "eager"

    def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids)
        logits = out.prediction_logits if kind == "bert" else out.logits
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), ids.view(-1))

    return Workload(
        model=build,
        make_batch=lambda n: torch.ones(n, sequence, dtype=torch.long),
        loss=loss,
        optimizer=NoStep,
        name=f"NeuSight {name}, seq {sequence}, forward and backward",
    )


def workload(key: str) -> Workload:
    """The workload a row names: ``bert-large adamw``, ``bert-large adafactor``,
    ``bert-squad base|large fp16|fp32``, ``neusight MODEL SEQUENCE``, or
    ``FAMILY[/nhwc]/timm|dle|dle-rmsprop`` (timm: SGD 0.9 Nesterov; dle: SGD 0.875;
    dle-rmsprop: DeepLearningExamples' EfficientNet recipe, RMSprop with momentum 0.9 and
    label smoothing 0.1)."""
    if key.startswith("neusight"):  # neusight MODEL SEQUENCE
        _, name, sequence = key.split()
        return neusight_lm(name, int(sequence))
    if key.startswith("bert-squad"):  # bert-squad SIZE PRECISION
        _, size, precision = key.split()
        return bert_squad(size, precision)
    if key.startswith("bert-large"):
        return bert_large_classifier(key.split()[1])
    family, *rest = key.split("/")
    origin = rest[-1]
    return vision(
        family,
        channels_last="nhwc" in rest,
        momentum=0.875 if origin == "dle" else 0.9,
        nesterov=origin == "timm",
        rmsprop=origin == "dle-rmsprop",
        label_smoothing=0.1 if origin == "dle-rmsprop" else 0.0,
    )
