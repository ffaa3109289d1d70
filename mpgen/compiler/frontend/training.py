"""Resolve ``train:`` into a :class:`~mpgen.compiler.ir.TrainConfig`.

Losses and optimizers are looked up in ``torch.nn`` and ``torch.optim`` and
their keyword arguments checked against the real signatures. The synthetic
targets of the generated training script follow from the loss and (filled
in by ``analysis.targets``) the inferred output shape:

- class-index losses (``CrossEntropyLoss``, ``NLLLoss``, ``MultiMarginLoss``):
  integer targets in ``[0, C)``; for an output ``[N, C]`` the classes are the
  last dim; an output with more dims (``[batch, seq, vocab]``) is flattened to
  ``[N*seq, vocab]``, as language models are trained;
- ``BCELoss``/``BCEWithLogitsLoss``/``KLDivLoss``: values in ``[0, 1)`` shaped like the output;
- every other single-target loss (``MSELoss``, ``L1Loss``, ``HuberLoss``, …):
  normal noise shaped like the output.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Optional

import torch
from torch import nn

from mpgen.compiler.frontend import ops
from mpgen.compiler.ir import Graph, Loss, TrainConfig
from mpgen.errors import Collector, did_you_mean
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import CallSpec, TrainSpec

_CLASS_LOSSES = {"CrossEntropyLoss", "NLLLoss", "MultiMarginLoss"}
_PROB_LOSSES = {"BCELoss", "BCEWithLogitsLoss", "KLDivLoss", "MultiLabelSoftMarginLoss"}
_PAIR_LOSSES = {"CosineEmbeddingLoss", "MarginRankingLoss", "TripletMarginLoss",
                "TripletMarginWithDistanceLoss", "CTCLoss", "GaussianNLLLoss",
                "PoissonNLLLoss", "AdaptiveLogSoftmaxWithLoss", "MultiLabelMarginLoss"}
#: Size of symbolic dims other than ``batch`` when ``train.dims`` is silent.
DEFAULT_DIM = 16


def loss_names() -> list[str]:
    return [n for n in ops.nn_module_names() if n.endswith("Loss")]


def optimizer_names() -> list[str]:
    return sorted(
        n for n in dir(torch.optim)
        if inspect.isclass(getattr(torch.optim, n))
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    )


def resolve_train(graph: Graph, spec: Optional[TrainSpec], source: SourceMap) -> Graph:
    """The graph with the training script's settings (defaults when ``train``
    is absent) and the sizes of its symbolic dims."""
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
    if isinstance(spec.loss, CallSpec):
        per_output = {out: (spec.loss, ("train", "loss")) for out in graph.outputs}
    else:
        per_output = {}
        for out, call in spec.loss.items():
            if out not in graph.outputs:
                errors.add(source.key(("train", "loss", out)), f"train.loss: {out!r} is not an "
                           f"output{did_you_mean(out, graph.outputs)}")
            per_output[out] = (call, ("train", "loss", out))
        for out in graph.outputs:
            if out not in per_output:
                errors.add(source.value(("train", "loss")), f"train.loss: no loss for output "
                           f"{out!r}")
    losses = []
    for out in graph.outputs:
        if out not in per_output:
            continue
        call, path = per_output[out]
        loss = _loss(graph, out, call, path, source, errors)
        if loss is not None:
            losses.append(loss)
    opt = spec.optimizer
    opt_path = ("train", "optimizer")
    lr = 0.01
    opt_kwargs: list[tuple[str, object]] = []
    if opt.op not in optimizer_names():
        errors.add(source.value((*opt_path, "op")) if "op" in _raw_keys(source, opt_path)
                   else source.value(opt_path),
                   f"train.optimizer: unknown optimizer {opt.op!r}"
                   f"{did_you_mean(opt.op, optimizer_names())}")
    else:
        cls = getattr(torch.optim, opt.op)
        sig = ops.module_signature(cls)
        allowed = [n for n in sig.names if n != "params"]
        for key, value in opt.kwargs.items():
            if key not in allowed and not sig.var_kwargs:
                errors.add(source.key((*opt_path, key)), f"train.optimizer: unknown keyword "
                           f"argument {key!r} for {opt.op}{did_you_mean(key, allowed)}")
            elif key == "lr":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    errors.add(source.value((*opt_path, key)), "train.optimizer.lr: expected a number")
                else:
                    lr = float(value)
            else:
                opt_kwargs.append((key, value))
        if "lr" not in opt.kwargs:
            default = inspect.signature(cls.__init__).parameters.get("lr")
            if default is not None and isinstance(default.default, (int, float)):
                lr = float(default.default)
        if not errors.errors:
            _try_build(lambda: cls([nn.Parameter(torch.zeros(1))], lr=lr, **dict(opt_kwargs)),
                       source.value(opt_path), f"train.optimizer: {opt.op}", errors)
    errors.raise_if_any()
    train = TrainConfig(
        losses=tuple(losses), optimizer=opt.op, optimizer_kwargs=tuple(opt_kwargs), lr=lr,
        batch_size=spec.batch_size, steps=spec.steps, seed=spec.seed, log_every=spec.log_every,
        dims=tuple(dims.items()),
    )
    return dataclasses.replace(graph, train=train, dims=train.dims)


def _try_build(make, pos, what: str, errors: Collector) -> bool:
    """Construct a loss or optimizer now, so a bad keyword value is a build
    error at its line rather than a crash of the training script."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make()
    except Exception as exc:  # whatever torch raises for a bad value
        text = str(exc).strip().splitlines()
        errors.add(pos, f"{what} cannot be built: {text[0] if text else type(exc).__name__}")
        return False
    return True


def _raw_keys(source: SourceMap, path) -> set:
    return {k[-1] for k in source.keys if k[:-1] == tuple(path)}


def _loss(graph: Graph, out: str, call: CallSpec, path, source: SourceMap,
          errors: Collector) -> Optional[Loss]:
    pos = source.value((*path, "op")) if "op" in _raw_keys(source, path) else source.value(path)
    if call.op not in loss_names():
        errors.add(pos, f"train.loss: unknown loss {call.op!r}{did_you_mean(call.op, loss_names())}")
        return None
    if call.op in _PAIR_LOSSES:
        errors.add(pos, f"train.loss: {call.op} needs inputs the generated training script "
                   "cannot synthesise; use a single-target loss such as MSELoss")
        return None
    sig = ops.module_signature(getattr(nn, call.op))
    for key in call.kwargs:
        if key not in sig.names:
            errors.add(source.key((*path, key)), f"train.loss: unknown keyword argument "
                       f"{key!r} for {call.op}{did_you_mean(key, sig.names)}")
            return None
    if not _try_build(lambda: getattr(nn, call.op)(**call.kwargs), source.value(path),
                      f"train.loss: {call.op}", errors):
        return None
    kind = ("classes" if call.op in _CLASS_LOSSES
            else "probabilities" if call.op in _PROB_LOSSES else "like_output")
    return Loss(out, call.op, tuple(call.kwargs.items()), kind, pos)
