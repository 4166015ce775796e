"""The ``memfit`` command line: a thin layer over the Python API.

Every command lives in its own module under :mod:`memfit.commands`, which defines
``command`` (a click command); each such module is registered here (``COMMANDS``). Every command takes ``--json``. A user error (a :class:`MemfitError`
or a bad option) prints one line ``memfit: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click

from memfit import __version__
from memfit.errors import MemfitError

__all__ = ["main", "cli", "COMMANDS"]

def _command_modules() -> tuple[str, ...]:
    """Names of the modules under memfit.commands that define a ``command``."""
    import memfit.commands

    names = []
    for info in pkgutil.iter_modules(memfit.commands.__path__):
        module = importlib.import_module(f"memfit.commands.{info.name}")
        if hasattr(module, "command"):
            names.append(info.name)
    return tuple(sorted(names))


#: modules under memfit.commands that define ``command`` (a click command)
COMMANDS: tuple[str, ...] = _command_modules()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memfit")
def cli() -> None:
    """memfit ends "CUDA out of memory": measure, estimate, probe, plan and guard
    the memory of PyTorch training."""


for _name in COMMANDS:
    cli.add_command(importlib.import_module(f"memfit.commands.{_name}").command)


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
