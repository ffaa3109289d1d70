"""The placement report ``<stem>.placement.md``, generated with every build.

It says how the layout was chosen, what each device holds (layers,
parameters, estimated training memory and FLOPs at the training sizes), which
tensors move between devices in forward, charts each device's memory and
parameters as Mermaid bar charts, and draws the layer graph as a Mermaid
flowchart coloured by device (GitHub renders both).

:func:`report_context` computes every string; ``placement.md.jinja`` only
loops. Everything that comes from the spec goes through :func:`md_code`,
:func:`md_text` or :func:`mermaid_text`, so no spec string is pasted raw into
Markdown or Mermaid. The output is deterministic: no timestamps, no absolute
paths.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from mpgen.compiler.analysis import cache
from mpgen.compiler.analysis.costs import human_bytes
from mpgen.compiler.analysis.schedule import layout_ranks
from mpgen.compiler.codegen.common import environment
from mpgen.compiler.ir import (
    MEMORY_PARTS,
    Costs,
    DeviceMemory,
    Graph,
    MemoryPlan,
    Node,
    device_runs,
    unit_labels,
)
from mpgen.compiler.placement.devices import map_device
from mpgen.compiler.placement.memory import capacities
from mpgen.compiler.placement.stages import stages

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
    charts: list[list[str]]  # Mermaid xychart-beta lines: memory, then parameters
    transfers: Table
    transfer_notes: list[str]
    legend: list[str]
    mermaid: list[str]
    notes: list[str] = field(default_factory=list)
    pipeline: list[str] = field(default_factory=list)  # paragraphs; none: plain forward
    checkpoints: Optional[Table] = None  # the checkpointed units; None: there are none
    memory: list[str] = field(default_factory=list)  # paragraphs; none: no memory plan
    memory_table: Optional[Table] = None  # per device and run: the plan's peaks


def report_context(graph: Graph) -> ReportContext:
    """Every string of the report, from the compiled graph."""
    layout = graph.layout
    choice = layout.auto
    auto = choice.request if choice is not None else None
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
                dict(auto.capacity).get(device))
        capacity = {d: sum(c) for d, c in mapped_caps.items() if all(x is not None for x in c)}

    # the capacities the build checks the plan against (placement.memory)
    stated = {device: size for device, (size, _) in capacities(graph).items()}
    how = _how(layout.method, choice, device_map)
    header = [
        html_comment(f"Generated by mpgen from {graph.spec_path}. DO NOT EDIT."),
        html_comment(f"spec digest: {graph.spec_hash}"),
    ]
    return ReportContext(
        header=header,
        title=f"Placement of {md_text(graph.name)}",
        how=how,
        estimates=_estimates(costs, graph),
        devices=_device_table(graph, costs, devices, capacity),
        charts=_charts(graph, costs, devices),
        transfers=_transfer_table(graph, costs),
        transfer_notes=_transfer_notes(graph, costs),
        legend=[f"{md_code(d)}: {PALETTE[i % len(PALETTE)][0]}" for i, d in enumerate(devices)],
        mermaid=_mermaid(graph, costs, devices),
        notes=_tie_notes(graph, costs) + ([] if all(u.measured for u in costs.units) else [
            "Activations of " + ", ".join(md_code(u.name) for u in costs.units if not u.measured)
            + " could not be measured on the meta device; their output size is used instead."])
        + _cache_notes(graph),
        pipeline=_pipeline(graph),
        checkpoints=_checkpoint_table(graph, costs),
        memory=_memory_notes(graph.memory, devices, stated),
        memory_table=_memory_table(graph.memory, devices, stated),
    )


def _cache_notes(graph: Graph) -> list[str]:
    """A decoder's KV cache (generate_<name>.py): its bytes per token of one
    sequence on each device, or why generation runs without one."""
    plan = cache.plan(graph)
    if plan is None:
        return []
    if not plan.cacheable:
        return [f"Generation runs without a KV cache: {md_text(plan.problem[1])}."]
    per_token, known = cache.bytes_per_token(graph, plan)
    if not per_token:
        return []
    parts = ", ".join(f"{md_code(d)} {human_bytes(n)}" for d, n in per_token.items())
    return [f"KV cache of generation, per token of each sequence: {parts}"
            + ("" if known else " (some attention layers' sizes are not known at build time)")
            + "."]


# -- the memory plan ----------------------------------------------------------

#: The ways of running the model the plan covers, in the table's order, and
#: what the report calls each.
MEMORY_RUNS = (("train", "training"), ("pipeline", "pipeline"), ("inference", "inference"))


def _memory_rows(plan: MemoryPlan, devices: list[str]) -> list[tuple[str, str, DeviceMemory]]:
    """(device, run, its memory) in the report's device order, then the run's."""
    known = list(dict.fromkeys([*devices, *(m.device for run, _ in MEMORY_RUNS
                                           for m in getattr(plan, run))]))
    return [(device, run, mode[device]) for device in known
            for run, mode in ((run, plan.of(run)) for run, _ in MEMORY_RUNS) if device in mode]


def binding(plan: MemoryPlan, capacity: dict[str, int],
            runs: tuple[str, ...] = ("train", "pipeline")) -> Optional[tuple[str, str, int]]:
    """The device whose peak is nearest its capacity (of those with one), over
    ``runs``: (device, run, peak); None when no device has a capacity."""
    found = [(m.peak / capacity[m.device], m.device, run, m.peak) for run in runs
             for m in getattr(plan, run) if capacity.get(m.device)]
    if not found:
        return None
    _, device, run, peak = max(found, key=lambda f: (f[0], f[3]))
    return device, run, peak


def _memory_notes(plan: Optional[MemoryPlan], devices: list[str],
                  capacity: dict[str, int]) -> list[str]:
    if plan is None:
        return []
    replicas = f" and {plan.dp} replicas" if plan.dp != 1 else ""
    many = "es" if plan.microbatches != 1 else ""
    notes = [
        f"The memory plan (`docs/memory.md`): each device's bytes at their largest during a "
        f"step of the single-process training script at a batch of {plan.batch} (training), "
        f"of `pp_<name>.py` under {md_code(plan.schedule)} with {plan.microbatches} "
        f"micro-batch{many}{replicas} (pipeline), and of a forward without gradients at the "
        "same batch (inference). The parts are what is alive at the peak; the largest "
        "contributors are the units holding the most then."]
    found = binding(plan, capacity)
    if found is not None:
        device, run, peak = found
        cap = capacity[device]
        verdict = "within" if peak <= cap else "**over**"
        notes.append(f"Binding: {md_code(device)}, whose {dict(MEMORY_RUNS)[run]} peak "
                     f"{human_bytes(peak)} is {100 * peak / cap:.1f}% of its capacity "
                     f"{human_bytes(cap)} ({verdict} it). `mpgen place SPEC --fit` finds the "
                     "largest batch that fits every capacity.")
    else:
        rows = [(m.peak, d, run) for d, run, m in _memory_rows(plan, devices)
                if run != "inference"]
        if rows:
            peak, device, run = max(rows, key=lambda r: r[0])
            notes.append(f"Largest: {md_code(device)}, {dict(MEMORY_RUNS)[run]} peak "
                         f"{human_bytes(peak)}. No capacity is stated; with one "
                         "(`capacity: {cuda:0: 24GiB}`), the build checks it and "
                         "`mpgen place SPEC --fit` finds the largest batch that fits.")
    return notes


def _memory_table(plan: Optional[MemoryPlan], devices: list[str],
                  capacity: dict[str, int]) -> Optional[Table]:
    if plan is None:
        return None
    columns = ["device", "run", "peak", "reached in", *MEMORY_PARTS, "largest at the peak"]
    if capacity:
        columns.append("of capacity")
    rows = []
    for device, run, m in _memory_rows(plan, devices):
        parts = dict(m.at_peak) if m.at_peak else {
            "weights": m.weights, "gradients": m.gradients, "optimizer": m.optimizer,
            "activations": m.activations}
        row = [md_code(device), dict(MEMORY_RUNS)[run], f"**{human_bytes(m.peak)}**",
               md_code(m.phase) if m.phase else "",
               *(human_bytes(parts[p]) if p in parts else "" for p in MEMORY_PARTS),
               ", ".join(f"{md_code(name)} {human_bytes(n)}" for name, n in m.largest)]
        if capacity:
            cap = capacity.get(device)
            row.append(f"{100 * m.peak / cap:.1f}% of {human_bytes(cap)}" if cap else "no limit")
        rows.append(row)
    return Table(columns, rows)


def _pipeline(graph: Graph) -> list[str]:
    """What ``pipeline:`` does to forward, in a few sentences."""
    pipeline = graph.pipeline
    if pipeline is None:
        return []
    parts = stages(graph)
    names = ", ".join(f"{md_code(f'stage_{s.index}')} on {md_code(s.device)}" for s in parts)
    spec_devices = [s.device for s in graph.spec_plan.sections]
    ranks = layout_ranks(pipeline.schedule, spec_devices)
    return [
        f"**Micro-batched** (`pipeline:`): forward splits the batch into "
        f"**{pipeline.microbatches}** micro-batches and runs {len(parts)} stage(s) ({names}) "
        "over them in GPipe order: stage k runs micro-batch i while stage k + 1 runs "
        "i - 1. Each transfer above happens once per micro-batch with its share of the "
        "bytes; activations are those of the whole batch, as in the plain split.",
        f"`pp_<name>.py` runs the spec's {len(spec_devices)} stage(s) under `torchrun`, with the "
        f"schedule {md_code(pipeline.schedule)} by default: {ranks} rank(s) per replica of the "
        "pipeline"
        + (f", {pipeline.dp} replicas (data parallel)." if pipeline.dp != 1 else "."),
    ]


def _checkpoint_table(graph: Graph, costs: Costs) -> Optional[Table]:
    units = [u for u in costs.units if u.checkpointed]
    if not units:
        return None
    rows = []
    for u in units:
        node = graph.nodes[u.node]
        why = "`checkpoint: true`" if node.checkpoint else "`pipeline.checkpoint`"
        rows.append([md_code(u.name), md_code(node.devices[u.instance]), why,
                     human_bytes(u.activation_bytes + u.recomputed_bytes),
                     human_bytes(u.activation_bytes), human_bytes(u.recomputed_bytes)])
    saved = sum(u.recomputed_bytes for u in units)
    rows.append(["total", "", "", "", human_bytes(sum(u.activation_bytes for u in units)),
                 human_bytes(saved)])
    return Table(["unit", "device", "by", "activations without", "kept (its inputs)",
                  "saved"], rows)


def _tie_notes(graph: Graph, costs: Costs) -> list[str]:
    """One sentence per tied parameter: who owns it, where, what moves (one
    copy per device that reads it, whatever the number of readers there)."""
    readers: dict[str, list[tuple[Node, str]]] = {}  # tie.source -> (node, its param)
    owners: dict[str, str] = {}
    for node in graph.nodes:
        for tie in node.ties:
            readers.setdefault(tie.source, []).append((node, tie.param))
            owners[tie.source] = tie.owner
    notes = []
    for source, tied in readers.items():
        owner = owners[source]
        where = graph.node(owner).devices[0]
        keys = _and([md_code(f"{node.name}.{param}") for node, param in tied])
        text = (f"Tied: {keys} {'is' if len(tied) == 1 else 'are'} {md_code(source)}, one "
                f"parameter owned by {md_code(owner)} on {md_code(where)} and counted there "
                "once")
        elsewhere: dict[str, list[str]] = {}
        for node, _ in tied:
            if node.devices[0] != where:
                elsewhere.setdefault(node.devices[0], []).append(node.name)
        if elsewhere:
            size = human_bytes(costs.nbytes(source))
            moves = "; ".join(
                f"{md_code(names[0])} on {md_code(device)} reads a copy moved in forward"
                if len(names) == 1 else
                f"{_and([md_code(n) for n in names])} on {md_code(device)} read one copy "
                f"moved there in forward" for device, names in elsewhere.items())
            if sum(map(len, elsewhere.values())) == 1:
                text += (f"; {moves} ({size} per step), and backward returns its gradient to "
                         "the one parameter")
            else:
                text += (f"; {moves} ({size} per step and device); backward returns the "
                         "gradient of each use to the one parameter")
        notes.append(text + ".")
    return notes


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _how(kind: str, choice, device_map) -> list[str]:
    paragraphs = []
    if kind == "default":
        paragraphs.append("**Default.** The spec has no `placement:` entries, so every layer is "
                          "on `cuda:0`.")
    elif kind == "explicit":
        paragraphs.append("**Explicit.** The layout is written in the spec's `placement:` block.")
    else:
        auto, split = choice.request, choice.split
        word = {"params": "parameters", "memory": "estimated training memory",
                "flops": "forward FLOPs",
                "time": "milliseconds measured by `mpgen profile`"}[auto.balance]
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
                f"{md_code(d)} {human_bytes(c)}" for d, c in auto.capacity))
        if speeds:
            extras.append("speeds " + ", ".join(speeds))
        if extras:
            paragraphs.append("With " + "; ".join(extras) + ".")
        paragraphs.append("`mpgen place SPEC --write` writes this layout into the spec in the "
                          "shortest explicit form (one bookmark per device run), to review it "
                          "as a config diff.")
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
    if balance == "time":
        return f"{value:.2f} ms"
    return f"{flops_text(value)} ({count(value)} FLOPs)"


def _estimates(costs: Costs, graph: Graph) -> str:
    sizes = ", ".join(f"{md_text(k)}={v}" for k, v in costs.dims) or "no symbolic dims"
    frozen = (f" {count(graph.trainable_params)} of the {count(graph.total_params)} parameters "
              "train; the others are frozen (`requires_grad: false`), with no gradients or "
              "optimizer state." if graph.frozen_params else "")
    return (f"Estimates at the training sizes ({sizes}) with optimizer "
            f"{md_code(costs.optimizer)} (optimizer state: {costs.state_factor}x the parameters). "
            "Memory = weights + gradients + optimizer state + activations saved for backward "
            "(measured on the meta device); see `docs/placement.md` for what is and is not "
            f"counted.{frozen}")


def _device_table(graph: Graph, costs: Costs, devices: list[str],
                  capacity: dict[str, int]) -> Table:
    columns = ["device", "layers", "parameters", "weights", "gradients", "optimizer",
               "activations", "memory", "forward FLOPs"]
    if capacity:
        columns.append("% of capacity")
    rows = []
    for device, units in _units_by_device(graph, costs, devices).items():
        labels = unit_labels([u.unit for u in units])
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


def _units_by_device(graph: Graph, costs: Costs, devices: list[str]) -> dict[str, list]:
    """Each device (in report order) -> the costs of its units, in unit order."""
    return {device: [u for u in costs.units if graph.nodes[u.node].devices[u.instance] == device]
            for device in devices}


def _charts(graph: Graph, costs: Costs, devices: list[str]) -> list[list[str]]:
    """Bar charts of the device table's memory and parameters columns, one unit
    for all devices, chosen by the largest (``MiB``, ``millions``)."""
    units = _units_by_device(graph, costs, devices)
    memory = [sum(u.memory for u in us) for us in units.values()]
    params = [sum(u.params for u in us) for us in units.values()]
    exponent = 0
    while exponent < len(BYTE_UNITS) - 1 and max(memory) >= 1024 ** (exponent + 1):
        exponent += 1
    scale, name = next(((s, n) for s, n in COUNT_UNITS if max(params) >= s), (1, ""))
    return [
        _bar_chart(f"Estimated training memory per device in {BYTE_UNITS[exponent]}",
                   BYTE_UNITS[exponent], devices, memory, 1024 ** exponent, 1 if exponent else 0),
        _bar_chart(f"Parameters per device{f' in {name}' if name else ''}", name or "parameters",
                   devices, params, scale, 2 if name else 0),
    ]


#: Units of the charts: bytes as ``human_bytes`` writes them; counts by thousands.
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
COUNT_UNITS = ((10 ** 9, "billions"), (10 ** 6, "millions"), (10 ** 3, "thousands"))


def _bar_chart(title: str, axis: str, devices: list[str], amounts: list[int], scale: int,
               digits: int) -> list[str]:
    values = [f"{a / scale:.{digits}f}" for a in amounts]
    labels = ", ".join(f'"{mermaid_text(d)}"' for d in devices)
    return [
        "xychart-beta",
        f'  title "{mermaid_text(title)}"',
        f"  x-axis [{labels}]",
        f'  y-axis "{mermaid_text(axis)}" 0 --> {_axis_top(max(float(v) for v in values))}',
        f"  bar [{', '.join(values)}]",
    ]


def _axis_top(value: float) -> str:
    """A round upper bound of a bar chart's axis: 1, 1.2, 1.5, 2, 2.5, 3, 4, 5,
    6 or 8 times a power of ten, the smallest at least ``value`` (1 for 0)."""
    if value <= 0:
        return "1"
    power = 10.0 ** math.floor(math.log10(value))
    top = next(m * power for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10)
               if m * power >= value * (1 - 1e-12))
    return f"{top:.12g}"


def _transfer_table(graph: Graph, costs: Costs) -> Table:
    columns = ["tensor", "from", "to", "shape", "bytes"]
    rows = []
    for t in graph.plan.transfers:
        size = costs.nbytes(t.value)
        rows.append([md_code(str(t.value)),
                     md_code(t.src) if t.src else "caller",
                     md_code(t.dst), md_code(str(t.type)),
                     f"{count(size)} ({human_bytes(size)})"])
    if not rows:
        rows.append(["(none)", "", "", "", ""])
    return Table(columns, rows)


def _transfer_notes(graph: Graph, costs: Costs) -> list[str]:
    transfers = graph.plan.transfers
    between = [t for t in transfers if t.src is not None]
    total = sum(costs.nbytes(t.value) for t in between)
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
    producer = {v: n.name for n in graph.nodes for v in n.value_names}
    first: dict[str, tuple[str, str]] = {}  # node -> (id, device) of its first run
    last: dict[str, tuple[str, str]] = {}
    edges = []
    for i, node in enumerate(graph.nodes):
        runs = device_runs(node.devices)
        for r, (start, stop, device) in enumerate(runs):
            node_id = f"n{i}" if len(runs) == 1 else f"n{i}r{r}"
            label = unit_labels([node.unit(k) for k in range(start, stop)])[0]
            text = f"{mermaid_text(label)}<br/>{mermaid_text(node.op.spelled)}"
            lines.append(f'  {node_id}["{text}"]:::{cls[device]}')
            if r == 0:
                first[node.name] = (node_id, device)
                for value in node.inputs:
                    if value in ids:
                        edges.append(f"  {ids[value]} --> {node_id}")
                    else:
                        edges.append(_edge(last[producer[value]], first[node.name],
                                           costs.nbytes(value)))
                for tie in node.ties:  # a shared parameter: a dotted edge from its owner
                    label = mermaid_text(f"tied {tie.source}")
                    edges.append(f'  {first[tie.owner][0]} -.->|"{label}"| {node_id}')
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
    return environment().get_template("placement.md.jinja").render(ctx=report_context(graph))
