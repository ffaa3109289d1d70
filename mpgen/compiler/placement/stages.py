"""Pipeline stages: the forward plan's sections, each with what it receives
and what it passes on.

# NOTE: [Pipeline stages]
# A stage is one section of the forward plan (consecutive work on one
# device). Stage k is a function of the variables it *takes* and returns the
# variables it *gives*: every variable defined by stage k or earlier (or a
# model input) that a later stage reads before redefining it, or that forward
# returns. Model inputs enter at stage 0 and are passed on like any value, so
# a stage only ever receives from the stage before it: that is what a
# pipeline schedule (GPipe, 1F1B; ``torch.distributed.pipelining``) can run,
# and what the micro-batched forward runs one micro-batch at a time. The
# last stage gives the model's outputs, in ``outputs`` order. A variable a
# stage reads includes the tensors whose sizes its expressions read
# (``"=size(idx, 1)"``) and the copies of tied parameters, which each stage
# makes itself (a tied parameter moved once per forward to a device is moved
# once per stage: ``_own_tie_copies``).
"""

from __future__ import annotations

from dataclasses import dataclass
from mpgen.compiler.ir import ForwardPlan, Graph, Node, Section, sizes_used


@dataclass(frozen=True)
class Stage:
    index: int
    device: str
    section: Section
    takes: tuple[str, ...]  # variables received, in a fixed order
    gives: tuple[str, ...]  # variables passed on; the last stage's: forward's returns


def _value_vars(graph: Graph) -> dict[str, str]:
    """Value name -> its variable in forward."""
    return ({t.name: t.var for t in graph.inputs} | {n.name: n.var for n in graph.nodes}
            | {e.name: e.var for n in graph.nodes for e in n.elements})


def _defines(node: Node) -> tuple[str, ...]:
    """The variables a step of ``node`` defines."""
    return tuple(e.var for e in node.elements) if node.pattern else (node.var,)


def _reads_and_defines(graph: Graph, section: Section) -> tuple[list[str], list[str]]:
    """The variables ``section`` reads before defining them, and those it defines, in order."""
    nodes = {n.name: n for n in graph.nodes}
    var = _value_vars(graph)
    # Insertion-ordered dicts: in order, and constant-time membership.
    reads: dict[str, None] = {}
    defined: dict[str, None] = {}

    def read(v: str) -> None:
        if v not in defined:
            reads.setdefault(v)

    def define(v: str) -> None:
        defined.setdefault(v)

    for t in section.transfers:
        read(t.src_var)
        define(t.dst_var)
    for step in section.steps:
        node = nodes[step.node]
        defines = _defines(node)
        for v in step.reads:
            read(v)
        for _, v in step.tied:
            read(v)
        for value in sorted(set().union(*(sizes_used(a) for a in (*node.call.values,
                                                                  *node.init.values)))):
            read(var[value])
        if step.out_var not in defines:  # a run of a repeated layer: out = first; loop
            define(step.out_var)
        for v in defines:
            define(v)
    return list(reads), list(defined)


def _own_tie_copies(sections: tuple[Section, ...]) -> list[Section]:
    """``sections``, each making the copies of tied parameters its steps read:
    forward moves a tied parameter to a device once, in its first section
    there, and a later section on that device reuses the copy; a stage
    makes its own instead of receiving it through the stages between (in
    pp_<name>.py each stage holds its copy as a parameter)."""
    moves = {t.dst_var: t for s in sections for t in s.transfers if t.src_var.startswith("self.")}
    result = []
    for section in sections:
        made = {t.dst_var for t in section.transfers}
        extra = {v: moves[v] for step in section.steps for _, v in step.tied
                 if v in moves and v not in made}
        result.append(Section(section.device, (*extra.values(), *section.transfers),
                              section.steps) if extra else section)
    return result


def stages(graph: Graph, plan: ForwardPlan | None = None) -> tuple[Stage, ...]:
    """The stages of ``plan`` (default: the graph's), NOTE [Pipeline stages]."""
    plan = plan or graph.plan
    sections = _own_tie_copies(plan.sections)
    usage = [_reads_and_defines(graph, s) for s in sections]
    available = [t.var for t in graph.inputs]
    result = []
    for k, section in enumerate(sections):
        takes = tuple(available)
        reads, defines = usage[k]
        for v in defines:
            if v not in available:
                available.append(v)
        if k == len(sections) - 1:
            gives = tuple(plan.returns)
        else:
            needed = set(plan.returns)
            for later_reads, _ in usage[k + 1:]:
                needed.update(later_reads)
            gives = tuple(v for v in available if v in needed)
        available = list(gives)  # the next stage takes exactly these
        result.append(Stage(k, section.device, section, takes, gives))
    return tuple(result)
