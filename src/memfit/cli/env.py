"""``memfit env export|check``: write files that reproduce this environment, and check one against it."""

from __future__ import annotations

import click
from rich.text import Text

from memfit.cli.options import OutputPath, console, json_option, print_environment_check, print_json
from memfit.environment import system
from memfit.environment.envfile import check_environment, export_environment


@click.group("env")
def command() -> None:
    """Export this environment (environment.yml, requirements.lock.txt, environment.json) or check one."""


@command.command("export")
@click.option(
    "-o",
    "--output",
    "directory",
    default=".",
    show_default=True,
    type=OutputPath(),
    metavar="DIR",
    help="Directory to write the three files into.",
)
@json_option
def export(directory: str, as_json: bool) -> None:
    """Write environment.yml, requirements.lock.txt (torch's CUDA variant kept) and environment.json."""
    result = export_environment(directory, system.current_probe())
    if as_json:
        print_json(result.to_dict())
        return
    source = "conda env export + pip" if result.conda else "Python + pip"
    for path in result.paths:
        console.print(Text(f"wrote {path}"), soft_wrap=True)
    console.print(Text(f"{result.packages} pip distributions; environment.yml from {source}"), soft_wrap=True)


@command.command("check")
@click.argument("path", metavar="ENVIRONMENT_JSON")
@json_option
def check(path: str, as_json: bool) -> int:
    """List every difference between ENVIRONMENT_JSON and this machine.

    Exit status 1 when one matters (torch, its CUDA, a GPU model, an older driver).
    """
    return print_environment_check(check_environment(path, system.current_probe()), as_json)
