"""``placement: {auto: ...}``: the compiler chooses the layout.

# NOTE: [Automatic placement]
# The units (a layer, one instance of a repeated layer, one block instance;
# never split) keep their ``layers`` order and are cut into contiguous stages,
# stage k on ``devices[k]``. Each unit is costed by ``compiler.costs`` at the
# training sizes; ``balance`` picks the quantity (params, memory or flops,
# or time: the milliseconds ``mpgen profile`` measured, NOTE [Measured
# time] in commands/profile.py), and a device's load is the sum over its
# stage divided by its ``speed`` (default 1; under ``time``, times the
# measured speed of the device's kind relative to the first device's).
# ``compiler.partition`` returns the exact optimum of: smallest
# bottleneck (the largest load), then the fewest bytes crossing the cuts
# (skip connections included), then each device in order taking as many
# units as it can. Every device gets a unit (``use_all``) when there are at
# least as many units as devices. ``capacity`` bounds each device's estimated
# training memory (weights + gradients + optimizer state + activations),
# whatever is balanced. ``--device-map`` renames devices after the choice.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from mpgen.compiler.analysis.costs import human_bytes
from mpgen.compiler.ir import AutoChoice, AutoPlacement, Costs, Graph, Layout, Profile
from mpgen.compiler.placement.partition import PartitionError, partition
from mpgen.compiler.placement.transfers import assign
from mpgen.errors import MpgenError

#: The word for one unit of each balanced quantity, for messages and reports.
BALANCE_UNITS = {"params": "parameters", "memory": "bytes", "flops": "FLOPs", "time": "ms"}


def choose(costs: Costs, request: AutoPlacement,
           profile: Optional[Profile] = None) -> AutoChoice:
    """The optimal split of the units by ``costs`` (under ``balance: time``,
    by ``profile``'s times); raises MpgenError."""
    speed, capacity = dict(request.speed), dict(request.capacity)
    speeds = tuple(float(speed.get(d, 1.0)) for d in request.devices)
    caps = [capacity.get(d) for d in request.devices]
    loads = costs.of(request.balance) if request.balance != "time" else None
    if loads is None:
        loads, measured = measured_loads(costs, request, profile)
        speeds = tuple(s * m for s, m in zip(speeds, measured))
    try:
        split = partition(loads, len(request.devices),
                          cut_cost=list(costs.cuts), speed=list(speeds),
                          capacity=caps if any(c is not None for c in caps) else None,
                          memory=[u.memory for u in costs.units], use_all=True)
    except PartitionError as exc:
        raise _capacity_error(exc, costs, request) from None
    return AutoChoice(request, split, speeds)


def place_auto(graph: Graph, request: AutoPlacement,
               device_map: Optional[Mapping[str, str]] = None) -> Graph:
    """Choose devices for every unit, then plan transfers (``transfers.assign``)."""
    choice = choose(graph.costs, request, graph.profile)
    devices: list[list[str]] = [[] for _ in graph.nodes]
    for unit, device in zip(graph.costs.units, choice.unit_devices()):
        devices[unit.node].append(device)
    graph = dataclasses.replace(graph, layout=Layout("auto", choice))
    return assign(graph, [tuple(d) for d in devices], dict(device_map or {}))


def measured_loads(costs: Costs, request: AutoPlacement,
                   profile: Optional[Profile]) -> tuple[list[float], list[float]]:
    """Each unit's measured forward + backward ms on the first device's kind,
    and each device's speed relative to it (its kind's total time over the
    first's); MpgenError when the profile is missing, stale, or names no
    kind for a device."""
    if profile is None:  # the front end refuses this first; a graph made by hand
        raise MpgenError(request.pos, "placement.auto.balance: 'time' needs a profile "
                                      "(`mpgen profile SPEC`)")
    why = profile.stale(costs)
    if why is not None:
        raise MpgenError(request.pos, f"placement.auto.balance: 'time': {profile.path} is "
                                      f"stale ({why}); rerun `mpgen profile`")
    kinds = [profile.kind_of(d) for d in request.devices]
    unknown = [d for d, k in zip(request.devices, kinds) if k is None]
    if unknown:
        raise MpgenError(request.pos, (
            f"placement.auto.balance: 'time': {profile.path} measured "
            f"{', '.join(d for d, _ in profile.devices)}, not {unknown[0]}; profile on the "
            "machine that trains, or name measured devices"))
    totals = {k: [f + b for f, b in profile.unit_ms(k)] for k in set(kinds)}
    first = totals[kinds[0]]
    relative = [sum(first) / sum(totals[k]) if sum(totals[k]) else 1.0 for k in kinds]
    return first, relative


def _capacity_error(exc: PartitionError, costs: Costs, request: AutoPlacement) -> MpgenError:
    """``placement: layer 'h.7' (1.2 GiB) does not fit: ...`` at the placement key."""
    unit = costs.units[exc.unit]
    head = f"placement: layer {unit.name!r} ({human_bytes(unit.memory)}) does not fit"
    if exc.room is not None:
        detail = f"the largest {exc.room_kind} is {human_bytes(max(exc.room, 0.0))}"
    else:  # it fits only by leaving a later device without a unit
        detail = ("it fits only where a later device would be left without a layer, and "
                  "every device must get one")
    return MpgenError(request.pos, f"{head}: {detail}")
