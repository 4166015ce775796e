"""MemfitCallback on modules it cannot drive: manual optimization is refused in one line before
anything runs; a training_step without batch_idx is probed as Lightning calls it (issue 20, item 8)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

lightning = pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from memfit.errors import MemfitError  # noqa: E402
from memfit.integrations.lightning import MemfitCallback  # noqa: E402


def loader(batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=generator), torch.randn(256, 1, generator=generator))
    return DataLoader(data, batch_size=batch_size)


class ManualGAN(pl.LightningModule):
    """A GAN-template module: two optimizers stepped by hand, training_step without batch_idx."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = 32
        self.generator = torch.nn.Linear(16, 16)
        self.discriminator = torch.nn.Linear(16, 1)
        self.steps_run = 0

    def training_step(self, batch: Any) -> None:
        self.steps_run += 1
        g_opt, d_opt = self.optimizers()
        real, _ = batch
        fake = self.generator(torch.randn_like(real))
        g_loss = -self.discriminator(fake).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())]

    def train_dataloader(self) -> DataLoader:
        return loader(self.batch_size)


class NoBatchIdx(pl.LightningModule):
    """Automatic optimization with ``training_step(self, batch)``: Lightning allows leaving batch_idx out."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return loader(self.batch_size)


def trainer(callback: MemfitCallback) -> pl.Trainer:
    return pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.mark.parametrize(("probe", "guard"), [(True, True), (True, False), (False, True)])
def test_manual_optimization_is_refused_in_one_line_before_anything_runs(probe: bool, guard: bool) -> None:
    module = ManualGAN()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(MemfitError, match=r"ManualGAN uses manual optimization \(automatic_optimization = False\)"):
        trainer(MemfitCallback(probe=probe, guard=guard, monitor=False, device="sim:64MiB")).fit(module)
    assert module.steps_run == 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_manual_optimization_keeps_the_memory_monitor() -> None:
    module = ManualGAN()
    callback = MemfitCallback(probe=False, guard=False, monitor=True, device="sim:64MiB")
    trainer(callback).fit(module)
    # (max_steps counts optimizer steps: two per training_step here)
    assert module.steps_run >= 1 and callback.memory is not None
    assert len(callback.memory.records) == module.steps_run


def test_a_training_step_without_batch_idx_is_probed() -> None:
    module = NoBatchIdx()
    callback = MemfitCallback(probe=True, guard=False, monitor=False, device="sim:8MiB", max_batch_size=64)
    trainer(callback).fit(module)
    assert callback.result is not None and callback.result.max_batch_size >= 1
    assert module.batch_size == callback.result.headroom_batch_size
