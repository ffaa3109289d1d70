"""``placement: {auto: ...}``: the compiler chooses the layout.

# NOTE: [Automatic placement]
# The units (a layer, one instance of a repeated layer, one block instance;
# never split) keep their ``layers`` order and are cut into contiguous stages,
# stage k on ``devices[k]``. Each unit is costed by ``compiler.costs`` at the
# training sizes; ``balance`` picks the quantity (params, memory or flops),
# and a device's load is the sum over its stage divided by its ``speed``
# (default 1). ``compiler.partition`` returns the exact optimum of: smallest
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
from mpgen.compiler.ir import AutoChoice, AutoPlacement, Costs, Graph, Layout
from mpgen.compiler.placement.partition import PartitionError, partition
from mpgen.compiler.placement.transfers import assign
from mpgen.errors import MpgenError

#: The word for one unit of each balanced quantity, for messages and reports.
BALANCE_UNITS = {"params": "parameters", "memory": "bytes", "flops": "FLOPs"}


def choose(costs: Costs, request: AutoPlacement) -> AutoChoice:
    """The optimal split of the units by ``costs``; raises MpgenError."""
    speed, capacity = dict(request.speed), dict(request.capacity)
    speeds = tuple(float(speed.get(d, 1.0)) for d in request.devices)
    caps = [capacity.get(d) for d in request.devices]
    try:
        split = partition(costs.of(request.balance), len(request.devices),
                          cut_cost=list(costs.cuts), speed=list(speeds),
                          capacity=caps if any(c is not None for c in caps) else None,
                          memory=[u.memory for u in costs.units], use_all=True)
    except PartitionError as exc:
        raise _capacity_error(exc, costs, request) from None
    return AutoChoice(request, split, speeds)


def place_auto(graph: Graph, request: AutoPlacement,
               device_map: Optional[Mapping[str, str]] = None) -> Graph:
    """Choose devices for every unit, then plan transfers (``transfers.assign``)."""
    choice = choose(graph.costs, request)
    devices: list[list[str]] = [[] for _ in graph.nodes]
    for unit, device in zip(graph.costs.units, choice.unit_devices()):
        devices[unit.node].append(device)
    graph = dataclasses.replace(graph, layout=Layout("auto", choice))
    return assign(graph, [tuple(d) for d in devices], dict(device_map or {}))


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
