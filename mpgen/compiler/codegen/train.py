"""IR -> ``train_<name>.py``: the training script."""

from __future__ import annotations

from dataclasses import dataclass

from mpgen.compiler.codegen.common import (
    _tuple,
    call,
    environment,
    file_names,
    header,
    input_code,
    known,
    optimizer_call,
    synthetic,
    synthetic_like,
)
from mpgen.compiler.frontend.namespace import GLOBALS, Namespace
from mpgen.compiler.ir import Expr, Graph


@dataclass
class TrainContext:
    header: list[str]
    model: str
    model_module: str
    spec_path: str
    file: str
    batch_params: str
    batch_lines: list[str]
    input_vars: str
    target_vars: str
    steps: int
    batch_size: int
    lr: str
    seed: int
    log_every: int
    loss_init: list[str]
    optimizer: str
    outputs: str
    loss_lines: list[str]
    trainable: bool  # False: no parameters, so no optimizer and no backward
    closure: bool  # the optimizer's step takes a closure that recomputes the loss
    optimizer_name: str


def batch_code(graph: Graph, ns) -> tuple[str, list[str], list[str], list[str], dict[str, str]]:
    """make_batch's parameters and body: one line per input and per target
    whose shape is known before the forward pass (see :func:`made_in_batch`).

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
            continue
        var = ns.fresh("target" if len(graph.train.losses) == 1 else f"{loss.output}_target")
        lines.append(f"{var} = {synthetic(loss.target_type, sizes, loss.classes, loss.target)}"
                     f"  # {loss.target_type}")
        targets.append(var)
    return ", ".join(params), lines, inputs, targets, sizes


def made_in_batch(loss) -> bool:
    """Whether make_batch makes the loss's target: not when a dim of the
    output it is for is known only at run time (``?``, NOTE [Symbolic dims]
    in analysis/shapes.py); the loop makes that one shaped like the output."""
    return known(loss.target_type)


#: The names the training scaffold defines: module level, then in ``main``.
_SCAFFOLD_GLOBALS = ("main", "make_batch", "batch_at", "rng_states", "set_rng_states",
                     "save_checkpoint")
_SCAFFOLD_LOCALS = ("args", "parser", "model", "optimizer", "step", "inputs", "targets",
                    "loss", "start", "elapsed", "path", "done", "state", "checkpoint", "error",
                    "interrupted", "on_interrupt", "previous")
#: Modules the training script imports besides those in GLOBALS.
_SCAFFOLD_IMPORTS = frozenset({"pathlib", "random", "signal", "tempfile"})


def _scaffold_names(graph: Graph) -> tuple[dict[str, str], Namespace]:
    """Claim the scaffold's names (``n`` in ``train.py.jinja``) before any
    name derived from the spec; returns them and ``main``'s namespace."""
    ns = Namespace(GLOBALS | _SCAFFOLD_IMPORTS | {graph.name})
    names = {name: ns.claim(name) for name in _SCAFFOLD_GLOBALS}
    names |= {name: ns.claim(name) for name in _SCAFFOLD_LOCALS}
    if graph.train.closure:
        names["closure"] = ns.claim("closure")
    return names, ns


def train_context(graph: Graph) -> tuple[TrainContext, dict[str, str]]:
    names = file_names(graph)
    train = graph.train
    batch_ns = Namespace(GLOBALS | _SCAFFOLD_IMPORTS | {graph.name, *_SCAFFOLD_GLOBALS})
    params, batch_lines, inputs, targets, _ = batch_code(graph, batch_ns)
    scaffold, ns = _scaffold_names(graph)
    plan_devices = {v: n.devices[-1] for n in graph.nodes for v in n.value_names}
    out_vars = [ns.fresh(o) for o in graph.outputs]
    loss_init, loss_lines, parts = [], [], []
    multi = len(train.losses) > 1
    loss_device = plan_devices[train.losses[0].output] if train.losses else "cpu"
    made = 0
    for loss in train.losses:
        fn = ns.fresh(f"{loss.output}_loss_fn" if multi else "loss_fn")
        loss_init.append(f"{fn} = {call(loss.callee, [], loss.kwargs)}")
        out = out_vars[graph.outputs.index(loss.output)]
        device = plan_devices[loss.output]
        if made_in_batch(loss):
            target = f'{scaffold["targets"]}[{made}].to("{device}")'
            made += 1
        else:
            # Shaped like the output: its size is known only at run time.
            like = synthetic_like(loss.target_type, out, loss.classes, loss.target)
            target = f'{like}.to("{device}")'
        if loss.flatten:
            expr = f"{fn}({out}.flatten(0, -2), {target}.flatten())"
        else:
            expr = f"{fn}({out}, {target})"
        if multi:
            var = ns.fresh(f"{loss.output}_loss")
            loss_lines.append(f"{var} = {expr}  # on {device}")
            parts.append(var if device == loss_device else f'{var}.to("{loss_device}")')
        else:
            loss_lines.append(f"{scaffold['loss']} = {expr}  # on {device}")
    if multi:
        loss_lines.append(f"{scaffold['loss']} = {' + '.join(parts)}  # on {loss_device}")
    optimizer = optimizer_call(train, Expr(f"{scaffold['args']}.lr"),
                               f"{scaffold['model']}.parameters()")
    return TrainContext(
        header=header(graph), model=graph.name, model_module=names["model"][:-3],
        spec_path=graph.spec_path, file=names["train"], batch_params=params,
        batch_lines=batch_lines, input_vars=_tuple(inputs), target_vars=_tuple(targets),
        steps=train.steps, batch_size=train.batch_size, lr=repr(train.lr), seed=train.seed,
        log_every=train.log_every, loss_init=loss_init, optimizer=optimizer,
        outputs=_tuple(out_vars) if len(out_vars) > 1 else out_vars[0],
        loss_lines=loss_lines, trainable=graph.total_params > 0, closure=train.closure,
        optimizer_name=train.optimizer,
    ), scaffold


def render_train(graph: Graph) -> str:
    ctx, names = train_context(graph)
    return environment().get_template("train.py.jinja").render(ctx=ctx, n=names)
