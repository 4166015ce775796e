"""Trials on fake tensors (memfit.search.trials): the same answers as real trials, confirmed for real."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import memfit
from memfit.errors import DoesNotFitError, MemfitError
from memfit.run.measure import measure
from memfit.search.plan import plan
from memfit.search.probe import probe
from memfit.search.trials import choose_trials, fake_measure
from memfit.workload import Workload
from memfit.workload.zoo import TINY

MLP = TINY["mlp"]


def linear_workload(loss=None, features: int = 64) -> Workload:
    """A one-layer model from a factory (fake trials apply), with an optional custom loss."""

    def default_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    return Workload(
        model=lambda: torch.nn.Linear(features, 4),
        make_batch=lambda n: (torch.randn(n, features), torch.randint(0, 4, (n,))),
        loss=loss or default_loss,
        name="linear",
    )


@pytest.mark.parametrize(
    ("ref", "batch"),
    [(TINY["mlp"], 64), (TINY["convnet"], 16), (TINY["gpt2"], 4), (TINY["convnet"], 4000)],
)
def test_a_fake_trial_measures_what_a_real_trial_measures_on_sim(ref: str, batch: int) -> None:
    workload, gpu = memfit.load_workload(ref), memfit.device("sim:16MiB")
    fake, real = fake_measure(workload, batch, gpu), measure(workload, batch, gpu)
    assert (fake.fits, fake.peak_allocated, fake.peak_reserved) == (real.fits, real.peak_allocated, real.peak_reserved)
    assert fake.fake and not real.fake
    assert fake.seconds_per_step is None  # fake tensors do no arithmetic: no time to report


def test_probe_on_fake_tensors_gives_the_real_answer_confirmed_by_real_runs() -> None:
    real = probe(MLP, "sim:4MiB", trials="real")
    fast = probe(MLP, "sim:4MiB")  # the default on a simulated GPU
    answers = ("max_batch_size", "headroom_batch_size", "limit")
    assert [getattr(fast, name) for name in answers] == [getattr(real, name) for name in answers]
    # Fake trials have no time, so the recommendation is the headroom batch (the real
    # path's throughput pick among small batches rests on CPU timings).
    assert fast.recommended_batch_size == fast.headroom_batch_size
    on_device = [(t.batch_size, t.fits) for t in fast.trials if not t.fake]
    # the smallest batch first (a broken step fails at once), then the search's proof
    assert on_device == [(1, True), (fast.max_batch_size, True), (fast.max_batch_size + 1, False)]
    # the search itself ran every trial of the real search, on fake tensors, with the same
    # outcomes (the real path may time a batch again for the throughput rule: a repeat)
    searched = [(t.batch_size, t.fits, t.peak_reserved) for t in fast.trials if t.fake]
    assert searched == list(dict.fromkeys((t.batch_size, t.fits, t.peak_reserved) for t in real.trials))
    data = fast.to_dict()
    assert data["fake_trials"] == len(searched) and data["trials_note"] is None
    assert [t["fake"] for t in data["trials"]] == [t.fake for t in fast.trials]


def test_a_search_bounded_by_max_batch_size_is_confirmed_without_a_proof_above_it() -> None:
    result = probe(MLP, "sim:64MiB", max_batch_size=48, guess=None)
    assert (result.max_batch_size, result.limit) == (48, "max_batch_size")
    assert [(t.batch_size, t.fits) for t in result.trials if not t.fake] == [(1, True), (48, True)]


def test_a_nan_loss_fails_at_the_first_real_run_before_the_search() -> None:
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1]) * float("nan")

    seen: list[tuple[int, bool]] = []
    with pytest.raises(MemfitError, match="the loss at batch 1 is nan"), pytest.warns(UserWarning):
        probe(linear_workload(loss), "sim:4MiB", progress=lambda b, m: m is not None and seen.append((b, m.fake)))
    assert seen == [(1, False)]  # no fake trial ran before it


def test_a_step_fake_tensors_cannot_run_falls_back_to_real_trials_and_says_why() -> None:
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        positive = x[x > 0]  # boolean indexing: its shape depends on the data
        return F.cross_entropy(model(x), y) + 0 * positive.sum()

    told: list[str] = []
    workload = linear_workload(loss)
    real = probe(workload, "sim:4MiB", trials="real", guess=None)
    fast = probe(workload, "sim:4MiB", guess=None, say=told.append)
    assert fast.max_batch_size == real.max_batch_size
    assert not any(t.fake for t in fast.trials)
    assert len(told) == 1 and "fake tensors cannot run this step" in told[0]
    assert fast.to_dict()["trials_note"] == told[0]


def test_a_real_run_that_disagrees_makes_the_search_run_again_on_real_trials() -> None:
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        if not isinstance(out, FakeTensor):
            # 8 KiB per sample (its gradient, in backward) that only the real step
            # allocates: fake tensors under-count
            out = out + 0 * torch.ones(x.shape[0], 2048, requires_grad=True).sum()
        return F.cross_entropy(out, y)

    told: list[str] = []
    workload = linear_workload(loss)
    real = probe(workload, "sim:4MiB", trials="real", guess=None)
    fast = probe(workload, "sim:4MiB", guess=None, say=told.append)
    assert fast.max_batch_size == real.max_batch_size
    assert measure(workload, fast.max_batch_size, "sim:4MiB").fits
    assert not measure(workload, fast.max_batch_size + 1, "sim:4MiB").fits
    assert len(told) == 1 and "the search ran again on real trials" in told[0]


def test_a_model_instance_runs_real_trials_and_says_why() -> None:
    base = memfit.load_workload(MLP)
    model = base.build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    workload = Workload(model, base.make_batch, base.loss, lambda _params: optimizer, name="script")
    told: list[str] = []
    result = probe(workload, "sim:4MiB", max_batch_size=16, say=told.append)
    assert not any(t.fake for t in result.trials)
    assert len(told) == 1 and "optimizer bound to its real parameters" in told[0]


def test_nothing_fits_is_confirmed_by_a_real_run() -> None:
    with pytest.raises(DoesNotFitError, match="does not fit even at batch size 1"):
        probe("mlp:layers=2,width=32,features=16384", "sim:2MiB")


def test_trials_are_real_on_an_unlimited_device_and_a_bad_kind_is_a_user_error() -> None:
    workload = memfit.load_workload(MLP)
    assert not choose_trials("auto", workload, memfit.device("cpu")).fake
    assert choose_trials("auto", workload, memfit.device("sim:4MiB")).fake
    assert not choose_trials("real", workload, memfit.device("sim:4MiB")).fake
    with pytest.raises(MemfitError, match="invalid trials 'quick'"):
        probe(MLP, "sim:4MiB", trials="quick")  # type: ignore[arg-type]


def test_several_ranks_are_rehearsed_with_real_trials_and_say_why() -> None:
    """A fake trial runs one GPU's step: for N ranks the trials must run the strategy's
    wrapped model on a fake process group, so they are real, and the probe says why."""
    workload = memfit.load_workload(MLP)
    one = choose_trials("auto", workload, memfit.device("sim:4MiB"), memfit.Settings())
    two = choose_trials("auto", workload, memfit.device("sim:4MiB"), memfit.Settings(world_size=2, shard="full"))
    assert one.fake and not two.fake
    told: list[str] = []
    result = probe(
        MLP, "sim:4MiB", memfit.Settings(world_size=2, shard="full"), max_batch_size=8, guess=None, say=told.append
    )
    assert not any(t.fake for t in result.trials)
    assert result.extra["rehearsed_world_size"] == 2
    assert len(told) == 1 and "one rank of 2 is rehearsed on a fake process group" in told[0]


def test_plan_on_fake_tensors_finds_what_real_trials_find_and_runs_the_choice_for_real() -> None:
    ref, device = "mlp:layers=4,width=256,features=256", "sim:8MiB"
    real = plan(ref, 512, device, precisions=["fp32", "bf16"], trials="real")
    seen: list[tuple[int, str, str, bool]] = []

    def progress(c) -> None:
        s = c.settings
        seen.append((s.micro_batch_size, s.precision, s.checkpointing, c.measurement.fake))

    fast = plan(ref, 512, device, precisions=["fp32", "bf16"], progress=progress)

    def memory(result):  # the memory answers: fits (and its peak), does not fit, or skipped as dominated
        verdict = {"measured": "fits", "out of memory": "no", "too large (estimate)": "no"}
        return [
            (c.settings, verdict.get(c.status, "skipped"), c.measurement.peak_reserved if c.fits else None)
            for c in result.candidates
        ]

    assert memory(fast) == memory(real)
    assert fast.recommended is not None and fast.recommended.measurement is not None
    assert not fast.recommended.measurement.fake  # the recommended candidate ran on the device
    # Every candidate tried ran on fake tensors (a fake trial per candidate, largest first,
    # in place of the estimator's search); the predicted speed ranked them, so only the
    # recommended one ran on the device.
    assert fast.ranked_by == real.ranked_by == "predicted"
    fake_first = [entry[:3] for entry in seen if entry[3]]
    on_device = [entry[:3] for entry in seen if not entry[3]]
    tried = [(c.settings.micro_batch_size, c.settings.precision, c.settings.checkpointing) for c in fast.candidates]
    assert sorted(fake_first) == sorted(t for t, c in zip(tried, fast.candidates, strict=True) if c.measurement)
    chosen = fast.recommended.settings
    assert on_device == [(chosen.micro_batch_size, chosen.precision, chosen.checkpointing)]
    assert all(c.status != "too large (estimate)" for c in fast.candidates)
    assert chosen == real.recommended.settings  # the same speeds rank the same memory answers


def test_plan_falls_back_to_real_trials_when_a_real_run_disagrees() -> None:
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        if not isinstance(out, FakeTensor):
            out = out + 0 * torch.ones(x.shape[0], 4096, requires_grad=True).sum()  # only the real step
        return F.cross_entropy(out, y)

    workload, device = linear_workload(loss), "sim:4MiB"
    told: list[str] = []
    result = plan(workload, 256, device, precisions=["fp32"], say=told.append)
    best = result.recommended
    assert best is not None and best.measurement is not None and not best.measurement.fake
    assert measure(workload, best.settings.micro_batch_size, device).fits
    assert len(told) == 1 and "the plan ran again on real trials" in told[0]
    assert result.trials_note == told[0]


def test_the_re_plan_on_real_trials_keeps_the_estimators_pruning_and_the_callers_lines() -> None:
    """After fake and real trials disagree the plan runs again on real trials: that run is
    the plan a caller asking for real trials gets (the estimator prunes what cannot fit),
    and it reports through the caller's ``say`` and ``progress``, not in silence."""

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        if not isinstance(out, FakeTensor):
            out = out + 0 * torch.ones(x.shape[0], 4096, requires_grad=True).sum()  # only the real step
        return F.cross_entropy(out, y)

    # 2048 features: micro-batch 256 is too large even by the estimate, 128 only for real
    workload, device = linear_workload(loss, features=2048), "sim:4MiB"
    told: list[str] = []
    seen: list[tuple[int, bool]] = []

    def progress(c) -> None:
        seen.append((c.settings.micro_batch_size, c.measurement.fake))

    again = plan(workload, 256, device, precisions=["fp32"], say=told.append, progress=progress)
    real = plan(workload, 256, device, precisions=["fp32"], trials="real")
    statuses = [(c.settings, c.status) for c in again.candidates]
    assert statuses == [(c.settings, c.status) for c in real.candidates]
    assert any(status == "too large (estimate)" for _, status in statuses)
    assert told and told[0] == again.trials_note
    assert any(not fake for _, fake in seen)  # the re-plan's real trials reached progress
