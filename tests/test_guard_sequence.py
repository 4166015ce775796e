"""The guard on sequence-first models, with gradient clipping, and what its OOM reports say.

The models are the ones a new user brings: pytorch/examples' word-language model (an
``nn.LSTM`` with ``batch_first=False``, batches of (35, 20) tokens: 20 sequences of 35),
its Transformer variant (``nn.TransformerEncoder``, sequence-first, with a float causal
mask) and the MNIST CNN. They are rebuilt here in plain torch with random weights. Real
OOMs come from the simulated GPU, entered with ``with memfit.device(...)`` and not
passed to the guard, as a user would write it.
"""

from __future__ import annotations

import copy
import gc
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.guard import Guard, GuardError
from memfit.guard.sequence import LayoutError, sequence_first_modules
from memfit.units import MiB

NTOKEN = 1000
SEQ, BATCH = 35, 20  # pytorch/examples' bptt and batch_size


@pytest.fixture(autouse=True, scope="module")
def _quiet_machine() -> Any:
    """One intra-op thread and a frozen heap (see tests/test_guard.py for why)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


#: pytorch/examples' models, rebuilt in tests/workloads (loaded by reference, as a user's file is)
EXAMPLES = Path(__file__).parent / "workloads" / "pytorch_examples.py"
RNNModel = memfit.load_workload(f"{EXAMPLES}:word_language_model").model
TransformerModel = memfit.load_workload(f"{EXAMPLES}:transformer_language_model").model
MnistNet = memfit.load_workload(f"{EXAMPLES}:mnist").model


def causal_mask(size: int) -> torch.Tensor:
    """The float mask pytorch/examples builds: 0 on and below the diagonal, -inf above."""
    return torch.log(torch.tril(torch.ones(size, size)))


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, NTOKEN, (SEQ, BATCH), generator=generator)
    return data, torch.randint(0, NTOKEN, (SEQ, BATCH), generator=generator)


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    output, _ = model(batch[0])
    return F.cross_entropy(output.reshape(-1, NTOKEN), batch[1].reshape(-1))


def relative_difference(model: nn.Module, reference: nn.Module) -> float:
    return max(
        float((p.detach() - q.detach()).norm() / q.detach().norm())
        for p, q in zip(model.parameters(), reference.parameters())
    )


def unsplit_step(model: nn.Module, batch: Any, loss: Any, clip: float | None = None) -> float:
    """The plain loop of the example: backward, clip_grad_norm_, SGD step; returns the unclipped norm."""
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    loss(model, batch).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf)
    optimizer.step()
    return float(norm)


# -- detection ---------------------------------------------------------------------------------------


def test_sequence_first_modules_are_found_outermost_first() -> None:
    found = [(name, type(m).__name__) for name, m in sequence_first_modules(RNNModel())]
    assert found == [("rnn", "LSTM")]
    found = [(name, type(m).__name__) for name, m in sequence_first_modules(TransformerModel())]
    assert found == [("transformer_encoder", "TransformerEncoder")]  # not its layers nor their attention
    batch_first = nn.ModuleList([nn.LSTM(4, 4, batch_first=True), nn.MultiheadAttention(4, 2, batch_first=True)])
    assert sequence_first_modules(batch_first) == []
    seq_first = nn.ModuleList([nn.GRU(4, 4), nn.RNN(4, 4), nn.MultiheadAttention(4, 2), nn.Transformer(8, 2, 1, 1)])
    assert [name for name, _ in sequence_first_modules(seq_first)] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("batch_dim", [None, 0])
def test_splitting_a_sequence_first_lm_along_dimension_0_is_refused_before_anything_is_split(batch_dim) -> None:
    """Issue 14, item 1: a (35, 20) batch was halved along the sequence and training went on."""
    torch.manual_seed(0)
    model = RNNModel()
    before = [p.detach().clone() for p in model.parameters()]
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=20.0), lm_loss, batch_dim=batch_dim)
    with memfit.device("sim:20MiB") as gpu, pytest.raises(LayoutError) as caught:
        gpu.adopt(model.parameters())
        guard.step(tokens(0))
    message = str(caught.value)
    assert "nn.LSTM 'rnn' (batch_first=False)" in message
    assert "its input (35, 20, 64) has the micro-batch's 35 samples along dimension 0, its sequence" in message
    assert "pass batch_dim=1" in message and "\n" not in message
    assert guard.events == []  # refused in the first, whole-batch forward: nothing was split
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_a_model_that_transposes_batch_first_data_is_split_along_dimension_0() -> None:
    """Batch-first tokens (20, 35) transposed before the LSTM: dimension 0 is right, nothing is refused."""

    class Transposing(RNNModel):  # type: ignore[misc,valid-type]
        def forward(self, tokens: torch.Tensor, hidden: Any = None) -> tuple[torch.Tensor, Any]:
            return super().forward(tokens.t(), hidden)

    torch.manual_seed(0)
    model = Transposing()
    reference = copy.deepcopy(model)
    data, targets = tokens(1)
    batch = (data.t().contiguous(), targets.t().contiguous())  # (batch, sequence)

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        return lm_loss(m, (b[0], b[1].t()))

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=20.0), loss)
    with memfit.device("sim:20MiB") as gpu:
        gpu.adopt(model.parameters())
        guard.step(batch)
    assert [(e.micro_batch_before, e.micro_batch_after) for e in guard.events] == [(20, 10), (10, 5)]
    unsplit_step(reference, batch, loss)
    assert relative_difference(model, reference) < 1e-5
    assert guard.splitter.layout.done  # checked once; the hooks are gone


# -- the split update equals the unsplit one ----------------------------------------------------------


def test_lm_split_along_batch_dim_1_with_clipping_equals_the_unsplit_clipped_update() -> None:
    """A real OOM on sim:20MiB splits 20 sequences into 4 micro-batches of 5 along dimension 1."""
    torch.manual_seed(0)
    model = RNNModel()
    reference, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    batch = tokens(2)
    norm = unsplit_step(unclipped, batch, lm_loss)
    clip = norm / 4  # so clipping really changes the update
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=20.0), lm_loss, batch_dim=1, clip_grad_norm=clip)
    with memfit.device("sim:20MiB") as gpu:
        gpu.adopt(model.parameters())
        loss = guard.step(batch)
    assert (guard.last.micro_batch_size, guard.last.micro_batches, guard.last.samples) == (5, 4, BATCH)
    assert guard.grad_norm == pytest.approx(norm, rel=1e-5)
    unsplit_step(reference, batch, lm_loss, clip)
    assert relative_difference(model, reference) < 1e-5
    assert relative_difference(model, unclipped) > 1e-3  # the clip mattered
    assert loss == pytest.approx(float(lm_loss(copy.deepcopy(unclipped), batch).detach()), rel=0.5)  # sanity
    # Item 17: the events carry the memory of the device entered, though none was passed.
    assert all(e.allocated is not None and e.reserved is not None for e in guard.events)
    assert all(0 < e.allocated <= e.reserved <= 20 * MiB for e in guard.events)


def test_hidden_state_in_the_batch_is_split_along_the_same_dimension() -> None:
    """Truncated BPTT carries (h, c) of shape (layers, batch, hidden): batch_dim=1 splits it with the tokens."""
    torch.manual_seed(0)
    model = RNNModel()
    reference = copy.deepcopy(model)
    data, targets = tokens(3)
    hidden = (torch.randn(2, BATCH, 64), torch.randn(2, BATCH, 64))

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        output, _ = m(b[0], b[2])
        return F.cross_entropy(output.reshape(-1, NTOKEN), b[1].reshape(-1))

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=20.0), loss, batch_dim=1, micro_batch_size=6)
    guard.step((data, targets, hidden))
    assert guard.last.micro_batches == 4  # 6 + 6 + 6 + 2 sequences
    unsplit_step(reference, (data, targets, hidden), loss)
    assert relative_difference(model, reference) < 1e-5


def test_transformer_with_a_shared_mask_per_element_batch_dim_and_predict() -> None:
    """(tokens, targets, mask): the mask is (35, 35), the same for every sequence, so its batch_dim is None."""
    torch.manual_seed(0)
    model = TransformerModel()
    reference = copy.deepcopy(model)
    data, targets = tokens(4)
    batch = (data, targets, causal_mask(SEQ))

    def loss(m: nn.Module, b: Any) -> torch.Tensor:
        return F.nll_loss(m(b[0], b[2]).reshape(-1, NTOKEN), b[1].reshape(-1))

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.5), loss, batch_dim=(1, 1, None), clip_grad_norm=0.5)
    guard.splitter.policy.limit = 8  # as after an OOM: 8 + 8 + 4 sequences
    guard.step(batch)
    assert guard.last.micro_batches == 3
    unsplit_step_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss(reference, batch).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    unsplit_step_sgd.step()
    assert relative_difference(model, reference) < 1e-5

    model.eval()
    expected = model(data, causal_mask(SEQ))
    guard.splitter.predict_policy.limit = 7
    out = guard.predict(batch, lambda b: model(b[0], b[2]))  # joined along batch_dim's 1, as split
    assert out.shape == (SEQ, BATCH, NTOKEN)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_before_step_hook_sees_the_whole_unscaled_gradient() -> None:
    torch.manual_seed(0)
    model = RNNModel()
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    seen: list[float] = []

    def clip_by_value(m: nn.Module, _optimizer: torch.optim.Optimizer) -> None:
        seen.append(max(float(p.grad.abs().max()) for p in m.parameters() if p.grad is not None))
        torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=20.0),
        lm_loss,
        batch_dim=1,
        scaler=scaler,
        before_step=clip_by_value,
        micro_batch_size=10,
    )
    batch = tokens(5)
    guard.step(batch)
    optimizer = torch.optim.SGD(reference.parameters(), lr=20.0)
    lm_loss(reference, batch).backward()
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    torch.nn.utils.clip_grad_value_(reference.parameters(), 1e-3)
    optimizer.step()
    assert seen == [pytest.approx(largest, rel=1e-4)]  # unscaled: not 4096 times larger
    assert relative_difference(model, reference) < 1e-5


# -- what the reports say ------------------------------------------------------------------------------


def test_an_optimizer_oom_on_mnist_names_segment_rounding_not_only_the_model_states() -> None:
    """Issue 14, item 17: 18.3 MiB of model states on a 40 MiB device, yet optimizer.step() runs out."""
    torch.manual_seed(0)
    model = MnistNet()
    guard = Guard(model, torch.optim.Adadelta(model.parameters(), lr=1.0), lambda m, b: F.nll_loss(m(b[0]), b[1]))
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 1, 28, 28, generator=generator), torch.randint(0, 10, (64,), generator=generator))
    with memfit.device("sim:40MiB") as gpu, pytest.raises(GuardError) as caught:
        gpu.adopt(model.parameters())
        guard.step(batch)
    message = str(caught.value)
    assert message.startswith("out of memory in optimizer.step(): splitting the batch cannot fix it; the model states")
    assert "= 18.31 MiB) fit on a device of 40.00 MiB, but the step needs more" in message
    assert "a request of 4.50 MiB needed a new 20.00 MiB segment" in message  # fc1's 9216 x 128 floats
    assert "with 18.00 MiB free" in message and "expandable_segments" in message and "foreach=False" in message
    parts = caught.value.breakdown
    assert parts["capacity"] == 40 * MiB and parts["requested"] == 9216 * 128 * 4
    assert parts["allocated"] is not None and parts["reserved"] is not None
    assert parts["optimizer_temporaries"] == parts["allocated"] - (
        parts["parameters"] + parts["gradients"] + parts["optimizer_state"]
    )
    # the OOMs in forward and backward before it carry the entered device's memory too
    assert guard.events and all(e.allocated is not None for e in guard.events)


def test_one_sample_that_does_not_fit_names_its_activations() -> None:
    """A CNN on 512 x 512 images: one sample's feature maps (16 MiB each) do not fit 40 MiB."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    batch = (torch.randn(2, 3, 512, 512), torch.randint(0, 10, (2,)))
    with memfit.device("sim:40MiB") as gpu, pytest.raises(GuardError) as caught:
        gpu.adopt(model.parameters())
        guard.step(batch)
    message = str(caught.value)
    assert "one sample does not fit" in message and "the activations and temporaries of one sample" in message
    assert "of 40.00 MiB allocated" in message and "a request of 16.00 MiB met" in message
    assert caught.value.breakdown["activations_and_temporaries"] > 16 * MiB
    assert [(e.micro_batch_before, e.micro_batch_after) for e in guard.events] == [(2, 1), (1, None)]
