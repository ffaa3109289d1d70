"""IR -> ``train_<name>.py``: the training script.

The script's fixed parts are ``templates/train.py.jinja``; what depends on the
spec is computed here: the synthetic batch (``make_batch``), the keys and
batch dims of a batch, the loss of each output (``forward_loss``), the
optimizer with its parameter groups, the learning-rate schedule, and the
defaults of every flag. Every name the script defines is claimed from one
:class:`Namespace` first, so a name from the spec never shadows one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mpgen.compiler.codegen.common import (
    _tuple,
    call,
    environment,
    file_names,
    float_literal,
    header,
    input_code,
    known,
    laid_out,
    literal,
    optimizer_call,
    synthetic,
    synthetic_like,
    tuple_literal,
)
from mpgen.compiler.frontend.namespace import GLOBALS, Namespace
from mpgen.compiler.ir import DataSource, Expr, Graph, Loss, Scheduler


@dataclass
class TrainContext:
    header: list[str]
    model: str
    model_module: str
    run_name: str  # runs/<run_name>: the default log folder
    spec_path: str
    spec_literal: str
    file: str
    devices: str  # literals
    device_type: str
    keys: str
    batch_dims: str
    n_inputs: int
    batch_params: str
    batch_lines: list[str]
    input_vars: str
    target_vars: str
    loss_fns: str
    loss_lines: list[str]
    loss_device: str
    classify: bool  # some loss reads class indices: evaluation reports accuracy
    steps: str
    epochs: str
    batch_size: int
    lr: str
    seed: int
    log_every: int
    amp: str
    grad_clip: str
    accumulate: int
    data: str
    data_help: str
    data_kwargs: str
    eval_data: str
    eval_data_kwargs: str
    eval_split: str
    eval_every: int
    samples: int
    workers: int
    optimizer: str
    no_decay: bool
    no_decay_text: str
    no_decay_test: str
    scheduler: str  # the statement making it; "" for none
    plateau: bool  # ReduceLROnPlateau: stepped with a loss
    lr_factor: list[str]  # body of the built-in schedule's function; [] for none
    lr_factor_doc: str
    decay_steps: str  # --decay-steps' default: the spec's run length
    trainable: bool  # False: no parameters, so no optimizer and no backward
    closure: bool  # the optimizer's step takes a closure that recomputes the loss
    optimizer_name: str
    modules: tuple[str, ...]  # user modules of the loss and optimizer classes


#: Names the script defines at module level (``n.*`` in the template), and
#: names main() defines. Claimed in this order after the model's class name,
#: each gets a suffix only if the spec took it first.
_SCAFFOLD_GLOBALS = (
    "DEVICES", "DEVICE_TYPE", "KEYS", "BATCH_DIMS", "AMP_DTYPES", "DATA_FILES", "SPEC",
    "make_batch", "SyntheticData", "TensorData", "read_tensors", "load_data", "as_batch",
    "collate", "epoch_batches", "batches", "forward_loss", "hits", "evaluate", "param_groups",
    "lr_factor", "rng_states", "set_rng_states", "save_checkpoint", "check_args", "check_devices",
    "one_line", "Log", "main",
)
_SCAFFOLD_LOCALS = (
    "parser", "args", "path", "data", "eval_data", "held_out", "cut", "per_epoch", "last",
    "model", "loss_fns", "optimizer", "scheduler", "scaler", "autocast", "done", "state",
    "started", "checkpoint", "error", "interrupted", "on_interrupt", "log", "stream", "previous",
    "step", "batch", "closure", "loss", "micro", "epoch", "eval_loss", "accuracy",
)
#: Names the script imports besides those in GLOBALS.
_SCAFFOLD_IMPORTS = frozenset({"csv", "importlib", "itertools", "pathlib", "random", "signal",
                               "tempfile", "DataLoader", "Dataset", "Subset", "tqdm",
                               "SummaryWriter"})
#: forward_loss's parameters.
_LOSS_PARAMS = ("model", "loss_fns", "inputs", "targets", "count")

#: What the built-in schedules do after the warmup (``progress`` runs from 0 to 1).
_SCHEDULES = {
    "cosine": ("cosine decay to ``floor`` at ``steps``",
               "floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))"),
    "linear": ("linear decay to ``floor`` at ``steps``", "floor + (1 - floor) * (1 - progress)"),
    "constant": ("then constant", "1.0"),
}
#: The torch classes of ``no_decay: [norms]``: every normalization layer with parameters.
_NORMS = ("nn.LayerNorm", "nn.RMSNorm", "nn.GroupNorm", "nn.BatchNorm1d", "nn.BatchNorm2d",
          "nn.BatchNorm3d", "nn.SyncBatchNorm", "nn.InstanceNorm1d", "nn.InstanceNorm2d",
          "nn.InstanceNorm3d")


def batch_code(graph: Graph, ns) -> tuple[str, list[str], list[str], list[str], dict[str, str]]:
    """make_batch's parameters and body: one line per input and per target
    whose shape is known before the forward pass (see :func:`made_in_batch`;
    None for the others, which forward_loss makes shaped like the output).

    The batch size comes first, without a default (the loop passes it), the
    other symbolic dims after it with their training sizes as defaults,
    whatever the order of the dims in the inputs (``[seq, batch]``)."""
    sizes: dict[str, str] = {}
    params = []
    dims = dict(graph.train.dims)
    var = ns.fresh("batch_size")
    params.append(f"{var}: int")
    if "batch" in dims:
        sizes["batch"] = var
    for name, size in dims.items():
        if name != "batch":
            sizes[name] = ns.fresh(name)
            params.append(f"{sizes[name]}: int = {size}")
    lines, inputs = input_code(graph, ns, sizes)
    targets = []
    for loss in graph.train.losses:
        if not made_in_batch(loss):
            targets.append("None")
            continue
        var = ns.fresh(target_key(graph, loss))
        lines.append(f"{var} = {synthetic(loss.target_type, sizes, loss.classes, loss.target)}"
                     f"  # {loss.target_type}")
        targets.append(var)
    return ", ".join(params), lines, inputs, targets, sizes


def made_in_batch(loss) -> bool:
    """Whether make_batch makes the loss's target: not when a dim of the
    output it is for is known only at run time (``?``, NOTE [Symbolic dims]
    in analysis/shapes.py); forward_loss makes that one shaped like the output."""
    return known(loss.target_type)


def target_key(graph: Graph, loss: Loss) -> str:
    """The key of a loss's target in a batch and a --data file."""
    return "target" if len(graph.train.losses) == 1 else f"{loss.output}_target"


def loss_code(graph: Graph, n: dict[str, str]) -> tuple[list[str], str]:
    """forward_loss's body, and the device the loss ends on."""
    ns = Namespace(_module_level(graph, n) | set(_LOSS_PARAMS))
    train = graph.train
    devices = {v: node.devices[-1] for node in graph.nodes for v in node.value_names}
    out_vars = [ns.fresh(o) for o in graph.outputs]
    outputs = _tuple(out_vars) if len(out_vars) > 1 else out_vars[0]
    lines = [f"{outputs} = model(*inputs)"]
    multi = len(train.losses) > 1
    loss_device = devices[train.losses[0].output] if train.losses else "cpu"
    parts, hits = [], []
    for k, loss in enumerate(train.losses):
        out = out_vars[graph.outputs.index(loss.output)]
        device = devices[loss.output]
        target = ns.fresh(target_key(graph, loss))
        if made_in_batch(loss):
            lines.append(f'{target} = targets[{k}].to("{device}")')
        else:
            # Shaped like the output: its size is known only at run time.
            like = synthetic_like(loss.target_type, out, loss.classes, loss.target)
            lines.append(f"{target} = targets[{k}] if targets[{k}] is not None else {like}")
            lines.append(f'{target} = {target}.to("{device}")')
        fn = f"loss_fns[{k}]"
        if loss.flatten:
            expr = f"{fn}({out}.flatten(0, -2), {target}.flatten())"
        elif loss.class_dim is not None and loss.class_dim != 1:
            expr = f"{fn}({out}.movedim({loss.class_dim}, 1), {target})"
        else:
            expr = f"{fn}({out}, {target})"
        if loss.class_dim is not None:
            hits.append(f"{n['hits']}({out}, {target}, {loss.class_dim})")
        if multi:
            var = ns.fresh(f"{loss.output}_loss")
            lines.append(f"{var} = {expr}  # on {device}")
            parts.append(var if device == loss_device else f'{var}.to("{loss_device}")')
        else:
            lines.append(f"loss = {expr}  # on {device}")
    if multi:
        lines.append(f"loss = {' + '.join(parts)}  # on {loss_device}")
    if hits:
        lines.append(f"return loss, [{', '.join(hits)}] if count else []")
    else:
        lines.append("return loss, []")
    return lines, loss_device


def _scaffold_names(graph: Graph) -> tuple[dict[str, str], Namespace]:
    """The scaffold's names (``n`` in ``train.py.jinja``), claimed before any
    name derived from the spec but after the model's class, which keeps its name."""
    packages = {m.split(".")[0] for m in graph.train.modules}  # import mypkg.losses binds mypkg
    ns = Namespace(GLOBALS | _SCAFFOLD_IMPORTS | packages | {graph.name})
    names = {name: ns.fresh(name) for name in _SCAFFOLD_GLOBALS + _SCAFFOLD_LOCALS}
    return names, ns


def _module_level(graph: Graph, n: dict[str, str]) -> set[str]:
    """The script's module-level names: what a function's locals must not shadow."""
    packages = {m.split(".")[0] for m in graph.train.modules}
    return (set(GLOBALS | _SCAFFOLD_IMPORTS | packages | {graph.name})
            | {n[k] for k in _SCAFFOLD_GLOBALS})


def _source(source: Optional[DataSource]) -> tuple[str, str]:
    """``--data``'s default and the factory's keyword arguments, as literals."""
    if source is None:
        return "None", "{}"
    kwargs = "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in source.kwargs) + "}"
    return literal(source.text), kwargs


def _optimizer(graph: Graph, n: dict[str, str]) -> tuple[str, str]:
    """The optimizer's construction, and (with ``no_decay``) the test that
    param_groups applies to each parameter."""
    train = graph.train
    lr = Expr(f"{n['args']}.lr")
    if not train.no_decay:
        return optimizer_call(train, lr, f"{n['model']}.parameters()"), ""
    kwargs = dict(train.optimizer_kwargs)
    kwargs.pop("weight_decay", None)  # in the groups: train.weight_decay, written or default
    groups = f"{n['param_groups']}({n['model']}, {literal(train.weight_decay)})"
    optimizer = call(train.optimizer_callee, [groups], [("lr", lr), *kwargs.items()])
    tests = []
    if "biases" in train.no_decay:
        tests.append('name.endswith("bias")')
    if "norms" in train.no_decay:
        tests.append(f"isinstance(module, ({', '.join(_NORMS)}))")
    if "embeddings" in train.no_decay:
        tests.append("isinstance(module, (nn.Embedding, nn.EmbeddingBag))")
    return optimizer, "no_decay = " + " or ".join(tests)


def _scheduler(schedule: Optional[Scheduler], n: dict[str, str]) -> tuple[str, list[str], str]:
    """The statement making the scheduler; the body and docstring of the
    built-in schedule's function (empty for a torch class)."""
    if schedule is None:
        return "", [], ""
    sched, opt = n["scheduler"], n["optimizer"]
    if schedule.built_in:
        doc, after = _SCHEDULES[schedule.op]
        floor = (f"{literal(schedule.min_lr)} / {n['args']}.lr if {n['args']}.lr else 0.0"
                 if schedule.min_lr else "0.0")
        statement = (f"{sched} = torch.optim.lr_scheduler.LambdaLR({opt}, lambda done: "
                     f"{n['lr_factor']}(done, {n['args']}.decay_steps or {n['last']}, {schedule.warmup}, {floor}))")
        body = [
            "if step < warmup:",
            "    return (step + 1) / (warmup + 1)",
            "progress = min((step - warmup) / max(steps - warmup, 1), 1.0)",
            f"return {after}",
        ]
        if schedule.op == "constant":
            body[2:] = ["return 1.0"]
        warmup = "linear warmup over ``warmup`` steps, " if schedule.warmup else ""
        return statement, body, f"{warmup}{doc}."
    made = call(f"torch.optim.lr_scheduler.{schedule.op}", [opt], schedule.kwargs)
    if schedule.warmup:
        factor = float_literal(1 / (schedule.warmup + 1))
        warm = (f"torch.optim.lr_scheduler.LinearLR({opt}, start_factor={factor}, "
                f"total_iters={schedule.warmup})")
        made = (f"torch.optim.lr_scheduler.SequentialLR({opt}, [{warm}, {made}], "
                f"milestones=[{schedule.warmup}])")
    return f"{sched} = {made}", [], ""


_DATA_HELP = "FILE.pt/.npz/.safetensors, or module:function returning a Dataset or DataLoader"


def train_context(graph: Graph) -> tuple[TrainContext, dict[str, str]]:
    names = file_names(graph)
    train = graph.train
    n, _ = _scaffold_names(graph)
    batch_ns = Namespace(_module_level(graph, n))
    params, batch_lines, inputs, targets, _ = batch_code(graph, batch_ns)
    keys = [t.var for t in graph.inputs] + [target_key(graph, loss) for loss in train.losses]
    dims = ([t.type.batch_dim for t in graph.inputs]
            + [loss.target_type.batch_dim for loss in train.losses])
    loss_lines, loss_device = loss_code(graph, n)
    optimizer, no_decay_test = _optimizer(graph, n)
    scheduler, lr_factor, lr_factor_doc = _scheduler(train.scheduler, n)
    data, data_kwargs = _source(train.data)
    eval_data, eval_kwargs = _source(train.eval_data)
    cuda = any(d.startswith("cuda") for d in graph.devices)
    default_data = "synthetic data" if train.data is None else train.data.text
    return TrainContext(
        header=header(graph), model=graph.name, model_module=names["model"][:-3],
        run_name=names["model"][:-3], spec_path=graph.spec_path,
        spec_literal=literal(graph.spec_path), file=names["train"],
        devices=tuple_literal(graph.devices), device_type=literal("cuda" if cuda else "cpu"),
        keys=tuple_literal(keys), batch_dims=tuple_literal(dims),
        n_inputs=len(graph.inputs), batch_params=params, batch_lines=batch_lines,
        input_vars=_tuple(inputs), target_vars=_tuple(targets) if targets else "",
        loss_fns=_tuple([call(loss.callee, [], loss.kwargs) for loss in train.losses]),
        loss_lines=loss_lines, loss_device=loss_device,
        classify=any(loss.class_dim is not None for loss in train.losses),
        steps=str(train.steps) if train.steps_given else "None",
        epochs=literal(train.epochs), batch_size=train.batch_size, lr=float_literal(train.lr),
        seed=train.seed, log_every=train.log_every, amp=literal(train.amp),
        grad_clip=literal(float(train.grad_clip or 0.0)), accumulate=train.accumulate,
        data=data, data_help=literal(f"{_DATA_HELP} (default: {default_data})".replace("%", "%%")),
        data_kwargs=data_kwargs, eval_data=eval_data, eval_data_kwargs=eval_kwargs,
        eval_split=literal(float(train.eval_split)), eval_every=train.eval_every,
        samples=train.samples, workers=train.workers, optimizer=optimizer,
        no_decay=bool(train.no_decay), no_decay_text=", ".join(train.no_decay),
        no_decay_test=no_decay_test, scheduler=scheduler,
        plateau=train.scheduler is not None and train.scheduler.op == "ReduceLROnPlateau",
        lr_factor=lr_factor, lr_factor_doc=lr_factor_doc,
        decay_steps=str(train.steps) if train.steps_given else "None", trainable=graph.total_params > 0,
        closure=train.closure, optimizer_name=train.optimizer, modules=train.modules,
    ), n


def render_train(graph: Graph) -> str:
    """``train_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    ctx, names = train_context(graph)
    text = environment().get_template("train.py.jinja").render(ctx=ctx, n=names)
    return laid_out(text, names, ctx.file)
