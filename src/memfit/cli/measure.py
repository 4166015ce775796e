"""``memfit measure``: run a workload at one batch size and report memory and speed."""

from __future__ import annotations

import click
from rich.table import Table

from memfit.cli.options import (
    console,
    device_options,
    json_option,
    make_settings,
    print_json,
    settings_options,
    workload_argument,
)
from memfit.memory.devices import device
from memfit.run.measure import measure
from memfit.units import format_size
from memfit.workload import load_workload


@click.command("measure")
@workload_argument
@device_options
@click.option("--batch-size", type=click.IntRange(min=1), required=True, help="Samples per forward/backward pass.")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True, help="Optimizer steps to run.")
@settings_options
@json_option
def command(
    workload: str,
    device_spec: str,
    memory: str | None,
    batch_size: int,
    steps: int,
    precision: str,
    checkpointing: str,
    as_json: bool,
) -> None:
    """Run STEPS optimizer steps of WORKLOAD at one batch size; report peak memory and time.

    An out-of-memory is a result ("fits": false), not an error.
    """
    wl = load_workload(workload)
    gpu = device(device_spec, memory=memory)
    settings = make_settings(precision, checkpointing)
    result = measure(wl, batch_size, gpu, settings, steps=steps)
    if as_json:
        print_json(result.to_dict())
        return
    table = Table(title=f"memfit measure · {wl.name} on {gpu.describe()}")
    for column in ("batch size", "fits", "peak allocated", "peak reserved", "s/step", "samples/s"):
        table.add_column(column, justify="right")
    table.add_row(
        str(result.batch_size),
        "yes" if result.fits else "[red]no (out of memory)[/red]",
        format_size(result.peak_allocated),
        format_size(result.peak_reserved),
        f"{result.seconds_per_step:.3f}" if result.seconds_per_step else "-",
        f"{result.samples_per_second:.1f}" if result.samples_per_second else "-",
    )
    console.print(table)
