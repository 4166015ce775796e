"""memfit against a real GPU: attention kernels, autocast, fixed costs, cuDNN RNNs and the zoo.

Five checks, each against what memfit predicts (the CUDA-semantics functions where they
are installed, imported by name; else the formulas this script documents, and it says so):

1. **attention**: for ``scaled_dot_product_attention`` under each backend (flash,
   memory-efficient, cuDNN, math), with and without dropout, without a mask, with a
   boolean mask and with a float mask that requires grad: the bytes the forward keeps for
   backward besides its inputs (``saved_tensors_hooks``, device-resident storages), against
   ``memfit.cuda.attention.saved_bytes`` for the fused kernels; the math path against the
   same call on the CPU (its composite is device independent).
2. **autocast**: the output dtype of each op under ``torch.autocast("cuda", fp16/bf16)``
   with fp32 and half inputs, against the policy of memfit's CUDA lists
   (``memfit.cuda.autocast_lists.for_torch``).
3. **fixed costs**: in a fresh subprocess per ``CUDA_MODULE_LOADING`` (LAZY, EAGER), what
   the card loses at the first CUDA call (NVML before, ``torch.cuda.mem_get_info`` after,
   less what torch's allocator reserved), then at the first matmul (cuBLAS) and the first
   convolution (cuDNN); and the cuBLAS workspaces a forward and a backward leave allocated.
   Against :func:`memfit.cuda.context.cuda_context` and ``cublas_workspace``.
4. **cuDNN RNN reserve**: the ``uint8`` reserve an ``nn.LSTM``/``GRU``/``RNN`` forward saves,
   against :func:`memfit.cuda.cudnn.rnn_reserve_bytes` and ``memfit.cuda.rnn.reserve_bytes``.
5. **zoo**: ``memfit.measure`` on ``cuda`` against ``memfit.estimate(..., memory=<the card>)``
   for each zoo workload at two batch sizes in fp32 and bf16 (peak allocated and reserved,
   from what the process held before the run; target: reserved within 5 %).

Prints one short table (check, cases, reference, worst |error|) and writes every case to
``--out`` (default bench/gpu_accuracy.json), atomically. About 3 minutes on an H200.
Without CUDA it says so and exits 2, unless ``--dry-run``: then the CPU runs what it can
(attention on the CPU's backends, autocast on the CPU against the CUDA lists, the
predictions of every check) so the script's own code is exercised without a GPU.

Run: .venv/bin/python bench/gpu_accuracy.py [--out FILE] [--quick] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import memfit
from gpu_speed_check import check as check_speed
from gpu_speed_check import summary as speed_summary
from memfit.cuda.context import (
    CUBLAS_WORKSPACES_IN_TRAINING,
    cublas_workspace,
    cuda_context,
    module_loading,
    parse_cuda_version,
)
from memfit.cuda.cudnn import rnn_reserve_bytes
from memfit.estimator.estimate import estimate
from memfit.units import format_size

OUT = Path(__file__).resolve().parent / "gpu_accuracy.json"

#: (workload, two batch sizes): real shapes where they run in seconds on one GPU
WORKLOADS: list[tuple[str, tuple[int, int]]] = [
    ("mlp", (64, 256)),
    ("convnet", (16, 64)),
    ("gpt2:n_layer=4,seq_len=512", (2, 8)),
    ("bert-base:layers=4,seq_len=256", (4, 16)),
    ("vit-base:layers=4", (4, 16)),
    ("resnet50:image_size=128", (8, 32)),
    ("llama-1b:layers=2,seq_len=512", (1, 4)),
    ("llama-7b:layers=1,seq_len=512", (1, 2)),
]

#: compute capability major.minor -> the architecture family of memfit's context table
FAMILIES: dict[tuple[int, int], str] = {
    (7, 0): "volta",
    (7, 2): "volta",
    (7, 5): "turing",
    (8, 0): "ampere",
    (8, 6): "ampere",
    (8, 7): "ampere",
    (8, 9): "ada",
    (9, 0): "hopper",
}


def write_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gpu-accuracy-")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, default=str)
    os.replace(tmp, path)


def error(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured if measured else (0.0 if predicted == 0 else 100.0)


def optional(module: str, name: str) -> Any | None:
    """``module.name`` of memfit's CUDA-semantics layer, or None where it is not installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# -- 1. attention --------------------------------------------------------------------------


@contextlib.contextmanager
def saved_storages(exclude: list[torch.Tensor], device: str) -> Iterator[dict[int, int]]:
    """Record the storages autograd saves on ``device`` (data pointer -> bytes), not ``exclude``'s.

    Why only the device's: the memory-efficient kernel keeps its seed and offset on the
    CPU; the GPU's memory is what an estimate is about.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if tensor.device.type == device and storage.nbytes() > 0 and storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


#: the attention cases: (dtype, dropout, mask kind)
ATTENTION_CASES: list[tuple[torch.dtype, float, str]] = [
    (torch.float16, 0.0, "none"),
    (torch.bfloat16, 0.0, "none"),
    (torch.float16, 0.1, "none"),
    (torch.float32, 0.1, "none"),
    (torch.bfloat16, 0.0, "bool"),
    (torch.float16, 0.1, "float, requires grad"),
]


def attention_saved(
    backend: str, dtype: torch.dtype, dropout: float, mask_kind: str, shape: tuple[int, int, int, int], device: str
) -> int | None:
    """Bytes one SDPA forward keeps for backward besides its inputs (None: backend refused)."""
    from torch.nn.attention import sdpa_kernel

    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask: torch.Tensor | None = None
    if mask_kind == "bool":
        mask = torch.ones(s, s, device=device, dtype=torch.bool).tril()
    elif mask_kind.startswith("float"):
        mask = torch.zeros(b, h, s, s, device=device, dtype=dtype, requires_grad=True)
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    try:
        with sdpa_kernel([_backend(backend)]), saved_storages(inputs, device) as saved, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a refused backend says why; the result says it too
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    except RuntimeError as failure:
        if "No available kernel" in str(failure) or "No viable backend" in str(failure):
            return None
        raise
    # the output is saved by the fused kernels (its storage is the output's own)
    del out
    return sum(saved.values())


def predicted_attention(
    backend: str, dtype: torch.dtype, dropout: float, shape: tuple[int, int, int, int]
) -> tuple[int | None, str]:
    """memfit's saved bytes for a fused kernel, and what gave them."""
    b, h, s, d = shape
    saved_bytes = optional("memfit.cuda.attention", "saved_bytes")
    if saved_bytes is not None and backend in ("flash", "efficient", "cudnn"):
        return int(
            saved_bytes(backend, b, h, s, d, dtype, requires_grad=True, dropout=dropout > 0)
        ), "memfit.cuda.attention"
    # The meta registrations' shapes (torch/_meta_registrations.py), this script's formula:
    item = torch.empty((), dtype=dtype).element_size()
    out = b * h * s * d * item
    if backend == "flash":
        return out + b * h * s * 4 + 16 + 8, "formula (meta shapes)"
    if backend == "efficient":
        return out + b * h * (-(-s // 32) * 32) * 4, "formula (meta shapes)"
    if backend == "cudnn":
        return out + b * h * s * 4 + (16 if dropout > 0 else 0), "formula (meta shapes)"
    return None, "the CPU's math path"


def check_attention(device: str, quick: bool) -> list[dict[str, Any]]:
    shape = (2, 8, 1024, 64) if device == "cuda" and not quick else (1, 2, 128, 32)
    backends = ("flash", "efficient", "cudnn", "math") if device == "cuda" else ("flash", "math")
    rows = []
    for dtype, dropout, mask_kind in ATTENTION_CASES:
        if device == "cpu" and dtype == torch.float16:
            continue  # the CPU's SDPA kernels in fp16 are slow and not what a GPU runs
        for backend in backends:
            measured = attention_saved(backend, dtype, dropout, mask_kind, shape, device)
            if backend == "math":
                reference = (
                    attention_saved("math", dtype, dropout, mask_kind, shape, "cpu") if device == "cuda" else None
                )
                source = "the same call on the CPU" if device == "cuda" else "-"
            else:
                reference, source = predicted_attention(backend, dtype, dropout, shape)
                if mask_kind != "none":
                    source += " (no mask term)"
            rows.append(
                {
                    "backend": backend,
                    "dtype": str(dtype).removeprefix("torch."),
                    "dropout": dropout,
                    "mask": mask_kind,
                    "shape": list(shape),
                    "measured": measured,
                    "predicted": reference,
                    "reference": source,
                    "error_pct": None
                    if measured is None or reference is None
                    else round(error(reference, measured), 2),
                }
            )
    return rows


# -- 2. autocast ---------------------------------------------------------------------------

#: op name in autocast's lists -> a call on a (16, 16) tensor ``x`` (and ``y`` of the other dtype)
AUTOCAST_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": lambda x, y: F.linear(x, x),
    "mm": lambda x, y: x @ x,
    "bmm": lambda x, y: torch.bmm(x[None], x[None]),
    "conv2d": lambda x, y: F.conv2d(x[None, None], x[None, None, :3, :3]),
    "scaled_dot_product_attention": lambda x, y: F.scaled_dot_product_attention(
        x[None, None], x[None, None], x[None, None]
    ),
    "softmax.int": lambda x, y: torch.softmax(x, -1),
    "log_softmax.int": lambda x, y: torch.log_softmax(x, -1),
    "layer_norm": lambda x, y: F.layer_norm(x, (16,)),
    "group_norm": lambda x, y: F.group_norm(x[None], 4),
    "exp": lambda x, y: torch.exp(x),
    "pow.Tensor_Scalar": lambda x, y: x**2,
    "sum": lambda x, y: x.sum(),
    "cumsum": lambda x, y: x.cumsum(0),
    "mse_loss": lambda x, y: F.mse_loss(x, x),
    "nll_loss": lambda x, y: F.nll_loss(x, torch.zeros(16, dtype=torch.long, device=x.device)),
    "binary_cross_entropy_with_logits": lambda x, y: F.binary_cross_entropy_with_logits(x, x.sigmoid()),
    "addcmul": lambda x, y: torch.addcmul(x, x, y),
    "gelu": lambda x, y: F.gelu(x),
    "relu": lambda x, y: F.relu(x),
    "tanh": lambda x, y: torch.tanh(x),
    "dropout": lambda x, y: F.dropout(x, 0.1, training=True),
}

#: this script's reading of aten/src/ATen/autocast_mode.{h,cpp} for CUDA, used when memfit's lists are absent
_FALLBACK_POLICY = {
    **dict.fromkeys(("linear", "mm", "bmm", "conv2d", "scaled_dot_product_attention"), "lower_precision"),
    **dict.fromkeys(("layer_norm", "group_norm", "exp", "pow.Tensor_Scalar", "mse_loss", "nll_loss"), "fp32"),
    "binary_cross_entropy_with_logits": "fp32",
    **dict.fromkeys(("softmax.int", "log_softmax.int", "sum", "cumsum"), "fp32_set_opt_dtype"),
    "addcmul": "promote",
}


def autocast_policy() -> tuple[Callable[[str], str], str]:
    for_torch = optional("memfit.cuda.autocast_lists", "for_torch")
    policy_of = optional("memfit.cuda.autocast", "policy_of")
    if for_torch is not None and policy_of is not None:
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        lists = for_torch(version)
        return (lambda name: str(policy_of(name, lists))), "memfit.cuda.autocast_lists"
    return (lambda name: _FALLBACK_POLICY.get(name, "none")), "formula (this script's lists)"


def expected_dtype(policy: str, input_dtype: torch.dtype, other: torch.dtype, half: torch.dtype) -> torch.dtype:
    if policy == "lower_precision":
        return half
    if policy.startswith("fp32"):
        return torch.float32
    if policy == "promote":
        return torch.promote_types(input_dtype, other)
    return input_dtype


def check_autocast(device: str) -> list[dict[str, Any]]:
    policy, source = autocast_policy()
    halves = (torch.float16, torch.bfloat16) if device == "cuda" else (torch.bfloat16,)
    rows = []
    for half in halves:
        for input_dtype in (torch.float32, half):
            other = torch.float32 if input_dtype == half else half
            for name, call in AUTOCAST_OPS.items():
                x = torch.randn(16, 16, device=device, dtype=input_dtype)
                y = torch.randn(16, 16, device=device, dtype=other)
                try:
                    with torch.autocast(device, dtype=half), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out = call(x, y)
                    measured = str(out.dtype).removeprefix("torch.")
                except RuntimeError as failure:
                    measured = f"error: {str(failure).splitlines()[0][:60]}"
                want = expected_dtype(policy(name), input_dtype, other, half)
                rows.append(
                    {
                        "op": name,
                        "autocast": str(half).removeprefix("torch."),
                        "input": str(input_dtype).removeprefix("torch."),
                        "policy": policy(name),
                        "measured": measured,
                        "predicted": str(want).removeprefix("torch."),
                        "reference": source,
                        "agrees": measured == str(want).removeprefix("torch."),
                    }
                )
    return rows


# -- 3. fixed costs (a fresh process each) ------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, torch, pynvml
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()
    x = torch.zeros(1, device="cuda")
    context = used() - before
    a = torch.randn(256, 256, device="cuda", requires_grad=True)
    base = torch.cuda.memory_allocated()
    b = a @ a
    after_forward = torch.cuda.memory_allocated() - base - b.nbytes
    cublas_init = used() - before - context
    b.sum().backward()
    del b
    a.grad = None
    after_backward = torch.cuda.memory_allocated() - base
    c = torch.nn.functional.conv2d(torch.randn(1, 8, 32, 32, device="cuda"), torch.randn(8, 8, 3, 3, device="cuda"))
    cudnn_init = used() - before - context - cublas_init
    print(json.dumps({
        "context": context, "cublas_init": cublas_init, "cudnn_init": cudnn_init,
        "workspace_after_forward": after_forward, "workspace_after_backward": after_backward,
        "cuda": torch.version.cuda, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
    }))
    """
)


def check_fixed_costs(dry_run: bool) -> list[dict[str, Any]]:
    rows = []
    for setting in ("LAZY", "EAGER"):
        if dry_run:
            cuda = parse_cuda_version(torch.version.cuda or "12.8")
            loading = module_loading(cuda, setting)
            rows.append(
                {
                    "CUDA_MODULE_LOADING": setting,
                    "measured": None,
                    "predicted_context": cuda_context(cuda, loading, "hopper").bytes,
                    "note": "dry run: no GPU, prediction for an H100/H200 only",
                }
            )
            continue
        env = {**os.environ, "CUDA_MODULE_LOADING": setting}
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode != 0:
            rows.append({"CUDA_MODULE_LOADING": setting, "measured": None, "note": done.stderr.strip()[-300:]})
            continue
        facts = json.loads(done.stdout.strip().splitlines()[-1])
        cuda = parse_cuda_version(facts["cuda"])
        family = FAMILIES.get(tuple(facts["capability"]))
        figure = cuda_context(cuda, module_loading(cuda, setting), family)
        workspace = cublas_workspace(facts["capability"][0], os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        rows.append(
            {
                "CUDA_MODULE_LOADING": setting,
                **facts,
                "measured": facts["context"],
                "predicted_context": figure.bytes,
                "context_source": figure.source,
                "context_error_pct": round(error(figure.bytes, facts["context"]), 2),
                "predicted_workspaces_after_backward": CUBLAS_WORKSPACES_IN_TRAINING * workspace,
                "workspace_error_pct": round(
                    error(CUBLAS_WORKSPACES_IN_TRAINING * workspace, facts["workspace_after_backward"]), 2
                ),
            }
        )
    return rows


# -- 4. cuDNN RNN reserve -------------------------------------------------------------------

RNN_CASES: list[dict[str, Any]] = [
    {"mode": "LSTM", "hidden": 256, "layers": 1, "dtype": torch.float32},
    {"mode": "LSTM", "hidden": 512, "layers": 2, "dtype": torch.float16},
    {"mode": "LSTM", "hidden": 256, "layers": 2, "dtype": torch.float32, "bidirectional": True},
    {"mode": "LSTM", "hidden": 256, "layers": 3, "dtype": torch.float32, "dropout": 0.2},
    {"mode": "GRU", "hidden": 256, "layers": 2, "dtype": torch.float32},
    {"mode": "RNN_TANH", "hidden": 256, "layers": 2, "dtype": torch.float32},
]


def check_rnn(device: str, seq_len: int = 32, batch: int = 16) -> list[dict[str, Any]]:
    other = optional("memfit.cuda.rnn", "reserve_bytes")
    rows = []
    for case in RNN_CASES:
        mode, hidden, layers, dtype = case["mode"], case["hidden"], case["layers"], case["dtype"]
        bidirectional, dropout = case.get("bidirectional", False), case.get("dropout", 0.0)
        item = torch.empty((), dtype=dtype).element_size()
        ours = rnn_reserve_bytes(
            mode, hidden_size=hidden, num_layers=layers, seq_len=seq_len, batch=batch, dtype_bytes=item,
            bidirectional=bidirectional, dropout=dropout,
        )  # fmt: skip
        theirs = None
        if other is not None:
            theirs = other(mode.lower(), seq_len, batch, hidden, layers, 2 if bidirectional else 1, item)
        measured = None
        if device == "cuda":
            cls = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN_TANH": torch.nn.RNN}[mode]
            rnn = cls(hidden, hidden, layers, dropout=dropout, bidirectional=bidirectional).to(device, dtype)
            x = torch.randn(seq_len, batch, hidden, device=device, dtype=dtype, requires_grad=True)
            reserve: list[int] = []

            def pack(tensor: torch.Tensor, into: list[int] = reserve) -> torch.Tensor:
                if tensor.dtype == torch.uint8 and tensor.is_cuda:
                    into.append(tensor.untyped_storage().nbytes())
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                rnn(x)
            measured = max(reserve) if reserve else 0
        rows.append(
            {
                **{k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v) for k, v in case.items()},
                "seq_len": seq_len,
                "batch": batch,
                "measured": measured,
                "predicted": ours,
                "reference": "memfit.cuda.cudnn.rnn_reserve_bytes (MIOpen's formula)",
                "error_pct": None if measured is None else round(error(ours, measured), 2),
                "cuda_semantics_model": theirs,
                "cuda_semantics_error_pct": None
                if measured is None or theirs is None
                else round(error(theirs, measured), 2),
            }
        )
    return rows


# -- 5. the zoo: estimate against measure ------------------------------------------------


def cublas_workspace_bytes() -> int:
    """What the first matmul of the process adds to allocated memory (the cuBLAS workspace)."""
    before = torch.cuda.memory_allocated()
    a = torch.ones(64, 64, device="cuda")
    _ = a @ a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - 2 * a.nbytes
    del a, _
    return max(workspace, 0)


def check_zoo(quick: bool) -> list[dict[str, Any]]:
    gpu = memfit.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    cublas_workspace_bytes()  # the process's own workspace first: measurements count from after it
    rows: list[dict[str, Any]] = []
    for ref, batches in WORKLOADS[:3] if quick else WORKLOADS:
        for batch in batches:
            for precision in ("fp32", "bf16"):
                if precision == "bf16" and not gpu.supports("bf16"):
                    continue
                settings = memfit.Settings(precision=precision)
                torch.cuda.empty_cache()
                base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                measured = memfit.measure(ref, batch, gpu, settings)
                measured = dataclasses.replace(
                    measured,
                    peak_allocated=measured.peak_allocated - base_allocated,
                    peak_reserved=measured.peak_reserved - base_reserved,
                )
                predicted = estimate(ref, batch, settings, memory=total, search=False)
                rows.append(
                    {
                        "workload": ref,
                        "batch_size": batch,
                        "precision": precision,
                        "fits": measured.fits,
                        "measured_allocated": measured.peak_allocated,
                        "predicted_allocated": predicted.peak_allocated,
                        "measured_reserved": measured.peak_reserved,
                        "predicted_reserved": predicted.peak_reserved,
                        "allocated_error_pct": round(error(predicted.peak_allocated, measured.peak_allocated), 2),
                        "reserved_error_pct": round(error(predicted.peak_reserved, measured.peak_reserved), 2),
                    }
                )
                print(
                    f"  {ref:40s} b={batch:<4d} {precision:5s} reserved {format_size(measured.peak_reserved):>11s} vs "
                    f"{format_size(predicted.peak_reserved):>11s} ({rows[-1]['reserved_error_pct']:+.2f} %)",
                    flush=True,
                )
    return rows


# -- the table ------------------------------------------------------------------------------


def worst(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [abs(r[key]) for r in rows if r.get(key) is not None]
    return max(values) if values else None


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(check, cases compared / run, reference, worst |error| or agreement) for the printed table.

    In a dry run the attention and autocast figures are the CPU's kernels and autocast,
    compared with CUDA's predictions: they show the differences memfit's CUDA layer exists
    for, not memfit's accuracy.
    """
    table = []
    attention = results["attention"]
    compared = [r for r in attention if r["error_pct"] is not None]
    references = sorted({r["reference"] for r in compared}) or ["-"]
    value = worst(attention, "error_pct")
    table.append(("attention saved bytes", f"{len(compared)}/{len(attention)}", "; ".join(references), _pct(value)))
    autocast = results["autocast"]
    agree = sum(r["agrees"] for r in autocast)
    table.append(
        (
            "autocast output dtype",
            f"{len(autocast)}",
            autocast[0]["reference"] if autocast else "-",
            f"{agree}/{len(autocast)} agree",
        )
    )
    fixed = results["fixed_costs"]
    table.append(
        (
            "CUDA context",
            f"{sum(r['measured'] is not None for r in fixed)}/{len(fixed)}",
            "memfit.cuda.context",
            _pct(worst(fixed, "context_error_pct")),
        )
    )
    table.append(
        (
            "cuBLAS workspaces",
            f"{sum(r.get('workspace_error_pct') is not None for r in fixed)}/{len(fixed)}",
            "memfit.cuda.context",
            _pct(worst(fixed, "workspace_error_pct")),
        )
    )
    rnn = results["rnn"]
    table.append(
        (
            "cuDNN RNN reserve",
            f"{sum(r['measured'] is not None for r in rnn)}/{len(rnn)}",
            "memfit.cuda.cudnn",
            _pct(worst(rnn, "error_pct")),
        )
    )
    zoo = results["zoo"]
    table.append(
        (
            "zoo peak reserved",
            f"{len(zoo)}",
            "memfit.estimate",
            _pct(worst([r for r in zoo if r["fits"]], "reserved_error_pct")),
        )
    )
    speed = results["speed"]
    median = speed_summary(speed)["median_abs_error_pct"]
    table.append(
        (
            "predicted samples/s (median)",
            f"{sum(r['measured_samples_per_second'] is not None for r in speed)}/{len(speed)}",
            "bench/gpu_speed_check.py",
            _pct(median),
        )
    )
    return table


def _pct(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f} %"


def run(out: Path, quick: bool, dry_run: bool) -> int:
    if not torch.cuda.is_available() and not dry_run:
        print(
            "bench/gpu_accuracy.py needs a CUDA GPU; none is visible here (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}). Nothing was measured; "
            "--dry-run runs the CPU's part.",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if dry_run else "cuda"
    started = time.perf_counter()
    # the context probes start fresh processes: before this process makes a context of its own
    results: dict[str, Any] = {"fixed_costs": check_fixed_costs(dry_run)}
    results["attention"] = check_attention(device, quick)
    results["autocast"] = check_autocast(device)
    results["rnn"] = check_rnn(device)
    results["zoo"] = [] if dry_run else check_zoo(quick)
    results["speed"] = check_speed("A100 80GB SXM" if dry_run else None, measure=not dry_run, quick=quick)
    results.update(
        {
            "dry_run": dry_run,
            "gpu": torch.cuda.get_device_name(0) if not dry_run else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "memfit": memfit.__version__,
            "seconds": round(time.perf_counter() - started, 1),
        }
    )
    write_atomically(out, results)
    table = summary_rows(results)
    header = ("check", "cases", "against", "worst |error|" + (" (the CPU's, not CUDA's)" if dry_run else ""))
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(4)]
    for row in [header, *table]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    where = "dry run on the CPU (nothing measured on a GPU)" if dry_run else results["gpu"]
    print(f"{where}; {results['seconds']} s; every case in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="JSON file to write (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smaller attention shapes, the first three zoo workloads")
    parser.add_argument("--dry-run", action="store_true", help="without a GPU: run the CPU's part and the predictions")
    args = parser.parse_args(argv)
    return run(args.out, args.quick, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
