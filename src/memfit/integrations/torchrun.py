"""memfit under torchrun: join the process group, use this rank's device, print on rank 0.

torchrun starts one process per GPU with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``MASTER_ADDR``/``MASTER_PORT`` set. memfit's collective pieces (``memfit.probe``,
``memfit.Guard``) agree across ranks as soon as a process group exists; this module
makes one from that environment (nccl with GPUs, gloo without) and tears it down, picks
``cuda:LOCAL_RANK`` for ``auto``/``cuda``, and keeps the output of every rank but 0
quiet, so N processes print one answer.

- ``torchrun --nproc-per-node N -m memfit.integrations.torchrun COMMAND ...`` runs any
  memfit command that way, per-rank ``--device`` lists included (``-m memfit probe``
  joins the group by itself, and takes one device spec for all ranks).
- In a training script: ``with process_group(): result = memfit.probe(wl, rank_device("auto"))``.

Per-rank devices: a ``sim:`` spec with one size per rank, ``sim:24GiB,16GiB``, gives rank
0 the first size and rank 1 the second (the last size is repeated for further ranks),
to rehearse a job over unequal GPUs on one CPU.

>>> rank_device("sim:8GiB,4GiB", rank=1)
'sim:4GiB'
>>> rank_device("cpu", rank=3)
'cpu'
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

__all__ = [
    "launched_by_torchrun",
    "process_group",
    "rank_device",
    "with_rank_device",
    "output_on_main_only",
    "main",
]


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment describes a job of several processes (torchrun's variables).

    >>> launched_by_torchrun({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    True
    >>> launched_by_torchrun({"WORLD_SIZE": "1"})
    False
    """
    env = os.environ if environ is None else environ
    needed = ("RANK", "MASTER_ADDR", "MASTER_PORT")
    return int(env.get("WORLD_SIZE", "1")) > 1 and all(name in env for name in needed)


@contextlib.contextmanager
def process_group(backend: str | None = None) -> Iterator[bool]:
    """Join the process group torchrun describes for the duration; yield True when distributed.

    Why leave it afterwards: a group this made is this block's; one that already
    existed (the user's, Lightning's) is used as it is and left alone.
    """
    if not launched_by_torchrun() or not dist.is_available() or dist.is_initialized():
        yield dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=chosen)
    try:
        yield True
    finally:
        dist.destroy_process_group()


def rank_device(spec: str, rank: int | None = None, local_rank: int | None = None) -> str:
    """The device spec for this rank: its own GPU for ``auto``/``cuda``, its size of a ``sim:`` list."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    local = int(os.environ.get("LOCAL_RANK", str(rank))) if local_rank is None else local_rank
    text = spec.strip()
    if text.lower().startswith("sim:") and "," in text:
        sizes = [size.strip() for size in text[4:].split(",") if size.strip()]
        return f"sim:{sizes[min(rank, len(sizes) - 1)]}"
    if text.lower() in ("auto", "cuda") and torch.cuda.is_available() and launched_by_torchrun():
        return f"cuda:{local % torch.cuda.device_count()}"
    return text


@contextlib.contextmanager
def output_on_main_only(rank: int | None = None) -> Iterator[None]:
    """Send stdout to nowhere on every rank but 0 (errors still reach stderr).

    Why: N processes printing the same agreed answer is noise, and N JSON documents on
    one stdout are not JSON.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


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


def main(argv: list[str] | None = None) -> int:
    """Run a memfit command as one rank of a torchrun job (or alone, without torchrun)."""
    from memfit.cli import main as cli_main

    args = with_rank_device(sys.argv[1:] if argv is None else argv)
    with process_group(), output_on_main_only():
        return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
