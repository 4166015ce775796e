"""``memfit probe``: find the largest batch that fits, and the one to use, by trial.

A progress line per trial goes to stderr; the table of trials (or ``--json``) to stdout;
``--plot FILE.png`` draws peak memory and samples/s against the batch size with the
device's capacity as a line. Under torchrun (WORLD_SIZE > 1) every rank probes its own
GPU (``cuda:LOCAL_RANK``), all agree on the smallest answer, and only rank 0 prints.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import click
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from memfit import distributed
from memfit._io import check_writable
from memfit.cli.options import (
    OutputPath,
    card_device,
    card_option,
    console,
    device_options,
    err_console,
    headroom_option,
    json_option,
    make_settings,
    print_json,
    settings_options,
    strategy,
    strategy_options,
    trials_option,
    workload_argument,
)
from memfit.cli.tables import compact_table, short_rate, short_size
from memfit.distributed import process_group
from memfit.errors import MemfitError
from memfit.memory.devices import Device, rank_device
from memfit.memory.devices import device as make_device
from memfit.run.host_memory import check_host_memory
from memfit.run.measure import Measurement
from memfit.search.probe import ProbeResult, probe
from memfit.search.probe import Progress as ProgressCallback
from memfit.workload import load_workload

if TYPE_CHECKING:
    from memfit.search.trials import TrialKind

#: the bar's length: the search usually proves its answer within this many trials
EXPECTED_TRIALS = 10


@click.command("probe")
@workload_argument
@device_options
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None, help="Largest batch to consider.")
@click.option(
    "--multiple-of",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Only batch sizes that are multiples of K (8 suits tensor cores).",
)
@headroom_option("Fraction of memory the recommended batch leaves free.")
@click.option(
    "--guess",
    type=click.IntRange(min=1),
    default=None,
    help="A predicted maximum, tried first (default: memfit estimate's, when the memory is known).",
)
@click.option("--no-estimate", is_flag=True, help="Search from batch 1 instead of starting at the estimate.")
@click.option(
    "--eval",
    "evaluation",
    is_flag=True,
    help="The largest evaluation batch instead: the loss in eval mode under torch.no_grad, no optimizer step.",
)
@click.option("--inference-mode", is_flag=True, help="With --eval: under torch.inference_mode instead of no_grad.")
@settings_options
@trials_option
@strategy_options
@click.option(
    "--plot",
    "plot_path",
    type=OutputPath(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE.png",
    help="Draw memory and samples/s against batch size.",
)
@card_option("Probe on")
@json_option
def command(
    workload: str,
    device_spec: str,
    memory: str | None,
    max_batch_size: int | None,
    multiple_of: int,
    headroom: float,
    guess: int | None,
    no_estimate: bool,
    evaluation: bool,
    inference_mode: bool,
    precision: str,
    checkpointing: str,
    trials: str,
    world_size: int,
    shard: str,
    shard_group_size: int | None,
    plot_path: Path | None,
    card: str | None,
    as_json: bool,
) -> None:
    """Find the largest batch of WORKLOAD that fits on the device (exact), and the one to use.

    Each trial runs two optimizer steps; an out-of-memory is a trial result.
    """
    if inference_mode and not evaluation:
        raise MemfitError("--inference-mode applies to the evaluation batch: add --eval")
    if plot_path is not None and plot_path.suffix.lower() != ".png":
        raise MemfitError(f"--plot {plot_path}: the file name must end in .png")
    if plot_path is not None:
        check_writable(plot_path, "--plot")  # before the trials, not after them
    wl = load_workload(workload)
    settings = make_settings(precision, checkpointing, **strategy(world_size, shard, shard_group_size))
    with process_group():
        gpu = make_device(rank_device(card_device(device_spec, card)), memory=memory)
        main = distributed.is_main_process()
        say = (lambda text: err_console.print(f"memfit probe · {text}")) if main else None
        check_host_memory(gpu, wl)  # before any trial builds the model for real
        with _progress_bar(enabled=main) as progress:
            result = probe(
                wl,
                gpu,
                settings,
                max_batch_size=max_batch_size,
                multiple_of=multiple_of,
                headroom=headroom,
                guess=guess if guess is not None or no_estimate else "estimate",
                progress=progress,
                trials=cast("TrialKind", trials),
                say=say,
                evaluation=("inference_mode" if inference_mode else "no_grad") if evaluation else False,
            )
    if not main:
        return
    if plot_path is not None:
        from memfit._io import write_atomically
        from memfit.reporting.figures import probe_png
        from memfit.search.probe_speeds import with_predicted_speeds

        charted = with_predicted_speeds(result.to_dict(), wl, settings, gpu, card)  # the card's speed, not the CPU's
        write_atomically(plot_path, probe_png(charted) or b"")
    if as_json:
        print_json(result.to_dict())
        return
    console.print(trials_table(result, gpu))
    console.print(trials_legend(result, gpu))
    console.print(summary(result))
    worst = result.extra.get("worst_case")
    if worst is not None:
        console.print(
            f"worst case: sample {worst['sample']} (size {tuple(worst['size'])}) of {worst['samples']:,} sets the "
            f"limit; every batch tried held the largest samples (sizes from {worst['found_by']})"
        )
    if plot_path is not None:
        console.print(f"plot: {plot_path}")


def trials_legend(result: ProbeResult, gpu: Device) -> str:
    """What the short words of :func:`trials_table` mean, and whose speed samples/s is."""
    parts = ["peak alloc / resv: peak allocated / reserved", "of cap: reserved share of capacity"]
    if any(t.fake for t in result.trials):
        parts.append("fake: on fake tensors (memory only, no arithmetic)")
    if gpu.simulated:
        parts.append(f"samples/s: this CPU's speed on {gpu.spec}, not a GPU's")
    return " · ".join(parts)


def trials_table(result: ProbeResult, gpu: Device) -> Table:
    """One row per trial, in the order they ran (80 columns: short headers and sizes)."""
    table = compact_table(f"memfit probe · {result.workload} on {gpu.describe()}")
    for column in ("#", "batch", "fits", "peak alloc", "peak resv", "of cap", "samples/s", "ran on"):
        table.add_column(column, justify="right")
    for index, trial in enumerate(result.trials, 1):
        share = f"{trial.peak_reserved / result.capacity:.0%}" if result.capacity else "-"
        table.add_row(
            str(index),
            str(trial.batch_size),
            "yes" if trial.fits else "[red]no[/red]",
            short_size(trial.peak_allocated),
            short_size(trial.peak_reserved),
            share if trial.fits else "-",
            short_rate(trial.samples_per_second),
            "fake" if trial.fake else "device",
        )
    return table


def summary(result: ProbeResult) -> str:
    """The answer in three lines."""
    bound = (
        f"{result.max_batch_size + result.multiple_of} does not fit"
        if result.limit == "memory"
        else "the --max-batch-size bound"
    )
    ranks = f" (smallest over {result.world_size} ranks)" if result.world_size > 1 else ""
    if "rehearsed_rank" in result.extra:
        ranks = (
            f" per rank of {result.extra['rehearsed_world_size']} ({result.extra['strategy']}; rank "
            f"{result.extra['rehearsed_rank']}, the one holding the most, rehearsed on a fake process group: "
            "samples/s without communication)"
        )
    mode = result.extra.get("evaluation")
    if mode is not None:
        return (
            f"largest evaluation batch that fits: [bold]{result.max_batch_size}[/bold] ({bound}; eval mode under "
            f"torch.{mode}, no gradients or optimizer state)\n"
            f"recommended evaluation batch: [bold]{result.recommended_batch_size}[/bold]: {result.reason}\n"
            f"{len(result.trials)} trials, {result.trial_steps} evaluation batches"
        )
    return (
        f"largest batch that fits: [bold]{result.max_batch_size}[/bold]{ranks} ({bound})\n"
        f"recommended batch: [bold]{result.recommended_batch_size}[/bold]: {result.reason}\n"
        f"{len(result.trials)} trials, {result.trial_steps} optimizer steps"
    )


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[ProgressCallback | None]:
    """A rich progress bar over trials on stderr (started at the first trial), or None.

    Why started late: an argument error raised before any trial must print its one line
    and nothing else.
    """
    if not enabled:
        yield None
        return
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed} trials"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )
    task = bar.add_task("probing", total=EXPECTED_TRIALS)
    started = False

    def update(batch_size: int, measurement: Measurement | None) -> None:
        nonlocal started
        if not started:
            bar.start()
            started = True
        if measurement is None:
            bar.update(task, description=f"batch {batch_size}")
            return
        verdict = ("fits" if measurement.fits else "out of memory") + (" (fake tensors)" if measurement.fake else "")
        done = bar.tasks[task].completed + 1
        bar.update(
            task, completed=done, total=max(EXPECTED_TRIALS, done + 1), description=f"batch {batch_size}: {verdict}"
        )

    try:
        yield update
    finally:
        if started:
            bar.stop()
