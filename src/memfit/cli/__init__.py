"""The ``memfit`` command line: a thin layer over the Python API.

Every command lives in its own module of this package (``memfit probe`` in
``cli/probe.py``), which defines ``command``. ``COMMANDS`` names them explicitly, so a
helper module here (``options.py``) never becomes a command by accident, and a command's
module (and torch with it) is imported only when that command runs.
Every command takes ``--json``. A user error (a :class:`MemfitError` or a bad option)
prints one line ``memfit: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import importlib
import sys

import click

from memfit._version import __version__
from memfit.errors import MemfitError

__all__ = ["main", "cli", "COMMANDS", "entry_point"]

#: command name -> module that defines ``command``
COMMANDS: dict[str, str] = {
    "check": "memfit.cli.check",
    "doctor": "memfit.cli.doctor",
    "env": "memfit.cli.env",
    "estimate": "memfit.cli.estimate",
    "fit": "memfit.cli.fit",
    "measure": "memfit.cli.measure",
    "plan": "memfit.cli.plan",
    "probe": "memfit.cli.probe",
    "report": "memfit.cli.report",
}


class _LazyGroup(click.Group):
    """Imports a command's module only when that command runs (or help lists it).

    Why: ``memfit doctor`` should answer fast and not import torch for nothing.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        return importlib.import_module(module).command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memfit")
def cli() -> None:
    """memfit ends "CUDA out of memory": doctor, estimate, probe, plan, guard, monitor
    and lock the memory of PyTorch training."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status instead of raising SystemExit."""
    try:
        result = cli.main(args=argv, prog_name="memfit", standalone_mode=False)
    except MemfitError as error:
        return _user_error(str(error))
    except click.ClickException as error:
        return _user_error(error.format_message())
    except click.exceptions.Abort:
        click.echo("memfit: aborted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def _user_error(message: str) -> int:
    first_line = " ".join(message.split())
    click.echo(f"memfit: error: {first_line}", err=True)
    return 2


def entry_point() -> None:
    sys.exit(main())
