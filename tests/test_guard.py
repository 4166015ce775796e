"""memfit guard: an OOM in forward or backward splits the batch; the update stays the whole batch's.

The failure seam is fault injection at the user's level: the loss function, a forward
hook, an autograd Function and a tensor hook raise a real ``torch.OutOfMemoryError`` at
chosen micro-batches; the simulated GPU raises real ones when its budget runs out. After
every step the parameters are compared with one plain, unsplit step on the whole batch.
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import DoesNotFitError, MemfitError
from memfit.guard import Guard, GuardError, SplitPolicy
from memfit.guard.batching import chunk_sizes
from memfit.guard.check import checking
from memfit.guard.gradients import expected_optimizer_state_bytes, reset_scaler_step_state
from memfit.guard.policy import grow, halve
from memfit.memory.allocator import round_size
from memfit.units import MiB

REL_TOL = 1e-6
KINDS = ("forward", "forward-hook", "backward", "backward-mid")
WHERE = {"forward": "forward", "forward-hook": "forward", "backward": "backward", "backward-mid": "backward"}


@pytest.fixture(autouse=True, scope="module")
def _quiet_machine() -> Any:
    """One intra-op thread and a frozen heap for this module's hundreds of tiny steps.

    Why: on a shared 2-core machine, tiny ops on two OpenMP threads spend their time
    spinning (50 ms instead of 5 per step), and every recovered OOM runs a full
    ``gc.collect()`` over torch's and transformers' objects (0.5 s); frozen objects are
    skipped by it. Both are restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


# -- the fault injector -------------------------------------------------------------------------


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected by the test)")


class _RaiseInBackward(torch.autograd.Function):
    """Identity in forward; when backward reaches it, calls ``before`` and raises an OOM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, before: Callable[[], None]) -> torch.Tensor:
        ctx.before = before
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.before()
        raise _oom()


@dataclass
class Faults:
    """Raise an OOM at chosen micro-batches of each attempt, and record which samples each attempt used.

    ``plan`` holds (micro-batch index within the attempt, kind); the first entry fires
    at that call of the loss function and is removed; the call count starts again,
    as the guard starts a new attempt after an OOM.
    """

    model: nn.Module
    plan: list[tuple[int, str]] = field(default_factory=list)
    calls: int = 0
    used: list[int] = field(default_factory=list)
    raised: list[tuple[int, str]] = field(default_factory=list)
    grads_at_mid_backward: list[bool] = field(default_factory=list)
    weighted: bool = False
    _hook_armed: bool = False

    def __post_init__(self) -> None:
        # A forward hook in the middle of the model, and a tensor hook on a hidden
        # activation: both raise only when armed for the current micro-batch.
        self.model[2].register_forward_hook(self._forward_hook)
        self.model[1].register_forward_hook(self._arm_tensor_hook)
        self._mid_backward_armed = False

    def expect(self, plan: list[tuple[int, str]]) -> None:
        """The OOMs of the next step (a new step starts its first attempt)."""
        self.plan, self.calls, self.used, self.raised = list(plan), 0, [], []

    def _due(self) -> str | None:
        if self.plan and self.plan[0][0] == self.calls:
            return self.plan[0][1]
        return None

    def _fired(self) -> None:
        self.raised.append(self.plan.pop(0))
        self.calls = 0
        self.used = []

    def _forward_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self._hook_armed:
            self._hook_armed = False
            self._fired()
            raise _oom()

    def _arm_tensor_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self._mid_backward_armed and output.requires_grad:
            self._mid_backward_armed = False

            def raise_now(grad: torch.Tensor) -> None:
                self.grads_at_mid_backward.append(any(p.grad is not None for p in self.model.parameters()))
                self._fired()
                raise _oom()

            output.register_hook(raise_now)

    def loss_fn(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if checking():  # the guard's check of the loss before its first split: no faults, not counted
            return plain_loss(model, batch, self.weighted)
        due = self._due()
        if due == "forward":
            self._fired()
            raise _oom()
        self._hook_armed = due == "forward-hook"
        self._mid_backward_armed = due == "backward-mid"
        loss = plain_loss(model, batch, self.weighted)
        if due == "backward":
            loss = _RaiseInBackward.apply(loss, self._fired)
        self.used.extend(batch[2].tolist())
        self.calls += 1
        return loss


def plain_loss(model: nn.Module, batch: tuple[torch.Tensor, ...], weighted: bool = False) -> torch.Tensor:
    """Cross-entropy, averaged over samples or (weighted) over each sample's token count."""
    inputs, targets, _index, tokens = batch
    per_sample = nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    if weighted:
        return (per_sample * tokens).sum() / tokens.sum()
    return per_sample.mean()


def make_model(seed: int, batchnorm: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    middle: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Tanh()
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), middle, nn.Linear(16, 3))


def make_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 6, generator=generator)
    targets = torch.randint(0, 3, (n,), generator=generator)
    tokens = torch.randint(1, 9, (n,), generator=generator).float()
    return inputs, targets, torch.arange(n), tokens


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def relative_difference(model: nn.Module, reference: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        worst = max(worst, float((p.detach() - q.detach()).norm() / q.detach().norm()))
    return worst


class Reference:
    """One plain, unsplit step on the whole batch, from the guarded model's current state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, kind: str, scaled: bool, weighted: bool):
        self.model = copy.deepcopy(model)
        self.optimizer = make_optimizer(kind, self.model.parameters())
        self.source_model, self.source_optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
        self.weighted = weighted

    def step(self, batch: tuple[torch.Tensor, ...]) -> float:
        self.model.load_state_dict(self.source_model.state_dict())
        self.optimizer.load_state_dict(copy.deepcopy(self.source_optimizer.state_dict()))
        loss = plain_loss(self.model, batch, self.weighted)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def halvings(size: int) -> int:
    """How many OOMs a micro-batch of ``size`` survives before size 1 fails."""
    count = 0
    while size > 1:
        size = halve(size)
        count += 1
    return count


# -- the 200 seeded fault-injection cases ----------------------------------------------------


def _fault_plan(rng: random.Random, samples: int, size: int) -> tuple[list[tuple[int, str]], list[int]]:
    """OOMs for one step: each at a random micro-batch of its attempt; the sizes they lead to."""
    plan = []
    sizes = [size]
    for _ in range(rng.randint(0, halvings(size))):
        calls = len(chunk_sizes(samples, size))
        plan.append((rng.randrange(calls), rng.choice(KINDS)))
        size = halve(size)
        sizes.append(size)
    return plan, sizes


@pytest.mark.parametrize("seed", range(200))
def test_fault_injection_gives_the_whole_batch_update(seed: int) -> None:
    rng = random.Random(seed)
    kind = rng.choice(["sgd", "adamw"])
    weighted = rng.random() < 0.3
    scaled = rng.random() < 0.2
    model = make_model(seed)
    optimizer = make_optimizer(kind, model.parameters())
    faults = Faults(model, weighted=weighted)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    start = rng.choice([None, None, rng.randint(1, 16)])
    guard = Guard(
        model,
        optimizer,
        faults.loss_fn,
        scaler=scaler,
        weight=(lambda b: b[3].sum()) if weighted else None,
        micro_batch_size=start,
    )
    reference = Reference(model, optimizer, kind, scaled, weighted)
    events = 0
    for step in range(3):
        samples = rng.randint(1, 16)
        batch = make_batch(samples, seed * 10 + step)
        plan, sizes = _fault_plan(rng, samples, guard.splitter.policy.size_for(samples))
        faults.expect(plan)

        expected_loss = reference.step(batch)
        loss = guard.step(batch)

        assert faults.raised == plan  # every planned OOM fired
        assert relative_difference(model, reference.model) < REL_TOL
        assert loss == pytest.approx(expected_loss, rel=REL_TOL)
        assert guard.last.samples == samples
        assert sorted(faults.used) == list(range(samples))  # every sample once in the update
        assert guard.last.attempts == len(plan) + 1
        assert guard.last.micro_batch_size == sizes[-1]
        assert guard.accumulation == len(chunk_sizes(samples, sizes[-1]))
        new_events = guard.events[events:]
        events = len(guard.events)
        assert [(e.micro_batch_before, e.micro_batch_after) for e in new_events] == list(itertools.pairwise(sizes))
        assert [(e.micro_batch_index, e.where) for e in new_events] == [(k, WHERE[w]) for k, w in plan]
        assert all(e.step == step for e in new_events)
        if plan:
            assert guard.micro_batch_size == sizes[-1]
        assert all(p.grad is None for p in model.parameters())


# -- the pieces of the policy ------------------------------------------------------------------


@pytest.mark.parametrize(("size", "expected"), [(2, 1), (3, 2), (8, 4), (7, 4), (1025, 513)])
def test_halve(size: int, expected: int) -> None:
    assert halve(size) == expected


def test_halve_refuses_one() -> None:
    with pytest.raises(ValueError):
        halve(1)


@pytest.mark.parametrize(("limit", "samples", "expected"), [(4, 16, 8), (8, 16, None), (3, 7, 6), (4, 7, None)])
def test_grow(limit: int, samples: int, expected: int | None) -> None:
    assert grow(limit, samples) == expected


@pytest.mark.parametrize(
    ("limit", "grow_after", "history", "expected"),
    [
        (4, 2, [False, False], None),  # two clean steps: 4 -> 8 covers the batch of 8
        (2, 2, [False, False], 4),
        (2, 2, [False, True, False], 2),  # an OOM restarts the count
        (2, None, [False] * 5, 2),  # no growing without grow_after
        (None, 1, [False], None),
    ],
)
def test_policy_grows_after_clean_steps(
    limit: int | None, grow_after: int | None, history: list[bool], expected: int | None
) -> None:
    policy = SplitPolicy(limit=limit, grow_after=grow_after)
    for had_oom in history:
        policy.finish_step(8, had_oom)
    assert policy.limit == expected


@pytest.mark.parametrize(("limit", "grow_after"), [(0, None), (4, 0)])
def test_policy_rejects_nonsense(limit: int, grow_after: int | None) -> None:
    with pytest.raises(MemfitError):
        SplitPolicy(limit=limit, grow_after=grow_after)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: torch.optim.AdamW(p), 2 * 4 * 70),
        (lambda p: torch.optim.Adam(p), 2 * 4 * 70),
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 4 * 70),
        (lambda p: torch.optim.LBFGS(p), None),
    ],
)
def test_expected_optimizer_state_bytes(make: Callable[[Any], torch.optim.Optimizer], expected: int | None) -> None:
    model = nn.Linear(10, 7)  # 70 weights... and 7 biases
    model.bias.requires_grad_(False)  # frozen: no state
    assert expected_optimizer_state_bytes(make(model.parameters())) == expected


def test_reset_scaler_step_state_allows_a_fresh_unscale() -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    reset_scaler_step_state(scaler)
    scaler.unscale_(optimizer)  # the discarded step's record is gone


# -- behaviour around the step -------------------------------------------------------------------


def _guard(seed: int = 0, **options: Any) -> tuple[Guard, Faults, nn.Module, torch.optim.Optimizer]:
    model = make_model(seed, batchnorm=options.pop("batchnorm", False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    faults = Faults(model)
    return Guard(model, optimizer, faults.loss_fn, **options), faults, model, optimizer


def test_partial_gradients_from_the_failed_backward_are_discarded() -> None:
    guard, faults, model, optimizer = _guard()
    reference = Reference(model, optimizer, "sgd", scaled=False, weighted=False)
    reference.optimizer = torch.optim.SGD(reference.model.parameters(), lr=0.1)
    batch = make_batch(8, 1)
    faults.expect([(0, "backward-mid")])
    reference.step(batch)
    guard.step(batch)
    assert faults.grads_at_mid_backward == [True]  # some gradients existed when it failed
    assert relative_difference(model, reference.model) < REL_TOL


def test_gradients_the_user_already_had_are_kept() -> None:
    guard, faults, model, _optimizer = _guard()
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    batch = make_batch(8, 2)
    faults.expect([(1, "backward"), (0, "forward")])
    plain_loss(reference, batch).backward()
    reference_optimizer.step()
    guard.step(batch)
    assert relative_difference(model, reference) < REL_TOL


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom("not memory"), KeyboardInterrupt(), RuntimeError("shape mismatch")])
@pytest.mark.parametrize("after_split", [False, True])
def test_other_errors_propagate_unchanged(error: BaseException, after_split: bool) -> None:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    faults = Faults(model)
    calls = []

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        calls.append(len(b[0]))
        if len(calls) == (3 if after_split else 1):
            raise error
        return faults.loss_fn(m, b)

    guard = Guard(model, optimizer, loss_fn)
    before = [p.detach().clone() for p in model.parameters()]
    faults.expect([(0, "forward")] if after_split else [])
    with pytest.raises(type(error)) as caught:
        guard.step(make_batch(8, 3))
    assert caught.value is error
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())  # no half-made gradient left behind


def test_oom_at_micro_batch_one_is_a_clear_error() -> None:
    guard, faults, model, _ = _guard()
    faults.expect([(0, "forward"), (1, "backward")])  # 2 -> 1 -> gives up
    with pytest.raises(GuardError) as caught:
        guard.step(make_batch(2, 4))
    message = str(caught.value)
    assert isinstance(caught.value, DoesNotFitError)
    assert message.startswith("out of memory at micro-batch size 1 (in backward): one sample does not fit")
    assert "parameters 1.70 KiB, gradients" in message and "\n" not in message  # 435 fp32 parameters
    assert caught.value.breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert [(e.micro_batch_before, e.micro_batch_after) for e in guard.events] == [(2, 1), (1, None)]
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_warns_once_when_it_first_splits_with_exact_false() -> None:
    guard, faults, _model, _ = _guard(batchnorm=True, exact=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.step(make_batch(8, 5))  # no split: no warning
        assert not caught
        faults.expect([(0, "forward")])
        guard.step(make_batch(8, 6))
        faults.expect([(1, "forward")])
        guard.step(make_batch(8, 7))
    assert len(guard.events) == 2
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "BatchNorm" in messages[0] and "GroupNorm" in messages[0]


def test_batchnorm_in_eval_mode_does_not_warn() -> None:
    guard, faults, model, _ = _guard(batchnorm=True)
    model[3].eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        faults.expect([(0, "forward")])
        guard.step(make_batch(8, 5))
    assert not caught


def test_grow_after_tries_the_larger_size_again() -> None:
    guard, faults, _, _ = _guard(grow_after=2)
    sizes = []
    for step in range(5):
        faults.expect([(0, "forward")] if step == 0 else [])
        guard.step(make_batch(8, step))
        sizes.append((guard.last.micro_batch_size, guard.micro_batch_size))
    # step 0: 8 fails, runs at 4; steps 1, 2 clean at 4; then whole batches again
    assert sizes == [(4, 4), (4, 4), (4, None), (8, None), (8, None)]


def test_events_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.guard")
    guard, faults, _, _ = _guard(logger=logger)
    faults.expect([(0, "forward"), (1, "backward")])
    with caplog.at_level(logging.WARNING, logger="test.guard"):
        guard.step(make_batch(8, 8))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [e.describe() for e in guard.events]
    assert lines[0] == "memfit guard: out of memory at step 0 in forward of micro-batch 0 on rank 0; micro-batch 8 -> 4"
    assert (
        lines[1] == "memfit guard: out of memory at step 0 in backward of micro-batch 1 on rank 0; micro-batch 4 -> 2"
    )


def test_custom_split_for_a_batch_memfit_cannot_split() -> None:
    """Features stored (features, samples): only the user knows dimension 1 is the samples'."""
    model = make_model(0)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    faults = Faults(model)
    inputs, targets, index, tokens = make_batch(6, 9)
    batch = {"features": inputs.t().contiguous(), "targets": targets, "index": index, "tokens": tokens}

    def split(b: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
        n = b["targets"].shape[0]
        return [
            {
                "features": b["features"][:, i : i + size],
                **{k: b[k][i : i + size] for k in ("targets", "index", "tokens")},
            }
            for i in range(0, n, size)
        ]

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return faults.loss_fn(m, (b["features"].t(), b["targets"], b["index"], b["tokens"]))

    guard = Guard(model, optimizer, loss_fn, split=split)
    faults.expect([(0, "backward")])
    guard.step(batch)
    plain_loss(reference, (inputs, targets, index, tokens)).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert guard.last.samples == 6 and guard.last.micro_batch_size == 3
    assert relative_difference(model, reference) < REL_TOL


def test_a_split_returning_the_wrong_number_of_micro_batches_is_an_error() -> None:
    model = make_model(0)
    faults = Faults(model)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), faults.loss_fn, split=lambda b, s: [b])
    faults.expect([(0, "forward")])
    with pytest.raises(MemfitError, match="returned 1 micro-batches for 8 samples; it must return 2"):
        guard.step(make_batch(8, 0))


def test_predict_splits_and_concatenates() -> None:
    model = make_model(0)
    faults = Faults(model)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), faults.loss_fn)
    batch = make_batch(10, 11)
    expected = model(batch[0])

    def predict(micro: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        faults._hook_armed = faults._due() == "forward-hook"
        out = model(micro[0])
        faults.calls += 1
        return {"logits": out, "index": micro[2]}

    faults.expect([(0, "forward-hook"), (1, "forward-hook")])  # 10 -> 5 -> 3
    out = guard.predict(batch, predict)
    assert out["index"].tolist() == list(range(10))
    torch.testing.assert_close(out["logits"], expected, rtol=1e-6, atol=1e-7)
    assert not out["logits"].requires_grad  # inference runs under no_grad
    assert [(e.where, e.micro_batch_before, e.micro_batch_after) for e in guard.events] == [
        ("predict", 10, 5),
        ("predict", 5, 3),
    ]
    assert guard.micro_batch_size is None  # training's size is its own


# -- real OOMs on the simulated GPU --------------------------------------------------------------


def _wide_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 4096), nn.Tanh(), nn.Linear(4096, 10))


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_real_oom_on_the_simulated_gpu_is_recovered() -> None:
    """1024 samples need about 50 MiB on this model, 512 about 42 MiB: a 46 MiB GPU splits once."""
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(1024, 32, generator=generator), torch.randint(0, 10, (1024,), generator=generator))
    gpu = memfit.device("sim:46MiB")
    model = _wide_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, optimizer, _classify, device=gpu)
    with gpu:
        gpu.adopt(model.parameters())
        guard.step(batch)
        after_first = gpu.memory_stats()["allocated_bytes.all.current"]
        guard.step(batch)  # the smaller size stays: no second OOM
    # the allocator model runs out in backward, where the gradients of 1024 samples' activations are made
    assert [(e.micro_batch_before, e.micro_batch_after, e.where) for e in guard.events] == [(1024, 512, "backward")]
    event = guard.events[0]
    # read while the OOM was handled: the 1024 samples' two 16 MiB activations were still alive
    assert event.allocated is not None and event.reserved is not None
    assert 32 * MiB <= event.allocated <= event.reserved <= 46 * MiB
    assert guard.micro_batch_size == 512 and guard.accumulation == 2
    # nothing of the failed attempt is left: the parameters and the batch, each block rounded to 512 B
    kept = list(model.parameters()) + list(batch)
    assert after_first == sum(round_size(t.numel() * t.element_size()) for t in kept)


def test_the_first_sim_step_equals_the_unsplit_step() -> None:
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(1024, 32, generator=generator), torch.randint(0, 10, (1024,), generator=generator))
    reference = _wide_model()
    _classify(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    gpu = memfit.device("sim:46MiB")
    model = _wide_model()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), _classify, device=gpu)
    with gpu:
        gpu.adopt(model.parameters())
        guard.step(batch)
    assert len(guard.events) == 1
    assert relative_difference(model, reference) < REL_TOL


def test_an_oom_in_optimizer_step_says_splitting_cannot_help() -> None:
    """A 2048x2048 layer: 16 MiB of weights and 16 of gradients fit in 60 MiB; AdamW's 32 more do not."""
    gpu = memfit.device("sim:60MiB")
    torch.manual_seed(0)
    model = nn.Linear(2048, 2048, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    guard = Guard(model, optimizer, lambda m, b: m(b).square().mean(), device=gpu)
    with gpu:
        gpu.adopt(model.parameters())
        with pytest.raises(GuardError) as caught:
            guard.step(torch.randn(4, 2048))
    message = str(caught.value)
    assert message.startswith("out of memory in optimizer.step(): splitting the batch cannot fix it")
    assert "parameters 16.00 MiB + gradients 16.00 MiB + AdamW state 32.00 MiB on a device of 60.00 MiB" in message
    assert "bf16" in message and "sharding" in message and "lighter optimizer" in message
    assert guard.events == []  # forward and backward were fine: nothing was split


def test_one_sample_that_does_not_fit_on_the_simulated_gpu() -> None:
    """Each sample makes 3 x 16 MiB of activations; 40 MiB cannot hold them beside the weights."""
    gpu = memfit.device("sim:40MiB")
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b.reshape(-1, 1)).tanh().exp().mean()

    guard = Guard(model, optimizer, loss_fn, device=gpu)
    with gpu:
        gpu.adopt(model.parameters())
        with pytest.raises(GuardError) as caught:
            guard.step(torch.randn(2, 4 * 2**20))
    message = str(caught.value)
    assert message.startswith("out of memory at micro-batch size 1 (in forward): one sample does not fit")
    assert "of 40.00 MiB allocated" in message
    breakdown = caught.value.breakdown
    assert breakdown["capacity"] == 40 * MiB and breakdown["parameters"] == 8
    assert breakdown["allocated"] is not None and breakdown["activations_and_temporaries"] > 16 * MiB
    assert [(e.micro_batch_before, e.micro_batch_after) for e in guard.events] == [(2, 1), (1, None)]
