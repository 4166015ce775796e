"""``memfit report``: turn a monitored run into a timeline PNG and one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path

import click

from memfit.cli.options import OutputPath, console, json_option, print_json
from memfit.monitor.runfile import read_run
from memfit.reporting.pages import check_report_outputs, write_report, written_snapshot

_RESULT = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command("report")
@click.argument("run", metavar="RUN.jsonl", type=_RESULT)
@click.option(
    "-o",
    "--output",
    type=OutputPath(dir_okay=False, path_type=Path),
    default=None,
    help="The HTML file to write (default: RUN with .html); the PNG goes beside it.",
)
@click.option("--probe", type=_RESULT, default=None, help="A `memfit probe --json` result to include.")
@click.option("--estimate", type=_RESULT, default=None, help="A `memfit estimate --json` result to include.")
@click.option("--plan", type=_RESULT, default=None, help="A `memfit plan --json` result to include.")
@click.option(
    "--snapshot",
    type=_RESULT,
    default=None,
    help="An allocator snapshot to embed (default: the one the monitor wrote, if any).",
)
@json_option
def command(
    run: Path,
    output: Path | None,
    probe: Path | None,
    estimate: Path | None,
    plan: Path | None,
    snapshot: Path | None,
    as_json: bool,
) -> None:
    """Render RUN.jsonl (written by memfit.Monitor(path=...)) as a report: the findings
    (leak, fragmentation, new-shape peak), a memory timeline PNG, and the probe, estimate
    and plan results when given. No network, no CDN: the images are embedded."""
    target = output if output is not None else run.absolute().with_suffix(".html")
    check_report_outputs(target)  # every file it writes, before reading and drawing
    recorded = read_run(run)
    if snapshot is None:
        snapshot = written_snapshot(run, recorded)
    files = write_report(recorded, target, probe=probe, estimate=estimate, plan=plan, snapshot=snapshot)
    if as_json:
        print_json({**files.to_dict(), "summary": recorded.summary()})
        return
    for finding in files.findings:
        console.print(f"[bold red]{finding.title}[/bold red]\n  {finding.summary}")
    if not files.findings:
        console.print("[green]No findings[/green]: no leak, no fragmentation, no new-shape peak.")
    console.print(f"wrote {files.html}\nwrote {files.png}")
