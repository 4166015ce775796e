"""Reports: tables for notebooks, the timeline PNG and the self-contained HTML page, and `memfit report`."""

from __future__ import annotations

import base64
import html
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit._html import html_table, is_byte_key, to_html
from memfit._io import write_atomically
from memfit._plot import png_bytes
from memfit.errors import MemfitError
from memfit.monitor.findings import MemoryFinding
from memfit.monitor.monitor import Monitor
from memfit.monitor.runfile import read_run
from memfit.monitor.timeline import timeline_figure, timeline_png
from memfit.reporting.figures import estimate_figure, estimate_png, plan_figure, plan_png, probe_figure, probe_png
from memfit.reporting.pages import write_report
from memfit.run.measure import Measurement
from memfit.units import format_size

MiB = 2**20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

PROBE = {
    "max_batch_size": 48,
    "recommended_batch_size": 32,
    "trial_steps": 2,
    "trials": [
        {
            "batch_size": 8,
            "fits": True,
            "peak_allocated": 200 * MiB,
            "peak_reserved": 220 * MiB,
            "samples_per_second": 410.0,
        },
        {
            "batch_size": 32,
            "fits": True,
            "peak_allocated": 700 * MiB,
            "peak_reserved": 760 * MiB,
            "samples_per_second": 990.5,
        },
        {
            "batch_size": 48,
            "fits": True,
            "peak_allocated": 1000 * MiB,
            "peak_reserved": 1010 * MiB,
            "samples_per_second": 1002.0,
        },
        {
            "batch_size": 64,
            "fits": False,
            "peak_allocated": 1020 * MiB,
            "peak_reserved": 1024 * MiB,
            "samples_per_second": None,
        },
    ],
}
ESTIMATE = {
    "batch_size": 32,
    "peak_allocated": 700 * MiB,
    "peak_reserved": 750 * MiB,
    "total": 750 * MiB,
    "breakdown": {"parameter": 100 * MiB, "gradient": 100 * MiB, "optimizer": 200 * MiB, "activation": 300 * MiB},
    "fits": True,
    "max_batch_size": 46,
    "memory": 1024 * MiB,
}
PLAN = {
    "workload": "gpt2:n_layer=2",
    "candidates": [
        {
            "precision": "bf16",
            "checkpointing": "none",
            "micro_batch_size": 16,
            "accumulation_steps": 2,
            "peak_reserved": 900 * MiB,
            "samples_per_second": 1200.0,
            "fits": True,
        },
        {
            "precision": "fp32",
            "checkpointing": "blocks",
            "micro_batch_size": 32,
            "accumulation_steps": 1,
            "peak_reserved": 980 * MiB,
            "samples_per_second": 800.0,
            "fits": True,
        },
    ],
}


# -- tables ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, expected",
    [
        ("peak_allocated", True),
        ("peak_reserved", True),
        ("total", True),
        ("memory", True),
        ("growth_bytes_per_step", True),
        ("unallocated", True),
        ("breakdown", True),
        ("batch_size", False),
        ("max_batch_size", False),
        ("samples_per_second", False),
        ("step", False),
        ("fits", False),
    ],
)
def test_is_byte_key(key, expected):
    assert is_byte_key(key) is expected


def test_html_table_formats_sizes_escapes_text_and_fills_missing_cells():
    table = html_table([{"name": "<script>", "peak_allocated": 3 * MiB}, {"fits": False, "speed": 1.23456}])
    assert "<th>name</th><th>peak_allocated</th><th>fits</th><th>speed</th>" in table
    assert "&lt;script&gt;" in table and "<script>" not in table
    assert '<td title="3145728 bytes">3.00 MiB</td>' in table
    assert "<td>no</td>" in table and "<td>1.235</td>" in table
    assert table.count("<td>-</td>") == 4  # missing cells


@pytest.mark.parametrize(
    "obj, expected",
    [
        (
            Measurement(batch_size=8, fits=True, peak_allocated=MiB, peak_reserved=2 * MiB, seconds_per_step=0.5),
            ["<th>batch_size</th><td>8</td>", '<th>peak_reserved</th><td title="2097152 bytes">2.00 MiB</td>'],
        ),
        ({"breakdown": {"activation": 5 * MiB}}, ['<th>activation</th><td title="5242880 bytes">5.00 MiB</td>']),
        ([{"batch_size": 4}, {"batch_size": 8}], ["<th>batch_size</th>", "<td>4</td>", "<td>8</td>"]),
        ({"trials": [{"batch_size": 2}]}, ["<th>trials</th><td><table", "<td>2</td>"]),
        (
            MemoryFinding(
                kind="leak",
                title="Memory leak: +1 B per step",
                summary="grew",
                first_step=0,
                last_step=9,
                causes=("`total = total + loss`",),
            ),
            ['class="finding leak"', "<code>total = total + loss</code>"],
        ),
        ("plain", ["<pre>plain</pre>"]),
        (
            {"advice": ["use bf16, then", "checkpoint"], "shape": [8, 128], "fixed_costs": {}},
            ["<td>use bf16, then<br>checkpoint</td>", "<td>8, 128</td>", "<th>fixed_costs</th><td>-</td>"],
        ),
    ],
)
def test_to_html(obj, expected):
    page = to_html(obj)
    for piece in expected:
        assert piece in page


# -- figures ---------------------------------------------------------------------------

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def lines_of(axes) -> dict[str, list[tuple[float, float]]]:
    """Each plotted line's (x, y) points by its label (an axhline/axvline spans 0..1 across)."""
    return {line.get_label(): [tuple(point) for point in line.get_xydata().tolist()] for line in axes.get_lines()}


def points_of(axes) -> dict[str, list[tuple[float, float]]]:
    """Each scatter's (x, y) points by its label."""
    return {c.get_label(): [tuple(point) for point in c.get_offsets().tolist()] for c in axes.collections}


def spans_of(axes) -> dict[str, tuple[float, float]]:
    """Each shaded span's (first x, last x) by its label."""
    spans = {}
    for patch in axes.patches:
        xs = patch.get_patch_transform().transform(patch.get_path().vertices)[:, 0]
        spans[patch.get_label()] = (float(xs.min()), float(xs.max()))
    return spans


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR"
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def test_probe_figure_plots_each_fitting_trials_peaks_the_ooms_at_the_capacity_and_the_chosen_sizes():
    figure = probe_figure({**PROBE, "capacity": 1536 * MiB})
    memory, speed = figure.axes
    assert memory.get_ylabel() == "GiB"  # the capacity, 1.5 GiB, is the largest value
    fitting = [t for t in PROBE["trials"] if t["fits"]]  # batch 64 ran out of memory: its peak is partial
    lines = lines_of(memory)
    for key in ("peak_allocated", "peak_reserved"):
        assert lines[key.replace("_", " ")] == [(t["batch_size"], t[key] / 2**30) for t in fitting]
    assert points_of(memory) == {"out of memory": [(64, 1.5)]}  # at the capacity, not its partial peak
    assert {y for _, y in lines["capacity 1.50 GiB"]} == {1.5}
    assert {x for x, _ in lines["max batch size = 48"]} == {48}
    assert {x for x, _ in lines["recommended batch size = 32"]} == {32}
    assert lines_of(speed) == {"samples/s": [(8, 410.0), (32, 990.5), (48, 1002.0)]}


def test_probe_figure_without_a_capacity_marks_an_oom_at_its_own_peak():
    figure = probe_figure(PROBE)
    memory, _ = figure.axes
    assert memory.get_ylabel() == "GiB"  # the OOM trial's 1024 MiB
    assert points_of(memory) == {"out of memory": [(64, 1.0)]}
    assert not any(label.startswith("capacity") for label in lines_of(memory))


def test_estimate_figure_draws_one_bar_per_category_smallest_first_and_the_peak_and_device_memory():
    breakdown = {"activation": 300 * MiB, "parameter": 100 * MiB, "optimizer": 200 * MiB, "gradient": 50 * MiB}
    (axes,) = estimate_figure({**ESTIMATE, "breakdown": breakdown}).axes
    assert axes.get_xlabel() == "GiB"
    assert [label.get_text() for label in axes.get_yticklabels()] == [
        "gradient",
        "parameter",
        "optimizer",
        "activation",
    ]
    assert [bar.get_width() for bar in axes.patches] == [50 / 1024, 100 / 1024, 200 / 1024, 300 / 1024]
    assert [text.get_text() for text in axes.texts] == [" 50.00 MiB", " 100.00 MiB", " 200.00 MiB", " 300.00 MiB"]
    lines = lines_of(axes)
    assert {x for x, _ in lines["peak reserved 750.00 MiB"]} == {750 / 1024}
    assert {x for x, _ in lines["memory 1.00 GiB"]} == {1.0}
    assert axes.get_title(loc="left") == "memfit estimate · batch size 32"


def test_plan_figure_places_each_measured_candidate_the_front_the_recommendation_and_the_capacity():
    bf16, fp32_blocks = PLAN["candidates"]
    unmeasured = {"precision": "fp16", "checkpointing": "none", "micro_batch_size": 64, "status": "dominated"}
    failed = {**bf16, "precision": "fp16", "fits": False, "samples_per_second": None}
    plan = {
        **PLAN,
        "candidates": [*PLAN["candidates"], unmeasured, failed],
        "pareto": [bf16, fp32_blocks],
        "recommended": bf16,
        "capacity": 1024 * MiB,
    }
    (axes,) = plan_figure(plan).axes
    assert axes.get_xlabel() == "peak reserved (GiB)"
    at = 1 / 1024  # one MiB on this axis
    assert points_of(axes) == {
        "bf16": [(900 * at, 1200.0)],
        "fp32, checkpointing": [(980 * at, 800.0)],
        "recommended": [(900 * at, 1200.0)],
    }
    lines = lines_of(axes)
    assert lines["Pareto front"] == [(900 * at, 1200.0), (980 * at, 800.0)]
    assert {x for x, _ in lines["capacity 1.00 GiB"]} == {1.0}
    assert [text.get_text() for text in axes.texts] == ["16×2", "32×1"]  # micro-batch × accumulation


def test_a_plan_ranked_by_predicted_speed_plots_that_speed_for_every_candidate_that_fits():
    """On a simulated GPU the plan ranks by the predicted speed on its card: the figure shows
    that speed, for fake-tensor candidates too (they have no measured speed), and names the card."""
    fake = {
        **PLAN["candidates"][0],
        "samples_per_second": None,  # a fake trial: memory only
        "predicted_samples_per_second": 5000.0,
        "fake": True,
    }
    real = {**PLAN["candidates"][1], "samples_per_second": 12.0, "predicted_samples_per_second": 3000.0}
    plan = {
        **PLAN,
        "ranked_by": "predicted",
        "speed_gpu": "RTX 4090",
        "candidates": [fake, real],
        "pareto": [fake, real],
        "recommended": fake,
        "capacity": 1024 * MiB,
    }
    (axes,) = plan_figure(plan).axes
    at = 1 / 1024
    assert axes.get_ylabel() == "samples/s predicted on the RTX 4090"
    assert points_of(axes) == {
        "bf16": [(900 * at, 5000.0)],
        "fp32, checkpointing": [(980 * at, 3000.0)],
        "recommended": [(900 * at, 5000.0)],
    }
    assert lines_of(axes)["Pareto front"] == [(900 * at, 5000.0), (980 * at, 3000.0)]
    measured = plan_figure({**PLAN, "ranked_by": "measured", "device": "cuda:0"})
    assert measured.axes[0].get_ylabel() == "samples/s measured on cuda:0"


def test_a_probe_chart_on_a_simulated_gpu_shows_the_cards_predicted_speed(one_thread):
    """On sim: the trials time the CPU; the chart shows each fitting batch's speed predicted on
    the simulated GPU's card (the default one for a bare size, named), fake trials included."""
    from memfit.estimator.speed import DEFAULT_SPEED_GPU, step_time
    from memfit.search.probe_speeds import with_predicted_speeds

    workload, gpu = memfit.load_workload("mlp:layers=1,width=16,features=32"), memfit.device("sim:4MiB")
    result = memfit.probe(workload, gpu, max_batch_size=16)
    charted = with_predicted_speeds(result.to_dict(), workload, memfit.Settings(), gpu)
    assert charted["speed_gpu"] == DEFAULT_SPEED_GPU
    fitting = [t for t in charted["trials"] if t["fits"]]
    assert fitting and any(t["fake"] for t in fitting)
    for t in fitting:
        expected = step_time(workload, memfit.Settings(micro_batch_size=t["batch_size"]), DEFAULT_SPEED_GPU)
        assert t["predicted_samples_per_second"] == expected.samples_per_second
    (_memory, twin) = probe_figure(charted).axes
    assert twin.get_ylabel() == f"samples/s predicted on the {DEFAULT_SPEED_GPU}"
    by_batch = sorted(fitting, key=lambda t: t["batch_size"])  # one point a trial, as the chart sorts them
    plotted = [(t["batch_size"], t["predicted_samples_per_second"]) for t in by_batch]
    assert [tuple(p) for p in twin.get_lines()[0].get_xydata().tolist()] == plotted
    # a model instance's fake steps would step the script's own optimizer: no prediction
    instance = memfit.Workload(workload.build_model(), workload.make_batch, workload.loss, name="script")
    assert with_predicted_speeds(result.to_dict(), instance, memfit.Settings(), gpu) == result.to_dict()


def timeline_records(steps: int = 4) -> list[dict]:
    return [
        {
            "step": i,
            "allocated": MiB * i,
            "reserved": 2 * MiB * i,
            "peak_allocated": MiB * (i + 1),
            "num_ooms": int(i == 3),
        }
        for i in range(steps)
    ]


def test_timeline_figure_plots_each_records_memory_the_oom_the_capacity_and_the_findings():
    leak = MemoryFinding(kind="leak", title="Memory leak: +1 B per step", summary="", first_step=1, last_step=3)
    shape = MemoryFinding(
        kind="shape_peak", title="New peak", summary="", first_step=2, last_step=2, evidence={"events": [{"step": 2}]}
    )
    figure = timeline_figure({"device": "sim:8MiB", "capacity": 8 * MiB}, timeline_records(), [leak, shape])
    (axes,) = figure.axes
    assert axes.get_ylabel() == "MiB" and axes.get_title(loc="left") == "memfit monitor · sim:8MiB"
    lines = lines_of(axes)
    assert lines["peak allocated (per step)"] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert lines["reserved"] == [(0, 0), (1, 2), (2, 4), (3, 6)]
    assert lines["allocated (at step end)"] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert {y for _, y in lines["capacity 8.00 MiB"]} == {8}
    assert {x for x, _ in lines["new largest input shape"]} == {2}
    assert points_of(axes) == {"out of memory": [(3, 6)]}  # the step whose OOM count rose, at its reserved
    assert spans_of(axes) == {"Memory leak: +1 B per step": (1, 3)}


def test_timeline_figure_of_a_large_card_notes_the_capacity_instead_of_flattening_the_lines():
    (axes,) = timeline_figure({"device": "sim:1GiB", "capacity": 2**30}, timeline_records()).axes
    assert axes.get_ylabel() == "MiB"
    assert not any(label.startswith("capacity") for label in lines_of(axes))
    assert [text.get_text() for text in axes.texts] == ["capacity 1.00 GiB (off the chart)"]


def test_timeline_figure_without_steps_says_so():
    (axes,) = timeline_figure({"device": "sim:1GiB", "capacity": 2**30}, []).axes
    assert [text.get_text() for text in axes.texts] == ["no steps recorded"]
    assert axes.get_lines() == [] and not axes.axison


@pytest.mark.parametrize(
    ("draw", "build", "args", "size"),
    [
        (probe_png, probe_figure, (PROBE,), (1000, 400)),
        (estimate_png, estimate_figure, (ESTIMATE,), (800, 242)),  # 0.9 + 0.38 per bar, inches
        (plan_png, plan_figure, (PLAN,), (900, 420)),
        (timeline_png, timeline_figure, ({"device": "sim:1GiB"}, timeline_records()), (1000, 420)),
        (timeline_png, timeline_figure, ({"device": "sim:1GiB"}, []), (1000, 420)),
    ],
)
def test_each_png_is_its_figure_rendered(draw, build, args, size):
    png = draw(*args)
    assert png_size(png) == size
    assert png == png_bytes(build(*args))  # rendering is deterministic: the same figure, the same bytes


@pytest.mark.parametrize(
    ("draw", "result"),
    [
        (probe_png, {"trials": []}),
        (probe_png, {"trials": [{"fits": True}]}),  # a trial without a batch size
        (estimate_png, {"breakdown": {}}),
        (estimate_png, {"batch_size": 4}),
        (plan_png, {"candidates": [{"fits": False}]}),
    ],
)
def test_results_without_data_have_no_figure(draw, result):
    assert draw(result) is None


# -- the page and the command ----------------------------------------------------------


class _Page(HTMLParser):
    """Collect what a reader sees: image sources, the text, and any links to elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.text: list[str] = []
        self.external: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "img":
            self.images.append(attributes["src"])
        if tag == "script":
            self.scripts += 1
        for name in ("src", "href"):
            if attributes.get(name, "").startswith(("http:", "https:", "//")):
                self.external.append(attributes[name])

    def handle_data(self, data):
        self.text.append(data)


def read_page(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def record_leaking_run(path: Path, steps: int = 15) -> None:
    """A real run on sim: evaluation without no_grad, keeping each step's loss with its graph."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        with Monitor("sim:64MiB", path=path) as monitor:
            total = 0
            for _ in range(steps):
                x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
                total = total + F.cross_entropy(model(x), y)
                monitor.step(phase="eval", shape=x.shape)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def leaking_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "run.jsonl"
    record_leaking_run(path)
    return path


@pytest.fixture
def results(tmp_path) -> dict[str, Path]:
    paths = {}
    for name, data in (("probe", PROBE), ("estimate", ESTIMATE), ("plan", PLAN)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    return paths


def test_report_command_renders_the_png_and_a_self_contained_html(tmp_path, leaking_run, results, run_cli):
    output = tmp_path / "out" / "report.html"
    status, out, err = run_cli(
        "report",
        str(leaking_run),
        "-o",
        str(output),
        "--probe",
        str(results["probe"]),
        "--estimate",
        str(results["estimate"]),
        "--plan",
        str(results["plan"]),
        "--json",
    )
    assert status == 0, err
    answer = json.loads(out)
    png = tmp_path / "out" / "report-timeline.png"
    assert answer["html"] == str(output) and answer["png"] == str(png)
    assert [f["kind"] for f in answer["findings"]] == ["leak"]
    assert answer["findings"][0]["evidence"]["growth_bytes_per_step"] == 11776
    assert sorted(p.name for p in output.parent.iterdir()) == ["report-timeline.png", "report.html"]

    page = read_page(output)
    assert page.external == [] and page.scripts == 0  # no CDN, nothing fetched
    assert len(page.images) == 4  # the timeline, the probe's, the estimate's and the plan's figures
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    figures = [base64.b64decode(src.split(",", 1)[1]) for src in page.images]
    run = read_run(leaking_run)
    # the page shows the run's timeline (the PNG beside it) and each result's own figure
    assert figures[0] == png.read_bytes() == timeline_png(run.header, run.records, run.findings())
    assert figures[1:] == [probe_png(PROBE), estimate_png(ESTIMATE), plan_png(PLAN)]
    text = " ".join(page.text)
    assert "Memory leak: +11.50 KiB per step" in text
    assert "total = total + loss" in text
    for heading in ("Findings", "Memory timeline", "Probe", "Estimate", "Plan"):
        assert heading in text
    assert "recommended_batch_size" in text and "1010.00 MiB" in text  # probe trials
    assert "activation" in text and "300.00 MiB" in text  # estimate breakdown
    assert "checkpointing" in text and "gpt2:n_layer=2" in text  # plan candidates and the rest


def test_report_command_defaults_to_the_run_name_and_prints_the_findings(tmp_path, leaking_run, run_cli):
    run = tmp_path / "copy.jsonl"
    run.write_bytes(leaking_run.read_bytes())
    status, out, _ = run_cli("report", str(run))
    assert status == 0
    assert (tmp_path / "copy.html").exists() and (tmp_path / "copy-timeline.png").exists()
    assert "Memory leak: +11.50 KiB per step" in out and "wrote" in out


def test_a_run_without_steps_renders_without_findings(tmp_path, run_cli):
    run = tmp_path / "empty.jsonl"
    with Monitor("cpu", path=run):
        pass
    status, out, _ = run_cli("report", str(run), "--json")
    assert status == 0 and json.loads(out)["findings"] == []
    text = " ".join(read_page(tmp_path / "empty.html").text)
    assert "No findings" in text


@pytest.mark.parametrize(
    "run_text, probe_text, message",
    [
        ('{"kind": "step"}\n', None, "not a memfit monitor run"),
        (None, "{not json", "the probe file .* is not valid JSON"),
        (None, "[1, 2]", "the probe file .* must be a JSON object"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, leaking_run, run_cli, run_text, probe_text, message):
    run = tmp_path / "run.jsonl"
    run.write_text(run_text) if run_text is not None else run.write_bytes(leaking_run.read_bytes())
    args = ["report", str(run), "-o", str(tmp_path / "out" / "r.html")]
    if probe_text is not None:
        (tmp_path / "probe.json").write_text(probe_text)
        args += ["--probe", str(tmp_path / "probe.json")]
    status, out, err = run_cli(*args)
    assert status == 2 and out == ""
    assert err.startswith("memfit: error: ") and err.count("\n") == 1
    import re

    assert re.search(message, err)
    assert not (tmp_path / "out").exists()


def test_missing_run_file_is_a_usage_error(tmp_path, run_cli):
    status, _, err = run_cli("report", str(tmp_path / "nope.jsonl"))
    assert status == 2 and err.startswith("memfit: error: ")


def test_write_report_takes_result_objects(tmp_path, leaking_run):
    import memfit

    probed = memfit.probe("mlp:layers=1,width=8,features=8", "sim:4MiB", max_batch_size=4, guess=4)
    files = write_report(leaking_run, tmp_path / "r.html", probe=probed)
    run = read_run(leaking_run)
    assert files.png.read_bytes() == timeline_png(run.header, run.records, run.findings())
    assert "<th>max_batch_size</th><td>4</td>" in files.html.read_text()


def test_a_foreign_result_is_refused_before_anything_is_written(tmp_path, leaking_run):
    """A measurement handed over as a plan (issue 14, item 13) is not a plan: refused, nothing written."""
    measurement = Measurement(batch_size=8, fits=True, peak_allocated=MiB, peak_reserved=2 * MiB, seconds_per_step=0.1)
    with pytest.raises(
        MemfitError, match=r"the plan result is not a `memfit plan --json` result \(workload is missing\)"
    ):
        write_report(leaking_run, tmp_path / "r.html", plan=measurement)
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(json.dumps(PLAN))  # a plan given as --probe
    with pytest.raises(MemfitError, match=r"not a `memfit probe --json` result \(max_batch_size is missing\)"):
        write_report(leaking_run, tmp_path / "r.html", probe=probe_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.json"]


def test_monitor_writes_its_own_report(tmp_path):
    with Monitor("sim:64MiB") as monitor:
        kept = []
        for _ in range(12):
            kept.append(torch.empty(1024))  # 4 KiB kept per step
            monitor.step()
    files = write_report(monitor, tmp_path / "m.html")
    assert [f.kind for f in files.findings] == ["leak"]
    assert files.png == tmp_path / "m-timeline.png" and files.png.exists()
    assert "Memory leak: +4.00 KiB per step" in files.html.read_text()


def test_write_atomically_replaces_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "a.txt"
    write_atomically(target, b"one")
    write_atomically(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def td(value: int) -> str:
    """A size's cell as a reader sees it: the size for people, the bytes in the tooltip."""
    return f'<td title="{value} bytes">{format_size(value)}</td>'


def test_results_show_as_tables_in_a_notebook():
    import memfit
    from memfit.search.plan import plan

    tiny = "mlp:layers=1,width=8,features=8"
    m = memfit.measure(tiny, 4, "sim:64MiB")
    e = memfit.estimate(tiny, 4, device="sim:64MiB")
    p = memfit.probe(tiny, "sim:4MiB", max_batch_size=8)
    pl = plan(tiny, 8, "sim:64MiB", precisions=["fp32"])

    # every tensor of this tiny MLP is under 1 MiB: one 2 MiB small-pool segment holds them all
    assert (m.fits, m.peak_reserved) == (True, 2 * MiB)
    page = m._repr_html_()
    assert "<th>batch_size</th><td>4</td>" in page and "<th>fits</th><td>yes</td>" in page
    assert '<th>peak_reserved</th><td title="2097152 bytes">2.00 MiB</td>' in page
    assert f"<th>peak_allocated</th>{td(m.peak_allocated)}" in page

    page = e._repr_html_()
    assert "<th>batch_size</th><td>4</td>" in page
    assert '<th>memory</th><td title="67108864 bytes">64.00 MiB</td>' in page
    assert f"<th>peak_reserved</th>{td(e.peak_reserved)}" in page
    for category, size in e.breakdown.items():  # the breakdown nests as a table of sizes
        assert f"<th>{category}</th>{td(size)}" in page

    page = p._repr_html_()
    assert (p.max_batch_size, p.limit) == (8, "max_batch_size")  # the whole range fits on 4 MiB
    assert "<th>max_batch_size</th><td>8</td>" in page and "<th>limit</th><td>max_batch_size</td>" in page
    assert f"<th>reason</th><td>{html.escape(p.reason)}</td>" in page
    assert '<th>capacity</th><td title="4194304 bytes">4.00 MiB</td>' in page
    for trial in p.trials:  # one row per trial: batch size, fits, then the peaks
        assert f"<tr><td>{trial.batch_size}</td><td>yes</td>{td(trial.peak_allocated)}{td(trial.peak_reserved)}" in page

    page = pl._repr_html_()
    best = pl.recommended
    assert (best.settings.micro_batch_size, best.settings.accumulation_steps) == (8, 1)
    recommended = page[page.index("<th>recommended</th>") : page.index("<th>reason</th>")]
    assert "<th>micro_batch_size</th><td>8</td>" in recommended and "<th>precision</th><td>fp32</td>" in recommended
    assert f"<th>peak_reserved</th>{td(best.measurement.peak_reserved)}" in recommended
    assert f"<th>reason</th><td>{html.escape(pl.reason)}</td>" in page
