"""Built-in workloads, randomly initialised, nothing downloaded.

A zoo reference is a name, optionally followed by ``:`` and comma-separated options:
``gpt``, ``gpt:layers=2,seq_len=128``, ``resnet50:image_size=64``.

The pure torch entries (``mlp``, ``convnet``, ``gpt``, ``lstm-lm``) need only memfit's core
dependencies; the others are built from transformers config classes and need the extra
(``pip install 'memfit[hf]'``).

==============  ===============================================  =====================================
name            model (default shapes)                           options
==============  ===============================================  =====================================
``mlp``         pure torch MLP, 4 blocks of 1024, 1024 features  layers, width, features, classes
``convnet``     pure torch CNN, 4 conv blocks, 64 ch, 64x64 RGB  blocks, channels, image_size, classes
``gpt``         GPT decoder in pure torch (nanoGPT-style),       layers, embd, heads, seq_len, vocab,
                GPT-2 124M shapes, sequence 1024                 dropout, bias, tied
``lstm-lm``     pure torch LSTM language model (PyTorch's        vocab, emsize, hidden, layers, seq_len,
                word_language_model), 2 layers of 200, seq 35    dropout
``gpt2``        GPT-2 124M, causal LM, sequence 1024             seq_len + GPT2Config fields
``bert-base``   BERT base, masked LM, sequence 512               seq_len + BertConfig fields
``vit-base``    ViT-B/16, image classification, 224x224          image_size + ViTConfig fields
``resnet50``    ResNet-50, image classification, 224x224         image_size + ResNetConfig fields
``llama-1b``    Llama 3.2 1B shapes, causal LM, sequence 2048    seq_len + LlamaConfig fields
``llama-7b``    Llama 2 7B shapes, causal LM, sequence 2048      seq_len + LlamaConfig fields
==============  ===============================================  =====================================

``gpt``'s ``dropout`` (0.1, as GPT-2) and ``lstm-lm``'s (0.2) are probabilities in [0, 1); ``bias`` (biases in
the linear layers and LayerNorms) and ``tied`` (the LM head shares the token embedding)
are true or false. Every transformers entry also accepts ``layers``, ``hidden``, ``heads`` and
``intermediate`` as short names for its config's fields, and ``classes`` / ``vocab``.
Batches are worst-case: every sequence at full length, every token a label.

Options are checked before anything runs (a one-line :class:`WorkloadError`): each key
once, sizes positive whole numbers, a value of the type its config field has, a config
the model accepts (``n_embd`` divisible by ``n_head``), and a model whose parameters a
process could hold at all (built on the meta device, which allocates nothing).

>>> wl = build("mlp", "layers=2,width=64")
>>> wl.info["layers"]
2
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import WorkloadError
from memfit.workload.gpt import GPT, GPTShape
from memfit.workload.spec import Workload

__all__ = [
    "ENTRIES",
    "DEFAULT_WORKLOAD",
    "TINY",
    "build",
    "parse_options",
    "names",
    "check_buildable",
    "MAX_ALLOCATION_BYTES",
]

#: what every command runs when no workload is given: a small pure-torch GPT (2 layers,
#: width 128, 64 tokens, a 4096-token vocabulary), so it needs no optional dependency, and
#: `memfit fit` on a laptop CPU, with its trials in three precisions on a simulated GPU,
#: finishes in well under a minute.
DEFAULT_WORKLOAD = "gpt:layers=2,embd=128,heads=4,seq_len=64,vocab=4096"


def parse_options(text: str) -> dict[str, Any]:
    """Parse ``"n_layer=2,seq_len=128"`` into ``{"n_layer": 2, "seq_len": 128}``.

    >>> parse_options("layers=1,layers=2")
    Traceback (most recent call last):
    memfit.errors.WorkloadError: zoo option 'layers' given twice: give each option once
    """
    options: dict[str, Any] = {}
    if not text.strip():
        return options
    for item in _split_top_level(text):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise WorkloadError(f"bad zoo option {item.strip()!r}: write key=value, comma-separated")
        if key in options:
            raise WorkloadError(f"zoo option {key!r} given twice: give each option once")
        if not value.strip():
            raise WorkloadError(f"zoo option {key!r} has no value: write {key}=VALUE")
        options[key] = _parse_value(value.strip())
    return options


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, so ``depths=[1,1],image_size=32`` is two options."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char in "[(":
            depth += 1
        elif char in ")]":
            depth -= 1
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return items


def _parse_value(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


#: the most memory a model's parameters (or one sample) may ask for: 128 TiB, all the
#: address space an x86-64 or arm64 process has (47 bits); past it no machine can allocate it
MAX_ALLOCATION_BYTES = 2**47

#: parts of config field names that hold a size (a count or a dimension)
_SIZE_NAME = re.compile(r"^(n|num)_|_size$|_sizes$|_dim$|_heads$|_layers$|_embeddings$|_positions$|^n[A-Z_]|^depths$")


def _is_size_name(field_name: str) -> bool:
    """True for config fields that hold a size (``n_layer``, ``vocab_size``, ``head_dim``).

    >>> [_is_size_name(n) for n in ("n_layer", "vocab_size", "hidden_sizes", "bos_token_id", "layer_norm_eps")]
    [True, True, True, False, False]
    """
    return bool(_SIZE_NAME.search(field_name))


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(name: str, key: str, value: Any) -> None:
    """A size option: a positive whole number (or a non-empty list of them)."""
    values = value if isinstance(value, list) and value else [value]
    if not all(_is_whole(v) and v >= 1 for v in values):
        raise WorkloadError(f"zoo workload {name!r}: {key} must be a positive integer, not {value!r}")


def _check_field(name: str, key: str, value: Any, default: Any, is_size: bool) -> None:
    """A config option: a size is positive, and a value has the type of the field's default."""
    if is_size and value is not None and (_is_whole(default) or isinstance(default, list) or _is_whole(value)):
        if isinstance(value, list) != isinstance(default, list) and default is not None:
            kind = "a list of positive integers" if isinstance(default, list) else "a positive integer"
            raise WorkloadError(f"zoo workload {name!r}: {key} must be {kind}, not {value!r}")
        _check_size(name, key, value)
        return
    expected: tuple[type, ...] | None = None
    if isinstance(default, bool):
        expected = (bool,)
    elif _is_whole(default):
        expected = (int,)
    elif isinstance(default, float):
        expected = (int, float)
    elif isinstance(default, str):
        expected = (str,)
    elif isinstance(default, list):
        expected = (list,)
    wrong_bool = isinstance(value, bool) and expected is not None and bool not in expected
    if expected is not None and (wrong_bool or not isinstance(value, expected)):
        kind = {bool: "true or false", int: "an integer", str: "a string", list: "a list"}.get(expected[0], "a number")
        if expected == (int, float):
            kind = "a number"
        raise WorkloadError(f"zoo workload {name!r}: {key} must be {kind}, not {value!r}")


def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def check_buildable(workload: Workload, name: str) -> int:
    """Build the model and a one-sample batch on the meta device (no memory); return the
    parameter bytes.

    Why: a config the model refuses (``n_embd`` not divisible by ``n_head``) or a size no
    machine can allocate (``mlp:width=99999999999``) must be one line now, not a
    traceback or an hour of swapping later. The zoo's code is memfit's, so what it raises
    here is about the options, not a bug of the user's.

    Args:
        workload: a zoo workload.
        name: its name, for messages.
    """
    try:
        # warnings.catch_warnings: a one-block probe build may warn (LSTM dropout with one layer)
        with _no_dispatch_modes(), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nbytes = _parameter_bytes(workload.build_model())
            sample = _tensor_bytes(workload.make_batch(1))
    except (ValueError, RuntimeError, TypeError, AttributeError, AssertionError) as error:
        raise WorkloadError(
            f"zoo workload {name!r}: the model cannot be built with these options ({_first_line(error)})"
        ) from None
    for what, size in (("its parameters alone", nbytes), ("one sample of its batch", sample)):
        if size > MAX_ALLOCATION_BYTES:
            raise WorkloadError(
                f"zoo workload {name!r}: {what} would take {size / 2**40:,.0f} TiB, more than any machine can "
                f"allocate (a process can address at most {MAX_ALLOCATION_BYTES // 2**40} TiB)"
            )
    return nbytes


@contextlib.contextmanager
def _no_dispatch_modes() -> Iterator[None]:
    """Leave any active dispatch mode (a simulated device's tracker) out of the meta build."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - torch without it
        yield
        return
    with _disable_current_modes():
        yield


# -- pure torch models ------------------------------------------------------------------


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


class MLP(nn.Module):
    def __init__(self, features: int, width: int, layers: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(layers))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, channels: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def _classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _mlp(layers: int = 4, width: int = 1024, features: int = 1024, classes: int = 10) -> Workload:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, features), torch.randint(0, classes, (n,))

    return Workload(
        model=lambda: MLP(features, width, layers, classes),
        make_batch=make_batch,
        loss=_classification_loss,
        info={"features": features, "width": width, "layers": layers},
    )


def _convnet(blocks: int = 4, channels: int = 64, image_size: int = 64, classes: int = 10) -> Workload:
    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, image_size, image_size), torch.randint(0, classes, (n,))

    return Workload(
        model=lambda: ConvNet(channels, blocks, classes),
        make_batch=make_batch,
        loss=_classification_loss,
        info={"image_size": image_size, "channels": channels, "blocks": blocks},
    )


def _gpt(
    *,
    layers: int = 12,
    embd: int = 768,
    heads: int = 12,
    seq_len: int = 1024,
    vocab: int = 50257,
    dropout: float = 0.1,
    bias: bool = True,
    tied: bool = True,
) -> Workload:
    if embd % heads:
        raise WorkloadError(f"zoo workload 'gpt': embd={embd} must be divisible by heads={heads}")
    shape = GPTShape(layers, embd, heads, seq_len, vocab, float(dropout), bias, tied)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # worst case: every sequence at full length, every token a label (targets are
        # the next tokens in real data; random ones cost the same memory)
        return torch.randint(0, vocab, (n, seq_len)), torch.randint(0, vocab, (n, seq_len))

    return Workload(
        model=lambda: GPT(shape),
        make_batch=make_batch,
        loss=_language_model_loss,
        info={
            "seq_len": seq_len,
            "layers": layers,
            "embd": embd,
            "heads": heads,
            "vocab": vocab,
            "description": "GPT decoder in pure torch (nanoGPT-style)",
        },
    )


def _language_model_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- transformers models ------------------------------------------------------------------


@dataclass(frozen=True)
class _HFEntry:
    """A transformers model built from its config class with random weights."""

    config: str  # config class name in transformers
    model: str  # model class name in transformers
    defaults: dict[str, Any]
    aliases: dict[str, str]
    kind: str  # "causal", "masked", "image"
    shape_default: int  # sequence length, or image size
    description: str

    def build(self, options: dict[str, Any], name: str) -> Workload:
        try:
            import transformers
        except ImportError:
            raise WorkloadError(f"zoo workload {name!r} needs transformers: pip install 'memfit[hf]'") from None
        transformers.logging.set_verbosity_error()  # config chatter is not the user's problem
        options = dict(options)
        shape_key = "image_size" if self.kind == "image" else "seq_len"
        shape = options.pop(shape_key, self.shape_default)
        _check_size(name, shape_key, shape)
        config_cls = getattr(transformers, self.config)
        model_cls = getattr(transformers, self.model)
        fields = dict(self.defaults)
        config_defaults = {**config_cls().to_dict(), **self.defaults}
        for key, value in options.items():
            field_name = self.aliases.get(key, key)
            if field_name not in config_defaults:
                raise WorkloadError(
                    f"unknown option {key!r} for zoo workload {name!r}: use {shape_key}, "
                    f"{', '.join(sorted(self.aliases))} or a {self.config} field"
                )
            _check_field(name, key, value, config_defaults[field_name], is_size=_is_size_name(field_name))
            if field_name in fields and key != field_name and field_name in options:
                raise WorkloadError(f"zoo workload {name!r}: {key} and {field_name} are one option: give it once")
            fields[field_name] = value
        if self.kind == "image":
            fields["image_size"] = shape
        else:
            fields.setdefault("use_cache", False)  # training keeps no KV cache
        try:
            config = config_cls(**fields)
        except Exception as error:  # noqa: BLE001 - the config's own validation, whatever it raises, refuses a value
            raise WorkloadError(
                f"zoo workload {name!r}: {self.config} refuses these options ({_first_line(error)})"
            ) from None
        if self.kind != "image":
            limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
            if limit is not None and shape > limit:
                raise WorkloadError(
                    f"zoo workload {name!r}: seq_len={shape} is longer than the model's {limit} positions"
                )

        def build_model() -> nn.Module:
            return model_cls(config)

        make_batch = _image_batch(config, shape) if self.kind == "image" else _token_batch(config, shape)
        return Workload(
            model=build_model,
            make_batch=make_batch,
            loss=_hf_loss,
            info={shape_key: shape, "config": self.config, "description": self.description},
        )


def _token_batch(config: Any, seq_len: int) -> Callable[[int], dict[str, torch.Tensor]]:
    vocab = int(config.vocab_size)

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq_len))
        return {"input_ids": ids, "labels": ids.clone()}

    return make_batch


def _image_batch(config: Any, image_size: int) -> Callable[[int], dict[str, torch.Tensor]]:
    classes = int(getattr(config, "num_labels", 1000))
    channels = int(getattr(config, "num_channels", 3))

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": torch.randn(n, channels, image_size, image_size),
            "labels": torch.randint(0, classes, (n,)),
        }

    return make_batch


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


_LLAMA_ALIASES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
}

_HF_ENTRIES: dict[str, _HFEntry] = {
    "gpt2": _HFEntry(
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
        {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size"},
        "causal",
        1024,
        "GPT-2 124M, causal LM",
    ),
    "bert-base": _HFEntry(
        "BertConfig",
        "BertForMaskedLM",
        {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
        {
            "layers": "num_hidden_layers",
            "hidden": "hidden_size",
            "heads": "num_attention_heads",
            "intermediate": "intermediate_size",
            "vocab": "vocab_size",
        },
        "masked",
        512,
        "BERT base, masked LM",
    ),
    "vit-base": _HFEntry(
        "ViTConfig",
        "ViTForImageClassification",
        {
            "num_hidden_layers": 12,
            "hidden_size": 768,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "patch_size": 16,
            "num_labels": 1000,
        },
        {
            "layers": "num_hidden_layers",
            "hidden": "hidden_size",
            "heads": "num_attention_heads",
            "intermediate": "intermediate_size",
            "classes": "num_labels",
        },
        "image",
        224,
        "ViT-B/16, image classification",
    ),
    "resnet50": _HFEntry(
        "ResNetConfig",
        "ResNetForImageClassification",
        {
            "depths": [3, 4, 6, 3],
            "hidden_sizes": [256, 512, 1024, 2048],
            "embedding_size": 64,
            "layer_type": "bottleneck",
            "num_labels": 1000,
        },
        {"classes": "num_labels"},
        "image",
        224,
        "ResNet-50, image classification",
    ),
    "llama-1b": _HFEntry(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_hidden_layers": 16,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "head_dim": 64,
        },
        _LLAMA_ALIASES,
        "causal",
        2048,
        "Llama 3.2 1B shapes, causal LM",
    ),
    "llama-7b": _HFEntry(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
        },
        _LLAMA_ALIASES,
        "causal",
        2048,
        "Llama 2 7B shapes, causal LM",
    ),
}


class LSTMLanguageModel(nn.Module):
    """PyTorch's word_language_model example (examples/word_language_model/model.py, LSTM):
    embedding, dropout, stacked LSTM (dropout between layers), dropout, linear decoder."""

    def __init__(self, vocab: int, emsize: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, emsize)
        self.rnn = nn.LSTM(emsize, hidden, layers, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.drop(self.encoder(tokens)))
        return self.decoder(self.drop(output))


def _lstm_lm(
    vocab: int = 10000, emsize: int = 200, hidden: int = 200, layers: int = 2, seq_len: int = 35, dropout: float = 0.2
) -> Workload:
    """The example's defaults (bptt 35, dropout 0.2); batches are (seq_len, batch), time first."""

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (seq_len + 1, n))
        return tokens[:-1], tokens[1:]

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).reshape(-1, vocab), targets.reshape(-1))

    return Workload(
        model=lambda: LSTMLanguageModel(vocab, emsize, hidden, layers, float(dropout)),
        make_batch=make_batch,
        loss=loss,
        info={"vocab": vocab, "hidden": hidden, "layers": layers, "seq_len": seq_len},
    )


_TORCH_ENTRIES: dict[str, Callable[..., Workload]] = {
    "mlp": _mlp,
    "convnet": _convnet,
    "gpt": _gpt,
    "lstm-lm": _lstm_lm,
}

#: every zoo name, in the order of the table above
ENTRIES: tuple[str, ...] = tuple(_TORCH_ENTRIES) + tuple(_HF_ENTRIES)


#: every entry at shapes small enough that two steps take a fraction of a second on a CPU
#: (for tests, doctests and the benchmarks' "small options")
TINY: dict[str, str] = {
    "mlp": "mlp:layers=2,width=32,features=16",
    "convnet": "convnet:blocks=2,channels=8,image_size=16",
    "gpt": "gpt:layers=2,embd=32,heads=2,seq_len=16,vocab=128",
    "lstm-lm": "lstm-lm:vocab=128,emsize=16,hidden=16,layers=2,seq_len=8",
    "gpt2": "gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=16,vocab_size=128",
    "bert-base": "bert-base:layers=1,hidden=32,heads=2,intermediate=64,seq_len=16,vocab_size=128",
    "vit-base": "vit-base:layers=1,hidden=32,heads=2,intermediate=64,image_size=32,classes=10",
    "resnet50": "resnet50:image_size=32,depths=[1,1],hidden_sizes=[16,32],embedding_size=8,classes=10",
    "llama-1b": "llama-1b:layers=1,hidden=32,heads=2,num_key_value_heads=1,head_dim=16,intermediate=64,vocab_size=128,seq_len=16",
    "llama-7b": "llama-7b:layers=1,hidden=32,heads=2,num_key_value_heads=2,intermediate=64,vocab_size=128,seq_len=16",
}


def _check_option(name: str, key: str, value: Any, default: Any) -> None:
    """Refuse a pure torch entry's option whose value is not of its default's kind.

    Why by the default: every option of these entries is a size (a positive integer), a
    probability (a float in [0, 1)) or a switch (a bool), and its default says which.
    """
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise WorkloadError(f"zoo workload {name!r}: {key} must be true or false, not {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise WorkloadError(f"zoo workload {name!r}: {key} must be a probability in [0, 1), not {value!r}")
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WorkloadError(f"zoo workload {name!r}: {key} must be a positive integer, not {value!r}")


def names() -> list[str]:
    return list(ENTRIES)


#: the option that repeats a block, per entry (the model's depth): the size check builds
#: one and two blocks and extrapolates, rather than building thousands of them
_REPEATED: dict[str, str] = {
    "mlp": "layers",
    "convnet": "blocks",
    "gpt": "layers",
    "lstm-lm": "layers",
    "gpt2": "n_layer",
    "bert-base": "num_hidden_layers",
    "vit-base": "num_hidden_layers",
    "resnet50": "depths",
    "llama-1b": "num_hidden_layers",
    "llama-7b": "num_hidden_layers",
}


def _make(name: str, options: dict[str, Any]) -> Workload:
    """The zoo workload ``name`` with parsed options, each option checked."""
    if name in _TORCH_ENTRIES:
        factory = _TORCH_ENTRIES[name]
        allowed = inspect.signature(factory).parameters
        for key, value in options.items():
            if key not in allowed:
                raise WorkloadError(f"unknown option {key!r} for zoo workload {name!r}: use {', '.join(allowed)}")
            _check_option(name, key, value, allowed[key].default)
        return factory(**options)
    if name in _HF_ENTRIES:
        return _HF_ENTRIES[name].build(options, name)
    raise WorkloadError(f"unknown zoo workload {name!r}: use one of {', '.join(ENTRIES)}")


def _repeat_option(name: str, options: dict[str, Any]) -> tuple[str, Any] | None:
    """(the key naming the depth in ``options``, its value), or None when left at its default."""
    field_name = _REPEATED.get(name)
    if field_name is None:
        return None
    aliases = _HF_ENTRIES[name].aliases if name in _HF_ENTRIES else {}
    for key, value in options.items():
        if aliases.get(key, key) == field_name:
            return key, value
    return None


def _check_size_of(name: str, options: dict[str, Any], workload: Workload) -> None:
    """Refuse a model no machine could hold, without building more than two of its blocks."""
    given = _repeat_option(name, options)
    depth = max(given[1]) if given is not None and isinstance(given[1], list) else given[1] if given else 0
    if given is None or depth <= 2:
        check_buildable(workload, name)
        return
    key, value = given

    def with_depth(blocks: int) -> dict[str, Any]:
        return {**options, key: [blocks] * len(value) if isinstance(value, list) else blocks}

    one = check_buildable(_make(name, with_depth(1)), name)
    two = check_buildable(_make(name, with_depth(2)), name)
    nbytes = one + (depth - 1) * (two - one)  # every block alike: memory linear in the depth
    if nbytes > MAX_ALLOCATION_BYTES:
        raise WorkloadError(
            f"zoo workload {name!r}: {key}={value} would make parameters of {nbytes / 2**40:,.0f} TiB, more than "
            f"any machine can allocate (a process can address at most {MAX_ALLOCATION_BYTES // 2**40} TiB)"
        )


def build(name: str, options_text: str = "") -> Workload:
    """Build the zoo workload ``name`` with options such as ``"layers=2,seq_len=128"``.

    Args:
        name: a zoo name (:data:`ENTRIES`).
        options_text: comma-separated ``key=value`` options, each given once.

    A transformers entry without transformers installed, an unknown name, a bad option or a
    model no machine could hold is refused with a one-line :class:`~memfit.errors.WorkloadError`.
    """
    options = parse_options(options_text)
    workload = _make(name, options)
    _check_size_of(name, options, workload)
    workload.name = f"{name}:{options_text}" if options_text else name
    return workload
