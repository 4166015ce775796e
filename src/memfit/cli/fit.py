"""``memfit fit``: doctor, estimate, probe and plan; then memfit.lock and a report."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import click

from memfit._io import check_writable, check_writable_folder
from memfit.cli.options import (
    OutputPath,
    card_device,
    card_option,
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
from memfit.reporting.pages import check_report_outputs
from memfit.run.host_memory import check_host_memory
from memfit.search.candidates import check_target
from memfit.search.fit import fit
from memfit.workload import load_workload

if TYPE_CHECKING:
    from memfit.run.settings import Precision
    from memfit.run.strategy import Shard
    from memfit.search.trials import TrialKind


@click.command("fit")
@workload_argument
@device_options
@click.option(
    "--target-batch",
    "target",
    type=click.IntRange(min=1),
    default=None,
    help="Global batch per optimizer step (default: the batch probe recommends).",
)
@click.option(
    "--max-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Stop the batch search here (the largest batch you would ever use).",
)
@plan_strategy_options
@settings_axes_options
@headroom_option("Fraction of memory to keep free.")
@click.option(
    "--lock",
    "lock_path",
    default="memfit.lock",
    show_default=True,
    type=OutputPath(dir_okay=False),
    help="Where to write the lock.",
)
@click.option(
    "--report-dir",
    default="memfit-report",
    show_default=True,
    type=OutputPath(file_okay=False),
    help="Where to write report.html and its figures.",
)
@click.option("--no-doctor", is_flag=True, help="Skip the environment checks.")
@card_option("Plan for")
@trials_option
@json_option
def command(
    workload: str,
    device_spec: str,
    memory: str | None,
    target: int | None,
    max_batch_size: int | None,
    world_size: int,
    precisions: tuple[str, ...],
    checkpointing: tuple[str, ...],
    shards: tuple[str, ...],
    gpus_per_node: int | None,
    headroom: float,
    lock_path: str,
    report_dir: str,
    no_doctor: bool,
    card: str | None,
    trials: str,
    as_json: bool,
) -> None:
    """Find what fits and the fastest settings for WORKLOAD; write memfit.lock and a report."""
    gpu = device(card_device(device_spec, card), memory=memory)
    say = None if as_json else (lambda text: err_console.print(f"[dim]memfit fit ·[/dim] {text}"))
    if target is not None:
        check_target(target, world_size)  # before the workload is loaded
    check_writable(lock_path, "lock")  # and every output: seconds now, not after the search
    check_report_outputs(check_writable_folder(report_dir, "report folder") / "report.html")
    wl = load_workload(workload)
    check_host_memory(gpu, wl)  # before any trial builds the model for real
    result = fit(
        wl,
        gpu,
        target_batch_size=target,
        headroom=headroom,
        max_batch_size=max_batch_size,
        world_size=world_size,
        precisions=cast("tuple[Precision, ...]", precisions) or None,
        checkpointing=checkpointing or None,
        shards=cast("tuple[Shard, ...]", shards) or None,
        gpus_per_node=gpus_per_node,
        lock_path=lock_path,
        report_dir=report_dir,
        run_doctor=not no_doctor,
        say=say,
        speed_gpu=card,
        trials=cast("TrialKind", trials),
    )
    if as_json:
        print_json(result.to_dict())
        return
    console.print(f"[bold]memfit fit · {result.workload} on {gpu.describe()}[/bold]")
    for line in result.summary():
        console.print(f"  {line}")
