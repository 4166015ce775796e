"""Activation checkpointing finds the blocks that run in forward, across containers, and
changes nothing but memory: the same gradients, the same buffers, the same random draws.

The models: a ResNet-18-like network (BatchNorm, two BasicBlocks per stage in four
``Sequential`` stages, a downsampling shortcut) and a tiny diffusion UNet (down and up
blocks in ``ModuleList`` containers that forward iterates, never calls)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memfit
from memfit.errors import MemfitError
from memfit.run.checkpointing import parse, recomputes_no_more
from memfit.run.settings import Settings


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18Like(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        chans = [width, width * 2, width * 4, width * 8]
        cin = width
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c)))
            cin = c
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(temb, cout)
        self.norm2 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(t)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class TinyUNet(nn.Module):
    """Down and up blocks in ModuleLists iterated in forward (as diffusion UNets do)."""

    def __init__(self, ch: int = 8, temb: int = 16) -> None:
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(1, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList([ResBlock(ch, ch, temb), ResBlock(ch, 2 * ch, temb)])
        self.pool = nn.AvgPool2d(2)
        self.mid = ResBlock(2 * ch, 2 * ch, temb)
        self.up = nn.ModuleList([ResBlock(4 * ch, ch, temb), ResBlock(2 * ch, ch, temb)])
        self.out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = self.temb(t)
        h = self.inp(x)
        skips = []
        for block in self.down:
            h = block(h, t)
            skips.append(h)
            h = self.pool(h)
        h = self.mid(h, t)
        for block in self.up:
            h = F.interpolate(h, scale_factor=2.0)
            h = block(torch.cat([h, skips.pop()], dim=1), t)
        return self.out(h)


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return ResNet18Like()


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return TinyUNet()


RESNET = memfit.Workload(
    model=_resnet,
    make_batch=lambda n: (torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))),
    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    name="resnet18-like",
)
UNET = memfit.Workload(
    model=_unet,
    make_batch=lambda n: (torch.randn(n, 3, 16, 16), torch.rand(n, 1)),
    loss=lambda m, b: m(b[0], b[1]).square().mean(),
    name="tiny-unet",
)


def _train(model: nn.Module, batch: tuple[torch.Tensor, ...], policy: str, steps: int = 2):
    """Two forward/backward passes (gradients accumulate) under ``policy``."""
    model = copy.deepcopy(model)
    applied = Settings(checkpointing=policy).apply(model)
    torch.manual_seed(1)
    for _ in range(steps):
        model(*batch).square().mean().backward()
    applied.undo()
    return model, applied.checkpointed


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    grads = all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    buffers = all(torch.equal(p, q) for p, q in zip(a.buffers(), b.buffers(), strict=True))
    return grads and buffers


def test_resnet_blocks_are_all_eight_basic_blocks_of_the_four_stages() -> None:
    model, batch = _resnet(), (torch.randn(4, 3, 16, 16),)
    _, done = _train(model, batch, "blocks")
    assert done.modules == [(f"layer{s}.{i}", "BasicBlock") for s in range(1, 5) for i in range(2)]
    assert done.describe() == "8 x BasicBlock"


def test_unet_blocks_in_modulelists_whose_forward_never_runs_are_found() -> None:
    model, batch = _unet(), (torch.randn(2, 3, 16, 16), torch.rand(2, 1))
    _, done = _train(model, batch, "blocks")
    assert [path for path, _ in done.modules] == ["down.0", "down.1", "mid", "up.0", "up.1"]


@pytest.mark.parametrize(
    "policy", ["blocks", "every:2", "first:3", "modules:BasicBlock", "modules:layer2", "selective"]
)
def test_resnet_gradients_and_batchnorm_buffers_equal_the_unchanged_run(policy: str) -> None:
    model, batch = _resnet(), (torch.randn(4, 3, 16, 16),)
    reference, _ = _train(model, batch, "none")
    checkpointed, done = _train(model, batch, policy)
    assert done.modules  # something was checkpointed
    assert _same_state(reference, checkpointed)
    bn = checkpointed.layer1[0].bn1
    assert int(bn.num_batches_tracked) == 2  # two forwards, not four (recompute put back)


@pytest.mark.parametrize("policy", ["blocks", "selective", "every:2"])
def test_unet_gradients_equal_the_unchanged_run(policy: str) -> None:
    model, batch = _unet(), (torch.randn(2, 3, 16, 16), torch.rand(2, 1))
    reference, _ = _train(model, batch, "none")
    checkpointed, _ = _train(model, batch, policy)
    assert _same_state(reference, checkpointed)


def test_plain_torch_checkpoint_updates_batchnorm_stats_twice() -> None:
    """What memfit avoids: torch's recompute runs BatchNorm's update again."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    x = torch.randn(8, 3, requires_grad=True)
    checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


def test_dropout_draws_and_rng_are_those_of_the_unchanged_run() -> None:
    """The look-ahead forward and the recompute draw nothing the unchanged run would not."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.fc(x)).relu()

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 1))
    batch = (torch.randn(16, 8),)
    reference, _ = _train(model, batch, "none")
    after_reference = torch.get_rng_state()
    checkpointed, done = _train(model, batch, "blocks")
    assert len(done.modules) == 2
    assert torch.equal(torch.get_rng_state(), after_reference)
    assert _same_state(reference, checkpointed)


@pytest.mark.parametrize("workload", [RESNET, UNET], ids=["resnet", "unet"])
def test_checkpointing_lowers_the_peak_on_the_simulated_gpu(workload: memfit.Workload) -> None:
    plain = memfit.measure(workload, 8, "sim:1GiB", Settings())
    blocks = memfit.measure(workload, 8, "sim:1GiB", Settings(checkpointing="blocks"))
    every2 = memfit.measure(workload, 8, "sim:1GiB", Settings(checkpointing="every:2"))
    assert blocks.peak_allocated < every2.peak_allocated < plain.peak_allocated


def test_a_model_without_repeated_blocks_is_refused_at_its_first_forward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    applied = Settings(checkpointing="blocks").apply(model)
    with pytest.raises(MemfitError, match="found no repeated blocks"):
        model(torch.randn(2, 4))
    applied.undo()


def test_modules_that_never_run_are_refused_with_the_blocks_that_do() -> None:
    model = _resnet()
    applied = Settings(checkpointing="modules:Bottleneck").apply(model)
    with pytest.raises(MemfitError, match=r"no module of that class or path runs in forward .*8 x BasicBlock"):
        model(torch.randn(2, 3, 16, 16))
    applied.undo()


def test_a_no_grad_forward_waits_for_the_training_one() -> None:
    model = _resnet()
    applied = Settings(checkpointing="blocks").apply(model)
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16))
    assert not applied.checkpointed.found
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert applied.checkpointed.found and len(applied.checkpointed.modules) == 8
    applied.undo()
    assert "forward" not in model.layer1[0].__dict__


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("every:0", "at least 1"),
        ("first:x", "whole number"),
        ("modules:", "unknown checkpointing"),
        ("budget", "plan axis"),
        ("some", "unknown checkpointing"),
    ],
)
def test_bad_policies_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(MemfitError, match=message):
        Settings(checkpointing=text)


def test_recomputation_order() -> None:
    assert recomputes_no_more("none", "selective") and recomputes_no_more("every:4", "every:2")
    assert not recomputes_no_more("every:2", "every:3") and not recomputes_no_more("selective", "every:2")
    assert recomputes_no_more("first:1", "first:3") and not recomputes_no_more("blocks", "first:3")
    assert parse("modules:Down+Up").names == ("Down", "Up")


@pytest.mark.parametrize("workload", [RESNET, UNET], ids=["resnet", "unet"])
@pytest.mark.parametrize("policy", ["none", "blocks", "every:2", "first:2", "selective"])
def test_estimate_equals_the_simulated_gpu_to_the_byte_under_each_policy(
    workload: memfit.Workload, policy: str
) -> None:
    settings = Settings(checkpointing=policy)
    measured = memfit.measure(workload, 8, "sim:1GiB", settings)
    estimated = memfit.estimate(workload, 8, settings, device="sim:1GiB", speed=False)
    assert (estimated.peak_allocated, estimated.peak_reserved) == (measured.peak_allocated, measured.peak_reserved)


def test_estimate_names_the_checkpointed_modules_and_the_memory_saved() -> None:
    plain = memfit.estimate(RESNET, 8, Settings(), device="sim:1GiB", speed=False)
    est = memfit.estimate(RESNET, 8, Settings(checkpointing="every:2"), device="sim:1GiB", speed=False)
    assert est.checkpointed == "4 x BasicBlock"
    assert est.checkpointed_modules == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert est.checkpointing_saves == plain.peak_allocated - est.peak_allocated > 0
    assert plain.checkpointed == "" and plain.checkpointing_saves is None


def test_the_recompute_is_in_the_predicted_step_time() -> None:
    """The fake steps really recompute, so the operation counter counts it; selective
    checkpointing recomputes no convolution, so it runs fewer kernels than whole blocks."""
    times = {
        policy: memfit.estimate(RESNET, 8, Settings(checkpointing=policy), device="sim:1GiB").predicted_time
        for policy in ("none", "selective", "blocks")
    }
    assert times["none"]["kernels"] < times["selective"]["kernels"] < times["blocks"]["kernels"]
    assert times["blocks"]["seconds_per_step"] > times["none"]["seconds_per_step"]


def test_plan_shows_a_checkpointing_mode_that_saves_nothing_and_drops_it() -> None:
    """Checkpointing single Linear layers keeps their inputs all the same: nothing saved."""
    wl = memfit.load_workload("mlp:layers=2,width=32,features=32")
    result = memfit.plan(wl, 8, "sim:64MiB", precisions=["fp32"], checkpointing=["none", "modules:Linear"])
    dropped = [c for c in result.candidates if c.settings.checkpointing == "modules:Linear"]
    assert dropped and all(c.status == "saves nothing (4 x Linear)" for c in dropped)
    assert all(c.measurement is None for c in dropped)
    assert result.recommended.settings.checkpointing == "none"


def test_plan_budget_recomputes_the_fewest_blocks_that_fit() -> None:
    """On a device where the whole micro-batch does not fit without checkpointing, the
    budget axis offers first:N steps and the plan takes the fewest blocks that fit."""
    result = memfit.plan(RESNET, 64, "sim:12MiB", precisions=["fp32"], checkpointing=["none", "budget"])
    modes = {c.settings.checkpointing for c in result.candidates}
    assert modes == {"none", "first:2", "first:4", "first:6", "blocks"}
    best = result.recommended.settings
    assert (best.micro_batch_size, best.checkpointing) == (64, "first:2")
    too_big = next(
        c for c in result.candidates if c.settings.checkpointing == "none" and c.settings.micro_batch_size == 64
    )
    assert not too_big.fits


def test_blocks_are_named_by_their_own_class_under_fsdp2() -> None:
    """FSDP2 makes each unit an ``FSDPMLPBlock``: ``modules:MLPBlock`` still matches, and
    the estimate names the class the code has."""
    settings = Settings(checkpointing="modules:MLPBlock", world_size=2, shard="full")
    est = memfit.estimate("mlp:layers=4,width=64,features=64", 64, settings, device="sim:1GiB")
    assert est.method == "traced" and est.checkpointed == "4 x MLPBlock"
    assert est.checkpointing_saves is not None and est.checkpointing_saves > 0


def test_a_model_whose_own_forward_never_runs_is_checkpointed_where_it_is_called() -> None:
    """A wrapper (a LightningModule, say) whose step calls ``self.net`` and a loss module."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _resnet()
            self.criterion = nn.CrossEntropyLoss()

        def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.criterion(self.net(x), y)

    torch.manual_seed(0)
    wrapper = Wrapper()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    reference = copy.deepcopy(wrapper)
    reference.step(x, y).backward()
    applied = Settings(checkpointing="blocks").apply(wrapper)
    wrapper.step(x, y).backward()
    applied.undo()
    assert applied.checkpointed.describe() == "8 x BasicBlock"
    assert applied.checkpointed.modules[0] == ("net.layer1.0", "BasicBlock")
    assert _same_state(reference, wrapper)


def test_lightning_callback_applies_checkpointing_and_trains_exactly_as_without() -> None:
    import lightning.pytorch as pl

    from memfit.integrations.lightning import MemfitCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _resnet()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.arange(8) % 10)
            return torch.utils.data.DataLoader(data, batch_size=4)

    def train(callbacks: list[pl.Callback]) -> Classifier:
        torch.manual_seed(0)
        module = Classifier()
        pl.Trainer(
            max_steps=2,
            accelerator="cpu",
            devices=1,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module)
        return module

    reference = train([])
    callback = MemfitCallback(probe=False, guard=False, monitor=False, checkpointing="every:2")
    trained = train([callback])
    assert callback.applied is not None and callback.applied.checkpointed.describe() == "4 x BasicBlock"
    assert "forward" not in trained.net.layer1[0].__dict__  # undone at fit end
    for (name, a), b in zip(reference.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_megatron_activation_formulas_per_layer_are_reproduced() -> None:
    """Korthikanti et al. (arXiv:2205.05198): a GPT layer keeps 34sbh + 5as^2b bytes for
    backward, 34sbh with the attention core recomputed, 2sbh with the whole layer
    recomputed; memfit adds LayerNorm's saved statistics (2 norms x 2 x sb fp16 values),
    which the formula leaves out. The model and the count are bench/checkpointing_policies.py's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "checkpointing_policies.py"
    spec = importlib.util.spec_from_file_location("checkpointing_policies", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.S, bench.B, bench.H, bench.A = s, b, h, a = 64, 2, 64, 4
    norms = 2 * 2 * s * b * 2
    assert bench.per_layer("none") == 34 * s * b * h + 5 * a * s * s * b + norms
    assert bench.per_layer("modules:CoreAttention") == 34 * s * b * h + norms
    assert bench.per_layer("blocks") == 2 * s * b * h
