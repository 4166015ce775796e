"""The plan and probe tables are read in an 80-column terminal: nothing cut, the legend says
what each short word means."""

from __future__ import annotations

import pytest

from memfit.cli.tables import STATUS_WORDS, status_legend, status_word

PLAN = ["plan", "mlp:layers=2,width=64", "--target-batch", "256", "--device", "sim:8MiB"]
PROBE = ["probe", "mlp:layers=2,width=64", "--device", "sim:8MiB"]


@pytest.mark.parametrize("args", [PLAN, PROBE], ids=["plan", "probe"])
def test_tables_fit_80_columns_without_cutting_a_cell(run_cli, one_thread, args) -> None:
    status, out, err = run_cli(*args)
    assert status == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out  # rich cuts a cell that does not fit with an ellipsis


def test_the_plan_table_names_every_status_it_shows_and_counts_what_it_hides(run_cli, one_thread) -> None:
    status, out, _ = run_cli(*PLAN)
    assert status == 0
    table = out[: out.index("fits: measured")]  # the rows end where the legend begins
    rows = [line.split() for line in table.splitlines() if line.split() and line.split()[0].isdigit()]
    assert rows and all(row[4] in {w for w, _ in STATUS_WORDS.values()} for row in rows)
    assert any(row[-1] == "★" for row in rows)
    text = " ".join(out.split())  # the legend wraps at 80 columns
    assert "fits: measured within the headroom" in text
    assert "beaten by a measured one are not listed" in text
    assert "pred/s: samples/s predicted on the A100 80GB SXM" in text
    assert "sim:8MiB names no card" in text


def test_status_words_are_short_and_each_has_its_meaning() -> None:
    assert all(len(word) <= 8 for word, _ in STATUS_WORDS.values())
    assert status_word("failed: RuntimeError: boom") == "failed"
    assert status_word("out of memory") == "OOM"
    assert status_word("saves nothing (6 x Linear)") == "no gain"
    assert status_legend({"out of memory", "measured"}) == "fits: measured within the headroom · OOM: out of memory"
