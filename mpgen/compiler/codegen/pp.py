"""IR -> ``pp_<name>.py``: the model as a pipeline of processes under torchrun.

# NOTE: [Pipeline program]
# One stage per section of the spec's own forward plan (``Graph.spec_plan``,
# before --device-map; NOTE [Pipeline stages]), one ``StageK(nn.Module)``
# class each, wired with ``torch.distributed.pipelining``. A stage class
# builds only its layers, under the attribute names of the single-process
# model, so its state dict holds exactly that model's keys for those layers:
# instances of a repeated layer held by other stages are ``Elsewhere``
# placeholders (no parameters), which keeps ``h.6.weight`` at index 6. A
# stage's forward is its section's statements (codegen/model.py's ``_step``)
# without the moves: PipelineStage delivers what it takes on its rank's
# device, and factories make their tensors on the device of what it takes.
# A tied parameter whose owner is on another stage is a parameter of its own
# here (a copy); the script makes the copies equal at the start and sums
# their gradients over the ranks holding them after each backward, as
# Megatron does for first- and last-stage embeddings.
#
# NOTE: [Micro-batch losses]
# The schedules average the micro-batches' losses (their gradients are
# divided by M), and the log shows that mean. M divides the batch (a stage
# receives into buffers shaped by the first micro-batch, so they must be
# equal), so for a mean loss that mean is the single-process script's loss
# of the whole batch; a summed loss is multiplied by M. A batch-coupled
# layer (BatchNorm) still sees micro-batches, and differs.
#
# The data pipeline (--data, synthetic samples, the seeded order), the
# checkpoint helpers, the parameter groups and the built-in learning-rate
# schedule are the training script's, imported from train_<name>.py; block
# classes are the model module's. A model that cannot run as a pipeline
# still gets the file (the build's other files are unaffected): run, it
# says why and exits with status 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from mpgen.compiler.codegen import train as train_codegen
from mpgen.compiler.codegen.common import (
    Names,
    _tuple,
    call,
    environment,
    file_names,
    header,
    laid_out,
    literal,
    string_literal,
    synthetic_like,
    tuple_literal,
)
from mpgen.compiler.codegen.model import _constructor, _imports, _initialization, _step, _variables
from mpgen.compiler.codegen.writer import PythonWriter
from mpgen.compiler.frontend.namespace import GLOBALS, Namespace
from mpgen.compiler.ir import Expr, Graph, Loss, Node, OpKind, Step, unit_labels
from mpgen.compiler.placement.stages import Stage, stages

#: Names the script defines or imports at module level (``n.*`` in
#: ``pp.py.jinja``), then names main() and run() define; claimed after the
#: spec's block classes, which keep their names.
_SCAFFOLD_GLOBALS = (
    "environ", "pathlib", "dist", "PipelineStage", "ScheduleGPipe", "Schedule1F1B",
    "ScheduleInterleaved1F1B", "TensorChunkSpec", "_Replicate", "single", "Elsewhere",
    "STAGES", "STAGE_DEVICES", "DEVICE_TYPE", "SCHEDULES", "N_INPUTS", "INPUT_DIMS",
    "TARGET_DIMS", "TIES", "PROBLEM", "stage_loss", "pick", "sendable", "examples", "placement", "stop", "merge",
    "tie_groups", "follow_owners", "sync_ties", "clip_gradients", "Log", "run", "main",
)
#: The modules the program imports under their own names.
_SCRIPT_MODULES = frozenset({"argparse", "csv", "math", "sys", "time"})
_SCAFFOLD_LOCALS = (
    "parser", "args", "world", "rank", "ranks", "device", "mine", "modules", "full", "k",
    "missing", "groups", "optimizers", "schedulers", "done", "state", "path", "data",
    "per_epoch", "last", "feeds", "stream", "pipeline", "schedule", "loss_fns", "current",
    "autocast", "log", "step", "batch", "inputs", "target", "losses", "loss", "epoch",
    "save_stages", "module", "optimizer", "scheduler", "started", "error", "shapes", "found",
)
_LOSS_PARAMS = ("outputs", "index", "targets", "loss_fns", "microbatches")


@dataclass
class PPContext:
    header: list[str]
    model: str
    spec_path: str
    file: str
    train_module: str
    model_module: str
    problem: str  # why the model cannot run as a pipeline; "" when it can
    problem_literal: str
    imports: list[str]  # torch, nn, F, user modules: what the stage classes use
    train_modules: tuple[str, ...]  # user modules of the loss and optimizer classes
    pipelining: list[str]  # the imports from torch.distributed.pipelining
    blocks: str  # the model module's block classes the stages build, "" for none
    classes: str  # Elsewhere (when needed) and the stage classes
    stage_names: str
    stage_devices: str
    n_stages: int
    device_type: str
    schedule: str
    microbatches: int
    n_inputs: int
    input_dims: str
    target_dims: str
    replicate: bool  # some input has no batch dim: each micro-batch gets it whole
    ties: str
    follow_owners: bool  # no_decay's two groups and a tie across stages: copies follow the owner
    loss_lines: list[str]
    loss_fns: str
    optimizer: str
    scheduler: str
    steps: str
    decay_steps: str
    epochs: str
    batch_size: int
    lr: str
    seed: int
    log_every: int
    amp: str
    grad_clip: str
    data: str
    data_kwargs: str
    data_help: str
    samples: int
    workers: int
    run_name: str


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
    if graph.total_params == 0:
        return f"{graph.name} has no parameters, so there is nothing to train"
    if train.closure:
        return (f"{train.optimizer} evaluates the loss several times per step (a closure); "
                "a pipeline schedule runs each micro-batch's forward and backward once")
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
            for node, step in held:
                if not node.op.has_module:
                    continue
                ctor = _constructor(node)
                if node.repeat is None:
                    w.line(f"self.{node.name} = {ctor}")
                    continue
                parts = []
                if step.start:
                    w.comment(f"{node.name}.0-{step.start - 1} are on earlier stages; "
                              f"placeholders keep the indices of {node.name}.{step.start}-"
                              f"{step.stop - 1}")
                    parts.append(f"[{elsewhere}() for _ in range({step.start})]")
                parts.append(f"[{ctor} for _ in range({step.stop - step.start})]")
                w.line(f"self.{node.name} = nn.ModuleList({' + '.join(parts)})")
            for node, _ in held:
                for tie in node.ties:
                    if owners[tie.owner] == stage.index:
                        w.line(f"self.{node.name}.{tie.param} = self.{tie.source}")
                    else:
                        w.comment(f"{node.name}.{tie.param}: a copy of {tie.source} (stage "
                                  f"{owners[tie.owner]}), kept equal by the script (TIES)")
            _initialization(w, dataclasses.replace(graph, nodes=tuple(n for n, _ in held)))
        w.line()
        params = ", ".join(["self", *(f"{v}: torch.Tensor" for v in stage.takes)])
        with w.block(f"def forward({params}) -> tuple[torch.Tensor, ...]"):
            names = _names(graph)
            for t in stage.section.transfers:
                if t.src_var.startswith("self.") or t.dst_var == t.src_var:
                    continue  # a tied parameter's copy is this stage's own; already here
                w.line(f"{t.dst_var} = {t.src_var}", str(t.type))
            device = Expr(f"{stage.takes[0]}.device") if stage.takes else None
            for node, step in held:
                _step(w, node, dataclasses.replace(step, tied=()), names, device=device)
            w.line(f"return {'(' + _tuple(stage.gives) + ')'}")


def _names(graph: Graph) -> Names:
    return Names({}, _variables(graph.inputs, graph.nodes))


def _classes(graph: Graph, all_stages: tuple[Stage, ...], n: dict[str, str],
             stage_names: list[str]) -> str:
    """Elsewhere (when needed) and the stage classes, in black's layout from
    the first class on (the template puts the blank lines before it)."""
    w = PythonWriter()
    owners = _stage_of(all_stages)
    if any(step.start for s in all_stages for _, step in _stage_nodes(graph, s)):
        w.line()
        w.line()
        with w.block(f"class {n['Elsewhere']}(nn.Module)"):
            w.docstring(["An instance of a repeated layer that another stage holds: no parameters,",
                         "so this stage's instances keep their indices (and state-dict keys)."])
            w.line()
            with w.block("def forward(self, *args) -> None"):
                w.line('raise RuntimeError("this instance is held by another stage")')
    for stage, name in zip(all_stages, stage_names):
        _stage_class(w, graph, stage, name, n["Elsewhere"], owners)
    return w.text().lstrip("\n")


def _ties(graph: Graph, all_stages: tuple[Stage, ...]) -> str:
    """TIES: one entry per parameter shared across stages: the owner's (stage,
    key) first, then each copy's."""
    owners = _stage_of(all_stages)
    groups: dict[str, list[tuple[int, str]]] = {}
    for node in graph.nodes:
        for tie in node.ties:
            if owners[tie.owner] != owners[node.name]:
                group = groups.setdefault(tie.source, [(owners[tie.owner], tie.source)])
                group.append((owners[node.name], f"{node.name}.{tie.param}"))
    entries = ["(" + ", ".join(f"({k}, {string_literal(key)})" for k, key in group) + ")"
               for group in groups.values()]
    return "(" + _tuple(entries) + ")"


# -- the loss -----------------------------------------------------------------------

def _loss_expr(loss: Loss, fn: str, out: str, target: str) -> str:
    """The loss of one output, as the training script computes it."""
    if loss.flatten:
        return f"{fn}({out}.flatten(0, -2), {target}.flatten())"
    if loss.class_dim is not None and loss.class_dim != 1:
        return f"{fn}({out}.movedim({loss.class_dim}, 1), {target})"
    return f"{fn}({out}, {target})"


def _loss_lines(graph: Graph, n: dict[str, str], reserved: set[str]) -> list[str]:
    """stage_loss's body: the outputs unpacked, each loss on its micro-batch's
    targets, so that the schedule's mean over micro-batches is the batch's
    loss (NOTE [Micro-batch losses])."""
    ns = Namespace(reserved | set(_LOSS_PARAMS))
    outs = [ns.fresh(o) for o in graph.outputs]
    if len(outs) == 1:  # the schedule passes a stage's one output without its tuple
        lines = [f"{outs[0]} = outputs[0] if isinstance(outputs, tuple) else outputs"]
    else:
        lines = [f"{_tuple(outs)} = outputs"]
    losses = graph.train.losses
    parts = []
    for k, loss in enumerate(losses):
        out = outs[graph.outputs.index(loss.output)]
        target = ns.fresh("target" if len(losses) == 1 else f"{loss.output}_target")
        lines.append(f"{target} = {n['pick']}(targets[{k}], {n['TARGET_DIMS']}[{k}], index)")
        if not train_codegen.made_in_batch(loss):
            like = synthetic_like(loss.target_type, out, loss.classes, loss.target)
            lines.append(f"{target} = ({target} if {target} is not None else {like})"
                         f".to({out}.device)")
        part = ns.fresh(f"{loss.output}_loss") if len(losses) > 1 else "loss"
        scale = " * microbatches" if dict(loss.kwargs).get("reduction") == "sum" else ""
        lines.append(f"{part} = {_loss_expr(loss, f'loss_fns[{k}]', out, target)}{scale}")
        parts.append(part)
    if len(parts) > 1:
        lines.append(f"loss = {' + '.join(parts)}")
    lines.append("return loss")
    return lines


# -- the script ---------------------------------------------------------------------

def _pipelining_imports(n: dict[str, str], replicate: bool) -> list[str]:
    """``from torch.distributed.pipelining[.microbatch] import ...``, each name
    under its own unless the spec took it (``as``)."""
    modules = {
        "torch.distributed.pipelining": ["PipelineStage", "Schedule1F1B", "ScheduleGPipe",
                                         "ScheduleInterleaved1F1B"],
        "torch.distributed.pipelining.microbatch": ["TensorChunkSpec"]
        + (["_Replicate"] if replicate else []),
    }
    return [f"from {module} import "
            + ", ".join(name if n[name] == name else f"{name} as {n[name]}" for name in names)
            for module, names in modules.items()]


def _scaffold_names(graph: Graph) -> dict[str, str]:
    blocks = {b.name for b in graph.blocks}
    users = {n.op.module.split(".")[0] for n in graph.nodes if n.op.kind is OpKind.USER}
    users |= {m.split(".")[0] for m in graph.train.modules}  # import mypkg.losses binds mypkg
    ns = Namespace(GLOBALS | blocks | users | _SCRIPT_MODULES)
    return {name: ns.fresh(name) for name in _SCAFFOLD_GLOBALS + _SCAFFOLD_LOCALS}


def pp_context(graph: Graph) -> tuple[PPContext, dict[str, str]]:
    names = file_names(graph)
    train = graph.train
    n = _scaffold_names(graph)
    all_stages = stages(graph, graph.spec_plan)
    problem = pipeline_problem(graph, all_stages) or ""
    stage_ns = Namespace(set(n.values()) | {b.name for b in graph.blocks} | GLOBALS)
    stage_names = [stage_ns.fresh(f"Stage{s.index}") for s in all_stages]
    tctx, tn = train_codegen.train_context(graph)
    single = n["single"]
    # The training script's optimizer and schedule, over one stage's module.
    mapped = dict(tn, model=n["module"], optimizer=n["optimizer"], scheduler=n["scheduler"],
                  args=n["args"], last=n["last"], param_groups=f"{single}.{tn['param_groups']}",
                  lr_factor=f"{single}.{tn['lr_factor']}")
    optimizer, _ = train_codegen._optimizer(graph, mapped)
    scheduler, _, _ = train_codegen._scheduler(train.scheduler, mapped)
    if train.scheduler is not None and train.scheduler.op == "ReduceLROnPlateau":
        scheduler = ""  # stepped with a loss every rank would need; not in the pipeline
    dims = [t.type.batch_dim for t in graph.inputs]
    ties = _ties(graph, all_stages)
    imports = _imports(graph)
    used_blocks = sorted({node.op.callee for s in all_stages for node, _ in _stage_nodes(graph, s)
                          if node.op.kind is OpKind.BLOCK})
    cuda = any(d.startswith("cuda") for d in graph.devices)
    reserved = ({n[k] for k in _SCAFFOLD_GLOBALS} | set(GLOBALS) | {b.name for b in graph.blocks}
                | _SCRIPT_MODULES)
    return PPContext(
        header=header(graph), model=graph.name, spec_path=graph.spec_path,
        file=names["pp"], train_module=names["train"][:-3], model_module=names["model"][:-3],
        problem=problem, problem_literal=literal(problem), imports=imports,
        train_modules=tuple(m for m in train.modules if f"import {m}" not in imports),
        pipelining=_pipelining_imports(n, any(d is None for d in dims)), blocks=", ".join(used_blocks),
        classes=_classes(graph, all_stages, n, stage_names) if not problem else "",
        stage_names="(" + _tuple(stage_names) + ")",
        stage_devices=tuple_literal(s.device for s in all_stages),
        n_stages=len(all_stages), device_type=literal("cuda" if cuda else "cpu"),
        schedule=literal(graph.pipeline.schedule if graph.pipeline else "1f1b"),
        microbatches=graph.pipeline.microbatches if graph.pipeline else len(all_stages),
        n_inputs=len(graph.inputs), input_dims=tuple_literal(dims),
        target_dims=tuple_literal(loss.target_type.batch_dim for loss in train.losses),
        replicate=any(d is None for d in dims), ties=ties,
        follow_owners=bool(train.no_decay) and ties != "()",
        loss_lines=_loss_lines(graph, n, reserved) if not problem else [],
        loss_fns=_tuple([call(loss.callee, [], loss.kwargs) for loss in train.losses]),
        optimizer=optimizer, scheduler=scheduler, steps=tctx.steps, decay_steps=tctx.decay_steps, epochs=tctx.epochs,
        batch_size=tctx.batch_size, lr=tctx.lr, seed=tctx.seed, log_every=tctx.log_every,
        amp=literal(train.amp if train.amp != "fp16" else "off"), grad_clip=tctx.grad_clip,
        data=tctx.data, data_kwargs=tctx.data_kwargs, data_help=tctx.data_help,
        samples=tctx.samples, workers=tctx.workers, run_name=f"pp_{tctx.run_name}",
    ), n | {"tn": tn}


def render_pp(graph: Graph) -> str:
    """``pp_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    ctx, names = pp_context(graph)
    tn = names.pop("tn")
    text = environment().get_template("pp.py.jinja").render(ctx=ctx, n=names, t=tn)
    return laid_out(text, names | tn, ctx.file)
