"""Predicting a pipeline: torch's schedules simulated over the stages of a layout.

The generated model is naive model parallelism: one device works while the
others wait. Split the batch into M micro-batches and the stages can work on
different micro-batches at once. :func:`simulate` predicts what that buys:
from each stage's forward and backward time for one micro-batch and each
boundary's transfer time, it replays a schedule's operations (a
discrete-event simulation, every operation at the earliest time its
dependencies and its rank allow) and gives the step time, the bubble, each
stage's busy time and the micro-batches each stage keeps in flight.
:func:`stage_times` derives those times from the cost model of a compiled
spec. This module is pure Python (it never imports torch), so the
simulator can be driven with exact numbers (``fractions.Fraction``).

# NOTE: [Schedule model]
# Ranks         a rank holds one stage or more (:func:`stage_ranks`) and runs
#               one operation at a time, in its schedule's order
#               (:func:`rank_orders`): forward F(k, i) of stage k and
#               micro-batch i, backward B(k, i), and for the zero-bubble
#               schedules W(k, i). A B with a W of the same stage and
#               micro-batch after it computes the input gradients only
#               (torch's BACKWARD_INPUT, "I"); W then computes the weight
#               gradients (BACKWARD_WEIGHT). Without a W, B is the whole
#               backward (FULL_BACKWARD).
# Split         B and W take half of the stage's backward time each: a
#               layer's backward is two products of one forward's
#               multiply-adds each (the input's gradient, the weight's:
#               BACKWARD_FACTOR), which the zero-bubble paper (Qi et al.
#               2023, arXiv:2401.10241) also takes as equal (T_B = T_W).
# Layouts       gpipe, 1f1b: stage k on rank k. interleaved, looped-bfs,
#               interleaved-zb: R ranks take turns, stage k on rank k % R
#               (K a multiple of R). zbv, dualpipev: two stages per rank in a
#               V, K = 2R: stage k on rank k for k < R, else on 2R - 1 - k,
#               so the first and last stage share rank 0.
# Dependencies  F(k, i) needs F(k - 1, i) and its transfer; B(k, i) needs
#               F(k, i) and B(k + 1, i) and its transfer (the last stage's
#               backward starts from its own forward: the loss is part of it);
#               W(k, i) needs B(k, i).
# Transfers     one per boundary and direction per micro-batch (activations
#               forward, their gradients back, the same bytes), none between
#               two stages on one rank. Default: a transfer occupies the
#               sending rank (``overlap=False``), as a copy on the default
#               stream does in the tutorial's pipelined ResNet-50 and in the
#               generated module: the sender computes nothing until it has
#               sent. ``overlap=True``: transfers run on their own link and
#               delay only the receiver (the best that separate copy streams
#               or NCCL could do).
# Orders        each is torch 2.13's (torch.distributed.pipelining), its
#               compute actions in order (its idle steps and communication
#               dropped; tests/compiler/analysis/test_schedule_sim.py checks
#               them against torch's ``pipeline_order``):
#               GPipe (ScheduleGPipe): all forwards 0..M-1, then all
#               backwards 0..M-1 (fill-drain).
#               1F1B (Schedule1F1B): min(M, K - k) forwards, then one
#               backward and one forward in turn, then the remaining
#               backwards. The last stage alternates from the start.
#               Interleaved 1F1B (ScheduleInterleaved1F1B): 1F1B over the
#               rank's stages, micro-batches in rounds of M // max(1, M // R)
#               (M a multiple of the rounds), depth first.
#               Looped BFS (ScheduleLoopedBFS): each of the rank's stages in
#               turn runs all its forwards; then the backwards, last stage
#               and last micro-batch first (breadth first).
#               Interleaved zero bubble (ScheduleInterleavedZeroBubble, ZB1P):
#               interleaved 1F1B with a shorter warmup, each backward split,
#               the W of a stage's oldest B run after each B once past the
#               rank's first ``rank`` steady steps.
#               ZBV (ScheduleZBVZeroBubble) and DualPipeV (ScheduleDualPipeV):
#               the V layout's own orders; DualPipeV's overlapped F and B
#               (OVERLAP_F_B) run one after the other here, F first.
# In flight     micro-batches whose forward ran and whose backward (its W,
#               when split) did not: each holds its activations. GPipe keeps
#               all M on every stage, 1F1B at most K - k on stage k.
# Not modelled  kernel efficiency (a micro-batch of 1/M of the batch is
#               assumed to take 1/M of the time; real kernels slow down on
#               small inputs, so real speedups fall behind as M grows), the
#               per-operation launch and Python overhead, the loss and the
#               optimizer step, the synchronisation of send and receive
#               (torch's 1F1B waits for paired sends), recomputation
#               (unless folded into the backward time), DualPipeV's overlap
#               of one micro-batch's communication with another's compute,
#               and layers coupled across the batch (BatchNorm sees a
#               micro-batch).
#
# With uniform stages (forward f, backward b, no transfers) GPipe and 1F1B
# take (M + K - 1)(f + b) and the bubble is (K - 1)/(M + K - 1), the
# textbook figures (tests/compiler/analysis/test_schedule_sim.py checks them
# exactly). The bubble counts ranks: 1 - busy / (R x step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mpgen.compiler.ir import AutoPlacement, ForwardPlan, Graph, PipelineConfig, device_runs

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved"
LOOPED_BFS = "looped-bfs"
INTERLEAVED_ZB = "interleaved-zb"
ZBV = "zbv"
DUALPIPEV = "dualpipev"
#: Every schedule, as ``pipeline.schedule`` names it.
SCHEDULES = PipelineConfig.SCHEDULES
#: Stage k on rank k.
ONE_STAGE_PER_RANK = (GPIPE, ONE_F_ONE_B)
#: Stage k on rank k % R, R ranks taking turns.
LOOPED = (INTERLEAVED, LOOPED_BFS, INTERLEAVED_ZB)
#: Two stages per rank, in a V.
V_SHAPED = (ZBV, DUALPIPEV)

FORWARD = "F"
BACKWARD = "B"  # the whole backward, or its input gradients when a W follows
WEIGHT = "W"  # the weight gradients of a split backward

#: Stage times from the cost model: FLOP/s of one device and bytes/s of the
#: link between two. Only ratios are reported, so what matters is the ratio
#: of the two: 100 TFLOP/s over 25 GB/s (a PCIe 4.0 x16 link).
DEFAULT_FLOPS_PER_SECOND = 100e12
DEFAULT_LINK_BYTES_PER_SECOND = 25e9
#: Backward over forward time: a layer's backward computes the gradients of
#: its input and of its weights, each about one forward's multiply-adds.
BACKWARD_FACTOR = 2


@dataclass(frozen=True)
class Pipeline:
    """The work of K stages, in seconds (or any unit, exact numbers too):
    ``forward[k]`` and ``backward[k]`` of stage k, ``transfers[k]`` one
    transfer over the boundary between stages k and k + 1 (each direction).
    ``devices`` names the stages, for display."""

    forward: tuple[Any, ...]
    backward: tuple[Any, ...]
    transfers: tuple[Any, ...] = ()  # empty: no transfers
    devices: tuple[str, ...] = ()
    #: The hardware each stage's times were measured on (the spec's profile,
    #: ``mpgen profile``); empty: the cost model's FLOPs at a nominal speed.
    measured_on: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        k = len(self.forward)
        if k == 0 or len(self.backward) != k:
            raise ValueError(f"need one forward and one backward time per stage, "
                             f"got {len(self.forward)} and {len(self.backward)}")
        if self.transfers and len(self.transfers) != k - 1:
            raise ValueError(f"{k} stages have {k - 1} boundaries, got "
                             f"{len(self.transfers)} transfer times")
        if self.devices and len(self.devices) != k:
            raise ValueError(f"{k} stages, {len(self.devices)} device names")
        if not self.transfers:
            object.__setattr__(self, "transfers", (0,) * (k - 1))

    @property
    def stages(self) -> int:
        return len(self.forward)

    @property
    def single_device(self) -> Any:
        """All the work on one device: every forward and backward, no transfer."""
        return sum(self.forward) + sum(self.backward)

    @property
    def plain(self) -> Any:
        """Naive model parallelism: the stages one after another, each
        boundary crossed twice (activations, then their gradients)."""
        return self.single_device + 2 * sum(self.transfers)

    def split(self, microbatches: int) -> "Pipeline":
        """The work of one of ``microbatches`` equal micro-batches: FLOPs and
        bytes scale with the batch, so every time divides by M."""
        if microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {microbatches}")
        return Pipeline(*(tuple(t / microbatches for t in times)
                          for times in (self.forward, self.backward, self.transfers)),
                        devices=self.devices)


@dataclass(frozen=True)
class Op:
    """One operation as simulated: compute from ``start`` to ``end``; the
    rank is free again at ``free`` (later when it sends, without overlap)."""

    kind: str  # FORWARD, BACKWARD or WEIGHT
    stage: int
    microbatch: int
    start: Any
    end: Any
    free: Any
    rank: int = 0


@dataclass(frozen=True)
class Simulation:
    """One schedule run over ``pipeline`` (the work of one micro-batch) for
    ``microbatches`` micro-batches."""

    schedule: str
    microbatches: int
    pipeline: Pipeline
    makespan: Any  # the step: first forward starts at 0, last backward ends
    busy: tuple[Any, ...]  # compute time of each stage (transfers excluded)
    peak_in_flight: tuple[int, ...]  # micro-batches holding activations, per stage
    ops: tuple[Op, ...]  # in the order they were simulated
    stage_ranks: tuple[int, ...] = ()  # the rank of each stage; empty: stage k on rank k

    @property
    def stages(self) -> int:
        return self.pipeline.stages

    @property
    def ranks(self) -> int:
        return len(set(self.stage_ranks)) if self.stage_ranks else self.stages

    @property
    def bubble(self) -> Any:
        """The share of R x makespan in which the R ranks do not compute
        (idle, or sending when transfers occupy the sender)."""
        return 1 - sum(self.busy) / (self.ranks * self.makespan)

    @property
    def speedup_over_single(self) -> Any:
        """Whole-batch time on one device over this step time."""
        return self.microbatches * self.pipeline.single_device / self.makespan

    @property
    def speedup_over_plain(self) -> Any:
        """Whole-batch time of the plain split (M = 1) over this step time."""
        return self.microbatches * self.pipeline.plain / self.makespan


# -- layouts ------------------------------------------------------------------------

def _known(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")


def layout_ranks(schedule: str, devices: Sequence[str]) -> int:
    """The ranks one replica of the pipeline takes when its stages are on
    ``devices`` (a layout's device runs, in order), by the layout rules of
    NOTE [Schedule model]; ValueError saying why the layout does not fit."""
    _known(schedule)
    stages = len(devices)
    if schedule in ONE_STAGE_PER_RANK:
        return stages
    if schedule in V_SHAPED:
        if stages % 2:
            raise ValueError(f"{schedule} holds two stages per rank, in a V, so it needs an "
                             f"even number of stages; the layout has {stages} "
                             f"({', '.join(devices)})")
        return stages // 2
    distinct = tuple(dict.fromkeys(devices))
    turns = stages // len(distinct)
    if turns < 2 or tuple(devices) != distinct * turns:
        raise ValueError(f"{schedule} needs a layout that visits its devices in a repeating "
                         "order at least twice (cuda:0, cuda:1, cuda:0, cuda:1), so that each "
                         f"rank holds two stages or more; the stages are on {', '.join(devices)}")
    return len(distinct)


def stage_ranks(schedule: str, stages: int, ranks: Optional[int] = None) -> tuple[int, ...]:
    """The rank of each of ``stages`` stages under ``schedule`` over
    ``ranks`` ranks (default: one per stage, or two per stage in a V; a
    looped schedule needs it)."""
    _known(schedule)
    if schedule in ONE_STAGE_PER_RANK:
        if ranks not in (None, stages):
            raise ValueError(f"{schedule} runs one stage per rank: {stages} ranks, not {ranks}")
        return tuple(range(stages))
    if schedule in V_SHAPED:
        if stages % 2 or ranks not in (None, stages // 2):
            raise ValueError(f"{schedule} runs two stages per rank: an even number of stages "
                             f"and half as many ranks, not {stages} stages on {ranks} ranks")
        half = stages // 2
        return tuple(k if k < half else stages - 1 - k for k in range(stages))
    if ranks is None or ranks < 1 or stages % ranks:
        raise ValueError(f"{schedule} needs the number of ranks, a divisor of the "
                         f"{stages} stages; got {ranks}")
    return tuple(k % ranks for k in range(stages))


# -- orders ---------------------------------------------------------------------------

Action = tuple[str, int, int]  # (FORWARD | BACKWARD | WEIGHT, stage, micro-batch)


def stage_order(schedule: str, stage: int, stages: int, microbatches: int,
                ranks: Optional[int] = None) -> list[tuple[str, int]]:
    """The operations of ``stage`` (0-based) of ``stages``, in the order the
    schedule runs them: ``[(FORWARD, 0), ..., (BACKWARD, M - 1)]``."""
    m = microbatches
    if schedule == GPIPE:
        return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    if schedule != ONE_F_ONE_B:
        rank = stage_ranks(schedule, stages, ranks)[stage]
        return [(kind, i) for kind, k, i in rank_orders(schedule, stages, m, ranks)[rank]
                if k == stage]
    warmup = min(m, stages - stage)
    order = [(FORWARD, i) for i in range(warmup)]
    for i in range(m):  # steady state: B(i), then F(i + warmup) while any is left
        order.append((BACKWARD, i))
        if warmup + i < m:
            order.append((FORWARD, warmup + i))
    return order


def rank_orders(schedule: str, stages: int, microbatches: int,
                ranks: Optional[int] = None) -> list[list[Action]]:
    """Each rank's operations in the order ``schedule`` runs them:
    ``(kind, stage, micro-batch)`` (NOTE [Schedule model]; ``ranks`` as for
    :func:`stage_ranks`)."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    placed = stage_ranks(schedule, stages, ranks)
    count = len(set(placed))
    if schedule in ONE_STAGE_PER_RANK:
        return [[(kind, k, i) for kind, i in stage_order(schedule, k, stages, microbatches)]
                for k in range(stages)]
    if schedule == LOOPED_BFS:
        return [_looped_bfs(rank, count, stages // count, microbatches) for rank in range(count)]
    if schedule in (INTERLEAVED, INTERLEAVED_ZB):
        return [_interleaved(rank, count, stages // count, microbatches,
                             schedule == INTERLEAVED_ZB) for rank in range(count)]
    if schedule == ZBV:
        return [_zbv(rank, count, microbatches) for rank in range(count)]
    if microbatches < stages:
        raise ValueError(f"dualpipev needs at least as many micro-batches as stages, "
                         f"got {microbatches} for {stages}")
    return [_dualpipev(rank, count, microbatches) for rank in range(count)]


def _looped_bfs(rank: int, ranks: int, local: int, m: int) -> list[Action]:
    """ScheduleLoopedBFS: every forward of each of the rank's stages in
    turn, then the backwards, last stage and micro-batch first."""
    own = range(rank, ranks * local, ranks)
    return ([(FORWARD, k, i) for k in own for i in range(m)]
            + [(BACKWARD, k, i) for k in reversed(own) for i in reversed(range(m))])


class _Order:
    """A rank's order as it is written: each kind of operation numbers the
    micro-batches of each stage from 0 (torch's counters)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.counts: dict[tuple[str, int], int] = {}

    def add(self, kind: str, stage: int) -> int:
        """Append ``kind`` of ``stage``'s next micro-batch; that micro-batch."""
        i = self.of(kind, stage)
        self.counts[(kind, stage)] = i + 1
        self.actions.append((kind, stage, i))
        return i

    def of(self, kind: str, stage: Optional[int] = None) -> int:
        """How many of ``kind`` there are for ``stage`` (None: every stage)."""
        return sum(n for (k, s), n in self.counts.items()
                   if k == kind and stage in (None, s))


def _interleaved(rank: int, ranks: int, local: int, m: int, zero_bubble: bool) -> list[Action]:
    """ScheduleInterleaved1F1B, or ScheduleInterleavedZeroBubble: torch's
    ``_get_1f1b_rank_ops`` with its warmup (``_get_warmup_ops``)."""
    rounds = max(1, m // ranks)
    if m % rounds:
        raise ValueError(f"{INTERLEAVED_ZB if zero_bubble else INTERLEAVED} needs the "
                         f"micro-batches to be a multiple of its rounds ({rounds}), got {m}")
    per_round = m // rounds
    total = local * m  # each of forwards, backwards
    warmup = min((local - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % local * ranks + rank

    def backward_stage(op: int) -> int:
        return (local - 1 - (op - warmup) // per_round % local) * ranks + rank

    order = _Order()
    backwards: list[int] = []  # the op of each backward, for its W
    for op in range(total + warmup):
        if op < total:
            order.add(FORWARD, forward_stage(op))
        if op < warmup:
            continue
        order.add(BACKWARD, backward_stage(op))
        backwards.append(op)
        if zero_bubble and op - warmup >= rank:
            order.add(WEIGHT, backward_stage(backwards[order.of(WEIGHT)]))
    while zero_bubble and order.of(WEIGHT) < len(backwards):
        order.add(WEIGHT, backward_stage(backwards[order.of(WEIGHT)]))
    return order.actions


def _zbv(rank: int, ranks: int, m: int) -> list[Action]:
    """ScheduleZBVZeroBubble: the V's first stage ``rank`` and second
    ``2R - 1 - rank``, for max(M, 2R - 1) micro-batches, those past M dropped."""
    first, second = rank, 2 * ranks - 1 - rank
    n = max(2 * ranks - 1, m)
    order = _Order()

    def backward(stage: int, weight: bool = True) -> None:
        order.add(BACKWARD, stage)
        if weight:
            order.add(WEIGHT, stage)

    for _ in range(2 * (ranks - rank) - 1):
        order.add(FORWARD, first)
    for _ in range(rank):
        order.add(FORWARD, second)
        order.add(FORWARD, first)
    for _ in range(ranks - rank):
        order.add(FORWARD, second)
        backward(second)
    while order.of(FORWARD, second) < order.of(FORWARD, first) or order.of(FORWARD, first) < n:
        if order.of(FORWARD, first) < n:  # steady state
            order.add(FORWARD, first)
        backward(first)
        order.add(FORWARD, second)
        backward(second)
    for _ in range(rank):  # cool-down: input gradients first, weights after
        backward(first, weight=False)
        backward(second, weight=False)
    for _ in range(ranks - rank):
        backward(first)
    for stage in (second, first):
        while order.of(WEIGHT, stage) < order.of(BACKWARD, stage):
            order.add(WEIGHT, stage)
    return [action for action in order.actions if action[2] < m]


def _dualpipev(rank: int, ranks: int, m: int) -> list[Action]:
    """ScheduleDualPipeV (DeepSeek's DualPipe, in a V): its eight steps;
    an overlapped forward and backward (OVERLAP_F_B) one after the other."""
    first, second = rank, 2 * ranks - 1 - rank
    order = _Order()
    pending: list[tuple[int, int]] = []  # input gradients whose W is to come

    def forward(stage: int) -> None:
        order.add(FORWARD, stage)

    def backward(stage: int, split: bool = False) -> None:
        i = order.add(BACKWARD, stage)
        if split:
            pending.append((stage, i))

    def weight() -> None:
        if pending:
            order.actions.append((WEIGHT, *pending.pop(0)))

    for _ in range(2 * (ranks - rank - 1)):  # 1: F0
        forward(first)
    for _ in range(rank + 1):  # 2: F0 F1
        forward(first)
        forward(second)
    for _ in range(ranks - rank - 1):  # 3: I1 W1 F1
        backward(second, split=True)
        weight()
        forward(second)
    for _ in range(m - 2 * ranks + rank + 1):  # 4: F0 B1, F1 B0
        forward(first)
        backward(second)
        forward(second)
        backward(first)
    for _ in range(ranks - rank - 1):  # 5: B1, F1 B0
        backward(second)
        forward(second)
        backward(first)
    split = False
    steps = rank + 1
    for i in range(steps):  # 6: B1 B0, the second half split
        split = split or (i == steps // 2 and rank % 2 == 1)
        backward(second, split)
        split = split or (i == steps // 2 and rank % 2 == 0)
        backward(first, split)
    for _ in range(ranks - rank - 1):  # 7: W0 B0
        weight()
        backward(first, split)
    for _ in range(rank + 1):  # 8: W0
        weight()
    return order.actions


def peak_in_flight(order: Sequence[tuple[str, int]]) -> int:
    """The most micro-batches a stage has run forward but not backward (nor
    its W, when the backward is split)."""
    split = {i for kind, i in order if kind == WEIGHT}
    held = peak = 0
    for kind, i in order:
        if kind == FORWARD:
            held += 1
        elif (kind == WEIGHT) == (i in split):
            held -= 1
        peak = max(peak, held)
    return peak


def simulate(pipeline: Pipeline, microbatches: int, schedule: str = GPIPE,
             overlap: bool = False, ranks: Optional[int] = None) -> Simulation:
    """Run ``schedule`` over ``pipeline`` (the times of one micro-batch) for
    ``microbatches`` micro-batches (NOTE [Schedule model]). ``ranks``: for
    the looped schedules, the ranks taking turns (default: by
    :func:`layout_ranks` from the pipeline's devices)."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    k_last = pipeline.stages - 1
    if ranks is None and schedule in LOOPED and pipeline.devices:
        ranks = layout_ranks(schedule, pipeline.devices)
    placed = stage_ranks(schedule, pipeline.stages, ranks)
    orders = rank_orders(schedule, pipeline.stages, microbatches, ranks)
    split = {(k, i) for order in orders for kind, k, i in order if kind == WEIGHT}
    # A boundary between two stages of one rank costs nothing.
    link = [0 if placed[k] == placed[k + 1] else t for k, t in enumerate(pipeline.transfers)]
    end: dict[Action, Any] = {}  # (kind, stage, micro-batch) -> compute end
    free = [0] * len(orders)
    busy = [0] * pipeline.stages
    position = [0] * len(orders)
    ops: list[Op] = []

    def ready(kind: str, k: int, i: int) -> Optional[Any]:
        """When the inputs of the operation are on its rank; None: not computed yet."""
        if kind == FORWARD:
            needs = [] if k == 0 else [((FORWARD, k - 1, i), link[k - 1])]
        elif kind == WEIGHT:
            needs = [((BACKWARD, k, i), 0)]
        else:
            needs = [((FORWARD, k, i), 0)]
            if k < k_last:
                needs.append(((BACKWARD, k + 1, i), link[k]))
        if any(key not in end for key, _ in needs):
            return None
        return max([0] + [end[key] + delay for key, delay in needs])

    def duration(kind: str, k: int, i: int) -> Any:
        if kind == FORWARD:
            return pipeline.forward[k]
        whole = pipeline.backward[k]
        if (k, i) not in split:
            return whole
        return whole / 2 if kind == BACKWARD else whole - whole / 2

    while any(position[r] < len(orders[r]) for r in range(len(orders))):
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                kind, k, i = order[position[r]]
                at = ready(kind, k, i)
                if at is None:
                    break
                start = max(free[r], at)
                took = duration(kind, k, i)
                done = start + took
                send = 0
                if kind == FORWARD and k < k_last:
                    send = link[k]
                elif kind == BACKWARD and k > 0:
                    send = link[k - 1]
                free[r] = done if overlap else done + send
                end[(kind, k, i)] = done
                busy[k] += took
                ops.append(Op(kind, k, i, start, done, free[r], r))
                position[r] += 1
                progressed = True
        if not progressed:  # an order that waits on itself; none of torch's does
            raise RuntimeError(f"schedule {schedule!r} deadlocks")
    makespan = max(op.free for op in ops)
    in_flight = tuple(peak_in_flight([(kind, i) for kind, s, i in orders[placed[k]] if s == k])
                      for k in range(pipeline.stages))
    return Simulation(schedule, microbatches, pipeline, makespan, tuple(busy), in_flight,
                      tuple(ops), placed)


def predict(batch: Pipeline, microbatches: int, schedule: str = GPIPE,
            overlap: bool = False, ranks: Optional[int] = None) -> Simulation:
    """``batch`` (the times of the whole batch) split into ``microbatches``
    and run by ``schedule``."""
    return simulate(batch.split(microbatches), microbatches, schedule, overlap, ranks)


def stage_times(graph: Graph, flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
                bytes_per_second: float = DEFAULT_LINK_BYTES_PER_SECOND,
                backward_factor: float = BACKWARD_FACTOR,
                plan: Optional[ForwardPlan] = None, measured: bool = True) -> Pipeline:
    """The whole batch's stage times of a compiled spec: measured, from the
    profile beside the spec when it has a current one that names every
    stage's device kind (``measured``; :func:`measured_times`), else from its
    cost model (``analysis.costs``: FLOPs and cut bytes at the training sizes).

    The stages are the device runs of the layout in forward order: consecutive
    units on one device form one stage (a device that holds two runs counts
    as two stages, as if they were separate devices). With ``plan``
    (``graph.spec_plan``: the spec's own devices, before --device-map, whose
    sections are the stages of pp_<name>.py), the runs of that plan's
    devices, one stage per section; ValueError when its sections are not
    runs of units in order. Forward time is the
    stage's FLOPs over ``flops_per_second`` (times the device's ``speed`` in
    ``placement: {auto: ...}``); backward is ``backward_factor`` times that;
    a transfer is the cut bytes at the boundary over ``bytes_per_second``.
    The cost model counts matmul and convolution FLOPs only, so layers
    without them (norms, activations, pooling) take no time here.
    """
    costs = graph.costs
    if costs is None:
        raise ValueError("the graph has no costs: compile it with compile_spec")
    if plan is None:
        devices = [graph.nodes[u.node].devices[u.instance] for u in costs.units]
    else:
        where = {graph.node(step.node).unit(k): section.device for section in plan.sections
                 for step in section.steps for k in range(step.start, step.stop)}
        devices = [where.get(u.unit) for u in costs.units]
    speeds = dict(graph.placement.speed) if isinstance(graph.placement, AutoPlacement) else {}
    runs = device_runs(devices)
    if plan is not None and [d for _, _, d in runs] != [s.device for s in plan.sections]:
        raise ValueError("the plan's sections are not runs of units in order")
    found = measured_times(graph, runs, speeds, bytes_per_second) if measured else None
    if found is not None:
        return found
    forward = tuple(sum(u.flops for u in costs.units[start:stop])
                    / (flops_per_second * speeds.get(device, 1.0))
                    for start, stop, device in runs)
    return Pipeline(forward, tuple(backward_factor * f for f in forward),
                    tuple(costs.cuts[stop - 1] / bytes_per_second for _, stop, _ in runs[:-1]),
                    tuple(device for _, _, device in runs))


def measured_times(graph: Graph, runs: Sequence[tuple[int, int, str]],
                   speeds: dict[str, float], bytes_per_second: float) -> Optional[Pipeline]:
    """The stage times the profile beside the spec gives (NOTE [Measured
    time] in commands/profile.py): each stage's units' forward and backward
    ms on its device's kind, plus one stage call, divided by its ``speed``;
    a transfer at the rate measured between the two devices, else at
    ``bytes_per_second``. None without a current profile or where a stage's
    device has no measured kind."""
    profile, costs = graph.profile, graph.costs
    if profile is None or costs is None or profile.stale(costs) is not None:
        return None
    kinds = [profile.kind_of(device) for _, _, device in runs]
    if any(kind is None for kind in kinds):
        return None
    call = {kind: (f, b) for kind, f, b in profile.call}
    rates = {(a, b): rate for a, b, rate in profile.transfers}
    forward, backward = [], []
    for (start, stop, device), kind in zip(runs, kinds):
        times = profile.unit_ms(kind)[start:stop]
        speed = speeds.get(device, 1.0) * 1000  # ms -> s
        forward.append((call.get(kind, (0.0, 0.0))[0] + sum(f for f, _ in times)) / speed)
        backward.append((call.get(kind, (0.0, 0.0))[1] + sum(b for _, b in times)) / speed)
    transfers = []
    for (_, stop, device), (_, _, after) in zip(runs, runs[1:]):
        rate = rates.get((device, after))
        cut = costs.cuts[stop - 1]
        transfers.append(cut / (rate * 1000) if rate else cut / bytes_per_second)
    names = dict(profile.kinds)
    return Pipeline(tuple(forward), tuple(backward), tuple(transfers),
                    tuple(device for _, _, device in runs), tuple(names[k] for k in kinds))


def profile_notes(graph: Graph) -> list[str]:
    """``PROFILE:1:1: note: ...`` when the spec's profile is stale: it is not
    used (the predicted times are the cost model's), and that is said, not
    silent. (Under ``balance: time`` a stale profile is an error instead.)"""
    profile = graph.profile
    why = profile.stale(graph.costs) if profile is not None and graph.costs else None
    if why is None:
        return []
    return [f"{profile.path}:1:1: note: this profile is stale ({why}), so the pipeline's "
            f"predicted times are the cost model's; rerun `mpgen profile {graph.spec_path}`"]
