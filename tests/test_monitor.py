"""The monitor on the simulated GPU: real training loops, real tensors, the CUDA allocator model."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit._plot import png_data_uri
from memfit.errors import MemfitError
from memfit.monitor.monitor import Monitor, jsonable_label
from memfit.monitor.runfile import RecordedRun, read_run
from memfit.monitor.timeline import timeline_png
from memfit.units import format_size

MiB = 2**20


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small steps on 2 shared cores


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out, loss


# -- leaks -----------------------------------------------------------------------------


def eval_keeping_the_graph(model, optimizer, state):
    """Evaluation without no_grad, the loss summed as a tensor: each step's graph is kept."""
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    state["total"] = state.get("total", 0) + loss


def train_appending_outputs(model, optimizer, state):
    """Training that keeps every step's output (and its graph) in a list."""
    out, _ = train_step(model, optimizer, *batch())
    state.setdefault("outputs", []).append(out)


LEAKS = {
    # kept per step by the graph of `total`: x (32x16 fp32, 2 KiB), the ReLU output
    # (32x64, 8 KiB), log_softmax's output (32x4, 512 B), the targets and nll_loss's
    # total weight (512 B blocks each): 11776 bytes
    "loss kept with its graph": (eval_keeping_the_graph, 11776),
    # the output, 32x4 fp32 = 512 bytes (one 512 B block)
    "outputs appended": (train_appending_outputs, 512),
}


@pytest.mark.parametrize("name", sorted(LEAKS))
def test_a_leak_is_reported_within_20_steps_naming_the_growth_per_step(name):
    loop, growth = LEAKS[name]
    model, optimizer = tiny_model()
    state: dict = {}
    found_at = None
    with Monitor("sim:64MiB") as monitor:
        for step in range(20):
            loop(model, optimizer, state)
            monitor.step(phase="train", shape=[32, 16])
            if found_at is None and any(f.kind == "leak" for f in monitor.findings):
                found_at = step
    assert found_at is not None and found_at < 20
    diffs = {b["allocated"] - a["allocated"] for a, b in zip(monitor.records[1:], monitor.records[2:])}
    assert diffs == {growth}
    (leak,) = [f for f in monitor.findings if f.kind == "leak"]
    assert leak.evidence["growth_bytes_per_step"] == growth
    assert f"+{format_size(growth)} per step" in leak.title
    assert [f.kind for f in monitor.findings] == ["leak"]


def train_with_item(model, optimizer, state):
    _, loss = train_step(model, optimizer, *batch())
    state["total"] = state.get("total", 0.0) + loss.item()


def eval_with_no_grad(model, optimizer, state):
    x, y = batch()
    with torch.no_grad():
        state["total"] = state.get("total", 0.0) + F.cross_entropy(model(x), y).item()


def train_summing_the_loss_after_backward(model, optimizer, state):
    """`total = total + loss` after backward: backward already freed the graph's saved
    tensors, so only host-side autograd nodes pile up, not device memory."""
    _, loss = train_step(model, optimizer, *batch())
    state["total"] = state.get("total", 0) + loss


@pytest.mark.parametrize(
    "loop, steps", [(train_with_item, 200), (eval_with_no_grad, 60), (train_summing_the_loss_after_backward, 60)]
)
def test_a_healthy_loop_gives_no_finding(loop, steps):
    model, optimizer = tiny_model()
    state: dict = {}
    with Monitor("sim:64MiB", window=10) as monitor:
        for _ in range(steps):
            loop(model, optimizer, state)
            monitor.step(phase="train", shape=[32, 16])
    assert len(monitor.records) == steps
    assert len({r["allocated"] for r in monitor.records[1:]}) == 1  # flat after the first step
    assert monitor.findings == []


def test_growing_inputs_report_the_new_shape_peak_not_a_leak():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lengths = [16 * 2 ** (step // 3) for step in range(18)]  # 16, 16, 16, 32, ... 512
    with Monitor("sim:256MiB") as monitor:
        for length in lengths:
            x = torch.randn(8, length, 16)
            out = model(x)  # still referenced at the boundary: memory there grows with the length
            F.cross_entropy(out.reshape(-1, 4), torch.randint(0, 4, (8 * length,))).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            monitor.step(phase="train", shape=x.shape)
    boundary = [r["allocated"] for r in monitor.records]
    assert boundary[-1] > boundary[0]  # it grew, yet it is not a leak: the shapes did
    assert [f.kind for f in monitor.findings] == ["shape_peak"]
    (finding,) = monitor.findings
    assert [e["step"] for e in finding.evidence["events"]] == [3, 6, 9, 12, 15]
    assert finding.evidence["shape"] == "shape=[8, 512, 16]"
    assert finding.evidence["peak_bytes"] == max(r["peak_allocated"] for r in monitor.records)


# -- fragmentation ---------------------------------------------------------------------


def fragmenting_steps(monitor: Monitor, steps: int, keep: int = 8, seed: int = 0) -> None:
    """Interleave short-lived tensors of random sizes (10-60 MiB) with long-lived ones
    (1.5-3 MiB, the last ``keep`` kept): each long-lived tensor is carved out of a freed
    large block, pinning its segment, so the next large request needs a new one."""
    rng = random.Random(seed)
    kept = [torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(keep)]
    for _ in range(steps):
        big = torch.empty(rng.randint(10, 60) * MiB, dtype=torch.uint8)
        kept.append(torch.empty(rng.randint(3, 6) * MiB // 2, dtype=torch.uint8))
        kept.pop(0)
        del big
        monitor.step(phase="train")


@pytest.mark.parametrize("capacity, retry_steps", [("512MiB", []), ("224MiB", [8, 24])])
def test_fragmentation_on_the_simulated_allocator_is_reported(capacity, retry_steps):
    with Monitor(f"sim:{capacity}") as monitor:
        fragmenting_steps(monitor, 40)
    assert [f.kind for f in monitor.findings] == ["fragmentation"]
    (finding,) = monitor.findings
    records = monitor.records
    worst = next(r for r in records if r["step"] == finding.evidence["at_step"])
    highest_peak = max(r["peak_allocated"] for r in records if r["step"] <= worst["step"])
    assert finding.evidence["unused_reserve_bytes"] == worst["reserved"] - highest_peak
    assert finding.evidence["unused_reserve_bytes"] >= worst["reserved"] // 2
    assert finding.evidence["retry_steps"] == retry_steps
    assert finding.evidence["successful_retries"] == len(retry_steps) == records[-1]["num_alloc_retries"]
    assert "expandable_segments:True" in " ".join(finding.advice)


def test_fragmentation_runs_out_of_memory_at_half_the_capacity():
    with (
        pytest.raises(torch.OutOfMemoryError, match="reserved by PyTorch but unallocated"),
        Monitor("sim:192MiB") as monitor,
    ):
        fragmenting_steps(monitor, 40)
    records = monitor.records
    assert records[-1]["event"] == "oom"
    assert max(r["peak_allocated"] for r in records) < 192 * MiB // 2
    assert [f.kind for f in monitor.findings] == ["fragmentation"]


# -- the records and the file ----------------------------------------------------------


def test_records_hold_the_allocator_counters_at_each_boundary(tmp_path):
    path = tmp_path / "run.jsonl"
    with Monitor("sim:64MiB", path=path) as monitor:
        a = torch.empty(MiB // 4)  # 1 MiB
        monitor.step(phase="warm")
        temp = torch.empty(3 * MiB // 4)  # 3 MiB, freed before the next boundary
        del temp
        monitor.step()
        lines = path.read_text().splitlines()  # written and flushed while the run goes on
        assert len(lines) == 3
    del a
    first, second = monitor.records
    assert (first["allocated"], first["reserved"], first["peak_allocated"]) == (MiB, 2 * MiB, MiB)
    assert first["unallocated"] == MiB
    assert (second["allocated"], second["peak_allocated"]) == (MiB, 4 * MiB)
    assert second["reserved"] == second["peak_reserved"] == 2 * MiB + 20 * MiB
    assert first["labels"] == {"phase": "warm"} and second["labels"] == {}
    assert (first["step"], second["step"]) == (0, 1)
    header = json.loads(lines[0])
    assert header["kind"] == "header"
    assert header["device"] == "sim:64MiB" and header["capacity"] == 64 * MiB
    assert [json.loads(line) for line in lines[1:]] == monitor.records
    run = read_run(path)
    assert run.header == header and run.records == monitor.records


def test_every_records_one_step_in_n_with_the_peak_of_all_of_them():
    with Monitor("sim:64MiB", every=5) as monitor:
        for step in range(23):
            if step == 2:
                temp = torch.empty(MiB // 4)  # 1 MiB at an unrecorded step
                del temp
            assert (monitor.step() is None) == (step % 5 != 4)
    assert [r["step"] for r in monitor.records] == [4, 9, 14, 19]
    assert monitor.records[0]["peak_allocated"] == MiB
    assert monitor.records[1]["peak_allocated"] == 0


def test_an_oom_is_recorded_and_propagates_unchanged(tmp_path):
    path = tmp_path / "run.jsonl"
    gpu = memfit.device("sim:4MiB")
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"), Monitor(gpu, path=path) as monitor:
        kept = []
        for _ in range(10):
            kept.append(torch.empty(MiB // 4))  # 1 MiB per step: the fourth does not fit
            monitor.step()
    # 1 MiB requests share 2 MiB small-pool segments: four fit in 4 MiB, the fifth does not
    assert [r["step"] for r in monitor.records] == [0, 1, 2, 3, 4]
    last = monitor.records[-1]
    assert last["event"] == "oom" and last["num_ooms"] == 1
    assert last["message"].startswith("CUDA out of memory. Tried to allocate 1.00 MiB")
    assert read_run(path).records[-1] == last
    del kept
    before = gpu.memory_stats()["allocation.all.current"]
    torch.empty(1024)  # the monitor left the device: nothing is counted any more
    assert gpu.memory_stats()["allocation.all.current"] == before


def test_other_errors_propagate_unchanged_without_a_record():
    error = ValueError("shapes do not match")
    with pytest.raises(ValueError) as caught, Monitor("sim:64MiB") as monitor:
        monitor.step()
        raise error
    assert caught.value is error
    assert len(monitor.records) == 1 and "event" not in monitor.records[0]


def test_rank_in_the_path_gives_each_process_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with Monitor("cpu", path=tmp_path / "run-{rank}.jsonl") as monitor:
        monitor.step()
    assert monitor.path == tmp_path / "run-3.jsonl"
    assert len(read_run(tmp_path / "run-3.jsonl").records) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every": 0}, "invalid every 0"),
        ({"every": 1.5}, "invalid every 1.5"),
        ({"max_entries": 0}, "invalid max_entries 0"),
        ({"window": 2}, "invalid window 2"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs, message):
    with pytest.raises(MemfitError, match=message):
        Monitor("sim:64MiB", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_device_without_cuda_is_a_user_error():
    with pytest.raises(MemfitError, match="Monitor needs a device"):
        Monitor()


def test_step_outside_the_block_is_a_user_error():
    monitor = Monitor("cpu")
    with pytest.raises(MemfitError, match="outside"):
        monitor.step()


@pytest.mark.parametrize(
    "value, expected",
    [
        (torch.Size([8, 128]), [8, 128]),
        (torch.zeros(2, 3), [2, 3]),
        ((4, (5, 6)), [4, [5, 6]]),
        ({"a": torch.Size([1])}, {"a": [1]}),
        ("eval", "eval"),
        (None, None),
        (0.5, 0.5),
        (float("nan"), "nan"),
        (torch.float16, "torch.float16"),
    ],
)
def test_jsonable_label(value, expected):
    assert jsonable_label(value) == expected


# -- reading a run back ----------------------------------------------------------------

HEADER = json.dumps({"kind": "header", "device": "sim:1GiB", "capacity": 2**30})
STEP = json.dumps({"kind": "step", "step": 0, "allocated": 1, "reserved": 2, "labels": {}})


def test_a_run_cut_short_by_a_crash_is_read_up_to_its_last_whole_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(f"{HEADER}\n{STEP}\n{STEP[:20]}")
    run = read_run(path)
    assert isinstance(run, RecordedRun) and len(run.records) == 1 and run.capacity == 2**30


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        (f"{STEP}\n", "the first line is not its header"),
        (f"{HEADER}\nnot json\n{STEP}\n", r"run.jsonl:2: not a memfit monitor record"),
        (f'{HEADER}\n{{"kind": "step"}}\n', r"run.jsonl:2: not a memfit monitor step record"),
        ("[1, 2]\n", r"run.jsonl:1: not a memfit monitor record"),
    ],
)
def test_a_file_that_is_not_a_run_is_a_user_error(tmp_path, text, message):
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    with pytest.raises(MemfitError, match=message):
        read_run(path)


def test_repr_html_shows_the_summary_findings_and_timeline():
    with Monitor("sim:64MiB") as monitor:
        kept = []
        for _ in range(12):
            kept.append(torch.empty(1024))
            monitor.step()
    page = monitor._repr_html_()
    assert "Memory leak: +4.00 KiB per step" in page
    assert "<th>steps_recorded</th><td>12</td>" in page and "<th>last_step</th><td>11</td>" in page
    assert f'<th>allocated</th><td title="{12 * 4096} bytes">48.00 KiB</td>' in page  # 12 kept tensors
    timeline = timeline_png(monitor.header, monitor.records, monitor.findings)
    assert f'<img src="{png_data_uri(timeline)}" alt="memory timeline">' in page


@pytest.mark.cuda
def test_cuda_snapshot_is_dumped_for_the_memory_viewer(tmp_path):  # pragma: no cover - GPU only
    import pickle

    snapshot = tmp_path / "snap.pickle"
    with Monitor("cuda", snapshot=snapshot, max_entries=1000) as monitor:
        x = torch.empty(MiB, device="cuda")
        monitor.step()
        del x
    data = pickle.loads(snapshot.read_bytes())
    assert "segments" in data and "device_traces" in data
    assert monitor.records[0]["allocated"] >= 4 * MiB
