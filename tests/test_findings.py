"""Findings over synthetic step records: each rule, its thresholds, and what it must not report."""

from __future__ import annotations

import json

import pytest

from memfit.monitor.findings import (
    EXPANDABLE_SEGMENTS,
    analyze_steps,
    find_fragmentation,
    find_leak,
    find_shape_peak,
    fragmentation_floor,
    growth_by_phase,
    keeps_growing,
    rising_fraction,
    shape_key,
    shape_size,
    steps_per_record,
    successful_retries,
    unused_reserve,
)

MiB = 2**20
GiB = 2**30
BASE = 50 * MiB


def records(allocated, *, labels=None, step_every=1, peak=None, reserved=None, retries=None, ooms=None):
    """Step records as a Monitor writes them, from per-step series."""
    out = []
    for i, value in enumerate(allocated):
        out.append(
            {
                "kind": "step",
                "step": i * step_every + step_every - 1,
                "allocated": value,
                "reserved": reserved[i] if reserved else max(value, 200 * MiB),
                "peak_allocated": peak[i] if peak else value + 10 * MiB,
                "num_alloc_retries": retries[i] if retries else 0,
                "num_ooms": ooms[i] if ooms else 0,
                "labels": labels[i] if labels else {},
            }
        )
    return out


# -- small helpers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, expected",
    [([], 0.0), ([5], 0.0), ([1, 2, 3], 1.0), ([3, 2, 1], 0.0), ([1, 2, 2, 3, 3], 0.5)],
)
def test_rising_fraction(values, expected):
    assert rising_fraction(values) == expected


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1, 2, 3, 4], True),
        ([1, 1, 1, 1], False),
        ([4, 3, 2, 1], False),
        ([0, 1, 2, 3, 4, 0, 1, 2, 3, 4], False),  # a sawtooth gives back what it gained
        ([0, 4, 8, 12, 11, 16], True),  # 4 of 5 up, gives back 1 of 17
        ([0, 2, 4, 6, 3, 8], False),  # 4 of 5 up, but gives back 3 of 11
        ([0, 1, 1, 1, 2], False),  # up in only half the steps
        ([5], False),
    ],
)
def test_keeps_growing(values, expected):
    assert keeps_growing(values) is expected


@pytest.mark.parametrize(
    "labels, expected",
    [
        ({}, ()),
        ({"phase": "train", "lr": 0.1, "epoch": 3}, ()),
        ({"shape": [8, 128]}, (("shape", (8, 128)),)),
        ({"seq_len": 256, "phase": "eval"}, (("seq_len", (256,)),)),
        ({"input_shape": 4}, (("input_shape", (4,)),)),
        ({"tokens": [8, 64], "images": [8, 3, 32, 32]}, (("images", (8, 3, 32, 32)), ("tokens", (8, 64)))),
        ({"flag": True, "names": ["a", "b"], "batch_size": True}, ()),
    ],
)
def test_shape_key_keeps_only_shapes(labels, expected):
    assert shape_key(labels) == expected


@pytest.mark.parametrize(
    "key, size",
    [((), 0), ((("shape", (8, 128)),), 1024), ((("a", (2, 3)), ("seq_len", (10,))), 16)],
)
def test_shape_size(key, size):
    assert shape_size(key) == size


@pytest.mark.parametrize(
    "capacity, floor",
    [(None, 64 * MiB), (1 * GiB, 64 * MiB), (80 * GiB, int(80 * GiB * 0.02))],
)
def test_fragmentation_floor(capacity, floor):
    assert fragmentation_floor(capacity) == floor


def test_unused_reserve_is_reserved_beyond_the_highest_peak_so_far():
    recs = records([10, 10, 10], peak=[100, 60, 80], reserved=[120, 150, 90])
    assert unused_reserve(recs) == [20, 50, 0]


def test_successful_retries_leave_out_the_retries_of_ooms():
    recs = records([1, 1, 1, 1], retries=[0, 1, 3, 4], ooms=[0, 0, 1, 2])
    assert successful_retries(recs) == [0, 1, 1, 0]


# -- leak ------------------------------------------------------------------------------

SAME = {"phase": "train", "shape": [32, 16]}


@pytest.mark.parametrize(
    "series, every, growth",
    [
        ([BASE + 512 * i for i in range(20)], 1, 512),  # the smallest block, every step
        ([BASE + 11776 * i for i in range(12)], 1, 11776),
        ([BASE + 5 * 4096 * i for i in range(15)], 5, 4096),  # one step in five recorded
        ([BASE] * 5 + [BASE + MiB * i for i in range(15)], 1, MiB),  # starts late
        # grows in 9 of 10 changes: a step that frees a little does not hide it (9 MiB in 10 steps)
        ([BASE + MiB * i for i in range(6)] + [BASE + 5 * MiB - 1] + [BASE + MiB * i for i in range(6, 10)], 1, 943718),
    ],
)
def test_growing_boundary_memory_is_a_leak_naming_the_growth_per_step(series, every, growth):
    finding = find_leak(records(series, labels=[SAME] * len(series), step_every=every))
    assert finding is not None
    assert finding.evidence["growth_bytes_per_step"] == growth
    from memfit.units import format_size

    assert f"+{format_size(growth)} per step" in finding.title
    assert format_size(growth) in finding.summary
    assert any("total = total + loss" in cause for cause in finding.causes)
    assert any("no_grad" in cause for cause in finding.causes)


@pytest.mark.parametrize(
    "series",
    [
        [BASE] * 200,  # flat: loss.item()
        [BASE + MiB, BASE + 2 * MiB] + [BASE + 3 * MiB] * 30,  # warm-up, then flat
        [BASE + (MiB if i % 2 else 0) for i in range(40)],  # sawtooth (gradient accumulation)
        [BASE + MiB * i for i in range(9)],  # growing, but fewer steps than the window
        [BASE + MiB * (i % 5) for i in range(40)],  # grows then drops back, over and over
    ],
)
def test_no_leak_without_sustained_growth(series):
    assert find_leak(records(series, labels=[SAME] * len(series))) is None


def test_growth_across_different_shapes_is_not_a_leak():
    series = [BASE + MiB * i for i in range(30)]
    labels = [{"shape": [8, 16 * (i + 1)]} for i in range(30)]
    assert find_leak(records(series, labels=labels)) is None


def test_a_leak_is_charged_to_the_phase_whose_steps_add_the_memory():
    series, labels, leaked = [], [], 0
    for i in range(40):
        phase = "eval" if i % 2 else "train"
        leaked += MiB if phase == "eval" else 0  # each eval step keeps 1 MiB; the memory stays
        series.append(BASE + leaked)
        labels.append({"phase": phase, "shape": [8, 32]})
    finding = find_leak(records(series, labels=labels))
    assert finding is not None
    assert finding.evidence["phase"] == "eval"
    assert finding.evidence["growth_bytes_per_step"] == MiB
    assert finding.evidence["groups_growing"] == 2  # the train boundaries show it too
    assert finding.title == "Memory leak: +1.00 MiB per 'eval' step"
    assert "0 B ('train')" in finding.summary


@pytest.mark.parametrize(
    "steps, expected", [([], 1), ([0], 1), ([0, 1, 2, 3], 1), ([4, 9, 14, 19], 5), ([0, 1, 2, 5, 6], 1)]
)
def test_steps_per_record(steps, expected):
    assert steps_per_record([{"step": s} for s in steps]) == expected


def test_growth_by_phase_skips_changes_across_shapes():
    recs = records(
        [100, 150, 400, 450],
        labels=[
            {"phase": "a", "seq_len": 8},
            {"phase": "b", "seq_len": 8},
            {"phase": "a", "seq_len": 64},
            {"phase": "b", "seq_len": 64},
        ],
    )
    assert growth_by_phase(recs, 0, 3) == {"b": 50.0}


def test_window_sets_how_long_growth_must_last():
    recs = records([BASE + MiB * i for i in range(6)])
    assert find_leak(recs) is None
    assert find_leak(recs, window=5) is not None


def test_a_leak_is_reported_once_even_in_several_groups():
    series, labels, leaked = [], [], 0
    for i in range(30):  # train steps keep 1 MiB each, eval steps 2 MiB each
        phase = "eval" if i % 2 else "train"
        leaked += 2 * MiB if phase == "eval" else MiB
        series.append(BASE + leaked)
        labels.append({"phase": phase})
    found = analyze_steps(records(series, labels=labels))
    assert [f.kind for f in found] == ["leak"]
    assert found[0].evidence["groups_growing"] == 2
    assert found[0].evidence["phase"] == "eval"
    assert found[0].evidence["growth_bytes_per_step"] == 2 * MiB  # the worst group


# -- fragmentation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "peak, reserved, retries, expected",
    [
        # reserve beyond the highest peak grows to 150 MiB (60 % of reserved)
        ([100 * MiB] * 6, [110 * MiB, 130 * MiB, 180 * MiB, 250 * MiB, 250 * MiB, 250 * MiB], None, 150 * MiB),
        # retries that succeed, in several steps
        ([100 * MiB] * 6, [110 * MiB] * 6, [0, 1, 1, 2, 3, 3], 10 * MiB),
    ],
)
def test_fragmentation_is_found(peak, reserved, retries, expected):
    finding = find_fragmentation(records([10 * MiB] * 6, peak=peak, reserved=reserved, retries=retries))
    assert finding is not None
    assert finding.evidence["unused_reserve_bytes"] == expected
    assert any(EXPANDABLE_SEGMENTS in advice for advice in finding.advice)
    assert any("before `import torch`" in advice for advice in finding.advice)


@pytest.mark.parametrize(
    "peak, reserved, retries, ooms, capacity",
    [
        # the normal cache: a large reserve between steps, but no more than the peak needs
        ([100 * MiB] * 6, [105 * MiB] * 6, None, None, None),
        # large but not growing (the first step already had it)
        ([100 * MiB] * 6, [250 * MiB] * 6, None, None, None),
        # growing but small (under the 64 MiB floor)
        ([10 * MiB] * 6, [12 * MiB, 20 * MiB, 30 * MiB, 40 * MiB, 40 * MiB, 40 * MiB], None, None, None),
        # growing, but small next to a big card's floor (2 % of 80 GiB)
        ([GiB] * 6, [GiB, GiB, 2 * GiB, 2 * GiB, 2 * GiB, 2 * GiB], None, None, 80 * GiB),
        # one retry only
        ([100 * MiB] * 6, [110 * MiB] * 6, [0, 0, 1, 1, 1, 1], None, None),
        # retries that failed: they belong to OOMs
        ([100 * MiB] * 6, [110 * MiB] * 6, [0, 1, 2, 3, 3, 3], [0, 1, 2, 3, 3, 3], None),
    ],
)
def test_no_fragmentation(peak, reserved, retries, ooms, capacity):
    recs = records([10 * MiB] * 6, peak=peak, reserved=reserved, retries=retries, ooms=ooms)
    assert find_fragmentation(recs, capacity=capacity) is None


# -- new-shape peak --------------------------------------------------------------------


def test_a_new_peak_with_a_new_largest_shape_is_reported_with_its_steps():
    peaks = [100 * MiB, 100 * MiB, 150 * MiB, 150 * MiB, 120 * MiB, 300 * MiB]
    lengths = [128, 128, 256, 256, 192, 512]
    recs = records([50 * MiB] * 6, peak=peaks, labels=[{"seq_len": n} for n in lengths])
    finding = find_shape_peak(recs)
    assert finding is not None
    assert [e["step"] for e in finding.evidence["events"]] == [2, 5]
    assert finding.evidence["peak_bytes"] == 300 * MiB
    assert finding.evidence["shape"] == "seq_len=[512]"
    assert "not a leak" in finding.summary
    assert any("worst-case" in advice for advice in finding.advice)
    assert find_leak(recs) is None


@pytest.mark.parametrize(
    "peaks, labels",
    [
        ([100 * MiB, 200 * MiB, 300 * MiB], [{}, {}, {}]),  # no shape labels: cannot say why
        ([100 * MiB, 200 * MiB, 300 * MiB], [{"shape": [8, 64]}] * 3),  # same shape: not a new shape
        ([100 * MiB, 102 * MiB, 104 * MiB], [{"seq_len": n} for n in (8, 16, 32)]),  # within 5 %
        ([100 * MiB, 200 * MiB, 300 * MiB], [{"seq_len": n} for n in (64, 32, 16)]),  # shapes shrink
    ],
)
def test_no_shape_peak(peaks, labels):
    assert find_shape_peak(records([10 * MiB] * 3, peak=peaks, labels=labels)) is None


# -- all together ----------------------------------------------------------------------


def test_a_healthy_run_has_no_findings():
    assert analyze_steps(records([BASE] * 200, labels=[SAME] * 200)) == []


def test_empty_input_has_no_findings():
    assert analyze_steps([]) == []


def test_findings_are_json():
    recs = records([BASE + MiB * i for i in range(12)], labels=[SAME] * 12)
    (finding,) = analyze_steps(recs)
    data = json.loads(json.dumps(finding.to_dict()))
    assert data["kind"] == "leak"
    assert data["evidence"]["growth_bytes_per_step"] == MiB
    assert str(finding).startswith("Memory leak: +1.00 MiB per step: ")
