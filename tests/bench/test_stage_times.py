"""bench/stage_times.py runs end to end (its numbers are the benchmark's,
never asserted: the machine is shared)."""

from __future__ import annotations

import pytest

from bench import stage_times

pytestmark = pytest.mark.slow


def test_every_contiguous_split_is_enumerated_once():
    assert stage_times.splits(4, 2) == [(0, 1, 4), (0, 2, 4), (0, 3, 4)]
    assert len(stage_times.splits(7, 3)) == 15
    assert all(len(set(b)) == 4 for b in stage_times.splits(7, 3))


def test_the_quick_report_measures_the_choice_among_every_split():
    text = stage_times.report(rounds=1, quick=True)
    rows = [line for line in text.splitlines() if line.startswith("| lm (")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")]
    assert cells[2:5] == ["2", "7", "6"]  # stages, units, splits measured
    assert float(cells[7]) >= 1.0  # the best measured is the least
    assert "time: " in text and "best: " in text and "flops: " in text
