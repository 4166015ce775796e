"""``memfit doctor``: find the environment causes of OOM (and of fake OOM), with the fix for each."""

from __future__ import annotations

import click
from rich.text import Text

from memfit.cli.options import console, json_option, print_json, size_or_none
from memfit.environment import system
from memfit.environment.doctor import Diagnosis, TrainingHints, diagnose

_MARKS = {"error": ("✗ error  ", "bold red"), "warning": ("! warning", "yellow"), "info": ("· info   ", "dim")}


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
@json_option
def command(
    variable_shapes: bool,
    cudnn_benchmark: bool,
    workers: int | None,
    batch_bytes: str | None,
    prefetch_factor: int,
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
    diagnosis = diagnose(system.current_probe(), hints)
    if as_json:
        print_json(diagnosis.to_dict())
    else:
        render(diagnosis)
    return diagnosis.exit_status
