"""Predicting a pipeline: GPipe and 1F1B simulated over the stages of a layout.

The generated model is naive model parallelism: one device works while the
others wait. Split the batch into M micro-batches and the stages can work on
different micro-batches at once. :func:`simulate` predicts what that buys:
from each stage's forward and backward time for one micro-batch and each
boundary's transfer time, it replays a schedule's operations (a
discrete-event simulation, every operation at the earliest time its
dependencies and its stage allow) and gives the step time, the bubble, each
stage's busy time and the micro-batches each stage keeps in flight.
:func:`stage_times` derives those times from the cost model of a compiled
spec. This module is pure Python (it never imports torch), so the
simulator can be driven with exact numbers (``fractions.Fraction``).

# NOTE: [Schedule model]
# Stages        stage k runs forward F(k, i) and backward B(k, i) of
#               micro-batch i, one operation at a time, in its schedule's
#               order (:func:`stage_order`).
# Dependencies  F(k, i) needs F(k - 1, i) and its transfer; B(k, i) needs
#               F(k, i) and B(k + 1, i) and its transfer (the last stage's
#               backward starts from its own forward: the loss is part of it).
# Transfers     one per boundary and direction per micro-batch (activations
#               forward, their gradients back, the same bytes). Default: a
#               transfer occupies the sending stage (``overlap=False``), as a
#               copy on the default stream does in the tutorial's pipelined
#               ResNet-50 and in the generated module: the sender computes
#               nothing until it has sent. ``overlap=True``: transfers run on
#               their own link and delay only the receiver (the best that
#               separate copy streams or NCCL could do).
# Orders        GPipe (torch.distributed.pipelining.ScheduleGPipe): all
#               forwards 0..M-1, then all backwards 0..M-1 (fill-drain).
#               1F1B (Schedule1F1B): min(M, K - k) forwards, then one
#               backward and one forward in turn, then the remaining
#               backwards. The last stage alternates from the start.
# In flight     micro-batches whose forward ran and whose backward did not:
#               each holds its activations. GPipe keeps all M on every
#               stage, 1F1B at most K - k on stage k.
# Not modelled  kernel efficiency (a micro-batch of 1/M of the batch is
#               assumed to take 1/M of the time; real kernels slow down on
#               small inputs, so real speedups fall behind as M grows), the
#               per-operation launch and Python overhead, the loss and the
#               optimizer step, the synchronisation of send and receive
#               (torch's 1F1B waits for paired sends), recomputation
#               (unless folded into the backward time) and layers coupled
#               across the batch (BatchNorm sees a micro-batch).
#
# With uniform stages (forward f, backward b, no transfers) both schedules
# take (M + K - 1)(f + b) and the bubble is (K - 1)/(M + K - 1), the
# textbook figures (tests/compiler/analysis/test_schedule_sim.py checks them exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mpgen.compiler.ir import AutoPlacement, Graph, device_runs

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B)

FORWARD = "F"
BACKWARD = "B"

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
    stage is free again at ``free`` (later when it sends, without overlap)."""

    kind: str  # FORWARD or BACKWARD
    stage: int
    microbatch: int
    start: Any
    end: Any
    free: Any


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

    @property
    def stages(self) -> int:
        return self.pipeline.stages

    @property
    def bubble(self) -> Any:
        """The share of K x makespan in which the stages do not compute
        (idle, or sending when transfers occupy the sender)."""
        return 1 - sum(self.busy) / (self.stages * self.makespan)

    @property
    def speedup_over_single(self) -> Any:
        """Whole-batch time on one device over this step time."""
        return self.microbatches * self.pipeline.single_device / self.makespan

    @property
    def speedup_over_plain(self) -> Any:
        """Whole-batch time of the plain split (M = 1) over this step time."""
        return self.microbatches * self.pipeline.plain / self.makespan


def stage_order(schedule: str, stage: int, stages: int,
                microbatches: int) -> list[tuple[str, int]]:
    """The operations of ``stage`` (0-based) of ``stages``, in the order the
    schedule runs them: ``[(FORWARD, 0), ..., (BACKWARD, M - 1)]``."""
    m = microbatches
    if schedule == GPIPE:
        return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    if schedule != ONE_F_ONE_B:
        raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    warmup = min(m, stages - stage)
    order = [(FORWARD, i) for i in range(warmup)]
    for i in range(m):  # steady state: B(i), then F(i + warmup) while any is left
        order.append((BACKWARD, i))
        if warmup + i < m:
            order.append((FORWARD, warmup + i))
    return order


def peak_in_flight(order: Sequence[tuple[str, int]]) -> int:
    """The most micro-batches a stage has run forward but not backward."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def simulate(pipeline: Pipeline, microbatches: int, schedule: str = GPIPE,
             overlap: bool = False) -> Simulation:
    """Run ``schedule`` over ``pipeline`` (the times of one micro-batch) for
    ``microbatches`` micro-batches (NOTE [Schedule model])."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    k_last = pipeline.stages - 1
    orders = [stage_order(schedule, k, pipeline.stages, microbatches)
              for k in range(pipeline.stages)]
    end: dict[tuple[str, int, int], Any] = {}  # (kind, stage, micro-batch) -> compute end
    free = [0] * pipeline.stages
    busy = [0] * pipeline.stages
    position = [0] * pipeline.stages
    ops: list[Op] = []

    def ready(kind: str, k: int, i: int) -> Optional[Any]:
        """When F/B(k, i)'s inputs are on stage k; None: not computed yet."""
        if kind == FORWARD:
            needs = [] if k == 0 else [((FORWARD, k - 1, i), pipeline.transfers[k - 1])]
        else:
            needs = [((FORWARD, k, i), 0)]
            if k < k_last:
                needs.append(((BACKWARD, k + 1, i), pipeline.transfers[k]))
        if any(key not in end for key, _ in needs):
            return None
        return max([0] + [end[key] + delay for key, delay in needs])

    while any(position[k] < len(orders[k]) for k in range(pipeline.stages)):
        progressed = False
        for k, order in enumerate(orders):
            while position[k] < len(order):
                kind, i = order[position[k]]
                at = ready(kind, k, i)
                if at is None:
                    break
                start = max(free[k], at)
                duration = (pipeline.forward if kind == FORWARD else pipeline.backward)[k]
                done = start + duration
                sends = (k < k_last) if kind == FORWARD else (k > 0)
                send = pipeline.transfers[k if kind == FORWARD else k - 1] if sends else 0
                free[k] = done if overlap else done + send
                end[(kind, k, i)] = done
                busy[k] += duration
                ops.append(Op(kind, k, i, start, done, free[k]))
                position[k] += 1
                progressed = True
        if not progressed:  # an order that waits on itself; neither schedule does
            raise RuntimeError(f"schedule {schedule!r} deadlocks")
    makespan = max(op.free for op in ops)
    return Simulation(schedule, microbatches, pipeline, makespan, tuple(busy),
                      tuple(peak_in_flight(order) for order in orders), tuple(ops))


def predict(batch: Pipeline, microbatches: int, schedule: str = GPIPE,
            overlap: bool = False) -> Simulation:
    """``batch`` (the times of the whole batch) split into ``microbatches``
    and run by ``schedule``."""
    return simulate(batch.split(microbatches), microbatches, schedule, overlap)


def stage_times(graph: Graph, flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
                bytes_per_second: float = DEFAULT_LINK_BYTES_PER_SECOND,
                backward_factor: float = BACKWARD_FACTOR) -> Pipeline:
    """The whole batch's stage times of a compiled spec, from its cost model
    (``analysis.costs``: FLOPs and cut bytes at the training sizes).

    The stages are the device runs of the layout in forward order: consecutive
    units on one device form one stage (a device that holds two runs counts
    as two stages, as if they were separate devices). Forward time is the
    stage's FLOPs over ``flops_per_second`` (times the device's ``speed`` in
    ``placement: {auto: ...}``); backward is ``backward_factor`` times that;
    a transfer is the cut bytes at the boundary over ``bytes_per_second``.
    The cost model counts matmul and convolution FLOPs only, so layers
    without them (norms, activations, pooling) take no time here.
    """
    costs = graph.costs
    if costs is None:
        raise ValueError("the graph has no costs: compile it with compile_spec")
    devices = [graph.nodes[u.node].devices[u.instance] for u in costs.units]
    speeds = dict(graph.placement.speed) if isinstance(graph.placement, AutoPlacement) else {}
    runs = device_runs(devices)
    forward = tuple(sum(u.flops for u in costs.units[start:stop])
                    / (flops_per_second * speeds.get(device, 1.0))
                    for start, stop, device in runs)
    return Pipeline(forward, tuple(backward_factor * f for f in forward),
                    tuple(costs.cuts[stop - 1] / bytes_per_second for _, stop, _ in runs[:-1]),
                    tuple(device for _, _, device in runs))
