"""Options shared by several commands, so they are spelled and parsed the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console

from memfit.units import parse_size

if TYPE_CHECKING:
    from memfit.run.settings import Settings

# memfit.run.settings and memfit.workload.zoo import torch: they are imported inside the decorators
# that need them, so commands that do not (doctor, env, check) start fast.

F = TypeVar("F", bound=Callable[..., Any])

#: tables and progress go to stderr when --json owns stdout
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def workload_argument(function: F) -> F:
    """WORKLOAD: a zoo name with options, file.py:function or module:function."""
    from memfit.workload.zoo import DEFAULT_WORKLOAD

    return click.argument("workload", metavar="[WORKLOAD]", required=False, default=DEFAULT_WORKLOAD)(function)


def device_options(function: F) -> F:
    function = click.option(
        "--memory",
        default=None,
        metavar="SIZE",
        help="Cap a real GPU to SIZE (emulates a smaller card), or size a sim device.",
    )(function)
    return click.option(
        "--device",
        "device_spec",
        default="auto",
        show_default=True,
        help="cuda, cuda:N, cpu, sim:SIZE (a simulated GPU, such as sim:8GiB), or auto.",
    )(function)


def settings_options(function: F) -> F:
    from memfit.run.settings import CHECKPOINTING, PRECISIONS

    function = click.option(
        "--checkpointing",
        type=click.Choice(CHECKPOINTING),
        default="none",
        show_default=True,
        help="Recompute the model's repeated blocks in backward.",
    )(function)
    return click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default="fp32",
        show_default=True,
        help="fp32, or bf16/fp16 autocast (fp16 with a GradScaler).",
    )(function)


def json_option(function: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(function)


def make_settings(precision: str, checkpointing: str, **extra: Any) -> Settings:
    from memfit.run.settings import Settings

    return Settings(precision=precision, checkpointing=checkpointing, **extra)


def size_or_none(text: str | None) -> int | None:
    return None if text is None else parse_size(text)


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))
