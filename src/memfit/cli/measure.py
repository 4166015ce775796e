"""``memfit measure``: run a workload at one batch size and report memory and speed."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from memfit.cli.options import (
    alloc_conf_option,
    apply_alloc_conf,
    console,
    device_options,
    json_option,
    make_settings,
    print_json,
    settings_options,
    strategy,
    strategy_options,
    workload_argument,
)
from memfit.errors import MemfitError
from memfit.memory.devices import device
from memfit.run.host_memory import check_host_memory
from memfit.run.measure import Measurement, measure
from memfit.units import format_size
from memfit.workload import load_workload


@click.command("measure")
@workload_argument
@device_options
@click.option("--batch-size", type=click.IntRange(min=1), required=True, help="Samples per forward/backward pass.")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True, help="Optimizer steps to run.")
@settings_options
@strategy_options
@alloc_conf_option
@json_option
def command(
    workload: str,
    device_spec: str,
    memory: str | None,
    batch_size: int,
    steps: int,
    precision: str,
    checkpointing: str,
    world_size: int,
    shard: str,
    shard_group_size: int | None,
    alloc_conf: str | None,
    as_json: bool,
) -> None:
    """Run STEPS optimizer steps of WORKLOAD at one batch size; report peak memory and time.

    An out-of-memory is a result ("fits": false), not an error. With --world-size N (under
    torchrun --nproc-per-node N) every rank trains with the --shard strategy on its own
    device; rank 0 prints its figures, every rank's and the largest over the ranks.
    """
    settings = make_settings(precision, checkpointing, **strategy(world_size, shard, shard_group_size))
    apply_alloc_conf(alloc_conf)
    ranks = _ranks_in_group()
    if world_size > 1 and ranks != world_size:
        where = f"{ranks} processes" if ranks > 1 else "one process"
        raise MemfitError(
            f"--world-size {world_size} measures a real run of {world_size} ranks, but this is {where}: "
            f"run it under torchrun --nproc-per-node {world_size}, or predict it with memfit estimate"
        )
    wl = load_workload(workload)
    gpu = device(device_spec, memory=memory)
    check_host_memory(gpu, wl)  # a real run: refused before it exhausts the host
    result = measure(wl, batch_size, gpu, settings, steps=steps)
    per_rank = _every_rank(result) if world_size > 1 else None
    if as_json:
        data: dict[str, Any] = result.to_dict()
        if per_rank is not None:
            data.update(_over_ranks(per_rank, settings.shard, shard_group_size))
        print_json(data)
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
    if per_rank is not None:
        over = _over_ranks(per_rank, settings.shard, shard_group_size)
        console.print(
            f"{world_size} ranks ({over['strategy']}): largest peak allocated "
            f"{format_size(over['max_peak_allocated'])}, reserved {format_size(over['max_peak_reserved'])} "
            f"(rank {over['max_rank']}); "
            + ("every rank fits." if over["all_fit"] else "[red]a rank ran out of memory.[/red]")
        )


def _ranks_in_group() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _every_rank(result: Measurement) -> list[dict[str, Any]]:
    """Every rank's peaks and verdict, in rank order (one all-gather; every rank calls it)."""
    import torch.distributed as dist

    mine = {"fits": result.fits, "peak_allocated": result.peak_allocated, "peak_reserved": result.peak_reserved}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [{"rank": rank, **figures} for rank, figures in enumerate(gathered)]


def _over_ranks(per_rank: list[dict[str, Any]], shard: str, group_size: int | None) -> dict[str, Any]:
    from memfit.run.strategy import describe

    largest = max(per_rank, key=lambda r: (r["peak_reserved"], r["peak_allocated"]))
    return {
        "world_size": len(per_rank),
        "shard": shard,
        "shard_group_size": group_size,
        "strategy": describe(shard, len(per_rank), group_size),
        "rank": 0,
        "ranks": per_rank,
        "max_peak_allocated": max(r["peak_allocated"] for r in per_rank),
        "max_peak_reserved": largest["peak_reserved"],
        "max_rank": largest["rank"],
        "all_fit": all(r["fits"] for r in per_rank),
    }
