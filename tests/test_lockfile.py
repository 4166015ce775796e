"""memfit.lock: round trip, apply, check, atomic writing, and every bad-lock case."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

import memfit
from memfit.environment.envfile import Fingerprint, GpuFingerprint, fingerprint
from memfit.errors import MemfitError
from memfit.run.settings import Settings
from memfit.search.lock import Lock, Measured, check_lock, load_lock, write_lock

HERE = Fingerprint(python="3.11.7", os="Linux x86_64", torch="2.13.0+cpu", gpus=())
A100 = GpuFingerprint("NVIDIA A100-SXM4-80GB", 85_000_000_000, "8.0")


def make_lock(**changes) -> Lock:
    fields = dict(
        workload="mlp:layers=4,width=64,features=32",
        settings=Settings(precision="bf16", checkpointing="blocks", micro_batch_size=8, accumulation_steps=4),
        target_batch_size=32,
        environment=HERE,
        measured=Measured(
            device="sim:8GiB",
            capacity=8 * 2**30,
            peak_allocated=123,
            peak_reserved=456,
            samples_per_second=78.5,
            headroom=0.05,
            max_batch_size=64,
        ),
    )
    fields.update(changes)
    return Lock(**fields)


def test_round_trip(tmp_path):
    lock = make_lock(
        environment=Fingerprint(
            python="3.11.7", os="Linux x86_64", torch="2.5.1+cu124", torch_cuda="12.4", driver="550.54", gpus=(A100,)
        )
    )
    path = write_lock(lock, tmp_path / "memfit.lock")
    loaded = load_lock(path)
    assert loaded.settings == lock.settings
    assert (loaded.workload, loaded.target_batch_size, loaded.world_size) == (lock.workload, 32, 1)
    assert loaded.measured == lock.measured
    assert loaded.environment == lock.environment
    assert (loaded.micro_batch_size, loaded.accumulation_steps) == (8, 4)
    assert 'schema = "memfit.lock"' in path.read_text()


def test_apply_gives_the_users_loop_what_it_needs(tmp_path):
    lock = load_lock(write_lock(make_lock(), tmp_path / "memfit.lock"))
    model = memfit.load_workload(lock.workload).build_model()
    plain = sum(1 for m in model.modules() if "forward" in m.__dict__)
    undo = lock.settings.apply(model)
    with lock.settings.autocast("cpu"):
        out = model(torch.randn(2, 32))  # the first forward with gradients finds the blocks
    assert sum(1 for m in model.modules() if "forward" in m.__dict__) == plain + 4  # four checkpointed blocks
    assert undo.checkpointed.describe() == "4 x MLPBlock"
    assert out.dtype == torch.bfloat16
    assert not lock.settings.scaler("cpu").is_enabled()  # bf16 needs no loss scaling
    undo()
    assert sum(1 for m in model.modules() if "forward" in m.__dict__) == plain


def test_check_same_environment_has_no_difference(tmp_path):
    path = write_lock(make_lock(), tmp_path / "memfit.lock")
    result = check_lock(path, current=HERE)
    assert result.differences == [] and not result.matters


def test_check_reports_a_changed_gpu_and_suggests_probing(tmp_path):
    old = Fingerprint(python="3.11.7", os="Linux x86_64", torch="2.5.1+cu124", torch_cuda="12.4", gpus=(A100,))
    new = Fingerprint(
        python="3.11.7",
        os="Linux x86_64",
        torch="2.5.1+cu124",
        torch_cuda="12.4",
        gpus=(GpuFingerprint("NVIDIA GeForce RTX 3090", 25_000_000_000, "8.6"),),
    )
    path = write_lock(make_lock(environment=old), tmp_path / "memfit.lock")
    result = check_lock(path, current=new)
    assert result.matters and result.gpu_changed
    assert any("memfit probe" in note for note in result.advice())


def test_check_reports_a_changed_torch(tmp_path):
    path = write_lock(make_lock(), tmp_path / "memfit.lock")
    result = check_lock(path, current=Fingerprint(python="3.11.7", os="Linux x86_64", torch="2.14.0+cpu"))
    assert [d.field for d in result.differences] == ["torch"] and result.matters


def test_writing_is_atomic(tmp_path, monkeypatch):
    path = write_lock(make_lock(), tmp_path / "memfit.lock")
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(MemfitError, match=r"cannot write .*memfit.lock: disk full"):  # one line, not a traceback
        write_lock(make_lock(target_batch_size=64), path)
    assert path.read_text() == before  # the old lock is intact
    assert [p.name for p in tmp_path.iterdir()] == ["memfit.lock"]  # no temp file left


BAD_LOCKS = {
    "corrupt": ("schema = [unclosed", "not a valid memfit.lock"),
    "foreign": ('schema = "something.else"\nschema_version = 1\n', "is not a memfit.lock"),
    "newer": ('schema = "memfit.lock"\nschema_version = 99\n', "newer than this memfit reads"),
    "damaged": ('schema = "memfit.lock"\nschema_version = 1\n[workload]\nref = "mlp"\n', "damaged memfit.lock"),
    "bad settings": (
        'schema = "memfit.lock"\nschema_version = 1\n[workload]\nref = "mlp"\n[settings]\nprecision = "fp8"\nmicro_batch_size = 2\n'
        '[target]\nbatch_size = 2\n[environment]\nschema = "memfit.environment"\nschema_version = 1\npython = "3.11"\nos = "Linux"\n',
        "settings.precision must be one of fp32, bf16, fp16, not 'fp8'",
    ),
    "binary": (b"\xff\xfe\x00garbage", "not a valid memfit.lock"),
}


@pytest.mark.parametrize("case", BAD_LOCKS)
def test_bad_locks_are_one_line_errors(tmp_path, case, run_cli):
    content, message = BAD_LOCKS[case]
    path = tmp_path / "memfit.lock"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(MemfitError, match=message):
        load_lock(path)
    status, out, err = run_cli("check", str(path))
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_missing_lock(tmp_path, run_cli):
    status, _, err = run_cli("check", str(tmp_path / "memfit.lock"))
    assert status == 2 and "not found" in err and "memfit fit" in err


def test_check_cli_exit_status(tmp_path, run_cli):
    from memfit.environment.envfile import fingerprint

    here = fingerprint()
    same = write_lock(make_lock(environment=here), tmp_path / "same.lock")
    status, out, _ = run_cli("check", str(same))
    assert status == 0 and "matches" in out
    other = Fingerprint(
        python=here.python,
        os=here.os,
        os_release=here.os_release,
        torch="1.0.0",
        torch_cuda=here.torch_cuda,
        cudnn=here.cudnn,
        driver=here.driver,
        cuda_driver=here.cuda_driver,
        gpus=here.gpus,
    )
    changed = write_lock(make_lock(environment=other), tmp_path / "changed.lock")
    status, out, _ = run_cli("check", str(changed))
    assert status == 1 and "torch" in out


def test_a_lock_without_a_reference_keeps_the_name_and_says_why(tmp_path):
    path = write_lock(make_lock(workload=None, workload_name="from my script"), tmp_path / "memfit.lock")
    text = path.read_text()
    assert "ref =" not in text and 'name = "from my script"' in text and "not a reference" in text
    loaded = load_lock(path)
    assert (loaded.workload, loaded.workload_name) == (None, "from my script")


def test_a_lock_with_neither_reference_nor_name_is_damaged(tmp_path):
    path = write_lock(make_lock(), tmp_path / "memfit.lock")
    path.write_text(
        path.read_text()
        .replace('ref = "mlp:layers=4,width=64,features=32"\n', "")
        .replace('name = "mlp:layers=4,width=64,features=32"\n', "")
    )
    with pytest.raises(MemfitError, match=r"damaged memfit\.lock: workload\.ref is missing"):
        load_lock(path)


def test_check_reads_the_lock_and_this_machine_without_importing_torch(tmp_path):
    """memfit check answers in about a second: neither it nor a child process imports torch."""
    import subprocess
    import sys

    path = tmp_path / "memfit.lock"
    write_lock(make_lock(environment=fingerprint()), path)
    code = (
        "import sys\nfrom memfit.cli import main\nstatus = main(['check', sys.argv[1]])\n"
        "print(status, 'torch' in sys.modules)"
    )
    completed = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert completed.stdout.splitlines()[-1] == "0 False"
    assert "no difference" in completed.stdout


# -- every field checked: a lock memfit could not have written is never a match (issue 21) --

ENV = 'schema = "memfit.environment", schema_version = 1, os = "Linux"'
DAMAGED_FIELDS = [
    ({"settings": "{ micro_batch_size = 8.5 }"}, "settings.micro_batch_size must be a whole number"),
    (
        {"settings": "{ micro_batch_size = true }"},
        "settings.micro_batch_size must be a whole number from 1 to 16777216, not true",
    ),
    ({"settings": "{ micro_batch_size = inf }"}, "settings.micro_batch_size must be a whole number"),
    ({"settings": "{ micro_batch_size = nan }"}, "settings.micro_batch_size must be a whole number"),
    ({"settings": "{ micro_batch_size = 0 }"}, "settings.micro_batch_size must be a whole number from 1"),
    ({"settings": "{ micro_batch_size = 8, accumulation_steps = 1e308 }"}, "settings.accumulation_steps"),
    (
        {"settings": "{ micro_batch_size = 8, accumulation_steps = 99999999999999999999 }"},
        "settings.accumulation_steps",
    ),
    ({"settings": "{ micro_batch_size = 8, world_size = 0 }"}, "settings.world_size"),
    ({"settings": '{ micro_batch_size = 8, shard = "all" }'}, "settings.shard must be one of"),
    ({"settings": "{ micro_batch_size = 8, micro = 2 }"}, "settings.micro is not a field memfit writes"),
    ({"target": "{ batch_size = -5 }"}, "target.batch_size must be a whole number from 1"),
    ({"target": "{ batch_size = 0 }"}, "target.batch_size must be a whole number from 1"),
    ({"target": "{ batch_size = 8, world_size = 0 }"}, "target.world_size"),
    ({"target": "{ batch_size = 16 }"}, "target.batch_size 16 is not micro_batch_size x accumulation_steps"),
    ({"target": "{ batch_size = 8, world_size = 2 }"}, "settings.world_size 1 is not target.world_size 2"),
    ({"measured": '{ capacity = "huge" }'}, "measured.capacity must be a whole number"),
    ({"measured": "{ capacity = -1 }"}, "measured.capacity must be a whole number from 0"),
    ({"measured": "{ peak_reserved = inf }"}, "measured.peak_reserved"),
    ({"measured": "{ samples_per_second = nan }"}, "measured.samples_per_second must be a number"),
    ({"measured": "{ headroom = 1.5 }"}, "measured.headroom"),
    ({"schema_version": "true"}, "schema_version must be a whole number from 1 to 1, not true"),
    ({"schema_version": "1.0"}, "schema_version must be a whole number"),
    ({"workload": '[ "mlp" ]'}, "workload must be an object, not a list"),
    ({"workload": "{ ref = 3 }"}, "workload.ref must be text"),
    ({"workload": '{ ref = "" }'}, "workload.ref must be text"),
    ({"created": "1979-05-27T07:32:00Z"}, "created must be text of at most 200 characters, not a datetime"),
    ({"memfit_version": "1979-05-27"}, "memfit_version must be text"),
    ({"environment": f"{{ {ENV} }}"}, "environment.python is missing"),
    ({"environment": f"{{ {ENV}, python = 3.11 }}"}, "environment.python must be text"),
    ({"environment": f'{{ {ENV}, python = "{"3" * 5000}" }}'}, "environment.python must be text of at most 200"),
    ({"environment": f'{{ {ENV}, python = "3", torch = 1979-05-27 }}'}, "environment.torch must be text"),
    (
        {"environment": f'{{ {ENV}, python = "3", gpus = [{{ name = "A100", memory = inf, capability = "8.0" }}] }}'},
        "environment.gpus[0].memory must be a whole number",
    ),
    (
        {"environment": f'{{ {ENV}, python = "3", gpus = [{{ name = "A100", memory = true, capability = "8.0" }}] }}'},
        "environment.gpus[0].memory must be a whole number",
    ),
    ({"extra": "1"}, "extra is not a field memfit writes"),
]


@pytest.fixture(scope="module")
def lock_text(bench_module: Callable[[str], ModuleType]) -> Callable[..., str]:
    """The base lock of bench/fault_injection.py's damaged-lock cases (one base for both:
    micro 8 x 1 x 1 = target 8), with the changes it is called with."""
    return bench_module("fault_injection")._lock_text


@pytest.mark.parametrize(("changes", "message"), DAMAGED_FIELDS, ids=[m for _, m in DAMAGED_FIELDS])
def test_a_damaged_field_is_refused_in_one_line_naming_it_and_the_file(tmp_path, run_cli, lock_text, changes, message):
    path = tmp_path / "memfit.lock"
    path.write_text(lock_text(**changes))
    with pytest.raises(MemfitError, match=re.escape(message)):
        load_lock(path)
    for json_flag in ((), ("--json",)):
        status, out, err = run_cli("check", str(path), *json_flag)
        assert (status, out) == (2, "")
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"memfit: error: {path} is a damaged memfit.lock: "), err
        assert message in lines[0]


def test_the_base_of_the_damaged_cases_is_a_lock_memfit_reads(tmp_path, lock_text):
    path = tmp_path / "memfit.lock"
    path.write_text(lock_text())
    assert load_lock(path).settings.micro_batch_size == 8


def test_a_5000_digit_number_is_one_line(tmp_path, run_cli, lock_text):
    path = tmp_path / "memfit.lock"
    path.write_text(lock_text(target="{ batch_size = " + "9" * 5000 + " }"))
    status, out, err = run_cli("check", str(path))
    assert (status, out) == (2, "") and "a number too long" in err and len(err.splitlines()) == 1


def test_the_locks_largest_target_is_the_plans():
    from memfit.search import candidates, lock

    assert lock.MAX_TARGET_BATCH == candidates.MAX_TARGET_BATCH
