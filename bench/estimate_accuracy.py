"""Estimate against measurement on the simulated GPU, and the cost of estimating Llama 7B.

For every zoo workload (small options), in fp32 and bf16, with checkpointing none and
blocks (none only for the LSTM language model, which has no repeated blocks), plus a small
GPT-2 at sequence 2048 with attention dropout: ``memfit.estimate(..., device=SIM)`` against
``memfit.measure(..., SIM)``, peak allocated and reserved (target: within 1 %). Both follow
CUDA's semantics (memfit.cuda: attention kernels, autocast lists, fused dropout, cuDNN RNNs). For a few workloads: the predicted
``max_batch_size`` against the true maximum found by measuring every batch size from 1
up to the first that does not fit. Then ``memfit estimate llama-7b --batch-size 1
--precision bf16`` in a subprocess: wall time, CPU time and peak resident memory
(targets: 20 s, 1 GiB). Writes the "estimate" section of docs/benchmarks.md.

Run: .venv/bin/python bench/estimate_accuracy.py
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import memfit
from _results import write_section
from memfit.estimator.estimate import estimate
from memfit.units import format_size

SIM = "sim:4GiB"
COMMAND = "python bench/estimate_accuracy.py"
BOTH = ("none", "blocks")
WORKLOADS: list[tuple[str, int, tuple[str, ...]]] = [
    ("mlp:layers=2,width=64", 8, BOTH),
    ("convnet:blocks=2,channels=8,image_size=16", 4, BOTH),
    ("gpt2:n_layer=2,n_embd=64,n_head=2,seq_len=32,vocab_size=1000", 2, BOTH),
    ("bert-base:layers=2,hidden=64,heads=2,intermediate=128,vocab=1000,seq_len=32", 2, BOTH),
    ("vit-base:layers=2,hidden=64,heads=2,intermediate=128,image_size=32,patch_size=8,classes=10", 2, BOTH),
    ("resnet50:image_size=32,embedding_size=16,classes=10", 2, BOTH),
    (
        "llama-1b:layers=2,hidden=64,heads=2,num_key_value_heads=2,head_dim=32,intermediate=128,vocab=1000,seq_len=32",
        2,
        BOTH,
    ),
    ("llama-7b:layers=2,hidden=64,heads=2,num_key_value_heads=2,intermediate=128,vocab=1000,seq_len=32", 2, BOTH),
    ("lstm-lm", 16, ("none",)),  # PyTorch's word_language_model defaults
    ("lstm-lm", 64, ("none",)),
    ("gpt2:n_layer=2,n_embd=64,n_head=2,n_positions=2048,vocab_size=1000,seq_len=2048", 1, ("none",)),
]
MAX_BATCH: list[tuple[str, str, int]] = [
    ("convnet:blocks=1,channels=8,image_size=32", "sim:8MiB", 64),
    ("convnet:blocks=2,channels=8,image_size=32", "sim:12MiB", 48),
]


def error(predicted: int, measured: int) -> float:
    return 0.0 if predicted == measured else 100.0 * (predicted - measured) / measured


def accuracy_rows() -> tuple[list[str], float]:
    rows, worst = [], 0.0
    for ref, batch, checkpointings in WORKLOADS:
        for precision in ("fp32", "bf16"):
            for checkpointing in checkpointings:
                settings = memfit.Settings(precision=precision, checkpointing=checkpointing)
                est = estimate(ref, batch, settings, device=SIM, search=False)
                got = memfit.measure(ref, batch, SIM, settings)
                ea, er = error(est.peak_allocated, got.peak_allocated), error(est.peak_reserved, got.peak_reserved)
                worst = max(worst, abs(ea), abs(er))
                name = ref.split(":")[0] + (" (seq 2048, dropout)" if "seq_len=2048" in ref else "")
                rows.append(
                    f"| `{name}` | {batch} | {precision} | {checkpointing} | "
                    f"{format_size(est.peak_allocated)} | {format_size(got.peak_allocated)} | {ea:+.2f} % | "
                    f"{format_size(est.peak_reserved)} | {format_size(got.peak_reserved)} | {er:+.2f} % |"
                )
                print(rows[-1], flush=True)
    return rows, worst


def true_max(ref: str, sim: str, limit: int) -> int:
    """Measure every batch from 1 up to the first that does not fit."""
    best = 0
    for batch in range(1, limit + 1):
        if not memfit.measure(ref, batch, sim).fits:
            break
        best = batch
    return best


def max_batch_rows() -> list[str]:
    rows = []
    for ref, sim, limit in MAX_BATCH:
        predicted = estimate(ref, device=sim).max_batch_size
        measured = true_max(ref, sim, limit)
        rows.append(f"| `{ref}` | {sim} | {predicted} | {measured} | {'yes' if predicted == measured else 'NO'} |")
        print(rows[-1], flush=True)
    return rows


def llama_7b_cost() -> tuple[str, float, float, float]:
    memfit_bin = Path(sys.executable).with_name("memfit")
    command = [str(memfit_bin), "estimate", "llama-7b", "--batch-size", "1", "--precision", "bf16", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rss_gib = after.ru_maxrss * 1024 / 2**30  # ru_maxrss is in KiB on Linux
    shown = "memfit estimate llama-7b --batch-size 1 --precision bf16 --json"
    return shown, wall, cpu, rss_gib


def import_cost() -> float:
    """CPU seconds to import memfit's CLI, torch and transformers' Llama (the fixed part)."""
    code = "import memfit.cli, memfit.workload.zoo, transformers; from transformers import LlamaForCausalLM"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main() -> None:
    started = time.perf_counter()
    rows, worst = accuracy_rows()
    max_rows = max_batch_rows()
    shown, wall, cpu, rss = llama_7b_cost()
    imports = import_cost()
    print(f"llama-7b: wall {wall:.1f} s, cpu {cpu:.1f} s, rss {rss:.2f} GiB", flush=True)
    text = f"""## memfit estimate: accuracy on the simulated GPU, cost on Llama 7B

Command: `{COMMAND}` ({platform.machine()}, {memfit.__version__}, torch {torch.__version__},
{os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s); load average {load_average()} at the end:
the machine was shared).

Predicted (`memfit.estimate(..., device="{SIM}")`, fake tensors) against measured
(`memfit.measure(..., "{SIM}")`, real tensors) peak allocated and reserved; error =
(predicted − measured) / measured. Target: within 1 %. **Worst |error|: {worst:.2f} %.**

| workload | batch | precision | checkpointing | predicted alloc | measured alloc | error | predicted reserved | measured reserved | error |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Largest batch that fits: `estimate(...).max_batch_size` against every batch measured
from 1 up to the first that does not fit.

| workload | device | predicted | true maximum | equal |
|---|---|---|---|---|
{chr(10).join(max_rows)}

`{shown}` (Llama 2 7B shapes, sequence 2048, AdamW, bf16 autocast with fp32 master
weights, a CUDA target so AdamW is foreach): **{wall:.1f} s wall, {cpu:.1f} s CPU, {rss:.2f} GiB peak
resident memory** (targets: 20 s, 1 GiB). Importing memfit, torch and transformers' Llama
alone, measured in the same run: {imports:.1f} s CPU. CPU time is the figure to read on a shared
machine: wall time there includes waiting for the other processes.

Whole benchmark: {time.perf_counter() - started:.0f} s.
"""
    write_section("estimate", text)


if __name__ == "__main__":
    main()
