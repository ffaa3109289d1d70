"""Resolve ``train:`` into a :class:`~mpgen.compiler.ir.TrainConfig`.

Losses and optimizers are looked up in ``torch.nn`` and ``torch.optim`` and
their keyword arguments checked against the real signatures. A spec whose
training script would crash is refused here, at the offending key: the loss
is built and computed on a sample batch, and the optimizer is built and takes
one step on sample parameters (on the CPU, a few elements), so that whatever
torch says about a bad value (``reduction: bogus``, ``lr: -1``) is a build
error rather than a crash at the script's first step; so is a scheduler,
built on that sample optimizer. The data settings are checked without running
anything: a factory's module must be one the import policy allows (its source
is read and parsed, never imported at build time). The synthetic targets
of the generated training script follow from the loss and (filled in by
``analysis.targets``) the inferred output shape:

- class-index losses (``CrossEntropyLoss``, ``NLLLoss``, ``MultiMarginLoss``):
  integer targets in ``[0, C)``, shaped like the output without its class
  dim: dim 1 by PyTorch's convention (``[N, C]``, or ``[N, C, H, W]`` for
  segmentation), the last dim when dim 1 is symbolic and the last is a number
  (``[batch, seq, vocab]``, flattened to ``[N*seq, vocab]`` as language
  models are trained), or the loss's ``class_dim:``;
- ``BCELoss``/``BCEWithLogitsLoss``/``KLDivLoss``: values in ``[0, 1)`` shaped like the output;
- every other single-target loss (``MSELoss``, ``L1Loss``, ``HuberLoss``, …):
  normal noise shaped like the output.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import lr_scheduler

from mpgen.compiler.frontend import imports, ops
from mpgen.compiler.frontend.limits import MAX_TRAIN_SIZE
from mpgen.compiler.ir import DataSource, Graph, Loss, Metric, OpKind, Scheduler, TrainConfig
from mpgen.errors import Collector, Position, did_you_mean, shown
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import (FACTORY, CallSpec, DataSpec, MetricSpec, SchedulerSpec,
                                      TrainSpec)

_CLASS_LOSSES = {"CrossEntropyLoss", "NLLLoss", "MultiMarginLoss"}
_PROB_LOSSES = {"BCELoss", "BCEWithLogitsLoss", "KLDivLoss", "MultiLabelSoftMarginLoss"}
_PAIR_LOSSES = {"CosineEmbeddingLoss", "MarginRankingLoss", "TripletMarginLoss",
                "TripletMarginWithDistanceLoss", "CTCLoss", "GaussianNLLLoss",
                "PoissonNLLLoss", "AdaptiveLogSoftmaxWithLoss", "MultiLabelMarginLoss"}
#: Losses with parameters of their own, which the optimizer (built over the
#: model's parameters) would never train.
_LOSSES_WITH_WEIGHTS = {"LinearCrossEntropyLoss"}
#: Layers whose output is not confined to [0, 1], as ``BCELoss`` needs.
_UNBOUNDED_LAYERS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding,
                     nn.EmbeddingBag, nn.RNNBase)
#: Optimizers that treat all parameters as one vector (``torch.cat`` of every
#: gradient), so they need every parameter on one device; checked after
#: placement (``placement.place``).
_ONE_DEVICE_OPTIMIZERS = {"LBFGS"}
#: How many times the build's sample step may evaluate the closure.
_CLOSURE_CALLS = 5
#: The seeds ``torch.manual_seed`` takes.
_SEEDS = (-(2**63), 2**64 - 1)
#: How torch's messages name some keywords, to point at the one at fault.
_SPELLED = {"lr": "learning rate", "eps": "epsilon", "betas": "beta"}
#: Size of symbolic dims other than ``batch`` when ``train.dims`` is silent.
DEFAULT_DIM = 16
#: ``torch.optim.lr_scheduler`` classes a spec cannot use: what a spec cannot write.
_REFUSED_SCHEDULERS = {
    "SequentialLR": "chains other schedulers",
    "ChainedScheduler": "chains other schedulers",
    "LambdaLR": "takes a Python function",
    "MultiplicativeLR": "takes a Python function",
    "LRScheduler": "is the base class of the schedules, not one",
}
#: A scheduler's arguments that the training script passes, or that torch deprecates.
_SCHEDULER_OWN = ("optimizer", "last_epoch", "verbose")
#: What a built-in schedule takes.
_BUILT_IN_KEYS = ("warmup", "min_lr")


def loss_names() -> list[str]:
    return [n for n in ops.nn_module_names() if n.endswith("Loss")]


def optimizer_names() -> list[str]:
    return sorted(
        n for n in dir(torch.optim)
        if inspect.isclass(getattr(torch.optim, n))
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    )


def scheduler_names() -> list[str]:
    """The ``torch.optim.lr_scheduler`` classes a spec may name."""
    return sorted(
        name for name, cls in vars(lr_scheduler).items()
        if inspect.isclass(cls) and not name.startswith("_")
        and cls.__module__ == lr_scheduler.__name__
        and (issubclass(cls, lr_scheduler.LRScheduler) or name == "ReduceLROnPlateau")
        and name not in _REFUSED_SCHEDULERS
    )


def resolve_train(graph: Graph, spec: Optional[TrainSpec], source: SourceMap,
                  project: Optional[imports.Project] = None) -> Graph:
    """The graph with the training script's settings (defaults when ``train``
    is absent) and the sizes of its symbolic dims. ``project``: where a
    user's loss or optimizer class (a dotted name) may be imported from
    (``frontend.imports``)."""
    spec = spec or TrainSpec()
    errors = Collector()
    symbols = list(dict.fromkeys(s for t in graph.inputs for s in t.type.symbols))
    for name in spec.dims:
        if name not in symbols:
            errors.add(source.key(("train", "dims", name)), f"train.dims: {name!r} is not a "
                       f"symbolic dim of the inputs{did_you_mean(name, symbols)}")
    dims = {name: spec.dims.get(name, DEFAULT_DIM) for name in symbols}
    if "batch" in dims:
        dims["batch"] = spec.dims.get("batch", spec.batch_size)
    # A mapping names the outputs trained on; the others are returned, not trained.
    if isinstance(spec.loss, CallSpec):
        per_output = {out: (spec.loss, ("train", "loss")) for out in graph.outputs}
    else:
        per_output = {}
        for out, call in spec.loss.items():
            if out not in graph.outputs:
                errors.add(source.key(("train", "loss", out)), f"train.loss: {out!r} is not an "
                           f"output{did_you_mean(out, graph.outputs)}")
            per_output[out] = (call, ("train", "loss", out))
        if not spec.loss:
            errors.add(source.value(("train", "loss")), "train.loss: an empty mapping gives "
                       "no output a loss; name at least one of "
                       f"{', '.join(map(repr, graph.outputs))}")
    losses = []
    for out in graph.outputs:
        if out not in per_output:
            continue
        call, path = per_output[out]
        loss = _loss(graph, out, call, path, source, errors, project)
        if loss is not None:
            losses.append(dataclasses.replace(loss, written="loss" in spec.model_fields_set))
    before = len(errors.errors)
    optimizer, optimizer_module = _optimizer_class(spec.optimizer.op, source, errors, project)
    lr, opt_kwargs = _optimizer(spec.optimizer, optimizer, source, errors)

    def sample() -> torch.optim.Optimizer:
        """The optimizer over sample parameters, for the scheduler's check."""
        groups = bool(spec.no_decay) and "weight_decay" in ops.module_signature(optimizer).names
        return _sample_optimizer(optimizer, {"lr": lr, **dict(opt_kwargs)}, groups)

    usable = optimizer is not None and len(errors.errors) == before
    scheduler = (_scheduler(spec.scheduler, sample if usable else None, source, errors)
                 if spec.scheduler else None)
    if optimizer is not None:
        _optimizer_fits(spec, optimizer, source, errors)
    data = _data(spec.data, "data", source, errors, project)
    eval_data = _data(spec.eval_data, "eval_data", source, errors, project)
    if spec.eval_data is not None and spec.eval_split > 0:
        errors.add(source.value(("train", "eval_split")), "train.eval_split: the evaluation "
                   "data is train.eval_data; hold out a split only without it")
    if spec.samples > MAX_TRAIN_SIZE:
        errors.add(source.value(("train", "samples")), f"train.samples: at most "
                   f"{MAX_TRAIN_SIZE:,} (the largest size), got {shown(spec.samples)}")
    metrics = (None if spec.metrics is None
               else _metrics(spec.metrics, losses, source, errors, project))
    if not _SEEDS[0] <= spec.seed <= _SEEDS[1]:
        errors.add(source.value(("train", "seed")), f"train.seed: {shown(spec.seed)} is outside "
                   f"the range torch.manual_seed takes, [{_SEEDS[0]}, {_SEEDS[1]}]")
    errors.raise_if_any()
    written = spec.model_fields_set
    train = TrainConfig(
        losses=tuple(losses), metrics=metrics,
        optimizer=spec.optimizer.op, optimizer_kwargs=opt_kwargs, lr=lr,
        batch_size=spec.batch_size, steps=spec.steps, seed=spec.seed, log_every=spec.log_every,
        dims=tuple(dims.items()), closure=needs_closure(optimizer),
        one_device=spec.optimizer.op in _ONE_DEVICE_OPTIMIZERS,
        optimizer_pos=_op_position(source, ("train", "optimizer")),
        epochs=spec.epochs, steps_given="steps" in written or "epochs" not in written,
        scheduler=scheduler, grad_clip=spec.grad_clip, accumulate=spec.accumulate, amp=spec.amp,
        no_decay=tuple(spec.no_decay), data=data, eval_data=eval_data,
        eval_every=spec.eval_every, eval_split=float(spec.eval_split), samples=spec.samples,
        workers=spec.workers, optimizer_module=optimizer_module,
        weight_decay=_weight_decay(optimizer, spec.optimizer.kwargs),
        dims_given=tuple(name for name in dims if name in spec.dims or name == "batch"),
        loss_per_output=not isinstance(spec.loss, CallSpec),
        monitor=spec.monitor, monitor_mode=spec.monitor_mode, keep_last=spec.keep_last,
        early_stop=spec.early_stop,
    )
    _check_monitor(train, source, errors)
    errors.raise_if_any()
    return dataclasses.replace(graph, train=train, dims=train.dims)


#: The words of a metric's name that say lower or higher is better: the
#: runtime's monitor.LOWER and HIGHER (which the compiler does not import;
#: a test keeps them equal).
_LOWER = ("loss", "perplexity", "ppl", "error", "mse", "mae", "rmse", "wer", "cer")
_HIGHER = ("accuracy", "acc", "top", "f1", "precision", "recall", "auc", "iou", "dice",
           "bleu", "rouge", "r2", "map", "score", "correct")


def monitor_mode(metric: str) -> Optional[str]:
    """"min" or "max" as ``metric``'s name says (the runtime's
    ``monitor.mode_of``), None when it does not."""
    words = [w for w in re.split(r"[^a-z0-9]+", metric.lower()) if w]
    for mode, known in (("min", _LOWER), ("max", _HIGHER)):
        if any(word.startswith(known) for word in words):
            return mode
    return None


def _check_monitor(train: TrainConfig, source: SourceMap, errors: Collector) -> None:
    """``train.monitor`` names a column of the evaluation's rows, and says
    (or ``monitor_mode`` says) whether lower or higher is better."""
    if train.monitor is None:
        return
    columns = train.eval_columns()
    if train.monitor not in columns:
        errors.add(source.value(("train", "monitor")), f"train.monitor: {train.monitor!r} is "
                   f"not a column of the evaluation{did_you_mean(train.monitor, columns)}; it "
                   f"has {', '.join(columns)}")
    elif train.monitor_mode is None and monitor_mode(train.monitor) is None:
        errors.add(source.value(("train", "monitor")), f"train.monitor: the name "
                   f"{train.monitor!r} does not say whether lower or higher is better; add "
                   "monitor_mode: min or monitor_mode: max")


def _scheduler(spec: SchedulerSpec, optimizer: Optional[Callable[[], torch.optim.Optimizer]],
               source: SourceMap, errors: Collector) -> Optional[Scheduler]:
    """``train.scheduler``, its keys checked against the schedule; a torch
    class is built on ``optimizer()`` (the spec's optimizer over sample
    parameters; None when that has errors of its own) and takes a step."""
    path = ("train", "scheduler")
    pos = _op_position(source, path)
    if spec.op in Scheduler.BUILT_IN:
        min_lr = 0.0
        for key, value in spec.kwargs.items():
            if key != "min_lr":
                errors.add(source.key((*path, key)), f"train.scheduler: unknown keyword {key!r} "
                           f"for the built-in schedule {spec.op!r}, which takes warmup and "
                           f"min_lr{did_you_mean(key, _BUILT_IN_KEYS)}")
            elif (isinstance(value, bool) or not isinstance(value, (int, float))
                  or _finite(value) is None or value < 0):
                errors.add(source.value((*path, key)), f"train.scheduler.min_lr: expected a "
                           f"finite number >= 0, got {shown(value)}")
            else:
                min_lr = float(value)
        return Scheduler(spec.op, (), spec.warmup, min_lr)
    if spec.op in _REFUSED_SCHEDULERS:
        errors.add(pos, f"train.scheduler: {spec.op} {_REFUSED_SCHEDULERS[spec.op]}, which a "
                   "spec cannot write; use a built-in schedule (cosine, linear, constant) or "
                   "another torch.optim.lr_scheduler class (warmup: N adds a linear warmup to "
                   "any of them)")
        return None
    if spec.op not in scheduler_names():
        errors.add(pos, f"train.scheduler: unknown schedule {spec.op!r}; expected cosine, linear, "
                   f"constant or a torch.optim.lr_scheduler class"
                   f"{did_you_mean(spec.op, [*Scheduler.BUILT_IN, *scheduler_names()])}")
        return None
    if spec.op == "ReduceLROnPlateau" and spec.warmup:
        errors.add(source.value((*path, "warmup")), "train.scheduler: ReduceLROnPlateau steps on "
                   "a loss, so it cannot follow a warmup (torch's SequentialLR steps without "
                   "one); drop warmup, or use a built-in schedule with warmup")
        return None
    cls = getattr(lr_scheduler, spec.op)
    allowed = [name for name in ops.module_signature(cls).names if name not in _SCHEDULER_OWN]
    unknown = [key for key in spec.kwargs if key not in allowed]
    for key in unknown:
        hint = did_you_mean(key, [*allowed, "warmup"])
        if not hint and key == "min_lr":
            hint = " (min_lr is for the built-in schedules)"
        errors.add(source.key((*path, key)), f"train.scheduler: unknown keyword argument {key!r} "
                   f"for {spec.op}{hint}")
    if unknown:
        return None
    defaults = inspect.signature(cls.__init__).parameters
    for key, value in spec.kwargs.items():
        expected = _kind_of(defaults[key].default)
        if expected is not None and not _is_kind(value, expected):
            errors.add(source.value((*path, key)), f"train.scheduler: {spec.op}'s {key} is "
                       f"{expected} (default {shown(defaults[key].default)}), got {shown(value)}")
            return None
    if optimizer is not None:
        check = _Check(f"train.scheduler: {spec.op}", spec.kwargs, path, pos, source, errors)
        if check.run(lambda given: cls(optimizer(), **given), "cannot be built") is None:
            return None
        if check.run(lambda given: _sample_schedule_step(cls(optimizer(), **given)),
                     "cannot take a step") is None:
            return None
    return Scheduler(spec.op, tuple(spec.kwargs.items()), spec.warmup)


def _kind_of(default: Any) -> Optional[str]:
    """What a scheduler argument's default says its values are, or None (no
    default, ``None``, or a default of another type)."""
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (int, float)):
        return "a number"  # or one per parameter group (min_lr, max_lr)
    if isinstance(default, str):
        return "a string"
    return None


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "a number" and isinstance(value, list):
        return bool(value) and all(_is_kind(item, kind) for item in value)
    if isinstance(value, bool):
        return kind == "true or false"
    if isinstance(value, (int, float)):
        return kind == "a number"
    return isinstance(value, str) and kind == "a string"


def _sample_schedule_step(scheduler: Any) -> Any:
    """``scheduler`` after one step (``ReduceLROnPlateau`` steps on a loss)."""
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(1.0)
    else:
        scheduler.step()
    return scheduler


def _optimizer_fits(spec: TrainSpec, optimizer: type, source: SourceMap,
                    errors: Collector) -> None:
    """Settings the training script could not honour with ``optimizer``:
    ``no_decay`` without weight decay; fp16's GradScaler or accumulated
    micro-batches with a step that evaluates a closure (LBFGS)."""
    name = spec.optimizer.op
    if spec.no_decay:
        param = inspect.signature(optimizer.__init__).parameters.get("weight_decay")
        decay = spec.optimizer.kwargs.get("weight_decay", param and param.default)
        where = source.value(("train", "no_decay"))
        if param is None:
            errors.add(where, f"train.no_decay: {name} has no weight decay to keep parameters "
                       "out of; use an optimizer with weight_decay, such as AdamW")
        elif isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay == 0:
            said = ("is 0" if "weight_decay" in spec.optimizer.kwargs
                    else "defaults to 0")
            errors.add(where, f"train.no_decay: {name}'s weight_decay {said}, so no parameter "
                       "decays; set train.optimizer.weight_decay (nanoGPT uses 0.1)")
    if not needs_closure(optimizer):
        return
    if spec.amp == "fp16":
        errors.add(source.value(("train", "amp")), f"train.amp: fp16 scales the loss with a "
                   f"GradScaler, which cannot step {name} (its step evaluates a closure); use "
                   "bf16 or off")
    if spec.accumulate > 1:
        errors.add(source.value(("train", "accumulate")), f"train.accumulate: {name} evaluates "
                   "the loss itself, several times a step (a closure), so micro-batches cannot "
                   "be accumulated; use accumulate: 1 and a larger batch_size")


def _data(spec: Optional[DataSpec], key: str, source: SourceMap, errors: Collector,
          project: Optional[imports.Project]) -> Optional[DataSource]:
    """``train.data``/``train.eval_data``: exactly one of ``factory:`` and
    ``path:``; keyword arguments only with a factory, whose module follows
    the import policy of dotted ops (``imports.check_factory``: read, never
    run). The text itself was checked by the schema."""
    if spec is None:
        return None
    path = ("train", key)
    extra = list(spec.kwargs)
    if spec.factory is not None and spec.path is not None:
        errors.add(source.key((*path, "path")), f"train.{key}: give factory: or path:, not both")
    elif spec.factory is None and spec.path is None:
        typo = [k for k in extra if did_you_mean(k, ("factory", "path"))]
        if typo:
            errors.add(source.key((*path, typo[0])), f"train.{key}: unknown key {typo[0]!r}"
                       f"{did_you_mean(typo[0], ('factory', 'path'))}")
        else:
            errors.add(source.value(path), f"train.{key}: expected factory: "
                       "'package.module:function' or path: FILE")
    elif spec.path is not None and extra:
        errors.add(source.key((*path, extra[0])), f"train.{key}: {extra[0]!r}: only a factory "
                   "takes keyword arguments, not a file")
    elif spec.factory is not None and not _factory_allowed(spec.factory, key, source, errors,
                                                            project):
        return None
    else:
        return DataSource(spec.path, spec.factory, tuple(spec.kwargs.items()))
    return None


def _factory_allowed(factory: str, key: str, source: SourceMap, errors: Collector,
                     project: Optional[imports.Project]) -> bool:
    """Whether the script may import the factory; else an error at its value."""
    try:
        imports.check_factory(factory, project or imports.Project.of("spec.yaml"))
    except imports.Refused as exc:
        errors.add(source.value(("train", key, "factory")), f"train.{key}: {exc}")
        return False
    return True


#: ``train.metrics``' short form of top-k accuracy: ``top5_accuracy``.
_TOP_K = re.compile(r"^top([1-9][0-9]*)_accuracy$")


def _metrics(specs: list[MetricSpec], losses: list[Loss], source: SourceMap, errors: Collector,
             project: Optional[imports.Project]) -> tuple[Metric, ...]:
    """``train.metrics``: each a metric mpgen knows or a user's function
    (under the import policy of data factories), on an output with a loss
    it can measure; their columns distinct."""
    found = []
    outputs = [loss.output for loss in losses]
    for i, spec in enumerate(specs):
        path = ("train", "metrics", i)
        pos = _op_position(source, path)
        op, k = spec.op, spec.k
        top = _TOP_K.match(op)
        if top:
            op, k = "top_k_accuracy", int(top.group(1)) if k is None else k
        function = None
        if FACTORY.match(op):
            function = op
            try:
                imports.check_factory(op, project or imports.Project.of("spec.yaml"),
                                      "metric function", "mymetrics:score")
            except imports.Refused as exc:
                errors.add(pos, f"train.metrics: {exc}")
                continue
        elif op not in Metric.OPS:
            errors.add(pos, f"train.metrics: unknown metric {spec.op!r}"
                       f"{did_you_mean(spec.op, (*Metric.OPS, 'top5_accuracy'))}; expected "
                       "accuracy, top_k_accuracy (topK_accuracy), f1, perplexity or your own "
                       "function 'package.module:function'")
            continue
        if op == "top_k_accuracy" and k is None:
            errors.add(pos, "train.metrics: top_k_accuracy needs k (k: 5, or top5_accuracy)")
            continue
        if op != "top_k_accuracy" and spec.k is not None:
            errors.add(source.key((*path, "k")), f"train.metrics: k is top_k_accuracy's, "
                       f"not {op}'s")
            continue
        if spec.output is not None and spec.output not in outputs:
            errors.add(source.value((*path, "output")), f"train.metrics: {spec.output!r} is "
                       f"not an output with a loss{did_you_mean(spec.output, outputs)}")
            continue
        metric = Metric(op, spec.output, k or 1, function, pos)
        if function is not None and spec.output is None and len(losses) > 1:
            errors.add(pos, f"train.metrics: {op} measures which output? Give "
                       f"{{op: {op}, output: NAME}}, one of {', '.join(outputs)}")
            continue
        measured = [loss for loss in losses
                    if spec.output in (None, loss.output) and metric.applies(loss)]
        if not measured:
            what = ("an output of CrossEntropyLoss or NLLLoss" if op == "perplexity"
                    else "a class output (CrossEntropyLoss, NLLLoss or MultiMarginLoss)")
            named = f"{spec.output!r} is not one" if spec.output else "the spec has none"
            errors.add(pos, f"train.metrics: {spec.op} needs {what}; {named}")
            continue
        found.append(metric)
    if len(found) == len(specs):
        train = TrainConfig(losses=tuple(losses), optimizer="SGD", optimizer_kwargs=(), lr=0.0,
                            batch_size=1, steps=1, seed=0, log_every=1, dims=(),
                            metrics=tuple(found))
        names = [column.name for column in train.metric_columns()]
        twice = next((c for c in train.metric_columns() if names.count(c.name) > 1), None)
        if twice is not None:
            errors.add(twice.metric.pos, f"train.metrics: {twice.name} is listed twice")
    return tuple(found)


def needs_closure(optimizer: type) -> bool:
    """Whether ``optimizer.step`` must be given a closure that recomputes the
    loss (``LBFGS``, which evaluates it several times per step)."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _optimizer_class(op: str, source: SourceMap, errors: Collector,
                     project: Optional[imports.Project]) -> tuple[Optional[type], Optional[str]]:
    """The optimizer class ``op`` names: a ``torch.optim`` class, or a user's
    ``torch.optim.Optimizer`` subclass by its dotted name (``mypkg.optim.Lion``,
    under the import policy), with its module; (None, None) after an error."""
    pos = _op_position(source, ("train", "optimizer"))
    if "." in op:
        cls, module = _user_class(op, project, torch.optim.Optimizer,
                                  "a torch.optim.Optimizer class", pos, "train.optimizer", errors)
        return cls, module
    if op not in optimizer_names():
        errors.add(pos, f"train.optimizer: unknown optimizer {op!r}"
                   f"{did_you_mean(op, optimizer_names())}")
        return None, None
    return getattr(torch.optim, op), None


def _user_class(op: str, project: Optional[imports.Project], base: type, what: str,
                pos: Position, key: str, errors: Collector) -> tuple[Optional[type], Optional[str]]:
    """A user's class for a loss or optimizer, or (None, None) after an error at ``pos``."""
    if not all(part.isidentifier() for part in op.split(".")):
        errors.add(pos, f"{key}: {op!r} is not a dotted Python path")
        return None, None
    try:
        return imports.user_class(op, project or imports.Project.of("spec.yaml"), base, what)
    except imports.Refused as exc:
        errors.add(pos, f"{key}: {exc}")
        return None, None


def _weight_decay(optimizer: Optional[type], kwargs: dict[str, Any]) -> Optional[float]:
    """The optimizer's weight decay, written or its default; None without one."""
    if optimizer is None:
        return None
    param = inspect.signature(optimizer.__init__).parameters.get("weight_decay")
    value = kwargs.get("weight_decay", param.default if param is not None else None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _optimizer(opt: CallSpec, cls: Optional[type], source: SourceMap,
               errors: Collector) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """The learning rate and the other keyword arguments of ``train.optimizer``
    (``cls``; None when it has an error), after building it and taking one
    step with them."""
    path = ("train", "optimizer")
    lr = 0.01
    kwargs: list[tuple[str, Any]] = []
    if cls is None:
        return lr, ()
    sig = ops.module_signature(cls)
    allowed = [n for n in sig.names if n != "params"]
    before = len(errors.errors)
    for key, value in opt.kwargs.items():
        if key not in allowed and not sig.var_kwargs:
            errors.add(source.key((*path, key)), f"train.optimizer: unknown keyword "
                       f"argument {key!r} for {opt.op}{did_you_mean(key, allowed)}")
        elif key == "lr":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                errors.add(source.value((*path, key)), "train.optimizer.lr: expected a number")
            elif _finite(value) is None:
                errors.add(source.value((*path, key)),
                           f"train.optimizer.lr: expected a finite number, got {shown(value)}")
            else:
                lr = _finite(value)
        else:
            kwargs.append((key, value))
    default = inspect.signature(cls.__init__).parameters.get("lr")
    default_lr = (float(default.default) if default is not None
                  and isinstance(default.default, (int, float)) else 0.01)
    if "lr" not in opt.kwargs:
        lr = default_lr
    if len(errors.errors) == before:
        written = dict(opt.kwargs)  # every key is known by now
        check = _Check(f"train.optimizer: {opt.op}", written, path, _op_position(source, path),
                       source, errors)
        with imports.user_code():  # a user's optimizer runs its own code
            if check.run(lambda given: _sample_optimizer(cls, {"lr": default_lr, **given}),
                         "cannot be built") is not None:
                check.run(lambda given: _sample_step(cls, {"lr": default_lr, **given}),
                          "cannot take a step")
    return lr, tuple(kwargs)


def _sample_optimizer(cls: type, kwargs: dict[str, Any],
                      no_decay: bool = False) -> torch.optim.Optimizer:
    """``cls`` over sample parameters (1-D and 2-D, as a model's), with
    gradients; with ``no_decay``, in two groups as the training script makes
    them (the 1-D one without weight decay), so that a scheduler's value per
    group (``min_lr: [...]``) is checked against the script's groups."""
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(3))]
    for param in params:
        param.grad = torch.ones_like(param)
    if no_decay:
        return cls([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}],
                   **kwargs)
    return cls(params, **kwargs)


class _Evaluated(Exception):
    """The sample step evaluated its closure enough times to have run."""


def _sample_step(cls: type, kwargs: dict[str, Any]) -> None:
    """One step of ``cls`` on sample parameters. capturable=True keeps the
    step on a GPU, so the CPU steps without it (``placement.training``
    checks that the parameters are on a GPU). An optimizer that evaluates
    the closure in a loop (LBFGS, ``max_iter: 1000000000``) is stopped after
    a few evaluations: the build checks the settings, not the iterations."""
    kwargs = {key: value for key, value in kwargs.items() if key != "capturable"}
    calls = iter(range(_CLOSURE_CALLS))

    def closure() -> torch.Tensor:
        if next(calls, None) is None:
            raise _Evaluated
        return torch.zeros(())

    try:
        _sample_optimizer(cls, kwargs).step(closure)
    except _Evaluated:
        pass


def _finite(value: int | float) -> Optional[float]:
    """``value`` as a finite float, or None (nan, inf, or an int too big)."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclasses.dataclass
class _Check:
    """Runs torch on a loss's or optimizer's keyword arguments, so that a
    bad value is a build error at its key rather than a crash of the
    training script."""

    what: str  # "train.loss: CrossEntropyLoss"
    kwargs: dict[str, Any]
    path: tuple
    pos: Position  # where the loss or optimizer is named
    source: SourceMap
    errors: Collector

    def run(self, make: Callable[[dict[str, Any]], Any], failure: str) -> Any:
        """``make(kwargs)``, or None after an error ``WHAT FAILURE: torch's
        message`` at the keyword to blame (else at the op)."""
        try:
            return self.quietly(make, self.kwargs)
        except Exception as exc:  # whatever torch raises for a bad value
            lines = str(exc).strip().splitlines()
            text = lines[0] if lines else type(exc).__name__
            key = self.blamed(make, text)
            given = "" if key is None else f" with {key}={shown(self.kwargs[key])}"
            self.errors.add(self.at(key), f"{self.what} {failure}{given}: {text}")
            return None

    @staticmethod
    def quietly(make: Callable[[dict[str, Any]], Any], kwargs: dict[str, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make(kwargs)

    def blamed(self, make: Callable[[dict[str, Any]], Any], text: str) -> Optional[str]:
        """The keyword torch's message names, else the first one without which
        ``make`` works."""
        for key in self.kwargs:
            if any(re.search(rf"\b{re.escape(word)}\b", text)
                   for word in (key, _SPELLED.get(key, key))):
                return key
        for key in self.kwargs:
            try:
                self.quietly(make, {k: v for k, v in self.kwargs.items() if k != key})
            except Exception:  # noqa: BLE001 - still failing: not this one alone
                continue
            return key
        return None

    def at(self, *keys: Optional[str]) -> Position:
        """The value of the first of ``keys`` that is given, else the op."""
        given = [key for key in keys if key in self.kwargs]
        return self.source.value((*self.path, given[0])) if given else self.pos


def _op_position(source: SourceMap, path) -> Position:
    """Where the loss or optimizer is named: ``op:``'s value, or the short form."""
    keys = {k[-1] for k in source.keys if k[:-1] == tuple(path)}
    return source.value((*path, "op")) if "op" in keys else source.value(path)


def _loss(graph: Graph, out: str, call: CallSpec, path, source: SourceMap,
          errors: Collector, project: Optional[imports.Project] = None) -> Optional[Loss]:
    pos = _op_position(source, path)
    if "." in call.op:
        return _user_loss(graph, out, call, path, pos, source, errors, project)
    if call.op not in loss_names():
        errors.add(pos, f"train.loss: unknown loss {call.op!r}{did_you_mean(call.op, loss_names())}")
        return None
    if call.op in _PAIR_LOSSES:
        errors.add(pos, f"train.loss: {call.op} needs inputs the generated training script "
                   "cannot synthesise; use a single-target loss such as MSELoss")
        return None
    if call.op in _LOSSES_WITH_WEIGHTS:
        errors.add(pos, f"train.loss: {call.op} has weights of its own, which the training "
                   "script's optimizer (over the model's parameters) would never train; end "
                   "the model with a Linear layer and use CrossEntropyLoss")
        return None
    sig = ops.module_signature(getattr(nn, call.op))
    for key in call.kwargs:
        if key not in sig.names:
            errors.add(source.key((*path, key)), f"train.loss: unknown keyword argument "
                       f"{key!r} for {call.op}{did_you_mean(key, sig.names)}")
            return None
    producer = graph.producer(out)
    if (call.op == "BCELoss" and producer is not None and producer.op.kind is OpKind.MODULE
            and issubclass(producer.op.target, _UNBOUNDED_LAYERS)):
        errors.add(pos, f"train.loss: BCELoss needs probabilities in [0, 1], but output "
                   f"{out!r} is the unbounded output of a {producer.op.spelled} layer; use "
                   "BCEWithLogitsLoss (it applies the sigmoid itself) or end the model with "
                   "Sigmoid")
        return None
    kind = ("classes" if call.op in _CLASS_LOSSES
            else "probabilities" if call.op in _PROB_LOSSES else "like_output")
    class_dim_pos = None
    if call.class_dim is not None:
        if kind != "classes":
            errors.add(source.key((*path, "class_dim")), f"train.loss: class_dim is for the "
                       f"class-index losses ({', '.join(sorted(_CLASS_LOSSES))}); {call.op} "
                       "takes targets shaped like the output")
            return None
        class_dim_pos = source.value((*path, "class_dim"))
    check = _Check(f"train.loss: {call.op}", call.kwargs, path, pos, source, errors)
    cls = getattr(nn, call.op)
    value = None
    if check.run(lambda given: cls(**given), "cannot be built") is not None:
        value = check.run(lambda given: cls(**given)(*_sample_batch(kind)), "cannot be computed")
    if value is None:
        return None
    if value.dim() != 0:
        given = [f"{key}={shown(call.kwargs[key])}" for key in ("reduction", "reduce")
                 if key in call.kwargs]
        errors.add(check.at("reduction", "reduce"), f"train.loss: {call.op}"
                   f"({', '.join(given)}) gives a loss per element, not the one number the "
                   "training script minimises; use reduction 'mean' or 'sum'")
        return None
    return Loss(out, call.op, tuple(call.kwargs.items()), kind, pos,
                class_dim_given=call.class_dim, class_dim_pos=class_dim_pos)


def _user_loss(graph: Graph, out: str, call: CallSpec, path, pos: Position, source: SourceMap,
               errors: Collector, project: Optional[imports.Project]) -> Optional[Loss]:
    """A user's loss class (``mypkg.losses.FocalLoss``): an ``nn.Module``
    whose forward takes the output and the target. Its targets are class
    indices when the spec gives ``class_dim``; otherwise whatever of values
    shaped like the output or class indices its sample computation accepts."""
    cls, module = _user_class(call.op, project, nn.Module, "an nn.Module class", pos,
                              "train.loss", errors)
    if cls is None:
        return None
    sig = ops.module_signature(cls)
    for key in call.kwargs:
        if key not in sig.names and not sig.var_kwargs:
            errors.add(source.key((*path, key)), f"train.loss: unknown keyword argument "
                       f"{key!r} for {call.op}{did_you_mean(key, sig.names)}")
            return None
    check = _Check(f"train.loss: {call.op}", call.kwargs, path, pos, source, errors)
    kinds = ["classes"] if call.class_dim is not None else ["like_output", "classes"]
    value, kind = None, kinds[0]
    with imports.user_code():
        if check.run(lambda given: cls(**given), "cannot be built") is None:
            return None
        for kind in kinds:
            try:
                value = check.quietly(lambda given: cls(**given)(*_sample_batch(kind)),
                                      call.kwargs)
                break
            except Exception:  # noqa: BLE001 - try the next kind of target
                continue
        if value is None:  # the last kind's error, at the op or the keyword to blame
            value = check.run(lambda given: cls(**given)(*_sample_batch(kind)),
                              "cannot be computed on a sample output and target")
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        errors.add(pos, f"train.loss: {call.op} must return one number (a 0-dim tensor) the "
                   f"training script minimises, got {type(value).__name__}"
                   + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""))
        return None
    class_dim_pos = source.value((*path, "class_dim")) if call.class_dim is not None else None
    return Loss(out, call.op, tuple(call.kwargs.items()), kind, pos,
                class_dim_given=call.class_dim, class_dim_pos=class_dim_pos, module=module)


def _sample_batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A small output and target of the loss's kind (module docstring)."""
    generator = torch.Generator().manual_seed(0)
    if kind == "classes":
        return torch.randn(2, 3, generator=generator), torch.tensor([0, 2])
    if kind == "probabilities":
        return torch.rand(2, 3, generator=generator), torch.rand(2, 3, generator=generator)
    return torch.randn(2, 3, generator=generator), torch.randn(2, 3, generator=generator)
