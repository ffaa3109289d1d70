"""analysis.schedule: GPipe and 1F1B simulated exactly, and stage times from
the cost model of a compiled spec (NOTE [Schedule model])."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from fractions import Fraction

import pytest

from helpers import ROOT, write_spec
from mpgen.compiler.analysis.schedule import (
    BACKWARD,
    FORWARD,
    GPIPE,
    ONE_F_ONE_B,
    SCHEDULES,
    Pipeline,
    predict,
    simulate,
    stage_order,
    stage_times,
)
from mpgen.compiler.driver import compile_spec


def uniform(stages: int, forward=1, backward=2, transfer=0) -> Pipeline:
    return Pipeline((Fraction(forward),) * stages, (Fraction(backward),) * stages,
                    (Fraction(transfer),) * (stages - 1))


SIZES = [(k, m) for k in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 16)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_uniform_stages_give_the_textbook_step_and_bubble(schedule, stages, microbatches):
    k, m = stages, microbatches
    run = simulate(uniform(k, 1, 2), m, schedule)
    assert run.makespan == (m + k - 1) * (1 + 2)
    assert run.bubble == Fraction(k - 1, m + k - 1)
    assert run.busy == (m * 3,) * k
    assert run.speedup_over_single == Fraction(k * m, m + k - 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_uniform_stages_in_seconds(schedule):
    """Floats work as well: the textbook bubble within rounding."""
    run = simulate(Pipeline((0.01,) * 4, (0.02,) * 4), 8, schedule)
    assert run.makespan == pytest.approx(11 * 0.03)
    assert run.bubble == pytest.approx(3 / 11)


def test_a_slow_middle_stage_sets_the_pace():
    """GPipe: one micro-batch through every stage, then M - 1 more at the slow
    stage's rate. 1F1B does better: the stages after the slow one run their
    backward of micro-batch i before the next forward arrives, so from M = 2
    the slow stage never waits once started, and the step is its own work
    plus the forwards before it and the backwards after (a lower bound for
    any schedule)."""
    pipeline = Pipeline((1, 3, 1), (2, 6, 2))
    assert simulate(pipeline, 1, ONE_F_ONE_B).makespan == pipeline.plain == 15
    for m in (1, 2, 4, 8):
        gpipe = simulate(pipeline, m, GPIPE)
        assert gpipe.makespan == (1 + 3 + 1) + (2 + 6 + 2) + (m - 1) * (3 + 6)
        assert gpipe.busy == (3 * m, 9 * m, 3 * m)
        if m > 1:
            assert simulate(pipeline, m, ONE_F_ONE_B).makespan == 1 + m * (3 + 6) + 2
    # The fast stages wait on it: the middle stage is the least idle.
    for schedule in SCHEDULES:
        run = simulate(pipeline, 8, schedule)
        idle = [run.makespan - b for b in run.busy]
        assert idle[1] < idle[0] and idle[1] < idle[2]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_transfers_add_latency(schedule):
    # On their own link, transfers delay GPipe once per boundary and
    # direction. 1F1B alternates, so a stage waits for the round trip of its
    # oldest micro-batch: the latency shows again in the steady state.
    half = Fraction(1, 2)
    for k, m in [(2, 1), (2, 4), (4, 8), (8, 3)]:
        gpipe = simulate(uniform(k, 1, 2, transfer=half), m, GPIPE, overlap=True)
        assert gpipe.makespan == (m + k - 1) * 3 + 2 * (k - 1) * half
        assert simulate(uniform(k, 1, 2, transfer=half), m, ONE_F_ONE_B,
                        overlap=True).makespan >= gpipe.makespan
    # K = 2, M = 4 by hand: stage 0 waits 1F1B's round trip (F0 1, transfer
    # 1/2, F0 and B0 on stage 1 3, transfer 1/2) before B0 and again before
    # B1 and B3.
    assert simulate(uniform(2, 1, 2, transfer=half), 4, ONE_F_ONE_B,
                    overlap=True).makespan == 17
    # Occupying the sender they cost more, and the bubble counts the sending.
    occupied = simulate(uniform(4, 1, 2, transfer=Fraction(1, 2)), 8, schedule)
    linked = simulate(uniform(4, 1, 2, transfer=Fraction(1, 2)), 8, schedule, overlap=True)
    bare = simulate(uniform(4, 1, 2), 8, schedule)
    assert bare.makespan < linked.makespan < occupied.makespan
    assert occupied.busy == linked.busy == bare.busy
    assert occupied.bubble > bare.bubble


def test_two_stages_with_transfers_by_hand():
    """K = 2, M = 2, forward 1, backward 2, transfer 1, the sender busy while
    it sends: stage 0 F0 0-1 (sends to 2), F1 2-3 (to 4); stage 1 F0 2-3, F1
    4-5, B0 5-7 (sends to 8), B1 8-10 (to 11); stage 0 B0 8-10, B1 11-13."""
    run = simulate(Pipeline((1, 1), (2, 2), (1,)), 2, GPIPE)
    timeline = {(op.kind, op.stage, op.microbatch): (op.start, op.end) for op in run.ops}
    assert timeline == {
        (FORWARD, 0, 0): (0, 1), (FORWARD, 0, 1): (2, 3),
        (FORWARD, 1, 0): (2, 3), (FORWARD, 1, 1): (4, 5),
        (BACKWARD, 1, 0): (5, 7), (BACKWARD, 1, 1): (8, 10),
        (BACKWARD, 0, 0): (8, 10), (BACKWARD, 0, 1): (11, 13),
    }
    assert run.makespan == 13
    assert run.bubble == pytest.approx(1 - 12 / 26)  # 12 of 2 x 13 computing


@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_in_flight_gpipe_keeps_every_microbatch_1f1b_at_most_k_minus_k(stages, microbatches):
    pipeline = uniform(stages)
    assert simulate(pipeline, microbatches, GPIPE).peak_in_flight == (microbatches,) * stages
    assert simulate(pipeline, microbatches, ONE_F_ONE_B).peak_in_flight == tuple(
        min(microbatches, stages - k) for k in range(stages))


def test_1f1b_order_is_torch_schedule1f1b():
    """Warmup of K - k forwards, then backward and forward in turn, then the
    rest of the backwards (torch.distributed.pipelining.Schedule1F1B)."""
    f = [(FORWARD, i) for i in range(8)]
    b = [(BACKWARD, i) for i in range(8)]
    assert stage_order(ONE_F_ONE_B, 0, 4, 8) == [*f[:4], b[0], f[4], b[1], f[5], b[2], f[6],
                                                 b[3], f[7], *b[4:]]
    assert stage_order(ONE_F_ONE_B, 3, 4, 3) == [f[0], b[0], f[1], b[1], f[2], b[2]]
    assert stage_order(GPIPE, 1, 4, 3) == [*f[:3], *b[:3]]
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        stage_order("zb", 0, 2, 2)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_microbatch_is_the_plain_split(schedule, overlap):
    batch = Pipeline((Fraction(3), Fraction(5), Fraction(2)), (Fraction(6), Fraction(9), Fraction(4)),
                     (Fraction(1), Fraction(2)))
    run = predict(batch, 1, schedule, overlap)
    assert run.makespan == batch.plain == 3 + 5 + 2 + 6 + 9 + 4 + 2 * (1 + 2)
    assert batch.single_device == 29
    assert run.speedup_over_plain == 1
    assert run.speedup_over_single == Fraction(29, 35)


def test_predict_splits_the_batch():
    batch = uniform(2, 4, 8, transfer=2)
    run = predict(batch, 4, GPIPE, overlap=True)
    assert run.pipeline == uniform(2, 1, 2, transfer=Fraction(1, 2))
    assert run.makespan == 5 * 3 + 2 * Fraction(1, 2)
    assert run.speedup_over_plain == Fraction(2 * 12 + 2 * 2, 16)


def test_bad_pipelines_are_refused():
    with pytest.raises(ValueError, match="one forward and one backward time per stage"):
        Pipeline((1, 2), (1,))
    with pytest.raises(ValueError, match="3 stages have 2 boundaries"):
        Pipeline((1, 1, 1), (2, 2, 2), (1,))
    with pytest.raises(ValueError, match="at least 1"):
        simulate(uniform(2), 0)


def test_the_simulator_does_not_import_torch():
    code = ("import sys, mpgen.compiler.analysis.schedule; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- stage times from a compiled spec ---------------------------------------

MLP = textwrap.dedent("""
    mpgen: 1
    name: Split
    inputs:
      x: [batch, 10]
    layers:
      fc1: {op: Linear, args: [10, 20]}
      act: {op: ReLU}
      fc2: {op: Linear, args: [20, 30]}
      fc3: {op: Linear, args: [30, 5]}
    placement:
      fc1: cuda:0
      fc2: cuda:1
    train:
      batch_size: 4
""")


def test_stage_times_from_the_cost_model(tmp_path):
    graph = compile_spec(write_spec(tmp_path, MLP))
    times = stage_times(graph, flops_per_second=100, bytes_per_second=32)
    # Stages: fc1 + act on cuda:0, fc2 + fc3 on cuda:1. Linear FLOPs are
    # 2 x batch x in x out; the cut is act's output, 4 x 20 float32.
    assert times.devices == ("cuda:0", "cuda:1")
    assert times.forward == (2 * 4 * 10 * 20 / 100, (2 * 4 * 20 * 30 + 2 * 4 * 30 * 5) / 100)
    assert times.backward == tuple(2 * f for f in times.forward)
    assert times.transfers == (4 * 20 * 4 / 32,)
    assert stage_times(graph, backward_factor=3).backward == tuple(
        3 * f for f in stage_times(graph).forward)
    # The plain split of the generated model is one micro-batch.
    assert predict(times, 1).makespan == pytest.approx(times.plain)


def test_stage_times_follow_device_runs(tmp_path):
    """A layout that comes back to a device has a stage per run, and the cut
    at each boundary counts every value crossing it (the skip included)."""
    spec = write_spec(tmp_path, MLP.replace("fc2: cuda:1", "act: cuda:1\n  fc3: cuda:0")
                      .replace("fc3: {op: Linear, args: [30, 5]}",
                               "fc3: {op: Linear, args: [30, 20]}\n"
                               "  out: {op: torch.add, in: [fc3, fc1]}"))
    graph = compile_spec(spec)
    times = stage_times(graph, flops_per_second=1, bytes_per_second=1)
    # fc1 | act, fc2 | fc3, out: fc1's output [4, 20] crosses both boundaries.
    assert times.devices == ("cuda:0", "cuda:1", "cuda:0")
    assert times.forward == (2 * 4 * 10 * 20, 2 * 4 * 20 * 30, 2 * 4 * 30 * 20)
    assert times.transfers == (4 * 20 * 4, 4 * 20 * 4 + 4 * 30 * 4)


def test_device_speed_divides_the_forward(tmp_path):
    spec = write_spec(tmp_path, MLP.replace(
        "placement:\n  fc1: cuda:0\n  fc2: cuda:1",
        "placement:\n  auto: {devices: [cuda:0, cuda:1], balance: flops, speed: {cuda:1: 2.0}}"))
    graph = compile_spec(spec)
    times = stage_times(graph, flops_per_second=1, bytes_per_second=1)
    flops = {d: 0 for d in times.devices}
    for unit in graph.costs.units:
        flops[graph.nodes[unit.node].devices[unit.instance]] += unit.flops
    assert times.forward == (flops["cuda:0"], flops["cuda:1"] / 2)


def test_the_documented_example_runs():
    """docs/pipelining.md's example, as written."""
    text = (ROOT / "docs" / "pipelining.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/pipelining.md", "exec"), namespace)
    run = namespace["run"]
    assert run.schedule == ONE_F_ONE_B and run.microbatches == 6
    assert run.pipeline.devices == ("cuda:0", "cuda:1")
    assert run.peak_in_flight == (2, 1)
