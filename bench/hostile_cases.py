"""The cases of issue 21 for bench/fault_injection.py: hostile file contents, output paths,
user code that exits or changes the process, environment variables, the host's memory,
ranks that never join, and more interrupt moments.

Imported by ``fault_injection.all_cases`` (which defines :class:`Case` and the helpers).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from fault_injection import GPT, HEADER, STEP, TINY, Case, _both, _lock_text, _run_lines, _workload, _write

ENV = 'schema = "memfit.environment", schema_version = 1, os = "Linux"'
FINGERPRINT = {"schema": "memfit.environment", "schema_version": 1, "python": "3.11.7", "os": "Linux"}


def _gpu(memory: str) -> str:
    return f'{{ {ENV}, python = "3", gpus = [{{ name = "A100", memory = {memory}, capability = "8.0" }}] }}'


#: (what, the lock's changed fields, the field the line must name)
DAMAGED_LOCKS: list[tuple[str, dict[str, str], str]] = [
    ("micro-batch 8.5", {"settings": "{ micro_batch_size = 8.5 }"}, "settings.micro_batch_size"),
    ("micro-batch true", {"settings": "{ micro_batch_size = true }"}, "settings.micro_batch_size"),
    ("micro-batch inf", {"settings": "{ micro_batch_size = inf }"}, "settings.micro_batch_size"),
    ("micro-batch nan", {"settings": "{ micro_batch_size = nan }"}, "settings.micro_batch_size"),
    ("micro-batch -inf", {"settings": "{ micro_batch_size = -inf }"}, "settings.micro_batch_size"),
    ("micro-batch 0", {"settings": "{ micro_batch_size = 0 }"}, "settings.micro_batch_size"),
    ("micro-batch -8", {"settings": "{ micro_batch_size = -8 }"}, "settings.micro_batch_size"),
    ("micro-batch text", {"settings": '{ micro_batch_size = "8" }'}, "settings.micro_batch_size"),
    ("micro-batch a list", {"settings": "{ micro_batch_size = [8] }"}, "settings.micro_batch_size"),
    ("micro-batch 2**40", {"settings": f"{{ micro_batch_size = {2**40} }}"}, "settings.micro_batch_size"),
    ("micro-batch missing", {"settings": "{ precision = 'fp32' }"}, "settings.micro_batch_size is missing"),
    ("accumulation 1e308", {"settings": "{ micro_batch_size = 8, accumulation_steps = 1e308 }"}, "accumulation"),
    ("accumulation 0", {"settings": "{ micro_batch_size = 8, accumulation_steps = 0 }"}, "accumulation"),
    ("accumulation true", {"settings": "{ micro_batch_size = 8, accumulation_steps = true }"}, "accumulation"),
    (
        "accumulation 10**20",
        {"settings": "{ micro_batch_size = 8, accumulation_steps = 100000000000000000000 }"},
        "accumulation",
    ),
    ("world size 0", {"settings": "{ micro_batch_size = 8, world_size = 0 }"}, "settings.world_size"),
    ("world size 1.5", {"settings": "{ micro_batch_size = 8, world_size = 1.5 }"}, "settings.world_size"),
    ("shard unknown", {"settings": '{ micro_batch_size = 8, shard = "everything" }'}, "settings.shard"),
    ("shard group 0", {"settings": "{ micro_batch_size = 8, shard_group_size = 0 }"}, "settings.shard_group_size"),
    ("precision fp8", {"settings": '{ micro_batch_size = 8, precision = "fp8" }'}, "settings.precision"),
    ("checkpointing 3", {"settings": "{ micro_batch_size = 8, checkpointing = 3 }"}, "settings.checkpointing"),
    ("an unknown setting", {"settings": "{ micro_batch_size = 8, micro = 2 }"}, "settings.micro"),
    ("settings a list", {"settings": "[8]"}, "settings must be an object"),
    ("target -5", {"target": "{ batch_size = -5 }"}, "target.batch_size"),
    ("target 0", {"target": "{ batch_size = 0 }"}, "target.batch_size"),
    ("target 8.0", {"target": "{ batch_size = 8.0 }"}, "target.batch_size"),
    ("target true", {"target": "{ batch_size = true }"}, "target.batch_size"),
    ("target missing", {"target": "{ world_size = 1 }"}, "target.batch_size is missing"),
    ("target not the product", {"target": "{ batch_size = 16 }"}, "is not micro_batch_size x"),
    ("target world size 0", {"target": "{ batch_size = 8, world_size = 0 }"}, "target.world_size"),
    ("world sizes disagree", {"target": "{ batch_size = 16, world_size = 2 }"}, "settings.world_size 1"),
    ("capacity huge", {"measured": '{ capacity = "huge" }'}, "measured.capacity"),
    ("capacity -1", {"measured": "{ capacity = -1 }"}, "measured.capacity"),
    ("capacity inf", {"measured": "{ capacity = inf }"}, "measured.capacity"),
    ("peak reserved -5", {"measured": "{ peak_reserved = -5 }"}, "measured.peak_reserved"),
    ("peak allocated 2**70", {"measured": f"{{ peak_allocated = {2**70} }}"}, "measured.peak_allocated"),
    ("speed nan", {"measured": "{ samples_per_second = nan }"}, "measured.samples_per_second"),
    ("speed -1", {"measured": "{ samples_per_second = -1.0 }"}, "measured.samples_per_second"),
    ("headroom 1.5", {"measured": "{ headroom = 1.5 }"}, "measured.headroom"),
    ("headroom true", {"measured": "{ headroom = true }"}, "measured.headroom"),
    ("max batch -1", {"measured": "{ max_batch_size = -1 }"}, "measured.max_batch_size"),
    ("device a number", {"measured": "{ device = 3 }"}, "measured.device"),
    ("an unknown measurement", {"measured": "{ peak = 3 }"}, "measured.peak"),
    ("schema_version true", {"schema_version": "true"}, "schema_version"),
    ("schema_version 1.0", {"schema_version": "1.0"}, "schema_version"),
    ("schema_version 0", {"schema_version": "0"}, "schema_version"),
    ("schema_version text", {"schema_version": '"1"'}, "schema_version"),
    ("workload a list", {"workload": '[ "mlp" ]'}, "workload must be an object"),
    ("workload ref a number", {"workload": "{ ref = 3 }"}, "workload.ref"),
    ("workload ref empty", {"workload": '{ ref = "" }'}, "workload.ref"),
    ("workload ref and name missing", {"workload": '{ note = "x" }'}, "workload.ref is missing"),
    ("workload ref 5000 characters", {"workload": f'{{ ref = "{"m" * 5000}" }}'}, "workload.ref"),
    ("created a TOML date", {"created": "1979-05-27T07:32:00Z"}, "created"),
    ("created a TOML time", {"created": "07:32:00"}, "created"),
    ("memfit_version a date", {"memfit_version": "1979-05-27"}, "memfit_version"),
    ("an unknown table", {"extra": "{ a = 1 }"}, "extra is not a field"),
    ("environment missing python", {"environment": f"{{ {ENV} }}"}, "environment.python"),
    ("environment python a number", {"environment": f"{{ {ENV}, python = 3.11 }}"}, "environment.python"),
    ("environment python a date", {"environment": f"{{ {ENV}, python = 2024-01-01 }}"}, "environment.python"),
    ("environment python 5000 chars", {"environment": f'{{ {ENV}, python = "{"3" * 5000}" }}'}, "environment.python"),
    ("environment torch a list", {"environment": f'{{ {ENV}, python = "3", torch = ["2"] }}'}, "environment.torch"),
    (
        "environment schema_version true",
        {"environment": '{ schema = "memfit.environment", schema_version = true, python = "3", os = "L" }'},
        "environment.schema_version",
    ),
    ("environment gpus not a list", {"environment": f'{{ {ENV}, python = "3", gpus = 5 }}'}, "environment.gpus"),
    ("gpu memory inf", {"environment": _gpu("inf")}, "environment.gpus[0].memory"),
    ("gpu memory true", {"environment": _gpu("true")}, "environment.gpus[0].memory"),
    ("gpu memory -1", {"environment": _gpu("-1")}, "environment.gpus[0].memory"),
    ("gpu memory 1.5", {"environment": _gpu("1.5")}, "environment.gpus[0].memory"),
    ("gpu memory text", {"environment": _gpu('"80GB"')}, "environment.gpus[0].memory"),
]


def lock_cases() -> list[Case]:
    cases = []
    for index, (name, changes, field) in enumerate(DAMAGED_LOCKS):
        for json_flag in ([], ["--json"]):
            cases.append(
                Case(
                    "hostile files",
                    f"check{' --json' if json_flag else ''}: {name}",
                    ["check", "memfit.lock", *json_flag],
                    setup=_write("memfit.lock", _lock_text(**changes)),
                    message=field,
                    quick=index < 2 and not json_flag,
                )
            )
    for where in ("target", "measured"):
        table = "{ batch_size = " if where == "target" else "{ capacity = "
        cases.append(
            Case(
                "hostile files",
                f"check: a 5000-digit number in {where}",
                ["check", "memfit.lock"],
                setup=_write("memfit.lock", _lock_text(**{where: table + "9" * 5000 + " }"})),
                message="a number too long",
            )
        )
    return cases


ENV_FILES: list[tuple[str, object, str]] = [
    ("python null", {**FINGERPRINT, "python": None}, "python must be text"),
    ("python a number", {**FINGERPRINT, "python": 3.11}, "python must be text"),
    ("os missing", {k: v for k, v in FINGERPRINT.items() if k != "os"}, "os is missing"),
    ("schema_version true", {**FINGERPRINT, "schema_version": True}, "schema_version"),
    ("schema_version 0", {**FINGERPRINT, "schema_version": 0}, "schema_version"),
    ("torch a list", {**FINGERPRINT, "torch": ["2.5"]}, "torch must be text"),
    ("driver an object", {**FINGERPRINT, "driver": {"v": 1}}, "driver must be text"),
    ("a gpu a string", {**FINGERPRINT, "gpus": ["A100"]}, "gpus must be a list of objects"),
    (
        "gpu memory negative",
        {**FINGERPRINT, "gpus": [{"name": "A", "memory": -1, "capability": "8.0"}]},
        "gpus[0].memory",
    ),
    (
        "gpu memory true",
        {**FINGERPRINT, "gpus": [{"name": "A", "memory": True, "capability": "8.0"}]},
        "gpus[0].memory",
    ),
    ("gpu name missing", {**FINGERPRINT, "gpus": [{"memory": 1, "capability": "8.0"}]}, "gpus[0].name is missing"),
    ("NaN", json.dumps(FINGERPRINT)[:-1] + ', "driver": NaN}', "holds NaN"),
    ("Infinity", json.dumps(FINGERPRINT)[:-1] + ', "driver": Infinity}', "holds Infinity"),
    ("1e400", json.dumps(FINGERPRINT)[:-1] + ', "gpus": [{"memory": 1e400}]}', "holds 1e400"),
    (
        "a 5000-digit number",
        json.dumps(FINGERPRINT)[:-1] + ', "gpus": [{"memory": ' + "9" * 5000 + "}]}",
        "a number too long",
    ),
]


def env_file_cases() -> list[Case]:
    cases = []
    for name, content, message in ENV_FILES:
        text = content if isinstance(content, str) else json.dumps(content)
        for json_flag in ([], ["--json"]):
            cases.append(
                Case(
                    "hostile files",
                    f"env check{' --json' if json_flag else ''}: {name}",
                    ["env", "check", "in.json", *json_flag],
                    setup=_write("in.json", text),
                    message=message,
                )
            )
    return cases


def run_and_result_cases() -> list[Case]:
    runs = [
        ("capacity -1", _run_lines({**HEADER, "capacity": -1}, STEP), "capacity must be a whole number from 0"),
        ("capacity true", _run_lines({**HEADER, "capacity": True}, STEP), "capacity must be a whole number"),
        ("capacity 1e400", json.dumps(HEADER)[:-1] + ', "capacity": 1e400}\n' + json.dumps(STEP) + "\n", "1e400"),
        (
            "allocated -10",
            _run_lines(HEADER, {**STEP, "allocated": -10}, STEP),
            "allocated must be a whole number from 0",
        ),
        ("reserved 2**70", _run_lines(HEADER, {**STEP, "reserved": 2**70}, STEP), "reserved must be"),
        ("seconds -1", _run_lines(HEADER, {**STEP, "seconds": -1}, STEP), "seconds must be a number from 0"),
        (
            "seconds NaN",
            json.dumps(HEADER) + "\n" + json.dumps(STEP)[:-1] + ', "seconds": NaN}\n' + json.dumps(STEP) + "\n",
            "NaN",
        ),
        ("step true", _run_lines(HEADER, {**STEP, "step": True}, STEP), "step must be a whole number"),
        (
            "a 5000-digit step",
            json.dumps(HEADER) + '\n{"kind": "step", "step": ' + "9" * 5000 + "}\n",
            "a number too long",
        ),
        ("window 2.5", _run_lines({**HEADER, "window": 2.5}, STEP), "window must be"),
    ]
    cases = [
        Case(
            "hostile files",
            f"report: {name}",
            ["report", "run.jsonl"],
            setup=_write("run.jsonl", text),
            message=message,
        )
        for name, text, message in runs
    ]
    good_run = _write("run.jsonl", _run_lines(HEADER, STEP, {**STEP, "step": 1}))
    results = [
        ("--plan", "Infinity", '{"workload": "mlp", "candidates": [{"peak_reserved": Infinity}]}', "holds Infinity"),
        (
            "--plan",
            "negative memory",
            '{"workload": "mlp", "candidates": [{"peak_reserved": -5}]}',
            "candidates[0].peak_reserved",
        ),
        ("--plan", "negative capacity", '{"workload": "mlp", "candidates": [], "capacity": -1}', "capacity must be"),
        ("--plan", "a workload list", '{"workload": ["mlp"], "candidates": []}', "workload must be text"),
        (
            "--probe",
            "a 5000-digit batch",
            '{"max_batch_size": ' + "9" * 5000 + ', "recommended_batch_size": 1, "trials": []}',
            "a number too long",
        ),
        (
            "--probe",
            "max batch true",
            '{"max_batch_size": true, "recommended_batch_size": 1, "trials": []}',
            "max_batch_size",
        ),
        (
            "--probe",
            "a NaN speed",
            '{"max_batch_size": 1, "recommended_batch_size": 1, "trials": [{"batch_size": 1, "samples_per_second": NaN}]}',
            "holds NaN",
        ),
        (
            "--estimate",
            "negative total",
            '{"batch_size": 1, "peak_allocated": 1, "total": -1, "breakdown": {}}',
            "total must be",
        ),
    ]
    cases += [
        Case(
            "hostile files",
            f"report {option}: {name}",
            ["report", "run.jsonl", option, "result.json"],
            setup=_both(good_run, _write("result.json", text)),
            message=message,
        )
        for option, name, text, message in results
    ]
    return cases


def _dangling(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).symlink_to(folder / "nowhere")


def _folder(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).mkdir(parents=True)


def output_cases() -> list[Case]:
    fit = ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--max-batch-size", "8"]
    long_name = "x" * 300
    deep = "/".join(["d" * 200] * 25)
    run = _write("run.jsonl", _run_lines(HEADER, STEP, {**STEP, "step": 1}))
    cases = [
        Case(
            "output paths",
            "fit --report-dir a dangling link",
            [*fit, "--report-dir", "report"],
            setup=_dangling("report"),
            message="does not exist",
        ),
        Case(
            "output paths",
            "fit --lock a dangling link",
            [*fit, "--lock", "lock"],
            setup=_dangling("lock"),
            message="does not exist",
        ),
        Case(
            "output paths",
            "probe --plot a dangling link",
            ["probe", TINY, "--device", "sim:64MiB", "--plot", "p.png"],
            setup=_dangling("p.png"),
            message="does not exist",
        ),
        Case(
            "output paths",
            "fit: a folder where the snapshot goes",
            fit,
            setup=_folder("memfit-report/report-snapshot.pickle"),
            message="report-snapshot.pickle",
        ),
        Case(
            "output paths",
            "fit: a folder where the viewer goes",
            fit,
            setup=_folder("memfit-report/report-memory-viz.html"),
            message="report-memory-viz.html",
        ),
        Case(
            "output paths",
            "report -o: a folder where the viewer goes",
            ["report", "run.jsonl", "-o", "page.html"],
            setup=_both(run, _folder("page-memory-viz.html")),
            message="page-memory-viz.html",
        ),
        Case(
            "output paths",
            "report -o: a folder where the timeline goes",
            ["report", "run.jsonl", "-o", "page.html"],
            setup=_both(run, _folder("page-timeline.png")),
            message="page-timeline.png",
        ),
        Case("output paths", "fit --lock a 300-byte name", [*fit, "--lock", long_name], message="bytes a name may be"),
        Case(
            "output paths",
            "fit --lock past PATH_MAX",
            [*fit, "--lock", f"{deep}/memfit.lock"],
            message="the path is longer",
        ),
        Case(
            "output paths",
            "report -o past PATH_MAX",
            ["report", "run.jsonl", "-o", f"{deep}/r.html"],
            setup=run,
            message="the path is longer",
        ),
        Case(
            "output paths",
            "probe --plot a 300-byte name",
            ["probe", TINY, "--plot", long_name + ".png"],
            message="bytes a name may be",
        ),
        Case(
            "output paths", "env export -o past PATH_MAX", ["env", "export", "-o", deep], message="the path is longer"
        ),
        Case(
            "output paths",
            "estimate --snapshot a 300-byte name",
            ["estimate", TINY, "--snapshot", long_name],
            message="bytes a name may be",
        ),
        Case(
            "output paths",
            "fit --lock a 251-byte name (its temp name passes 255)",
            [*fit, "--lock", "l" * 246 + ".lock"],
            expect="ok",
            timeout=180,
        ),
    ]
    return cases


CHANGES = {
    "sys.exit(0)": ("sys.exit(0)", "called sys.exit(0)"),
    "SystemExit": ("raise SystemExit('done')", "called sys.exit('done')"),
    "os.chdir": ("os.chdir(os.path.join(os.path.dirname(__file__), 'elsewhere'))", "changed the working directory"),
    "set_default_dtype": ("torch.set_default_dtype(torch.float64)", "changed torch's default dtype"),
    "use_deterministic_algorithms": ("torch.use_deterministic_algorithms(True)", "deterministic-algorithms flag"),
}


def _changing(where: str, statement: str) -> Callable[[Path], None]:
    def hook(part: str) -> str:
        return f"        {statement}\n" if part == where else ""

    body = (
        "import sys\n"
        "def make():\n"
        "    def model():\n" + hook("model") + "        return torch.nn.Linear(8, 2)\n"
        "    def batch(n):\n" + hook("make_batch") + "        return torch.randn(n, 8), torch.randint(0, 2, (n,))\n"
        "    def loss(m, b):\n"
        + hook("loss")
        + "        return torch.nn.functional.cross_entropy(m(b[0].to(m.weight.dtype)), b[1])\n"
        "    return memfit.Workload(model=model, make_batch=batch, loss=loss)\n"
    )
    return _both(_workload(body), _folder("elsewhere"))


def user_code_cases() -> list[Case]:
    commands = {
        "measure": ["measure", "wl.py:make", "--device", "sim:64MiB", "--batch-size", "2"],
        "probe": ["probe", "wl.py:make", "--device", "sim:64MiB", "--max-batch-size", "8", "--plot", "p.png"],
        "fit": ["fit", "wl.py:make", "--device", "sim:64MiB", "--no-doctor", "--max-batch-size", "8"],
    }
    cases = []
    index = 0
    for name, (statement, message) in CHANGES.items():
        for where in ("model", "make_batch", "loss"):
            command = list(commands)[index % len(commands)]
            index += 1
            cases.append(
                Case(
                    "user code",
                    f"{command}: {name} in {where}",
                    commands[command],
                    setup=_changing(where, statement),
                    message=message,
                    late=command == "fit",
                    quick=index == 1,
                )
            )
    return cases


def _reconfigure_ascii() -> None:
    sys.stdout.reconfigure(encoding="ascii")  # type: ignore[attr-defined]
    sys.stderr.reconfigure(encoding="ascii")  # type: ignore[attr-defined]


def _small_host(available: int) -> Callable[[], None]:
    def inject() -> None:
        from memfit.environment import system
        from memfit.environment.system import HostFacts, RecordedProbe

        host = HostFacts("Linux", "6.1", "x86_64", 2, 4 * available, available, None, None)
        system.current_probe = lambda: RecordedProbe(host=host)  # type: ignore[assignment]

    return inject


def environment_cases() -> list[Case]:
    torchrun = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    probe = ["probe", TINY, "--device", "sim:64MiB"]
    table = [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"RANK": "abc"}, "RANK='abc'"),
        ({"RANK": "5"}, "RANK='5'"),
        ({"RANK": "-1"}, "RANK='-1'"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"MEMFIT_COLLECTIVE_TIMEOUT": "1e-9"}, "MEMFIT_COLLECTIVE_TIMEOUT='1e-9'"),
        ({"MEMFIT_COLLECTIVE_TIMEOUT": "1e300"}, "MEMFIT_COLLECTIVE_TIMEOUT='1e300'"),
        ({"MEMFIT_COLLECTIVE_TIMEOUT": "0.5"}, "MEMFIT_COLLECTIVE_TIMEOUT='0.5'"),
    ]
    cases = [
        Case(
            "environment", " ".join(f"{k}={v}" for k, v in env.items()), probe, env={**torchrun, **env}, message=message
        )
        for env, message in table
    ]
    lock = _write("memfit.lock", _lock_text())
    ascii_commands = {
        "fit": ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--max-batch-size", "8"],
        "estimate": ["estimate", GPT, "--device", "sim:64MiB"],
        "measure": ["measure", TINY, "--device", "sim:64MiB", "--batch-size", "2"],
        "check": ["check", "memfit.lock"],
        "doctor": ["doctor"],
        "plan": ["plan", TINY, "--device", "sim:64MiB", "--target-batch", "8"],
    }
    cases += [
        Case(
            "environment",
            f"PYTHONIOENCODING=ascii: {name}",
            argv,
            expect="ok",
            inject=_reconfigure_ascii,
            setup=lock if name == "check" else None,
            timeout=180,
        )
        for name, argv in ascii_commands.items()
    ]
    alloc = {
        "4400 digits": "max_split_size_mb:" + "9" * 4400,
        "4400 characters": "x" * 4400,
        "200 settings": "expandable_segments:True," * 200,
    }
    cases += [
        Case(
            "environment",
            f"doctor --json: a PYTORCH_CUDA_ALLOC_CONF of {name}",
            ["doctor", "--json"],
            expect="ok",
            env={"PYTORCH_CUDA_ALLOC_CONF": value},
        )
        for name, value in alloc.items()
    ]
    meta = "def make():\n    return memfit.Workload(model=lambda: torch.nn.Linear(8, 2, device='meta'), make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))), loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))\n"
    cases += [
        Case(
            "environment",
            f"{argv[0]}: a model built on the meta device",
            argv,
            setup=_workload(meta),
            message="meta device",
        )
        for argv in (
            ["measure", "wl.py:make", "--device", "sim:64MiB", "--batch-size", "2"],
            ["probe", "wl.py:make", "--device", "sim:64MiB"],
        )
    ]
    real = ["--trials", "real"]
    host = [
        (
            "plan llama-7b --gpu 'RTX 4090' --trials real",
            ["plan", "llama-7b:seq_len=512", "--gpu", "RTX 4090", "--target-batch", "8", "--trials", "real"],
            2**30,
        ),
        ("fit llama-7b --gpu 'RTX 4090'", ["fit", "llama-7b:seq_len=512", "--gpu", "RTX 4090", "--no-doctor"], 2**30),
        ("probe llama-1b on sim:RTX 4090", ["probe", "llama-1b", "--device", "sim:RTX 4090"], 2**30),
        ("probe llama-7b --gpu 'RTX 4090'", ["probe", "llama-7b:seq_len=512", "--gpu", "RTX 4090"], 2**30),
        (
            "measure a 1 GiB model",
            ["measure", "mlp:layers=4,width=8192,features=8192", "--device", "cpu", "--batch-size", "1"],
            2**30,
        ),
        (
            "plan --trials real on sim:64MiB with 16 MiB free",
            ["plan", "mlp:layers=2,width=1024,features=1024", "--device", "sim:64MiB", "--target-batch", "8", *real],
            16 * 2**20,
        ),
    ]
    cases += [
        Case(
            "host memory",
            name,
            argv,
            inject=_small_host(available),
            message="of host memory",
            timeout=60,
            quick=name == "probe llama-7b --gpu 'RTX 4090'",
        )
        for name, argv, available in host
    ]
    # On fake trials ranked by the card's predicted speed a plan runs no real step: it goes on
    # (nothing built for real) and says its answer was not confirmed for real.
    cases.append(
        Case(
            "host memory",
            "plan on fake trials, sim:256MiB with 16 MiB free",
            ["plan", "mlp:layers=2,width=1024,features=1024", "--device", "sim:256MiB", "--target-batch", "4"],
            expect="ok",
            inject=_small_host(16 * 2**20),
            message="was not run for real",
            timeout=120,
        )
    )
    return cases


def distributed_join_cases() -> list[Case]:
    probe = ["probe", TINY, "--device", "sim:64MiB", "--no-estimate", "--max-batch-size", "4"]
    fit = ["fit", TINY, "--device", "sim:64MiB", "--no-doctor", "--max-batch-size", "4"]
    cases = []
    for argv in (probe, fit):
        cases.append(
            Case(
                "distributed",
                f"{argv[0]}: rank 1 never starts",
                argv,
                expect="rank-error",
                ranks=(0,),
                message="rank 1 did not join the job",
                timeout=90,
            )
        )
        cases.append(
            Case(
                "distributed",
                f"{argv[0]}: the master is unreachable",
                argv,
                expect="rank-error",
                ranks=(1,),
                message="could not reach the job's master",
                timeout=90,
            )
        )
        cases.append(
            Case(
                "distributed",
                f"{argv[0]}: rank 1 ends before joining",
                argv,
                expect="rank-error",
                rank_env={1: {"MEMFIT_COLLECTIVE_TIMEOUT": "soon"}},
                message="rank 1 did not join the job",
                timeout=90,
            )
        )
    return cases


def more_interrupt_cases(seed: int) -> list[Case]:
    chance = random.Random(seed + 21)
    argv = ["estimate", GPT, "--device", "sim:64MiB"]
    cases = []
    for moment in range(36):
        sig = signal.SIGINT if moment % 3 else signal.SIGTERM
        delay = round(chance.uniform(0.0, 3.0), 3)
        cases.append(
            Case(
                "interrupts",
                f"estimate: {signal.Signals(sig).name} after {delay} s (moment {moment})",
                argv,
                expect="interrupt",
                signal=sig,
                delay=delay,
            )
        )
    # the first milliseconds after the fork (the handlers of run()'s first line are in place, the
    # command's own not yet) and the fake steps, where torch's C++ calls memfit and torch back
    for moment, (sig, delay) in enumerate(
        (s, d) for d in (0.0, 0.001, 0.004, 0.02) for s in (signal.SIGINT, signal.SIGTERM)
    ):
        cases.append(
            Case(
                "interrupts",
                f"estimate: {signal.Signals(sig).name} after {delay} s (at the start)",
                argv,
                expect="interrupt",
                signal=sig,
                delay=delay,
                quick=moment in (1, 2),
            )
        )
    return cases


def hostile_cases(seed: int) -> list[Case]:
    """Every case of issue 21's classes."""
    assert os.environ.get("OMP_NUM_THREADS") == "1"
    return (
        lock_cases()
        + env_file_cases()
        + run_and_result_cases()
        + output_cases()
        + user_code_cases()
        + environment_cases()
        + distributed_join_cases()
        + more_interrupt_cases(seed)
    )
