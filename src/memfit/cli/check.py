"""``memfit check memfit.lock``: does this machine still match the lock's environment?"""

from __future__ import annotations

import click

from memfit.cli.options import json_option, print_environment_check
from memfit.search.lock import check_lock


@click.command("check")
@click.argument("lock_path", metavar="[LOCK]", default="memfit.lock", type=click.Path(dir_okay=False))
@json_option
def command(lock_path: str, as_json: bool) -> int:
    """Compare the GPU, torch, CUDA and driver with the lock's fingerprint.

    Exit status 1 when a difference matters (torch, CUDA, GPU model, an older driver).
    """
    return print_environment_check(check_lock(lock_path), as_json)
