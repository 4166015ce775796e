"""A monitor's memory does not grow with the run, and it watches the device it is made in (issue 14, item 15).

Before, a Monitor kept every record (about 0.9 GiB per million steps) and refused to start
inside ``with memfit.device("sim:8GiB"):`` without a device of its own.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

import memfit
from memfit.monitor.findings import FindingsStream, analyze_steps
from memfit.monitor.monitor import Monitor
from memfit.monitor.runfile import read_run

KEEP = 50


def leaky_run(steps: int, *, keep: int = KEEP, leak_from: int, path=None) -> Monitor:
    """``steps`` steps on a simulated GPU; from ``leak_from`` on, each step keeps 4 KiB."""
    kept = []
    with memfit.device("sim:1GiB"), Monitor(keep=keep, path=path) as monitor:
        for step in range(steps):
            if step >= leak_from:
                kept.append(torch.ones(1024))
            monitor.step(phase="train")
    return monitor


def test_records_held_stay_at_keep_while_findings_and_summary_cover_the_whole_run(tmp_path):
    monitor = leaky_run(3000, leak_from=2900, path=tmp_path / "run.jsonl")
    assert len(monitor.records) == KEEP  # not 3000
    assert monitor.records[-1]["step"] == 2999
    assert monitor.summary()["steps_recorded"] == 3000
    [leak] = monitor.findings
    assert leak.kind == "leak" and leak.evidence["growth_bytes_per_step"] == 4096
    assert leak.evidence["from_step"] == 2899  # the last boundary before the growth
    # the file has every step, and the findings read back from it are the streamed ones
    run = read_run(tmp_path / "run.jsonl")
    assert len(run.records) == 3000
    assert [f.to_dict() for f in run.findings()] == [f.to_dict() for f in monitor.findings]


def test_a_leak_that_stopped_long_ago_is_still_found_after_its_records_are_dropped():
    kept = []
    with memfit.device("sim:1GiB"), Monitor(keep=KEEP) as monitor:
        for step in range(2000):
            if 100 <= step < 130:
                kept.append(torch.ones(1024))
            monitor.step()
    assert monitor.records[0]["step"] == 2000 - KEEP  # the leak's steps are gone from memory
    [leak] = monitor.findings
    assert (leak.evidence["from_step"], leak.evidence["to_step"]) == (99, 129)


def test_memory_held_does_not_grow_with_the_number_of_steps():
    tracemalloc.start()
    try:
        short = leaky_run(500, leak_from=10**9)
        held_short = tracemalloc.get_traced_memory()[0]
        del short
        long = leaky_run(5000, leak_from=10**9)
        held_long = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(long.records) == KEEP and long.summary()["steps_recorded"] == 5000
    # 4500 more records held would be about 4 MiB of dicts; bounded, the difference is noise
    assert held_long - held_short < 1 * 2**20, (held_short, held_long)


def test_the_stream_holds_a_few_windows_whatever_the_length():
    stream = FindingsStream(window=10)
    for step in range(20_000):
        stream.add({"step": step, "allocated": 1000 + (step % 7), "labels": {"phase": ("train", "eval")[step % 2]}})
    assert stream.held() <= 2 * 3 * 10  # two groups, at most three windows each


def test_the_stream_and_the_list_agree():
    records = [
        {
            "step": i,
            "allocated": 1000 + 512 * i * (i > 20),
            "reserved": 2**30 + 2**26 * i,
            "peak_allocated": 2000,
            "num_alloc_retries": i // 5,
            "num_ooms": 0,
            "labels": {"phase": "train", "seq_len": 128 if i < 40 else 512},
        }
        for i in range(60)
    ]
    stream = FindingsStream(window=10)
    for record in records:
        stream.add(record)
    expected = analyze_steps(records, capacity=2**34, window=10)
    assert [f.kind for f in expected] == ["leak", "fragmentation"]
    assert json.dumps([f.to_dict() for f in stream.findings(2**34)]) == json.dumps([f.to_dict() for f in expected])


def test_a_monitor_made_inside_a_memfit_device_watches_that_device():
    kept = []
    # no device given (made after the device is entered): before, "Monitor needs a device"
    with memfit.device("sim:8GiB") as gpu, Monitor() as monitor:
        for _ in range(12):
            kept.append(torch.ones(1024))
            monitor.step()
    assert monitor.device is gpu
    assert monitor.records[-1]["allocated"] - monitor.records[-2]["allocated"] == 4096
    assert [f.kind for f in monitor.findings] == ["leak"]


def test_keep_must_be_a_positive_integer():
    with pytest.raises(memfit.MemfitError, match="invalid keep 0"):
        Monitor("sim:1GiB", keep=0)
