"""The GPU table: name lookup, close-name errors, fixed costs."""

from __future__ import annotations

import pytest

from memfit.errors import MemfitError
from memfit.memory.gpus import GPUS, cublas_workspace, fixed_costs, lookup, normalize_name
from memfit.units import KiB, MiB

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


@pytest.mark.parametrize(("major", "expected"), [(7, 8320 * KiB), (8, 8320 * KiB), (9, 32 * MiB), (10, 32 * MiB)])
def test_cublas_workspace_follows_pytorchs_default_config(major: int, expected: int) -> None:
    assert cublas_workspace(major) == expected


@pytest.mark.parametrize(
    ("name", "context", "workspace"),
    [("RTX 3090", 400 * MiB, 8320 * KiB), ("T4", 300 * MiB, 8320 * KiB), ("H100 80GB", 500 * MiB, 32 * MiB)],
)
def test_fixed_costs_are_context_and_cublas_workspace(name: str, context: int, workspace: int) -> None:
    assert fixed_costs(lookup(name)) == {"cuda context": context, "cublas workspace": workspace}


def test_table_facts_are_consistent() -> None:
    for gpu in GPUS:
        assert gpu.memory % MiB == 0 and gpu.memory > 10 * 2**30
        assert gpu.bf16 == (gpu.compute_capability >= (8, 0))
        assert gpu.source in ("torch", "smi")
        assert gpu.to_dict()["compute_capability"].count(".") == 1
