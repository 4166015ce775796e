"""The GPU table: name lookup, close-name errors, fixed costs."""

from __future__ import annotations

import re

import pytest

from memfit.errors import MemfitError
from memfit.memory.gpus import CONTEXT_BY_FAMILY, GPUS, cublas_workspace, fixed_costs, lookup, normalize_name
from memfit.units import GiB, KiB, MiB

REQUIRED = [
    "RTX 3060 12GB",
    "RTX 3090",
    "RTX 4090",
    "T4",
    "V100 16GB",
    "V100 32GB",
    "A10",
    "L4",
    "A100 40GB",
    "A100 80GB",
    "H100 80GB",
    "H200",
]


@pytest.mark.parametrize("name", REQUIRED)
def test_every_required_model_is_in_the_table(name: str) -> None:
    assert lookup(name).name == name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rtx3090", "RTX 3090"),
        ("RTX 3090", "RTX 3090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("a100-80gb", "A100 80GB"),
        ("A100_40GB", "A100 40GB"),
        ("tesla t4", "T4"),
        ("h100", "H100 80GB"),
        ("rtx-3060-12gb", "RTX 3060 12GB"),
    ],
)
def test_lookup_is_tolerant_of_case_spaces_and_hyphens(text: str, expected: str) -> None:
    assert lookup(text).name == expected


@pytest.mark.parametrize(("a", "b"), [("RTX 3090", "rtx-3090"), ("A100 80GB", "a100_80gb"), ("H200", " h200 ")])
def test_normalize_name_equates_spellings(a: str, b: str) -> None:
    assert normalize_name(a) == normalize_name(b)


def test_unknown_name_lists_close_names_in_one_line() -> None:
    with pytest.raises(MemfitError) as info:
        lookup("rtx3080")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("unknown GPU 'rtx3080': close names: ")
    assert "RTX 3090" in message


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
    "RTX 3060 12GB": ((8, 6), 12),
    "RTX 3090": ((8, 6), 24),
    "RTX 4090": ((8, 9), 24),
    "T4": ((7, 5), 16),
    "V100 16GB": ((7, 0), 16),
    "V100 32GB": ((7, 0), 32),
    "A10": ((8, 6), 24),
    "L4": ((8, 9), 24),
    "A100 40GB": ((8, 0), 40),
    "A100 80GB": ((8, 0), 80),
    "H100 80GB": ((9, 0), 80),
    "H200": ((9, 0), 141),
}
#: the architecture of each compute capability (CUDA C++ Programming Guide, "Compute Capabilities")
ARCHITECTURE = {(7, 0): "volta", (7, 5): "turing", (8, 0): "ampere", (8, 6): "ampere", (8, 9): "ada", (9, 0): "hopper"}


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
        assert gpu.context == CONTEXT_BY_FAMILY[ARCHITECTURE[gpu.compute_capability]]
    hopper, ampere = lookup("H100 80GB"), lookup("A100 80GB")
    assert hopper.cublas_workspace == workspace_config_bytes(":4096:8") > ampere.cublas_workspace


def test_table_entries_serialize_their_capability_and_costs() -> None:
    data = lookup("RTX 3090").to_dict()
    assert data["compute_capability"] == "8.6" and data["memory"] == lookup("RTX 3090").memory
    assert (data["context"], data["cublas_workspace"]) == tuple(fixed_costs(lookup("RTX 3090")).values())
    assert {gpu.source for gpu in GPUS} == {"torch", "smi"}  # the two kinds of number the docstring explains
