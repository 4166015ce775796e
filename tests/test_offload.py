"""CPU offload (shard="offload", FSDP2 with CPUOffloadPolicy): placing a traced step's
memory on the host and the GPU, the predicted transfers, and plan's fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.cli import main
from memfit.estimator.estimate import estimate
from memfit.estimator.fake import run_fake_steps
from memfit.estimator.offload import (
    HOST_OPTIMIZER_BANDWIDTH,
    OPTIMIZER_BYTES_PER_PARAMETER,
    gpu_side,
    host_link_bandwidth,
    split_events,
    transfer_seconds,
)
from memfit.memory.gpus import lookup
from memfit.memory.tracker import Labels
from memfit.run.measure import measure
from memfit.run.strategy import check_strategy, describe
from memfit.search.plan import plan

#: its states (16 MiB of parameters: 80 MiB with gradients and AdamW) outweigh its activations
WIDE_MLP = "mlp:layers=4,width=1024,features=64"


def test_split_events_places_the_states_on_the_host() -> None:
    events = [
        ("alloc", 1, 4096, Labels()),  # a parameter: made before the first step
        ("alloc", 2, 2048, Labels("forward", 0, "fc")),  # saved for backward
        ("alloc", 3, 4096, Labels("backward", 0)),  # the gradient
        ("free", 2, 0, Labels("backward", 0)),
        ("alloc", 4, 8192, Labels("optimizer", 0)),  # optimizer state
        ("alloc", 5, 100, Labels("optimizer", 0)),  # the CPU optimizer's scratch
        ("free", 5, 0, Labels("optimizer", 0)),
    ]
    placed = split_events(events)
    assert [event[1] for event in placed.gpu_events] == [2, 2]  # only the activation stays on the GPU
    assert placed.host_peak == 4096 + 4096 + 8192 + 100
    assert placed.host_parameters == 4096


def _mlp_workload(optimizer: object) -> memfit.Workload:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    return memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        optimizer=optimizer,
    )


def test_an_offloaded_optimizer_leaves_the_gpu_what_an_optimizer_without_state_holds() -> None:
    """AdamW's state and step on the host (ZeRO-Offload, torchao's CPUOffloadOptimizer): the
    GPU's side equals, to the byte, the simulated GPU's measurement of the same training
    with an in-place SGD, which allocates nothing on the device."""
    adamw = _mlp_workload(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    run = run_fake_steps(adamw, memfit.Settings(micro_batch_size=64))
    events = run.events
    sgd = measure(_mlp_workload(lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False)), 64, "sim:64MiB")
    side = gpu_side(events, ("optimizer state",))
    assert (side.peak_allocated, side.peak_reserved) == (sgd.peak_allocated, sgd.peak_reserved)
    assert run.peak_allocated > side.peak_allocated  # AdamW's state counted on the GPU
    states = 2 * sum(p.numel() * 4 for p in adamw.build_model().parameters())
    assert side.host_peak >= states  # exp_avg and exp_avg_sq of every parameter


def test_offloading_the_gradients_too_takes_them_off_the_gpu() -> None:
    adamw = _mlp_workload(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    events = run_fake_steps(adamw, memfit.Settings(micro_batch_size=64)).events
    optimizer_only = gpu_side(events, ("optimizer state",))
    with_gradients = gpu_side(events, ("optimizer state", "gradients"))
    gradients = sum(p.numel() * 4 for p in adamw.build_model().parameters())
    assert with_gradients.host_peak >= optimizer_only.host_peak + gradients
    assert with_gradients.peak_allocated < optimizer_only.peak_allocated
    # within a budget the replay is the caching allocator's verdict on the GPU's share alone
    reserved = optimizer_only.peak_reserved
    assert gpu_side(events, ("optimizer state",), budget=reserved).fits is True
    assert gpu_side(events, ("optimizer state",), budget=reserved - 1).fits is False


def test_transfer_time_by_the_host_link_and_host_bandwidth() -> None:
    card = lookup("RTX 4090")  # Ada: PCIe 4.0 x16
    assert host_link_bandwidth(card) == pytest.approx(31.5e9 * 0.8)
    copies, optimizer = transfer_seconds(10**9, 10**9, 25 * 10**7, 2, card)
    # two micro-batches, each: parameters in twice (forward, backward), gradients out once
    assert copies == pytest.approx(2 * 3e9 / (31.5e9 * 0.8))
    assert optimizer == pytest.approx(25e7 * OPTIMIZER_BYTES_PER_PARAMETER / HOST_OPTIMIZER_BANDWIDTH)


def test_offload_is_a_strategy_for_one_gpu_too() -> None:
    check_strategy("offload", world_size=1)
    assert "CPUOffloadPolicy" in describe("offload", 1) and "one GPU" in describe("offload", 1)
    check_strategy("offload", world_size=4, group_size=2)


def test_only_offload_fits_on_a_small_device() -> None:
    plain = estimate(WIDE_MLP, 2, device="sim:48MiB", search=False)
    offloaded = estimate(WIDE_MLP, 2, memfit.Settings(shard="offload"), device="sim:48MiB", search=False)
    assert plain.fits is False and offloaded.fits is True
    states = sum(plain.breakdown[name] for name in ("parameters", "gradients", "optimizer state"))
    # the GPU keeps none of the states; the host keeps them all (and the optimizer step's scratch)
    assert not any(offloaded.breakdown.get(name) for name in ("parameters", "gradients", "optimizer state"))
    assert offloaded.host_memory is not None and offloaded.host_memory >= states
    assert offloaded.peak_allocated < plain.peak_allocated and offloaded.peak_reserved <= 48 * 2**20
    assert offloaded.breakdown["unsharded parameters"] > 0  # FSDP2's gathered units
    time = offloaded.predicted_time
    assert time is not None and time["offload_copy_seconds"] > 0 and time["cpu_optimizer_seconds"] > 0
    assert offloaded.predicted_seconds_per_step is not None


def test_a_simulated_gpu_refuses_to_run_offload(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["measure", "mlp", "--batch-size", "2", "--device", "sim:64MiB", "--shard", "offload"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("memfit: error:") and "host memory" in err and "\n" not in err


def test_plan_falls_back_to_offload_when_nothing_else_fits() -> None:
    result = plan(WIDE_MLP, 2, "sim:48MiB", precisions=["fp32"], checkpointing=["none"])
    best = result.recommended
    assert best is not None and best.settings.shard == "offload"
    assert all(c.status != "measured" for c in result.candidates if c.settings.shard == "none")
    assert any("host memory" in line for line in result.advice)
    assert best.predicted_samples_per_second is not None


def test_plan_with_its_strategies_chosen_does_not_offload() -> None:
    with pytest.raises(memfit.DoesNotFitError):
        plan(WIDE_MLP, 2, "sim:48MiB", precisions=["fp32"], checkpointing=["none"], shards=["none"])


#: blocks save nothing on the GPU alone here (its step's peak is AdamW's, whose states offload moves to the host)
STATE_HEAVY_GPT = "gpt:layers=4,embd=512,heads=2,seq_len=24,vocab=1024"


def test_under_offload_the_plan_weighs_checkpointing_that_saved_nothing_on_the_gpu_alone() -> None:
    result = plan(STATE_HEAVY_GPT, 8, "sim:56MiB", precisions=["fp32"])
    by = {(c.settings.shard, c.settings.checkpointing, c.settings.micro_batch_size): c for c in result.candidates}
    assert by["none", "blocks", 8].status == "saves nothing (4 x Block)"
    # on the host's side of the policy the activations set the GPU's peak: recomputing them fits micro-batch 4
    assert by["offload", "none", 4].status == "over headroom"
    assert by["offload", "blocks", 4].status == "measured"
    best = result.recommended
    assert best is not None
    assert (best.settings.shard, best.settings.checkpointing, best.settings.micro_batch_size) == (
        "offload",
        "blocks",
        4,
    )
