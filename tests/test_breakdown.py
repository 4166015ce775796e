"""The breakdown: each allocation's category from its phases, replayed to the peak."""

from __future__ import annotations

import pytest

from memfit.estimator.breakdown import analyze, classify, outlives_phase
from memfit.memory.allocator import MiB
from memfit.memory.tracker import Labels

OTHER = Labels()


def L(phase: str, step: int = 0, module: str = "") -> Labels:
    return Labels(phase, step, module)


@pytest.mark.parametrize(
    ("born", "died", "expected"),
    [
        (L("forward"), L("forward"), False),  # a forward temporary
        (L("forward"), L("backward"), True),  # saved for backward
        (L("backward"), L("backward"), False),  # a backward temporary
        (L("backward"), L("optimizer"), True),  # a gradient, freed by zero_grad
        (L("backward"), L("forward", 1), True),  # a gradient kept into the next step
        (L("optimizer"), L("optimizer"), False),  # optimizer scratch
        (L("optimizer"), OTHER, True),  # optimizer state, dropped after the run
        (L("optimizer"), None, True),  # never freed
        (L("backward", 1), L("optimizer", 0), False),  # an earlier step cannot free a later allocation
    ],
)
def test_outlives_phase(born: Labels, died: Labels | None, expected: bool) -> None:
    assert outlives_phase(born, died) is expected


@pytest.mark.parametrize(
    ("born", "died", "early", "expected"),
    [
        (OTHER, None, True, "parameters"),
        (L("forward"), L("backward"), False, "activations"),
        (L("forward"), L("forward"), False, "temporaries"),
        (L("backward"), L("optimizer"), False, "gradients"),
        (L("backward"), L("backward"), False, "temporaries"),
        (L("optimizer"), OTHER, False, "optimizer state"),
        (L("optimizer"), L("optimizer"), False, "temporaries"),
        (OTHER, OTHER, False, "temporaries"),
    ],
)
def test_classify(born: Labels, died: Labels | None, early: bool, expected: str) -> None:
    assert classify(born, died, early) == expected


def _step_events() -> list[tuple[str, int, int, Labels]]:
    """One hand-made step: 2 parameters, 3 activations in two modules, a temporary,
    2 gradients, then optimizer state and scratch."""
    return [
        ("alloc", 1, 4096, OTHER),
        ("alloc", 2, 1000, OTHER),  # rounded to 1024
        ("alloc", 3, 8192, L("forward", 0, "a")),
        ("alloc", 4, 2048, L("forward", 0, "b")),
        ("alloc", 5, 2048, L("forward", 0, "b")),
        ("alloc", 6, 3000, L("forward", 0, "b")),  # temporary, rounded to 3072
        ("free", 6, 0, L("forward", 0, "b")),
        ("alloc", 7, 4096, L("backward", 0)),  # gradient of parameter 1
        ("free", 5, 0, L("backward", 0)),
        ("alloc", 8, 512, L("backward", 0)),  # backward scratch
        ("free", 8, 0, L("backward", 0)),
        ("alloc", 9, 1024, L("backward", 0)),  # gradient of parameter 2
        ("free", 3, 0, L("backward", 0)),
        ("free", 4, 0, L("backward", 0)),
        ("alloc", 10, 8192, L("optimizer", 0)),  # state
        ("alloc", 11, 2048, L("optimizer", 0)),  # state
        ("alloc", 12, 4096, L("optimizer", 0)),  # scratch
        ("free", 12, 0, L("optimizer", 0)),
        ("free", 7, 0, L("optimizer", 0)),
        ("free", 9, 0, L("optimizer", 0)),
    ]


def test_peak_is_broken_down_exactly() -> None:
    peak = analyze(_step_events())
    # The peak: parameters 5120 + gradients 5120 + state 10240 + scratch 4096 = 24576.
    assert peak.peak_allocated == 24576
    assert peak.categories == {
        "parameters": 5120,
        "gradients": 5120,
        "optimizer state": 10240,
        "activations": 0,
        "temporaries": 4096,
    }
    assert peak.peak_reserved == 2 * MiB  # one small-pool segment
    assert peak.gradient_sizes == [4096, 1024]


def test_breakdown_at_the_end_of_forward() -> None:
    events = _step_events()
    end_of_forward = next(i for i, e in enumerate(events) if e[3].phase == "backward")
    peak = analyze(events, at=end_of_forward)
    assert peak.categories["activations"] == 8192 + 2048 + 2048
    assert peak.categories["temporaries"] == 0
    assert peak.top_modules == [("a", 8192), ("b", 4096)]


def test_top_modules_keeps_the_largest_n() -> None:
    events = [("alloc", i, 512 * i, L("forward", 0, f"m{i}")) for i in range(1, 15)]
    events += [("free", i, 0, L("backward", 0)) for i in range(1, 15)]
    peak = analyze(events, top=10)
    assert [name for name, _ in peak.top_modules] == [f"m{i}" for i in range(14, 4, -1)]


def test_categories_count_whole_blocks() -> None:
    # 11 MiB + 1 byte gets a 12 MiB segment of its own; the rest (under 1 MiB) is not
    # worth a block, so the whole segment is handed out and counted as allocated, by the
    # allocator and by the breakdown alike.
    events = [("alloc", 1, 11 * MiB + 1, OTHER)]
    peak = analyze(events)
    assert peak.categories["parameters"] == 12 * MiB == peak.peak_allocated
    assert peak.peak_reserved == 12 * MiB


def test_budget_replay_releases_cached_segments() -> None:
    events = [
        ("alloc", 1, 12 * MiB, L("forward", 0)),
        ("free", 1, 0, L("forward", 0)),
        ("alloc", 2, 14 * MiB, L("forward", 0)),
    ]
    assert analyze(events).peak_reserved == 26 * MiB
    assert analyze(events, budget=16 * MiB).peak_reserved == 14 * MiB
