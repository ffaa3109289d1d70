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
from dataclasses import dataclass
from typing import Mapping, Optional

from mpgen.compiler.placement.transfers import assign
from mpgen.compiler.analysis.costs import Costs, human_bytes
from mpgen.compiler.ir import Graph, Layout
from mpgen.compiler.placement.partition import Partition, PartitionError, partition
from mpgen.errors import Collector, MpgenError
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import AutoPlacementSpec

#: The word for one unit of each balanced quantity, for messages and reports.
BALANCE_UNITS = {"params": "parameters", "memory": "bytes", "flops": "FLOPs"}


@dataclass(frozen=True)
class AutoChoice:
    """The chosen split and what it was chosen from."""

    auto: AutoPlacementSpec
    costs: Costs
    split: Partition
    speeds: tuple[float, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.auto.devices)

    def unit_devices(self) -> list[str]:
        """The device of every unit, in unit order (before ``--device-map``)."""
        result = []
        for device, stage in zip(self.auto.devices, self.split.stages):
            result.extend(device for _ in stage)
        return result

    @property
    def bottleneck_device(self) -> str:
        """The first device whose load is the bottleneck."""
        return self.auto.devices[self.split.loads.index(self.split.bottleneck)]


def choose(graph: Graph, auto: AutoPlacementSpec, source: SourceMap) -> AutoChoice:
    """The optimal split of the units, by the costs in ``graph.costs``;
    raises MpgenError."""
    _check_device_keys(auto, source)
    costs: Costs = graph.costs
    speeds = tuple(float(auto.speed.get(d, 1.0)) for d in auto.devices)
    capacity = [auto.capacity.get(d) for d in auto.devices]
    memory = [u.memory for u in costs.units]
    try:
        split = partition(costs.of(auto.balance), len(auto.devices), cut_cost=list(costs.cuts),
                          speed=list(speeds),
                          capacity=capacity if any(c is not None for c in capacity) else None,
                          memory=memory, use_all=True)
    except PartitionError as exc:
        raise _capacity_error(exc, costs, source) from None
    return AutoChoice(auto, costs, split, speeds)


def place_auto(graph: Graph, auto: AutoPlacementSpec, source: SourceMap,
               device_map: Optional[Mapping[str, str]] = None) -> Graph:
    """Choose devices for every unit, then plan transfers (``transfers.assign``)."""
    choice = choose(graph, auto, source)
    per_unit = choice.unit_devices()
    devices: list[list[str]] = [[] for _ in graph.nodes]
    for unit, device in zip(choice.costs.units, per_unit):
        devices[unit.node].append(device)
    graph = dataclasses.replace(graph, layout=Layout("auto", choice))
    return assign(graph, [tuple(d) for d in devices], dict(device_map or {}))


def _check_device_keys(auto: AutoPlacementSpec, source: SourceMap) -> None:
    errors = Collector()
    for field in ("capacity", "speed"):
        for device in getattr(auto, field):
            if device not in auto.devices:
                errors.add(source.key(("placement", "auto", field, device)),
                           f"placement.auto.{field}: {device!r} is not one of the devices "
                           f"({', '.join(auto.devices)})")
    errors.raise_if_any()


def _capacity_error(exc: PartitionError, costs: Costs, source: SourceMap) -> MpgenError:
    """``placement: layer 'h.7' (1.2 GiB) does not fit: ...`` at the placement key."""
    unit = costs.units[exc.unit]
    head = f"placement: layer {unit.name!r} ({human_bytes(unit.memory)}) does not fit"
    if exc.room is not None:
        detail = f"the largest {exc.room_kind} is {human_bytes(max(exc.room, 0.0))}"
    else:  # it fits only by leaving a later device without a unit
        detail = ("it fits only where a later device would be left without a layer, and "
                  "every device must get one")
    return MpgenError(source.key(("placement",)), f"{head}: {detail}")
