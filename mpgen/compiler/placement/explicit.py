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
from typing import Optional

from mpgen.compiler.ir import (
    ExplicitPlacement,
    Graph,
    Layout,
    OpKind,
    PlacementEntry,
    UnitRange,
    UnitRef,
    unit_labels,
)
from mpgen.compiler.placement.devices import DEFAULT_DEVICE
from mpgen.compiler.placement.transfers import assign
from mpgen.errors import Collector, did_you_mean


def place_explicit(graph: Graph, request: ExplicitPlacement,
                   device_map: Optional[dict[str, str]] = None) -> Graph:
    """Resolve the explicit form (or the default) into per-instance devices.

    Inside a split block instance (NOTE [Placement inside a block instance]),
    a layer no key names is on the instance's device: the device its own key
    gives, or else the one the bookmarks give where it stands (an inner
    instance: its outer one's); the bookmarks go on from there after it."""
    errors = Collector()
    named: dict[UnitRef, PlacementEntry] = {}
    splits = {s.path: s for s in graph.splits}
    placed_splits: dict[str, PlacementEntry] = {}
    for entry in request.entries:
        if entry.key in splits:
            placed_splits[entry.key] = entry
            continue
        units = _units_of(graph, entry, errors)
        again = [u for u in units if u in named]
        if again:
            others = ", ".join(dict.fromkeys(repr(named[u].key) for u in again))
            errors.add(entry.pos, f"placement: {entry.key!r} places "
                       f"{', '.join(unit_labels(again))} again (already placed by {others})")
        for unit in units:
            named.setdefault(unit, entry)
    errors.raise_if_any()
    graph = dataclasses.replace(graph,
                                layout=Layout("explicit" if request.entries else "default"))
    inside: dict[str, list[str]] = {}  # node -> the splits holding it, outer first
    for split in graph.splits:
        for name in split.nodes:
            inside.setdefault(name, []).append(split.path)
    first = [placed_splits[p].device for n in graph.nodes for p in inside.get(n.name, ())[:1]
             if p in placed_splits]
    current = next((named[u].device for u in graph.units if u in named),
                   first[0] if first else DEFAULT_DEVICE)
    devices = []
    split_device: dict[str, str] = {}
    for node in graph.nodes:
        paths = inside.get(node.name, [])
        for outer, path in zip([None, *paths], paths):
            if path not in split_device:
                entry = placed_splits.get(path)
                split_device[path] = (entry.device if entry else
                                      split_device[outer] if outer else current)
                if outer is None:
                    current = split_device[path]
        per_instance = []
        for unit in node.units:
            if unit in named and not paths:
                current = named[unit].device
            per_instance.append(named[unit].device if unit in named else
                                split_device[paths[-1]] if paths else current)
        devices.append(tuple(per_instance))
    return assign(graph, devices, device_map)


def _units_of(graph: Graph, entry: PlacementEntry, errors: Collector) -> list[UnitRef]:
    key, pos = entry.key, entry.pos
    names = [n.name for n in graph.nodes]
    if key in names:  # a layer of a split nn.Sequential block (features.3, trunk.block1-0)
        return list(graph.node(key).units)
    label = UnitRange.parse(key)
    sequential = {s.path for s in graph.splits
                  if next(b for b in graph.blocks if b.name == s.block).sequential}
    if label is not None and label.first is not None and label.node in sequential:
        errors.add(pos, f"placement: {key!r}: {label.node!r} is a block instance whose layers "
                   f"are named by position, not a repeated layer: name each layer "
                   f"('{label.node}.{label.first}'), or place the layers between bookmarks")
        return []
    items = ([n for n in names if n.rpartition(".")[0] == label.node
              and n.rpartition(".")[2].isdigit()]
             if label is not None and label.first is not None and label.node not in names
             else [])
    if items:  # a range of a ModuleList's items (NOTE [Items of a ModuleList])
        if label.first > label.last or label.last >= len(items):
            errors.add(pos, f"placement: {key!r}: the nn.ModuleList {label.node!r} has items "
                       f"0-{len(items) - 1}; a range goes from the lower to the higher, e.g. "
                       f"'{label.node}.0-{len(items) - 1}'")
            return []
        return [unit for k in range(label.first, label.last + 1)
                for unit in graph.node(f"{label.node}.{k}").units]
    if label is None or label.node not in names:
        base = label.node if label else key
        errors.add(pos, f"placement: {key!r} matches no layer{did_you_mean(base, names)}")
        return []
    node = graph.node(label.node)
    if label.first is None:
        return list(node.units)
    if node.repeat is None:
        inner = next((b.nodes[0].name for b in graph.blocks
                      if node.op.kind is OpKind.BLOCK and b.name == node.op.target), None)
        hint = (f"; a layer inside block instance {node.name!r} is named by its path, like "
                f"'{node.name}.{inner}'" if inner else "")
        errors.add(pos, f"placement: {key!r}: layer {node.name!r} is not repeated, so it has "
                   f"no instances to index{hint}")
        return []
    if label.first > label.last:
        errors.add(pos, f"placement: {key!r}: a range goes from the lower to the higher "
                   f"instance, e.g. '{UnitRange(node.name, label.last, label.first)}'")
        return []
    if label.last >= node.repeat:
        errors.add(pos, f"placement: {key!r}: layer {node.name!r} has instances "
                   f"0-{node.repeat - 1}")
        return []
    return [node.unit(k) for k in range(label.first, label.last + 1)]
