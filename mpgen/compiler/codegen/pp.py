"""IR -> ``pp_<name>.py``: the model as a pipeline of processes under torchrun.

# NOTE: [Pipeline program]
# One stage per section of the spec's own forward plan (``Graph.spec_plan``,
# before --device-map; NOTE [Pipeline stages]), one ``StageK(nn.Module)``
# class each, wired with ``torch.distributed.pipelining``. A stage class
# builds only its layers, under the attribute names of the single-process
# model, so its state dict holds exactly that model's keys for those layers:
# instances of a repeated layer held by other stages are the runtime's
# ``Elsewhere`` placeholders (no parameters), which keeps ``h.6.weight`` at
# index 6. A stage's forward is its section's statements (codegen/model.py's
# ``statements``)
# without the moves: PipelineStage delivers what it takes on its rank's
# device, and factories make their tensors on the device of what it takes.
# A tied parameter whose owner is on another stage is a parameter of its own
# here (a copy); the runtime makes the copies equal at the start and sums
# their gradients over the ranks holding them after each backward, as
# Megatron does for first- and last-stage embeddings.
#
# The file holds only the stages, their devices, the ties, the last
# stage's loss, the spec's pipeline: defaults and the cost model's figures
# of one sample (each stage's forward and backward seconds, each
# boundary's transfer, the training FLOPs: for the runtime's predicted
# bubble and MFU), in one ``mpgen_runtime.Stages``; the loop (its pipeline
# mode, ``mpgen/runtime/pipeline.py``), the data, the optimizer and the
# defaults are the runtime's and train_<name>.py's ``TRAINING``; block
# classes are the model module's. A model that cannot run as a pipeline
# still gets the file (the build's other files are unaffected): run, it
# says why and exits with status 1.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mpgen.compiler.analysis import schedule as schedules
from mpgen.compiler.codegen import train as train_codegen
from mpgen.compiler.codegen.common import (
    Names,
    _tuple,
    file_names,
    header,
    literal,
    string_literal,
    synthetic_like,
    tuple_literal,
)
from mpgen.compiler.codegen.model import (
    assignment,
    attribute,
    checkpoint_runs,
    containers,
    copies,
    freeze,
    imports,
    initialization,
    source_code,
    statements,
    variables,
)
from mpgen.compiler.codegen.writer import PythonWriter
from mpgen.compiler.frontend.namespace import GLOBALS, Namespace
from mpgen.compiler.ir import Expr, Graph, Node, OpKind, PipelineConfig, Step, unit_labels
from mpgen.compiler.placement.pipelining import checkpointed_units
from mpgen.compiler.placement.stages import Stage, stages
from mpgen.errors import Position, escaped

RUNTIME = train_codegen.RUNTIME
#: The names the file defines, claimed in this order after what it imports.
OWN_NAMES = ("stage_loss", "STAGES", "PROBLEM", "main")
_LOSS_PARAMS = ("outputs", "index", "targets", "loss_fns", "microbatches")
#: ``mpgen_runtime.Stages``' field defaults (mpgen/runtime/spec.py, which the
#: compiler does not import: tests/runtime keeps the two equal); a field at
#: its default is not written.
STAGES_DEFAULTS = {"schedule": "1f1b", "microbatches": 2, "dp": 1, "sync_bn": False, "costs": (),
                   "transfers": (), "flops": 0.0, "measured_on": ()}
#: Significant digits of the per-sample costs (the same on every rebuild).
COST_DIGITS = 4


def _stage_of(all_stages: tuple[Stage, ...]) -> dict[str, int]:
    """Layer name -> the stage holding its first step."""
    found: dict[str, int] = {}
    for stage in all_stages:
        for step in stage.section.steps:
            found.setdefault(step.node, stage.index)
    return found


def pipeline_problem(graph: Graph, all_stages: tuple[Stage, ...]) -> Optional[str]:
    """Why ``graph`` cannot train as a pipeline of its stages, or None."""
    train = graph.train
    if not train.losses:
        return f"{graph.name} has no loss (train: loss:), so there is nothing to pipeline"
    if graph.trainable_params == 0:
        what = "parameters that train" if graph.total_params else "parameters"
        return f"{graph.name} has no {what}, so there is nothing to train"
    if train.closure:
        return (f"{train.optimizer} evaluates the loss several times per step (a closure); "
                "a pipeline schedule runs each micro-batch's forward and backward once")
    for loss in train.losses:
        if loss.flat_batch is not None:
            return (f"the target of {loss.output} {loss.target_type} holds its samples inside "
                    f"{loss.target_type.shape[loss.flat_batch[0]]}, which the schedule cannot "
                    "split into micro-batches; return an output with a batch dim of its own")
    for stage in all_stages[1:]:
        if not stage.takes:
            return (f"stage {stage.index} ({stage.device}) reads nothing the stage before it "
                    "computes, so no tensor would carry the pipeline to it")
    for stage in all_stages:
        for var in stage.gives:
            if _type_of_var(graph, var) is None:
                return (f"stage {stage.index} passes {var}, which is not a tensor; "
                        "torch.distributed.pipelining sends only tensors between stages")
    return None


def _type_of_var(graph: Graph, var: str):
    """The type of a variable of forward (a value or its copy), None when unknown."""
    for t in graph.inputs:
        if t.var == var:
            return t.type
    for node in graph.nodes:
        if node.var == var and not node.pattern:
            return node.out
        for e in node.elements:
            if e.var == var:
                return e.type
    for t in graph.spec_plan.transfers:
        if t.dst_var == var:
            return t.type
    return None


# -- stage classes ----------------------------------------------------------------

def _stage_nodes(graph: Graph, stage: Stage) -> list[tuple[Node, Step]]:
    nodes = {n.name: n for n in graph.nodes}
    return [(nodes[step.node], step) for step in stage.section.steps]


def _stage_class(w: PythonWriter, graph: Graph, stage: Stage, name: str, elsewhere: str,
                 owners: dict[str, int]) -> None:
    held = _stage_nodes(graph, stage)
    units = [graph.node(s.node).unit(k) for _, s in held for k in range(s.start, s.stop)]
    doc = [f"Stage {stage.index} (on {stage.device} in the spec): {', '.join(unit_labels(units))}.",
           "",
           f"Takes {', '.join(stage.takes)}; gives {', '.join(stage.gives)}."]
    w.line()
    w.line()
    with w.block(f"class {name}(nn.Module)"):
        w.docstring(doc)
        w.line()
        with w.block("def __init__(self) -> None"):
            w.line("super().__init__()")
            made: set[str] = set()
            for node, step in held:
                if not node.op.has_module:
                    continue
                containers(w, graph, node, made, elsewhere)
                if node.repeat is None:
                    attribute(w, node)
                    continue
                parts = []
                if step.start:
                    w.comment(f"{node.name}.0-{step.start - 1} are on earlier stages; "
                              f"placeholders keep the indices of {node.name}.{step.start}-"
                              f"{step.stop - 1}")
                    parts.append(f"[{elsewhere}() for _ in range({step.start})]")
                parts.append(copies(node, step.start, step.stop))
                w.line(assignment(node, f"nn.ModuleList({' + '.join(parts)})"))
                freeze(w, node)
            copied: dict[str, str] = {}  # a tied parameter -> its copy on this stage
            for node, _ in held:
                for tie in node.ties:
                    if owners[tie.owner] == stage.index:
                        w.line(f"self.{node.name}.{tie.param} = "
                               f"{source_code(graph, tie.source)}")
                    elif tie.source in copied:  # one copy per stage, whatever reads it
                        w.line(f"self.{node.name}.{tie.param} = self.{copied[tie.source]}")
                    else:
                        copied[tie.source] = f"{node.name}.{tie.param}"
                        w.comment(f"{node.name}.{tie.param}: a copy of {tie.source} (stage "
                                  f"{owners[tie.owner]}), kept equal by the script (TIES)")
                        if graph.node(tie.owner).frozen != node.frozen:  # trains as its owner
                            trains = not graph.node(tie.owner).frozen
                            w.line(f"self.{node.name}.{tie.param}.requires_grad_({trains})",
                                   f"as {tie.source}: {'trains' if trains else 'frozen'}")
            initialization(w, dataclasses.replace(graph, nodes=tuple(n for n, _ in held)))
        w.line()
        params = ", ".join(["self", *(f"{v}: torch.Tensor" for v in stage.takes)])
        with w.block(f"def forward({params}) -> tuple[torch.Tensor, ...]"):
            names = _names(graph)
            for t in stage.section.transfers:
                if t.src_var.startswith("self.") or t.dst_var == t.src_var:
                    continue  # a tied parameter's copy is this stage's own; already here
                w.line(f"{t.dst_var} = {t.src_var}", str(t.type))
            device = Expr(f"{stage.takes[0]}.device") if stage.takes else None
            checkpointed = checkpointed_units(graph)
            for node, step in held:
                # recomputed in backward where the spec says so, as in <name>.py
                for part, recompute in checkpoint_runs(node, dataclasses.replace(step, tied=()),
                                                       checkpointed):
                    statements(w, node, part, names, device=device, checkpoint=recompute)
            w.line(f"return {'(' + _tuple(stage.gives) + ')'}")


def _names(graph: Graph) -> Names:
    return Names({}, variables(graph.inputs, graph.nodes))


def _classes(w: PythonWriter, graph: Graph, all_stages: tuple[Stage, ...],
             stage_names: list[str]) -> None:
    """The stage classes."""
    owners = _stage_of(all_stages)
    for stage, name in zip(all_stages, stage_names):
        _stage_class(w, graph, stage, name, f"{RUNTIME}.pipeline.Elsewhere", owners)


def _ties(graph: Graph, all_stages: tuple[Stage, ...]) -> str:
    """TIES: one entry per parameter shared across stages: the owner's (stage,
    key) first, then each copy's."""
    owners = _stage_of(all_stages)
    groups: dict[str, list[tuple[int, str]]] = {}
    for node in graph.nodes:
        for tie in node.ties:
            if owners[tie.owner] != owners[node.name]:
                group = groups.setdefault(tie.source, [(owners[tie.owner], tie.source)])
                if all(k != owners[node.name] for k, _ in group):  # the stage's one copy
                    group.append((owners[node.name], f"{node.name}.{tie.param}"))
    entries = ["(" + ", ".join(f"({k}, {string_literal(key)})" for k, key in group) + ")"
               for group in groups.values()]
    return "(" + _tuple(entries) + ")"


# -- the loss -----------------------------------------------------------------------

def _loss_lines(graph: Graph, reserved: set[str]) -> list[str]:
    """stage_loss's body: the outputs unpacked, each loss on its micro-batch's
    targets, so that the schedule's mean over micro-batches is the batch's
    loss (NOTE [Micro-batch losses] in mpgen/runtime/pipeline.py)."""
    ns = Namespace(reserved | set(_LOSS_PARAMS))
    outs = [ns.fresh(o) for o in graph.outputs]
    if len(outs) == 1:  # the schedule passes a stage's one output without its tuple
        lines = [f"{outs[0]} = outputs[0] if isinstance(outputs, tuple) else outputs"]
    else:
        lines = [f"{_tuple(outs)} = outputs{train_codegen.untrained_note(graph, outs)}"]
    losses = graph.train.losses
    parts, each = [], []
    for k, loss in enumerate(losses):
        out = outs[graph.outputs.index(loss.output)]
        target = ns.fresh("target" if len(losses) == 1 else f"{loss.output}_target")
        dim = literal(loss.target_type.batch_dim)
        lines.append(f"{target} = {RUNTIME}.pipeline.pick(targets[{k}], {dim}, index)")
        if not train_codegen.made_in_batch(loss):
            like = synthetic_like(loss.target_type, out, loss.classes, loss.target)
            lines.append(f"{target} = ({target} if {target} is not None else {like})"
                         f".to({out}.device)")
        part = ns.fresh(f"{loss.output}_loss") if len(losses) > 1 else "loss"
        scale = " * microbatches" if dict(loss.kwargs).get("reduction") == "sum" else ""
        expr = train_codegen.loss_expr(loss, f"loss_fns[{k}]", out, target)
        lines.append(f"{part} = {expr}{scale}")
        parts.append(part)
        each.append(f"({_tuple([part, out, target])})")
    if len(parts) > 1:
        lines.append(f"loss = {' + '.join(parts)}")
    lines.append(f"return loss, ({_tuple(each)})")
    return lines


# -- the file -----------------------------------------------------------------------

def _reserved(graph: Graph) -> set[str]:
    """What the file imports: torch, nn, F, the spec's modules, the runtime,
    the training script and the model module's blocks."""
    names = file_names(graph)
    users = {n.op.module.split(".")[0] for n in graph.nodes if n.op.kind is OpKind.USER}
    return (set(GLOBALS) | {b.name for b in graph.blocks} | users | {RUNTIME, names["train"][:-3]})


def _unavailable(w: PythonWriter, graph: Graph, problem: str, n: dict[str, str]) -> None:
    names = file_names(graph)
    w.docstring([f"{graph.name} as a pipeline of processes: not available.", "",
                 f"Generated by mpgen from {graph.spec_path}. {graph.name} cannot train under",
                 f"torch.distributed.pipelining: {problem}.",
                 f"Train it with {names['train']}."])
    w.line()
    w.line("import sys")
    w.line()
    w.line(f"{n['PROBLEM']} = {literal(problem)}")
    w.line()
    w.line()
    with w.block(f"def {n['main']}(argv: list[str] | None = None) -> None"):
        message = (f"{names['pp']}: {graph.name} cannot run as a pipeline: "
                   f"{{{n['PROBLEM']}}}. Train it with {names['train']}")
        w.line(f"sys.exit(f{literal(message)})")
    w.line()
    w.line()
    with w.block('if __name__ == "__main__"'):
        w.line(f"{n['main']}()")


def render_pp(graph: Graph) -> str:
    """``pp_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    ns = Namespace(_reserved(graph))
    n = {base: ns.fresh(base) for base in OWN_NAMES}
    all_stages = stages(graph, graph.spec_plan)
    problem = pipeline_problem(graph, all_stages)
    w = PythonWriter()
    for line in header(graph):
        w.line(line)
    if problem:
        _unavailable(w, graph, problem, n)
    else:
        _program(w, graph, all_stages, ns, n)
    return w.text()


def _program(w: PythonWriter, graph: Graph, all_stages: tuple[Stage, ...], ns: Namespace,
             n: dict[str, str]) -> None:
    names = file_names(graph)
    train_module, stem = names["train"][:-3], names["model"][:-3]
    count = len(all_stages)
    pipeline = graph.pipeline or PipelineConfig(microbatches=count)
    ranks = schedules.layout_ranks(pipeline.schedule, [s.device for s in all_stages])
    processes = ranks * pipeline.dp
    how = []
    if processes != count:
        replicas = (f", {pipeline.dp} replicas of the pipeline (data parallel, --dp)"
                    if pipeline.dp != 1 else "")
        how = ["", f"The {pipeline.schedule} schedule runs them on {ranks} ranks{replicas}:",
               f"{processes} processes."]
    w.docstring([
        f"Train {graph.name} as {count} pipeline stages, {graph.spec_path}'s device runs, under torchrun.",
        *how,
        "",
        "For example:",
        "",
        f"    torchrun --nproc-per-node {processes} {names['pp']} --steps 100 --checkpoint runs/pp_{stem}",
        f"    python {names['pp']} --merge runs/pp_{stem} model.pt  # one state dict of {graph.name}",
        f"    torchrun --nproc-per-node {count} {names['pp']} --predict --checkpoint runs/pp_{stem} "
        "--data inputs.safetensors --out outputs.safetensors  # forward only",
    ])
    w.line()
    for line in imports(graph):
        w.line(line)
    w.line()
    w.line(f"import {RUNTIME}.pipeline")
    w.line(f"import {train_module}")
    used_blocks = sorted({node.op.callee for s in all_stages for node, _ in _stage_nodes(graph, s)
                          if node.op.kind is OpKind.BLOCK})
    if used_blocks:
        w.line(f"from {stem} import {', '.join(used_blocks)}")
    stage_names = [ns.fresh(f"Stage{s.index}") for s in all_stages]
    _classes(w, graph, all_stages, stage_names)
    w.line()
    w.line()
    with w.block(f"def {n['stage_loss']}(outputs, index, targets, loss_fns, microbatches)"):
        w.docstring([f"The last stage's loss ({train_codegen.losses_text(graph)}) of the "
                     "micro-batch ``index`` picks, and each output's loss, output and target."])
        for line in _loss_lines(graph, _reserved(graph) | set(n.values())):
            code, _, comment = line.partition("  # ")
            w.line(code, comment)
    fields = [("training", f"{train_module}.TRAINING"),
              ("stages", "(" + _tuple(stage_names) + ")"),
              ("devices", tuple_literal(s.device for s in all_stages)),
              ("loss", n["stage_loss"])]
    ties = _ties(graph, all_stages)
    if ties != "()":
        fields.append(("ties", ties))
    given = {"schedule": pipeline.schedule, "microbatches": pipeline.microbatches,
             "dp": pipeline.dp, "sync_bn": pipeline.sync_bn, **_per_sample(graph)}
    fields += [(key, _literal(value)) for key, value in given.items()
               if value != STAGES_DEFAULTS[key]]
    if graph.memory is not None and graph.memory.pipeline:
        fields.append(("memory", train_codegen.memory_literal(graph.memory.pipeline)))
    train_codegen.facts_and_run(w, n["STAGES"], f"{RUNTIME}.Stages", fields,
                                f"{RUNTIME}.pipeline.train")


def _literal(value: object) -> str:
    """A value of STAGES, its tuples (nested too) as black writes them."""
    if isinstance(value, tuple):
        return "(" + _tuple([_literal(v) for v in value]) + ")"
    return literal(value)


def _per_sample(graph: Graph) -> dict[str, object]:
    """STAGES' ``costs``, ``transfers`` and ``flops``: one sample's seconds
    (the cost model's stage times of the spec's own stages,
    ``analysis.schedule.stage_times``, over the training batch) and training
    FLOPs, at :data:`COST_DIGITS` significant digits, so that a rebuild
    writes the same; none where unknown or zero."""
    batch = dict(graph.costs.dims).get("batch") if graph.costs else None
    if not batch:
        return {}

    def per_sample(value: float) -> float:
        return float(f"{value / batch:.{COST_DIGITS}g}")

    found: dict[str, object] = {}
    try:
        times = schedules.stage_times(graph, plan=graph.spec_plan)
    except ValueError:  # the spec's stages are not runs of the cost model's units
        times = None
    if times is not None and any(times.forward):
        found["costs"] = tuple((per_sample(f), per_sample(b))
                               for f, b in zip(times.forward, times.backward))
        if any(times.transfers):
            found["transfers"] = tuple(per_sample(t) for t in times.transfers)
        if times.measured_on:  # from the spec's profile (NOTE [Measured time])
            found["measured_on"] = times.measured_on
    flops = sum(u.flops for u in graph.costs.units) * (1 + schedules.BACKWARD_FACTOR)
    if flops:
        found["flops"] = per_sample(flops)
    return found


#: What each mode of the memory plan simulates, as a note names it.
_SIMULATED = {"train": "the training step", "pipeline": "the pipeline program's step",
              "inference": "a forward without gradients"}


def memory_notes(graph: Graph) -> list[str]:
    """``SPEC:LINE:COL: note: ...`` for each way of running the model whose
    step the memory plan could not simulate (at the layer that raised, else
    the spec's first line): its peaks are the additive estimate, which the
    placement report marks "estimate". None where the spec itself chose the
    estimate (too many layer runs, a recurrent layer: the same on every
    machine), nor for the pipeline program where the layout cannot run it
    (pp_<name>.py says why when it is run)."""
    plan = graph.memory
    if plan is None or not plan.unsimulated or not graph.nodes:
        return []
    same: dict[tuple[str, Position], list[str]] = {}  # one note per cause, naming its modes
    for mode, why, pos in plan.unsimulated:
        if mode == "pipeline" and pipeline_problem(graph, stages(graph, graph.spec_plan)):
            continue
        same.setdefault((why, pos or Position(graph.nodes[0].pos.file, 1, 1)), []).append(mode)
    notes = []
    for (why, where), modes in same.items():
        named = [_SIMULATED[m] for m in modes]
        what = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]
        its = "its peaks are" if len(named) == 1 else "their peaks are"
        notes.append(f"{where}: note: the memory plan could not simulate {what} "
                     f"({escaped(why)}), so {its} the additive estimate (\"estimate\" in the "
                     "placement report)")
    return notes


def batch_norm_notes(graph: Graph) -> list[str]:
    """``SPEC:LINE:COL: note: ...`` at the first BatchNorm of a model whose
    pipeline program runs it on micro-batches or replicas by default: what
    its statistics become there (NOTE [BatchNorm under data parallelism]
    in the runtime's batchnorm.py); none where pp_<name>.py matches the
    single-process script (one micro-batch, one replica or --sync-bn)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [node for node in (*graph.nodes, *(n for b in graph.blocks for n in b.nodes))
             if isinstance(node.op.target, type) and issubclass(node.op.target, _BatchNorm)]
    if not norms or graph.train is None:
        return []
    all_stages = stages(graph, graph.spec_plan)
    if pipeline_problem(graph, all_stages):
        return []
    count = len(all_stages)
    pipeline = graph.pipeline or PipelineConfig(microbatches=count)
    least = max(pipeline.microbatches, count if pipeline.schedule == "1f1b" else 1)
    if least == 1 and (pipeline.dp == 1 or pipeline.sync_bn):
        return []
    script, train = file_names(graph)["pp"], file_names(graph)["train"]
    replicas = f", {pipeline.dp} replicas" if pipeline.dp > 1 else ""
    where = "over every replica's (sync_bn)" if pipeline.sync_bn else "on its replica"
    also = "" if pipeline.sync_bn or pipeline.dp == 1 else " and --sync-bn"
    return [f"{norms[0].pos}: note: {script} runs this BatchNorm"
            f"{f' and {len(norms) - 1} more' if len(norms) > 1 else ''} on micro-batches "
            f"({least} or more per replica by default{replicas}): each micro-batch is "
            f"normalised by its own statistics {where}, and the running stats move once per "
            "micro-batch (num_batches_tracked counts micro-batches), averaged over the replicas "
            f"after each step; for {train}'s losses and stats run --microbatches 1{also} "
            "(docs/pipelining.md, BatchNorm)"]
