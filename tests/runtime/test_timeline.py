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


def test_one_f_one_b_is_replayed_from_its_own_order_with_the_textbook_bubble():
    # K = 4 uniform stages, M = 6: the bubble of 1F1B is GPipe's, (K - 1) / (M + K - 1).
    ranks, costs = [0, 1, 2, 3], ((1.0, 2.0),) * 4
    order = timeline.one_f_one_b(ranks, 6)
    assert [a[0] for a in order[3]] == ["F", "B"] * 6  # the last rank alternates from the start
    assert order[0][:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3)]
    found, why = timeline.prediction("1f1b", None, ranks, costs, (), 1.0, 6)
    assert why == ""
    assert found == (pytest.approx(27.0), pytest.approx(3 / 9))  # (M + K - 1)(f + b)


def test_torchs_own_1f1b_order_is_not_replayable_so_it_is_not_used():
    # torch 2.13's Schedule1F1B.pipeline_order lists the last rank's micro-batches from 1.
    from torch.distributed.pipelining.schedules import Schedule1F1B

    schedule = object.__new__(Schedule1F1B)
    schedule._num_stages, schedule._n_microbatches = 3, 4
    torchs = schedule._get_pipeline_order()
    costs = ((1.0, 2.0),) * 3
    assert timeline.predict(torchs, [0, 1, 2], costs, (), 1.0) is None
    found, _ = timeline.prediction("1f1b", torchs, [0, 1, 2], costs, (), 1.0, 4)
    assert found[1] == pytest.approx(2 / 6)


def test_a_missing_prediction_says_why():
    stuck = order("0B0 0F0", "1F0 1B0")
    costs = ((1.0, 2.0), (1.0, 2.0))
    assert timeline.prediction("gpipe", stuck, [0, 1], costs, (), 1.0, 1) == (
        None, "torch's order of --schedule gpipe cannot be replayed "
        "(an action waits for one the order never runs)")
    assert timeline.prediction("gpipe", None, [0, 1], costs, (), 1.0, 1) == (
        None, "torch gives no order of --schedule gpipe to replay")
    assert timeline.prediction("1f1b", None, [0, 1], (), (), 1.0, 2) == (
        None, "the build's cost model gave no time for these stages")


def test_the_summary_says_why_a_bubble_is_not_predicted(tmp_path, capsys):
    from mpgen.runtime.log import Log

    rates = {"schedule": "--schedule gpipe with 2 micro-batches",
             "unpredicted": "the build's cost model gave no time for these stages"}
    log = Log(tmp_path, 1, 0, 1, 4, (), rates)
    log.step(1, 0, 0.5, 0.1, {"grad_norm": 1.0, "busy": [1e-3, 1e-3]})
    log.close(0)
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("idle:")]
    assert line.split("; ")[1] == ("no predicted bubble for --schedule gpipe with 2 "
                                  "micro-batches: the build's cost model gave no time for "
                                  "these stages")


def test_predicted_busy_sums_each_ranks_stages_over_the_steps_samples():
    costs = ((1.0, 2.0), (0.5, 1.0), (2.0, 4.0))
    assert timeline.predicted_busy(costs, [0, 1, 0], 4) == [36.0, 6.0]
    assert timeline.predicted_busy((), [0, 1], 4) is None  # no time for these stages
    assert timeline.predicted_busy(costs, [0, 1], 4) is None


def test_the_prediction_names_its_source_and_other_hardware():
    import torch

    cpu = torch.device("cpu")
    here = timeline.hardware(cpu)
    assert here.endswith(f"({torch.get_num_threads()} thread"
                         f"{'s' if torch.get_num_threads() != 1 else ''})")
    assert timeline.source((), cpu) == "the cost model"
    assert timeline.source((here, here), cpu) == "the profile (measured on this hardware)"
    other = timeline.source((here, "Some Other CPU (64 threads)"), cpu)
    assert other.startswith("the profile, measured on other hardware (Some Other CPU "
                            "(64 threads); this run: ")
    assert "rerun mpgen profile here" in other
