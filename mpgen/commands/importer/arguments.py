"""The arguments ``mpgen import`` writes: a ``torch.nn`` module's constructor
arguments, recovered from the module (:func:`constructor`), and a traced
function's argument names and defaults."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.operator_schemas import normalize_function

from mpgen.commands.importer.trace import shown_args
from mpgen.errors import MpgenError

#: Keys of a layer that are not keyword arguments (docs/spec.md, "Layers").
LAYER_FIELDS = frozenset({"op", "in", "args", "repeat", "outputs", "output", "call", "tie",
                          "init", "checkpoint"})


# -- constructor arguments ----------------------------------------------------------

MISSING = object()

#: Constructor arguments that are not the module's attribute of the same name:
#: (classes, argument) -> how to read it from a module.
_KNOWN_ARGUMENTS = {
    ((nn.MultiheadAttention,), "bias"): lambda m: m.in_proj_bias is not None,
    ((nn.MultiheadAttention,), "add_bias_kv"): lambda m: m.bias_k is not None,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "d_model"):
        lambda m: m.self_attn.embed_dim,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "nhead"):
        lambda m: m.self_attn.num_heads,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "dim_feedforward"):
        lambda m: m.linear1.out_features,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "dropout"):
        lambda m: m.dropout.p,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "activation"):
        lambda m: {F.relu: "relu", F.gelu: "gelu"}.get(m.activation, MISSING),
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "layer_norm_eps"):
        lambda m: m.norm1.eps,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "batch_first"):
        lambda m: m.self_attn.batch_first,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "bias"):
        lambda m: m.linear1.bias is not None,
}


def _recover(module: nn.Module, param: inspect.Parameter) -> Any:
    """The value ``param`` of ``type(module).__init__`` had, or MISSING."""
    for (classes, name), read in _KNOWN_ARGUMENTS.items():
        if name == param.name and isinstance(module, classes):
            return read(module)
    value = getattr(module, param.name, MISSING)
    if (value is None or isinstance(value, nn.Parameter)) and isinstance(param.default, bool):
        return value is not None  # bias=True: the attribute holds the parameter or None
    return value


#: Arguments of a base class's ``__init__`` that a subclass taking only
#: ``*args, **kwargs`` passes itself: ``nn.LSTM(...)`` is ``RNNBase("LSTM", ...)``.
_SUPPLIED_BY_SUBCLASS = {(nn.RNNBase, "mode")}


def _init_parameters(cls: type) -> list[inspect.Parameter]:
    """The arguments a spec can give ``cls``: those of its ``__init__``, or
    of the first base's where it takes only ``*args, **kwargs``."""
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = [p for p in list(inspect.signature(klass.__init__).parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and (klass is cls or (klass, p.name) not in _SUPPLIED_BY_SUBCLASS)]
        if params or klass is nn.Module:
            return [p for p in params
                    if not p.name.startswith("_") and p.name not in ("device", "dtype")]
    return []


def _fingerprint(module: nn.Module) -> Any:
    """What two modules built alike share: their settings, and the names,
    shapes and dtypes of their state."""
    settings = sorted((k, repr(_as_lists(v))) for k, v in vars(module).items()
                      if not k.startswith("_") and k != "training"
                      and not isinstance(v, (torch.Tensor, nn.Module)))
    state = [(k, tuple(v.shape), v.dtype) for k, v in module.state_dict().items()]
    children = [(name, _fingerprint(child)) for name, child in module.named_children()]
    return settings, state, children


def _as_lists(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_as_lists(v) for v in value]
    return value


def _rebuild(cls: type, args: list, kwargs: dict) -> Optional[nn.Module]:
    if "dtype" in kwargs:
        kwargs = {**kwargs, "dtype": getattr(torch, kwargs["dtype"])}
    try:
        with torch.device("meta"):
            return cls(*args, **kwargs)
    except Exception:  # a combination the class refuses: not the one it was built with
        return None


def yaml_value(value: Any) -> Any:
    """``value`` as the spec writes it (tuples are lists), or MISSING."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [yaml_value(v) for v in value]
        return MISSING if any(v is MISSING for v in items) else items
    return MISSING


def constructor(module: nn.Module, layer: str) -> tuple[list, dict]:
    """Positional and keyword arguments that build a module like ``module``.

    Every parameter of the class's ``__init__`` is read from the module's
    attribute of the same name (or :data:`_KNOWN_ARGUMENTS`); required ones
    are positional, and an optional one is written only when leaving it out
    would build a different module. Each choice is checked by building the
    class on the meta device and comparing it with ``module``
    (:func:`_fingerprint`)."""
    cls = type(module)
    params = _init_parameters(cls)
    values: dict[str, Any] = {}
    for param in params:
        value = _recover(module, param)
        written = MISSING if value is MISSING else yaml_value(value)
        if written is MISSING:
            if param.default is param.empty:
                shown = "" if value is MISSING else f" ({value!r} cannot be written in a spec)"
                raise MpgenError(None, f"layer {layer!r}: cannot recover the argument "
                                       f"{param.name!r} of {cls.__name__} from the module"
                                       f"{shown}")
            continue  # assumed the default; the check below confirms it
        values[param.name] = written
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if dtype != torch.float32:
            values["dtype"] = str(dtype).removeprefix("torch.")
    target = _fingerprint(module)
    required = [p.name for p in params if p.default is p.empty]

    def split(chosen: dict) -> tuple[list, dict]:
        # Required arguments positionally, the rest by keyword; a keyword the
        # spec's layer syntax takes itself (init, ...) goes positionally too.
        names = [p.name for p in params]
        last = max([names.index(n) for n in chosen if n in LAYER_FIELDS and n in names]
                   + [len(required) - 1])
        positional = [chosen.get(n, p.default) for n, p in zip(names, params)][:last + 1]
        return positional, {k: v for k, v in chosen.items() if k not in names[:last + 1]}

    def same(chosen: dict) -> bool:
        rebuilt = _rebuild(cls, *split(chosen))
        return rebuilt is not None and _fingerprint(rebuilt) == target

    if not same(values):
        raise MpgenError(None, f"layer {layer!r}: cannot recover the constructor arguments "
                               f"of {cls.__name__} from the module: {cls.__name__}"
                               f"({shown_args(values)}) builds a different module")
    for param in params:
        name = param.name
        if name not in values:
            continue
        value = values[name]
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            if same({**values, name: value[0]}):  # kernel_size=(3, 3) -> 3
                values[name] = value = value[0]
        if param.default is not param.empty and same(
                {k: v for k, v in values.items() if k != name}):
            del values[name]  # the default, or what the class derives (stride=kernel_size)
    return split(values)


# -- a traced function's arguments --------------------------------------------------

def drop_defaults(fn: Any, kwargs: dict) -> None:
    """Leave out keywords a function was given at their defaults (a traced
    ``F.dropout`` passes every argument), where its signature says them."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without one: keep them all
        return
    for key, value in list(kwargs.items()):
        default = getattr(parameters.get(key), "default", inspect.Parameter.empty)
        if type(default) is type(value) and default == value:
            del kwargs[key]


def argument_names(fn: Any, args: list, kwargs: dict, values: dict) -> Optional[list]:
    """The parameter names of ``fn``'s positional ``args`` (through its
    signature or torch's schemas), or None where they are ambiguous."""
    def sample(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(sample(x) for x in a)
        return values.get(a, a) if isinstance(a, fx.Node) else a

    args = tuple(sample(a) for a in args)
    kwargs = {k: sample(v) for k, v in kwargs.items()}
    try:
        normalized = normalize_function(fn, args, kwargs, normalize_to_only_use_kwargs=True)
        if normalized is None:
            normalized = normalize_function(
                fn, args, kwargs, arg_types=tuple(type(a) for a in args),
                kwarg_types={k: type(v) for k, v in kwargs.items()},
                normalize_to_only_use_kwargs=True)
    except Exception:  # an ambiguous schema: positional arguments it is
        return None
    names = list(normalized.kwargs) if normalized is not None else []
    return names[:len(args)] if len(names) >= len(args) else None
