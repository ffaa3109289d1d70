"""timeline.py: the bubble predicted from torch's own schedule orders, and
the busy time measured around a stage's calls."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action

from mpgen.runtime import timeline


def order(*ranks: str) -> dict:
    """Each rank's actions written as torch writes them ("0F0 0F1 0B0 0B1")."""
    return {r: [None if a == "_" else _Action.from_str(a) for a in text.split()]
            for r, text in enumerate(ranks)}


def test_gpipe_on_uniform_stages_has_the_textbook_bubble():
    # K stages, M micro-batches: (K - 1) / (M + K - 1)
    gpipe = order("0F0 0F1 0F2 0F3 _ 0B0 0B1 0B2 0B3", "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3")
    step, bubble = timeline.predict(gpipe, [0, 1], ((1.0, 2.0), (1.0, 2.0)), (), 1.0)
    assert step == pytest.approx(15.0)  # (M + K - 1)(f + b)
    assert bubble == pytest.approx(1 / 5)


def test_transfers_delay_the_receiver_but_not_between_stages_on_one_rank():
    two = order("0F0 0B0", "1F0 1B0")
    step, _ = timeline.predict(two, [0, 1], ((1.0, 2.0), (1.0, 2.0)), (0.5,), 2.0)
    assert step == pytest.approx(2 * (1 + 0.5 + 1 + 2 + 0.5 + 2))  # samples scale everything
    v = order("0F0 1F0 1B0 0B0")  # a V: both stages on rank 0, no transfer
    step, bubble = timeline.predict(v, [0, 0], ((1.0, 2.0), (1.0, 2.0)), (0.5,), 1.0)
    assert (step, bubble) == (pytest.approx(6.0), pytest.approx(0.0))


def test_a_zero_bubble_split_backward_counts_input_and_weight_halves():
    zb = order("0F0 0F1 _ 0I0 0I1 0W0 0W1", "1F0 1F1 1I0 1I1 1W0 1W1")
    step, bubble = timeline.predict(zb, [0, 1], ((1.0, 2.0), (1.0, 2.0)), (), 1.0)
    # I and W take half a backward (1) each; rank 0's I0 waits for rank 1's (at 4)
    assert step == pytest.approx(8.0)
    assert bubble == pytest.approx(1 - 2 * 6 / (2 * 8))


def test_no_prediction_without_costs_or_for_an_order_that_waits_on_itself():
    gpipe = order("0F0 0B0", "1F0 1B0")
    assert timeline.predict(gpipe, [0, 1], (), (), 1.0) is None
    stuck = order("0B0 0F0", "1F0 1B0")  # B before its own F
    assert timeline.predict(stuck, [0, 1], ((1.0, 2.0), (1.0, 2.0)), (), 1.0) is None


def test_busy_time_adds_up_around_a_stages_calls():
    class Stage:
        def forward_one_chunk(self, x):
            return x + 1

    stage, busy = Stage(), [0.0]
    timeline.time_stages([stage], busy, cuda=False)
    assert stage.forward_one_chunk(1) == 2
    assert busy[0] > 0
    assert timeline.read(busy) > 0 and busy == [0.0]
