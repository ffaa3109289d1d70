"""analysis.schedule: GPipe and 1F1B simulated exactly, the other schedules'
orders checked against torch's own, and stage times from the cost model of
a compiled spec (NOTE [Schedule model])."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from fractions import Fraction

import pytest

from helpers import ROOT, write_spec
from mpgen.compiler.analysis.schedule import (
    BACKWARD,
    DUALPIPEV,
    FORWARD,
    GPIPE,
    INTERLEAVED,
    INTERLEAVED_ZB,
    LOOPED,
    LOOPED_BFS,
    ONE_F_ONE_B,
    ONE_STAGE_PER_RANK,
    SCHEDULES,
    WEIGHT,
    ZBV,
    Pipeline,
    layout_ranks,
    predict,
    rank_orders,
    simulate,
    stage_order,
    stage_ranks,
    stage_times,
)
from mpgen.compiler.ir import PipelineConfig
from mpgen.compiler.driver import compile_spec


def uniform(stages: int, forward=1, backward=2, transfer=0) -> Pipeline:
    return Pipeline((Fraction(forward),) * stages, (Fraction(backward),) * stages,
                    (Fraction(transfer),) * (stages - 1))


SIZES = [(k, m) for k in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 16)]


@pytest.mark.parametrize("schedule", ONE_STAGE_PER_RANK)
@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_uniform_stages_give_the_textbook_step_and_bubble(schedule, stages, microbatches):
    k, m = stages, microbatches
    run = simulate(uniform(k, 1, 2), m, schedule)
    assert run.makespan == (m + k - 1) * (1 + 2)
    assert run.bubble == Fraction(k - 1, m + k - 1)
    assert run.busy == (m * 3,) * k
    assert run.speedup_over_single == Fraction(k * m, m + k - 1)


@pytest.mark.parametrize("schedule", ONE_STAGE_PER_RANK)
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
    for schedule in ONE_STAGE_PER_RANK:
        run = simulate(pipeline, 8, schedule)
        idle = [run.makespan - b for b in run.busy]
        assert idle[1] < idle[0] and idle[1] < idle[2]


@pytest.mark.parametrize("schedule", ONE_STAGE_PER_RANK)
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
@pytest.mark.parametrize("schedule", ONE_STAGE_PER_RANK)
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


# -- several stages per rank ----------------------------------------------

#: (ranks, stages per rank, micro-batches): M below, at and above the ranks,
#: and multiples of them or not (interleaved refuses M that is not a multiple
#: of its rounds, as torch does).
MULTI = [(r, v, m) for r in (1, 2, 3, 4) for v in (2, 3) for m in (1, 2, 3, 4, 6, 8, 12)]
TORCH_CLASSES = {GPIPE: "ScheduleGPipe", INTERLEAVED: "ScheduleInterleaved1F1B",
                 LOOPED_BFS: "ScheduleLoopedBFS", INTERLEAVED_ZB: "ScheduleInterleavedZeroBubble",
                 ZBV: "ScheduleZBVZeroBubble", DUALPIPEV: "ScheduleDualPipeV"}


def _ranks_arg(schedule: str, ranks: int):
    return ranks if schedule in LOOPED else None


def torch_orders(schedule: str, ranks: int, local: int, microbatches: int):
    """torch's ``pipeline_order`` for ``ranks`` ranks holding ``local`` stages
    each, its compute actions as ``(kind, stage, micro-batch)``: F, B and I
    (input gradients: our B followed by a W), W; DualPipeV's OVERLAP_F_B as
    its two actions in order; idle steps and the rest (REDUCE_GRAD) dropped.
    Every rank computes the whole order, so one rank's schedule object, made
    from stand-ins with the attributes the constructors read, gives it
    without a process group."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    count = ranks * local

    def stage(index: int):
        return SimpleNamespace(stage_index=index, num_stages=count, group_size=ranks,
                               group_rank=0, submod=None, is_first=index == 0,
                               is_last=index == count - 1, stage_index_to_group_rank={})

    cls = getattr(schedules, TORCH_CLASSES[schedule])
    made = (cls(stage(0), microbatches) if local == 1
            else cls([stage(k * ranks) for k in range(local)], microbatches))
    kinds = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT}
    return [[(kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
             for action in made.pipeline_order[rank] if action is not None
             for a in (action.sub_actions or (action,)) if a.computation_type.value in kinds]
            for rank in range(ranks)]


@pytest.mark.parametrize("schedule", [s for s in TORCH_CLASSES if s != GPIPE])
@pytest.mark.parametrize("ranks, local, microbatches", MULTI)
def test_orders_are_torchs(schedule, ranks, local, microbatches):
    """Every rank's order is torch's, and where torch refuses (interleaved
    micro-batches not a multiple of the rounds, DualPipeV with fewer
    micro-batches than stages) the order is refused too."""
    if schedule in (ZBV, DUALPIPEV) and local != 2:
        return  # exactly two stages per rank
    count = ranks * local
    try:
        expected = torch_orders(schedule, ranks, local, microbatches)
    except ValueError:
        with pytest.raises(ValueError):
            rank_orders(schedule, count, microbatches, _ranks_arg(schedule, ranks))
        return
    assert rank_orders(schedule, count, microbatches, _ranks_arg(schedule, ranks)) == expected


@pytest.mark.parametrize("stages, microbatches", SIZES)
def test_gpipe_order_is_torchs(stages, microbatches):
    """GPipe's pipeline_order is what ScheduleGPipe runs. 1F1B is checked by
    hand (test_1f1b_order_is_torch_schedule1f1b): Schedule1F1B's
    pipeline_order, only a picture of the schedule, warms up with K - 1 - k
    forwards and numbers the last rank's from 1 (F1 .. FM, no F0), while its
    ``_step_microbatches``, what runs, warms up with min(M, K - k)."""
    expected = torch_orders(GPIPE, stages, 1, microbatches)
    assert rank_orders(GPIPE, stages, microbatches) == expected


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("ranks, local, microbatches", MULTI)
def test_every_operation_once_in_order_without_deadlock(schedule, ranks, local, microbatches):
    """Each rank runs its own stages; every (stage, micro-batch) has one F
    and one B, and a W at most, after its B; the simulation finishes (no
    order waits on itself) with every rank's work done."""
    if schedule in ONE_STAGE_PER_RANK:
        ranks, local = ranks * local, 1
    elif schedule in (ZBV, DUALPIPEV):
        local = 2
    count = ranks * local
    try:
        orders = rank_orders(schedule, count, microbatches, _ranks_arg(schedule, ranks))
    except ValueError:
        assert schedule in (INTERLEAVED, INTERLEAVED_ZB, DUALPIPEV)
        return
    placed = stage_ranks(schedule, count, _ranks_arg(schedule, ranks))
    seen = {}
    for rank, order in enumerate(orders):
        for position, (kind, k, i) in enumerate(order):
            assert placed[k] == rank
            assert (kind, k, i) not in seen
            seen[(kind, k, i)] = position
            if kind == WEIGHT:
                assert seen[(BACKWARD, k, i)] < position
    pairs = {(k, i) for k in range(count) for i in range(microbatches)}
    assert {(k, i) for kind, k, i in seen if kind == FORWARD} == pairs
    assert {(k, i) for kind, k, i in seen if kind == BACKWARD} == pairs
    run = simulate(uniform(count, 1, 2, transfer=Fraction(1, 3)), microbatches, schedule,
                   ranks=_ranks_arg(schedule, ranks))
    assert run.busy == (microbatches * 3,) * count
    assert len(run.ops) == len(seen)


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_several_stages_per_rank_shrink_the_bubble(ranks, microbatches):
    """R ranks, each with two stages of forward 1 and backward 2 against
    1F1B over R stages of the two merged (forward 2, backward 4): the work
    per rank is the same, 6M. 1F1B adds the fill and drain of (R - 1) x 6;
    interleaved and looped BFS (R - 1) x 3, a stage's share (Megatron's
    bubble over v = 2); the zero-bubble schedules, filling the drain with the
    weight gradients (B and W of 1 each), only the first forwards' (R - 1) x 1."""
    r, m = ranks, microbatches
    merged = simulate(uniform(r, 2, 4), m, ONE_F_ONE_B)
    assert merged.makespan == 6 * m + (r - 1) * 6
    for schedule, fill in [(INTERLEAVED, 3), (LOOPED_BFS, 3), (INTERLEAVED_ZB, 1), (ZBV, 1),
                           (DUALPIPEV, 1)]:
        run = simulate(uniform(2 * r, 1, 2), m, schedule, ranks=_ranks_arg(schedule, r))
        assert run.ranks == r
        assert run.makespan == 6 * m + (r - 1) * fill, schedule
        assert run.bubble == Fraction((r - 1) * fill, 6 * m + (r - 1) * fill)
    # What each holds: looped BFS every micro-batch on every stage; ZBV and
    # DualPipeV 2R - k on stage k, 1F1B's figure over the V.
    assert simulate(uniform(2 * r, 1, 2), m, LOOPED_BFS, ranks=r).peak_in_flight == (m,) * (2 * r)
    for schedule in (ZBV, DUALPIPEV):
        assert simulate(uniform(2 * r, 1, 2), m, schedule).peak_in_flight == tuple(
            2 * r - k for k in range(2 * r))


def test_stages_on_one_rank_send_nothing():
    """The V's turn (stages R - 1 and R, both on rank R - 1) costs no transfer;
    with one rank (K = 2) nothing is sent at all."""
    slow = simulate(uniform(2, 1, 2, transfer=Fraction(100)), 4, ZBV)
    assert slow.makespan == simulate(uniform(2, 1, 2), 4, ZBV).makespan == 4 * 6
    assert slow.ranks == 1 and slow.bubble == 0


def test_layouts():
    assert stage_ranks(GPIPE, 3) == (0, 1, 2)
    assert stage_ranks(INTERLEAVED, 6, 3) == (0, 1, 2, 0, 1, 2)
    assert stage_ranks(ZBV, 6) == (0, 1, 2, 2, 1, 0)
    assert stage_ranks(DUALPIPEV, 2) == (0, 0)
    for bad in [(ZBV, 5, None), (GPIPE, 3, 2), (LOOPED_BFS, 6, None), (INTERLEAVED, 6, 4)]:
        with pytest.raises(ValueError):
            stage_ranks(*bad)
    assert layout_ranks(ONE_F_ONE_B, ("cuda:0", "cuda:1", "cuda:0")) == 3
    assert layout_ranks(INTERLEAVED_ZB, ("cuda:0", "cuda:1") * 3) == 2
    assert layout_ranks(ZBV, ("cuda:0", "cuda:1", "cuda:0", "cuda:1")) == 2
    with pytest.raises(ValueError, match="repeating order at least twice"):
        layout_ranks(LOOPED_BFS, ("cuda:0", "cuda:1", "cuda:0"))
    with pytest.raises(ValueError, match="repeating order at least twice"):
        layout_ranks(INTERLEAVED, ("cuda:0", "cuda:1"))
    with pytest.raises(ValueError, match="even number of stages; the layout has 3"):
        layout_ranks(DUALPIPEV, ("cuda:0", "cuda:1", "cuda:2"))
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        layout_ranks("zb", ("cuda:0",))
    # The simulator takes a looped schedule's ranks from the stages' devices.
    named = Pipeline((1,) * 4, (2,) * 4, devices=("cuda:0", "cuda:1") * 2)
    assert simulate(named, 4, INTERLEAVED).stage_ranks == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="needs the number of ranks"):
        simulate(uniform(4), 4, INTERLEAVED)


def test_the_simulator_knows_the_specs_schedules():
    assert SCHEDULES == PipelineConfig.SCHEDULES
    assert set(TORCH_CLASSES) | {ONE_F_ONE_B} == set(SCHEDULES)
    assert stage_order(ZBV, 1, 4, 4) == [(kind, i) for kind, k, i in rank_orders(ZBV, 4, 4)[1]
                                         if k == 1]


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


def test_stage_times_of_the_specs_own_stages(tmp_path):
    """``plan=graph.spec_plan``: the stages of pp_<name>.py, at the spec's
    devices whatever --device-map merged."""
    spec = write_spec(tmp_path, MLP)
    plain = compile_spec(spec)
    assert stage_times(plain, plan=plain.spec_plan) == stage_times(plain)
    merged = compile_spec(spec, {"cuda:1": "cuda:0"})
    assert stage_times(merged).devices == ("cuda:0",)
    assert stage_times(merged, plan=merged.spec_plan) == stage_times(plain)


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


@pytest.mark.slow  # 5 s: too long for the quick loop
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
