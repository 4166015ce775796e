"""``memfit estimate``: predict peak memory, its breakdown and the largest batch, without a GPU."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from memfit._io import check_writable
from memfit.cli.options import (
    OutputPath,
    alloc_conf_option,
    apply_alloc_conf,
    console,
    json_option,
    make_settings,
    print_json,
    settings_options,
    strategy,
    strategy_options,
    workload_argument,
)
from memfit.errors import MemfitError
from memfit.estimator.estimate import Estimate, estimate
from memfit.units import format_size


@click.command("estimate")
@workload_argument
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Samples per forward/backward pass on each GPU (default: the largest that fits).",
)
@click.option(
    "--accumulation-steps",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Micro-batches per optimizer step (gradient accumulation).",
)
@click.option(
    "--max-batch/--no-max-batch",
    "max_batch",
    default=None,
    help="Also find the largest batch that fits (default: only when --batch-size is not given).",
)
@click.option(
    "--gpu",
    default=None,
    metavar="NAME",
    help='A GPU model from the table, as torch or nvidia-smi names it ("NVIDIA A100-SXM4-80GB") or short ("RTX 3090"); '
    "a card it lacks: custom:memory=12GiB,cc=8.6[,fp32=TFLOPS,fp16=..,bf16=..,tf32=..,bandwidth=GB/s].",
)
@click.option("--memory", default=None, metavar="SIZE", help="A GPU whose PyTorch allocator may reserve SIZE.")
@click.option(
    "--device", "device_spec", default=None, metavar="sim:SIZE", help="The simulated GPU itself (no fixed costs)."
)
@click.option(
    "--fixed-costs",
    default=None,
    metavar="SIZE",
    help="Override the CUDA context and workspace memory the allocator never sees.",
)
@click.option(
    "--cuda-version",
    default=None,
    metavar="X.Y",
    help="CUDA of the torch build that will train, for the CUDA context and the kernels PyTorch picks "
    "(default: this torch's CUDA, else ./memfit.lock's, else a current CUDA 12).",
)
@settings_options
@strategy_options
@click.option(
    "--snapshot",
    "snapshot_path",
    type=OutputPath(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE.pickle",
    help="Also write the step's allocator history for PyTorch's memory viewer (pytorch.org/memory_viz).",
)
@alloc_conf_option
@json_option
def command(
    workload: str,
    batch_size: int | None,
    accumulation_steps: int,
    max_batch: bool | None,
    gpu: str | None,
    memory: str | None,
    device_spec: str | None,
    fixed_costs: str | None,
    cuda_version: str | None,
    precision: str,
    checkpointing: str,
    world_size: int,
    shard: str,
    snapshot_path: Path | None,
    shard_group_size: int | None,
    alloc_conf: str | None,
    as_json: bool,
) -> None:
    """Predict the peak GPU memory of WORKLOAD's training step and what takes it.

    Runs two optimizer steps on fake tensors (no memory, no arithmetic), as CUDA would run
    them (its attention kernels, autocast lists, fused dropout, cuDNN RNNs). With a target
    (--gpu, --memory or --device sim:SIZE) and no --batch-size it finds the largest batch
    that fits (--max-batch: also with --batch-size). With --world-size N the figures are
    one rank's, traced through DDP, ZeRO-1 or FSDP2 on a fake process group of N ranks.
    """
    if snapshot_path is not None and world_size > 1:
        raise MemfitError(
            "--snapshot records one GPU's unsharded step: drop --world-size (or estimate with --world-size 1)"
        )
    if snapshot_path is not None:
        check_writable(snapshot_path, "--snapshot")  # before the work, not after it
    apply_alloc_conf(alloc_conf)
    settings = make_settings(
        precision, checkpointing, accumulation_steps=accumulation_steps, **strategy(world_size, shard, shard_group_size)
    )
    result = estimate(
        workload,
        batch_size,
        settings,
        gpu=gpu,
        memory=memory,
        device=device_spec,
        fixed_costs=fixed_costs,
        cuda_version=cuda_version if cuda_version is not None else locked_cuda_version(),
        search=max_batch,
    )
    if snapshot_path is not None:
        from memfit._io import write_atomically
        from memfit.estimator.snapshot import step_snapshot
        from memfit.memory.allocator import snapshot_bytes

        snapshot = step_snapshot(
            workload,
            result.batch_size,
            settings,
            gpu=gpu,
            memory=memory,
            device=device_spec,
            fixed_costs=fixed_costs,
        )
        write_atomically(snapshot_path, snapshot_bytes(snapshot))
    if as_json:
        print_json(result.to_dict())
        return
    console.print(breakdown_table(result))
    if result.top_modules:
        console.print(modules_table(result))
    console.print(summary_line(result))
    allocator = allocator_line(result)
    if allocator:
        console.print(allocator)
    if result.host_memory is not None:
        console.print(offload_line(result))
    if result.checkpointed:
        console.print(checkpointing_line(result))
    speed = speed_line(result)
    if speed:
        console.print(speed)
    elif result.speed_note:
        console.print(f"Predicted speed: {result.speed_note}.")
    if result.world_size > 1:
        console.print(method_line(result))
    if result.compile_note:
        console.print(f"[yellow]torch.compile:[/yellow] {result.compile_note}.", soft_wrap=True)
    if snapshot_path is not None:
        console.print(
            f"snapshot: {snapshot_path} (open it at https://pytorch.org/memory_viz, "
            "or: python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html)"
        )


def checkpointing_line(result: Estimate) -> str:
    """What checkpointing recomputes and the peak allocated memory it saves."""
    saves = result.checkpointing_saves
    if saves is None:
        saved = ""
    elif saves > 0:
        saved = f", saving {format_size(saves)} of peak allocated memory"
    else:
        saved = ": it saves nothing here (the peak is elsewhere)"
    return f"Checkpointing {result.settings['checkpointing']}: {result.checkpointed} recompute in backward{saved}."


def locked_cuda_version(path: Path = Path("memfit.lock")) -> str | None:
    """The lock's CUDA (``torch_cuda``) when torch here has none and ./memfit.lock exists.

    Why only then: the installed torch's CUDA comes first (it is what will train when
    this machine trains), and a lock written elsewhere says what that machine ran.
    """
    from memfit.cuda.context import installed_cuda_version
    from memfit.search.lock import load_lock

    if installed_cuda_version() is not None or not path.is_file():
        return None
    return load_lock(path).environment.torch_cuda


def breakdown_table(result: Estimate) -> Table:
    """What holds the memory at the peak, one row per category."""
    title = f"memfit estimate · {result.workload} · batch {result.batch_size} · {result.target}"
    if result.cuda_version is not None:
        title += f" · CUDA {result.cuda_version}"
    if result.world_size > 1:
        title += f" · rank {result.rank} of {result.world_size}, shard {result.shard}"
    table = Table(title=title)
    table.add_column("at the peak")
    table.add_column("memory", justify="right")
    table.add_column("share", justify="right")
    for name, nbytes in result.breakdown.items():
        share = f"{100 * nbytes / result.total:.1f} %" if result.total else "-"
        table.add_row(name, format_size(nbytes), share)
    table.add_section()
    table.add_row("peak allocated", format_size(result.peak_allocated), "")
    table.add_row("peak reserved", format_size(result.peak_reserved), "")
    table.add_row("[bold]total[/bold]", f"[bold]{format_size(result.total)}[/bold]", "")
    return table


def modules_table(result: Estimate) -> Table:
    table = Table(title="modules holding the most activation memory")
    table.add_column("module")
    table.add_column("activations", justify="right")
    for row in result.top_modules:
        table.add_row(row["module"], format_size(row["bytes"]))
    return table


def method_line(result: Estimate) -> str:
    """Where the per-rank figures come from: a trace of PyTorch's components, or formulas."""
    if result.method == "traced":
        return (
            f"Per-rank figures for rank {result.rank} (the rank holding the most), traced through "
            f"{result.strategy} on a fake process group of {result.world_size} ranks."
        )
    return f"[yellow]Per-rank figures from formulas:[/yellow] {result.method_note}."


def summary_line(result: Estimate) -> str:
    """One sentence: fits or not, and the largest batch."""
    if result.memory is None:
        return "No target memory given: add --gpu NAME, --memory SIZE or --device sim:SIZE for fits and max batch size."
    verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    line = f"Batch {result.batch_size} {verdict} in {format_size(result.memory)} ({result.target})."
    if result.cuda:
        line += f" As CUDA runs it: {result.cuda}."
    if result.max_batch_size is not None:
        line += f" Largest batch that fits: {result.max_batch_size}."
    return line


def allocator_line(result: Estimate) -> str | None:
    """Peak reserved memory under the settings the estimate ran with and the others compared."""
    if len(result.reserved_by_setting) < 2:
        return None
    parts = []
    for name, reserved in result.reserved_by_setting.items():
        figure = format_size(reserved) if reserved is not None else "does not fit"
        if reserved is not None and name != result.allocator:
            saved = result.peak_reserved - reserved
            figure += f" ({'saves' if saved >= 0 else 'costs'} {format_size(abs(saved))})"
        parts.append(f"{name}{' (this run)' if name == result.allocator else ''}: {figure}")
    return "Peak reserved under allocator settings: " + "; ".join(parts) + "."


def offload_line(result: Estimate) -> str:
    """What CPU offload keeps on the host, and what its copies and CPU optimizer step cost."""
    line = (
        f"CPU offload: the host holds {format_size(result.host_memory or 0)} at most (parameters, gradients, "
        "optimizer state; the optimizer steps on the CPU)"
    )
    time = result.predicted_time or {}
    if "offload_copy_seconds" in time:
        line += (
            f"; per step {_seconds(time['offload_copy_seconds'])} of copies over PCIe and "
            f"{_seconds(time['cpu_optimizer_seconds'])} of the CPU's optimizer step (in the predicted time below)"
        )
    return line + "."


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def speed_line(result: Estimate) -> str | None:
    """The predicted step time on the target's card, with what it assumes; None without one."""
    if result.predicted_seconds_per_step is None or result.predicted_time is None:
        return None
    time = result.predicted_time
    line = (
        f"Predicted on {result.speed_gpu}: {_seconds(result.predicted_seconds_per_step)} per step, "
        f"[bold]{result.predicted_samples_per_second:,.4g} samples/s[/bold] (eager PyTorch; the GPU computes "
        f"{_seconds(time['compute_seconds'])} and moves memory {_seconds(time['memory_seconds'])}, "
        f"the host launches for {_seconds(time['host_seconds'])})."
    )
    classes = time.get("by_class") or {}
    if classes:
        busy = sum(classes.values()) or 1.0
        top = ", ".join(f"{name.replace('_', ' ')} {seconds / busy:.0%}" for name, seconds in list(classes.items())[:4])
        bound = str(time.get("bound_by", "")).replace("_", " ")
        if bound == "layout":
            bound = "layout (cuDNN's NCHW<->NHWC transposes: channels_last avoids them)"
        line += f" Bound by {bound}; GPU time by kernel class: {top}."
    if result.speed_accuracy is not None:
        text = str(result.speed_accuracy["text"])
        line += f" Such predictions were {text}."
    if result.target.startswith("sim:") and result.target != f"sim:{result.speed_gpu}":
        line += (
            f" {result.target} names no card: the speed is the {result.speed_gpu}'s; "
            'name one with --device "sim:RTX 4090".'
        )
    return line
