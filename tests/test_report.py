"""Reports: tables for notebooks, the timeline PNG and the self-contained HTML page, and `memfit report`."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memfit._html import html_table, is_byte_key, to_html
from memfit._io import write_atomically
from memfit.monitor.findings import MemoryFinding
from memfit.monitor.monitor import Monitor
from memfit.monitor.timeline import timeline_png
from memfit.reporting.pages import write_report
from memfit.run.measure import Measurement

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


def test_timeline_png_draws_with_and_without_steps():
    header = {"device": "sim:1GiB", "capacity": 2**30}
    records = [
        {
            "step": i,
            "allocated": MiB * i,
            "reserved": 2 * MiB * i,
            "peak_allocated": MiB * (i + 1),
            "num_ooms": int(i == 3),
        }
        for i in range(4)
    ]
    for png in (timeline_png(header, records), timeline_png(header, [])):
        assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


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
    assert all(figure.startswith(PNG_SIGNATURE) for figure in figures)
    assert figures[0] == png.read_bytes()  # the PNG beside the page is the timeline it shows
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
        (None, "{not json", "the probe file .* is not JSON"),
        (None, "[1, 2]", "the probe result must be a JSON object"),
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
    measurement = Measurement(batch_size=8, fits=True, peak_allocated=MiB, peak_reserved=2 * MiB, seconds_per_step=0.1)
    files = write_report(leaking_run, tmp_path / "r.html", plan=measurement)
    assert files.png.read_bytes().startswith(PNG_SIGNATURE)
    assert '<th>peak_reserved</th><td title="2097152 bytes">2.00 MiB</td>' in files.html.read_text()


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


def test_results_show_as_tables_in_a_notebook():
    import memfit
    from memfit.search.plan import plan

    m = memfit.measure("mlp:layers=1,width=8,features=8", 4, "sim:64MiB")
    e = memfit.estimate("mlp:layers=1,width=8,features=8", 4, device="sim:64MiB")
    p = memfit.probe("mlp:layers=1,width=8,features=8", "sim:4MiB", max_batch_size=8)
    pl = plan("mlp:layers=1,width=8,features=8", 8, "sim:64MiB", precisions=["fp32"])
    for result in (m, e, p, pl):
        page = result._repr_html_()
        assert page.startswith("<") and "<table" in page
