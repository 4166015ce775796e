"""The GPU table: names as the driver prints them, ambiguous names, close-name errors,
published throughput, fixed costs."""

from __future__ import annotations

import re

import pytest

from memfit.errors import MemfitError
from memfit.memory.gpus import (
    CONTEXT_BY_FAMILY,
    GPUS,
    candidates,
    cublas_workspace,
    fixed_costs,
    lookup,
    normalize_name,
)
from memfit.units import GiB, KiB, MiB

#: the range users rent or own (issue 13, item 8)
REQUIRED = [
    "V100 SXM2 16GB",
    "V100 SXM2 32GB",
    "V100 PCIe 16GB",
    "V100 PCIe 32GB",
    "T4",
    "A10",
    "A10G",
    "A30",
    "A40",
    "A100 40GB",
    "A100 80GB PCIe",
    "A100 80GB SXM",
    "L4",
    "L40",
    "L40S",
    "H100 PCIe",
    "H100 SXM",
    "H100 NVL",
    "H200",
    "GH200",
    "B200",
    "RTX 2080 Ti",
    "RTX 3060 12GB",
    "RTX 3070",
    "RTX 3080 10GB",
    "RTX 3080 12GB",
    "RTX 3090",
    "RTX 3090 Ti",
    "RTX 4060 Ti 16GB",
    "RTX 4070",
    "RTX 4080",
    "RTX 4090",
    "RTX 5090",
    "RTX A4000",
    "RTX A5000",
    "RTX A6000",
    "RTX 6000 Ada",
]


@pytest.mark.parametrize("name", REQUIRED)
def test_every_required_model_is_in_the_table(name: str) -> None:
    assert lookup(name).name == name


@pytest.mark.parametrize(
    ("printed", "expected"),
    [
        # torch.cuda.get_device_name() / nvidia-smi --query-gpu=name, as public logs show them
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA GeForce RTX 3090 Ti", "RTX 3090 Ti"),
        ("NVIDIA GeForce RTX 2080 Ti", "RTX 2080 Ti"),
        ("NVIDIA GeForce RTX 3060", "RTX 3060 12GB"),
        ("NVIDIA GeForce RTX 5090", "RTX 5090"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2 16GB"),
        ("Tesla V100-SXM2-32GB", "V100 SXM2 32GB"),
        ("Tesla V100-PCIE-16GB", "V100 PCIe 16GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        # short names, any case and separator
        ("rtx3090", "RTX 3090"),
        ("3090", "RTX 3090"),
        ("4090", "RTX 4090"),
        ("a6000", "RTX A6000"),
        ("A100_40GB", "A100 40GB"),
        ("a100-80gb-sxm", "A100 80GB SXM"),
        ("h100 sxm", "H100 SXM"),
        ("rtx-3060-12gb", "RTX 3060 12GB"),
        ("tesla t4", "T4"),
    ],
)
def test_names_as_torch_and_nvidia_smi_print_them(printed: str, expected: str) -> None:
    assert lookup(printed).name == expected


@pytest.mark.parametrize(
    ("name", "cards"),
    [
        ("V100", ["V100 SXM2 16GB", "V100 SXM2 32GB", "V100 PCIe 16GB", "V100 PCIe 32GB"]),
        ("V100 16GB", ["V100 SXM2 16GB", "V100 PCIe 16GB"]),
        ("A100", ["A100 40GB", "A100 80GB PCIe", "A100 80GB SXM"]),
        ("a100-80gb", ["A100 80GB PCIe", "A100 80GB SXM"]),
        ("H100", ["H100 PCIe", "H100 SXM"]),
        ("3080", ["RTX 3080 10GB", "RTX 3080 12GB"]),
        ("rtx3080", ["RTX 3080 10GB", "RTX 3080 12GB"]),
        ("NVIDIA GeForce RTX 3080", ["RTX 3080 10GB", "RTX 3080 12GB"]),
        ("NVIDIA GeForce RTX 4060 Ti", ["RTX 4060 Ti 8GB", "RTX 4060 Ti 16GB"]),
    ],
)
def test_a_name_that_fits_several_cards_is_refused_naming_them(name: str, cards: list[str]) -> None:
    assert [gpu.name for gpu in candidates(name)] == cards
    with pytest.raises(MemfitError) as info:
        lookup(name)
    message = str(info.value)
    assert "\n" not in message and "fits several GPUs" in message
    for card in cards:
        assert card in message


def test_a_model_word_is_not_optional() -> None:
    """ "3090" is the RTX 3090, never the 3090 Ti; "L40" is not the L40S."""
    assert [gpu.name for gpu in candidates("3090")] == ["RTX 3090"]
    assert [gpu.name for gpu in candidates("L40")] == ["L40"]
    assert [gpu.name for gpu in candidates("h100")] == ["H100 PCIe", "H100 SXM"]  # not the NVL


@pytest.mark.parametrize(
    ("typo", "close"),
    [("rtx3080x", "RTX 3080 10GB"), ("rtx 4900", "RTX 4090"), ("a1000", "A100 40GB"), ("h20", "H200")],
)
def test_a_typo_lists_close_names_in_one_line(typo: str, close: str) -> None:
    with pytest.raises(MemfitError) as info:
        lookup(typo)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"unknown GPU {typo!r}: close names: ")
    assert close in message


@pytest.mark.parametrize(("a", "b"), [("RTX 3090", "rtx-3090"), ("A100 80GB", "a100_80gb"), ("H200", " h200 ")])
def test_normalize_name_equates_spellings(a: str, b: str) -> None:
    assert normalize_name(a) == normalize_name(b)


def workspace_config_bytes(config: str) -> int:
    """Bytes of a ``CUBLAS_WORKSPACE_CONFIG`` value, read as PyTorch reads it (pytorch#83461,
    ``parseChosenWorkspaceSize``): ``:SIZE:COUNT`` pairs, SIZE in KiB, summed."""
    return sum(int(size) * KiB * int(count) for size, count in re.findall(r":([0-9]+):([0-9]+)", config))


#: PyTorch's default config when CUBLAS_WORKSPACE_CONFIG is unset (aten/src/ATen/cuda/CublasHandlePool.cpp,
#: getChosenWorkspaceSize): ``:4096:8`` from Hopper (sm90) on, ``:4096:2:16:8`` before it
@pytest.mark.parametrize(
    ("major", "config"), [(7, ":4096:2:16:8"), (8, ":4096:2:16:8"), (9, ":4096:8"), (10, ":4096:8")]
)
def test_cublas_workspace_is_pytorchs_default_config(major: int, config: str) -> None:
    assert cublas_workspace(major) == workspace_config_bytes(config)


def test_cublas_workspace_before_hopper_is_the_block_a_first_matmul_allocates() -> None:
    # https://discuss.pytorch.org/t/178671: after a first `X @ W` on a CUDA GPU,
    # torch.cuda.memory_snapshot() shows one more block, "always this fixed size: 8519680B"
    assert cublas_workspace(8) == 8519680


#: NVIDIA's published facts about each card, not memfit's table: its compute capability
#: (https://developer.nvidia.com/cuda-gpus) and the memory it is sold with, in GB (binary:
#: a "24 GB" card carries 24 GiB of DRAM), from NVIDIA's product pages and datasheets
PUBLISHED: dict[str, tuple[tuple[int, int], int]] = {
    "V100 SXM2 16GB": ((7, 0), 16),
    "V100 SXM2 32GB": ((7, 0), 32),
    "V100 PCIe 16GB": ((7, 0), 16),
    "V100 PCIe 32GB": ((7, 0), 32),
    "V100S PCIe 32GB": ((7, 0), 32),
    "T4": ((7, 5), 16),
    "A10": ((8, 6), 24),
    "A10G": ((8, 6), 24),
    "A30": ((8, 0), 24),
    "A40": ((8, 6), 48),
    "A100 40GB": ((8, 0), 40),
    "A100 80GB PCIe": ((8, 0), 80),
    "A100 80GB SXM": ((8, 0), 80),
    "L4": ((8, 9), 24),
    "L40": ((8, 9), 48),
    "L40S": ((8, 9), 48),
    "H100 PCIe": ((9, 0), 80),
    "H100 SXM": ((9, 0), 80),
    "H100 NVL": ((9, 0), 94),
    "H200": ((9, 0), 141),
    "GH200": ((9, 0), 96),
    "B200": ((10, 0), 180),
    "RTX 2080 Ti": ((7, 5), 11),
    "RTX 3060 12GB": ((8, 6), 12),
    "RTX 3070": ((8, 6), 8),
    "RTX 3080 10GB": ((8, 6), 10),
    "RTX 3080 12GB": ((8, 6), 12),
    "RTX 3090": ((8, 6), 24),
    "RTX 3090 Ti": ((8, 6), 24),
    "RTX 4060 Ti 8GB": ((8, 9), 8),
    "RTX 4060 Ti 16GB": ((8, 9), 16),
    "RTX 4070": ((8, 9), 12),
    "RTX 4080": ((8, 9), 16),
    "RTX 4090": ((8, 9), 24),
    "RTX 5090": ((12, 0), 32),
    "RTX A4000": ((8, 6), 16),
    "RTX A5000": ((8, 6), 24),
    "RTX A6000": ((8, 6), 48),
    "RTX 6000 Ada": ((8, 9), 48),
    # issue 23 (https://developer.nvidia.com/cuda-gpus; memory from NVIDIA's product pages)
    "RTX 2060": ((7, 5), 6),
    "RTX 2060 Super": ((7, 5), 8),
    "RTX 2070": ((7, 5), 8),
    "RTX 2070 Super": ((7, 5), 8),
    "RTX 2080": ((7, 5), 8),
    "RTX 2080 Super": ((7, 5), 8),
    "Titan RTX": ((7, 5), 24),
    "Quadro RTX 8000": ((7, 5), 48),
    "GTX 1650": ((7, 5), 4),
    "GTX 1650 Super": ((7, 5), 4),
    "GTX 1660": ((7, 5), 6),
    "GTX 1660 Super": ((7, 5), 6),
    "GTX 1660 Ti": ((7, 5), 6),
    "RTX 3050 8GB": ((8, 6), 8),
    "RTX 3060 Ti": ((8, 6), 8),
    "RTX 3070 Ti": ((8, 6), 8),
    "RTX 3080 Ti": ((8, 6), 12),
    "RTX 4060": ((8, 9), 8),
    "RTX 4070 Super": ((8, 9), 12),
    "RTX 4070 Ti": ((8, 9), 12),
    "RTX 4070 Ti Super": ((8, 9), 16),
    "RTX 4080 Super": ((8, 9), 16),
    "RTX 5060": ((12, 0), 8),
    "RTX 5060 Ti 8GB": ((12, 0), 8),
    "RTX 5060 Ti 16GB": ((12, 0), 16),
    "RTX 5070": ((12, 0), 12),
    "RTX 5070 Ti": ((12, 0), 16),
    "RTX 5080": ((12, 0), 16),
    "GTX 1060 3GB": ((6, 1), 3),
    "GTX 1060 6GB": ((6, 1), 6),
    "GTX 1070": ((6, 1), 8),
    "GTX 1070 Ti": ((6, 1), 8),
    "GTX 1080": ((6, 1), 8),
    "GTX 1080 Ti": ((6, 1), 11),
    "P100 PCIe 16GB": ((6, 0), 16),
    "P100 PCIe 12GB": ((6, 0), 12),
    "P100 SXM2 16GB": ((6, 0), 16),
    "P40": ((6, 1), 24),
    "RTX 3050 Laptop": ((8, 6), 4),
    "RTX 3050 Ti Laptop": ((8, 6), 4),
    "RTX 3060 Laptop": ((8, 6), 6),
    "RTX 3070 Laptop": ((8, 6), 8),
    "RTX 3070 Ti Laptop": ((8, 6), 8),
    "RTX 3080 Ti Laptop": ((8, 6), 16),
    "RTX 4050 Laptop": ((8, 9), 6),
    "RTX 4060 Laptop": ((8, 9), 8),
    "RTX 4070 Laptop": ((8, 9), 8),
    "RTX 4080 Laptop": ((8, 9), 12),
    "RTX 4090 Laptop": ((8, 9), 16),
}
#: the architecture of each compute capability (CUDA C++ Programming Guide, "Compute Capabilities")
ARCHITECTURE = {
    (6, 0): "pascal",
    (6, 1): "pascal",
    (7, 0): "volta",
    (7, 5): "turing",
    (8, 0): "ampere",
    (8, 6): "ampere",
    (8, 9): "ada",
    (9, 0): "hopper",
    (10, 0): "blackwell",
    (12, 0): "blackwell",
}


def test_published_facts_cover_the_whole_table() -> None:
    assert sorted(PUBLISHED) == sorted(gpu.name for gpu in GPUS)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_table_agrees_with_nvidias_published_capability_and_bf16(name: str) -> None:
    capability, _ = PUBLISHED[name]
    gpu = lookup(name)
    assert gpu.compute_capability == capability
    assert gpu.bf16 is (capability >= (8, 0))  # bf16 tensor cores from Ampere on
    assert gpu.family == ARCHITECTURE[capability]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_usable_memory_is_a_little_less_than_the_card_is_sold_with(name: str) -> None:
    """CUDA reports less than the DRAM on the card (the driver's reservation; ECC on T4,
    A10 and L4 takes 1/16 more): within 10 % below the published size, never above it."""
    _, sold_gib = PUBLISHED[name]
    memory = lookup(name).memory
    assert 0.9 * sold_gib * GiB <= memory < sold_gib * GiB
    assert memory % MiB == 0  # CUDA's total and nvidia-smi's are whole MiB


def test_fixed_costs_follow_the_architecture() -> None:
    """What a card loses outside PyTorch's allocator depends on its architecture alone: the
    context on the family, the cuBLAS workspace on the compute capability's major."""
    for gpu in GPUS:
        costs = fixed_costs(gpu)
        assert costs == {"cuda context": gpu.context, "cublas workspace": gpu.cublas_workspace}
        assert gpu.cublas_workspace == cublas_workspace(gpu.compute_capability[0])
        family = ARCHITECTURE[gpu.compute_capability]
        # Blackwell has no measured context yet: it takes Hopper's, the newest measured
        assert gpu.context == CONTEXT_BY_FAMILY.get(family, CONTEXT_BY_FAMILY["hopper"])
    hopper, ampere = lookup("H100 SXM"), lookup("A100 80GB SXM")
    assert hopper.cublas_workspace == workspace_config_bytes(":4096:8") > ampere.cublas_workspace


def test_table_entries_serialize_their_capability_and_costs() -> None:
    data = lookup("RTX 3090").to_dict()
    assert data["compute_capability"] == "8.6" and data["memory"] == lookup("RTX 3090").memory
    assert (data["context"], data["cublas_workspace"]) == tuple(fixed_costs(lookup("RTX 3090")).values())
    assert data["fp16_tensor"] == 71e12 and data["bandwidth"] == 936e9
    # the three kinds of number the docstring explains
    assert {gpu.memory_source for gpu in GPUS} == {"torch", "smi", "spec"}


@pytest.mark.parametrize(
    ("name", "fp32", "tf32", "bf16", "fp16", "bandwidth"),
    [
        # dense figures of the datasheets (the sparse ones are twice these)
        ("A100 80GB SXM", 19.5, 156, 312, 312, 2039),
        ("H100 SXM", 67, 494.5, 989.5, 989.5, 3350),
        ("V100 SXM2 16GB", 15.7, None, None, 125, 900),
        ("T4", 8.1, None, None, 65, 320),
        ("L4", 30.3, 60, 121, 121, 300),
        # GeForce: fp16 with fp32 accumulate runs at half the fp16-accumulate rate
        ("RTX 3090", 35.6, 35.6, 71, 71, 936),
        ("RTX 4090", 82.6, 82.6, 165.2, 165.2, 1008),
    ],
)
def test_published_dense_throughput_and_bandwidth(
    name: str, fp32: float, tf32: float | None, bf16: float | None, fp16: float, bandwidth: float
) -> None:
    gpu = lookup(name)
    assert gpu.fp32 == pytest.approx(fp32 * 1e12)
    assert gpu.tf32 == (None if tf32 is None else pytest.approx(tf32 * 1e12))
    assert gpu.bf16_tensor == (None if bf16 is None else pytest.approx(bf16 * 1e12))
    assert gpu.fp16_tensor == pytest.approx(fp16 * 1e12)
    assert gpu.bandwidth == pytest.approx(bandwidth * 1e9)


def test_table_facts_are_consistent() -> None:
    names = [gpu.name for gpu in GPUS]
    assert len(names) == len(set(names))
    for gpu in GPUS:
        assert gpu.memory % MiB == 0 and gpu.memory > 2 * 2**30
        assert gpu.bf16 == (gpu.compute_capability >= (8, 0))
        assert gpu.memory_source in ("torch", "smi", "spec")
        assert gpu.spec_source
        if gpu.has_peaks:  # a laptop part has none (its clocks are the laptop's)
            assert gpu.bf16 == (gpu.bf16_tensor is not None) == (gpu.tf32 is not None)
            # tensor cores from Volta on, except the GTX 16 cards
            assert (gpu.fp16_tensor is not None) == (gpu.compute_capability >= (7, 0) and "GTX" not in gpu.name)
            assert 0 < gpu.fp32 < (gpu.fp16_tensor or float("inf")) and gpu.bandwidth > 0
        else:
            assert gpu.fp32 == gpu.bandwidth == 0 and "Laptop" in gpu.name
        assert gpu.to_dict()["compute_capability"].count(".") == 1
        # every spelling of a card finds that card
        for spelling in (gpu.name, *gpu.aliases):
            assert lookup(spelling) is gpu


def test_a_simulated_card_follows_its_own_compute_capability():
    from memfit.memory.devices import device

    ampere, volta = device("sim:RTX 3090"), device("sim:Tesla V100-SXM2-32GB")
    assert ampere.cuda is not None and ampere.cuda.capability == (8, 6)
    assert volta.cuda is not None and volta.cuda.capability == (7, 0)
