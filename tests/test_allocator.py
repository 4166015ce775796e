"""The allocator model against hand-computed segment and reserved counts."""

import pytest

from memfit.memory.allocator import (
    AllocationFailed,
    CachingAllocatorModel,
    is_small,
    round_size,
    segment_size,
    should_split,
)

MiB = 2**20


@pytest.mark.parametrize(("n", "rounded"), [(1, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)])
def test_round_size(n, rounded):
    assert round_size(n) == rounded


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (11 * MiB, 12 * MiB),
        (21 * MiB, 22 * MiB),
    ],
)
def test_segment_size(rounded, segment):
    assert segment_size(rounded) == segment


@pytest.mark.parametrize(
    ("block", "rounded", "small", "split"),
    [
        (2 * MiB, 512, True, True),
        (1024, 512, True, True),
        (1024, 1024, True, False),
        (20 * MiB, 19 * MiB, False, False),
        (20 * MiB, 19 * MiB - 512, False, True),
        (20 * MiB, 3 * MiB, False, True),
    ],
)
def test_should_split(block, rounded, small, split):
    assert should_split(block, rounded, small) is split


def test_is_small():
    assert is_small(MiB) and not is_small(MiB + 512)


def reserved(a: CachingAllocatorModel) -> int:
    return a.stats()["reserved_bytes.all.current"]


def allocated(a: CachingAllocatorModel) -> int:
    return a.stats()["allocated_bytes.all.current"]


def test_small_pool_shares_one_segment():
    a = CachingAllocatorModel()
    a.malloc(100)
    a.malloc(1000)
    a.malloc(MiB)
    assert (allocated(a), reserved(a)) == (512 + 1024 + MiB, 2 * MiB)
    assert a.stats()["segment.all.current"] == 1
    a.malloc(MiB)  # does not fit the 2 MiB segment's rest: a second segment
    assert reserved(a) == 4 * MiB and a.stats()["segment.all.current"] == 2


def test_large_pool_splits_a_20_mib_segment():
    a = CachingAllocatorModel()
    a.malloc(3 * MiB)
    a.malloc(5 * MiB)
    assert (allocated(a), reserved(a)) == (8 * MiB, 20 * MiB)
    a.malloc(12 * MiB)  # exactly the cached rest: best fit, no new segment
    assert (allocated(a), reserved(a)) == (20 * MiB, 20 * MiB)
    a.malloc(11 * MiB)  # >= 10 MiB: its own 12 MiB segment; the 1 MiB rest is not split off
    assert (allocated(a), reserved(a)) == (32 * MiB, 32 * MiB)


def test_a_rest_of_one_mib_or_less_is_not_split_off():
    a = CachingAllocatorModel()
    a.malloc(19 * MiB + MiB // 2)  # own 20 MiB segment; the 0.5 MiB rest stays in the block
    assert (allocated(a), reserved(a)) == (20 * MiB, 20 * MiB)


def test_freed_blocks_are_cached_and_reused():
    a = CachingAllocatorModel()
    h = a.malloc(4 * MiB)
    a.free(h)
    assert (allocated(a), reserved(a)) == (0, 20 * MiB)
    a.malloc(4 * MiB)
    assert reserved(a) == 20 * MiB and a.stats()["num_device_alloc"] == 1


def test_best_fit_picks_the_smallest_block_that_is_large_enough():
    a = CachingAllocatorModel()
    first = a.malloc(8 * MiB)  # one 20 MiB segment: [8][2][6][2][rest 2]
    a.malloc(2 * MiB)
    second = a.malloc(6 * MiB)
    a.malloc(2 * MiB)
    a.free(first)
    a.free(second)  # free: 8 MiB at the lowest address, then 6 MiB, then the 2 MiB rest
    a.malloc(5 * MiB)  # the 6 MiB block, not the first large enough; its 1 MiB rest is not split off
    assert allocated(a) == (2 + 2 + 6) * MiB
    a.malloc(8 * MiB)  # so the 8 MiB block is still whole: no new segment
    assert (allocated(a), reserved(a)) == (18 * MiB, 20 * MiB)
    assert a.stats()["num_device_alloc"] == 1


def test_free_neighbours_merge_back_into_one_block():
    a = CachingAllocatorModel()
    x = a.malloc(4 * MiB)
    y = a.malloc(4 * MiB)
    a.free(x)
    a.free(y)
    a.malloc(18 * MiB)  # only fits if the three free pieces merged back into 20 MiB
    assert (allocated(a), reserved(a)) == (18 * MiB, 20 * MiB)


def test_release_cached_segments_and_retry_once():
    a = CachingAllocatorModel(budget=40 * MiB)
    a.malloc(12 * MiB)  # its own 12 MiB segment, used whole
    x = a.malloc(3 * MiB)  # a 20 MiB segment: reserved 32 MiB
    a.free(x)  # the 20 MiB segment is now entirely free, but cached
    a.malloc(22 * MiB)  # 32 + 22 > 40: release the free 20 MiB segment, then 12 + 22 fits
    s = a.stats()
    assert (s["reserved_bytes.all.current"], s["num_alloc_retries"], s["num_ooms"]) == (34 * MiB, 1, 0)
    assert s["reserved_bytes.all.peak"] == 34 * MiB


@pytest.mark.parametrize(
    ("budget", "sizes"),
    [
        (2 * MiB, [MiB, MiB]),
        (20 * MiB, [20 * MiB]),
        (20 * MiB, [2 * MiB, 2 * MiB, 16 * MiB]),
        (22 * MiB, [20 * MiB, MiB, MiB]),
    ],
)
def test_oom_point_is_exact(budget, sizes):
    a = CachingAllocatorModel(budget=budget)
    for size in sizes:
        a.malloc(size)
    assert reserved(a) == budget  # fits exactly
    with pytest.raises(AllocationFailed):
        a.malloc(512)  # 512 B more does not
    s = a.stats()
    assert (s["num_alloc_retries"], s["num_ooms"]) == (1, 1)
    assert reserved(a) == budget  # a failed request changes nothing


def test_empty_cache_and_peaks():
    a = CachingAllocatorModel()
    h = a.malloc(30 * MiB)
    a.free(h)
    a.malloc(MiB // 2)
    assert a.stats()["allocated_bytes.all.peak"] == 30 * MiB
    a.empty_cache()
    assert reserved(a) == 2 * MiB  # the free 30 MiB segment went back
    a.reset_peak()
    s = a.stats()
    assert s["allocated_bytes.all.peak"] == MiB // 2 and s["reserved_bytes.all.peak"] == 2 * MiB
