"""memfit under torchrun: run any memfit command as one rank of a job.

torchrun starts one process per GPU with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``MASTER_ADDR``/``MASTER_PORT`` set. memfit's collective pieces (``memfit.probe``,
``memfit.Guard``) agree across ranks as soon as a process group exists;
:func:`memfit.distributed.process_group` makes one from that environment (nccl with GPUs,
gloo without), :func:`memfit.memory.devices.rank_device` picks ``cuda:LOCAL_RANK`` for
``auto``/``cuda`` (or this rank's size of a ``sim:`` list), and rank 0 alone prints.

- ``torchrun --nproc-per-node N -m memfit COMMAND ...`` (or ``-m memfit.integrations.torchrun``)
  runs any memfit command that way, per-rank ``--device`` lists included.
- In a training script: ``with process_group(): result = memfit.probe(wl, rank_device("auto"))``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from memfit.cli import exit_with, user_error
from memfit.cli import main as cli_main
from memfit.distributed import check_environment, launched_by_torchrun, output_on_main_only, process_group
from memfit.errors import MemfitError
from memfit.memory.devices import rank_device

__all__ = [
    "launched_by_torchrun",
    "process_group",
    "rank_device",
    "with_rank_device",
    "output_on_main_only",
    "main",
]


def with_rank_device(argv: list[str], rank: int | None = None) -> list[str]:
    """``argv`` with the value of ``--device`` replaced by this rank's (see :func:`rank_device`).

    >>> with_rank_device(["probe", "mlp", "--device", "sim:8GiB,4GiB"], rank=1)
    ['probe', 'mlp', '--device', 'sim:4GiB']
    >>> with_rank_device(["probe", "--device=sim:8GiB,4GiB"], rank=0)
    ['probe', '--device=sim:8GiB']
    """
    out = list(argv)
    for index, arg in enumerate(out):
        if arg == "--device" and index + 1 < len(out):
            out[index + 1] = rank_device(out[index + 1], rank=rank)
        elif arg.startswith("--device="):
            out[index] = "--device=" + rank_device(arg.split("=", 1)[1], rank=rank)
    return out


def main(argv: list[str] | None = None, final: bool = False) -> int:
    """Run a memfit command as one rank of a torchrun job (or alone, without torchrun).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        final: the process ends when this returns (see :func:`memfit.cli.main`).
    """
    try:
        if any(name in os.environ for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK")):
            check_environment()  # RANK=abc: one line, before --device is read per rank
        args = with_rank_device(sys.argv[1:] if argv is None else argv)
    except MemfitError as error:
        return user_error(str(error))

    @contextlib.contextmanager
    def as_one_rank() -> Iterator[None]:
        with process_group(), output_on_main_only():
            yield

    # inside the command line's handling: a rank that does not answer, an interrupt during
    # the process group's set-up or teardown end in one line too
    return cli_main(args, within=as_one_rank, final=final)


if __name__ == "__main__":
    exit_with(main(final=True))
