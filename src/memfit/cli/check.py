"""``memfit check memfit.lock``: does this machine still match the lock's environment?"""

from __future__ import annotations

import click

from memfit.cli.options import console, json_option, print_json
from memfit.search.lock import check_lock


@click.command("check")
@click.argument("lock_path", metavar="[LOCK]", default="memfit.lock", type=click.Path(dir_okay=False))
@json_option
def command(lock_path: str, as_json: bool) -> int:
    """Compare the GPU, torch, CUDA and driver with the lock's fingerprint.

    Exit status 1 when a difference matters (torch, CUDA, GPU model, an older driver).
    """
    result = check_lock(lock_path)
    if as_json:
        print_json(result.to_dict())
    elif not result.differences:
        console.print(f"{lock_path}: this environment matches the lock.")
    else:
        for d in result.differences:
            level = "[red]differs[/red]" if d.matters else "[yellow]differs (harmless)[/yellow]"
            note = f" — {d.note}" if d.note else ""
            console.print(f"{level} {d.field}: {d.old} → {d.new}{note}")
        for note in result.advice():
            console.print(note)
    return 1 if result.matters else 0
