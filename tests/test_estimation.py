"""memfit.estimate: hand-computed breakdowns, sim agreement, sharding, fake-tensor limits."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.batch_search import Outcome
from memfit.errors import MemfitError
from memfit.estimator.breakdown import Peak, analyze
from memfit.estimator.estimate import apply_sharding, estimate, largest_fitting, resolve_target
from memfit.estimator.fake import UnsupportedOperation, run_fake_steps
from memfit.estimator.sharding import bucket_sizes, shard_states, uses_ddp_buckets
from memfit.memory.gpus import lookup
from memfit.units import GiB, KiB, MiB

# mlp:layers=1,features=16,width=256,classes=16 at batch 256, by hand (fp32):
#   parameters: inp 256x16 (16384) + bias (1024); blocks.0.linear 256x256 (262144) + bias
#   (1024); out 16x256 (16384) + bias 64 B (one 512 B block)            = 297472
#   AdamW state: exp_avg and exp_avg_sq per parameter (2 x 297472); the scalar
#   step per parameter stays on the host (AdamW keeps it on the CPU unless
#   capturable or fused, on CUDA too), so the device holds none of it     = 594944
#   saved for backward at the end of forward: the batch x (256x16x4 = 16384) and labels
#   (256 int64 = 2048), the three hidden activations (3 x 256x256x4 = 786432), the
#   log-softmax (16384), nll_loss's total weight and the loss / 1 (2 x 512) = 822272
MLP = "mlp:layers=1,features=16,width=256,classes=16"
MLP_PARAMS = 297472
MLP_ADAMW = 594944
MLP_SAVED = 822272
TINY_GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=2,seq_len=32,vocab_size=1000"


def test_mlp_breakdown_matches_the_hand_computation() -> None:
    est = estimate(MLP, 256, device="sim:1GiB", search=False)
    assert est.breakdown["parameters"] == MLP_PARAMS
    assert est.breakdown["optimizer state"] == MLP_ADAMW
    named = ("parameters", "gradients", "optimizer state", "activations", "temporaries")
    assert sum(est.breakdown[name] for name in named) == est.peak_allocated
    assert est.breakdown["allocator overhead"] == est.peak_reserved - est.peak_allocated
    assert est.breakdown["fixed costs"] == 0 and est.total == est.peak_reserved


def test_mlp_activations_saved_for_backward_match_the_hand_computation() -> None:
    run = run_fake_steps(memfit.load_workload(MLP), memfit.Settings(micro_batch_size=256))
    end_of_forward = next(
        i for i, (kind, _, _, labels) in enumerate(run.events) if kind == "alloc" and labels == memfit_labels()
    )
    at_end = analyze(run.events, at=end_of_forward)
    assert at_end.categories["activations"] == MLP_SAVED
    assert at_end.categories["parameters"] == MLP_PARAMS
    assert at_end.categories["optimizer state"] == MLP_ADAMW
    assert at_end.categories["gradients"] == 0  # zero_grad(set_to_none) after step 0
    assert dict(at_end.top_modules) == {
        "inp": 262144,
        "blocks.0.linear": 262144,
        "blocks.0": 262144,
        "<outside modules>": 16384 + 2048 + 16384 + 1024,
    }


def memfit_labels():  # the first backward allocation of the second step ends its forward
    from memfit.memory.tracker import Labels

    return Labels("backward", 1, "")


@pytest.mark.parametrize(
    ("ref", "batch", "precision", "checkpointing"),
    [
        ("mlp:layers=2,width=64", 8, "fp32", "none"),
        ("convnet:blocks=2,channels=8,image_size=16", 4, "bf16", "blocks"),
        (TINY_GPT2, 2, "fp32", "none"),
        (TINY_GPT2, 2, "bf16", "blocks"),
        ("lstm-lm:vocab=128,emsize=16,hidden=16,layers=2,seq_len=8", 4, "fp32", "none"),
        ("lstm-lm:vocab=512,emsize=32,hidden=64,layers=2,seq_len=16", 16, "bf16", "none"),
    ],
)
def test_estimate_equals_sim_measurement(ref: str, batch: int, precision: str, checkpointing: str) -> None:
    settings = memfit.Settings(precision=precision, checkpointing=checkpointing)
    est = estimate(ref, batch, settings, device="sim:1GiB", search=False)
    measured = memfit.measure(ref, batch, "sim:1GiB", settings)
    assert est.fits is measured.fits is True
    assert est.peak_allocated == pytest.approx(measured.peak_allocated, rel=0.01)
    assert est.peak_reserved == pytest.approx(measured.peak_reserved, rel=0.01)


@pytest.mark.slow
def test_max_batch_size_equals_the_exhaustive_maximum_on_sim() -> None:
    ref, size = "convnet:blocks=1,channels=8,image_size=32", "sim:8MiB"
    fits = {b: memfit.measure(ref, b, size).fits for b in range(1, 41)}
    true_max = max(b for b, ok in fits.items() if ok)
    assert all(fits[b] for b in range(1, true_max + 1)) and not any(fits[b] for b in range(true_max + 1, 41))
    est = estimate(ref, device=size)
    assert est.max_batch_size == true_max == est.batch_size
    assert est.fits is True


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 7, 8, 9, 100, 1000, 25204])
def test_largest_fitting_finds_the_threshold_in_few_runs(threshold: int) -> None:
    calls: list[int] = []
    capacity = 1000 + 7 * threshold + 3  # memory 1000 + 7 per sample: the maximum is ``threshold``

    def trial(b: int) -> Outcome:
        calls.append(b)
        memory = 1000 + 7 * b
        return Outcome(b, memory <= capacity, memory if memory <= capacity else 0)

    assert largest_fitting(trial, capacity) == threshold
    assert len(calls) <= 6  # a linear curve: found and proven in a handful of fake runs


def test_largest_fitting_stops_at_its_limit() -> None:
    assert largest_fitting(lambda b: Outcome(b, True, 1), 10**9, limit=64) == 64


@pytest.mark.parametrize(
    ("shard", "world", "expected"),
    [
        ("none", 4, (1000, 1000, 2000)),
        ("optimizer", 4, (1000, 1000, 500)),
        ("gradients", 4, (1000, 250, 500)),
        ("full", 4, (250, 250, 500)),
        ("full", 3, (334, 334, 667)),  # ceil: no byte is lost
        ("full", 1, (1000, 1000, 2000)),
    ],
)
def test_shard_states(shard: str, world: int, expected: tuple[int, int, int]) -> None:
    assert shard_states(1000, 1000, 2000, world_size=world, shard=shard) == expected


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([], []),
        ([512 * KiB, 512 * KiB, 10 * MiB, 10 * MiB, 10 * MiB], [1 * MiB, 30 * MiB]),
        ([2 * MiB], [2 * MiB]),
        ([1 * MiB, 40 * MiB, 1 * MiB], [1 * MiB, 40 * MiB, 1 * MiB]),
    ],
)
def test_bucket_sizes(sizes: list[int], expected: list[int]) -> None:
    assert bucket_sizes(sizes) == expected


@pytest.mark.parametrize(
    ("world", "shard", "expected"),
    [(1, "none", False), (2, "none", True), (2, "optimizer", True), (2, "gradients", False), (8, "full", False)],
)
def test_uses_ddp_buckets(world: int, shard: str, expected: bool) -> None:
    assert uses_ddp_buckets(world, shard) is expected


def _peak() -> Peak:
    categories = {
        "parameters": 4 * MiB,
        "gradients": 4 * MiB,
        "optimizer state": 8 * MiB,
        "activations": 2 * MiB,
        "temporaries": 0,
    }
    return Peak(18 * MiB, 20 * MiB, categories, [], gradient_sizes=[2 * MiB, 2 * MiB])


@pytest.mark.parametrize(
    ("shard", "states", "buckets"),
    [("none", 16 * MiB, 4 * MiB), ("optimizer", 10 * MiB, 4 * MiB), ("gradients", 7 * MiB, 0), ("full", 4 * MiB, 0)],
)
def test_apply_sharding(shard: str, states: int, buckets: int) -> None:
    categories, allocated, reserved = apply_sharding(_peak(), 4, shard)
    assert categories["parameters"] + categories["gradients"] + categories["optimizer state"] == states
    assert categories.get("ddp buckets", 0) == buckets
    assert allocated == states + 2 * MiB + buckets
    # the one-GPU overhead (2 MiB) is kept; two 2 MiB buckets need one 20 MiB segment
    assert reserved == allocated + 2 * MiB + (20 * MiB - buckets if buckets else 0)


def test_estimate_with_full_sharding_traces_fsdp2_shards() -> None:
    one = estimate(MLP, 8, search=False)
    four = estimate(MLP, 8, world_size=4, shard="full", search=False)
    # FSDP2 keeps ceil(rows / 4) rows of each of the six parameters, one allocation each
    # (512 B blocks): [64,16], [64], [64,256], [64], [4,256], [4] in fp32
    shards = 4096 + 512 + 65536 + 512 + 4096 + 512
    assert four.method == "traced" and four.breakdown["parameters"] == shards
    # AdamW: two moments each (the step counters stay on the host)
    assert four.breakdown["optimizer state"] == 2 * shards
    assert four.breakdown["unsharded parameters"] == MLP_PARAMS  # the root unit's full parameters
    assert four.peak_allocated < one.peak_allocated


def test_gpu_target_subtracts_fixed_costs_and_counts_them_in_total() -> None:
    # CUDA 12.4, lazy loading: an Ampere context, and two cuBLAS workspaces (forward's
    # thread and autograd's), each :4096:2:16:8 = 8320 KiB.
    target = resolve_target(gpu="RTX 3090", cuda_version="12.4")
    card = lookup("RTX 3090")
    assert target.budget == card.memory - card.context - 2 * card.cublas_workspace
    est = estimate("mlp:layers=1,width=32", 4, gpu="rtx3090", cuda_version="12.4", search=False)
    assert est.total == est.peak_reserved + 400 * MiB + 2 * 8320 * KiB
    assert est.breakdown["cuda context"] == 400 * MiB and est.breakdown["cublas workspace"] == 2 * 8320 * KiB
    assert est.breakdown["cudnn workspace"] == 0 and est.cuda_version == "12.4"
    assert sum(est.fixed_costs.values()) == est.total - est.peak_reserved
    assert est.fits is True and est.memory == card.memory


def test_cuda_version_sets_the_context_by_module_loading() -> None:
    # CUDA 11.2 has no lazy loading: the V100's eager context of the transformers docs.
    old = estimate("mlp:layers=1,width=32", 4, gpu="V100 SXM2 16GB", cuda_version="11.2", search=False)
    new = estimate("mlp:layers=1,width=32", 4, gpu="V100 SXM2 16GB", cuda_version="cu121", search=False)
    assert old.breakdown["cuda context"] == 1341 * MiB and new.breakdown["cuda context"] == 300 * MiB
    assert old.total - new.total == 1041 * MiB


def test_fixed_costs_can_be_overridden() -> None:
    est = estimate("mlp:layers=1,width=32", 4, gpu="RTX 3090", fixed_costs="1GiB", search=False)
    assert est.breakdown["fixed costs"] == 1 * GiB and est.total == est.peak_reserved + GiB


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu": "T4", "settings": memfit.Settings(precision="bf16")}, "T4 does not support bf16"),
        ({"gpu": "RTX 3090", "memory": "8GiB"}, "give one target"),
        ({"world_size": 0}, "invalid world size 0"),
        ({"shard": "zero4"}, "unknown shard mode 'zero4'"),
    ],
)
def test_bad_input_is_one_clear_error(kwargs: dict, message: str) -> None:
    with pytest.raises(MemfitError, match=message):
        estimate("mlp:layers=1,width=32", 2, search=False, **kwargs)


def test_too_small_a_target_does_not_fit_and_still_says_what_it_needs() -> None:
    est = estimate(MLP, 512, device="sim:2MiB", search=True)
    assert est.fits is False and est.max_batch_size is not None and est.max_batch_size < 512
    assert est.total > 2 * MiB


def _workload(forward: Callable[[torch.Tensor], torch.Tensor], module_name: str = "gate") -> memfit.Workload:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            setattr(self, module_name, _Call(forward))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(self, module_name)(self.fc(x))

    return memfit.Workload(
        model=Model,
        make_batch=lambda n: torch.randn(n, 8),
        loss=lambda model, x: model(x).float().pow(2).mean(),
        name="custom",
    )


class _Call(nn.Module):
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


@torch.library.custom_op("memfit_test::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@pytest.mark.parametrize(
    ("forward", "op", "why"),
    [
        (
            lambda x: x[torch.nonzero(x > 0, as_tuple=True)].sum().expand(2),
            "aten.nonzero",
            "output shape depends on the data",
        ),
        (lambda x: x * float(x.sum()), "aten._local_scalar_dense", "reads a tensor's value"),
        (lambda x: _no_fake(x), "memfit_test.no_fake", "no fake/meta implementation"),
    ],
)
def test_unsupported_operation_names_the_operation_and_the_module(forward, op: str, why: str) -> None:
    with pytest.raises(UnsupportedOperation) as info:
        estimate(_workload(forward), 4, search=False)
    message = str(info.value)
    assert op in message and "module 'gate'" in message and why in message
    assert "\n" not in message


def test_other_errors_of_the_workload_propagate_unchanged() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's bug")

    with pytest.raises(ValueError, match="the user's bug"):
        estimate(_workload(broken), 4, search=False)


def test_a_module_instance_is_copied_to_fake_tensors_and_left_alone() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before = [p.detach().clone() for p in model.parameters()]
    wl = memfit.Workload(
        model=model,
        make_batch=lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))),
        loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )
    est = estimate(wl, 4, search=False)
    # weights 16x32 (2048 B) and 32x4 (512 B); biases of 128 B and 16 B take 512 B blocks
    assert est.breakdown["parameters"] == 2048 + 512 + 512 + 512
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None and not isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())


def test_no_predicted_speed_for_several_ranks_says_why() -> None:
    """A card but several ranks: no step time (communication is not modelled), and the reason."""
    one = memfit.estimate(MLP, 4, gpu="A100 80GB SXM")
    four = memfit.estimate(MLP, 4, memfit.Settings(world_size=4, shard="full"), gpu="A100 80GB SXM")
    assert one.predicted_seconds_per_step is not None and one.speed_note == ""
    assert four.predicted_seconds_per_step is None
    assert "communication is not modelled" in four.speed_note
