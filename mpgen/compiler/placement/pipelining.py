"""The checks of ``pipeline:`` that need the analysed and placed graph, and
which units are checkpointed.

A micro-batched forward concatenates each output's micro-batches along its
batch dim, so every output needs one (known after ``analysis.shapes``); a
device in ``pipeline.checkpoint`` must be one the spec's layout uses, and
the layout must suit the schedule (``analysis.schedule.layout_ranks``: a
looped schedule needs devices visited in a repeating order at least twice,
a V-shaped one an even number of stages). A unit is checkpointed when its
layer says ``checkpoint: true`` or it is placed on such a device (the
spec's device, before ``--device-map``; a function layer there is not: it
has nothing to recompute). The costs of the units checkpointed by device
follow (NOTE [Cost formulas]).
"""

from __future__ import annotations

import dataclasses

from mpgen.compiler.analysis.costs import checkpointed_cost
from mpgen.compiler.analysis.schedule import layout_ranks
from mpgen.compiler.ir import Graph, UnitRef
from mpgen.errors import Collector


def check_pipeline(graph: Graph) -> Graph:
    """Raise MpgenError for a ``pipeline:`` the placed graph cannot run;
    return the graph with the costs of every checkpointed unit."""
    pipeline = graph.pipeline
    if pipeline is None:
        return graph
    errors = Collector()
    flat = [f"{name} {graph.type_of(name)}" for name in graph.outputs
            if graph.type_of(name) is None or graph.type_of(name).batch_dim is None]
    if flat:
        errors.add(pipeline.pos, "pipeline: the forward concatenates each output's "
                   "micro-batches along its batch dim, but " + ", ".join(flat)
                   + (" has" if len(flat) == 1 else " have") + " no 'batch' dim; return "
                   "outputs that keep the batch dim, or drop pipeline:")
    used = [s.device for s in graph.spec_plan.sections]
    try:
        layout_ranks(pipeline.schedule, used)
    except ValueError as problem:
        errors.add(pipeline.schedule_pos or pipeline.pos, f"pipeline.schedule: {problem}; "
                   "use gpipe or 1f1b, or a layout that suits it")
    for device, pos in zip(pipeline.checkpoint, pipeline.checkpoint_pos):
        if device not in used:
            errors.add(pos, f"pipeline.checkpoint: no layer is placed on {device!r} (the "
                       f"layout uses {', '.join(dict.fromkeys(used))})")
    errors.raise_if_any()
    units = checkpointed_units(graph)
    costs = graph.costs
    if costs is None or not pipeline.checkpoint:
        return graph
    changed = tuple(checkpointed_cost(u) if u.unit in units and not u.checkpointed else u
                    for u in costs.units)
    return dataclasses.replace(graph, costs=dataclasses.replace(costs, units=changed))


def checkpointed_units(graph: Graph) -> frozenset[UnitRef]:
    """Every unit forward recomputes in backward: the instances of layers
    with ``checkpoint: true`` and the module layers on ``pipeline.checkpoint``
    devices."""
    units = {u for n in graph.nodes if n.checkpoint for u in n.units}
    devices = graph.pipeline.checkpoint if graph.pipeline else ()
    if devices:
        nodes = {n.name: n for n in graph.nodes}
        for section in graph.spec_plan.sections:
            if section.device not in devices:
                continue
            for step in section.steps:
                node = nodes[step.node]
                if node.op.has_module and node.op.runs:
                    units.update(node.unit(k) for k in range(step.start, step.stop))
    return frozenset(units)
