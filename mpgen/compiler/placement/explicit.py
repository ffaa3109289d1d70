"""The explicit placement form (or none): a device for every layer instance.

# NOTE: [Explicit placement as bookmarks]
# The placement mapping's keys name layers, instances (``h.3``) or instance
# ranges (``h.0-5``). Walking the layer instances in ``layers`` order, a named
# instance takes its device and every instance after it keeps that device
# until the next named one; instances before the first named one take the
# device of the first named one. No placement means everything on cuda:0.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from mpgen.compiler.ir import Graph, Layout, Node
from mpgen.compiler.placement.devices import DEFAULT_DEVICE
from mpgen.compiler.placement.transfers import assign
from mpgen.errors import Collector, Position, did_you_mean
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import PlacementSpec


_KEY = re.compile(r"^(?P<name>[^.]+)(?:\.(?P<start>[0-9]+)(?:-(?P<stop>[0-9]+))?)?$")


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


