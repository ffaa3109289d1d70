"""The pipeline's time: the bubble the cost model predicts for the schedule
torch runs, and the busy time each rank measures.

# NOTE: [Predicted bubble]
# torch's schedules state their work as each rank's list of actions
# (``pipeline_order``: forward F, full backward B, or the zero-bubble
# schedules' input-gradient I and weight-gradient W of one stage and
# micro-batch; None: idle). predict() replays those lists with the stage
# times of the build's cost model (Stages.costs: each stage's forward and
# backward seconds for one sample; I and W take half a backward each):
# each action at the earliest time its rank is free and its inputs are
# there (F after the previous stage's F of that micro-batch and the
# transfer, B/I after its own F and the next stage's B/I and the transfer,
# W after its I). Transfers delay only the receiver, as torch's
# asynchronous sends do, and cost nothing between stages on one rank (a V's
# turn). The bubble is the ranks' idle share of the step; measured(), the
# same share of a real step, from the time each rank spends in its stages'
# forward and backward (the schedule's calls, timed by time_stages).
# 1f1b is replayed from its textbook order (one_f_one_b: what
# Schedule1F1B runs): torch 2.13's pipeline_order of it starts the last
# rank's micro-batches at 1 (F1 .. FM), so its replay waits forever for
# an F0 that is never listed. A prediction that cannot be made says why
# in the summary (prediction()), never drops its clause silently.
"""

from __future__ import annotations

import platform
import time
from typing import Optional

import torch

COMPUTE = {"F": "forward", "B": "backward", "I": "input", "W": "weight"}


def actions(order: list) -> list[tuple[str, int, int]]:
    """A rank's compute actions as (kind, stage, micro-batch), in order
    (torch's actions, or such tuples already)."""
    found = []
    for action in order:
        if action is None:
            continue
        if not hasattr(action, "computation_type"):  # (kind, stage, micro-batch)
            found.append(action)
            continue
        for one in getattr(action, "sub_actions", None) or (action,):
            kind = one.computation_type.value
            if kind in COMPUTE:
                found.append((kind, one.stage_index, one.microbatch_index))
    return found


def one_f_one_b(ranks: list[int], microbatches: int) -> dict:
    """Schedule1F1B's order, stage k on rank k: rank r runs R - 1 - r
    forwards (at most M), then a forward and a backward in turn, then the
    backwards left, as (kind, stage, micro-batch)."""
    count, m, order = len(ranks), microbatches, {}
    for k in range(count):
        warmup = min(m, count - 1 - k)
        found = [("F", k, i) for i in range(warmup)]
        for i in range(m - warmup):
            found += [("F", k, warmup + i), ("B", k, i)]
        found += [("B", k, i) for i in range(m - warmup, m)]
        order[ranks[k]] = found
    return order


def prediction(
    schedule: str,
    order: Optional[dict],
    ranks: list[int],
    costs,
    transfers,
    samples: float,
    microbatches: int,
) -> tuple[Optional[tuple[float, float]], str]:
    """The predicted step time and bubble of ``schedule`` (``order``:
    torch's pipeline_order of it), or None and why not, in a clause."""
    if not costs or len(costs) != len(ranks):
        return None, "the build's cost model gave no time for these stages"
    if schedule == "1f1b":
        order = one_f_one_b(ranks, microbatches)
    if not order:
        return None, f"torch gives no order of --schedule {schedule} to replay"
    found = predict(order, ranks, costs, transfers, samples)
    if found is None:
        return None, (
            f"torch's order of --schedule {schedule} cannot be replayed "
            "(an action waits for one the order never runs)"
        )
    return found, ""


def predict(
    order: dict, ranks: list[int], costs, transfers, samples: float
) -> Optional[tuple[float, float]]:
    """The step time and bubble of one batch, each micro-batch ``samples``
    samples (NOTE [Predicted bubble]); None where it cannot be replayed."""
    if not costs or len(costs) != len(ranks):
        return None
    last = len(ranks) - 1
    moves = list(transfers) if len(transfers) == last else [0.0] * last
    todo = {r: actions(order.get(r) or []) for r in sorted(set(ranks))}
    end, free, busy = {}, dict.fromkeys(todo, 0.0), dict.fromkeys(todo, 0.0)

    def arrival(stage: int, other: int, boundary: int) -> float:
        return 0.0 if ranks[stage] == ranks[other] else moves[boundary] * samples

    def ready(kind: str, k: int, i: int) -> Optional[float]:
        needs = []
        if kind == "F" and k > 0:
            needs.append((("F", k - 1, i), arrival(k, k - 1, k - 1)))
        if kind in "BI":
            needs.append((("F", k, i), 0.0))
            if k < last:
                back = ("B", k + 1, i) if ("B", k + 1, i) in end else ("I", k + 1, i)
                needs.append((back, arrival(k, k + 1, k)))
        if kind == "W":
            needs.append((("I", k, i), 0.0))
        if any(key not in end for key, _ in needs):
            return None
        return max([0.0] + [end[key] + delay for key, delay in needs])

    while any(todo.values()):
        progressed = False
        for rank, queue in todo.items():
            while queue:
                kind, k, i = queue[0]
                at = ready(kind, k, i)
                if at is None:
                    break
                forward, backward = costs[k]
                took = {"F": forward, "B": backward}.get(kind, backward / 2) * samples
                start = max(free[rank], at)
                end[kind, k, i] = free[rank] = start + took
                busy[rank] += took
                queue.pop(0)
                progressed = True
        if not progressed:
            return None
    step = max(free.values())
    if step <= 0:
        return None
    return step, 1 - sum(busy.values()) / (len(busy) * step)


def predicted_busy(costs, ranks: list[int], samples: float) -> Optional[list[float]]:
    """Each pipeline rank's predicted busy seconds in a step of ``samples``
    samples (its replica's): its stages' forward and backward of each
    sample; None where the build gave no time for these stages."""
    if not costs or len(costs) != len(ranks):
        return None
    busy = [0.0] * (max(ranks) + 1)
    for (forward, backward), rank in zip(costs, ranks):
        busy[rank] += (forward + backward) * samples
    return busy


def hardware(device: torch.device) -> str:
    """The hardware as ``mpgen profile`` names it: a GPU's name, else the
    CPU's model and torch's threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    model = " ".join(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{model} ({threads} thread{'s' if threads != 1 else ''})"


def source(measured_on: tuple, device: torch.device) -> str:
    """Who predicts: the profile (and whether its hardware is this run's),
    or the cost model."""
    if not measured_on:
        return "the cost model"
    here = hardware(device)
    others = sorted({name for name in measured_on if name != here})
    if not others:
        return "the profile (measured on this hardware)"
    return (
        f"the profile, measured on other hardware ({', '.join(others)}; this run: "
        f"{here}; rerun mpgen profile here),"
    )


def time_stages(stages: list, busy: list, cuda: bool) -> None:
    """Add the time each stage's forward and backward calls take to
    ``busy[0]`` (on a GPU, as CUDA events that read()/measured() resolve)."""
    names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    for stage in stages:
        for name in names:
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, timed(method, busy, cuda))


def timed(method, busy: list, cuda: bool):
    def call(*args, **kwargs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True
            )
            start.record()
            try:
                return method(*args, **kwargs)
            finally:
                end.record()
                busy.append((start, end))
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - began

    return call


def read(busy: list) -> float:
    """The seconds ``busy`` holds since the last read, and reset it."""
    for _, end in busy[1:]:
        end.synchronize()
    seconds = busy[0] + sum(s.elapsed_time(e) / 1000 for s, e in busy[1:])
    busy[:] = [0.0]
    return seconds


#: Dense bf16 tensor FLOP/s of one GPU, by a part of its name (torchtitan's MFU uses the same).
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
}


def peak_flops(device: torch.device) -> Optional[float]:
    """One GPU's peak, where its name is known (None: unknown, or the CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, flops in sorted(PEAK_FLOPS.items(), key=lambda item: -len(item[0])):
        if part in name:
            return flops
    return None
