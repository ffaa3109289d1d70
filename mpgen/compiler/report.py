"""The placement report ``<stem>.placement.md``, generated with every build.

It says how the layout was chosen, what each device holds (layers,
parameters, estimated training memory and FLOPs at the training sizes), which
tensors move between devices in forward, and draws the layer graph as a
Mermaid flowchart coloured by device (GitHub renders it).

:func:`report_context` computes every string; ``placement.md.jinja`` only
loops. Everything that comes from the spec goes through :func:`md_code`,
:func:`md_text` or :func:`mermaid_text`, so no spec string is pasted raw into
Markdown or Mermaid. The output is deterministic: no timestamps, no absolute
paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mpgen.compiler.costs import Costs, human_bytes, unit_labels
from mpgen.compiler.ir import Graph, Transfer
from mpgen.compiler.placement import map_device

#: Fill and stroke colours of the device classes in the Mermaid graph, in order.
PALETTE = (
    ("blue", "#dbeafe", "#1d4ed8"),
    ("green", "#dcfce7", "#15803d"),
    ("amber", "#fef3c7", "#b45309"),
    ("pink", "#fce7f3", "#be185d"),
    ("violet", "#ede9fe", "#6d28d9"),
    ("cyan", "#cffafe", "#0e7490"),
    ("red", "#fee2e2", "#b91c1c"),
    ("grey", "#e5e7eb", "#374151"),
)


# -- escaping -----------------------------------------------------------------

def md_code(text: str) -> str:
    """``text`` as an inline code span, safe inside a Markdown table cell."""
    text = str(text).replace("\n", " ").replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")


def md_text(text: str) -> str:
    """Plain Markdown text: punctuation backslash-escaped, HTML characters as entities."""
    text = str(text).replace("\n", " ")
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def mermaid_text(text: str) -> str:
    """A Mermaid label: anything but letters, digits and ``_.:,- `` as ``#code;``."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.:,- ") else f"#{ord(c)};"
                   for c in str(text))


def html_comment(text: str) -> str:
    return "<!-- " + str(text).replace("--", "- -").replace(">", "&gt;") + " -->"


# -- numbers ------------------------------------------------------------------

def count(n: float) -> str:
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"


def flops_text(n: int) -> str:
    if n == 0:
        return "0"
    for scale, suffix in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} FLOP"


# -- the context --------------------------------------------------------------

@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]

    @property
    def rule(self) -> list[str]:
        return ["---"] * len(self.columns)


@dataclass
class ReportContext:
    header: list[str]
    title: str
    how: list[str]  # paragraphs
    estimates: str
    devices: Table
    transfers: Table
    transfer_notes: list[str]
    legend: list[str]
    mermaid: list[str]
    notes: list[str] = field(default_factory=list)


def transfer_name(graph: Graph, transfer: Transfer) -> str:
    """The tensor a transfer moves, by layer instance: ``h.5``, ``embed``, ``tokens``."""
    value = transfer.value
    name, sep, run = value.partition("#")
    node = next((n for n in graph.nodes if n.name == name), None)
    if node is None or not node.repeat:
        return name
    if not sep:
        return f"{name}.{node.repeat - 1}"
    return f"{name}.{_runs(node.devices)[int(run)][1] - 1}"


def _runs(devices) -> list[tuple[int, int, str]]:
    runs: list[tuple[int, int, str]] = []
    for k, device in enumerate(devices):
        if runs and runs[-1][2] == device:
            runs[-1] = (runs[-1][0], k + 1, device)
        else:
            runs.append((k, k + 1, device))
    return runs


def report_context(graph: Graph) -> ReportContext:
    """Every string of the report, from the compiled graph."""
    layout = graph.layout
    choice = layout.choice if layout.method == "auto" else None
    auto = choice.auto if choice is not None else None
    device_map = dict(graph.device_map)
    costs: Costs = graph.costs

    devices = list(graph.devices)
    capacity: dict[str, int] = {}
    if auto is not None:
        for device in auto.devices:
            mapped = map_device(device, device_map)
            if mapped not in devices:
                devices.append(mapped)
        mapped_caps: dict[str, list] = {}
        for device in auto.devices:
            mapped_caps.setdefault(map_device(device, device_map), []).append(
                auto.capacity.get(device))
        capacity = {d: sum(c) for d, c in mapped_caps.items() if all(x is not None for x in c)}

    how = _how(layout.method, choice, device_map)
    header = [
        html_comment(f"Generated by mpgen from {graph.spec_path}. DO NOT EDIT."),
        html_comment(f"spec sha256: {graph.spec_hash}"),
    ]
    return ReportContext(
        header=header,
        title=f"Placement of {md_text(graph.name)}",
        how=how,
        estimates=_estimates(costs),
        devices=_device_table(graph, costs, devices, capacity),
        transfers=_transfer_table(graph, costs),
        transfer_notes=_transfer_notes(graph, costs),
        legend=[f"{md_code(d)}: {PALETTE[i % len(PALETTE)][0]}" for i, d in enumerate(devices)],
        mermaid=_mermaid(graph, costs, devices),
        notes=[] if all(u.measured for u in costs.units) else [
            "Activations of " + ", ".join(md_code(u.name) for u in costs.units if not u.measured)
            + " could not be measured on the meta device; their output size is used instead."],
    )


def _how(kind: str, choice, device_map) -> list[str]:
    paragraphs = []
    if kind == "default":
        paragraphs.append("**Default.** The spec has no `placement:` entries, so every layer is "
                          "on `cuda:0`.")
    elif kind == "explicit":
        paragraphs.append("**Explicit.** The layout is written in the spec's `placement:` block.")
    else:
        auto, split = choice.auto, choice.split
        word = {"params": "parameters", "memory": "estimated training memory",
                "flops": "forward FLOPs"}[auto.balance]
        devices = ", ".join(md_code(d) for d in auto.devices)
        paragraphs.append(
            f"**Automatic** (`placement: auto`): balance **{auto.balance}** ({word}) over "
            f"{devices}. mpgen found the exact optimum over all contiguous splits of the "
            "layer units (a layer, one instance of a repeated layer, one block instance): the "
            "smallest bottleneck first, then the fewest bytes crossing between devices.")
        load = _balance_amount(auto.balance, split.bottleneck)
        speeds = [f"{md_code(d)} {count(s)}" for d, s in zip(auto.devices, choice.speeds)
                  if s != 1.0]
        per = " / speed" if speeds else ""
        where = md_code(choice.bottleneck_device)
        renamed = map_device(choice.bottleneck_device, device_map)
        if renamed != choice.bottleneck_device:
            where += f" ({md_code(renamed)} after `--device-map`)"
        paragraphs.append(
            f"Bottleneck: **{load}** on {where} (the largest per-device load: "
            f"{auto.balance}{per}). Bytes crossing the cuts per training step in forward: "
            f"{count(split.cut_bytes)}.")
        extras = []
        if auto.capacity:
            extras.append("capacities " + ", ".join(
                f"{md_code(d)} {human_bytes(c)}" for d, c in auto.capacity.items()))
        if speeds:
            extras.append("speeds " + ", ".join(speeds))
        if extras:
            paragraphs.append("With " + "; ".join(extras) + ".")
        paragraphs.append("`mpgen place SPEC --write` writes this layout into the spec in the "
                          "explicit form, to review it as a config diff.")
    if device_map:
        mapping = ",".join(f"{k}={v}" for k, v in sorted(device_map.items()))
        paragraphs.append(f"Devices were renamed at build time by `--device-map {mapping}`; the "
                          "tables show the renamed devices.")
    return paragraphs


def _balance_amount(balance: str, value: float) -> str:
    if balance == "params":
        return f"{count(value)} parameters"
    if balance == "memory":
        return f"{human_bytes(value)} ({count(value)} bytes)"
    return f"{flops_text(value)} ({count(value)} FLOPs)"


def _estimates(costs: Costs) -> str:
    sizes = ", ".join(f"{md_text(k)}={v}" for k, v in costs.dims) or "no symbolic dims"
    return (f"Estimates at the training sizes ({sizes}) with optimizer "
            f"{md_code(costs.optimizer)} (optimizer state: {costs.state_factor}x the parameters). "
            "Memory = weights + gradients + optimizer state + activations saved for backward "
            "(measured on the meta device); see `docs/placement.md` for what is and is not "
            "counted.")


def _device_table(graph: Graph, costs: Costs, devices: list[str],
                  capacity: dict[str, int]) -> Table:
    columns = ["device", "layers", "parameters", "weights", "gradients", "optimizer",
               "activations", "memory", "forward FLOPs"]
    if capacity:
        columns.append("% of capacity")
    rows = []
    for device in devices:
        units = [u for u in costs.units if graph.nodes[u.node].devices[u.instance] == device]
        labels = unit_labels(graph, [(u.node, u.instance) for u in units])
        memory = sum(u.memory for u in units)
        row = [
            md_code(device),
            ", ".join(md_code(label) for label in labels) or "(none)",
            count(sum(u.params for u in units)),
            human_bytes(sum(u.weight_bytes for u in units)),
            human_bytes(sum(u.grad_bytes for u in units)),
            human_bytes(sum(u.optimizer_bytes for u in units)),
            human_bytes(sum(u.activation_bytes for u in units)),
            human_bytes(memory),
            flops_text(sum(u.flops for u in units)),
        ]
        if capacity:
            cap = capacity.get(device)
            row.append(f"{100 * memory / cap:.1f}% of {human_bytes(cap)}" if cap else "no limit")
        rows.append(row)
    units = costs.units
    total = ["total", "", count(sum(u.params for u in units)),
             human_bytes(sum(u.weight_bytes for u in units)),
             human_bytes(sum(u.grad_bytes for u in units)),
             human_bytes(sum(u.optimizer_bytes for u in units)),
             human_bytes(sum(u.activation_bytes for u in units)),
             human_bytes(sum(u.memory for u in units)),
             flops_text(sum(u.flops for u in units))]
    if capacity:
        total.append("")
    rows.append(total)
    return Table(columns, rows)


def _transfer_table(graph: Graph, costs: Costs) -> Table:
    columns = ["tensor", "from", "to", "shape", "bytes"]
    rows = []
    for t in graph.plan.transfers:
        size = costs.nbytes(t.value.partition("#")[0])
        rows.append([md_code(transfer_name(graph, t)),
                     md_code(t.src) if t.src else "caller",
                     md_code(t.dst), md_code(str(t.type)),
                     f"{count(size)} ({human_bytes(size)})"])
    if not rows:
        rows.append(["(none)", "", "", "", ""])
    return Table(columns, rows)


def _transfer_notes(graph: Graph, costs: Costs) -> list[str]:
    transfers = graph.plan.transfers
    between = [t for t in transfers if t.src is not None]
    total = sum(costs.nbytes(t.value.partition("#")[0]) for t in between)
    return [
        f"Between devices: {len(between)} transfer(s), {count(total)} bytes "
        f"({human_bytes(total)}) per training step in forward; backward sends the gradients "
        "of the floating-point ones back the same way. Inputs come from the caller's device.",
    ]


def _mermaid(graph: Graph, costs: Costs, devices: list[str]) -> list[str]:
    lines = ["flowchart TD"]
    cls = {d: f"dev{i}" for i, d in enumerate(devices)}
    ids: dict[str, str] = {}  # input name -> mermaid id
    for i, t in enumerate(graph.inputs):
        ids[t.name] = f"in{i}"
        lines.append(f'  in{i}(["{mermaid_text(t.name)}"]):::input')
    first: dict[str, tuple[str, str]] = {}  # node -> (id, device) of its first run
    last: dict[str, tuple[str, str]] = {}
    edges = []
    for i, node in enumerate(graph.nodes):
        runs = _runs(node.devices)
        for r, (start, stop, device) in enumerate(runs):
            node_id = f"n{i}" if len(runs) == 1 else f"n{i}r{r}"
            label = unit_labels(graph, [(i, k) for k in range(start, stop)])[0]
            text = f"{mermaid_text(label)}<br/>{mermaid_text(node.op.spelled)}"
            lines.append(f'  {node_id}["{text}"]:::{cls[device]}')
            if r == 0:
                first[node.name] = (node_id, device)
                for value in node.inputs:
                    if value in ids:
                        edges.append(f"  {ids[value]} --> {node_id}")
                    else:
                        edges.append(_edge(last[value], first[node.name], costs.nbytes(value)))
            else:
                edges.append(_edge(last[node.name], (node_id, device),
                                   costs.nbytes(node.name)))
            last[node.name] = (node_id, device)
    lines.extend(edges)
    for device in devices:
        _, fill, stroke = PALETTE[devices.index(device) % len(PALETTE)]
        lines.append(f"  classDef {cls[device]} fill:{fill},stroke:{stroke},color:#111")
    lines.append("  classDef input fill:#ffffff,stroke:#6b7280,stroke-dasharray:3 3,color:#111")
    return lines


def _edge(src: tuple[str, str], dst: tuple[str, str], nbytes: int) -> str:
    if src[1] == dst[1]:
        return f"  {src[0]} --> {dst[0]}"
    label = mermaid_text(f"{src[1]} to {dst[1]}, {human_bytes(nbytes)}")
    return f'  {src[0]} -->|"{label}"| {dst[0]}'


def render_report(graph: Graph) -> str:
    """The report's Markdown."""
    from mpgen.compiler.render import environment

    return environment().get_template("placement.md.jinja").render(ctx=report_context(graph))
