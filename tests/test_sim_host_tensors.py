"""The simulated GPU holds what a real GPU would hold: a host dataset indexed inside the device,
and the host side of a batch, are not charged; Guard splits on device memory (issue 20, item 7)."""

from __future__ import annotations

import torch
from torch import nn

import memfit
from memfit import Guard, Workload

MiB = 2**20


def test_a_host_dataset_tensor_indexed_inside_the_device_trains_as_on_a_gpu() -> None:
    data = torch.randn(150 * MiB // (4 * 64), 64)  # 150 MiB on the host, made outside
    targets = torch.randint(0, 10, (data.shape[0],))
    gpu = memfit.device("sim:64MiB")

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, data.shape[0], (n,))
        return data[index], targets[index]  # host batches, as a DataLoader over the dataset gives

    workload = Workload(
        model=lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
        make_batch=make_batch,
        loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
        name="host-dataset",
    )
    measured = memfit.measure(workload, 256, gpu)
    assert measured.fits and measured.peak_allocated < 4 * MiB  # the 150 MiB stay on the host
    estimated = memfit.estimate(workload, 256, device=gpu, speed=False)
    assert (estimated.peak_allocated, estimated.peak_reserved) == (measured.peak_allocated, measured.peak_reserved)


def test_guard_does_not_shrink_a_host_batch_whose_device_side_fits() -> None:
    gpu = memfit.device("sim:32MiB")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # 4096 samples: their 64 MiB of raw host data would not fit in 32 MiB; only the 32
    # features of each go to the device
    batch = {"features": torch.randn(4096, 32), "raw": torch.randn(4096, 4096), "y": torch.randn(4096, 1)}
    seen_on_host = []

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        seen_on_host.append(float(b["raw"].abs().mean()))  # host-side work, as a logger does
        x, y = b["features"].to(gpu.torch_device), b["y"].to(gpu.torch_device)
        return nn.functional.mse_loss(m(x), y)

    guard = Guard(model, optimizer, loss, device=gpu)
    with gpu:
        gpu.adopt(model.parameters())
        guard.step(batch)
        peak = gpu.memory_stats()["allocated_bytes.all.peak"]
    assert guard.events == [] and len(seen_on_host) == 1
    assert peak < 8 * MiB  # the device-side micro-batch (4096 x 32 and its activations), not the raw data
