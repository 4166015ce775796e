"""``memfit doctor``: find the environment causes of OOM (and of fake OOM), with the fix for each."""

from __future__ import annotations

from dataclasses import replace

import click
from rich.text import Text

from memfit.cli.options import console, json_option, print_json, size_or_none
from memfit.environment import system
from memfit.environment.doctor import Diagnosis, EnvironmentFinding, TrainingHints, diagnose
from memfit.errors import MemfitError
from memfit.units import format_size

_MARKS = {"error": ("✗ error  ", "bold red"), "warning": ("! warning", "yellow"), "info": ("· info   ", "dim")}


def allocator_finding(workload: str, batch_size: int, gpu: str | None) -> EnvironmentFinding:
    """The allocator setting that reserves least for the workload's step, with its predicted
    saving: the step on fake tensors, its events replayed under each setting
    (:func:`memfit.estimate`'s ``reserved_by_setting``)."""
    from memfit.estimator.estimate import estimate
    from memfit.memory import allocator_conf
    from memfit.search.offload_plan import allocator_advice

    est = estimate(workload, batch_size, gpu=gpu, search=False, speed=False)
    advice = allocator_advice(est.reserved_by_setting, allocator_conf.current().describe())
    if not advice:
        shown = ", ".join(
            f"{k}: {format_size(v) if v is not None else 'does not fit'}" for k, v in est.reserved_by_setting.items()
        )
        return EnvironmentFinding(
            "allocator", "info", f"{workload} at batch {batch_size}: the allocator settings now reserve least ({shown})"
        )
    message, _, fix = advice[0].removeprefix("allocator: ").partition(": ")
    return EnvironmentFinding("allocator", "info", f"{workload} at batch {batch_size}: {message}", fix)


def render(diagnosis: Diagnosis) -> None:
    """Findings one per line with the fix below.

    Text (not markup) so "[...]" in settings prints as is; soft wrap so a fix command is
    never broken by a hard newline when pasted.
    """
    for finding in diagnosis.findings:
        mark, style = _MARKS[finding.severity]
        line = Text(mark, style=style)
        line.append(f" {finding.message}")
        console.print(line, soft_wrap=True)
        if finding.fix:
            console.print(Text(f"            fix: {finding.fix}", style="cyan"), soft_wrap=True)
    errors, warnings = diagnosis.count("error"), diagnosis.count("warning")
    summary = f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"
    console.print(Text(summary, style="bold red" if errors else "bold"))


@click.command("doctor")
@click.option("--variable-shapes", is_flag=True, help="Training inputs change shape from step to step.")
@click.option("--cudnn-benchmark", is_flag=True, help="The training script sets torch.backends.cudnn.benchmark = True.")
@click.option("--workers", type=click.IntRange(min=0), default=None, help="DataLoader num_workers of the training run.")
@click.option("--batch-bytes", metavar="SIZE", default=None, help="Size of one batch in host memory (such as 512MiB).")
@click.option(
    "--prefetch-factor", type=click.IntRange(min=1), default=2, show_default=True, help="DataLoader prefetch_factor."
)
@click.option(
    "--workload",
    default=None,
    metavar="WORKLOAD",
    help="Also predict which allocator setting reserves least for this workload's step (with --batch-size).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="The micro-batch for --workload.")
@click.option(
    "--gpu", default=None, metavar="NAME", help="The GPU of the table --workload trains on (default: no limit)."
)
@json_option
def command(
    variable_shapes: bool,
    cudnn_benchmark: bool,
    workers: int | None,
    batch_bytes: str | None,
    prefetch_factor: int,
    workload: str | None,
    batch_size: int | None,
    gpu: str | None,
    as_json: bool,
) -> int:
    """Check Python, torch's build, the driver, each GPU and the allocator settings.

    Reads GPUs through NVML (torch's facts come from a child process), so it never creates
    a CUDA context. Exit status 0 when no error was found, 1 otherwise.
    """
    hints = TrainingHints(
        variable_shapes=variable_shapes,
        cudnn_benchmark=cudnn_benchmark,
        workers=workers,
        batch_bytes=size_or_none(batch_bytes),
        prefetch_factor=prefetch_factor,
    )
    if (workload is None) != (batch_size is None):
        raise MemfitError("--workload and --batch-size go together: give both to predict the allocator's saving")
    diagnosis = diagnose(system.current_probe(), hints)
    if workload is not None and batch_size is not None:
        diagnosis = replace(diagnosis, findings=(*diagnosis.findings, allocator_finding(workload, batch_size, gpu)))
    if as_json:
        print_json(diagnosis.to_dict())
    else:
        render(diagnosis)
    return diagnosis.exit_status
