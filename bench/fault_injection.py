"""Fault injection: every memfit command against bad input, interrupts and injected faults.

Each case runs one command line in a folder of its own and checks that it *held*:

- bad input: exit status 2, one line ``memfit: error: ...`` on stderr, nothing on stdout,
  no traceback, no output file and no temp file left;
- an exception of the user's own workload code: exit status 1, one line naming the
  workload function, then the user's traceback;
- an interrupt (SIGINT or SIGTERM at a random moment of the command): exit status 130 or
  143 and ``memfit: aborted``, no traceback, and every file left is whole (a PNG ends with
  its IEND chunk, a page with ``</html>``, a lock and JSON parse), no temp file;
- an injected fault memfit must survive (a run cut short by a crash, a workload that
  prints): the documented status and a result;
- distributed faults (a rank frozen or killed, two real gloo processes): the other rank
  ends within the collective timeout with one line naming the rank;
- no case may run past its time limit (a hang).

Cases run in forked children of one process that imported memfit, torch and transformers
once (``OMP_NUM_THREADS=1``, so no thread pool is forked), so two hundred of them take
minutes on two cores; the distributed ones run as real ``python -m memfit`` processes.

    .venv/bin/python bench/fault_injection.py              # every case; writes the "faults" section
    .venv/bin/python bench/fault_injection.py --quick      # the fast subset (tests/test_fault_injection.py)
    .venv/bin/python bench/fault_injection.py --only zoo --no-write --verbose
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: nothing to break in a forked child

import argparse
import contextlib
import errno
import json
import pickle
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
SOURCE = Path(__file__).resolve().parent.parent / "src"
if str(SOURCE) not in sys.path:
    sys.path.insert(0, str(SOURCE))

from _results import write_section

EXPECT = ("error", "user-code", "interrupt", "ok", "rank-error")
TINY = "mlp:layers=1,width=16,features=8"
GPT = "gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=16,vocab_size=128"
PNG_END = b"IEND\xaeB`\x82"
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Case:
    """One command line and what it must do."""

    group: str
    name: str
    argv: list[str]
    expect: str = "error"
    #: writes the case's input files into its folder
    setup: Callable[[Path], None] | None = None
    #: runs in the child before the command (monkeypatches: a fault to inject)
    inject: Callable[[], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: for interrupts: the signal and when, in seconds after the command starts
    signal: int | None = None
    delay: float = 0.0
    #: text the error line must contain
    message: str = ""
    timeout: float = 120.0
    quick: bool = False
    #: the error comes after the work (a disk that fails at the end): progress lines may precede it
    late: bool = False
    #: distributed: the ranks started (the first one is judged), and variables of one rank only
    ranks: tuple[int, ...] = (0, 1)
    rank_env: dict[int, dict[str, str]] = field(default_factory=dict)


@dataclass
class Outcome:
    case: Case
    held: bool
    status: int | None
    seconds: float
    why: str = ""
    note: str = ""


# -- files the cases read ------------------------------------------------------------------

HEADER = {"kind": "header", "format": 1, "device": "sim:1GiB", "capacity": 2**30, "window": 10}
STEP = {"kind": "step", "step": 0, "allocated": 10, "reserved": 20, "peak_allocated": 15, "labels": {}}


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)

    return setup


def _both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        for one in setups:
            one(folder)

    return setup


def _fifo(name: str) -> Callable[[Path], None]:
    return lambda folder: os.mkfifo(folder / name)


def _big(name: str, size: int) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        with open(folder / name, "wb") as handle:
            handle.truncate(size)  # sparse: no disk used

    return setup


def _run_lines(*records: dict | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _long_run(steps: int = 4000) -> str:
    """A monitored run with a leak: a big timeline to draw (the report takes a while)."""
    lines = [json.dumps(HEADER)]
    for i in range(steps):
        lines.append(
            json.dumps({**STEP, "step": i, "allocated": 10 + 512 * i, "reserved": 2**22 + 512 * i, "seconds": 0.01})
        )
    return "\n".join(lines) + "\n"


GOOD_RUN = _write("run.jsonl", _run_lines(HEADER, STEP, {**STEP, "step": 1}))

WORKLOAD = """
import os, time, torch, memfit

def make():
    return memfit.Workload(
        model=lambda: torch.nn.Linear(8, 2),
        make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
    )
"""


def _workload(body: str) -> Callable[[Path], None]:
    return _write("wl.py", "import os, time, torch, memfit\n" + body)


#: a lock memfit reads (micro 8 x 1 x 1 = target 8): the base of every damaged-lock case
LOCK = {
    "schema": '"memfit.lock"',
    "schema_version": "1",
    "workload": '{ ref = "mlp" }',
    "settings": "{ micro_batch_size = 8 }",
    "target": "{ batch_size = 8 }",
    "environment": '{ schema = "memfit.environment", schema_version = 1, python = "3.11.7", os = "Linux" }',
}


def _lock_text(**changes: str) -> str:
    return "".join(f"{key} = {value}\n" for key, value in {**LOCK, **changes}.items())


# -- the cases ----------------------------------------------------------------------------


def zoo_cases() -> list[Case]:
    refs = [
        ("gpt2:n_layer=abc", "n_layer must be a positive integer"),
        ("gpt2:n_layer=", "has no value"),
        ("gpt2:n_layer=-1", "positive integer"),
        ("gpt2:n_layer=0", "positive integer"),
        ("gpt2:n_layer=1.5", "positive integer"),
        ("gpt2:n_layer=[1]", "positive integer"),
        ("gpt2:n_layer=99999999999", "more than any machine can allocate"),
        ("gpt2:n_head=3,n_embd=128", "divisible"),
        ("gpt2:seq_len=0", "seq_len must be a positive integer"),
        ("gpt2:seq_len=abc", "seq_len must be a positive integer"),
        ("gpt2:seq_len=99999", "longer than the model's"),
        ("gpt2:vocab_size=0", "vocab_size must be a positive integer"),
        ("gpt2:n_positions=99999999999", "more than any machine can allocate"),
        ("gpt2:layer_norm_epsilon=abc", "must be a number"),
        ("gpt2:use_cache=3", "true or false"),
        ("gpt2:n_inner=abc", "refuses these options"),
        ("gpt2:depth=2", "unknown option 'depth'"),
        ("gpt2:layers=2,n_layer=3", "one option"),
        ("gpt2:n_layer=1,n_layer=2", "given twice"),
        ("gpt2:=3", "bad zoo option"),
        ("gpt2:n_layer", "bad zoo option"),
        ("bert-base:vocab_size=-5", "positive integer"),
        ("bert-base:heads=5", "not a multiple of the number of attention heads"),
        ("vit-base:image_size=0", "image_size must be a positive integer"),
        ("vit-base:patch_size=0", "positive integer"),
        ("llama-1b:heads=3", "refuses these options"),
        ("llama-7b:num_key_value_heads=0", "positive integer"),
        ("resnet50:depths=[0,1]", "depths must be a positive integer"),
        ("resnet50:depths=[]", "depths must be a positive integer"),
        ("resnet50:depths=[1,99999999999]", "more than any machine can allocate"),
        ("mlp:width=99999999999", "zoo workload 'mlp'"),
        ("mlp:width=abc", "positive integer"),
        ("mlp:width=0", "positive integer"),
        ("mlp:layers=true", "positive integer"),
        ("mlp:layers=1,layers=2", "given twice"),
        ("mlp:layers=99999999999", "more than any machine can allocate"),
        ("mlp:features=99999999999", "more than any machine can allocate"),
        ("mlp:classes=0", "positive integer"),
        ("mlp:depth=3", "unknown option 'depth'"),
        ("convnet:image_size=99999999", "one sample of its batch"),
        ("convnet:channels=-1", "positive integer"),
        ("gpt:layers=99999999999", "more than any machine can allocate"),
        ("gpt:heads=3,embd=128", "must be divisible by heads"),
        ("gpt:dropout=2", "probability"),
        ("lstm-lm:layers=99999999999", "more than any machine can allocate"),
        ("lstm-lm:hidden=0", "positive integer"),
        ("gtp2", "unknown workload 'gtp2'"),
        ("   ", "empty workload reference"),
    ]
    commands = [
        ["estimate", "--batch-size", "1"],
        ["measure", "--device", "sim:1GiB", "--batch-size", "1"],
        ["probe", "--device", "sim:1GiB"],
        ["plan", "--device", "sim:1GiB", "--target-batch", "8"],
        ["fit", "--device", "sim:1GiB", "--no-doctor"],
    ]
    cases = []
    for index, (ref, message) in enumerate(refs):
        command = commands[index % len(commands)]
        cases.append(
            Case(
                "zoo options",
                f"{command[0]} {ref!r}",
                [command[0], ref, *command[1:]],
                message=message,
                quick=index < 8,
            )
        )
    return cases


def workload_file_cases() -> list[Case]:
    measure = ["measure", "wl.py:make", "--device", "sim:64MiB", "--batch-size", "2"]
    loss_ok = "lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])"
    batch_ok = "lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,)))"

    def wl(model: str = "lambda: torch.nn.Linear(8, 2)", batch: str = batch_ok, loss: str = loss_ok) -> str:
        return f"def make():\n    return memfit.Workload(model={model}, make_batch={batch}, loss={loss})\n"

    return [
        Case(
            "workload files",
            "a syntax error",
            measure,
            setup=_write("wl.py", "def make(:\n"),
            message="invalid syntax",
            quick=True,
        ),
        Case("workload files", "null bytes", measure, setup=_write("wl.py", "x = 1\x00\n"), message="null bytes"),
        Case("workload files", "a binary file", measure, setup=_write("wl.py", b"\xff\xd8\xff\xe0\x00\x10JFIF")),
        Case(
            "workload files",
            "a missing import",
            measure,
            setup=_write("wl.py", "import torchvisionn\n"),
            message="imports torchvisionn",
            quick=True,
        ),
        Case(
            "workload files",
            "a bad relative import",
            measure,
            setup=_write("wl.py", "from . import sibling\n"),
            message="cannot be imported",
        ),
        Case("workload files", "an empty file", measure, setup=_write("wl.py", ""), message="function make not found"),
        Case(
            "workload files",
            "not a function",
            measure,
            setup=_write("wl.py", "make = 3\n"),
            message="is not a function",
        ),
        Case(
            "workload files",
            "a function with arguments",
            measure,
            setup=_write("wl.py", "def make(size):\n    pass\n"),
            message="must take no required arguments",
        ),
        Case(
            "workload files",
            "returns something else",
            measure,
            setup=_write("wl.py", "def make():\n    return 42\n"),
            message="returned int, not a memfit.Workload",
        ),
        Case(
            "workload files",
            "the model factory returns a tensor",
            measure,
            setup=_workload(wl(model="lambda: torch.ones(3)")),
            message="not an nn.Module",
        ),
        Case(
            "workload files",
            "the loss is a tensor of losses",
            measure,
            setup=_workload(wl(loss="lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction='none')")),
            message="not one number",
        ),
        Case(
            "workload files",
            "the loss is loss.item()",
            measure,
            setup=_workload(wl(loss="lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]).item()")),
            message="returned float, not a tensor",
        ),
        Case(
            "workload files",
            "the loss is detached",
            measure,
            setup=_workload(wl(loss="lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]).detach()")),
            message="does not depend on the model's parameters",
        ),
        Case(
            "workload files",
            "a folder",
            ["measure", "dir.py:make", "--device", "sim:64MiB", "--batch-size", "1"],
            setup=lambda f: (f / "dir.py").mkdir(),
            message="not found",
        ),
        Case(
            "workload files",
            "no such file",
            ["measure", "nowhere.py:make", "--batch-size", "1"],
            message="file nowhere.py not found",
        ),
        Case(
            "workload files",
            "no function named",
            ["measure", "wl.py", "--batch-size", "1"],
            setup=_write("wl.py", WORKLOAD),
            message="name the function",
        ),
        Case(
            "workload files",
            "no such module",
            ["measure", "no_such_package_x:make", "--batch-size", "1"],
            message="module no_such_package_x not found",
        ),
        Case(
            "workload files",
            "module function needs arguments",
            ["measure", "json:dumps", "--batch-size", "1"],
            message="must take no required arguments",
        ),
        Case(
            "workload files",
            "a bug in the user's loss",
            measure,
            expect="user-code",
            setup=_workload(wl(loss="lambda m, b: m(b[0][:, :3]).sum()")),
            message="a lambda (wl.py, line 3) of the workload wl.py:make",
            quick=True,
        ),
        Case(
            "workload files",
            "a bug in the user's make_batch",
            measure,
            expect="user-code",
            setup=_workload(wl(batch="lambda n: {}['missing']")),
            message="of the workload wl.py:make",
        ),
        Case(
            "workload files",
            "a bug in the model factory",
            measure,
            expect="user-code",
            setup=_workload(wl(model="lambda: torch.nn.Linear(8)")),
            message="a lambda (wl.py, line 3) of the workload wl.py:make",
        ),
        Case(
            "workload files",
            "the workload function raises",
            measure,
            expect="user-code",
            setup=_workload("def make():\n    raise KeyError('config')\n"),
            message="make (wl.py, line 3) of the workload wl.py:make",
        ),
        Case(
            "workload files",
            "the file's top level raises",
            measure,
            expect="user-code",
            setup=_write("wl.py", "raise RuntimeError('no data dir')\n"),
            message="the top level (wl.py, line 1) of the workload wl.py:make",
        ),
        Case(
            "workload files",
            "make_batch runs out of host memory",
            measure,
            expect="user-code",
            setup=_workload(wl(batch="lambda n: (_ for _ in ()).throw(MemoryError())")),
            message="of the workload wl.py:make",
        ),
    ]


def input_file_cases() -> list[Case]:
    inputs = {
        "binary": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00",
        "latin-1": b'{"schema": "caf\xe9"}',
        "deep array": b"[" * 100_000 + b"]" * 100_000,
        "deep object": b'{"a":' * 300 + b"1" + b"}" * 300,
        "nested 100": b"[" * 100 + b"]" * 100,
        "null": b"null",
        "a list": b"[1, 2, 3]",
        "a string": b'"memfit"',
        "empty": b"",
        "not JSON": b"{schema: memfit}",
        "utf-16": '{"schema": "memfit.environment"}'.encode("utf-16"),
    }
    cases = []
    for index, (name, data) in enumerate(inputs.items()):
        cases.append(
            Case(
                "input files",
                f"env check: {name}",
                ["env", "check", "in.json"],
                setup=_write("in.json", data),
                quick=index < 3,
            )
        )
        cases.append(Case("input files", f"report: {name}", ["report", "in.jsonl"], setup=_write("in.jsonl", data)))
    env_foreign = [
        ("a conda file", '{"name": "train", "dependencies": []}', "not a memfit environment fingerprint"),
        ("a newer schema", '{"schema": "memfit.environment", "schema_version": 9}', "schema_version 9"),
        (
            "gpus not a list",
            '{"schema": "memfit.environment", "schema_version": 1, "python": "3", "os": "x", "gpus": 5}',
            "damaged",
        ),
    ]
    for name, text, message in env_foreign:
        cases.append(
            Case(
                "input files",
                f"env check: {name}",
                ["env", "check", "in.json"],
                setup=_write("in.json", text),
                message=message,
            )
        )
    specials = [
        ("a folder", lambda f: (f / "in.json").mkdir(), "is a folder"),
        ("a pipe", _fifo("in.json"), "not a regular file"),
        ("a 100 MiB file", _big("in.json", 100 * 2**20), "more than a memfit file ever is"),
        ("missing", None, "does not exist"),
    ]
    for name, setup, message in specials:
        cases.append(
            Case(
                "input files",
                f"env check: {name}",
                ["env", "check", "in.json"],
                setup=setup,
                message=message if name != "missing" else "",
            )
        )
    runs = [
        ("a step first", _run_lines(STEP), "first line is not its header"),
        ("reserved is text", _run_lines(HEADER, {**STEP, "reserved": "lots"}, STEP), "reserved must be a whole number"),
        ("labels is a list", _run_lines(HEADER, {**STEP, "labels": [1]}, STEP), "labels must be an object"),
        ("window 1", _run_lines({**HEADER, "window": 1}, STEP), "window must be"),
        ("capacity text", _run_lines({**HEADER, "capacity": "big"}, STEP), "capacity must be"),
        ("a bad middle line", _run_lines(HEADER, "{oops", STEP), "not JSON"),
        (
            "a deep label",
            _run_lines(HEADER, {**STEP, "labels": {"x": json.loads("[" * 80 + "]" * 80)}}),
            "nested too deeply",
        ),
    ]
    for name, text, message in runs:
        cases.append(
            Case(
                "input files",
                f"report: {name}",
                ["report", "run.jsonl"],
                setup=_write("run.jsonl", text),
                message=message,
            )
        )
    results = [
        (
            "--plan",
            "a probe result",
            {"max_batch_size": 4, "recommended_batch_size": 4, "trials": []},
            "not a `memfit plan --json` result",
        ),
        ("--probe", "a plan result", {"workload": "mlp", "candidates": []}, "not a `memfit probe --json` result"),
        (
            "--estimate",
            "a probe result",
            {"max_batch_size": 4, "recommended_batch_size": 4, "trials": []},
            "not a `memfit estimate --json`",
        ),
        ("--plan", "a bad candidate", {"workload": "mlp", "candidates": [{"peak_reserved": "big"}]}, "candidates[0]"),
        (
            "--probe",
            "a bad trial",
            {"max_batch_size": 4, "recommended_batch_size": 4, "trials": [{"batch_size": "4"}]},
            "trials[0]",
        ),
        ("--probe", "a list", [1, 2], "must be a JSON object"),
        ("--estimate", "binary", None, "binary file"),
        ("--plan", "deep", "deep", "nested too deeply"),
    ]
    for option, name, content, message in results:
        data: bytes | str = (
            b"\x00\x01\x02"
            if content is None
            else b"[" * 5000 + b"]" * 5000
            if content == "deep"
            else json.dumps(content)
        )
        cases.append(
            Case(
                "input files",
                f"report {option}: {name}",
                ["report", "run.jsonl", option, "result.json"],
                setup=_both(GOOD_RUN, _write("result.json", data)),
                message=message,
                quick=option == "--plan" and name == "a probe result",
            )
        )
    locks = [
        ("binary", b"\x00\x01binary", "not a valid memfit.lock"),
        ("not TOML", "schema = [unclosed", "not a valid memfit.lock"),
        ("deep TOML", "a = " + "[" * 5000 + "]" * 5000, "not a valid memfit.lock"),
        ("foreign TOML", 'name = "project"\n', "is not a memfit.lock"),
        ("newer schema", _lock_text(schema_version="99"), "schema_version 99"),
        ("damaged settings", _lock_text(settings='{ micro_batch_size = "eight" }'), "damaged"),
        ("no environment", _lock_text(environment="{}"), "damaged"),
        ("a folder", None, "is a directory"),
        ("missing", "", "not found"),
    ]
    for name, text, message in locks:
        if name == "a folder":
            setup = lambda f: (f / "memfit.lock").mkdir()  # noqa: E731
        elif name == "missing":
            setup = None
        else:
            setup = _write("memfit.lock", text)
        cases.append(Case("input files", f"check: {name}", ["check", "memfit.lock"], setup=setup, message=message))
    return cases


def output_path_cases() -> list[Case]:
    def folders(folder: Path) -> None:
        (folder / "a-folder").mkdir()
        (folder / "a-folder.png").mkdir()
        (folder / "a-folder.html").mkdir()

    blocked = _both(_write("a-file", "x"), folders, _fifo("a-pipe.png"), _fifo("a-pipe.html"))
    targets = {
        "under a file": "a-file/out.png",
        "a folder": "a-folder",
        "a pipe": "a-pipe.png",
        "in /proc": "/proc/memfit-fault-injection.png",
    }
    cases = []
    for where, target in targets.items():
        cases.append(
            Case(
                "output paths",
                f"probe --plot {where}",
                [
                    "probe",
                    TINY,
                    "--device",
                    "sim:64MiB",
                    "--plot",
                    target if target.endswith(".png") else target + ".png",
                ],
                setup=blocked,
                quick=where == "under a file",
            )
        )
        cases.append(
            Case(
                "output paths",
                f"plan --plot {where}",
                ["plan", TINY, "--device", "sim:64MiB", "--target-batch", "8", "--plot", target],
                setup=blocked,
            )
        )
        cases.append(
            Case(
                "output paths",
                f"fit --lock {where}",
                ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--lock", target],
                setup=blocked,
            )
        )
        cases.append(
            Case(
                "output paths",
                f"report -o {where}",
                ["report", "run.jsonl", "-o", target.replace(".png", ".html")],
                setup=_both(blocked, GOOD_RUN),
            )
        )
    for where, target in {
        "a file": "a-file",
        "under a file": "a-file/deeper",
        "in /proc": "/proc/memfit-fault",
    }.items():
        cases.append(
            Case(
                "output paths",
                f"fit --report-dir {where}",
                ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--report-dir", target],
                setup=blocked,
            )
        )
        cases.append(Case("output paths", f"env export -o {where}", ["env", "export", "-o", target], setup=blocked))
    cases.append(
        Case(
            "output paths", "probe --plot not a .png", ["probe", TINY, "--plot", "plot.pdf"], message="must end in .png"
        )
    )
    return cases


def option_cases() -> list[Case]:
    m = ["measure", TINY]
    table = [
        ([*m, "--batch-size", "0"], "--batch-size"),
        ([*m, "--batch-size", "-3"], "--batch-size"),
        ([*m, "--batch-size", "many"], "--batch-size"),
        ([*m, "--batch-size", "4", "--steps", "0"], "--steps"),
        ([*m, "--batch-size", "4", "--device", "tpu"], "unknown device 'tpu'"),
        ([*m, "--batch-size", "4", "--device", "sim:0"], ""),
        ([*m, "--batch-size", "4", "--device", "sim:-1GiB"], ""),
        ([*m, "--batch-size", "4", "--device", "sim:8GiG"], "invalid size '8GiG'"),
        ([*m, "--batch-size", "4", "--device", "sim:"], ""),
        ([*m, "--batch-size", "4", "--device", "sim:1e400GiB"], ""),
        ([*m, "--batch-size", "4", "--device", "cuda:99"], ""),
        ([*m, "--batch-size", "4", "--device", "sim:1GiB", "--memory", "lots"], "invalid size 'lots'"),
        ([*m, "--batch-size", "4", "--precision", "fp8"], "fp8"),
        ([*m, "--batch-size", "4", "--checkpointing", "everything"], "everything"),
        (["probe", TINY, "--headroom", "1.5"], "--headroom"),
        (["probe", TINY, "--headroom", "nan"], "headroom"),
        (["probe", TINY, "--multiple-of", "0"], "--multiple-of"),
        (["probe", TINY, "--max-batch-size", "0"], "--max-batch-size"),
        (["probe", TINY, "--guess", "-1"], "--guess"),
        (["plan", TINY, "--target-batch", "0"], "--target-batch"),
        (["plan", TINY, "--target-batch", "8", "--world-size", "0"], "--world-size"),
        (["plan", TINY, "--target-batch", "8", "--reference-batch", "0"], "--reference-batch"),
        (["estimate", TINY, "--shard", "zero9"], "zero9"),
        (["estimate", TINY, "--gpu", "Voodoo 5 6000"], ""),
        (["probe", TINY, "--gpu", "Voodoo 5 6000"], "Voodoo 5 6000"),
        (["plan", TINY, "--target-batch", "8", "--gpu", "Voodoo 5 6000"], "Voodoo 5 6000"),
        (["estimate", TINY, "--fixed-costs", "lots"], "invalid size 'lots'"),
        (["estimate", TINY, "--memory", "-5GiB"], ""),
        (["doctor", "--workers", "-1"], "--workers"),
        (["doctor", "--batch-bytes", "lots"], "invalid size 'lots'"),
        (["doctor", "--prefetch-factor", "0"], "--prefetch-factor"),
        (["fit", TINY, "--headroom", "-0.5"], "--headroom"),
        (["nosuchcommand"], "No such command"),
        (["measure", TINY, "--no-such-option"], "No such option"),
        (["report"], "Missing argument"),
        (["report", "nowhere.jsonl"], "does not exist"),
        (["env", "frobnicate"], "No such command"),
    ]
    cases = [
        Case("options", " ".join(argv), argv, message=message, quick=index % 8 == 0)
        for index, (argv, message) in enumerate(table)
    ]
    torchrun = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    cases.append(
        Case(
            "options",
            "MEMFIT_COLLECTIVE_TIMEOUT=soon under torchrun",
            ["probe", TINY, "--device", "sim:64MiB"],
            env={**torchrun, "MEMFIT_COLLECTIVE_TIMEOUT": "soon"},
            message="MEMFIT_COLLECTIVE_TIMEOUT='soon'",
        )
    )
    cases.append(
        Case(
            "options",
            "MEMFIT_COLLECTIVE_TIMEOUT=-1 under torchrun",
            ["probe", TINY, "--device", "sim:64MiB"],
            env={**torchrun, "MEMFIT_COLLECTIVE_TIMEOUT": "-1"},
            message="must be a number of seconds from 1",
        )
    )
    return cases


def _fail_os(function: str, code: int) -> Callable[[], None]:
    """Make ``os.<function>`` fail with ``code`` inside memfit's writer (a full disk, a lost disk)."""

    def inject() -> None:
        from memfit import _io

        def failing(*_args: object, **_kwargs: object) -> None:
            raise OSError(code, os.strerror(code))

        class FailingOs:
            def __getattr__(self, name: str) -> object:
                return failing if name == function else getattr(os, name)

        _io.os = FailingOs()  # type: ignore[assignment]

    return inject


def fault_cases() -> list[Case]:
    run = _write("run.jsonl", _long_run(200))
    cases = [
        Case(
            "injected faults",
            f"report: {name} during the write",
            ["report", "run.jsonl"],
            setup=run,
            inject=_fail_os(function, code),
            message=text,
            quick=function == "fsync",
        )
        for name, function, code, text in [
            ("a full disk", "fsync", errno.ENOSPC, "No space left on device"),
            ("an I/O error", "replace", errno.EIO, "Input/output error"),
            ("a read-only disk", "fchmod", errno.EROFS, "Read-only file system"),
        ]
    ]
    cases += [
        Case(
            "injected faults",
            "env export: a full disk",
            ["env", "export", "-o", "env"],
            inject=_fail_os("fsync", errno.ENOSPC),
            message="No space left on device",
        ),
        Case(
            "injected faults",
            "fit: a full disk for the lock",
            ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--max-batch-size", "4"],
            inject=_fail_os("fsync", errno.ENOSPC),
            message="No space left on device",
            late=True,
        ),
        Case(
            "injected faults",
            "report: a run cut short by a crash",
            ["report", "run.jsonl", "--json"],
            setup=_write("run.jsonl", _run_lines(HEADER, STEP) + '{"kind": "step", "st'),
            expect="ok",
        ),
        Case(
            "injected faults",
            "measure --json: a workload that prints",
            ["measure", "wl.py:make", "--device", "sim:64MiB", "--batch-size", "2", "--json"],
            setup=_write("wl.py", "print('hello from the workload')\n" + WORKLOAD),
            expect="ok",
            quick=True,
        ),
        Case(
            "injected faults",
            "check: a lock whose environment differs",
            ["check", "memfit.lock"],
            setup=_write("memfit.lock", _lock_text()),
            expect="ok",
        ),
    ]
    return cases


def interrupt_cases(seed: int) -> list[Case]:
    chance = random.Random(seed)
    commands = {
        "report": (["report", "run.jsonl", "-o", "out/report.html"], _write("run.jsonl", _long_run()), 3.0),
        "probe --plot": (["probe", TINY, "--device", "sim:8MiB", "--no-estimate", "--plot", "probe.png"], None, 3.0),
        "fit": (["fit", TINY, "--device", "sim:8MiB", "--no-doctor", "--max-batch-size", "16"], None, 6.0),
        "plan --plot": (
            ["plan", TINY, "--device", "sim:8MiB", "--target-batch", "32", "--plot", "plan.png"],
            None,
            4.0,
        ),
        "env export": (["env", "export", "-o", "env"], None, 2.0),
        "estimate": (["estimate", GPT, "--device", "sim:64MiB"], None, 3.0),
        "measure": (
            [
                "measure",
                "mlp:layers=4,width=512,features=512",
                "--device",
                "sim:1GiB",
                "--batch-size",
                "64",
                "--steps",
                "40",
            ],
            None,
            1.5,
        ),
        "doctor": (["doctor"], None, 2.0),
        "check": (["check", "memfit.lock"], _write("memfit.lock", _lock_text()), 1.0),
    }
    cases = []
    for name, (argv, setup, span) in commands.items():
        for sig in (signal.SIGINT, signal.SIGTERM):
            for moment in range(3 if name in ("report", "fit", "probe --plot", "plan --plot") else 1):
                delay = round(chance.uniform(0.05, span), 3)
                cases.append(
                    Case(
                        "interrupts",
                        f"{name}: {signal.Signals(sig).name} after {delay} s",
                        argv,
                        expect="interrupt",
                        setup=setup,
                        signal=sig,
                        delay=delay,
                        quick=name == "report" and moment == 0,
                    )
                )
    return cases


def distributed_cases() -> list[Case]:
    body = (
        "def make():\n"
        "    def make_batch(n):\n"
        "        if os.environ['RANK'] == '1':\n"
        "            if os.environ['FAULT'] == 'freeze':\n"
        "                time.sleep(3600)\n"
        "            os.kill(os.getpid(), 9)\n"
        "        return torch.randn(n, 8), torch.randint(0, 2, (n,))\n"
        "    return memfit.Workload(model=lambda: torch.nn.Linear(8, 2), make_batch=make_batch,\n"
        "        loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))\n"
    )
    probe = ["probe", "wl.py:make", "--device", "sim:64MiB", "--no-estimate", "--max-batch-size", "4"]
    fit = ["fit", "wl.py:make", "--device", "sim:64MiB", "--no-doctor", "--max-batch-size", "4"]
    return [
        Case(
            "distributed",
            f"{argv[0]}: rank 1 {fault}",
            argv,
            expect="rank-error",
            setup=_workload(body),
            env={"FAULT": fault},
            message=message,
            timeout=90,
        )
        for argv in (probe, fit)
        for fault, message in (
            ("freeze", "rank 1 did not answer within 3 s"),
            ("kill", "rank 1 did not answer at memfit's agreement: its process ended"),
        )
    ]


def all_cases(seed: int) -> list[Case]:
    from hostile_cases import hostile_cases  # issue 21's classes; it imports this module's helpers

    return (
        zoo_cases()
        + workload_file_cases()
        + input_file_cases()
        + output_path_cases()
        + option_cases()
        + fault_cases()
        + interrupt_cases(seed)
        + distributed_cases()
        + hostile_cases(seed)
    )


# -- running a case -----------------------------------------------------------------------


def _child(case: Case, folder: Path) -> None:
    """In the forked child: run the command as the ``memfit`` entry point would, then exit."""
    from memfit.cli import aborted, ignore_signals, main
    from memfit.errors import Terminated, install_handlers

    status = 1
    try:
        install_handlers()  # signals are still blocked (run_forked): the process is at run()'s first line
        os.chdir(folder)
        os.environ.update(case.env)
        out = os.open(folder.parent / f"{folder.name}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(folder.parent / f"{folder.name}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        if case.inject is not None:
            case.inject()
        try:  # as run() runs the command: final, so a later signal cannot change the outcome
            signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)  # one that came meanwhile lands here
            status = main(case.argv, final=True)
        except (KeyboardInterrupt, Terminated) as interrupted:
            ignore_signals()
            status = aborted(type(interrupted))
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: a traceback, exit status 1
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _left_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_fifo())


def _whole(path: Path) -> str | None:
    """Why ``path`` is not a whole file memfit writes (None: it is whole)."""
    if path.is_fifo():
        return None
    data = path.read_bytes()
    if path.suffix == ".png" and not data.endswith(PNG_END):
        return f"{path.name}: a PNG without its end"
    # torch's memory viewer page (report-memory-viz.html, torch's own generator) ends at </body>
    if path.suffix == ".html" and not data.rstrip().endswith((b"</html>", b"</body>")):
        return f"{path.name}: a page without its end"
    if path.suffix == ".pickle":
        try:
            pickle.loads(data)  # memfit's own snapshot, written by the case just run
        except Exception:  # noqa: BLE001 - any failure to read it back means it is cut
            return f"{path.name}: a pickle that does not load"
    if path.suffix == ".json":
        try:
            json.loads(data)
        except ValueError:
            return f"{path.name}: not whole JSON"
    if path.suffix == ".lock":
        from memfit.search.lock import load_lock

        try:
            load_lock(path)
        except Exception as error:  # noqa: BLE001 - any failure to read it back means it is not whole
            return f"{path.name}: {error}"
    return None


def _judge(
    case: Case, status: int | None, out: str, err: str, before: set[Path], folder: Path
) -> tuple[bool, str, str]:
    """(held, why not, a note) for a finished case."""
    left = [p for p in _left_files(folder) if p not in before]
    temps = [p.name for p in _left_files(folder) if p.name.endswith(".tmp") or p.name.startswith(".")]
    if temps:
        return False, f"temp files left: {temps}", ""
    lines = err.strip().splitlines()
    if case.expect == "error":
        if status != 2:
            return False, f"exit status {status}, not 2", ""
        if out:
            return False, "stdout not empty", ""
        if case.late:  # progress lines first, then the one error line
            lines = [line for line in lines if line.startswith("memfit: error")] if lines[-1:] else lines
        if len(lines) != 1 or not lines[0].startswith("memfit: error: ") or "Traceback" in err:
            return False, f"not one error line: {lines[:3]}", ""
        if case.late and not err.rstrip().endswith(lines[0]):
            return False, "the error line is not the last", ""
        if case.message and case.message not in lines[0]:
            return False, f"line lacks {case.message!r}: {lines[0]}", ""
        if left:
            return False, f"files written: {[p.name for p in left]}", ""
        return True, "", ""
    if case.expect == "user-code":
        if status != 1 or not lines or not lines[0].startswith("memfit: error in ") or "Traceback" not in err:
            return False, f"status {status}; {lines[:2]}", ""
        if case.message and case.message not in lines[0]:
            return False, f"line lacks {case.message!r}: {lines[0]}", ""
        return True, "", ""
    if case.expect == "ok":
        if status not in (0, 1) or "Traceback" in err:
            return False, f"status {status}; {lines[-3:]}", ""
        if case.message and case.message not in " ".join((out + err).split()):
            return False, f"output lacks {case.message!r}", ""
        if "--json" in case.argv:
            try:
                json.loads(out, parse_constant=_no_constant)  # strict: no bare NaN or Infinity
            except ValueError:
                return False, "stdout is not strict JSON alone", ""
        broken = [why for p in left if (why := _whole(p))]
        return (not broken), "; ".join(broken), ""
    if case.expect == "interrupt":
        broken = [why for p in left if (why := _whole(p))]
        if broken:
            return False, "; ".join(broken), ""
        if "Traceback" in err:
            return False, f"a traceback: {lines[-1:]}", ""
        if status in (130, 143):
            expected_line = "memfit: aborted" if status == 130 else "memfit: aborted (SIGTERM)"
            if not lines or lines[-1] != expected_line or (status == 130) != (case.signal == signal.SIGINT):
                return False, f"status {status} with {lines[-1:]}", ""
            return True, "", "interrupted"
        if status in (0, 1):
            return True, "", "finished before the signal"
        return False, f"exit status {status}", ""
    if case.expect == "rank-error":  # progress lines (fit's) may come first; the error line ends it
        errors = [line for line in lines if line.startswith("memfit: error")]
        if status != 2 or len(errors) != 1 or lines[-1] != errors[0] or "Traceback" in err:
            return False, f"status {status}: {lines[-3:]}", ""
        if case.message not in errors[0]:
            return False, f"line lacks {case.message!r}: {errors[0]}", ""
        return True, "", ""
    return False, f"unknown expectation {case.expect}", ""


def _no_constant(text: str) -> None:
    raise ValueError(f"bare {text} in the JSON")


def run_forked(case: Case, folder: Path) -> Outcome:
    folder.mkdir(parents=True)
    if case.setup is not None:
        case.setup(folder)
    before = set(_left_files(folder))
    started = time.monotonic()
    # the child starts with SIGINT and SIGTERM blocked and unblocks them once it has the handlers
    # of the `memfit` command (memfit.__main__.install_handlers): a signal 1 ms after the fork is
    # then the command's, as it is for a process that has reached run()'s first line
    signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child(case, folder)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)
    status: int | None = None
    signalled = False
    while True:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(code)
            break
        elapsed = time.monotonic() - started
        if case.signal is not None and not signalled and elapsed >= case.delay:
            os.kill(pid, case.signal)
            signalled = True
        if elapsed > case.timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return Outcome(case, False, None, elapsed, f"no end after {case.timeout:g} s (a hang)")
        time.sleep(0.01)
    seconds = time.monotonic() - started
    out = (folder.parent / f"{folder.name}.out").read_text(errors="replace")
    err = (folder.parent / f"{folder.name}.err").read_text(errors="replace")
    held, why, note = _judge(case, status, out, err, before, folder)
    return Outcome(case, held, status, seconds, why, note)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_ranks(case: Case, folder: Path) -> Outcome:
    """Two real ``python -m memfit`` processes joined by gloo; rank 0 must end with one line."""
    folder.mkdir(parents=True)
    if case.setup is not None:
        case.setup(folder)
    port = _free_port()
    processes = []
    started = time.monotonic()
    for rank in case.ranks:
        env = {
            **os.environ,
            **case.env,
            **case.rank_env.get(rank, {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **(
                {} if "MEMFIT_COLLECTIVE_TIMEOUT" in case.rank_env.get(rank, {}) else {"MEMFIT_COLLECTIVE_TIMEOUT": "3"}
            ),
            "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")]),
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "memfit", *case.argv],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out, err = processes[0].communicate(timeout=case.timeout)
        status: int | None = processes[0].returncode
    except subprocess.TimeoutExpired:
        return Outcome(
            case, False, None, time.monotonic() - started, f"rank 0 no end after {case.timeout:g} s (a hang)"
        )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    seconds = time.monotonic() - started
    held, why, note = _judge(case, status, out, err, set(), folder)
    return Outcome(case, held, status, seconds, why, note)


def run_all(cases: list[Case], verbose: bool) -> list[Outcome]:
    # import what the commands need once, in the parent, so each forked child starts warm
    import memfit.cli
    import memfit.search.lock

    for name in memfit.cli.COMMANDS:
        memfit.cli.cli.get_command(None, name)  # type: ignore[arg-type]
    from memfit.workload import load_workload
    from memfit.workload.zoo import TINY as TINY_ZOO

    for reference in TINY_ZOO.values():  # the transformers model classes are imported lazily
        with contextlib.suppress(Exception):  # transformers missing: its cases will say so
            load_workload(reference)
    root = Path(tempfile.mkdtemp(prefix="memfit-faults-"))
    outcomes = []
    try:
        for index, case in enumerate(cases):
            folder = root / f"case-{index:03d}"
            runner = run_two_ranks if case.group == "distributed" else run_forked
            outcome = runner(case, folder)
            outcomes.append(outcome)
            if verbose or not outcome.held:
                mark = "held" if outcome.held else "FAILED"
                detail = f" ({outcome.note})" if outcome.note else ""
                reason = f": {outcome.why}" if outcome.why else ""
                print(f"{mark:6} {case.group:16} {case.name}{detail} [{outcome.seconds:.1f} s]{reason}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return outcomes


# -- the report -----------------------------------------------------------------------------


def summary_table(outcomes: list[Outcome]) -> str:
    groups: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        groups.setdefault(outcome.case.group, []).append(outcome)
    rows = ["| group | cases | held | what must hold |", "| --- | ---: | ---: | --- |"]
    rules = {
        "zoo options": "one `memfit: error:` line, exit 2, before any model is built",
        "workload files": "one line, exit 2; the user's own exception: a line naming the function, then its traceback (exit 1)",
        "input files": "one line, exit 2 (binary, nested, foreign, a folder, a pipe, too large)",
        "output paths": "one line, exit 2, before any trial; nothing written",
        "options": "one line, exit 2",
        "injected faults": "a failing disk: one line, exit 2, no temp file; crash remains and prints: a result",
        "interrupts": "exit 130 / 143 and `memfit: aborted`, no traceback, every file left whole, no temp file",
        "distributed": "the waiting rank ends within the timeout (3 s) with one line naming the missing rank or the address",
        "hostile files": "every damaged field of a lock, environment.json, run or result: one line naming the field, exit 2",
        "user code": "sys.exit, os.chdir, default dtype, deterministic flag in the model, make_batch or loss: one line, exit 2, state restored, nothing written",
        "environment": "torchrun variables, timeouts, an ASCII terminal, a 4400-character allocator setting, a meta model",
        "host memory": "real steps the host cannot hold (a small MemAvailable through the seam): one line before the model is built; a plan on fake trials goes on and says it was not confirmed for real",
    }
    for group, members in groups.items():
        held = sum(o.held for o in members)
        rows.append(f"| {group} | {len(members)} | {held} | {rules.get(group, '')} |")
    total = len(outcomes)
    rows.append(f"| **all** | **{total}** | **{sum(o.held for o in outcomes)}** | no hang past a case's time limit |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the fast subset (the tests run it)")
    parser.add_argument("--only", default=None, help="only the cases of groups whose name contains this")
    parser.add_argument("--seed", type=int, default=14, help="seed of the interrupt moments")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--verbose", action="store_true", help="one line per case, not only failures")
    args = parser.parse_args()
    cases = all_cases(args.seed)
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.only:
        cases = [c for c in cases if args.only in c.group]
    started = time.monotonic()
    outcomes = run_all(cases, args.verbose)
    minutes = (time.monotonic() - started) / 60
    held = sum(o.held for o in outcomes)
    notes = Counter(o.note for o in outcomes if o.note)
    print(summary_table(outcomes))
    print(f"held: {held} of {len(outcomes)} in {minutes:.1f} min; interrupts: {dict(notes)}")
    if not args.no_write and not args.quick and not args.only:
        import torch

        command = "OMP_NUM_THREADS=1 .venv/bin/python bench/fault_injection.py"
        text = (
            "## Fault injection: every command against bad input, interrupts and faults\n\n"
            f"`{command}` (seed {args.seed}) drove every command (doctor, env export/check, estimate, "
            "measure, probe, plan, fit, check, report) through "
            f"{len(outcomes)} cases: bad input, SIGINT/SIGTERM at random moments, injected faults "
            "(a disk that fails during a write), a rank frozen or killed under two gloo "
            "processes, and issue 21's classes (bench/hostile_cases.py): every damaged field of "
            "each file memfit reads, output paths past the OS limits or blocked, user code that "
            "exits or changes the process, torchrun variables, an ASCII terminal, the host's "
            "memory through the system seam, ranks that never join. "
            f"**{held} of {len(outcomes)} held.**\n\n"
            f"{summary_table(outcomes)}\n\n"
            f"Interrupts: {notes.get('interrupted', 0)} interrupted mid-command, "
            f"{notes.get('finished before the signal', 0)} finished before their signal arrived "
            "(their files checked all the same); moments from 0 ms after the start (the fork) on, "
            f"{sum(o.case.group == 'interrupts' and o.case.argv[0] == 'estimate' for o in outcomes)} of them "
            "in `estimate`, whose fake steps run in Python that torch's C++ calls back. Cases ran in "
            "forked children of one warm process, each started as the `memfit` command is once its first "
            "line has run: SIGINT and SIGTERM blocked across the fork until `errors.install_handlers` "
            "ran (what comes before that line in a real process: docs/design.md, Signals) "
            f"({minutes:.1f} min on {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}); the distributed ones as real `python -m memfit` ranks.\n"
        )
        write_section("faults", text)
        print("wrote the faults section of docs/benchmarks.md")
    return 0 if held == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
