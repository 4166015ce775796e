"""MemfitCallback with the real ``lightning`` package, on simulated GPUs.

Run as a script by torchrun (``python -m torch.distributed.run --nproc-per-node 2
tests/test_integration_lightning.py OUT``), this file is also the DDP job the DDP tests
start: two gloo processes, Lightning's ``ddp`` strategy on the CPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

lightning = pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from memfit.errors import MemfitError  # noqa: E402
from memfit.guard.check import checking  # noqa: E402
from memfit.integrations.effective_batch import split_target  # noqa: E402
from memfit.integrations.lightning import (  # noqa: E402
    MEMORY_METRICS,
    MemfitCallback,
    add_gradients,
    batch_maker,
    first_optimizer,
    loss_of,
    set_aside_gradients,
)
from memfit.search.trials import trial_line  # noqa: E402

SAMPLES = 2048
#: on this budget a training step at batch 1024 runs out of memory (the 2048-sample dataset
#: stays on the host, as on a GPU); the probe, by multiples of 64, proves 384 fits and 448 does not
TIGHT = "sim:6MiB"
#: under DDP the guard also needs room for a flat copy of the gradients when it averages them
DDP_TIGHT = "sim:8MiB"


class Regression(pl.LightningModule):
    """A small MLP without dropout or BatchNorm, so a split batch gives the same gradient."""

    def __init__(self, batch_size: int = 512) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(SAMPLES, 64, generator=generator)
        targets = torch.randn(SAMPLES, 1, generator=generator)
        return DataLoader(TensorDataset(inputs, targets), batch_size=self.batch_size)


class MemoryLogger(Logger):
    """A real Lightning logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def fit(
    batch_size: int,
    callbacks: list[pl.Callback] | None = None,
    *,
    steps: int = 2,
    accumulate: int = 1,
    logger: Logger | bool = False,
    **trainer_options: Any,
) -> Regression:
    torch.manual_seed(0)
    model = Regression(batch_size)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=trainer_options.pop("devices", 1),
        callbacks=callbacks or [],
        accumulate_grad_batches=accumulate,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )
    trainer.fit(model)
    return model


def assert_same_weights(model: torch.nn.Module, reference: dict[str, torch.Tensor] | torch.nn.Module) -> None:
    expected = reference if isinstance(reference, dict) else reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


# -- pure helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [(torch.tensor(2.0), 2.0), ({"loss": torch.tensor(3.0), "acc": 1}, 3.0)],
)
def test_loss_of_finds_the_loss(output: Any, expected: float) -> None:
    assert float(loss_of(output)) == expected


@pytest.mark.parametrize("output", [None, {"acc": torch.tensor(1.0)}, 1.5])
def test_loss_of_refuses_outputs_without_a_loss(output: Any) -> None:
    with pytest.raises(MemfitError, match="training_step returned"):
        loss_of(output)


@pytest.mark.parametrize(
    ("target", "world", "fits", "expected"),
    [
        (512, 1, 256, (256, 2)),
        (512, 1, 512, (512, 1)),
        (2048, 2, 512, (512, 2)),
        (96, 2, 40, (24, 2)),
        (7, 1, 3, (1, 7)),
    ],
)
def test_split_target_is_exact_with_the_fewest_accumulation_steps(
    target: int, world: int, fits: int, expected: tuple[int, int]
) -> None:
    batch, accumulation = split_target(target, world, fits)
    assert (batch, accumulation) == expected
    assert batch * accumulation * world == target and batch <= fits


@pytest.mark.parametrize(("target", "world", "fits"), [(7, 2, 8), (0, 1, 8), (8, 1, 0)])
def test_split_target_refuses_what_cannot_be_split(target: int, world: int, fits: int) -> None:
    with pytest.raises(MemfitError):
        split_target(target, world, fits)


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


@pytest.mark.parametrize("shape", ["bare", "list", "dict", "pair"])
def test_first_optimizer_reads_every_configure_optimizers_shape(shape: str) -> None:
    optimizer = _sgd()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    configured = {
        "bare": optimizer,
        "list": [optimizer, _sgd()],
        "dict": {"optimizer": optimizer, "lr_scheduler": scheduler},
        "pair": ([optimizer], [scheduler]),
    }[shape]
    assert first_optimizer(configured) is optimizer


def test_first_optimizer_refuses_none() -> None:
    with pytest.raises(MemfitError, match="no optimizer"):
        first_optimizer(None)


@pytest.mark.parametrize("n", [1, 3, 7])
def test_batch_maker_cycles_the_dataset_through_the_collate_function(n: int) -> None:
    data = TensorDataset(torch.arange(3.0))
    (batch,) = batch_maker(DataLoader(data, batch_size=2))(n)
    assert batch.tolist() == [float(i % 3) for i in range(n)]


def test_batch_maker_needs_a_map_style_dataset() -> None:
    with pytest.raises(MemfitError, match="make_batch"):
        batch_maker(object())


def test_gradients_set_aside_come_back_added() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.ones(2)
    taken = set_aside_gradients(params)
    assert [p.grad for p in params] == [None, None]
    params[0].grad = torch.full((2,), 2.0)
    add_gradients(params, taken)
    assert params[0].grad.tolist() == [3.0, 3.0]
    assert params[1].grad is None


def test_target_needs_the_probe() -> None:
    with pytest.raises(MemfitError, match="probe=True"):
        MemfitCallback(probe=False, target_batch_size=64)


# -- one process ------------------------------------------------------------------------------


def test_the_guard_recovers_an_oom_and_gives_the_unsplit_weights(caplog: pytest.LogCaptureFixture) -> None:
    reference = fit(1024)
    callback = MemfitCallback(probe=False, device=TIGHT)
    with caplog.at_level(logging.INFO):
        model = fit(1024, [callback])
    assert callback.splitter is not None
    assert [e.micro_batch_before for e in callback.splitter.events][:1] == [1024]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit guard: out of memory")]
    assert said == [event.describe() for event in callback.splitter.events]  # one line per recovery
    assert callback.splitter.micro_batch_size is not None and callback.splitter.micro_batch_size < 1024
    assert_same_weights(model, reference)
    assert "training_step" not in vars(model)  # the wrapper is gone after fit


class SummedRegression(Regression):
    """The same MLP with a summed loss (as pytorch/examples' VAE): split micro-batches weigh 1 each."""

    logged = 0
    calls = 0
    checked = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        SummedRegression.calls += 1
        SummedRegression.checked += int(checking())
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets, reduction="sum") / 1024
        self.log("train_loss", loss)
        return loss

    def log(self, *args: Any, **kwargs: Any) -> None:
        SummedRegression.logged += 1


def test_the_guard_weights_a_summed_loss_as_the_check_finds_it() -> None:
    def run(callbacks: list[pl.Callback]) -> tuple[pl.LightningModule, int]:
        torch.manual_seed(0)
        model = SummedRegression(1024)
        SummedRegression.logged = SummedRegression.calls = SummedRegression.checked = 0
        trainer = pl.Trainer(
            max_steps=2,
            accelerator="cpu",
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        return model, SummedRegression.logged

    reference, _ = run([])
    callback = MemfitCallback(probe=False, monitor=False, device=TIGHT)
    model, logged = run([callback])
    assert callback.splitter is not None and callback.splitter.events
    assert callback.splitter.weighting is not None and callback.splitter.weighting.name == "sum"
    assert_same_weights(model, reference)
    # the check ran once, on a few samples together and one by one: those calls logged nothing
    # (nor did the calls that ran out of memory in forward, before their self.log)
    in_forward = sum(e.where == "forward" for e in callback.splitter.events)
    assert SummedRegression.checked >= 3
    assert logged == SummedRegression.calls - SummedRegression.checked - in_forward


def test_without_the_guard_the_same_run_runs_out_of_memory() -> None:
    with pytest.raises(torch.OutOfMemoryError):
        fit(1024, [MemfitCallback(probe=False, guard=False, monitor=False, device=TIGHT)])


def test_the_probe_keeps_the_target_batch_exact_with_accumulation(caplog: pytest.LogCaptureFixture) -> None:
    reference = fit(1024)
    callback = MemfitCallback(device=TIGHT, target_batch_size=1024, multiple_of=64, max_batch_size=1024, headroom=0)
    with caplog.at_level(logging.INFO):
        model = fit(64, [callback])
    assert callback.result is not None
    assert callback.result.max_batch_size == 384  # as on a fresh device: 448 does not fit
    # the probe says what it does, one line per trial, on Lightning's console logger
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfit: probe")]
    assert lines[0].startswith("memfit: probe · real trials: the workload's model is an instance")
    trials = [line for line in lines if line.startswith("memfit: probe · batch")]
    assert trials == [f"memfit: probe · batch {t.batch_size}: {trial_line(t)}" for t in callback.result.trials]
    assert any("memfit: probing the batch size" in r.getMessage() for r in caplog.records)
    assert (callback.batch_size, callback.accumulation) == (256, 4)  # 1024 = 256 x 4: 384 does not divide it
    assert model.batch_size == 256
    assert_same_weights(model, reference)


def test_memory_is_logged_per_step_to_the_trainers_logger() -> None:
    logger = MemoryLogger()
    callback = MemfitCallback(probe=False, device="sim:64MiB")
    fit(256, [callback], steps=3, logger=logger)
    logged = [(step, metrics) for step, metrics in logger.metrics if "memfit/allocated" in metrics]
    assert callback.memory is not None
    assert [step for step, _ in logged] == [1, 2, 3]
    assert [m for _, m in logged] == [
        {name: float(record[key]) for name, key in MEMORY_METRICS.items()} for record in callback.memory.records
    ]
    assert all(m["memfit/peak_allocated"] > 0 for _, m in logged)


# -- DDP: two gloo processes under torchrun ---------------------------------------------------


def _ddp_main(out: Path) -> None:
    """The torchrun job: a guarded run where only rank 1 runs out of memory, then a probed one."""
    rank = int(os.environ["RANK"])
    options = {"devices": 2, "strategy": "ddp", "num_nodes": 1}

    # 1. per rank a batch of 1024: rank 0 has room, rank 1 runs out of memory.
    guard = MemfitCallback(probe=False, device=lambda r: "cpu" if r == 0 else DDP_TIGHT)
    model = fit(1024, [guard], **options)
    torch.save(
        {"state": model.state_dict(), "events": len(guard.splitter.events) if guard.splitter else -1},
        out / f"guard-{rank}.pt",
    )

    # 2. a target of 2048 over both ranks: each probes its own device, they agree on 512.
    probe = MemfitCallback(
        device=lambda r: "sim:64MiB" if r == 0 else DDP_TIGHT,
        target_batch_size=2048,
        multiple_of=64,
        max_batch_size=512,
        headroom=0,
    )
    model = fit(64, [probe], **options)
    torch.save(
        {"state": model.state_dict(), "batch": (probe.batch_size, probe.accumulation)},
        out / f"probe-{rank}.pt",
    )


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", __file__, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return out


@pytest.mark.timeout(200)
def test_ddp_guard_recovers_an_oom_on_one_rank_only(ddp_run: Path) -> None:
    # Each rank took 1024 samples per step, interleaved: together all 2048, in order.
    reference = fit(2048).state_dict()
    results = [torch.load(ddp_run / f"guard-{rank}.pt") for rank in (0, 1)]
    # rank 1 ran out of memory; both ranks recorded it and re-ran the batch in halves
    assert results[0]["events"] == results[1]["events"] >= 1
    for result in results:
        assert_same_weights_dict(result["state"], reference)
    for name, value in results[0]["state"].items():
        assert torch.equal(value, results[1]["state"][name]), name


@pytest.mark.timeout(200)
def test_ddp_probe_agrees_on_one_batch_and_keeps_the_target(ddp_run: Path) -> None:
    reference = fit(2048).state_dict()
    results = [torch.load(ddp_run / f"probe-{rank}.pt") for rank in (0, 1)]
    assert [r["batch"] for r in results] == [(512, 2), (512, 2)]
    for result in results:
        assert_same_weights_dict(result["state"], reference)


def assert_same_weights_dict(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


if __name__ == "__main__":
    _ddp_main(Path(sys.argv[1]))
