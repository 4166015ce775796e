"""bench/published.py: every published row names its source and versions, its workload builds and
runs its fake step, and the three estimators' figures are what their rules say; bench/gpu_accuracy.py
refuses without CUDA and runs its CPU dry run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from memfit.estimator.estimate import estimate
from memfit.units import GiB, MiB

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: the row keys, read from the script's text so collecting the tests imports nothing heavy
ROW_KEYS = sorted(
    set(__import__("re").findall(r'"((?:bert|vit|gpt2)-[a-z0-9-]+)"', (BENCH / "published.py").read_text()))
)


@pytest.fixture(scope="module")
def published(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("published")


def test_the_rows_cover_what_the_issue_asks(published: ModuleType) -> None:
    rows = published.ROWS
    assert len(rows) >= 10
    assert len({row.family for row in rows}) >= 3
    assert any(row.settings.precision == "fp32" and not row.options.get("bf16_true") for row in rows)
    assert any(row.settings.precision != "fp32" or row.options.get("bf16_true") for row in rows)
    assert len({row.key for row in rows}) == len(rows)


def test_every_row_names_source_gpu_versions_and_quantity(published: ModuleType) -> None:
    for row in published.ROWS:
        assert row.source.startswith("https://") and row.section, row.key
        assert row.gpu and row.versions and "torch" in row.versions, row.key
        assert row.quantity in ("nvidia-smi", "max_memory_reserved", "max_memory_allocated"), row.key
        assert 1 * GiB < row.measured < 40 * GiB and row.setup and row.limits, row.key
        assert set(row.depends_on) <= {1, 2, 5, 7}, row.key


def _row(published: ModuleType, key: str) -> Any:
    return next(row for row in published.ROWS if row.key == key)


@pytest.mark.parametrize("key", ROW_KEYS)
def test_every_rows_workload_runs_its_fake_step_at_a_small_size(published: ModuleType, key: str) -> None:
    # The same model code, optimizer, loop order and dtypes as the published size (the bf16-true
    # rows' factory moves the model to bf16: issue 13's item 7).
    row = _row(published, key)
    workload = row.tiny_workload()
    if row.options.get("bf16_true"):
        assert next(workload.build_model().parameters()).dtype == torch.bfloat16
    est = estimate(workload, 2, row.settings, gpu=row.gpu_table, cuda_version=row.cuda, search=False)
    assert 0 < est.peak_allocated <= est.peak_reserved
    assert est.breakdown["optimizer state"] > 0 and est.breakdown["cuda context"] > 0


def test_the_bert_rows_softmax_keeps_its_input_as_torch_1_10_did(published: ModuleType) -> None:
    scores = torch.randn(2, 3, 8, 8, requires_grad=True)
    probs = published._SoftmaxKeepingInput.apply(scores, -1)
    assert torch.equal(probs, torch.softmax(scores, -1))
    kept_input, kept_output = probs.grad_fn.saved_tensors
    assert torch.equal(kept_input, scores) and torch.equal(kept_output, probs)
    grad = torch.randn_like(probs)
    (ours,) = torch.autograd.grad(probs, scores, grad)
    (torchs,) = torch.autograd.grad(torch.softmax(scores, -1), scores, grad)
    assert torch.allclose(ours, torchs)


def test_the_bert_workload_holds_one_fp32_score_tensor_a_layer_more_than_the_installed_torch(
    published: ModuleType,
) -> None:
    tiny = published._TINY["BERT"]
    layers, heads, seq, batch = tiny["layers"], tiny["heads"], tiny["seq_len"], 2
    as_measured = estimate(published.bert_large(**tiny), batch, memory="1GiB", search=False)
    installed = estimate(published.bert_large(**tiny, attention="eager"), batch, memory="1GiB", search=False)
    scores = batch * heads * seq * seq * 4  # one fp32 (batch, heads, seq, seq) tensor
    assert as_measured.breakdown["activations"] - installed.breakdown["activations"] == layers * scores


def test_each_reproduction_of_older_software_can_be_removed_from_its_rows(published: ModuleType) -> None:
    """The headline is shown with and without the era reproductions: a BERT row's installed
    workload runs the installed torch's softmax (eager attention), a ViT row's the installed
    torch's Adam; the GPT-2 row reproduces nothing."""
    bert, vit, gpt2 = (_row(published, k) for k in ("bert-fp32-b4", "vit-fp32-b64", "gpt2-fp32-b8"))
    assert bert.installed == {"attention": "eager"} and gpt2.installed is None and gpt2.installed_workload() is None
    era = vit.tiny_workload().optimizer(nn.Linear(2, 2).parameters())
    plain = vit.builder(**{**vit.options, **vit.installed, **published._TINY["ViT"]})
    now = plain.optimizer(nn.Linear(2, 2).parameters())
    assert isinstance(era, published.Adam2023) and not isinstance(now, published.Adam2023)
    assert isinstance(now, torch.optim.Adam)


def test_the_trainers_zero_grad_of_2022_keeps_gradients_through_the_next_forward(published: ModuleType) -> None:
    workload = _row(published, "bert-fp32-b4").tiny_workload()
    kept = estimate(workload, 32, memory="1GiB", search=False)
    plain = dataclasses.replace(workload, optimizer=lambda p: torch.optim.AdamW(p, foreach=False))
    freed = estimate(plain, 32, memory="1GiB", search=False)
    params = kept.breakdown["parameters"]
    assert kept.breakdown["activations"] > params  # the peak is the forward's
    assert kept.breakdown["gradients"] == pytest.approx(params, rel=0.01)  # every gradient alive there
    assert freed.breakdown["gradients"] < params / 5  # only those backward has made by then
    assert kept.peak_allocated - freed.peak_allocated > 0.8 * params


def test_memfit_figure_is_the_measured_quantity(published: ModuleType) -> None:
    by_key = {row.key: row for row in published.ROWS}
    est = estimate(by_key["gpt2-fp32-b8"].tiny_workload(), 2, gpu="A100 40GB", cuda_version="12.8", search=False)
    workspaces = est.fixed_costs["cublas workspace"]
    assert workspaces == 2 * 8320 * 1024
    smi, reserved, allocated = by_key["bert-fp32-b4"], by_key["vit-fp32-b64"], by_key["gpt2-fp32-b8"]
    assert published.memfit_figure(smi, est) == est.total  # nvidia-smi: reserved + every fixed cost
    assert published.memfit_figure(reserved, est) == est.peak_reserved + workspaces  # torch 2.1: in the allocator
    assert published.memfit_figure(allocated, est) == est.peak_allocated + workspaces


def test_accelerate_and_deepspeed_follow_their_published_rules(published: ModuleType) -> None:
    row = next(r for r in published.ROWS if r.key == "gpt2-fp32-b8")
    workload = row.tiny_workload()
    params = published.parameter_count(workload)
    buffers = 0
    with torch.device("meta"):
        model = workload.build_model()
        buffers = sum(b.numel() for b in model.buffers())
    # fp32: the largest of model 4P, gradients 4P, Adam 8P, step 16P (bytes of the fp32 model)
    assert published.accelerate_estimate(workload, "float32") == 4 * (4 * params + 4 * buffers)
    # mixed: max(model 4P, gradients 6P, Adam 8P, step 8P) = 8P
    assert published.accelerate_estimate(workload, "float16") == 2 * (4 * params + 4 * buffers)
    shapes = row.shapes
    s, b, h, a, layers = shapes.seq_len, row.batch_size, shapes.hidden, shapes.heads, shapes.layers
    expected = 20 * params + layers * s * b * h * (34 + 5 * a * s / h) * 2  # fp32: twice the paper's 16-bit
    assert published.deepspeed_estimate(params, row) == int(expected)


def test_summary_is_median_and_worst_over_the_rows_that_ran(published: ModuleType) -> None:
    rows = published.ROWS[:3]
    results = [
        published.Result(rows[0], int(rows[0].measured * 1.02), 1, 1, 0.0),
        published.Result(rows[1], int(rows[1].measured * 0.90), 1, 1, 0.0),
        published.Result(rows[2], None, 1, 1, 0.0, failure="RuntimeError: item 7"),
    ]
    median, worst, missing = published.summary(results, "memfit")
    assert median == pytest.approx(6.0, abs=0.01) and worst == pytest.approx(10.0, abs=0.01) and missing == 1
    text = published.markdown(results, 1.0)
    assert "fails" in text and "RuntimeError: item 7" in text and rows[0].source in text
    assert f"{14949 * MiB / GiB:.2f} GiB" in text


@pytest.fixture(scope="module")
def gpu_accuracy(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("gpu_accuracy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the path of a machine without CUDA")
def test_gpu_accuracy_refuses_without_cuda_and_dry_runs_on_the_cpu(
    gpu_accuracy: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu.json"
    assert gpu_accuracy.main(["--out", str(out)]) == 2 and not out.exists()
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert gpu_accuracy.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["zoo"] == []
    flash = next(r for r in data["attention"] if r["backend"] == "flash" and r["mask"] == "none")
    # the CPU's flash kernel keeps what CUDA's does but the 24 bytes of random-number state
    assert flash["predicted"] - flash["measured"] == 24
    softmax = next(r for r in data["autocast"] if r["op"] == "softmax.int" and r["input"] == "bfloat16")
    assert softmax["measured"] == "bfloat16" and softmax["predicted"] == "float32"  # CPU autocast is not CUDA's
    assert all(r["predicted_context"] > 0 and r["measured"] is None for r in data["fixed_costs"])
    assert all(r["predicted"] > 0 for r in data["rnn"])
    assert "attention saved bytes" in capsys.readouterr().out


def test_adam2023_updates_as_torch_adam_with_one_more_parameter_sized_intermediate(published: ModuleType) -> None:
    """The ViT rows' Adam: the same update as torch's foreach Adam, and a step that holds one
    more copy of the parameters at its peak (the intermediate torch dropped in July 2023)."""
    import memfit
    from memfit.workload import Workload

    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    theirs.load_state_dict(ours.state_dict())
    old, new = (
        published.Adam2023(ours.parameters(), lr=1e-2),
        torch.optim.Adam(theirs.parameters(), lr=1e-2, foreach=True),
    )
    for _ in range(3):
        x = torch.randn(8, 256)
        for model, optimizer in ((ours, old), (theirs, new)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b)

    def workload(make: Any) -> Workload:
        # A wide layer and one sample: the optimizer step, not the activations, sets the peak.
        return Workload(
            model=lambda: torch.nn.Linear(1024, 1024),
            make_batch=lambda n: torch.randn(n, 1024),
            loss=lambda model, batch: model(batch).square().mean(),
            optimizer=make,
            name="wide",
        )

    parameters = (1024 * 1024 + 1024) * 4
    peak_old = memfit.measure(workload(lambda p: published.Adam2023(p, lr=1e-3)), 1, "sim:1GiB").peak_allocated
    peak_new = memfit.measure(
        workload(lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True)), 1, "sim:1GiB"
    ).peak_allocated
    assert peak_old - peak_new == pytest.approx(parameters, rel=0.01)
