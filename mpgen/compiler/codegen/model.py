"""IR -> ``<name>.py``: the model module (block classes, then the model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mpgen.compiler.codegen.common import (
    BODY_INDENT,
    call,
    commented,
    constructor,
    count,
    docstring,
    environment,
    header,
    literal,
)
from mpgen.compiler.ir import BlockClass, Graph, Node, OpKind, Step, TensorType, Transfer, device_runs


@dataclass
class ClassCode:
    """One generated nn.Module class, as lines for the template."""

    name: str
    doc: str
    init_params: str
    init_lines: list[str]
    forward_params: str
    returns_hint: str
    forward_lines: list[str]
    returns: str


@dataclass
class ModelContext:
    header: list[str]
    doc: str
    imports: list[str]
    classes: list[ClassCode] = field(default_factory=list)


def _step_call(node: Node, reads: Sequence[str], target: str) -> str:
    if node.op.kind is OpKind.FUNCTION:
        tensors = [f"[{', '.join(reads)}]"] if node.op.seq_input else list(reads)
        code = call(node.op.callee, tensors + [literal(a) for a in node.args], node.kwargs)
    else:
        code = f"{target}({', '.join(reads)})"
    return code + _pick(node)


def _pick(node: Node) -> str:
    return f"[{node.output}]" if node.output is not None else ""


def _node_lines(node: Node, step: Step, comment: Optional[TensorType] = None) -> list[str]:
    """Lines that run one step (a layer, or a run of a repeated layer)."""
    shape = comment if comment is not None else node.out
    out = step.out_var
    if node.repeat is None:
        return commented(f"{out} = {_step_call(node, step.reads, f'self.{node.name}')}", shape)
    if step.stop - step.start == 1:
        target = f"self.{node.name}[{step.start}]"
        return commented(f"{out} = {_step_call(node, step.reads, target)}", shape)
    first, extra = step.reads[0], list(step.reads[1:])
    lines = [f"{out} = {first}"] if first != out else []
    if step.start == 0 and step.stop == node.repeat:
        seq = f"self.{node.name}"
    else:
        seq = f"self.{node.name}[{step.start}:{step.stop}]"
    lines.append(f"for {step.loop_var} in {seq}:")
    body = commented(f"{out} = {step.loop_var}({', '.join([out, *extra])}){_pick(node)}",
                     shape, BODY_INDENT + 4)
    lines.extend(f"    {line}" for line in body)
    return lines


def _transfer_lines(t: Transfer) -> list[str]:
    return commented(f'{t.dst_var} = {t.src_var}.to("{t.dst}")', t.type)


def _init_lines(nodes: Sequence[Node], in_block: bool) -> list[str]:
    lines: list[str] = []
    device = None
    for node in nodes:
        if not node.op.has_module:
            continue
        ctor = constructor(node)
        if in_block:
            if node.repeat:
                lines.append(f"self.{node.name} = nn.ModuleList("
                             f"[{ctor} for _ in range({node.repeat})])")
            else:
                lines.append(f"self.{node.name} = {ctor}")
            continue
        runs = device_runs(node.devices)
        if runs[0][2] != device:
            device = runs[0][2]
            lines.append(f"# {device}")
        if node.repeat is None:
            lines.append(f'self.{node.name} = {ctor}.to("{device}")')
            continue
        parts = [f'[{ctor}.to("{d}")]' if stop - start == 1 else
                 f'[{ctor}.to("{d}") for _ in range({stop - start})]' for start, stop, d in runs]
        lines.append(f"self.{node.name} = nn.ModuleList({' + '.join(parts)})")
        device = runs[-1][2]
    return lines


def _tensor_params(names: Sequence[str]) -> str:
    return ", ".join(f"{n}: torch.Tensor" for n in names)


def _returns_hint(n: int) -> str:
    return "torch.Tensor" if n == 1 else f"tuple[{', '.join(['torch.Tensor'] * n)}]"


def block_class(block: BlockClass) -> ClassCode:
    shapes = dict(block.shapes)
    lines: list[str] = []
    for node in block.nodes:
        reads = [_var(block, r) for r in node.inputs]
        step = Step(node.name, "", tuple(reads), node.var, 0, node.instances,
                    "layer" if node.repeat and node.repeat > 1 else None)
        lines.extend(_node_lines(node, step, shapes.get(node.name)))
    doc = [f"Block {block.name}"
           + (f"({', '.join(block.params)})" if block.params else "") + "."]
    if block.params_count is not None:
        doc += ["", f"{count(block.params_count)} parameters per instance."]
    return ClassCode(
        name=block.name,
        doc=docstring(doc, "    "),
        init_params="".join(f", {p}" for p in block.params),
        init_lines=_init_lines(block.nodes, in_block=True),
        forward_params=_tensor_params([t.var for t in block.inputs]),
        returns_hint=_returns_hint(len(block.outputs)),
        forward_lines=lines,
        returns=", ".join(_var(block, o) for o in block.outputs),
    )


def _var(block: BlockClass, name: str) -> str:
    for t in block.inputs:
        if t.name == name:
            return t.var
    for n in block.nodes:
        if n.name == name:
            return n.var
    raise KeyError(name)


def model_class(graph: Graph) -> ClassCode:
    nodes = {n.name: n for n in graph.nodes}
    lines: list[str] = []
    for section in graph.plan.sections:
        if lines:
            lines.append("")
        lines.append(f"# {section.device}")
        for transfer in section.transfers:
            lines.extend(_transfer_lines(transfer))
        for step in section.steps:
            lines.extend(_node_lines(nodes[step.node], step))
    totals = graph.params_by_device()
    doc = [f"{graph.name}, split over {', '.join(graph.devices)}.", ""]
    doc += ["Parameters per device:"]
    doc += [f"    {d}: {count(n)}" for d, n in totals.items()]
    doc += [f"    total: {count(graph.total_params)}"]
    return ClassCode(
        name=graph.name,
        doc=docstring(doc, "    "),
        init_params="",
        init_lines=_init_lines(graph.nodes, in_block=False),
        forward_params=_tensor_params([t.var for t in graph.inputs]),
        returns_hint=_returns_hint(len(graph.outputs)),
        forward_lines=lines,
        returns=", ".join(graph.plan.returns),
    )


def imports(graph: Graph) -> list[str]:
    nodes = list(graph.nodes) + [n for b in graph.blocks for n in b.nodes]
    lines = ["import torch"]
    if any(n.op.callee.startswith("F.") for n in nodes):
        lines.append("import torch.nn.functional as F")
    lines.append("from torch import nn")
    users = sorted({n.op.module for n in nodes if n.op.kind is OpKind.USER})
    if users:
        lines.append("")
        lines.extend(f"import {m}" for m in users)
    return lines


def model_context(graph: Graph) -> ModelContext:
    transfers = graph.plan.transfers
    doc = [
        f"{graph.name}: model-parallel PyTorch generated by mpgen from {graph.spec_path}.",
        "",
        "Layers are built on their devices in __init__; forward moves a tensor",
        "with an explicit .to() exactly where the device changes.",
        "",
        "Transfers in forward:",
    ]
    for t in transfers:
        src = t.src or "caller's device"
        doc.append(f"    {t.value.split('#')[0]} {t.type}: {src} -> {t.dst}")
    if not transfers:
        doc.append("    none")
    classes = [block_class(b) for b in graph.blocks] + [model_class(graph)]
    return ModelContext(header(graph), docstring(doc), imports(graph), classes)


def render_model(graph: Graph) -> str:
    return environment().get_template("model.py.jinja").render(ctx=model_context(graph))
