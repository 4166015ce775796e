"""The allocator model under PYTORCH_CUDA_ALLOC_CONF: parsing, each setting's rules on
hand-computed sequences, and the simulated GPU agreeing with the estimate under each."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import MemfitError
from memfit.estimator.estimate import estimate
from memfit.memory import allocator_conf
from memfit.memory.allocator import AllocationFailed, CachingAllocatorModel, replay_reserved
from memfit.memory.allocator_conf import DEFAULT, EXPANDABLE, divisions_round, from_environment, parse, round_request
from memfit.units import MiB


def _model(text: str, budget: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(budget=budget, config=parse(text) if text else DEFAULT)


# -- parsing, as c10/core/AllocatorConfig.cpp parses ---------------------------------


def test_parse_reads_each_modelled_key() -> None:
    conf = parse(
        "expandable_segments:True, max_split_size_mb:128,max_non_split_rounding_mb:40,"
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9,roundup_power2_divisions:4"
    )
    assert conf.expandable_segments is True
    assert conf.max_split_size == 128 * MiB and conf.max_non_split_rounding == 40 * MiB
    assert conf.garbage_collection_threshold == 0.6 and conf.per_process_memory_fraction == 0.9
    assert conf.roundup_power2_divisions == (4,) * 16


def test_divisions_list_fills_as_torch_does() -> None:
    # PyTorch's own test (c10/test/core/AllocatorConfig_test.cpp): intervals in MB, values
    # before the first entry take its value, unset ones stay 0, ">" fills after the last
    conf = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    assert [conf.divisions(n * MiB) for n in (64, 128, 256, 512, 1024, 2048, 4096)] == [8, 8, 16, 1, 0, 8, 2]


def test_power_of_two_rounding() -> None:
    # roundup_power2_next_division: 1200 with 4 divisions of [1024, 2048) -> 1280
    assert divisions_round(1200, 4) == 1280
    assert divisions_round(2048, 4) == 2048
    assert round_request(5 * MiB + 1, parse("roundup_power2_divisions:4")) == 6 * MiB
    assert round_request(5 * MiB + 1, DEFAULT) == 5 * MiB + 512


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("expandable_segments:yes", "True or False"),
        ("max_split_size_mb:10", "at least 20"),
        ("garbage_collection_threshold:1.5", "between 0 and 1"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("backend:cudaMallocAsync", "not modelled"),
        ("large_segment_size_mb:64", "not modelled"),
        ("expandable_segment:True", "unknown key"),
        ("max_split_size_mb", "expected ':' at the end"),
    ],
)
def test_parse_refuses_in_one_line(text: str, why: str) -> None:
    with pytest.raises(MemfitError, match=why) as error:
        parse(text)
    assert "\n" not in str(error.value)


def test_keys_without_effect_on_device_memory_are_accepted() -> None:
    conf = parse("pinned_use_cuda_host_register:True,release_lock_on_cudamalloc:True,expandable_segments:True")
    assert conf.expandable_segments and conf.max_split_size is None


def test_environment_order_is_torchs() -> None:
    environ = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert from_environment(environ).expandable_segments is True
    assert from_environment({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size == 64 * MiB
    assert from_environment({}) == DEFAULT


def test_a_new_model_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert CachingAllocatorModel().config.expandable_segments is True
    with allocator_conf.use(DEFAULT):
        assert CachingAllocatorModel().config == DEFAULT


# -- each setting's rules, on hand-computed sequences -------------------------------


def test_expandable_segments_grow_one_segment_by_pages() -> None:
    default, expandable = _model(""), _model("expandable_segments:True")
    for allocator in (default, expandable):
        allocator.malloc(3 * MiB)
    # both: one 20 MiB block (a kLargeBuffer segment, or one 20 MiB page)
    assert default.reserved == expandable.reserved == 20 * MiB
    for allocator in (default, expandable):
        allocator.malloc(30 * MiB)
    # default: a segment of its own (30 MiB); expandable: the 17 MiB left plus one more page
    assert default.reserved == 50 * MiB and expandable.reserved == 40 * MiB
    assert expandable.stats()["segment.all.current"] == 0  # PyTorch counts cudaMalloc'ed segments only


def test_expandable_segments_reuse_memory_as_shapes_grow() -> None:
    default, expandable = _model(""), _model("expandable_segments:True")
    for allocator in (default, expandable):
        for size in (11, 13, 15):  # a buffer a little larger each step
            allocator.free(allocator.malloc(size * MiB))
    # default: 12 + 14 + 16 MiB segments (rounded to 2 MiB), none reusable by the next
    assert default.reserved == 42 * MiB
    assert expandable.reserved == 20 * MiB  # one page serves all three


def test_expandable_release_unmaps_free_pages_and_keeps_partial_ones() -> None:
    allocator = _model("expandable_segments:True")
    kept = allocator.malloc(3 * MiB)
    allocator.free(allocator.malloc(50 * MiB))  # maps pages up to 60 MiB
    assert allocator.reserved == 60 * MiB
    allocator.empty_cache()
    # the first page holds the live 3 MiB: it stays; the two after it go back
    assert allocator.reserved == 20 * MiB and allocator.stats()["num_device_free"] == 1
    allocator.free(kept)
    allocator.empty_cache()
    assert allocator.reserved == 0


def test_expandable_segments_fail_on_the_pages_not_the_segment() -> None:
    allocator = _model("expandable_segments:True", budget=64 * MiB)
    allocator.malloc(21 * MiB)  # two pages
    allocator.malloc(19 * MiB)  # the 19 MiB left in them
    with pytest.raises(AllocationFailed):
        allocator.malloc(30 * MiB)  # two more pages: 80 MiB
    allocator.malloc(20 * MiB)  # one more page: 60 MiB


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    default, limited = _model(""), _model("max_split_size_mb:20")
    for allocator in (default, limited):
        allocator.free(allocator.malloc(40 * MiB))
        allocator.malloc(5 * MiB)
    assert default.reserved == 40 * MiB  # the cached 40 MiB block is split
    assert limited.reserved == 60 * MiB  # a 5 MiB request never takes a 40 MiB block


def test_max_split_size_releases_oversize_blocks_before_the_retry() -> None:
    allocator = _model("max_split_size_mb:20", budget=50 * MiB)
    allocator.free(allocator.malloc(40 * MiB))
    allocator.malloc(5 * MiB)
    stats = allocator.stats()
    # release_available_cached_blocks freed the 40 MiB block: no full retry was needed
    assert allocator.reserved == 20 * MiB and stats["num_alloc_retries"] == 0 and stats["num_device_free"] == 1


def test_max_non_split_rounding_bounds_the_block_an_oversize_request_takes() -> None:
    allocator = _model("max_split_size_mb:20,max_non_split_rounding_mb:20")
    allocator.free(allocator.malloc(60 * MiB))
    allocator.malloc(30 * MiB)  # 60 >= 30 + 20: not taken
    assert allocator.reserved == 90 * MiB
    other = _model("max_split_size_mb:20,max_non_split_rounding_mb:40")
    other.free(other.malloc(60 * MiB))
    other.malloc(30 * MiB)  # 60 < 30 + 40: taken whole
    assert other.reserved == 60 * MiB and other.allocated == 60 * MiB


def test_garbage_collection_releases_the_oldest_cached_segments() -> None:
    text = "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0"
    collected, plain = _model(text, budget=100 * MiB), _model("", budget=100 * MiB)
    for allocator in (collected, plain):
        for size in (30, 32):
            allocator.free(allocator.malloc(size * MiB))
        allocator.malloc(34 * MiB)
    # reserved 62 MiB > 50 MiB: the older cached block (30 MiB, age 2 >= the mean 1.5) goes
    assert collected.reserved == (32 + 34) * MiB
    assert plain.reserved == (30 + 32 + 34) * MiB


def test_garbage_collection_needs_a_memory_fraction() -> None:
    allocator = _model("garbage_collection_threshold:0.5", budget=100 * MiB)  # no fraction: as PyTorch, no GC
    for size in (30, 32):
        allocator.free(allocator.malloc(size * MiB))
    allocator.malloc(34 * MiB)
    assert allocator.reserved == 96 * MiB


def test_a_memory_fraction_checks_the_segment_size() -> None:
    allocator = _model("per_process_memory_fraction:0.5", budget=100 * MiB)
    allocator.malloc(30 * MiB)
    with pytest.raises(AllocationFailed):
        allocator.malloc(30 * MiB)  # 60 MiB > 50 MiB allowed
    assert _model("", budget=100 * MiB).malloc(30 * MiB) > 0


def test_replay_gives_each_settings_reserved_memory() -> None:
    events = [("alloc", 1, 11 * MiB), ("free", 1, 0), ("alloc", 2, 13 * MiB), ("free", 2, 0), ("alloc", 3, 15 * MiB)]
    assert replay_reserved(events, None, DEFAULT) == 42 * MiB
    assert replay_reserved(events, None, EXPANDABLE) == 20 * MiB
    assert replay_reserved(events, 30 * MiB, DEFAULT) == 26 * MiB  # the peak: cached segments released before 16 MiB
    assert replay_reserved(events, 10 * MiB, EXPANDABLE) is None  # does not fit


# -- the simulated GPU and the estimate agree under each setting ----------------------


class _Growing(nn.Module):
    """Each forward repeats its input once more: the step's shapes change from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.down(torch.relu(self.up(x.repeat(self.calls, 1))))


GROWING = memfit.Workload(
    model=_Growing, make_batch=lambda n: torch.randn(n, 256), loss=lambda m, b: m(b).square().mean(), name="growing"
)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "expandable_segments:True",
        "max_split_size_mb:20",
        "roundup_power2_divisions:4",
        "expandable_segments:True,roundup_power2_divisions:[1:2,>:8]",
        "garbage_collection_threshold:0.2,per_process_memory_fraction:0.5",
    ],
)
def test_estimate_equals_sim_under_each_setting(text: str) -> None:
    with allocator_conf.use(parse(text) if text else DEFAULT):
        predicted = estimate(GROWING, 700, device="sim:160MiB", search=False)
        measured = memfit.measure(GROWING, 700, "sim:160MiB")
    assert predicted.fits is measured.fits is True
    assert (predicted.peak_allocated, predicted.peak_reserved) == (measured.peak_allocated, measured.peak_reserved)
    assert predicted.allocator == (text or "torch's defaults")


def test_settings_change_the_simulated_figures() -> None:
    reserved = {}
    for text in ("", "max_split_size_mb:20", "roundup_power2_divisions:4"):
        with allocator_conf.use(parse(text) if text else DEFAULT):
            run = memfit.measure(GROWING, 700, "sim:160MiB")
        reserved[text] = (run.peak_allocated, run.peak_reserved)
    assert reserved[""][1] < reserved["max_split_size_mb:20"][1]  # oversize blocks are not split
    assert reserved[""][0] < reserved["roundup_power2_divisions:4"][0]  # rounded-up requests


def test_estimate_shows_reserved_memory_under_each_setting() -> None:
    predicted = estimate(GROWING, 700, device="sim:160MiB", search=False)
    shown = predicted.reserved_by_setting
    assert set(shown) == {"torch's defaults", "expandable_segments:True"}
    assert shown["torch's defaults"] == predicted.peak_reserved
    with allocator_conf.use(EXPANDABLE):
        assert shown["expandable_segments:True"] == memfit.measure(GROWING, 700, "sim:160MiB").peak_reserved


def test_pytorchs_reproducer_of_reserved_growth_under_split_limit_and_expandable() -> None:
    """pytorch/pytorch#193400 (issue #123548): a 64 MiB buffer, then per cycle 91 MiB and
    45.5 MiB allocated, a 2 MiB block kept, the two freed; the published reserved MiB."""
    published = {0: 220, 20: 2980, 40: 5760, 60: 8520, 80: 11300, 100: 14060}

    def cycles(text: str) -> dict[int, int]:
        allocator = _model(text)
        allocator.malloc(64 * MiB)
        seen = {}
        for cycle in range(101):
            a, b = allocator.malloc(91 * MiB), allocator.malloc(int(45.5 * MiB))
            allocator.malloc(2 * MiB)
            allocator.free(a)
            allocator.free(b)
            if cycle in published:
                seen[cycle] = allocator.reserved // MiB
        return seen

    assert cycles("max_split_size_mb:128,expandable_segments:True") == published
    # "either option on its own keeps reserved under 500 MiB"
    assert max(cycles("max_split_size_mb:128").values()) < 500
    assert max(cycles("expandable_segments:True").values()) < 500


def test_allocator_advice_names_the_setting_that_saves_with_its_saving() -> None:
    from memfit.search.offload_plan import allocator_advice

    shown = {"torch's defaults": 42 * MiB, "expandable_segments:True": 20 * MiB}
    (line,) = allocator_advice(shown, "torch's defaults")
    assert "expandable_segments:True would reserve 20.00 MiB" in line and "saves 22.00 MiB" in line
    assert line.endswith("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert allocator_advice(shown, "expandable_segments:True") == []  # already the least
    assert allocator_advice({"torch's defaults": None, "expandable_segments:True": 20 * MiB}, "torch's defaults") == []


def test_doctor_predicts_each_settings_reserved_memory_for_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.cli import main

    main(["doctor", "--workload", "mlp:layers=1,width=8", "--batch-size", "2", "--json"])
    import json

    findings = json.loads(capsys.readouterr().out)["findings"]
    (found,) = [f for f in findings if f["message"].startswith("mlp:layers=1,width=8 at batch 2")]
    assert "torch's defaults: 2.00 MiB" in found["message"] and "expandable_segments:True: 2.00 MiB" in found["message"]
    assert main(["doctor", "--workload", "mlp"]) == 2  # --batch-size missing: one line, exit 2
