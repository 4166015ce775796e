"""`memfit probe` on the command line: JSON, table, plot, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memfit
from memfit.reporting.figures import probe_png

FAST = "mlp:layers=1,width=8,features=16384"


def test_json_output_has_the_fields(run_cli) -> None:
    status, out, _ = run_cli("probe", FAST, "--device", "sim:4MiB", "--json")
    assert status == 0
    data = json.loads(out)
    assert data["max_batch_size"] >= data["recommended_batch_size"] >= 1
    assert data["trial_steps"] == 2 * len(data["trials"])
    assert data["capacity"] == 4 * 2**20
    assert {"batch_size", "fits", "peak_allocated", "peak_reserved", "samples_per_second"} <= set(data["trials"][0])
    sizes = {t["batch_size"]: t["fits"] for t in data["trials"]}
    assert sizes[data["max_batch_size"]] is True and sizes[data["max_batch_size"] + 1] is False


def test_table_and_summary(run_cli) -> None:
    status, out, _ = run_cli("probe", FAST, "--device", "sim:4MiB", "--headroom", "0")
    assert status == 0
    found = memfit.probe(FAST, "sim:4MiB", headroom=0)  # sim is exact: the same answer as the command's
    largest = found.max_batch_size
    assert "memfit probe" in out and f"largest batch that fits: {largest} ({largest + 1} does not fit)" in out
    assert f"recommended batch: {found.recommended_batch_size}: " in out
    assert f"{len(found.trials)} trials, {found.trial_steps} optimizer steps" in out


def test_memory_option_sizes_the_sim_device_and_max_batch_size_bounds_it(run_cli) -> None:
    status, out, _ = run_cli(
        "probe", FAST, "--device", "sim", "--memory", "4MiB", "--max-batch-size", "6", "--multiple-of", "2", "--json"
    )
    assert status == 0
    data = json.loads(out)
    assert (data["max_batch_size"], data["limit"], data["multiple_of"]) == (6, "max_batch_size", 2)
    assert all(t["batch_size"] % 2 == 0 for t in data["trials"])


def test_plot_writes_a_png(run_cli, tmp_path: Path) -> None:
    target = tmp_path / "probe.png"
    status, out, _ = run_cli(
        "probe", FAST, "--device", "sim:4MiB", "--max-batch-size", "8", "--plot", str(target), "--json"
    )
    assert status == 0
    # the plot is the figure of the very trials printed, with each fitting batch's speed predicted on
    # the simulated GPU's card (what it draws: tests/test_report.py)
    from memfit.search.probe_speeds import with_predicted_speeds

    charted = with_predicted_speeds(
        json.loads(out), memfit.load_workload(FAST), memfit.Settings(), memfit.device("sim:4MiB")
    )
    assert "predicted_samples_per_second" in charted["trials"][0]
    assert target.read_bytes() == probe_png(charted)
    assert [p.name for p in tmp_path.iterdir()] == ["probe.png"]  # no temp file left behind


def test_does_not_fit_is_one_line_and_exit_2(run_cli) -> None:
    status, out, err = run_cli("probe", FAST, "--device", "sim:1MiB")
    assert status == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("memfit: error: ") and "does not fit even at batch size 1" in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--plot", "out.svg"], "must end in .png"),
        (["--headroom", "1.5"], "headroom"),
        (["--max-batch-size", "2", "--multiple-of", "4"], "invalid max_batch_size"),
    ],
)
def test_bad_input_is_a_one_line_error(run_cli, args: list[str], message: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli("probe", FAST, "--device", "sim:4MiB", *args)
    assert status == 2
    assert err.startswith("memfit: error: ") and message in err
    assert not list(tmp_path.iterdir())


# -- --gpu X: the card X, its memory and its speed, as in plan, fit and estimate (issue 21) ----------


def test_gpu_x_means_the_card_x_as_in_plan_and_estimate(run_cli) -> None:
    status, out, err = run_cli("probe", FAST, "--gpu", "T4", "--max-batch-size", "4", "--json")
    assert status == 0, err
    probed = json.loads(out)
    assert probed["device"] == "sim:T4" and probed["capacity"] == memfit.device("sim:T4").capacity
    status, out, err = run_cli("plan", FAST, "--gpu", "T4", "--target-batch", "4", "--json")
    assert status == 0, err
    assert (json.loads(out)["device"], json.loads(out)["capacity"]) == ("sim:T4", probed["capacity"])
    status, out, err = run_cli("estimate", FAST, "--gpu", "T4", "--batch-size", "4", "--json")
    assert status == 0, err
    estimated = json.loads(out)  # the card's memory less what the allocator never sees: the sim card's capacity
    assert estimated["memory"] - sum(estimated["fixed_costs"].values()) == probed["capacity"]


def test_gpu_x_with_a_device_probes_that_device_and_charts_the_card_s_speed(run_cli, tmp_path: Path) -> None:
    target = tmp_path / "probe.png"
    args = ["--device", "sim:4MiB", "--gpu", "T4", "--max-batch-size", "4", "--plot", str(target), "--json"]
    status, out, err = run_cli("probe", FAST, *args)
    assert status == 0, err
    data = json.loads(out)
    assert (data["device"], data["capacity"]) == ("sim:4MiB", 4 * 2**20)
    from memfit.search.probe_speeds import with_predicted_speeds

    wl, settings, sim = memfit.load_workload(FAST), memfit.Settings(), memfit.device("sim:4MiB")
    on_t4 = with_predicted_speeds(data, wl, settings, sim, "T4")
    assert on_t4["speed_gpu"] == "T4" and on_t4 != with_predicted_speeds(data, wl, settings, sim)
    assert target.read_bytes() == probe_png(on_t4)


def test_gpu_x_not_in_the_table_is_one_line(run_cli) -> None:
    status, out, err = run_cli("probe", FAST, "--gpu", "rtx3090x", "--json")
    lines = [line for line in err.splitlines() if line.strip()]
    assert (status, out, len(lines)) == (2, "", 1) and lines[0].startswith("memfit: error: ")
    assert "rtx3090x" in lines[0]
