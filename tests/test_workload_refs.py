"""Every workload reference form resolves, and every zoo entry trains two steps on sim."""

import textwrap

import pytest
import torch

import memfit
from memfit.errors import WorkloadError
from memfit.run.steps import run_steps
from memfit.workload.zoo import ENTRIES, parse_options
from memfit.workload.zoo import TINY as TINY_ZOO

WORKLOAD_SOURCE = textwrap.dedent(
    """
    import torch, memfit

    def make_workload():
        return memfit.Workload(
            model=lambda: torch.nn.Linear(8, 2),
            make_batch=lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))),
            loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        )

    def with_defaults(width=8):
        return make_workload()

    def needs_argument(width):
        return make_workload()

    def not_a_workload():
        return 42

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def workload_file(tmp_path):
    path = tmp_path / "my_workload.py"
    path.write_text(WORKLOAD_SOURCE)
    return path


def two_steps_fit(workload):
    return memfit.measure(workload, 2, "sim:512MiB").fits


def test_file_reference(workload_file):
    wl = memfit.load_workload(f"{workload_file}:make_workload")
    assert wl.name == f"{workload_file}:make_workload"
    assert two_steps_fit(wl)


def test_module_reference(workload_file, monkeypatch):
    monkeypatch.syspath_prepend(str(workload_file.parent))
    assert two_steps_fit(memfit.load_workload("my_workload:with_defaults"))


def test_workload_object_passes_through():
    wl = memfit.load_workload("mlp")
    assert memfit.load_workload(wl) is wl


@pytest.mark.parametrize("name", ENTRIES)
def test_every_zoo_entry_runs_two_steps_on_sim(name):
    result = memfit.measure(TINY_ZOO[name], 2, "sim:1GiB")
    assert result.fits and result.peak_reserved > 0


def test_zoo_options_reach_the_model():
    model = memfit.load_workload("gpt2:n_layer=3,n_embd=32,n_head=2,seq_len=8,vocab_size=64").build_model()
    assert model.config.n_layer == 3 and model.config.vocab_size == 64
    assert memfit.load_workload("gpt2:layers=2,hidden=32,heads=2,vocab=64").build_model().config.n_layer == 2
    batch = memfit.load_workload("gpt2:n_layer=1,n_embd=32,n_head=2,seq_len=8,vocab_size=64").make_batch(3)
    assert batch["input_ids"].shape == (3, 8)


def test_a_module_instance_is_trained_in_place():
    model = torch.nn.Linear(4, 2)
    wl = memfit.Workload(model=model, make_batch=lambda n: torch.randn(n, 4), loss=lambda m, b: m(b).square().mean())
    before = model.weight.detach().clone()
    run_steps(wl, memfit.Settings(micro_batch_size=2), memfit.device("cpu"), steps=1)
    assert not torch.equal(before, model.weight)


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("", {}),
        ("a=1", {"a": 1}),
        ("a=1,b=x", {"a": 1, "b": "x"}),
        ("d=[1,2],e=true", {"d": [1, 2], "e": True}),
        ("f=0.5", {"f": 0.5}),
    ],
)
def test_parse_options(text, options):
    assert parse_options(text) == options


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("gtp2", "unknown workload 'gtp2'"),
        ("gpt2:n_layers=2", "unknown option 'n_layers' for zoo workload 'gpt2'"),
        ("mlp:depth=2", "unknown option 'depth' for zoo workload 'mlp'"),
        ("mlp:layers=two", "layers must be a positive integer"),
        ("mlp:layers", "bad zoo option 'layers'"),
        ("gpt2:seq_len=4096", "longer than the model's 1024 positions"),
        ("missing/file.py:make", "file missing/file.py not found"),
        ("nonexistent_pkg_xyz.mod:make", "module nonexistent_pkg_xyz.mod not found"),
        ("", "empty workload reference"),
    ],
)
def test_bad_references(ref, message):
    with pytest.raises(WorkloadError, match=message):
        memfit.load_workload(ref)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("missing_function", "function missing_function not found"),
        ("needs_argument", "must take no required arguments"),
        ("not_a_workload", "returned int, not a memfit.Workload"),
        ("NOT_CALLABLE", "is not a function"),
        ("", "name the function"),
    ],
)
def test_bad_functions(workload_file, function, message):
    with pytest.raises(WorkloadError, match=message):
        memfit.load_workload(f"{workload_file}:{function}")


def test_a_loaded_workload_remembers_its_reference(workload_file):
    """A lock records the reference, so that load_workload(lock.workload) loads the same workload."""
    assert memfit.load_workload("mlp:layers=1").reference == "mlp:layers=1"
    ref = f"{workload_file}:make_workload"
    assert memfit.load_workload(f"  {ref} ").reference == ref
    made = memfit.Workload(model=lambda: torch.nn.Linear(2, 2), make_batch=lambda n: torch.randn(n, 2), loss=None)
    assert memfit.load_workload(made).reference is None
    with pytest.raises(WorkloadError, match=r"no workload reference \(None\)"):
        memfit.load_workload(None)
