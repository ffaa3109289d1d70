"""``mpgen show``: every layer's op, device, output shape and parameters."""

from __future__ import annotations

import json
from typing import Any

from mpgen.compiler.ir import Graph, Node, TensorType, device_runs, unit_labels


def _runs(node: Node) -> list[tuple[str, str, int]]:
    """(label, device, instances) per device run of a node."""
    return [(unit_labels([node.unit(k) for k in range(a, b)])[0], device, b - a)
            for a, b, device in device_runs(node.devices)]


def _shape(t: TensorType) -> list:
    return [d if isinstance(d, int) else str(d) for d in t.shape]


def rows(graph: Graph) -> list[dict[str, Any]]:
    """One row per layer, or per device run of a repeated layer."""
    result = []
    for node in graph.nodes:
        for label, device, n in _runs(node):
            row = {
                "name": label,
                "op": node.op.spelled,
                "device": device,
                "instances": n,
                "shape": _shape(node.out) if node.out else None,
                "dtype": node.out.dtype if node.out else None,
                "params": node.params * n,
            }
            if node.pattern:  # a returned tuple: the shape of each named element
                row["elements"] = {e.name: {"shape": _shape(e.type), "dtype": e.type.dtype}
                                   for e in node.elements if e.type is not None}
            result.append(row)
    return result


def to_json(graph: Graph) -> str:
    data = {
        "name": graph.name,
        "spec": graph.spec_path,
        "inputs": {t.name: {"shape": _shape(t.type), "dtype": t.type.dtype}
                   for t in graph.inputs},
        "outputs": list(graph.outputs),
        "layers": rows(graph),
        "devices": graph.params_by_device(),
        "total_params": graph.total_params,
        "transfers": [
            {"tensor": t.value.name, "from": t.src, "to": t.dst,
             "shape": _shape(t.type), "dtype": t.type.dtype}
            for t in graph.plan.transfers
        ],
    }
    return json.dumps(data, indent=2)


def to_table(graph: Graph) -> str:
    table = [("layer", "op", "device", "output", "params")]
    for row in rows(graph):
        shape = "[" + ", ".join(str(d) for d in row["shape"]) + "]" if row["shape"] else ""
        if "elements" in row:
            shape = ", ".join(f"{name} [{', '.join(str(d) for d in e['shape'])}]"
                              for name, e in row["elements"].items())
        table.append((row["name"], row["op"], row["device"], shape, f"{row['params']:,}"))
    widths = [max(len(r[i]) for r in table) for i in range(5)]

    def line(r):
        cells = [r[i].ljust(widths[i]) for i in range(4)] + [r[4].rjust(widths[4])]
        return "  ".join(cells).rstrip()

    out = [line(table[0]), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in table[1:]]
    out.append("")
    totals = graph.params_by_device()
    dw = max(len(d) for d in [*totals, "total"])
    for device, n in totals.items():
        share = n / graph.total_params * 100 if graph.total_params else 0.0
        out.append(f"{device.ljust(dw)}  {n:>14,}  {share:5.1f}%")
    out.append(f"{'total'.ljust(dw)}  {graph.total_params:>14,}")
    transfers = graph.plan.transfers
    out.append("")
    out.append(f"transfers in forward: {len(transfers)}")
    for t in transfers:
        out.append(f"  {t.value.name} {t.type}: {t.src or 'input'} -> {t.dst}")
    return "\n".join(out)
