"""Per-instance devices -> the transfer plan of ``forward``.

# NOTE: [Transfer plan]
# A value is produced on one device (model inputs: on the caller's device).
# Each device that reads a value gets exactly one copy, made by one
# ``.to(device)`` placed in the section of its first reader; later readers on
# that device reuse the copy. When nothing reads the original after the copy,
# and the value has no other copy, the copy takes over the variable name
# (``h = h.to("cuda:1")``) as hand-written code does; otherwise every copy gets
# a name saying where it lives (``trunk_cuda1``, ``trunk_cuda2``).
#
# NOTE: [Tied parameters across devices]
# A tied parameter (``tie: {weight: wte.weight}``) has one owner: the layer
# it is tied to, on that layer's device; the state dict lists it under both
# names and the optimizer sees it once. A tied layer on another device reads
# a copy moved to its device in forward (a Transfer of ``wte.weight``, made
# in the section of its first reading layer there; every later tied layer on
# that device reads the same copy), so backward sends the gradient of those
# uses back to the one parameter, where it adds to the owner's own. This
# is the single-process form of what pipeline schedules do with first- and
# last-stage embeddings; the transfer plan, the report and the memory costs
# show the move.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from mpgen.compiler.ir import (
    ForwardPlan,
    Graph,
    Node,
    Section,
    Step,
    Transfer,
    ValueRef,
    device_runs,
)
from mpgen.compiler.frontend.namespace import Namespace
from mpgen.compiler.placement.devices import map_device


def assign(graph: Graph, devices: Sequence[tuple[str, ...]],
           device_map: Optional[dict[str, str]] = None) -> Graph:
    """Set per-instance devices (after ``device_map``) and plan transfers."""
    device_map = device_map or {}
    spec_nodes = tuple(dataclasses.replace(n, devices=tuple(ds))
                       for n, ds in zip(graph.nodes, devices))
    spec_plan = plan_transfers(dataclasses.replace(graph, nodes=spec_nodes))
    nodes = tuple(
        dataclasses.replace(n, devices=tuple(map_device(d, device_map) for d in ds))
        for n, ds in zip(graph.nodes, devices)
    )
    graph = dataclasses.replace(graph, nodes=nodes,
                                device_map=tuple(sorted(device_map.items())))
    plan = plan_transfers(graph)
    return dataclasses.replace(graph, plan=plan, spec_plan=spec_plan if device_map else plan)


def plan_transfers(graph: Graph) -> ForwardPlan:
    """Sections of forward, with one transfer per (value, reading device)."""
    ns = Namespace({"self", *(t.var for t in graph.inputs), *(n.var for n in graph.nodes),
                    *(e.var for n in graph.nodes for e in n.elements)})
    refs = {t.name: ValueRef(t.name) for t in graph.inputs} | {n.name: n.value()
                                                               for n in graph.nodes}
    refs |= {e.name: ValueRef(e.name) for n in graph.nodes for e in n.elements}
    home: dict[ValueRef, Optional[str]] = {refs[t.name]: None for t in graph.inputs}
    var: dict[ValueRef, str] = {refs[t.name]: t.var for t in graph.inputs}
    types = {refs[t.name]: t.type for t in graph.inputs}
    # One entry per step: (node, start, stop, device, values read).
    steps: list[tuple[Node, int, int, str, list[ValueRef]]] = []
    for node in graph.nodes:
        reads = [refs[name] for name in node.inputs]
        for start, stop, device in device_runs(node.devices):
            steps.append((node, start, stop, device, reads))
            for e in node.elements:  # the named elements of a returned tuple
                home[refs[e.name]], var[refs[e.name]], types[refs[e.name]] = device, e.var, e.type
            # A later run of a repeated layer reads this run's output.
            out = node.value(stop - 1)
            reads = [out, *reads[1:]]
            home[out] = device
            var[out] = node.var
            types[out] = node.out
    # Which (value, device) pairs are read, and where the last read of each
    # value's original (on its home device, or as an output) happens.
    last_home_read: dict[ValueRef, int] = {}
    for i, (node, _, _, device, reads) in enumerate(steps):
        for value in reads:
            if home[value] == device:
                last_home_read[value] = i
    for name in graph.outputs:  # a split block instance's: the value it became
        last_home_read[refs[graph.value_name(name)]] = len(steps)
    copies: dict[tuple[ValueRef, str], str] = {}
    pending: dict[ValueRef, list[str]] = {}  # value -> devices it still has to reach
    for node, _, _, device, reads in steps:
        for value in reads:
            if home[value] != device and device not in pending.setdefault(value, []):
                pending[value].append(device)
    n_copies = {value: len(devices) for value, devices in pending.items()}
    # (tied parameter, reading device) -> its copy there: one per forward,
    # whatever the number of layers that read it on that device.
    tied_copies: dict[tuple[str, str], str] = {}
    sections: list[Section] = []
    loop_names: dict[str, str] = {}
    for i, (node, start, stop, device, reads) in enumerate(steps):
        transfers = []
        read_vars = []
        for value in reads:
            if home[value] == device:
                read_vars.append(var[value])
                continue
            if (value, device) not in copies:
                pending[value].remove(device)
                reuse = n_copies[value] == 1 and last_home_read.get(value, -1) < i
                dst_var = var[value] if reuse else ns.fresh(f"{var[value]}_{_tag(device)}")
                transfers.append(Transfer(value, home[value], device, var[value], dst_var,
                                          types[value]))
                copies[(value, device)] = dst_var
            read_vars.append(copies[(value, device)])
        tied = []
        for tie in node.ties:  # NOTE: [Tied parameters across devices]
            owner = graph.node(tie.owner).devices[0]
            if owner != device:
                if (tie.source, device) not in tied_copies:
                    copy = ns.fresh(f"{tie.owner}_{tie.owner_param}".replace(".", "_"))
                    transfers.append(Transfer(ValueRef(tie.source), owner, device,
                                              graph.attribute_code(tie.source), copy,
                                              tie.type))
                    tied_copies[(tie.source, device)] = copy
                tied.append((tie.param, tied_copies[(tie.source, device)]))
        loop_var = None
        if node.repeat is not None and stop - start > 1:
            kind = "block" if node.op.kind.value == "block" else "layer"
            loop_var = loop_names.get(kind) or loop_names.setdefault(kind, ns.fresh(kind))
        step = Step(node.name, device, tuple(read_vars), node.var, start, stop, loop_var,
                    tuple(tied))
        if sections and sections[-1].device == device:
            last = sections[-1]
            sections[-1] = Section(device, last.transfers + tuple(transfers), last.steps + (step,))
        else:
            sections.append(Section(device, tuple(transfers), (step,)))
    returns = tuple(var[refs[graph.value_name(o)]] for o in graph.outputs)
    return ForwardPlan(tuple(sections), returns)


def _tag(device: str) -> str:
    return device.replace(":", "")
