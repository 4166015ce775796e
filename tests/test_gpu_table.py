"""Issue 23's cards (the ones students own: GeForce 10/16/20/30/40/50, Titan RTX, P100, P40,
laptop parts), found by the names nvidia-smi prints, estimated on; and a card the table
lacks, described on the command line (``custom:memory=12GiB,cc=8.6``)."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.estimator.estimate import estimate
from memfit.memory.devices import device
from memfit.memory.gpus import GPUS, lookup
from memfit.run.settings import Settings
from memfit.units import GiB, MiB

TINY = "mlp:layers=1,width=32,features=32"

#: every card issue 23 added, as ``nvidia-smi --query-gpu=name`` (and torch) print it
ADDED = {
    "NVIDIA GeForce RTX 2060": "RTX 2060",
    "NVIDIA GeForce RTX 2060 SUPER": "RTX 2060 Super",
    "NVIDIA GeForce RTX 2070": "RTX 2070",
    "NVIDIA GeForce RTX 2070 SUPER": "RTX 2070 Super",
    "NVIDIA GeForce RTX 2080": "RTX 2080",
    "NVIDIA GeForce RTX 2080 SUPER": "RTX 2080 Super",
    "NVIDIA TITAN RTX": "Titan RTX",
    "NVIDIA GeForce GTX 1650": "GTX 1650",
    "NVIDIA GeForce GTX 1650 SUPER": "GTX 1650 Super",
    "NVIDIA GeForce GTX 1660": "GTX 1660",
    "NVIDIA GeForce GTX 1660 SUPER": "GTX 1660 Super",
    "NVIDIA GeForce GTX 1660 Ti": "GTX 1660 Ti",
    "NVIDIA GeForce RTX 3050": "RTX 3050 8GB",
    "NVIDIA GeForce RTX 3060 Ti": "RTX 3060 Ti",
    "NVIDIA GeForce RTX 3070 Ti": "RTX 3070 Ti",
    "NVIDIA GeForce RTX 3080 Ti": "RTX 3080 Ti",
    "NVIDIA GeForce RTX 4060": "RTX 4060",
    "NVIDIA GeForce RTX 4070 SUPER": "RTX 4070 Super",
    "NVIDIA GeForce RTX 4070 Ti": "RTX 4070 Ti",
    "NVIDIA GeForce RTX 4070 Ti SUPER": "RTX 4070 Ti Super",
    "NVIDIA GeForce RTX 4080 SUPER": "RTX 4080 Super",
    "NVIDIA GeForce RTX 5060": "RTX 5060",
    "NVIDIA GeForce RTX 5060 Ti 8GB": "RTX 5060 Ti 8GB",
    "NVIDIA GeForce RTX 5060 Ti 16GB": "RTX 5060 Ti 16GB",
    "NVIDIA GeForce RTX 5070": "RTX 5070",
    "NVIDIA GeForce RTX 5070 Ti": "RTX 5070 Ti",
    "NVIDIA GeForce RTX 5080": "RTX 5080",
    "NVIDIA GeForce GTX 1060 3GB": "GTX 1060 3GB",
    "NVIDIA GeForce GTX 1060 6GB": "GTX 1060 6GB",
    "NVIDIA GeForce GTX 1070": "GTX 1070",
    "NVIDIA GeForce GTX 1070 Ti": "GTX 1070 Ti",
    "NVIDIA GeForce GTX 1080": "GTX 1080",
    "NVIDIA GeForce GTX 1080 Ti": "GTX 1080 Ti",
    "Tesla P100-PCIE-16GB": "P100 PCIe 16GB",
    "Tesla P100-PCIE-12GB": "P100 PCIe 12GB",
    "Tesla P100-SXM2-16GB": "P100 SXM2 16GB",
    "Tesla P40": "P40",
    "NVIDIA GeForce RTX 3050 Laptop GPU": "RTX 3050 Laptop",
    "NVIDIA GeForce RTX 3050 Ti Laptop GPU": "RTX 3050 Ti Laptop",
    "NVIDIA GeForce RTX 3060 Laptop GPU": "RTX 3060 Laptop",
    "NVIDIA GeForce RTX 3070 Laptop GPU": "RTX 3070 Laptop",
    "NVIDIA GeForce RTX 3070 Ti Laptop GPU": "RTX 3070 Ti Laptop",
    "NVIDIA GeForce RTX 3080 Ti Laptop GPU": "RTX 3080 Ti Laptop",
    "NVIDIA GeForce RTX 4050 Laptop GPU": "RTX 4050 Laptop",
    "NVIDIA GeForce RTX 4060 Laptop GPU": "RTX 4060 Laptop",
    "NVIDIA GeForce RTX 4070 Laptop GPU": "RTX 4070 Laptop",
    "NVIDIA GeForce RTX 4080 Laptop GPU": "RTX 4080 Laptop",
    "NVIDIA GeForce RTX 4090 Laptop GPU": "RTX 4090 Laptop",
}


@pytest.mark.parametrize(("printed", "name"), list(ADDED.items()))
def test_every_added_card_is_found_by_the_name_nvidia_smi_prints(printed: str, name: str) -> None:
    gpu = lookup(printed)
    assert gpu.name == name
    assert lookup(name) is gpu and lookup(printed.lower()) is gpu
    assert gpu.sms > 0 and gpu.spec_source


@pytest.mark.parametrize(
    ("short", "name"),
    [
        ("1080 ti", "GTX 1080 Ti"),
        ("gtx1080ti", "GTX 1080 Ti"),
        ("1080", "GTX 1080"),  # not the Ti
        ("2080", "RTX 2080"),  # not the Super, nor the Ti
        ("2080 super", "RTX 2080 Super"),
        ("4070 ti", "RTX 4070 Ti"),  # not the Ti Super
        ("titan rtx", "Titan RTX"),
        ("rtx 4060 laptop", "RTX 4060 Laptop"),
        ("4060", "RTX 4060"),  # neither the Ti nor the laptop part
        ("p40", "P40"),
    ],
)
def test_short_names_keep_their_model_words(short: str, name: str) -> None:
    assert lookup(short).name == name


@pytest.mark.parametrize(
    ("name", "cards"),
    [
        ("P100", ["P100 PCIe 16GB", "P100 PCIe 12GB", "P100 SXM2 16GB"]),
        ("GTX 1060", ["GTX 1060 3GB", "GTX 1060 6GB"]),
        ("5060 Ti", ["RTX 5060 Ti 8GB", "RTX 5060 Ti 16GB"]),
    ],
)
def test_names_that_fit_several_added_cards_are_refused(name: str, cards: list[str]) -> None:
    with pytest.raises(MemfitError, match="fits several GPUs") as info:
        lookup(name)
    assert all(card in str(info.value) for card in cards)


@pytest.mark.parametrize(
    ("name", "fp32", "tensor"),
    [
        # figures NVIDIA prints (Turing whitepaper at reference clocks, product pages' shader
        # TFLOPS, Pascal's GFLOPS), which the table's SMs x clock x per-SM rates must reproduce
        ("RTX 2080", 10.1, 40.3),
        ("RTX 2070", 7.5, 29.9),
        ("RTX 3080 Ti", 34.1, 68.2),
        ("RTX 4070 Ti", 40.1, 80.2),
        ("RTX 4080 Super", 52.2, 104.4),
        ("RTX 5080", 56.3, 112.6),
        ("Titan RTX", 16.3, 130.5),
        ("GTX 1080", 8.9, None),
        ("GTX 1080 Ti", 11.3, None),
        ("P100 PCIe 16GB", 9.3, None),
    ],
)
def test_derived_peaks_agree_with_nvidias_printed_figures(name: str, fp32: float, tensor: float | None) -> None:
    gpu = lookup(name)
    assert gpu.fp32 == pytest.approx(fp32 * 1e12, rel=0.01)
    assert gpu.fp16_tensor == (None if tensor is None else pytest.approx(tensor * 1e12, rel=0.01))


def test_every_added_card_is_in_the_table_once() -> None:
    names = [gpu.name for gpu in GPUS]
    assert set(ADDED.values()) <= set(names) and len(names) == len(set(names))


def test_the_issue_card_estimates_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "mlp", "--gpu", "NVIDIA GeForce RTX 3080 Ti", "--batch-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"] == "RTX 3080 Ti" and data["memory"] == lookup("RTX 3080 Ti").memory
    assert data["fits"] is True and data["predicted_seconds_per_step"] > 0
    assert data["cuda"].startswith("RTX 3080 Ti, sm86")


@pytest.mark.parametrize("name", ["GTX 1080 Ti", "RTX 2070 Super", "RTX 5070", "P40", "Titan RTX"])
def test_added_cards_of_each_architecture_estimate(name: str) -> None:
    est = estimate(TINY, 4, gpu=name)
    gpu = lookup(name)
    assert est.fits and est.memory == gpu.memory
    assert est.predicted_samples_per_second is not None and est.predicted_samples_per_second > 0
    assert est.cuda is not None and f"sm{gpu.compute_capability[0]}{gpu.compute_capability[1]}" in est.cuda


def test_a_card_before_ampere_refuses_bf16_in_one_line() -> None:
    with pytest.raises(MemfitError, match="does not support bf16"):
        estimate(TINY, 4, Settings(precision="bf16"), gpu="GTX 1080 Ti")


def test_a_laptop_part_estimates_memory_and_says_why_there_is_no_speed() -> None:
    est = estimate(TINY, 4, gpu="NVIDIA GeForce RTX 4060 Laptop GPU")
    assert est.fits and est.memory == lookup("RTX 4060 Laptop").memory
    assert est.predicted_seconds_per_step is None
    assert "power limit" in est.speed_note and "custom:" in est.speed_note
    assert device("sim:RTX 4060 Laptop").supports("bf16")


def test_a_custom_card_is_described_by_memory_and_capability() -> None:
    gpu = lookup("custom:memory=12GiB,cc=8.6,fp32=30,fp16=60,bf16=60,bandwidth=900,name=My card")
    assert (gpu.name, gpu.memory, gpu.compute_capability, gpu.family) == ("My card", 12 * GiB, (8, 6), "ampere")
    assert gpu.bf16 and gpu.fp32 == 30e12 and gpu.fp16_tensor == 60e12 and gpu.bandwidth == 900e9
    bare = lookup("custom:memory=6GiB,cc=7.5")
    assert not bare.bf16 and not bare.has_peaks and bare.family == "turing" and bare.memory == 6 * 1024 * MiB
    est = estimate(TINY, 4, gpu="custom:memory=12GiB,cc=8.6,fp32=30,fp16=60,bf16=60,bandwidth=900")
    assert est.fits and est.memory == 12 * GiB and est.predicted_seconds_per_step is not None
    assert est.fixed_costs["cuda context"] > 0  # the fixed costs of its architecture


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("custom:memory=12GiB", "give memory= and cc="),
        ("custom:cc=8.6", "give memory= and cc="),
        ("custom:memory=12GiB,cc=9.9", "not a CUDA compute capability"),
        ("custom:memory=12GiB,cc=eight", "not a CUDA compute capability"),
        ("custom:memory=12Gx,cc=8.6", "invalid size"),
        ("custom:memory=12GiB,cc=8.6,fp32=30", "fp32= and bandwidth= together"),
        ("custom:memory=12GiB,cc=8.6,fp32=-1,bandwidth=900", "must be a positive number"),
        ("custom:memory=12GiB,cc=8.6,fp32=nan,bandwidth=900", "must be a positive number"),
        ("custom:memory=12GiB,cc=7.5,bf16=60", "no bf16 or tf32"),
        ("custom:memory=12GiB,cc=8.6,speed=fast", "is not KEY=VALUE"),
        ("custom:memory=12GiB,cc=8.6,cc=8.9", "each once"),
    ],
)
def test_a_bad_custom_card_is_one_line_exit_2(spec: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--gpu", spec, "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memfit: error: invalid GPU") and why in err
