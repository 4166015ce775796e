"""Allocator snapshots in PyTorch's memory viewer format: recorded, written, read by torch's tools, reported."""

from __future__ import annotations

import pickle
import pickletools

import pytest
import torch
from torch.cuda import _memory_viz

import memfit
from memfit.errors import MemfitError
from memfit.estimator.snapshot import step_snapshot
from memfit.memory.allocator import SNAPSHOT_BASE_ADDRESS, CachingAllocatorModel, snapshot_bytes
from memfit.monitor.monitor import Monitor
from memfit.reporting.memory_viz import memory_figure, timeline
from memfit.reporting.pages import load_snapshot, write_report
from memfit.units import MiB
from memfit.workload.zoo import TINY

#: the pickle opcodes the memory viewer's own unpickler (torch/utils/viz/MemoryViz.js) reads
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "SETITEM", "SETITEMS", "APPEND", "APPENDS", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}  # fmt: skip


def replay(snapshot: dict) -> tuple[dict[int, int], dict[int, int]]:
    """Apply the trace from nothing: (segments address -> size, live blocks address -> requested
    size) at its end, checking every allocation lies in a segment and every free matches."""
    segments: dict[int, int] = {}
    live: dict[int, int] = {}
    requested: set[int] = set()
    for entry in snapshot["device_traces"][0]:
        action, size = entry["action"], entry["size"]
        if action == "segment_alloc":
            segments[entry["addr"]] = size
        elif action == "segment_free":
            assert segments.pop(entry["addr"]) == size
            assert not any(entry["addr"] <= a < entry["addr"] + size for a in live)
        elif action == "alloc":
            assert any(s <= entry["addr"] < s + n for s, n in segments.items())
            live[entry["addr"]] = size
        elif action == "free_requested":
            assert live[entry["addr"]] == size
            requested.add(entry["addr"])
        elif action == "free_completed":
            requested.remove(entry["addr"])
            del live[entry["addr"]]
        else:
            assert action == "oom" and entry["device_free"] >= 0
    return segments, live


def end_state(snapshot: dict) -> tuple[dict[int, int], dict[int, int]]:
    segments = {s["address"]: s["total_size"] for s in snapshot["segments"]}
    live = {
        b["address"]: b["requested_size"]
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    for segment in snapshot["segments"]:  # blocks tile their segment, in address order
        addresses = [segment["address"]]
        for block in segment["blocks"]:
            assert block["address"] == addresses[-1]
            addresses.append(block["address"] + block["size"])
        assert addresses[-1] == segment["address"] + segment["total_size"]
    return segments, live


def test_the_allocator_records_what_cuda_records_only_when_asked() -> None:
    allocator = CachingAllocatorModel(budget=64 * MiB)
    allocator.free(allocator.malloc(1024))
    assert allocator.snapshot()["device_traces"] == [[]] and not allocator.recording
    allocator.record_history()
    frames = [{"filename": "blocks.0", "line": 0, "name": "forward"}]
    kept = allocator.malloc(3 * MiB, frames)
    allocator.free(allocator.malloc(100, frames))
    with pytest.raises(Exception, match="cannot allocate"):
        allocator.malloc(60 * MiB)
    snapshot = allocator.snapshot()
    actions = [(e["action"], e["size"]) for e in snapshot["device_traces"][0]]
    assert actions == [
        ("segment_alloc", 20 * MiB),
        ("alloc", 3 * MiB),
        ("alloc", 100),
        ("free_requested", 100),
        ("free_completed", 100),
        ("segment_free", 2 * MiB),  # the retry releases the cached small segment first
        ("oom", 60 * MiB),
    ]
    assert snapshot["device_traces"][0][-1]["device_free"] == 64 * MiB - 20 * MiB
    assert snapshot["device_traces"][0][1]["frames"] == frames
    (segment,) = snapshot["segments"]
    # the small segment of the first (unrecorded) allocation came first, at the base address
    assert segment["address"] == SNAPSHOT_BASE_ADDRESS + 2 * MiB and segment["segment_type"] == "large"
    assert [(b["state"], b["size"], b["requested_size"]) for b in segment["blocks"]] == [
        ("active_allocated", 3 * MiB, 3 * MiB),
        ("inactive", 17 * MiB, 0),
    ]
    assert segment["blocks"][0]["frames"] == frames
    allocator.free(kept)


@pytest.mark.parametrize(("ref", "batch", "spec"), [(TINY["gpt2"], 8, "sim:64MiB"), (TINY["convnet"], 64, "sim:64MiB")])
def test_a_step_snapshot_is_consistent_and_matches_the_measured_peaks(ref: str, batch: int, spec: str) -> None:
    snapshot = step_snapshot(ref, batch, device=spec)
    assert replay(snapshot) == end_state(snapshot)
    moments = timeline(snapshot)
    measured = memfit.measure(ref, batch, spec)
    assert max(m.reserved for m in moments) == measured.peak_reserved
    # the trace's requested bytes peak at or below the allocator's (rounded) peak
    assert 0.9 * measured.peak_allocated <= max(m.allocated for m in moments) <= measured.peak_allocated
    phases = {m.phase for m in moments}
    assert {"forward", "backward", "optimizer"} <= phases


def test_a_snapshot_opens_in_torchs_memory_viewer_tools() -> None:
    snapshot = step_snapshot(TINY["mlp"], 32, device="sim:64MiB")
    data = snapshot_bytes(snapshot)
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES
    loaded = pickle.loads(data)
    for render in (_memory_viz.trace_plot, _memory_viz.segment_plot):
        page = render(loaded)
        assert "add_local_files" in page and "snapshot.pickle" in page
    assert f"segments: {len(loaded['segments'])}" in _memory_viz.segsum(loaded)
    text = _memory_viz.trace(loaded)
    assert "cudaMalloc" in text and f"{len(loaded['device_traces'][0])} entries" in text
    flame = _memory_viz.memory(loaded, format_flamegraph=lambda lines: lines)
    assert isinstance(flame, str)


def test_a_step_that_does_not_fit_ends_at_its_oom(tmp_path, run_cli) -> None:
    path = tmp_path / "step.pickle"
    status, out, _ = run_cli(
        "estimate", TINY["mlp"], "--device", "sim:2MiB", "--batch-size", "100000", "--snapshot", str(path)
    )
    assert status == 0 and str(path) in out
    snapshot = load_snapshot(path)
    trace = snapshot["device_traces"][0]
    assert [e["action"] for e in trace].count("oom") == 1
    assert replay(snapshot) == end_state(snapshot)


def test_estimate_snapshot_with_several_ranks_is_refused_before_any_work(tmp_path, run_cli) -> None:
    status, _, err = run_cli("estimate", TINY["mlp"], "--world-size", "2", "--snapshot", str(tmp_path / "s.pickle"))
    assert status == 2 and "--snapshot records one GPU's unsharded step" in err
    assert not (tmp_path / "s.pickle").exists()


def test_monitor_on_sim_writes_a_snapshot_and_the_report_embeds_it(tmp_path) -> None:
    snapshot_path, run_path = tmp_path / "run.pickle", tmp_path / "run.jsonl"
    with Monitor("sim:64MiB", path=run_path, snapshot=snapshot_path) as monitor:
        kept = []
        for _ in range(4):
            kept.append(torch.ones(256, 256))
            monitor.step()
    snapshot = load_snapshot(snapshot_path)
    assert [e["action"] for e in snapshot["device_traces"][0]].count("alloc") == 4
    assert replay(snapshot) == end_state(snapshot)
    assert sorted(end_state(snapshot)[1].values()) == [256 * 256 * 4] * 4  # the kept tensors, still alive
    files = write_report(run_path, tmp_path / "report.html")  # finds the snapshot the monitor wrote
    page = files.html.read_text()
    assert "<h2>Memory viewer</h2>" in page and 'download="memfit-snapshot.pickle"' in page
    assert "add_local_files(local_files" in (tmp_path / "report-memory-viz.html").read_text()
    assert load_snapshot(tmp_path / "report-snapshot.pickle") == snapshot
    del kept


def test_a_pickle_that_names_a_class_is_not_a_snapshot(tmp_path) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": MemfitError("boom")}))
    with pytest.raises(MemfitError, match=r"not a memory snapshot .*names memfit\.errors\.MemfitError"):
        load_snapshot(path)


def test_the_figure_plots_allocated_and_reserved_with_the_peak() -> None:
    snapshot = step_snapshot(TINY["mlp"], 32, device="sim:64MiB")
    figure = memory_figure(snapshot)
    assert figure is not None
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    moments = timeline(snapshot)
    reserved = lines["reserved"].get_ydata()
    assert len(reserved) == len(moments) and max(reserved) * 2**20 == max(m.reserved for m in moments)
    peak = next(label for label in lines if label.startswith("peak"))
    assert lines[peak].get_ydata()[0] * 2**20 == max(m.allocated for m in moments)
