"""Workloads made from pytorch/examples' models, as a user would write them for memfit.

The models are rebuilt in plain torch with random weights (no download): the MNIST CNN
(``mnist/main.py``'s ``Net``, trained with Adadelta), and the word-language model's
``RNNModel`` (a sequence-first ``nn.LSTM``) and ``TransformerModel`` (a sequence-first
``nn.TransformerEncoder`` under a float causal mask). Each factory gives its workload a
``name`` of its own, as a script would, so a lock must record the reference, not the
name, to load it again. Tests load them by reference: ``"<this file>:mnist"``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import memfit

NTOKEN = 1000
BPTT = 35  # the word-language model's sequence length


class Net(nn.Module):
    """pytorch/examples mnist's Net."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


class RNNModel(nn.Module):
    """word_language_model's RNNModel with an LSTM: encoder, sequence-first LSTM, decoder."""

    def __init__(self, ntoken: int = NTOKEN, ninp: int = 64, nhid: int = 64, nlayers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)  # batch_first=False, the default
        self.decoder = nn.Linear(nhid, ntoken)
        self.ntoken = ntoken

    def forward(self, tokens: torch.Tensor, hidden: Any = None) -> tuple[torch.Tensor, Any]:
        output, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(output), hidden  # (sequence, batch, ntoken)


class TransformerModel(nn.Module):
    """word_language_model's TransformerModel: a sequence-first TransformerEncoder, float causal mask."""

    def __init__(self, ntoken: int = NTOKEN, ninp: int = 32, nhead: int = 2, nhid: int = 64, nlayers: int = 2):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout=0.0)  # batch_first=False
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.decoder = nn.Linear(ninp, ntoken)
        self.ninp = ninp

    def forward(self, src: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:  # as the example builds it: 0 on and below the diagonal, -inf above
            mask = torch.log(torch.tril(torch.ones(src.size(0), src.size(0), device=src.device)))
        hidden = self.transformer_encoder(self.encoder(src) * math.sqrt(self.ninp), mask)
        return F.log_softmax(self.decoder(hidden), dim=-1)


def _mnist_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, batch) tokens and targets: n sequences of BPTT tokens."""
    return torch.randint(0, NTOKEN, (BPTT, n)), torch.randint(0, NTOKEN, (BPTT, n))


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    output, _ = model(batch[0])
    return F.cross_entropy(output.reshape(-1, NTOKEN), batch[1].reshape(-1))


def _transformer_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.nll_loss(model(batch[0]).reshape(-1, NTOKEN), batch[1].reshape(-1))


def mnist() -> memfit.Workload:
    """The MNIST CNN with the example's Adadelta (lr 1.0)."""
    return memfit.Workload(
        model=Net,
        make_batch=_mnist_batch,
        loss=lambda model, batch: F.nll_loss(model(batch[0]), batch[1]),
        optimizer=lambda params: torch.optim.Adadelta(params, lr=1.0),
        name="mnist-cnn",
    )


def word_language_model() -> memfit.Workload:
    """The LSTM language model; the batch size is the number of sequences (dimension 1)."""
    return memfit.Workload(model=RNNModel, make_batch=_tokens, loss=_lm_loss, name="word-lm (LSTM)")


def transformer_language_model() -> memfit.Workload:
    """The Transformer language model, whose float mask fake tensors cannot run."""
    return memfit.Workload(
        model=TransformerModel, make_batch=_tokens, loss=_transformer_loss, name="word-lm (Transformer)"
    )
