"""Bad input ends in one ``memfit: error:`` line and exit status 2, before the long work (issue 14, items 12-13).

Each case here ended in a traceback (exit 1), was accepted though wrong, or was found only
after the trials had run. An exception raised by the user's own workload code keeps its
traceback, after one line naming the workload function.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memfit.environment import system
from memfit.environment.system import NvidiaFacts, RecordedProbe, TorchFacts

TINY = "mlp:layers=1,width=8,features=8"


def one_error_line(status: int, out: str, err: str, *expected: str) -> str:
    """Assert the command ended as a user error; return its line."""
    assert status == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("memfit: error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# -- zoo options -------------------------------------------------------------------------

ZOO = [
    ("gpt2:n_layer=abc", "n_layer must be a positive integer, not 'abc'"),
    ("gpt2:n_layer=", "zoo option 'n_layer' has no value"),
    ("gpt2:n_layer=-1", "n_layer must be a positive integer, not -1"),
    ("gpt2:n_layer=99999999999", "more than any machine can allocate"),
    ("gpt2:n_head=3,n_embd=128", "`embed_dim` must be divisible by num_heads"),
    ("gpt2:seq_len=0", "seq_len must be a positive integer, not 0"),
    ("gpt2:vocab_size=0", "vocab_size must be a positive integer, not 0"),
    ("gpt2:layer_norm_epsilon=abc", "layer_norm_epsilon must be a number"),
    ("gpt2:layers=2,n_layer=3", "layers and n_layer are one option"),
    ("llama-1b:heads=3", "not a multiple of the number of attention heads"),
    ("resnet50:depths=[0,1]", "depths must be a positive integer"),
    ("vit-base:image_size=0", "image_size must be a positive integer"),
    ("mlp:width=99999999999", "zoo workload 'mlp'"),
    ("mlp:layers=99999999999", "more than any machine can allocate"),
    ("mlp:features=99999999999", "more than any machine can allocate"),
    ("convnet:image_size=99999999", "one sample of its batch would take"),
    ("lstm-lm:layers=99999999999", "more than any machine can allocate"),
    ("gpt:layers=99999999999", "more than any machine can allocate"),
    ("mlp:layers=1,layers=2", "zoo option 'layers' given twice"),
]


def test_every_zoo_entry_names_its_depth_option():
    """The size check builds one and two blocks of the depth option; an entry without one
    would build all its blocks (`lstm-lm:layers=99999999999` would never end)."""
    from memfit.workload import zoo

    assert set(zoo._REPEATED) == set(zoo.ENTRIES)


@pytest.mark.parametrize(("ref", "message"), ZOO)
def test_impossible_or_wrongly_typed_zoo_options_are_one_line(run_cli, ref, message):
    status, out, err = run_cli("estimate", ref, "--batch-size", "1", "--json")
    one_error_line(status, out, err, message)


# -- workload files ----------------------------------------------------------------------

FILES = [
    ("syntax.py", "def make(:\n    pass\n", "syntax.py, line 1: invalid syntax"),
    ("nul.py", "import torch\x00\ndef make(): pass\n", "null bytes"),
    ("missing.py", "import numpy_that_is_not_there\ndef make(): pass\n", "imports numpy_that_is_not_there"),
    ("binary.py", b"\xff\xfe\x00\x01garbage", ""),
]


@pytest.mark.parametrize(("name", "source", "message"), FILES)
def test_a_workload_file_that_cannot_be_imported_is_one_line(run_cli, tmp_path, name, source, message):
    path = tmp_path / name
    if isinstance(source, bytes):
        path.write_bytes(source)
    else:
        path.write_text(source)
    status, out, err = run_cli("measure", f"{path}:make", "--batch-size", "1", "--device", "sim:64MiB")
    one_error_line(status, out, err, message)


BUGGY = """
import torch, memfit

def make():
    def loss(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0][:, :4]), batch[1])  # the user's bug

    return memfit.Workload(
        model=lambda: torch.nn.Linear(8, 2),
        make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
        loss=loss,
    )
"""


def test_an_exception_in_the_users_loss_keeps_its_traceback_after_a_line_naming_it(run_cli, tmp_path):
    path = tmp_path / "buggy.py"
    path.write_text(BUGGY)
    status, out, err = run_cli("measure", f"{path}:make", "--batch-size", "2", "--device", "sim:64MiB")
    assert status == 1 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith(
        f"memfit: error in loss (buggy.py, line 6) of the workload {path}:make: RuntimeError: mat1 and mat2 shapes"
    )
    assert lines[1] == "Traceback (most recent call last):"
    assert any(str(path) in line and "in loss" in line for line in lines)  # the user's frame is there
    assert lines[-1].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")


def test_an_exception_at_the_top_of_the_users_file_keeps_its_traceback(run_cli, tmp_path):
    path = tmp_path / "top.py"
    path.write_text("raise RuntimeError('configuration missing')\n")
    status, _, err = run_cli("measure", f"{path}:make", "--batch-size", "2", "--device", "sim:64MiB")
    lines = err.strip().splitlines()
    assert status == 1 and lines[0].startswith(
        f"memfit: error in the top level (top.py, line 1) of the workload {path}"
    )
    assert lines[-1] == "RuntimeError: configuration missing"


# -- input files: env check, report ------------------------------------------------------


def bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "binary": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
        "latin1": b'{"schema": "caf\xe9"}',
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "deep-object": b'{"a":' * 200 + b"1" + b"}" * 200,
        "null": b"null",
    }
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_bytes(data)
    paths["folder"] = tmp_path
    return paths


@pytest.mark.parametrize("case", ["binary", "latin1", "deep", "deep-object", "null", "folder"])
def test_env_check_refuses_binary_and_deeply_nested_files_in_one_line(run_cli, tmp_path, case):
    path = bad_files(tmp_path)[case]
    status, out, err = run_cli("env", "check", str(path))
    one_error_line(status, out, err)


@pytest.mark.parametrize("case", ["binary", "latin1", "deep", "deep-object", "null"])
def test_report_refuses_binary_and_deeply_nested_runs_in_one_line(run_cli, tmp_path, case):
    path = bad_files(tmp_path)[case].rename(tmp_path / f"{case}.jsonl")
    status, out, err = run_cli("report", str(path))
    one_error_line(status, out, err)
    assert not path.with_suffix(".html").exists()


HEADER = {"kind": "header", "format": 1, "device": "sim:1GiB", "capacity": 2**30, "window": 10}
STEP = {"kind": "step", "step": 0, "allocated": 10, "reserved": 20, "peak_allocated": 15, "labels": {}}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({**STEP, "reserved": "lots"}, "reserved must be a whole number"),
        ({**STEP, "labels": [1, 2]}, "labels must be an object"),
        ({**STEP, "seconds": "slow"}, "seconds must be a number"),
    ],
)
def test_report_refuses_records_of_the_wrong_type(run_cli, tmp_path, line, message):
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps(HEADER) + "\n" + json.dumps(line) + "\n" + json.dumps(STEP) + "\n")
    one_error_line(*run_cli("report", str(run)), message)


def a_run(tmp_path: Path) -> Path:
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps(HEADER) + "\n" + json.dumps(STEP) + "\n")
    return run


@pytest.mark.parametrize(
    ("option", "content", "message"),
    [
        ("--plan", {"max_batch_size": 4, "recommended_batch_size": 4, "trials": []}, "not a `memfit plan --json`"),
        (
            "--probe",
            {"workload": "mlp", "candidates": []},
            "not a `memfit probe --json` result (max_batch_size is missing)",
        ),
        ("--estimate", {"name": "something else"}, "not a `memfit estimate --json` result"),
        (
            "--plan",
            {"workload": "mlp", "candidates": [{"peak_reserved": "big"}]},
            "candidates[0].peak_reserved must be a whole number",
        ),
        ("--probe", [1, 2, 3], "must be a JSON object"),
    ],
)
def test_report_refuses_a_foreign_result(run_cli, tmp_path, option, content, message):
    result = tmp_path / "result.json"
    result.write_text(json.dumps(content))
    run = a_run(tmp_path)
    one_error_line(*run_cli("report", str(run), option, str(result)), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "run.jsonl"]  # nothing written


# -- output paths, checked before any trial ----------------------------------------------

COUNTING = """
import pathlib, torch, memfit

def make():
    def make_batch(n):
        pathlib.Path(__file__).with_name("a-trial-ran").touch()
        return torch.randn(n, 8), torch.randint(0, 2, (n,))

    return memfit.Workload(
        model=lambda: torch.nn.Linear(8, 2),
        make_batch=make_batch,
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
    )
"""


def unwritable(tmp_path: Path) -> dict[str, str]:
    """Paths no one can write here, even root: under a regular file, a folder, /proc."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    (tmp_path / "a-folder").mkdir()
    return {
        "under a file": str(blocker / "out.png"),
        "a folder": str(tmp_path / "a-folder"),
        "in /proc": "/proc/memfit-cannot-write-here.png",
    }


@pytest.mark.parametrize("where", ["under a file", "a folder", "in /proc"])
@pytest.mark.parametrize("command", ["probe --plot", "plan --plot", "fit --lock", "fit --report-dir"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_trial(run_cli, tmp_path, command, where):
    workload = tmp_path / "counting.py"
    workload.write_text(COUNTING)
    target = unwritable(tmp_path)[where]
    name, option = command.split()
    if where == "a folder" and option == "--report-dir":
        target = str(tmp_path / "a-file")  # a report folder that is a file
    args = [name, f"{workload}:make", "--device", "sim:64MiB", option, target]
    if name == "plan":
        args += ["--target-batch", "4", "--precision", "fp32", "--checkpointing", "none"]
    if name == "fit":
        args += ["--no-doctor", "--max-batch-size", "4"]
        args += ["--report-dir", str(tmp_path / "r")] if option == "--lock" else ["--lock", str(tmp_path / "m.lock")]
    if name == "probe":
        args += ["--max-batch-size", "4", "--no-estimate"]
    one_error_line(*run_cli(*args))
    assert not (tmp_path / "a-trial-ran").exists()  # refused before the first batch was made


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_report_output_that_cannot_be_written_is_one_line(run_cli, tmp_path, where):
    target = unwritable(tmp_path)[where].replace(".png", ".html")
    one_error_line(*run_cli("report", str(a_run(tmp_path)), "-o", target))


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_env_export_into_a_folder_that_cannot_be_written_is_one_line(run_cli, tmp_path, where):
    target = (
        str(Path(unwritable(tmp_path)[where]).parent / "env") if where == "in /proc" else unwritable(tmp_path)[where]
    )
    one_error_line(*run_cli("env", "export", "-o", target))


# -- allocator settings torch refuses ------------------------------------------------------


def test_doctor_counts_an_allocator_setting_torch_refuses_as_an_error(run_cli, monkeypatch):
    """Before, `expandable_segment:True` (a typo torch refuses at CUDA's start) was a warning: exit 0."""

    def machine(environ: dict[str, str]) -> RecordedProbe:
        return RecordedProbe(
            nvidia=NvidiaFacts(error="NVML Shared Library Not Found"),
            torch=TorchFacts(version="2.13.0+cpu"),
            environ=environ,
        )

    monkeypatch.setattr(system, "current_probe", lambda: machine({}))
    status, out, _ = run_cli("doctor", "--json")
    assert status == 0 and not [f for f in json.loads(out)["findings"] if f["severity"] == "error"]
    monkeypatch.setattr(
        system, "current_probe", lambda: machine({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segment:True"})
    )
    status, out, _ = run_cli("doctor", "--json")
    errors = [f for f in json.loads(out)["findings"] if f["severity"] == "error"]
    assert status == 1
    assert [f["check"] for f in errors] == ["allocator"]
    assert errors[0]["fix"] == "replace expandable_segment with expandable_segments in PYTORCH_CUDA_ALLOC_CONF"


@pytest.mark.parametrize("value", ["max_split_size_mb:" + "9" * 4400, "x" * 4400, "expandable_segments:True," * 180])
def test_doctor_json_reads_a_4400_character_allocator_setting(run_cli, monkeypatch, value):
    probe = RecordedProbe(torch=TorchFacts(version="2.13.0+cpu"), environ={"PYTORCH_CUDA_ALLOC_CONF": value})
    monkeypatch.setattr(system, "current_probe", lambda: probe)
    status, out, err = run_cli("doctor", "--json")
    assert status in (0, 1) and "Traceback" not in err, err
    assert json.loads(out)["findings"] is not None


def test_a_model_built_on_the_meta_device_is_one_line(run_cli, tmp_path):
    (tmp_path / "meta.py").write_text(
        "import torch, memfit\n"
        "def make():\n"
        "    return memfit.Workload(model=lambda: torch.nn.Linear(8, 2, device='meta'),\n"
        "        make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),\n"
        "        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))\n"
    )
    args = ["measure", f"{tmp_path / 'meta.py'}:make", "--device", "sim:64MiB", "--batch-size", "2"]
    one_error_line(*run_cli(*args), "built its model on the meta device")


# -- every field of environment.json, run files and results (issue 21) -----------------------

FINGERPRINT = {"schema": "memfit.environment", "schema_version": 1, "python": "3.11.7", "os": "Linux"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (json.dumps({**FINGERPRINT, "python": None}), "python must be text"),
        (json.dumps({**FINGERPRINT, "schema_version": True}), "schema_version must be a whole number"),
        (json.dumps({**FINGERPRINT, "torch": 2.5}), "torch must be text"),
        (json.dumps({**FINGERPRINT, "gpus": [{"name": "A100", "memory": -1, "capability": "8.0"}]}), "gpus[0].memory"),
        (json.dumps({**FINGERPRINT, "gpus": [{"name": "A100", "memory": 1.5, "capability": "8.0"}]}), "gpus[0].memory"),
        (json.dumps({**FINGERPRINT, "gpus": ["A100"]}), "gpus must be a list of objects"),
        (json.dumps(FINGERPRINT)[:-1] + ', "driver": NaN}', "holds NaN"),
        (json.dumps(FINGERPRINT)[:-1] + ', "gpus": [{"memory": 1e400}]}', "holds 1e400"),
        (json.dumps(FINGERPRINT)[:-1] + ', "gpus": [{"memory": ' + "9" * 5000 + "}]}", "a number too long"),
    ],
)
def test_env_check_refuses_every_damaged_field_in_one_line(run_cli, tmp_path, text, message):
    path = tmp_path / "environment.json"
    path.write_text(text)
    for json_flag in ((), ("--json",)):
        one_error_line(*run_cli("env", "check", str(path), *json_flag), str(path), message)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({**HEADER, "capacity": -1}, "capacity must be a whole number from 0"),
        ({**HEADER, "capacity": True}, "capacity must be a whole number"),
        ({**HEADER, "window": 2.5}, "window must be a whole number"),
        ({**STEP, "allocated": -10}, "allocated must be a whole number from 0"),
        ({**STEP, "reserved": 2**70}, "reserved must be a whole number"),
        ({**STEP, "seconds": -1}, "seconds must be a number from 0"),
        ({**STEP, "step": True}, "step must be a whole number"),
    ],
)
def test_report_refuses_negative_or_impossible_figures(run_cli, tmp_path, line, message):
    run = tmp_path / "run.jsonl"
    lines = [line, STEP] if line.get("kind") == "header" else [HEADER, line, STEP]
    run.write_text("".join(json.dumps(item) + "\n" for item in lines))
    one_error_line(*run_cli("report", str(run)), f"{run}:", message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"workload": "mlp", "candidates": [{"peak_reserved": Infinity}]}', "holds Infinity"),
        ('{"workload": "mlp", "candidates": [{"peak_reserved": -5}]}', "candidates[0].peak_reserved"),
        ('{"workload": "mlp", "candidates": [], "capacity": -1}', "capacity must be a whole number from 0"),
        ('{"workload": "mlp", "candidates": [{"samples_per_second": NaN}]}', "holds NaN"),
        ('{"workload": ["mlp"], "candidates": []}', "workload must be text"),
    ],
)
def test_report_refuses_a_damaged_plan_result(run_cli, tmp_path, text, message):
    result = tmp_path / "result.json"
    result.write_text(text)
    one_error_line(*run_cli("report", str(a_run(tmp_path)), "--plan", str(result)), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "run.jsonl"]


# -- user code that exits or changes the process (issue 21) -----------------------------------

CHANGING = """
import os, sys, torch, memfit

def make(change):
    def batch(n):
        change()
        return (torch.randn(n, 8), torch.randint(0, 2, (n,)))
    return memfit.Workload(model=lambda: torch.nn.Linear(8, 2), make_batch=batch,
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0].to(m.weight.dtype)), b[1]))

def chdir():
    return make(lambda: os.chdir(os.path.join(os.path.dirname(__file__), "elsewhere")))

def dtype():
    return make(lambda: torch.set_default_dtype(torch.float64))

def deterministic():
    return make(lambda: torch.use_deterministic_algorithms(True))

def exits():
    return make(lambda: sys.exit(0))

def raises_system_exit():
    return make(lambda: (_ for _ in ()).throw(SystemExit("done")))
"""


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("chdir", "changed the working directory from"),
        ("dtype", "changed torch's default dtype from torch.float32 to torch.float64"),
        ("deterministic", "changed torch's deterministic-algorithms flag"),
        ("exits", "a lambda (changing.py, line 21) of the workload changing.py:exits called sys.exit(0)"),
        ("raises_system_exit", "called sys.exit('done')"),
    ],
)
def test_user_code_that_exits_or_changes_the_process_is_one_line_and_undone(
    run_cli, tmp_path, monkeypatch, function, message
):
    import torch

    (tmp_path / "changing.py").write_text(CHANGING)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli("probe", f"changing.py:{function}", "--device", "sim:64MiB", "--plot", "p.png")
    one_error_line(status, out, err, message)
    assert os.getcwd() == str(tmp_path)
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["changing.py"]  # no plot, anywhere


def test_an_output_path_is_where_the_command_started(run_cli, tmp_path, monkeypatch):
    from memfit.cli.options import OutputPath

    monkeypatch.chdir(tmp_path)
    assert OutputPath(dir_okay=False).convert("memfit.lock", None, None) == str(tmp_path / "memfit.lock")


# -- every output destination, before any work (issue 21) -------------------------------------


def test_a_dangling_link_as_report_dir_is_refused_before_any_trial(run_cli, tmp_path):
    (tmp_path / "report").symlink_to(tmp_path / "nowhere")
    args = ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--lock", str(tmp_path / "memfit.lock")]
    one_error_line(*run_cli(*args, "--report-dir", str(tmp_path / "report")), "which does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


@pytest.mark.parametrize("name", ["report-snapshot.pickle", "report-memory-viz.html", "report-timeline.png"])
def test_a_folder_where_a_report_file_goes_is_refused_before_any_trial(run_cli, tmp_path, name):
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / name).mkdir()
    args = ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--lock", str(tmp_path / "memfit.lock")]
    one_error_line(*run_cli(*args, "--report-dir", str(tmp_path / "report")), name, "it is a folder")
    assert not (tmp_path / "memfit.lock").exists()


def test_report_o_refuses_before_writing_any_png(run_cli, tmp_path):
    run = a_run(tmp_path)
    (tmp_path / "page-memory-viz.html").mkdir()
    one_error_line(*run_cli("report", str(run), "-o", str(tmp_path / "page.html")), "page-memory-viz.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page-memory-viz.html", "run.jsonl"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("x" * 300 + ".lock", "bytes a name may be"),
        ("/".join(["d" * 200] * 25) + "/memfit.lock", "the path is longer than"),
    ],
)
def test_an_output_path_longer_than_the_os_allows_is_one_line(run_cli, tmp_path, path, message):
    args = ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--report-dir", str(tmp_path / "r")]
    one_error_line(*run_cli(*args, "--lock", str(tmp_path / path)), message)
    assert list(tmp_path.iterdir()) == []


def test_a_251_byte_name_is_written_though_its_temp_name_would_pass_255(tmp_path):
    from memfit._io import check_writable, write_atomically

    target = tmp_path / ("l" * 246 + ".lock")
    assert len(target.name.encode()) == 251
    check_writable(target)
    write_atomically(target, "x = 1\n")
    assert [p.name for p in tmp_path.iterdir()] == [target.name] and target.read_text() == "x = 1\n"


# -- the host's memory, through the system seam (issue 21) ------------------------------------


def with_host_memory(monkeypatch: pytest.MonkeyPatch, available: int) -> None:
    from memfit.environment.system import HostFacts

    host = HostFacts("Linux", "6.1", "x86_64", 2, 4 * available, available, None, None)
    monkeypatch.setattr(system, "current_probe", lambda: RecordedProbe(host=host))


def test_plan_gpu_x_means_the_card_and_a_real_trial_that_would_exhaust_the_host_is_refused(run_cli, monkeypatch):
    """`plan llama-7b --gpu "RTX 4090"` grew to 24 GB of host memory; a small limit through the seam refuses it."""
    with_host_memory(monkeypatch, 2**30)
    args = ["plan", "llama-7b:seq_len=512", "--gpu", "RTX 4090", "--target-batch", "8", "--trials", "real"]
    line = one_error_line(
        *run_cli(*args), "on sim:RTX 4090 need about", "more than the 1.00 GiB this machine has available"
    )
    assert "use `memfit estimate`" in line


@pytest.mark.parametrize(
    "command",
    [["measure", "--batch-size", "2"], ["probe"], ["plan", "--target-batch", "4", "--trials", "real"], ["fit"]],
)
def test_a_real_run_the_host_cannot_hold_is_refused_before_it_starts(run_cli, monkeypatch, tmp_path, command):
    with_host_memory(monkeypatch, 16 * 2**20)
    monkeypatch.chdir(tmp_path)
    args = [command[0], "mlp:layers=2,width=1024,features=1024", "--device", "sim:64MiB", *command[1:]]
    one_error_line(*run_cli(*args), "MiB of host memory (parameters", "more than the 16.00 MiB this machine has")
    assert list(tmp_path.iterdir()) == []


def test_a_plan_on_fake_trials_the_host_cannot_confirm_stands_and_says_so(run_cli, monkeypatch, tmp_path):
    """Ranked by the card's predicted speed, a plan needs no real run: its answer is the fake trials', said so."""
    with_host_memory(monkeypatch, 16 * 2**20)
    monkeypatch.chdir(tmp_path)
    status, out, err = run_cli(
        "plan", "mlp:layers=2,width=1024,features=1024", "--device", "sim:256MiB", "--target-batch", "4"
    )
    assert status == 0, err
    said = " ".join((out + err).split())
    assert "the recommended candidate was not run for real" in said
    assert "more than the 16.00 MiB this machine has available" in said
    assert list(tmp_path.iterdir()) == []


def test_a_run_the_host_can_hold_is_not_refused(run_cli, monkeypatch):
    with_host_memory(monkeypatch, 2**30)
    status, _, err = run_cli("measure", TINY, "--device", "sim:64MiB", "--batch-size", "2")
    assert status == 0, err


# -- noise first (issue 21) -------------------------------------------------------------------

NOISY = """
import logging, warnings, torch, memfit

def make(fail):
    def batch(n):
        return (torch.randn(n, 8), torch.randint(0, 2, (n,)))
    def model():
        logging.getLogger("torch._subclasses.fake_tensor").warning("fake tensor raised: dozens of lines")
        warnings.warn("a two-line UserWarning", UserWarning)
        return torch.nn.Linear(8, 2, device="meta") if fail == "one line" else torch.nn.Linear(8, 2)
    def loss(m, b):
        if fail == "user":
            raise ValueError("the user's bug")
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])
    return memfit.Workload(model=model, make_batch=batch, loss=loss)

def one_line():
    return make("one line")

def user():
    return make("user")

def fine():
    return make("")
"""


@pytest.mark.parametrize("function", ["one_line", "user", "fine"])
def test_torch_logs_and_warnings_come_after_memfits_line(run_cli, tmp_path, function):
    (tmp_path / "noisy.py").write_text(NOISY)
    args = ["measure", f"{tmp_path / 'noisy.py'}:{function}", "--device", "sim:64MiB", "--batch-size", "2"]
    status, out, err = run_cli(*args)
    lines = err.strip().splitlines()
    if function == "one_line":  # a refusal: its line is the whole answer
        one_error_line(status, out, err, "meta device")
    elif function == "user":
        assert status == 1 and lines[0].startswith("memfit: error in "), err
        assert "Traceback" in err and err.index("Traceback") < err.index("fake tensor raised")
    else:  # results first (stdout), then what torch said
        assert status == 0 and out and "fake tensor raised" in err and "a two-line UserWarning" in err
    status, _, err = run_cli("--verbose", *args)  # --verbose: nothing held (pytest captures the live ones)
    assert "fake tensor raised" not in err and status == {"one_line": 2, "user": 1, "fine": 0}[function]
