"""Exact or refused: a failed attempt leaves nothing behind, and a split keeps the user's own loss.

On code of the kinds that broke before: a BatchNorm ResNet (pytorch/examples ImageNet's
BasicBlock, tiny) whose failed forward updated the running statistics; an OOM in
``optimizer.step()`` or an error in ``before_step`` that the user catches; a VAE's summed
loss; token means with ``ignore_index``; a contrastive loss with in-batch negatives; a
loss normalized by ``std()``; a graph batch whose adjacency carries the samples twice.
Real OOMs come from the simulated GPU; injected ones are real ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.guard import Guard, GuardError, NonFiniteGradientError, SplitRefusedError
from memfit.guard.batching import chunk_sizes
from memfit.guard.check import checking

# -- a tiny ImageNet-style ResNet (BasicBlock, BatchNorm) -----------------------------------


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(seed: int = 0) -> ResNet:
    torch.manual_seed(seed)
    return ResNet()


def images(n: int = 8, seed: int = 0, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Everything a step can change, copied: parameters, buffers, gradients, optimizer state."""
    state: dict[str, Any] = {f"value:{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        state[f"grad:{name}"] = None if p.grad is None else p.grad.detach().clone()
    if optimizer is not None:
        state["optimizer"] = copy.deepcopy(optimizer.state_dict()["state"])
    return state


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any], rtol: float = 0.0) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if key == "optimizer":
            assert actual[key].keys() == value.keys()
            for index, entry in value.items():
                for name, tensor in entry.items():
                    torch.testing.assert_close(actual[key][index][name], tensor, rtol=rtol, atol=0.0)
        elif value is None:
            assert actual[key] is None, key
        else:
            torch.testing.assert_close(actual[key], value, rtol=rtol, atol=0.0, msg=key)


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected by the test)")


def unsplit_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: Callable) -> None:
    loss_fn(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# -- 1. a failed attempt leaves nothing behind --------------------------------------------------


def _sim_budget(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """A simulated GPU on which this ResNet's forward and backward fit for half the batch, not the whole."""
    reserved = []
    for n in (len(batch[0]), len(batch[0]) // 2):
        gpu = memfit.device("sim:1GiB")
        model = resnet()
        with gpu:
            gpu.adopt(list(model.parameters()) + list(model.buffers()))
            gpu.reset_peak_memory_stats()
            classify(model, (batch[0][:n], batch[1][:n])).backward()
            reserved.append(gpu.memory_stats()["reserved_bytes.all.peak"])
    assert reserved[1] < reserved[0]
    return (reserved[0] + reserved[1]) // 2


def test_a_batchnorm_resnet_is_refused_and_left_as_it_was() -> None:
    """exact=True: BatchNorm in training cannot split exactly; the OOMed forward's statistics are undone."""
    batch = images(64, size=32)
    budget = _sim_budget(batch)
    model = resnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = state_of(model, optimizer)
    gpu = memfit.device(f"sim:{budget}B")
    guard = Guard(model, optimizer, classify, device=gpu)
    with gpu, pytest.raises(SplitRefusedError) as caught:
        gpu.adopt(list(model.parameters()) + list(model.buffers()))
        guard.step(batch)
    assert "BatchNorm2d 'bn1' in training mode" in str(caught.value) and "exact=False" in str(caught.value)
    assert len(guard.events) == 1  # the OOM of the whole batch happened (in forward or backward)
    assert_same_state(state_of(model, optimizer), before)  # num_batches_tracked 0, running stats untouched
    # the user retries on a larger device: the same as the plain loop's first step
    reference = resnet()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    unsplit_step(reference, reference_optimizer, batch, classify)
    guard.step(batch)
    assert_same_state(state_of(model, optimizer), state_of(reference, reference_optimizer), rtol=1e-5)


def test_exact_false_splits_a_resnet_with_the_statistics_of_the_attempt_that_ran() -> None:
    """An OOM in the second micro-batch's forward: its first micro-batch's BatchNorm updates are undone."""
    batch = images(8)
    reference = resnet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Guard(
            reference, torch.optim.SGD(reference.parameters(), lr=0.1), classify, micro_batch_size=2, exact=False
        ).step(batch)
    model = resnet()
    calls = {"n": 0}

    def failing(model: nn.Module, micro: Any) -> torch.Tensor:
        if not checking():
            calls["n"] += 1
            if calls["n"] == 2:  # the second micro-batch of 4, after the first ran forward and backward
                raise _oom()
        return classify(model, micro)

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), failing, micro_batch_size=4, exact=False)
    with pytest.warns(UserWarning, match="BatchNorm"):
        guard.step(batch)
    assert [(e.micro_batch_before, e.micro_batch_after) for e in guard.events] == [(4, 2)]
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0.0, atol=0.0, msg=name)
    assert int(model.bn1.num_batches_tracked) == 4  # the four micro-batches of 2 that ran, not 2 + 4


def test_an_oom_in_the_optimizer_step_leaves_the_state_before_the_step() -> None:
    """Adam's first step makes its state, then runs out: caught, everything is as before; the retry is the plain step."""
    batch = images(8)
    model = resnet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    fail = {"now": True}
    original = optimizer.step

    def step_that_runs_out(*args: Any, **kwargs: Any) -> Any:
        if fail["now"]:
            fail["now"] = False
            for p in model.parameters():  # the state, as Adam's _init_group makes it, then the OOM
                optimizer.state[p]["step"] = torch.tensor(0.0)
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
            raise _oom()
        return original(*args, **kwargs)

    optimizer.step = step_that_runs_out  # type: ignore[method-assign]
    before = state_of(model, optimizer)
    rng = torch.random.get_rng_state()
    guard = Guard(model, optimizer, classify, clip_grad_norm=1.0)
    with pytest.raises(GuardError, match=r"optimizer\.step"):
        guard.step(batch)
    assert_same_state(state_of(model, optimizer), before)  # no state, no gradient, BatchNorm as before
    assert torch.equal(torch.random.get_rng_state(), rng)
    reference = resnet()
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    classify(reference, batch).backward()
    nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    reference_optimizer.step()
    reference_optimizer.zero_grad(set_to_none=True)
    guard.step(batch)
    assert_same_state(state_of(model, optimizer), state_of(reference, reference_optimizer), rtol=1e-5)


def test_a_partial_optimizer_step_is_said_not_hidden() -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    original = optimizer.step

    def half_a_step(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            model.weight.sub_(0.1 * model.weight.grad)
        raise _oom()

    optimizer.step = half_a_step  # type: ignore[method-assign]
    guard = Guard(model, optimizer, lambda m, b: m(b).pow(2).mean())
    with pytest.raises(GuardError, match=r"had already changed 1 parameter"):
        guard.step(torch.randn(4, 4))
    optimizer.step = original  # type: ignore[method-assign]


def test_before_step_raising_leaves_the_gradients_the_user_had() -> None:
    """The issue's case: before_step raises, the user catches; that batch's gradient must not reach the next step."""
    batch, other = images(8, 1), images(8, 2)
    model = resnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    classify(model, other).backward()  # the user's own accumulated gradient, kept across the failure
    mine = state_of(model, optimizer)
    raised = {"once": True}

    def before_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if raised["once"]:
            raised["once"] = False
            raise ValueError("a logging hook failed")

    guard = Guard(model, optimizer, classify, before_step=before_step)
    with pytest.raises(ValueError, match="logging hook"):
        guard.step(batch)
    assert_same_state(state_of(model, optimizer), mine)
    reference = resnet()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    classify(reference, other).backward()
    unsplit_step(reference, reference_optimizer, batch, classify)
    guard.step(batch)
    assert_same_state(state_of(model, optimizer), state_of(reference, reference_optimizer), rtol=1e-5)


# -- 2. the reduction is checked on the user's own loss -------------------------------------


class VAE(nn.Module):
    """pytorch/examples vae's model, small: its loss is summed over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(16, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.fc3, self.fc4 = nn.Linear(2, 8), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(logvar) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def vae_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = model(x)
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


def _split_once(model: nn.Module, loss_fn: Callable, batch: Any, **options: Any) -> Guard:
    """One guarded step that splits (micro-batches of 3 from the start); returns the guard."""
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, micro_batch_size=3, **options)
    guard.step(batch)
    return guard


def _compare(
    make: Callable[[], nn.Module], loss_fn: Callable, batch: Any, seed: int = 0, **options: Any
) -> tuple[Guard, nn.Module, nn.Module]:
    torch.manual_seed(seed)
    reference = make()
    torch.manual_seed(seed)
    model = make()
    torch.manual_seed(1)
    unsplit_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batch, loss_fn)
    torch.manual_seed(1)
    guard = _split_once(model, loss_fn, batch, **options)
    return guard, model, reference


def test_a_summed_loss_is_weighted_one_per_micro_batch() -> None:
    """The VAE's loss (reduction="sum"): the check finds it; the split update equals the whole's.

    Its reparameterisation draws noise per sample: the check runs with constant draws, and
    the comparison here uses a VAE whose noise is zero (eval-like), so both runs draw the same.
    """
    batch = torch.rand(8, 16)

    def deterministic(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mu = model.fc21(F.relu(model.fc1(x)))  # z = mu: no noise
        recon = torch.sigmoid(model.fc4(F.relu(model.fc3(mu))))
        return F.binary_cross_entropy(recon, x, reduction="sum")

    guard, model, reference = _compare(VAE, deterministic, batch)
    assert guard.splitter.weighting is not None and guard.splitter.weighting.name == "sum"
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    guard = _split_once(VAE(), vae_loss, batch)  # the real VAE loss, random draws and all
    assert guard.splitter.weighting is not None and guard.splitter.weighting.name == "sum"


def test_a_token_mean_with_ignore_index_is_weighted_by_valid_tokens() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 20, (8, 6))
    labels = tokens.clone()
    labels[::2, 3:] = -100  # half the samples have fewer targets
    batch = {"input_ids": tokens, "labels": labels}

    def make() -> nn.Module:
        return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))

    def token_mean(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=-100)

    guard, model, reference = _compare(make, token_mean, batch)
    assert guard.splitter.weighting.name == "valid tokens of batch['labels']"
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def _contrastive(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """SimCLR's NT-Xent: each sample's negatives are the other samples of the batch."""
    a, b = F.normalize(model(batch[0]), dim=1), F.normalize(model(batch[1]), dim=1)
    logits = a @ b.T / 0.5
    return F.cross_entropy(logits, torch.arange(len(a)))


def _std_normalized(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Advantage normalisation, as policy-gradient code does: statistics over the batch."""
    advantages = (batch[1] - batch[1].mean()) / batch[1].std()
    return -(model(batch[0]).squeeze(1) * advantages).mean()


@pytest.mark.parametrize(
    ("loss_fn", "why"),
    [(_contrastive, "do not add up"), (_std_normalized, "not finite")],
)
def test_a_loss_that_couples_the_samples_is_refused_before_anything_changes(loss_fn: Callable, why: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 4) if loss_fn is _contrastive else nn.Linear(6, 1)
    batch = (torch.randn(8, 6), torch.randn(8, 6) if loss_fn is _contrastive else torch.randn(8))
    before = state_of(model)
    rng = torch.random.get_rng_state()
    with pytest.raises(SplitRefusedError, match=why) as caught:
        _split_once(model, loss_fn, batch)
    assert "\n" not in str(caught.value) and "couples the samples" in str(caught.value)
    assert_same_state(state_of(model), before)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_exact_false_splits_a_coupled_loss_after_a_warning() -> None:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="splitting although"):
        _split_once(nn.Linear(6, 4), _contrastive, (torch.randn(8, 6), torch.randn(8, 6)), exact=False)


# -- 3. equal micro-batches, non-finite gradients, batches along two dimensions -------------------


def test_micro_batches_are_as_equal_as_the_batch_allows() -> None:
    assert chunk_sizes(9, 8) == [5, 4] and chunk_sizes(17, 8) == [6, 6, 5] and chunk_sizes(16, 8) == [8, 8]
    seen: list[int] = []
    model = nn.Linear(6, 1)

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if not checking():
            seen.append(len(batch))
        return model(batch).mean()

    Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, micro_batch_size=8).step(torch.randn(17, 6))
    assert seen == [6, 6, 5]


def test_a_non_finite_gradient_is_never_stepped() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    before = state_of(model)
    batch = torch.randn(8, 6)
    batch[5, 0] = float("inf")  # a sample of the second micro-batch

    def loss_fn(model: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return model(b).mean() if not checking() else model(b.nan_to_num(posinf=0.0)).mean()

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, micro_batch_size=4)
    with pytest.raises(NonFiniteGradientError, match=r"micro-batch 2 of 2 \(samples 4 to 7 of 8\)"):
        guard.step(batch)
    assert_same_state(state_of(model), before)


class GCN(nn.Module):
    """A whole-graph model: every node's features mix through the (N, N) adjacency."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return adj @ self.lin(x)


def test_a_batch_carried_along_two_dimensions_is_refused_with_its_name() -> None:
    torch.manual_seed(0)
    model = GCN()
    n = 8
    batch = {"x": torch.randn(n, 5), "adj": torch.rand(n, n), "y": torch.randint(0, 3, (n,))}
    before = state_of(model)

    def loss_fn(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b["x"], b["adj"]), b["y"])

    with pytest.raises(SplitRefusedError, match=r"batch\['adj'\] \(8, 8\) carries the sample count") as caught:
        _split_once(model, loss_fn, batch)
    assert isinstance(caught.value.__cause__, RuntimeError)  # the user's own error stays visible
    assert_same_state(state_of(model), before)


# -- 4. the outputs of the step ------------------------------------------------------------------


def test_the_outputs_of_a_split_step_are_the_whole_batch_s() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    batch = (torch.randn(10, 6), torch.randint(0, 3, (10,)))

    def loss_fn(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = model(b[0])
        return {"loss": F.cross_entropy(logits, b[1]), "logits": logits}

    expected = model(batch[0]).detach()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, micro_batch_size=4)
    guard.step(batch)
    assert guard.accumulation == 3
    torch.testing.assert_close(guard.outputs["logits"], expected)
    assert not guard.outputs["logits"].requires_grad


def test_a_failed_step_under_a_grad_scaler_leaves_the_scaler_as_it_was() -> None:
    """before_step raises after the scaler unscaled: the retry unscales again and equals the plain scaled step."""
    torch.manual_seed(0)
    model, reference = nn.Linear(6, 3), nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())
    batch = (torch.randn(8, 6), torch.randint(0, 3, (8,)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    raised = {"once": True}

    def before_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if raised["once"]:
            raised["once"] = False
            raise ValueError("hook")

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, optimizer, classify, scaler=scaler, clip_grad_norm=1.0, before_step=before_step)
    with pytest.raises(ValueError, match="hook"):
        guard.step(batch)
    assert scaler.get_scale() == 2.0**10 and all(p.grad is None for p in model.parameters())
    guard.step(batch)  # would raise "unscale_() has already been called" with the failed step's record
    reference_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_scaler.scale(classify(reference, batch)).backward()
    reference_scaler.unscale_(reference_optimizer)
    nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    reference_scaler.step(reference_optimizer)
    reference_scaler.update()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0.0)
    assert scaler.get_scale() == reference_scaler.get_scale()


def test_dropout_does_not_hide_a_mean_loss_from_the_check() -> None:
    """Masks drawn per call differ between a batch and its parts; the check draws constants instead."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    guard = _split_once(model, classify, (torch.randn(8, 6), torch.randint(0, 3, (8,))))
    assert guard.splitter.weighting is not None and guard.splitter.weighting.name == "samples"
    assert guard.accumulation == 3
