"""A GPT decoder in pure torch (nanoGPT-style): the zoo's ``gpt`` and memfit's default workload.

Why memfit has its own: the default workload must run with memfit's core dependencies
alone (``pip install memfit``, no transformers), and a decoder-only transformer is what
most people who hit "CUDA out of memory" are training. The layout follows GPT-2 as
nanoGPT writes it (https://github.com/karpathy/nanoGPT, ``model.py``): token and position
embeddings, pre-LayerNorm blocks of causal self-attention (through
``F.scaled_dot_product_attention``) and a GELU MLP four times as wide, a final LayerNorm
and a language-model head, tied to the token embedding by default.

Dropout (``dropout``, 0.1 by default as in GPT-2) sits where GPT-2 puts it: after the
embeddings, on the attention weights, and on each residual branch. It changes activation
memory (a dropout mask is saved for backward), never the parameters.

>>> model = GPT(GPTShape(layers=2, embd=16, heads=2, seq_len=8, vocab=32))
>>> model(torch.zeros(3, 8, dtype=torch.long)).shape
torch.Size([3, 8, 32])
>>> len(model.blocks)
2
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTShape", "GPT", "Block", "CausalSelfAttention", "FeedForward"]


@dataclass(frozen=True)
class GPTShape:
    """The sizes of a GPT decoder; the defaults are GPT-2 124M's."""

    layers: int = 12
    embd: int = 768
    heads: int = 12
    seq_len: int = 1024  # the context: position embeddings, and every batch's length
    vocab: int = 50257
    dropout: float = 0.1
    bias: bool = True  # biases in the linear layers and LayerNorms, as GPT-2 has
    tied: bool = True  # the LM head shares the token embedding's weight, as GPT-2 does


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.dropout = shape.dropout
        self.qkv = nn.Linear(shape.embd, 3 * shape.embd, bias=shape.bias)
        self.proj = nn.Linear(shape.embd, shape.embd, bias=shape.bias)
        self.resid_dropout = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, tokens, width) -> (batch, heads, tokens, head width)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, tokens, width)
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    """The block's MLP: width -> 4 x width -> width, GELU between."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.embd, 4 * shape.embd, bias=shape.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * shape.embd, shape.embd, bias=shape.bias)
        self.dropout = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.embd, bias=shape.bias)
        self.attn = CausalSelfAttention(shape)
        self.ln_2 = nn.LayerNorm(shape.embd, bias=shape.bias)
        self.mlp = FeedForward(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT decoder: token ids (batch, tokens) -> logits (batch, tokens, vocab).

    The blocks live in one ``nn.ModuleList`` of :class:`Block`, so ``checkpointing=blocks``
    (:func:`memfit.run.settings.find_blocks`) recomputes each of them in backward.
    """

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab, shape.embd)
        self.wpe = nn.Embedding(shape.seq_len, shape.embd)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.embd, bias=shape.bias)
        self.lm_head = nn.Linear(shape.embd, shape.vocab, bias=False)
        if shape.tied:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream (nanoGPT does the same)
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * shape.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = ids.shape[1]
        if tokens > self.shape.seq_len:
            raise ValueError(f"{tokens} tokens is more than the model's {self.shape.seq_len} positions")
        positions = torch.arange(tokens, device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits
