"""IR -> ``train_<name>.py``: the spec's facts of training, for the runtime.

The loop, its flags, the data pipeline, the log and the checkpoints are the
output folder's ``mpgen_runtime`` package (``mpgen/runtime``, NOTE [One
runtime per output folder]); this file writes what only the spec knows: the
synthetic batch (``make_batch``), the loss of each output (``forward_loss``),
the optimizer with its parameter groups, the learning-rate schedule, and the
defaults of the flags, in one ``mpgen_runtime.Training``. Its own names are
claimed after the model's class and the spec's modules, and every local from
a namespace that holds the file's names, so a spec name never shadows one.
"""

from __future__ import annotations

from typing import Optional

from mpgen.compiler.codegen.common import (
    _tuple,
    call,
    file_names,
    header,
    input_code,
    known,
    literal,
    synthetic,
    synthetic_like,
    tuple_literal,
)
from mpgen.compiler.codegen.writer import PythonWriter
from mpgen.compiler.frontend.namespace import GLOBALS, Namespace
from mpgen.compiler.ir import DataSource, Expr, Graph, Loss, Scheduler

#: The package a build writes beside the scripts (output.runtime).
RUNTIME = "mpgen_runtime"
#: The names the file defines, claimed in this order after the model's class.
OWN_NAMES = ("make_batch", "forward_loss", "make_losses", "make_optimizer", "make_scheduler",
             "TRAINING")
#: forward_loss's parameters.
_LOSS_PARAMS = ("model", "loss_fns", "inputs", "targets")
#: The flags' defaults where a spec says nothing: the runtime's BASE_DEFAULTS
#: (mpgen/runtime/spec.py, which the compiler does not import: tests/runtime
#: keeps the two equal); a default equal to one is not written.
BASE_DEFAULTS = {"seed": 0, "log_every": 1, "amp": "off", "grad_clip": 0.0, "accumulate": 1,
                 "eval_split": 0.0, "eval_every": 0, "samples": 1024, "workers": 0,
                 "keep_last": 1, "early_stop": 0}
#: The decays of the built-in schedules (mpgen_runtime.lr_factor).
_DECAYS = {"cosine": "cosine decay", "linear": "linear decay", "constant": "then constant"}


def _imported(graph: Graph) -> set[str]:
    """The names the file imports: torch, nn, the spec's modules (``import
    mypkg.losses`` binds mypkg), the runtime and the model's class."""
    return set(GLOBALS) | {m.split(".")[0] for m in graph.train.modules} | {graph.name, RUNTIME}


def own_names(graph: Graph) -> dict[str, str]:
    """The file's names (base -> name), claimed after what it imports."""
    ns = Namespace(_imported(graph))
    return {base: ns.fresh(base) for base in OWN_NAMES}


def module_level(graph: Graph) -> set[str]:
    """The file's module-level names: what a function's locals must not shadow."""
    return _imported(graph) | set(own_names(graph).values())


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


def untrained_note(graph: Graph, out_vars: list[str]) -> str:
    """``  # hn, cn: no loss`` for the outputs ``train.loss`` does not name
    (returned by the model, not trained on); empty when every output has one."""
    trained = {loss.output for loss in graph.train.losses}
    free = [var for var, out in zip(out_vars, graph.outputs) if out not in trained]
    return f"  # {', '.join(free)}: no loss" if free else ""


def loss_expr(loss: Loss, fn: str, out: str, target: str) -> str:
    """The loss of one output (as both scripts compute it)."""
    if loss.flatten:
        return f"{fn}({out}.flatten(0, -2), {target}.flatten())"
    if loss.class_dim is not None and loss.class_dim != 1:
        return f"{fn}({out}.movedim({loss.class_dim}, 1), {target})"
    return f"{fn}({out}, {target})"


def loss_code(graph: Graph) -> tuple[list[str], str]:
    """forward_loss's body, and the device the loss ends on."""
    ns = Namespace(module_level(graph) | set(_LOSS_PARAMS))
    train = graph.train
    devices = {v: node.devices[-1] for node in graph.nodes for v in node.value_names}
    devices |= {out: devices[v] for out, v in graph.aliases if v in devices}
    out_vars = [ns.fresh(o) for o in graph.outputs]
    outputs = _tuple(out_vars) if len(out_vars) > 1 else out_vars[0]
    lines = [f"{outputs} = model(*inputs){untrained_note(graph, out_vars)}"]
    multi = len(train.losses) > 1
    loss_device = devices[train.losses[0].output] if train.losses else "cpu"
    parts, each = [], []
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
        expr = loss_expr(loss, f"loss_fns[{k}]", out, target)
        var = ns.fresh(f"{loss.output}_loss") if multi else "loss"
        lines.append(f"{var} = {expr}  # on {device}")
        if multi:
            parts.append(var if device == loss_device else f'{var}.to("{loss_device}")')
        each.append(f"({_tuple([var, out, target])})")
    if multi:
        lines.append(f"loss = {' + '.join(parts)}  # on {loss_device}")
    lines.append(f"return loss, ({_tuple(each)})")
    return lines, loss_device


def metrics_literal(graph: Graph) -> str:
    """The evaluation's metrics (``ir.TrainConfig.metric_columns``), as
    ``mpgen_runtime.Metric``s; a user's function by its dotted name."""
    made = []
    for column in graph.train.metric_columns():
        metric = column.metric
        kwargs = [("loss", column.loss)] * (column.loss > 0)
        if metric.op == "top_k_accuracy":
            kwargs.append(("k", metric.k))
        if metric.op == "f1":
            kwargs.append(("classes", graph.train.losses[column.loss].classes))
        if metric.function is not None:
            module, _, function = metric.function.partition(":")
            kwargs.append(("function", Expr(f"{module}.{function}")))
        op = "function" if metric.function is not None else metric.op
        made.append(call(f"{RUNTIME}.Metric", [literal(column.name), literal(op)], kwargs))
    return "(" + _tuple(made) + ")"


def _source(source: Optional[DataSource]) -> tuple[Optional[str], dict]:
    """--data's default and the factory's keyword arguments."""
    if source is None:
        return None, {}
    return source.text, dict(source.kwargs)


def optimizer_code(graph: Graph) -> list[str]:
    """make_optimizer's body: the optimizer over ``model`` (or one pipeline
    stage) at ``args.lr``, its other keyword arguments the run's settings
    (the spec's train.optimizer, with --set's changes)."""
    train = graph.train
    own = '"lr", "weight_decay"' if train.no_decay else '"lr"'
    lines = ['settings = args.settings["optimizer"]  # train.optimizer, with --set\'s changes',
             f"kwargs = {RUNTIME}.keywords(settings, {own})"]
    if not train.no_decay:  # the parameters that train (requires_grad: false leaves some out)
        params = ("[p for p in model.parameters() if p.requires_grad]" if graph.frozen_params
                  else "model.parameters()")
    else:
        lines.append('no_decay = tuple(args.settings["no_decay"])')
        params = f'{RUNTIME}.param_groups(model, settings["weight_decay"], no_decay)'
    lines.append(f"return {train.optimizer_callee}({params}, lr=args.lr, **kwargs)")
    return lines


def scheduler_code(schedule: Scheduler) -> tuple[list[str], str]:
    """make_scheduler's body and docstring: the schedule's settings read
    from the run's (the spec's train.scheduler, with --set's changes)."""
    read = 'schedule = args.settings["scheduler"]  # train.scheduler, with --set\'s changes'
    if schedule.built_in:
        factor = (f'{RUNTIME}.lr_factor(done, args.decay_steps or steps, schedule["warmup"], '
                  'floor, schedule["op"])')
        warmup = f"linear warmup over {schedule.warmup} steps, then " if schedule.warmup else ""
        doc = f"{warmup}{_DECAYS[schedule.op]}".capitalize() + (
            f" to {literal(schedule.min_lr)}" if schedule.op != "constant" and schedule.min_lr else "")
        return [read,
                'floor = schedule.get("min_lr", 0.0) / args.lr if args.lr else 0.0',
                f"return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: {factor})"], \
            doc + " (the spec's; --set changes it)."
    lines = [read, f'kwargs = {RUNTIME}.keywords(schedule, "warmup")']
    made = f"torch.optim.lr_scheduler.{schedule.op}(optimizer, **kwargs)"
    if schedule.warmup:
        lines.append('warmup = schedule["warmup"]')
        warm = ("torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup + 1), "
                "total_iters=warmup)")
        made = (f"torch.optim.lr_scheduler.SequentialLR(optimizer, [{warm}, {made}], "
                "milestones=[warmup])")
    return [*lines, f"return {made}"], f"torch's {schedule.op} (the spec's; --set changes it)."


def settings(graph: Graph) -> dict:
    """The spec's train: settings, resolved, as the script holds them
    (mpgen_runtime.Training.settings): what --set changes and the code reads."""
    train = graph.train

    def loss_call(loss: Loss) -> dict:
        given = {"op": loss.op, **dict(loss.kwargs)}
        return given | ({"class_dim": loss.class_dim_given}
                        if loss.class_dim_given is not None else {})

    if train.loss_per_output:
        loss = {item.output: loss_call(item) for item in train.losses}
    else:
        loss = loss_call(train.losses[0]) if train.losses else {"op": "MSELoss"}
    optimizer = {"op": train.optimizer, "lr": train.lr, **dict(train.optimizer_kwargs)}
    if train.no_decay and "weight_decay" not in optimizer:
        optimizer["weight_decay"] = train.weight_decay  # the optimizer's default
    scheduler = None
    if train.scheduler is not None:
        scheduler = {"op": train.scheduler.op, "warmup": train.scheduler.warmup,
                     **dict(train.scheduler.kwargs)}
        if train.scheduler.built_in and train.scheduler.min_lr:
            scheduler["min_lr"] = train.scheduler.min_lr

    def data(source: Optional[DataSource]):
        if source is None or not source.kwargs:
            return None if source is None else source.text
        return {"factory": source.factory, **dict(source.kwargs)}

    return {
        "loss": loss, "optimizer": optimizer, "batch_size": train.batch_size,
        "steps": train.steps, "seed": train.seed,
        "log_every": train.log_every,
        "dims": {name: size for name, size in train.dims if name in train.dims_given
                 and name != "batch"},
        "epochs": train.epochs, "scheduler": scheduler, "grad_clip": train.grad_clip,
        "accumulate": train.accumulate, "amp": train.amp, "no_decay": list(train.no_decay),
        "data": data(train.data), "eval_data": data(train.eval_data),
        "eval_every": train.eval_every, "eval_split": float(train.eval_split),
        "samples": train.samples, "workers": train.workers,
        "monitor": train.monitor, "monitor_mode": train.monitor_mode,
        "keep_last": train.keep_last, "early_stop": train.early_stop,
    }


def defaults(graph: Graph) -> dict:
    """The flags' defaults the spec sets, where they differ from the runtime's."""
    train = graph.train
    data, _ = _source(train.data)
    eval_data, _ = _source(train.eval_data)
    given = {
        "steps": train.steps if train.steps_given else None,
        "epochs": train.epochs, "batch_size": train.batch_size, "lr": train.lr,
        "seed": train.seed, "log_every": train.log_every, "amp": train.amp,
        "grad_clip": float(train.grad_clip or 0.0), "accumulate": train.accumulate,
        "data": data, "eval_data": eval_data, "eval_split": float(train.eval_split),
        "eval_every": train.eval_every, "samples": train.samples, "workers": train.workers,
        "monitor": train.monitor, "monitor_mode": train.monitor_mode,
        "keep_last": train.keep_last, "early_stop": train.early_stop,
    }
    if train.scheduler is not None and train.scheduler.built_in:
        given["decay_steps"] = train.steps if train.steps_given else None
    return {k: v for k, v in given.items()
            if k in ("steps", "batch_size", "lr", "decay_steps") or v != BASE_DEFAULTS.get(k)}


def losses_text(graph: Graph) -> str:
    """``CrossEntropyLoss of cls + HuberLoss of reg``: the loss, in the scripts' docstrings."""
    return " + ".join(f"{loss.op} of {loss.output}" for loss in graph.train.losses)


def layouts_literal(values: list) -> str:
    """A tuple of ints, None and pairs (``batch_dims``, ``classes``)."""
    return "(" + _tuple([tuple_literal(v) if isinstance(v, tuple) else literal(v)
                         for v in values]) + ")"


def shapes_literal(types: list) -> str:
    """Each key's shape as the spec states it, a dim a number or its name
    (``("seq", "batch")``, ``"seq*batch"``, ``"?"``): what the runtime checks
    every batch against (mpgen_runtime.data.check_batch)."""
    return "(" + _tuple([tuple_literal([d if isinstance(d, int) else str(d) for d in t.shape])
                         for t in types]) + ")"


#: The target class indices a torch loss ignores where it takes ``ignore_index``.
_IGNORED = {"CrossEntropyLoss": -100, "NLLLoss": -100}


def class_range(loss: Loss) -> Optional[tuple[int, Optional[int]]]:
    """``(classes, ignore_index)`` of a torch class-index loss's targets
    (ignore_index None: none), what every batch's targets are checked
    against; None for other losses (a user's loss decides its own)."""
    if loss.target != "classes" or loss.module or not isinstance(loss.classes, int):
        return None
    ignored = dict(loss.kwargs).get("ignore_index", _IGNORED.get(loss.op))
    return loss.classes, ignored if isinstance(ignored, int) else None


def _dict_literal(values: dict) -> str:
    return "{" + ", ".join(f"{literal(k)}: {data_literal(v)}" for k, v in values.items()) + "}"


def data_literal(value) -> str:
    """A spec value as Python, mappings and lists too (``Training.settings``)."""
    if isinstance(value, dict):
        return _dict_literal(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(data_literal(v) for v in value) + "]"
    return literal(value)


def memory_literal(devices: tuple) -> str:
    """The plan's peaks (``ir.DeviceMemory``s) as ``{device: bytes}``: what
    ``--memory`` prints beside the measured peak."""
    return _dict_literal({d.device: d.peak for d in devices})


def render_train(graph: Graph) -> str:
    """``train_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    names = file_names(graph)
    n = own_names(graph)
    train = graph.train
    stem = names["model"][:-3]
    w = PythonWriter()
    for line in header(graph):
        w.line(line)
    w.docstring([
        f"Train {graph.name} as {graph.spec_path} says, on {RUNTIME}'s loop (--help: its flags).",
        "",
        "For example:",
        "",
        f"    python {names['train']} --steps 1000 --checkpoint runs/{stem}",
        f"    python {names['train']} --steps 2000 --checkpoint runs/{stem} --resume",
    ])
    w.line()
    w.line("import torch")
    w.line("from torch import nn")
    w.line()
    for module in train.modules:
        w.line(f"import {module}")
    w.line(f"import {RUNTIME}")
    w.line(f"from {stem} import {graph.name}")

    batch_ns = Namespace(module_level(graph))
    params, batch_lines, inputs, targets, _ = batch_code(graph, batch_ns)
    w.line()
    w.line()
    with w.block(f"def {n['make_batch']}({params}) -> tuple[tuple, tuple]"):
        w.docstring([f"{graph.name}'s synthetic inputs and targets, on the CPU (it moves its inputs)."])
        for line in batch_lines:
            code, _, comment = line.partition("  # ")
            w.line(code, comment)
        w.line(f"return ({_tuple(inputs)}), ({_tuple(targets) if targets else ''})")

    loss_lines, loss_device = loss_code(graph)
    w.line()
    w.line()
    with w.block(f"def {n['forward_loss']}(model, loss_fns, inputs, targets)"):
        w.docstring([f"The loss: {losses_text(graph)}, on {loss_device}; and each output's "
                     "loss, output and target (the log's and the metrics')."])
        for line in loss_lines:
            code, _, comment = line.partition("  # ")
            w.line(code, comment)

    w.line()
    w.line()
    with w.block(f"def {n['make_losses']}(settings: dict) -> tuple[nn.Module, ...]"):
        w.docstring(["Each output's loss, with the run's keyword arguments (train.loss, "
                     "with --set's changes)."])
        w.line('loss = settings["loss"]')
        made = []
        for loss in train.losses:
            given = f'loss["{loss.output}"]' if train.loss_per_output else "loss"
            made.append(f'{loss.callee}(**{RUNTIME}.keywords({given}, "class_dim"))')
        w.line(f"return ({_tuple(made)})")

    trainable = graph.trainable_params > 0
    fields = [("model", graph.name), ("spec", literal(graph.spec_path)),
              ("devices", tuple_literal(graph.devices)),
              ("inputs", tuple_literal(t.var for t in graph.inputs)),
              ("targets", tuple_literal(target_key(graph, loss) for loss in train.losses)),
              ("batch_dims", layouts_literal([t.type.batch_dim for t in graph.inputs]
                                             + [loss.batch_layout for loss in train.losses])),
              ("shapes", shapes_literal([t.type for t in graph.inputs]
                                        + [loss.target_type for loss in train.losses])),
              ("dtypes", tuple_literal([t.type.dtype for t in graph.inputs]
                                       + [loss.target_type.dtype for loss in train.losses])),
              ("make_batch", n["make_batch"]),
              ("losses", n["make_losses"]),
              ("forward_loss", n["forward_loss"]),
              ("loss_outputs", tuple_literal(loss.output for loss in train.losses))]
    if any(loss.class_dim is not None for loss in train.losses):
        fields.append(("class_dims", layouts_literal([loss.class_dim for loss in train.losses])))
    if train.metric_columns():
        fields.append(("metrics", metrics_literal(graph)))
    ranges = ([(t.high, None) if t.high else None for t in graph.inputs]
              + [class_range(loss) for loss in train.losses])
    if any(ranges):
        fields.append(("classes", layouts_literal(ranges)))
    if graph.dim_limits:
        fields.append(("dim_limits", layouts_literal(list(graph.dim_limits))))
    if trainable:
        w.line()
        w.line()
        with w.block(f"def {n['make_optimizer']}(model: nn.Module, args) -> torch.optim.Optimizer"):
            for line in optimizer_code(graph):
                code, _, comment = line.partition("  # ")
                w.line(code, comment)
        fields.append(("optimizer", n["make_optimizer"]))
        if train.scheduler is not None:
            body, doc = scheduler_code(train.scheduler)
            w.line()
            w.line()
            with w.block(f"def {n['make_scheduler']}(optimizer: torch.optim.Optimizer, args, "
                         f"steps: int)"):
                w.docstring([doc])
                for line in body:
                    code, _, comment = line.partition("  # ")
                    w.line(code, comment)
            fields.append(("scheduler", n["make_scheduler"]))
        if train.closure:
            fields.append(("closure", "True"))
    # --init fills a key a state dict leaves out (save_pretrained's tied head) from its owner's.
    ties = [tuple_literal((f"{node.name}.{tie.param}", tie.source))
            for node in graph.nodes for tie in node.ties]
    if ties:
        fields.append(("ties", "(" + _tuple(ties) + ")"))
    fields.append(("defaults", _dict_literal(defaults(graph))))
    fields.append(("settings", data_literal(settings(graph))))
    if graph.memory is not None and graph.memory.train:
        fields.append(("memory", memory_literal(graph.memory.train)))
    for key, source in (("data_kwargs", train.data), ("eval_data_kwargs", train.eval_data)):
        kwargs = _source(source)[1]
        if kwargs:
            fields.append((key, _dict_literal(kwargs)))
    facts_and_run(w, n["TRAINING"], f"{RUNTIME}.Training", fields, f"{RUNTIME}.train")
    return w.text()


def facts_and_run(w: PythonWriter, name: str, callee: str, fields: list[tuple[str, str]],
                  run: str) -> None:
    """``name = callee(key=value, ...)``, one field a line, and the script's
    ``if __name__ == "__main__": run(name)`` (both scripts end so)."""
    w.line()
    w.line()
    arguments = ", ".join(f"{key}={value}" for key, value in fields)
    w.line(f"{name} = {callee}({arguments},)")
    w.line()
    w.line()
    with w.block('if __name__ == "__main__"'):
        w.line(f"{run}({name})")
