"""The simulated GPU: tracks real tensors, models CUDA's allocator, runs out of memory like it."""

import gc

import pytest
import torch

import memfit
from memfit.errors import DeviceError, MemfitError
from memfit.memory.devices import SimDevice
from memfit.run.steps import run_steps

MiB = 2**20


def test_allocations_and_frees_are_tracked():
    gpu = memfit.device("sim:64MiB")
    with gpu:
        x = torch.zeros(256, 1024)  # 1 MiB: small pool
        assert gpu.memory_allocated() == MiB
        assert gpu.memory_reserved() == 2 * MiB
        y = x.view(-1)  # a view shares the storage: nothing new
        assert gpu.memory_allocated() == MiB
        del x, y
        gc.collect()
        assert gpu.memory_allocated() == 0
        assert gpu.memory_reserved() == 2 * MiB  # cached, like CUDA
    gpu.empty_cache()
    assert gpu.memory_reserved() == 0


def test_raises_cudas_oom_past_the_budget():
    gpu = memfit.device("sim:2MiB")
    with gpu:
        a = torch.empty(MiB // 4)  # 1 MiB
        b = torch.empty(MiB // 4)  # 1 MiB: the 2 MiB segment is full, exactly
        with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 512 B"):
            torch.empty(1)
        del a, b
    stats = gpu.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert memfit.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB"))


def test_host_tensors_count_only_once_the_code_puts_them_on_the_device():
    w = torch.zeros(1024, 256)  # 1 MiB, made outside: a host tensor
    gpu = SimDevice(64 * MiB)
    with gpu:
        assert gpu.memory_allocated() == 0
        on_host = w + 1  # an operation on host tensors alone makes a host tensor
        assert gpu.memory_allocated() == 0
        ones = torch.ones(1024, 256)  # made inside: on the device
        _ = w + ones  # meeting a device tensor: on a GPU w must be there
        assert gpu.memory_allocated() == 3 * MiB  # w, the ones, the sum
        moved = on_host.to(gpu.torch_device)  # .to(device): the host-to-device copy
        assert gpu.memory_allocated() == 4 * MiB
        assert moved.to(gpu.torch_device) is moved and ones.to(gpu.torch_device) is ones
        assert moved is not on_host and torch.equal(moved, on_host)  # already there: nothing new
    other = torch.zeros(512)
    gpu.adopt([other])
    assert gpu.memory_allocated() == 5 * MiB + 2048  # torch.equal put on_host there too


def test_a_host_dataset_indexed_inside_the_device_is_not_charged_only_the_moved_batch():
    data = torch.randn(150 * MiB // (4 * 64), 64)  # a 150 MiB dataset on the host
    gpu = SimDevice(16 * MiB)
    model = torch.nn.Linear(64, 8)
    with gpu:
        gpu.adopt(model.parameters())
        params = gpu.memory_allocated()
        index = torch.randint(0, data.shape[0], (1024,))
        batch = data[index]  # indexing a host tensor: a host batch, on a GPU too
        window = data[5000:6024]  # a view of the host dataset
        assert gpu.memory_allocated() == params + 8192  # the index alone
        moved = batch.to(gpu.torch_device)
        assert gpu.memory_allocated() == params + 8192 + 1024 * 64 * 4
        model(moved).sum().backward()
        moved_window = window.to(gpu.torch_device)  # only the view's bytes are copied
        assert moved_window.untyped_storage().nbytes() == 1024 * 64 * 4


def test_autograd_and_optimizer_memory_is_seen():
    gpu = SimDevice(None)
    model = torch.nn.Linear(256, 256)
    with gpu:
        gpu.adopt(model.parameters())
        params = gpu.memory_allocated()
        assert params == (256 * 256 + 256) * 4
        model(torch.randn(8, 256)).sum().backward()
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.step()
        # gradients and two AdamW states per parameter; the step counters are host tensors,
        # as on CUDA (AdamW keeps `step` on the host unless capturable or fused)
        assert gpu.memory_allocated() == 4 * params


def test_each_device_has_its_own_budget_and_both_are_back_at_baseline_after_a_run():
    wl = memfit.load_workload("mlp:layers=2,width=64,features=32")
    settings = memfit.Settings(micro_batch_size=4096)  # a step peaks at 8 MiB reserved
    small, large = memfit.device("sim:4MiB"), memfit.device("sim:256MiB")
    with small:
        kept = torch.empty(MiB // 4)  # 1 MiB on the small device, alive through both runs
    with pytest.raises(torch.OutOfMemoryError):
        run_steps(wl, settings, small, steps=2)
    run_steps(wl, settings, large, steps=2)  # neither the small device's tensor nor its OOM counts here
    gc.collect()
    assert (small.memory_allocated(), large.memory_allocated()) == (MiB, 0)
    small_stats, large_stats = small.memory_stats(), large.memory_stats()
    assert (small_stats["num_ooms"], large_stats["num_ooms"]) == (1, 0)
    assert small_stats["reserved_bytes.all.peak"] <= 4 * MiB < large_stats["reserved_bytes.all.peak"]
    del kept
    gc.collect()
    assert small.memory_allocated() == 0


@pytest.mark.parametrize(
    ("spec", "kind", "capacity"),
    [
        ("sim:8GiB", SimDevice, 8 * 2**30),
        ("sim:512MiB", SimDevice, 512 * MiB),
        ("SIM:1GB", SimDevice, 10**9),
        ("cpu", SimDevice, None),
    ],
)
def test_device_specs(spec, kind, capacity):
    gpu = memfit.device(spec)
    assert isinstance(gpu, kind) and gpu.capacity == capacity


def test_auto_is_a_simulated_8_gib_gpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    gpu = memfit.device("auto")
    assert gpu.spec == "sim:8GiB" and gpu.capacity == 8 * 2**30


@pytest.mark.parametrize("spec", ["tpu", "sim", "sim:lots", "cuda:x", "cpu:3", "auto:1"])
def test_bad_device_specs(spec):
    with pytest.raises(DeviceError):
        memfit.device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_why():
    with pytest.raises(DeviceError, match="CUDA was asked for"):
        memfit.device("cuda")


def test_sim_sized_by_memory_option():
    assert memfit.device("sim", memory="1GiB").capacity == 2**30
    with pytest.raises(MemfitError):
        memfit.device("sim", memory="1 gigabyte")
