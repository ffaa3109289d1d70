"""``mpgen show``: every layer's op, device, output shape and parameters,
and every device's memory plan (NOTE [Memory plan] in placement/memory.py)."""

from __future__ import annotations

import json
from typing import Any

from mpgen.compiler.analysis.costs import human_bytes
from mpgen.compiler.ir import (MEMORY_PARTS, DeviceMemory, Graph, Node, TensorType,
                               device_runs, unit_labels)

#: The ways of running the model the plan covers, in the order shown.
MEMORY_MODES = ("train", "pipeline", "inference")


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
    if graph.memory is not None:
        data["memory"] = memory_json(graph)
    return json.dumps(data, indent=2)


def _device_json(d: DeviceMemory) -> dict[str, Any]:
    return {"weights": d.weights, "gradients": d.gradients, "optimizer": d.optimizer,
            "activations": d.activations, "peak": d.peak, "phase": d.phase,
            "at_peak": dict(d.at_peak), "largest": dict(d.largest)}


def memory_json(graph: Graph) -> dict[str, Any]:
    """The memory plan in bytes: ``train``, ``pipeline`` and ``inference``,
    each device -> its parts, peak, the phase of the peak and what is alive then."""
    plan = graph.memory
    data: dict[str, Any] = {"batch": plan.batch, "schedule": plan.schedule,
                            "microbatches": plan.microbatches, "dp": plan.dp}
    for mode in MEMORY_MODES:
        data[mode] = {d.device: _device_json(d) for d in getattr(plan, mode)}
    return data


def memory_table(graph: Graph) -> list[str]:
    """Per mode and device: each part at its largest, and the peak."""
    plan = graph.memory
    if plan is None:
        return []
    head = ("memory", "device", "weights", "gradients", "optimizer", "activations", "peak",
            "at")
    table = [head]
    for mode in MEMORY_MODES:
        for d in getattr(plan, mode):
            table.append((mode, d.device, *(human_bytes(n) for n in (
                d.weights, d.gradients, d.optimizer, d.activations, d.peak)), d.phase))
    if len(table) == 1:
        return []
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]

    def line(r):
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        cells += [r[i].rjust(widths[i]) for i in range(2, 7)] + [r[7]]
        return "  ".join(cells).rstrip()

    note = (f"memory at batch {plan.batch}; pipeline: {plan.schedule}, "
            f"{plan.microbatches} micro-batch{'es' if plan.microbatches != 1 else ''}, "
            f"{plan.dp} replica"
            + ("s" if plan.dp != 1 else ""))
    return ["", note, line(head), line(tuple("-" * w for w in widths)),
            *(line(r) for r in table[1:])]


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
    dw = max(len(d) for d in [*totals, "total", *["trainable"] * bool(graph.frozen_params)])
    for device, n in totals.items():
        share = n / graph.total_params * 100 if graph.total_params else 0.0
        out.append(f"{device.ljust(dw)}  {n:>14,}  {share:5.1f}%")
    out.append(f"{'total'.ljust(dw)}  {graph.total_params:>14,}")
    if graph.frozen_params:  # requires_grad: false
        out.append(f"{'trainable'.ljust(dw)}  {graph.trainable_params:>14,}")
    transfers = graph.plan.transfers
    out.append("")
    out.append(f"transfers in forward: {len(transfers)}")
    for t in transfers:
        out.append(f"  {t.value.name} {t.type}: {t.src or 'input'} -> {t.dst}")
    out += memory_table(graph)
    return "\n".join(out)
