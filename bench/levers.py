"""The levers beside the batch: allocator settings and CPU offload, against published figures.

1. PyTorch's own reproducer of reserved memory growing without bound under
   ``max_split_size_mb:128,expandable_segments:True`` (pytorch/pytorch#123548, fix proposed in
   pytorch/pytorch#193400): a 64 MiB buffer, then per cycle A = 91 MiB and B = 45.5 MiB,
   a 2 MiB block that stays alive, A and B freed; measured on a 16 GiB card. Replayed
   through memfit's allocator model under each setting.
2. CPU offload (FSDP2 ``CPUOffloadPolicy``) of Llama 2 7B shapes at sequence 512 on an
   RTX 4090 (24 GB): estimated on fake tensors; the host's share against the arithmetic
   of fp32 parameters, gradients and AdamW's two moments (16 bytes per parameter), and the
   predicted step's parts (FSDP2's PR, pytorch/pytorch#120256: "CPU optimizer step
   dominates").

Usage: ``python bench/levers.py`` (``--skip-7b`` leaves out part 2, a few minutes of fake
tensors). Writes the ``levers`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import memfit
from _results import write_section
from memfit.estimator.estimate import estimate
from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.allocator_conf import DEFAULT, parse
from memfit.units import MiB, format_size

#: the published table (pytorch/pytorch#193400): cycle -> (allocated MiB, reserved MiB)
PUBLISHED = {0: (66, 220), 20: (106, 2980), 40: (146, 5760), 60: (186, 8520), 80: (226, 11300), 100: (266, 14060)}
SETTINGS = ("max_split_size_mb:128,expandable_segments:True", "max_split_size_mb:128", "expandable_segments:True", "")


def reproducer(text: str) -> dict[int, tuple[int, int]]:
    """The reproducer's cycles through the model: cycle -> (allocated MiB, reserved MiB)."""
    allocator = CachingAllocatorModel(config=parse(text) if text else DEFAULT)
    allocator.malloc(64 * MiB)  # the canary buffer, alive throughout
    rows = {}
    for cycle in range(101):
        a = allocator.malloc(91 * MiB)
        b = allocator.malloc(int(45.5 * MiB))
        allocator.malloc(2 * MiB)  # stays alive: fences the freed A + B off from the segment's tail
        allocator.free(a)
        allocator.free(b)
        if cycle in PUBLISHED:
            rows[cycle] = (allocator.allocated // MiB, allocator.reserved // MiB)
    return rows


def allocator_table() -> str:
    modelled = {text: reproducer(text) for text in SETTINGS}
    both = modelled[SETTINGS[0]]
    lines = [
        "| cycle | published allocated | memfit allocated | published reserved | memfit reserved |",
        "|---|---|---|---|---|",
    ]
    for cycle, (allocated, reserved) in PUBLISHED.items():
        lines.append(
            f"| {cycle} | {allocated} MiB | {both[cycle][0]} MiB | {reserved:,} MiB | {both[cycle][1]:,} MiB |"
        )
    alone = ", ".join(f"`{text or 'defaults'}` {modelled[text][100][1]} MiB" for text in SETTINGS[1:])
    exact = all(both[c] == PUBLISHED[c] for c in PUBLISHED)
    return "\n".join(lines) + (
        f"\n\nReserved after cycle 100 with either option alone or neither (published: under 500 MiB): {alone}. "
        f"**Every published figure reproduced exactly: {'yes' if exact else 'no'}.**"
    )


def offload_rows() -> str:
    ref = "llama-7b:seq_len=512"
    settings = memfit.Settings(precision="bf16", checkpointing="blocks", shard="offload")
    start = time.perf_counter()
    est = estimate(ref, 1, settings, gpu="RTX 4090", search=False)
    seconds = time.perf_counter() - start
    params = 6_738_415_616  # Llama 2 7B (LlamaConfig defaults of the zoo's llama-7b)
    states = 16 * params
    t = est.predicted_time or {}
    return (
        f"`memfit.estimate('{ref}', 1, Settings(precision='bf16', checkpointing='blocks', shard='offload'), "
        f"gpu='RTX 4090')` ({seconds:.0f} s of fake tensors):\n\n"
        "| figure | memfit | arithmetic / published |\n|---|---|---|\n"
        f"| fits on the RTX 4090 (24 GB) | {est.fits} | plain training needs > 100 GB (16 B x 6.74 B parameters) |\n"
        f"| GPU peak reserved | {format_size(est.peak_reserved)} | - |\n"
        f"| host memory | {format_size(est.host_memory or 0)} | {format_size(states)} (fp32 P + G + 2 AdamW moments) |\n"
        f"| predicted step | {est.predicted_seconds_per_step or 0:.2f} s | - |\n"
        f'| of which CPU optimizer step | {t.get("cpu_optimizer_seconds", 0):.2f} s | "CPU optimizer step dominates" '
        "(pytorch/pytorch#120256) |\n"
        f"| of which PCIe copies | {t.get('offload_copy_seconds', 0):.2f} s | - |\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-7b", action="store_true", help="leave out the 7B offload estimate")
    args = parser.parse_args(argv)
    text = (
        "## The levers: allocator settings and CPU offload against published figures\n\n"
        f"Command: `python bench/levers.py` ({platform.machine()}, {memfit.__version__}, "
        f"{os.cpu_count()} CPUs).\n\n"
        "### Allocator settings: PyTorch's reproducer of reserved memory growth (pytorch/pytorch#193400)\n\n"
        "`PYTORCH_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True`; a 64 MiB buffer, then per cycle "
        "91 MiB and 45.5 MiB allocated, a 2 MiB block kept, the two freed; published on a 16 GiB card "
        "(ROCm 7.14, torch 2.12), replayed through `memfit.memory.allocator.CachingAllocatorModel`.\n\n"
        + allocator_table()
        + "\n\nNot reproduced: torchtune's 16.39 GiB -> 10.83 GiB with `expandable_segments:True` "
        "(meta-pytorch/torchtune#1185, Llama 3 8B QLoRA on an A100): its NF4 base weights are not modelled.\n"
    )
    if not args.skip_7b:
        text += "\n### CPU offload: Llama 2 7B on an RTX 4090\n\n" + offload_rows()
    write_section("levers", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
