"""``memfit plan``: the fastest settings that reach a target batch within memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import click

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
    plan_strategy_options,
    print_json,
    settings_axes_options,
    trials_option,
    workload_argument,
)
from memfit.cli.tables import compact_table, short_rate, short_size, status_legend, status_word
from memfit.estimator import speed_accuracy
from memfit.memory.devices import device
from memfit.search.candidates import Candidate, check_target
from memfit.search.plan import Plan, plan
from memfit.workload import load_workload

if TYPE_CHECKING:
    from memfit.run.settings import Precision
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
@click.option("--plot", type=OutputPath(dir_okay=False), default=None, help="Write a PNG of memory against speed.")
@card_option("Plan for")
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
    card: str | None,
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
    gpu = device(card_device(device_spec, card), memory=memory)
    say = None if as_json else (lambda text: err_console.print(f"  {text}"))

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
        checkpointing=checkpointing or None,
        reference_batch_size=reference_batch,
        headroom=headroom,
        progress=None if as_json else progress,
        speed_gpu=card,
        trials=cast("TrialKind", trials),
        say=say,
    )
    if plot:
        write_plot(result, plot)
    if as_json:
        print_json(result.to_dict())
        return
    print_plan(result)


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
    """The candidates table, its legend, the recommendation and the advice.

    The table fits 80 columns: short headers and status words (the legend spells them
    out), and the candidates a measured one beats are counted, not listed (``--json``
    lists every candidate).
    """
    ranks = f" x {result.world_size} ranks" if result.world_size > 1 else ""
    table = compact_table(
        f"memfit plan · {result.workload} → batch {result.target_batch_size} on {result.device}{ranks}"
    )
    predicted = result.ranked_by == "predicted"
    on_cpu = result.device.startswith(("sim", "cpu"))
    columns = ["micro", "accum", "prec", "ckpt"]
    # one GPU shows the strategy once CPU offload (plan's fallback) was weighed
    strategies = result.world_size > 1 or any(c.settings.shard != "none" for c in result.candidates)
    if strategies:
        columns.append("strategy")
    columns += ["status", "peak"]
    columns += (["pred/s", "CPU/s" if on_cpu else "meas/s"]) if predicted else ["samples/s"]
    for column in (*columns, ""):
        table.add_column(column, justify="right")
    front = {id(c) for c in result.pareto}
    shown = [c for c in result.candidates if c.status not in ("not run", "dominated")]
    beaten = sum(c.status == "dominated" for c in result.candidates)
    for c in shown:
        s, m = c.settings, c.measurement
        mark = "★" if c is result.recommended else ("•" if id(c) in front else "")
        strategy = [f"{s.shard}" + (f"/{s.shard_group_size}" if s.shard_group_size else "")]
        speeds = [short_rate(c.predicted_samples_per_second)] if predicted else []
        table.add_row(
            str(s.micro_batch_size),
            str(s.accumulation_steps),
            s.precision,
            s.checkpointing,
            *(strategy if strategies else []),
            status_word(c.status),
            short_size(m.peak_reserved) if m else "-",
            *speeds,
            short_rate(c.samples_per_second),
            mark,
        )
    console.print(table)
    legend = status_legend({c.status for c in shown} | ({"dominated"} if beaten else set()))
    marks = "★ recommended · • on the Pareto front (least memory for its speed)"
    console.print(f"{legend} · {marks}" if legend else marks)
    if beaten:
        console.print(f"{beaten} candidate(s) beaten by a measured one are not listed (--json lists them).")
    if predicted:
        cpu = "; CPU/s: the CPU's own speed there" if on_cpu else ""
        console.print(
            f"pred/s: samples/s predicted on the {result.speed_gpu} (eager PyTorch); "
            f"the trials ran on {result.device} for memory{cpu}.{speed_accuracy.sentence()}"
        )
        if result.device.startswith("sim:") and result.device != f"sim:{result.speed_gpu}":
            console.print(
                f"{result.device} names no card: the speed is the {result.speed_gpu}'s; "
                'name one with --gpu NAME or --device "sim:RTX 4090".'
            )
    if result.estimate_error:
        console.print(f"The estimate could not prune candidates ({result.estimate_error}); every one was tried.")
    if result.speed_error:
        console.print(
            f"The predicted GPU speed could not be computed ({result.speed_error}): ranked by the measured "
            f"speed on {result.device}, which on a simulated GPU is the CPU's."
        )
    console.print(f"[bold]Recommended:[/bold] {result.reason}")
    for note in result.advice:
        console.print(f"  • {note}")
