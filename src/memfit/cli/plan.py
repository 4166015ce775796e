"""``memfit plan``: the fastest settings that reach a target batch within memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import click
from rich.table import Table

from memfit._io import check_writable
from memfit.cli.options import (
    console,
    device_options,
    err_console,
    headroom_option,
    json_option,
    plan_strategy_options,
    print_json,
    settings_axes_options,
    trials_option,
    workload_argument,
)
from memfit.memory.devices import device
from memfit.search.candidates import Candidate, check_target
from memfit.search.plan import Plan, plan
from memfit.units import format_size
from memfit.workload import load_workload

if TYPE_CHECKING:
    from memfit.run.settings import Checkpointing, Precision
    from memfit.run.strategy import Shard
    from memfit.search.trials import TrialKind


@click.command("plan")
@workload_argument
@click.option(
    "--target-batch",
    "target",
    type=click.IntRange(min=1),
    required=True,
    help="Global batch per optimizer step (micro-batch x accumulation x world size).",
)
@device_options
@plan_strategy_options
@settings_axes_options
@headroom_option("Fraction of memory the recommended settings leave free.")
@click.option(
    "--reference-batch",
    type=click.IntRange(min=1),
    default=None,
    help="The batch your learning rate was tuned for (for scaling advice).",
)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG of memory against speed.")
@click.option(
    "--gpu",
    "speed_gpu",
    default=None,
    metavar="NAME",
    help="Rank by the predicted speed on this GPU of the table (default on sim: its card, else an A100 80GB SXM); "
    "without a CUDA GPU and --device, also plan for its memory (--device sim:NAME).",
)
@trials_option
@json_option
def command(
    workload: str,
    target: int,
    device_spec: str,
    memory: str | None,
    world_size: int,
    shards: tuple[str, ...],
    gpus_per_node: int | None,
    precisions: tuple[str, ...],
    checkpointing: tuple[str, ...],
    headroom: float,
    reference_batch: int | None,
    plot: str | None,
    speed_gpu: str | None,
    trials: str,
    as_json: bool,
) -> None:
    """Choose micro-batch, accumulation, precision, checkpointing and (for several GPUs) the
    sharding strategy that reach TARGET fastest.

    With --world-size N each trial rehearses the rank that holds the most on a fake process
    group of N ranks (its memory on the device exactly; its time without communication).
    """
    check_target(target, world_size)  # before the workload is loaded
    if plot:
        check_writable(plot, "--plot")  # before the candidates run, not after them
    wl = load_workload(workload)
    if device_spec == "auto" and speed_gpu is not None and memory is None and not _has_cuda():
        device_spec = f"sim:{speed_gpu}"  # the card named is the one planned for
    gpu = device(device_spec, memory=memory)

    def progress(c: Candidate) -> None:
        s = c.settings
        ran = " (fake tensors)" if c.measurement is not None and c.measurement.fake else ""
        strategy = (f" {s.shard}" + (f"/{s.shard_group_size}" if s.shard_group_size else "")) if world_size > 1 else ""
        err_console.print(
            f"  tried micro-batch {s.micro_batch_size} {s.precision} {s.checkpointing}{strategy}: {c.status}{ran}"
        )

    result = plan(
        wl,
        target,
        gpu,
        world_size=world_size,
        shards=cast("tuple[Shard, ...]", shards) or None,
        gpus_per_node=gpus_per_node,
        precisions=cast("tuple[Precision, ...]", precisions) or None,
        checkpointing=cast("tuple[Checkpointing, ...]", checkpointing) or None,
        reference_batch_size=reference_batch,
        headroom=headroom,
        progress=None if as_json else progress,
        speed_gpu=speed_gpu,
        trials=cast("TrialKind", trials),
        say=None if as_json else (lambda text: err_console.print(f"  {text}")),
    )
    if plot:
        write_plot(result, plot)
    if as_json:
        print_json(result.to_dict())
        return
    print_plan(result)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def write_plot(result: Plan, path: str) -> None:
    """The plan's figure as a PNG (written atomically), or a one-line error without data."""
    from pathlib import Path

    from memfit._io import write_atomically
    from memfit.errors import MemfitError
    from memfit.reporting.figures import plan_png

    png = plan_png(result.to_dict())
    if png is None:
        raise MemfitError("no candidate was measured: nothing to plot")
    write_atomically(Path(path), png)


def print_plan(result: Plan) -> None:
    """The candidates table, the recommendation and the advice."""
    ranks = f" x {result.world_size} ranks" if result.world_size > 1 else ""
    table = Table(title=f"memfit plan · {result.workload} → batch {result.target_batch_size} on {result.device}{ranks}")
    predicted = result.ranked_by == "predicted"
    speed = f"samples/s on {result.speed_gpu}" if predicted else "samples/s"
    columns = ["micro", "accum", "precision", "checkpointing"]
    # one GPU shows the strategy once CPU offload (plan's fallback) was weighed
    strategies = result.world_size > 1 or any(c.settings.shard != "none" for c in result.candidates)
    if strategies:
        columns.append("strategy")
    columns += ["status", "peak reserved", speed]
    if predicted:
        columns.append("measured (CPU)" if result.device.startswith(("sim", "cpu")) else "measured")
    for column in (*columns, "Pareto"):
        table.add_column(column, justify="right")
    front = {id(c) for c in result.pareto}
    for c in result.candidates:
        if c.status == "not run":
            continue
        s, m = c.settings, c.measurement
        mark = "★" if c is result.recommended else ("•" if id(c) in front else "")
        strategy = [f"{s.shard}" + (f"/{s.shard_group_size}" if s.shard_group_size else "")]
        table.add_row(
            str(s.micro_batch_size),
            str(s.accumulation_steps),
            s.precision,
            s.checkpointing,
            *(strategy if strategies else []),
            c.status,
            format_size(m.peak_reserved) if m else "-",
            *(
                [_rate(c.predicted_samples_per_second), _rate(c.samples_per_second)]
                if predicted
                else [_rate(c.samples_per_second)]
            ),
            mark,
        )
    console.print(table)
    if result.estimate_error:
        console.print(f"The estimate could not prune candidates ({result.estimate_error}); every one was tried.")
    if result.speed_error:
        console.print(
            f"The predicted GPU speed could not be computed ({result.speed_error}): ranked by the measured "
            f"speed on {result.device}, which on a simulated GPU is the CPU's."
        )
    if predicted:
        console.print(
            f"Ranked by the predicted speed on the {result.speed_gpu} (eager PyTorch; the trials ran on "
            f"{result.device} for memory)."
        )
    console.print(f"[bold]Recommended:[/bold] {result.reason}")
    for note in result.advice:
        console.print(f"  • {note}")


def _rate(value: float | None) -> str:
    return f"{value:,.1f}" if value else "-"
