"""Devices for every layer instance, and the transfer plan of ``forward``.

# NOTE: [Explicit placement as bookmarks]
# The placement mapping's keys name layers, instances (``h.3``) or instance
# ranges (``h.0-5``). Walking the layer instances in ``layers`` order, a named
# instance takes its device and every instance after it keeps that device
# until the next named one; instances before the first named one take the
# device of the first named one. No placement means everything on cuda:0.
#
# NOTE: [Transfer plan]
# A value is produced on one device (model inputs: on the caller's device).
# Each device that reads a value gets exactly one copy, made by one
# ``.to(device)`` placed in the section of its first reader; later readers on
# that device reuse the copy. When nothing reads the original after the copy,
# and the value has no other copy, the copy takes over the variable name
# (``h = h.to("cuda:1")``) as hand-written code does; otherwise every copy gets
# a name saying where it lives (``trunk_cuda1``, ``trunk_cuda2``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from mpgen.compiler.ir import (
    ForwardPlan,
    Graph,
    Layout,
    Node,
    Section,
    Step,
    Transfer,
    device_runs,
)
from mpgen.compiler.namespace import Namespace
from mpgen.errors import Collector, Position, did_you_mean
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import PlacementSpec, check_device

DEFAULT_DEVICE = "cuda:0"
_KEY = re.compile(r"^(?P<name>[^.]+)(?:\.(?P<start>[0-9]+)(?:-(?P<stop>[0-9]+))?)?$")


def parse_device_map(text: str) -> dict[str, str]:
    """``cuda:1=cuda:0,cuda:2=cpu`` -> mapping; ``cpu`` alone maps everything.

    The key ``*`` stands for every device. Raises ValueError on bad syntax.
    """
    result: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        src, sep, dst = item.partition("=")
        if not sep:
            src, dst = "*", src
        for device in ([src] if src != "*" else []) + [dst]:
            try:
                check_device(device.strip())
            except Exception as exc:
                raise ValueError(f"--device-map: {exc}") from None
        result[src.strip()] = dst.strip()
    if not result:
        raise ValueError("--device-map: empty mapping")
    return result


def map_device(device: str, device_map: dict[str, str]) -> str:
    return device_map.get(device, device_map.get("*", device))


def place_explicit(graph: Graph, spec: Optional[PlacementSpec], source: SourceMap,
                   device_map: Optional[dict[str, str]] = None) -> Graph:
    """Resolve the explicit form (or the default) into per-instance devices."""
    explicit = dict(spec.explicit) if spec else {}
    errors = Collector()
    nodes = graph.nodes
    index = {n.name: i for i, n in enumerate(nodes)}
    # unit (node index, instance) -> (device, key position)
    named: dict[tuple[int, int], tuple[str, Position, str]] = {}
    for key, device in explicit.items():
        pos = source.key(("placement", key))
        units = _units_of(key, nodes, index, pos, errors)
        again = [u for u in units if u in named]
        if again:
            others = ", ".join(dict.fromkeys(repr(named[u][2]) for u in again))
            errors.add(pos, f"placement: {key!r} places {_units_label(nodes, again)} again "
                       f"(already placed by {others})")
        for unit in units:
            named.setdefault(unit, (device, pos, key))
    errors.raise_if_any()
    graph = dataclasses.replace(graph, layout=Layout("explicit" if explicit else "default"))
    order = [(i, k) for i, n in enumerate(nodes) for k in range(n.instances)]
    first = next((named[u][0] for u in order if u in named), DEFAULT_DEVICE)
    current = first
    devices: dict[int, list[str]] = {i: [] for i in range(len(nodes))}
    for unit in order:
        if unit in named:
            current = named[unit][0]
        devices[unit[0]].append(current)
    return assign(graph, [tuple(devices[i]) for i in range(len(nodes))], device_map)


def assign(graph: Graph, devices: Sequence[tuple[str, ...]],
           device_map: Optional[dict[str, str]] = None) -> Graph:
    """Set per-instance devices (after ``device_map``) and plan transfers."""
    device_map = device_map or {}
    nodes = tuple(
        dataclasses.replace(n, devices=tuple(map_device(d, device_map) for d in ds))
        for n, ds in zip(graph.nodes, devices)
    )
    graph = dataclasses.replace(graph, nodes=nodes,
                                device_map=tuple(sorted(device_map.items())))
    return dataclasses.replace(graph, plan=plan_transfers(graph))


def _units_of(key, nodes: Sequence[Node], index, pos, errors) -> list[tuple[int, int]]:
    match = _KEY.match(key)
    names = [n.name for n in nodes]
    if not match or match.group("name") not in index:
        base = match.group("name") if match else key
        where = "" if not match or base not in [n.name for n in nodes] else ""
        errors.add(pos, f"placement: {key!r} matches no layer{did_you_mean(base, names)}{where}")
        return []
    node_i = index[match.group("name")]
    node = nodes[node_i]
    if match.group("start") is None:
        return [(node_i, k) for k in range(node.instances)]
    if node.repeat is None:
        errors.add(pos, f"placement: {key!r}: layer {node.name!r} is not repeated, so it has "
                   "no instances to index (a block instance is placed as a whole)")
        return []
    start = int(match.group("start"))
    stop = int(match.group("stop")) if match.group("stop") is not None else start
    if start > stop:
        errors.add(pos, f"placement: {key!r}: a range goes from the lower to the higher "
                   f"instance, e.g. '{node.name}.{stop}-{start}'")
        return []
    if stop >= node.repeat:
        errors.add(pos, f"placement: {key!r}: layer {node.name!r} has instances "
                   f"0-{node.repeat - 1}")
        return []
    return [(node_i, k) for k in range(start, stop + 1)]


def _units_label(nodes: Sequence[Node], units: Sequence[tuple[int, int]]) -> str:
    """``h.1-2``, ``h.4``, ``embed``: units of one node, runs compressed."""
    node = nodes[units[0][0]]
    if not node.repeat:
        return node.name
    ks = sorted(k for _, k in units)
    runs: list[list[int]] = []
    for k in ks:
        if runs and runs[-1][1] == k - 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return ", ".join(f"{node.name}.{a}" if a == b else f"{node.name}.{a}-{b}" for a, b in runs)


def plan_transfers(graph: Graph) -> ForwardPlan:
    """Sections of forward, with one transfer per (value, reading device)."""
    ns = Namespace({"self", *(t.var for t in graph.inputs), *(n.var for n in graph.nodes)})
    home: dict[str, Optional[str]] = {t.name: None for t in graph.inputs}
    var: dict[str, str] = {t.name: t.var for t in graph.inputs}
    types = {t.name: t.type for t in graph.inputs}
    # One entry per step: (node, start, stop, device, values read).
    steps: list[tuple[Node, int, int, str, list[str]]] = []
    for node in graph.nodes:
        runs = device_runs(node.devices)
        for r, (start, stop, device) in enumerate(runs):
            reads = list(node.inputs) if r == 0 else [_link(node, r - 1), *node.inputs[1:]]
            steps.append((node, start, stop, device, reads))
            out = node.name if r == len(runs) - 1 else _link(node, r)
            home[out] = device
            var[out] = node.var
            types[out] = node.out
    # Which (value, device) pairs are read, and where the last read of each
    # value's original (on its home device, or as an output) happens.
    last_home_read: dict[str, int] = {}
    for i, (node, _, _, device, reads) in enumerate(steps):
        for value in reads:
            if home[value] == device:
                last_home_read[value] = i
    for value in graph.outputs:
        last_home_read[value] = len(steps)
    copies: dict[tuple[str, str], str] = {}
    pending: dict[str, list[str]] = {}  # value -> devices it still has to reach
    for node, _, _, device, reads in steps:
        for value in reads:
            if home[value] != device and device not in pending.setdefault(value, []):
                pending[value].append(device)
    n_copies = {value: len(devices) for value, devices in pending.items()}
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
        loop_var = None
        if node.repeat is not None and stop - start > 1:
            kind = "block" if node.op.kind.value == "block" else "layer"
            loop_var = loop_names.get(kind) or loop_names.setdefault(kind, ns.fresh(kind))
        step = Step(node.name, device, tuple(read_vars), node.var, start, stop, loop_var)
        if sections and sections[-1].device == device:
            last = sections[-1]
            sections[-1] = Section(device, last.transfers + tuple(transfers), last.steps + (step,))
        else:
            sections.append(Section(device, tuple(transfers), (step,)))
    returns = tuple(var[o] for o in graph.outputs)
    return ForwardPlan(tuple(sections), returns)


def _link(node: Node, run: int) -> str:
    """The value flowing between two device runs of a repeated layer."""
    return f"{node.name}#{run}"


def _tag(device: str) -> str:
    return device.replace(":", "")
