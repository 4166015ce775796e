"""Options shared by several commands, so they are spelled and parsed the same way."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from memfit._io import check_before_output
from memfit._schema import finite_or_none
from memfit.errors import MemfitError
from memfit.run.strategy import SHARDS, check_strategy
from memfit.search.headroom import DEFAULT_HEADROOM
from memfit.units import parse_size

if TYPE_CHECKING:
    from memfit.environment.envfile import EnvironmentCheck
    from memfit.run.settings import Precision, Settings

# memfit.run.settings and memfit.workload.zoo import torch: they are imported inside the decorators
# that need them, so commands that do not (doctor, env, check) start fast.

F = TypeVar("F", bound=Callable[..., Any])


class _ResultsConsole(Console):
    """The console of results: nothing is printed once a check refuses the command's outcome.

    Why: a workload that changed the process while memfit ran it (``os.chdir`` in its model
    factory) is refused when memfit next writes or prints; its table must not reach stdout first.
    """

    def print(self, *objects: Any, **kwargs: Any) -> None:
        check_before_output()
        super().print(*objects, **kwargs)


#: results (tables) go to stdout; progress to stderr
console = _ResultsConsole(highlight=False)
err_console = Console(stderr=True, highlight=False)

#: where results go while a command runs (the stdout it started with), innermost last
_results: list[IO[str]] = []


def results_stream() -> IO[str]:
    """The stream memfit's results go to: the command's own stdout, even while it is redirected."""
    return _results[-1] if _results else sys.stdout


@contextlib.contextmanager
def results_alone_on_stdout() -> Iterator[None]:
    """Keep stdout for memfit's results: anything else printed meanwhile goes to stderr.

    Why: a workload prints (nanoGPT its parameter count, a training script its progress)
    while memfit imports it, builds its model and runs its steps; with ``--json``, one such
    line on stdout and the output no longer parses. Results (``print_json``, the tables of
    ``console``) still go to the stdout the command started with.
    """
    stdout = sys.stdout
    _results.append(stdout)
    console.file = stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _results.pop()
        console.file = _results[-1] if _results else None  # type: ignore[assignment]  # None: follow sys.stdout


def route_output(command: click.Command) -> click.Command:
    """Run ``command`` (each subcommand of a group) with :func:`results_alone_on_stdout`; once."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            route_output(sub)
        return command
    callback = command.callback
    if callback is None or getattr(callback, "__memfit_routed__", False):
        return command

    @functools.wraps(callback)
    def routed(*args: Any, **kwargs: Any) -> Any:
        with results_alone_on_stdout():
            return callback(*args, **kwargs)

    routed.__memfit_routed__ = True  # type: ignore[attr-defined]
    command.callback = routed
    return command


class OutputPath(click.Path):
    """A path memfit writes, made absolute when the command line is read.

    Why: the user's code runs inside the command (a workload may ``os.chdir``); a relative
    ``memfit.lock`` resolved after that would land in another folder while memfit says it
    wrote ``memfit.lock``. Links are kept (not resolved): the write goes where they point.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        converted = super().convert(value, param, ctx)
        if converted is None:
            return None
        absolute = os.path.abspath(os.fsdecode(converted))
        return Path(absolute) if isinstance(converted, Path) else absolute


def card_device(device_spec: str, card: str | None) -> str:
    """The device of a command given ``--gpu CARD``: ``sim:CARD`` unless ``--device`` was given.

    Why: ``--gpu "RTX 4090"`` means that card, its memory as well as its speed; planning on
    the default ``sim:8GiB`` while ranking by the 4090's speed answered for no real card.

    Args:
        device_spec: the command's ``--device`` (its default: ``auto``).
        card: the command's ``--gpu`` (None: not given).
    """
    context = click.get_current_context(silent=True)
    given = context is not None and context.get_parameter_source("device_spec") not in (
        None,
        click.core.ParameterSource.DEFAULT,
    )
    return f"sim:{card}" if card and not given else device_spec


def card_option(what: str) -> Callable[[F], F]:
    """``--gpu NAME`` (the parameter ``card``): a GPU of the table, its memory and its speed.

    One option for every command that runs on a card it names (plan, fit, probe), read by
    :func:`card_device`, so ``--gpu X`` means the same card X in each.

    Args:
        what: what the command does on that card, the help's first words ("Plan for").
    """
    return click.option(
        "--gpu",
        "card",
        default=None,
        metavar="NAME",
        help=f"{what} this GPU of the table: its memory (sim:NAME, unless --device is given) and its predicted speed.",
    )


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
        help='cuda, cuda:N, cpu, sim:SIZE or sim:GPU (a simulated GPU: sim:8GiB, "sim:RTX 4090"), or auto.',
    )(function)


def settings_options(function: F) -> F:
    from memfit.run.checkpointing import POLICY_HELP
    from memfit.run.settings import PRECISIONS

    function = click.option(
        "--checkpointing",
        default="none",
        show_default=True,
        callback=policy_list(single=True),
        help=f"What backward recomputes: {POLICY_HELP} (memfit.run.checkpointing).",
    )(function)
    return click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default="fp32",
        show_default=True,
        help="fp32, or bf16/fp16 autocast (fp16 with a GradScaler).",
    )(function)


def trials_option(function: F) -> F:
    """--trials auto|fake|real: what probe's and plan's trials run (see memfit.search.trials)."""
    return click.option(
        "--trials",
        type=click.Choice(["auto", "fake", "real"]),
        default="auto",
        show_default=True,
        help="auto: on a sim device, search on fake tensors and confirm the answer with real runs; real: every trial real.",
    )(function)


def headroom_option(help_text: str) -> Callable[[F], F]:
    """--headroom: the fraction of memory a recommendation leaves free (probe, plan, fit)."""
    return click.option(
        "--headroom",
        type=click.FloatRange(0, 1, max_open=True),
        default=DEFAULT_HEADROOM,
        show_default=True,
        help=help_text,
    )


def plan_strategy_options(function: F) -> F:
    """--world-size, --shard (repeatable) and --gpus-per-node: the ranks a plan is for and the
    sharding strategies it weighs (plan and fit)."""
    function = click.option(
        "--gpus-per-node",
        type=click.IntRange(min=1),
        default=None,
        help="GPUs per machine: the plan adds hybrid sharding (FSDP2 within a node) when the world spans nodes.",
    )(function)
    function = click.option(
        "--shard",
        "shards",
        type=click.Choice(SHARDS),
        multiple=True,
        help="Sharding strategies the plan considers with --world-size > 1 (repeatable; default: all).",
    )(function)
    return click.option(
        "--world-size", type=click.IntRange(min=1), default=1, show_default=True, help="Processes (GPUs)."
    )(function)


def strategy_options(function: F) -> F:
    """--world-size, --shard and --shard-group-size: how many ranks, and how they share the model."""
    function = click.option(
        "--shard-group-size",
        type=click.IntRange(min=1),
        default=None,
        metavar="G",
        help="FSDP2 shards within groups of G ranks and replicates across groups (hybrid sharding, HSDP).",
    )(function)
    function = click.option(
        "--shard",
        type=click.Choice(SHARDS),
        default="none",
        show_default=True,
        help="none: DDP; optimizer: DDP + ZeRO-1; gradients: FSDP2 keeping full parameters "
        "from forward to backward; full: FSDP2.",
    )(function)
    return click.option(
        "--world-size", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs (ranks) training together."
    )(function)


def alloc_conf_option(function: F) -> F:
    """--alloc-conf: the caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF takes them."""
    return click.option(
        "--alloc-conf",
        default=None,
        metavar="SETTINGS",
        help="Allocator settings as PYTORCH_CUDA_ALLOC_CONF takes them (expandable_segments:True, "
        "max_split_size_mb:N, garbage_collection_threshold:F, roundup_power2_divisions:N); "
        "default: the variable's.",
    )(function)


def apply_alloc_conf(text: str | None) -> None:
    """Check --alloc-conf (one line, exit 2, before any work) and make it this process's
    PYTORCH_CUDA_ALLOC_CONF: the simulated GPU, the estimator, a child process and a real
    GPU (whose allocator reads the variable when CUDA starts) then all follow it."""
    if text is None:
        return
    import os

    from memfit.memory.allocator_conf import parse

    parse(text)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = text


def json_option(function: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(function)


def make_settings(precision: str, checkpointing: str, **extra: Any) -> Settings:
    """Settings from the command line's strings (click.Choice already checked them)."""
    from memfit.run.settings import Settings

    return Settings(precision=cast("Precision", precision), checkpointing=checkpointing, **extra)


def strategy(world_size: int, shard: str, shard_group_size: int | None) -> dict[str, Any]:
    """The strategy options as Settings fields, checked before any long work (one line, exit 2)."""
    check_strategy(shard, world_size, shard_group_size)
    return {"world_size": world_size, "shard": shard, "shard_group_size": shard_group_size}


def size_or_none(text: str | None) -> int | None:
    return None if text is None else parse_size(text)


def print_environment_check(result: EnvironmentCheck, as_json: bool) -> int:
    """``memfit check`` and ``memfit env check``: one table (or JSON) of differences; return the exit status."""
    if as_json:
        print_json(result.to_dict())
        return result.exit_status
    if not result.differences:
        console.print(Text(f"no difference from {result.source}: this environment matches it"), soft_wrap=True)
        return result.exit_status
    table = Table(title=f"{result.source} (recorded) vs here")
    for column in ("field", "recorded", "here", "matters", "why"):
        table.add_column(column)
    for d in result.differences:
        table.add_row(
            Text(d.field),
            Text(str(d.old)),
            Text(str(d.new)),
            Text("yes", style="bold red") if d.matters else Text("no"),
            Text(d.note),
        )
    console.print(table)
    for note in result.advice():
        console.print(Text(note), soft_wrap=True)
    return result.exit_status


def print_json(data: Any) -> None:
    """The result as strict JSON, alone on the command's stdout.

    Why ``finite_or_none``: Python writes NaN and infinity as bare ``NaN`` / ``Infinity``,
    which no strict parser (``jq``, JavaScript's, Go's) reads; JSON's own word for a figure
    that is not there is ``null``.
    """
    check_before_output()
    click.echo(json.dumps(finite_or_none(data), indent=2, sort_keys=False, allow_nan=False), file=results_stream())


def choice_list(
    choices: tuple[str, ...] | list[str],
) -> Callable[[click.Context, click.Parameter, Any], tuple[str, ...]]:
    """A click callback for a repeatable option that also takes comma lists.

    ``--precision fp32 --precision bf16`` and ``--precision fp32,bf16`` give the same
    tuple, in order, without repeats; an unknown value is a bad option (one line, exit 2).
    """

    def parse(_ctx: click.Context, param: click.Parameter, values: Any) -> tuple[str, ...]:
        chosen: list[str] = []
        for value in values or ():
            for item in str(value).split(","):
                item = item.strip()
                if item not in choices:
                    raise click.BadParameter(
                        f"{item!r} is not one of {', '.join(choices)}", param_hint=f"'--{param.name}'"
                    )
                if item not in chosen:
                    chosen.append(item)
        return tuple(chosen)

    return parse


def policy_list(single: bool = False) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback for ``--checkpointing``: policies of :mod:`memfit.run.checkpointing`
    (repeatable or a comma list, unless ``single``), each checked; ``budget`` only for a
    plan's axis. A bad one is a bad option (one line, exit 2)."""
    from memfit.run.checkpointing import BUDGET, parse

    def check(_ctx: click.Context, param: click.Parameter, values: Any) -> Any:
        items = [values] if single else [i.strip() for v in values or () for i in str(v).split(",")]
        chosen: list[str] = []
        for item in items:
            try:
                if single or item != BUDGET:
                    parse(item)
            except MemfitError as error:
                raise click.BadParameter(str(error), param_hint=f"'--{param.name}'") from None
            if item not in chosen:
                chosen.append(item)
        return chosen[0] if single else tuple(chosen)

    return check


def settings_axes_options(function: F) -> F:
    """``--precision`` and ``--checkpointing`` for plan and fit: which settings to consider."""
    from memfit.run.checkpointing import POLICY_HELP
    from memfit.run.settings import PRECISIONS

    function = click.option(
        "--checkpointing",
        "checkpointing",
        multiple=True,
        callback=policy_list(),
        metavar="POLICY",
        help=(
            f"Checkpointing to consider: {POLICY_HELP}, budget (the fewest blocks that fit); "
            "repeatable or a comma list; default: none and blocks, where the model has blocks."
        ),
    )(function)
    return click.option(
        "--precision",
        "precisions",
        multiple=True,
        callback=choice_list(PRECISIONS),
        metavar="|".join(PRECISIONS),
        help="Precisions to consider (repeatable or a comma list; default: all the device supports).",
    )(function)
