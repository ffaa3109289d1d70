"""Layers built and run on the meta device: one interpreter of the IR.

``compiler.shapes`` runs it at symbolic sizes (to infer shapes and report
mismatches), ``compiler.costs`` at the training sizes (to measure saved
activations and flops). Both build the same modules the generated code
builds, named the same way, so parameter counts and names agree with the
generated state dict. What each stage adds (error reporting, recording) it
passes in as a :class:`Hooks` object.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from mpgen.compiler.analysis.budget import Budget
from mpgen.compiler.frontend import expressions
from mpgen.compiler.frontend.imports import user_code
from mpgen.errors import MpgenError, did_you_mean, shown
from mpgen.compiler.ir import (
    Args,
    BinOp,
    BlockClass,
    Expr,
    INDEX,
    IfTraining,
    Neg,
    Node,
    OpKind,
    Param,
    Size,
    Tie,
    Training,
    expression_text,
)

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

#: Whether :func:`value` gives a layer's values while training (``Training``
#: is True, ``IfTraining`` its value): build-time runs are as in eval (the
#: shapes are the same), the memory plan's training step as in training.
_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("training", default=False)


@contextlib.contextmanager
def training(mode: bool) -> Iterator[None]:
    """Run layers as the generated model runs them in ``model.train(mode)``:
    ``self.training`` and the arguments that read it (``dropout_p`` of
    ``F.scaled_dot_product_attention``, ``F.dropout``'s ``training``)."""
    token = _TRAINING.set(mode)
    try:
        yield
    finally:
        _TRAINING.reset(token)


class ArgumentError(Exception):
    """An argument value cannot be computed (a user-facing message)."""


def value(v: Any, params: Mapping[str, Any], env: Optional[Mapping[str, Any]] = None) -> Any:
    """An IR value as a Python value: ``$param`` substituted, expressions
    computed (``size()`` from the tensors in ``env``), dtypes resolved."""
    if isinstance(v, Param):
        return params[v.name]
    if isinstance(v, Expr):  # the only Exprs are dtypes: torch.float16
        return TORCH_DTYPES[v.code.removeprefix("torch.")]
    if isinstance(v, list):
        return [value(x, params, env) for x in v]
    if isinstance(v, Training):  # build-time runs are as in eval: shapes are the same
        return _TRAINING.get()
    if isinstance(v, IfTraining):
        return value(v.value if _TRAINING.get() else v.otherwise, params, env)
    if isinstance(v, Size):
        tensor = (env or {})[v.value]
        if not -tensor.dim() <= v.dim < tensor.dim():
            raise ArgumentError(f"size({v.value}, {v.dim}): {v.value} has {tensor.dim()} dims")
        return int(tensor.size(v.dim))
    if isinstance(v, Neg):
        return -value(v.operand, params, env)
    if isinstance(v, BinOp):
        try:
            return expressions.fold(v.op, value(v.left, params, env),
                                    value(v.right, params, env))
        except expressions.ExpressionError as exc:
            raise ArgumentError(str(exc)) from None
    return v


def call_args(args: Args, params: Mapping[str, Any],
              env: Optional[Mapping[str, Any]] = None) -> tuple[list, dict]:
    """Positional and keyword values of ``args``, with block params set."""
    return ([value(a, params, env) for a in args.positional],
            {k: value(v, params, env) for k, v in args.keyword})


class Hooks:
    """How a stage observes the interpreter; the default just runs things,
    every layer under ``budget`` (:mod:`~mpgen.compiler.analysis.budget`)."""

    def __init__(self, budget: Optional[Budget] = None) -> None:
        self.budget = budget or Budget()

    def build(self, node: Node, label: str, params: Mapping[str, Any],
              make: Callable[[], nn.Module]) -> nn.Module:
        return make()

    def run(self, node: Node, label: str, params: Mapping[str, Any],
            module: Optional[nn.Module], fn: Callable, inputs: Sequence[torch.Tensor],
            call: Callable[[], Any]) -> Any:
        return call()

    def chain(self, node: Node, label: str, layers: Sequence[nn.Module], x: Any,
              step: Callable[[nn.Module, Any], Any]) -> Any:
        """The output of a repeated layer inside a block: ``step(layer, x)``
        through each of its copies ``layers`` in turn."""
        for layer in layers:
            x = step(layer, x)
        return x

    def block_done(self, block: BlockClass, params: Mapping[str, Any],
                   outputs: Mapping[str, torch.Tensor], module: nn.Module) -> None:
        pass


PLAIN = Hooks()


def build(node: Node, params: Mapping[str, Any], blocks: Mapping[str, BlockClass],
          hooks: Hooks = PLAIN, where: str = "", index: int = 0) -> nn.Module:
    """One instance of a module, user or block node, on meta: of a repeated
    layer, copy ``index`` (its ``$index``)."""
    label = f"{where}{node.name}"
    if node.repeat:
        params = {**params, INDEX: index}
        if index:
            label = f"{label}.{index}"
    if node.op.kind is OpKind.BLOCK:
        with hooks.budget.layer(node, label):
            try:
                args, _ = call_args(node.init, params)
            except ArgumentError as exc:
                raise MpgenError(node.pos, f"layer {label!r}: {exc}") from None
            block = MetaBlock(blocks[node.op.target], args, blocks, hooks, f"{label}.")
            return block.requires_grad_(False) if node.frozen else block

    if node.op.kind is OpKind.TENSOR:
        return hooks.build(node, label, params, lambda: OwnTensorLayer(node, params))

    def make() -> nn.Module:
        # The arguments too: an expression over a block's params can fail
        # (``nan // 2``), and that is the layer's failure to be built.
        args, kwargs = call_args(node.init, params)
        with torch.device("meta"), hooks.budget.build(node, label, call_text(node, params)), \
                user_code():
            module = node.op.target(*args, **kwargs)
        return module.requires_grad_(False) if node.frozen else module

    return hooks.build(node, label, params, make)


def run(node: Node, module: Optional[nn.Module], inputs: Sequence[torch.Tensor],
        params: Mapping[str, Any], hooks: Hooks = PLAIN, where: str = "",
        env: Optional[Mapping[str, Any]] = None) -> Any:
    """Apply one instance of ``node`` (its module, or its function) to
    ``inputs`` (one per ``node.inputs``); ``env`` holds the tensors whose
    sizes its arguments may read. Returns the output, or for a layer with
    ``outputs:`` the returned tuple."""
    if node.held:  # call: false (NOTE [Held layers] in frontend/resolve.py)
        return None
    label = f"{where}{node.name}"
    tensors, by_keyword = node.feeding.build(list(inputs))

    @user_code()
    def call() -> Any:
        args, kwargs = call_args(node.call, params, env)
        kwargs = {**by_keyword, **kwargs}
        if node.op.kind is OpKind.TENSOR:  # a Parameter or Buffer: the tensor itself
            return module if isinstance(module, torch.Tensor) else module()
        if node.op.kind is OpKind.FUNCTION:
            fn = node.op.target
            if node.factory:
                kwargs["device"] = "meta"
            given = [list(tensors)] if node.op.seq_input else list(tensors)
            result = fn(*given, *args, **kwargs)
            track_range(node, fn, list(tensors), args, kwargs, result)
            return pick(node, result)
        return pick(node, module(*tensors, *args, **kwargs))

    with hooks.budget.layer(node, label):
        if node.op.kind is OpKind.TENSOR:  # reads its tensor: nothing to observe
            return call()
        if node.op.kind is OpKind.FUNCTION:
            return hooks.run(node, label, params, None, node.op.target, inputs, call)
        return hooks.run(node, label, params, module, module, inputs, call)


def call_text(node: Node, params: Mapping[str, Any]) -> str:
    """The layer's call as the spec writes it, block params set where known:
    ``Linear(64, 3 * $dim)``, ``LSTM(8, 8, 2, batch_first=True)``."""
    def show(v):
        if isinstance(v, Param):
            return shown(params[v.name]) if v.name in params else f"${v.name}"
        if isinstance(v, Expr):
            return v.code
        if isinstance(v, Size):
            return f"size({v.value}, {v.dim})"
        if isinstance(v, (BinOp, Neg)):
            return expression_text(v, show)
        if isinstance(v, list):
            return "[" + ", ".join(show(x) for x in v) + "]"
        return shown(v)  # a 4,000-digit size is cut, not spelled out
    given = node.init or node.call
    if node.tensor is not None:
        given = Args((), (("shape", list(node.tensor.shape)), ("dtype", node.tensor.dtype)))
    parts = ([show(a) for a in given.positional]
             + [f"{k}={show(v)}" for k, v in given.keyword])
    return f"{node.op.spelled}({', '.join(parts)})"


def unpack(node: Node, result: Any) -> dict[str, Any]:
    """The values ``node`` produces, by name: its output, or the elements of
    the tuple it returns named by ``outputs:``; raises OutputError."""
    if node.held:
        return {}
    if not node.pattern:
        return {node.name: result}
    values: dict[str, Any] = {}

    def walk(pattern: tuple, got: Any, where: str) -> None:
        if not isinstance(got, (tuple, list)):
            raise OutputError(f"returns {_kind(got)}{where}, but outputs: names "
                              f"{len(pattern)} elements there")
        if len(got) != len(pattern):
            raise OutputError(f"returns {len(got)} values{where}, but outputs: names "
                              f"{len(pattern)}")
        for i, (name, item) in enumerate(zip(pattern, got)):
            if isinstance(name, tuple):
                walk(name, item, f"{where} in element {i}" if not where else f"{where}.{i}")
            elif name is not None:
                if not isinstance(item, torch.Tensor):
                    raise OutputError(f"returns {_kind(item)} as element {i}{where}, so "
                                      f"outputs: cannot name it {name!r}; use '_' to drop it")
                values[name] = item

    try:
        walk(node.pattern, result, "")
    finally:
        del walk  # a recursive closure is a cycle that would keep ``values`` alive
    return values


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a tuple of {len(value)}"
    return "a tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def share_parameter(module: nn.Module, name: str, parameter: nn.Parameter) -> None:
    """Make ``module``'s parameter ``name`` (dotted) the very ``parameter``,
    as the generated ``self.lm_head.weight = self.wte.weight`` does."""
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, parameter)


def share_tied(module: nn.Module, owner: nn.Module, node: Node, tie: Tie, label: str) -> None:
    """``node``'s ``tie``: ``module``'s parameter made the very parameter of
    ``owner`` (the layer it is tied to), in the model or in a block; errors
    at the tie."""
    owned = dict(owner.named_parameters())
    mine = dict(module.named_parameters())
    where = f"layer {label!r}: tie: {tie.param}"
    if tie.owner_param not in owned:
        raise MpgenError(tie.pos, f"{where}: {tie.owner!r} has no parameter "
                         f"{tie.owner_param!r}{did_you_mean(tie.owner_param, owned)}")
    if tie.param not in mine:
        raise MpgenError(tie.pos, f"{where}: {node.op.spelled} has no parameter "
                         f"{tie.param!r}{did_you_mean(tie.param, mine)}")
    theirs = owned[tie.owner_param]
    if mine[tie.param].shape != theirs.shape or mine[tie.param].dtype != theirs.dtype:
        raise MpgenError(tie.pos, f"{where}: {tuple(mine[tie.param].shape)} cannot be "
                         f"{tie.owner}.{tie.owner_param}, which is "
                         f"{tuple(theirs.shape)}")
    share_parameter(module, tie.param, theirs)


class OutputError(Exception):
    """``output:`` does not fit what the layer returns (message is user-facing)."""


def pick(node: Node, result: Any) -> Any:
    """The layer's output: ``result``, or its element ``node.output``."""
    if node.output is None:
        return result
    if not isinstance(result, (tuple, list)):
        raise OutputError(f"returns a single {type(result).__name__}; 'output: "
                          f"{node.output}' selects from a tuple, remove it")
    if not -len(result) <= node.output < len(result):
        raise OutputError(f"returns {len(result)} values, so 'output: {node.output}' is "
                          "out of range")
    return result[node.output]


class MetaBlock(nn.Module):
    """A block instance as a real ``nn.Module``, children named as in the
    generated block class (a repeated layer is an ``nn.ModuleList``)."""

    def __init__(self, block: BlockClass, args: Sequence[Any],
                 blocks: Mapping[str, BlockClass], hooks: Hooks = PLAIN,
                 where: str = "") -> None:
        super().__init__()
        # private (self._MetaBlock__block): a block's layers may be named block or values
        self.__block = block
        self.__values = dict(zip(block.params, args))
        self.__hooks = hooks
        self.__where = where
        for node in block.nodes:
            if not node.op.has_module:
                continue
            if node.tensor is not None:  # registered under its own name, as generated
                layer = build(node, self.__values, blocks, hooks, where)
                if node.tensor.buffer:
                    self.register_buffer(node.name, layer.tensor, node.tensor.persistent)
                else:
                    self.register_parameter(node.name, layer.tensor)
            elif node.repeat:
                self.add_module(node.name, nn.ModuleList(
                    build(node, self.__values, blocks, hooks, where, k)
                    for k in range(node.repeat)))
            elif "." in node.name:  # an item of an nn.ModuleList (NOTE [Items of a ModuleList])
                container = node.name.partition(".")[0]
                if container not in self._modules:
                    self.add_module(container, nn.ModuleList())
                self._modules[container].append(
                    build(node, self.__values, blocks, hooks, where))
            else:
                self.add_module(node.name, build(node, self.__values, blocks, hooks, where))
        for node in block.nodes:  # as the generated class, once its layers are made
            for tie in node.ties:
                share_tied(self.get_submodule(node.name) if "." in node.name
                           else getattr(self, node.name), self.get_submodule(tie.owner), node,
                           tie, f"{where}{node.name}")
        self.__class__ = _named_class(block.name)

    def forward(self, *inputs: torch.Tensor):
        env = {t.name: x for t, x in zip(self.__block.inputs, inputs)}
        for node in self.__block.nodes:
            xs = [env[name] for name in node.inputs]
            module = (None if not node.op.has_module else self.get_submodule(node.name)
                      if "." in node.name else getattr(self, node.name))
            if node.repeat:
                out = self.__hooks.chain(
                    node, f"{self.__where}{node.name}", module, xs[0],
                    lambda layer, x: run(node, layer, [x, *xs[1:]], self.__values,
                                         self.__hooks, self.__where, env))
            else:
                out = run(node, module, xs, self.__values, self.__hooks, self.__where, env)
            env.update(unpack(node, out))
        self.__hooks.block_done(self.__block, self.__values, env, self)
        outs = [env[name] for name in self.__block.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def parameter_count(attribute: Any, trainable: bool = False) -> int:
    """The parameters of a layer's attribute: a module's, or a Parameter's own
    (``trainable``: only those that require a gradient)."""
    params = ([attribute] if isinstance(attribute, nn.Parameter) else [] if isinstance(
        attribute, torch.Tensor) else attribute.parameters())
    return sum(p.numel() for p in params if p.requires_grad or not trainable)


class OwnTensorLayer(nn.Module):
    """A Parameter or Buffer layer on meta: its tensor (``tensor``, of the
    layer's shape and dtype, its initializer applied) and, called, the tensor.
    In a block, :class:`MetaBlock` registers the tensor under the layer's name,
    as the generated class does."""

    def __init__(self, node: Node, params: Mapping[str, Any]) -> None:
        super().__init__()
        spec = node.tensor
        shape = [value(d, params) for d in spec.shape]
        for size in shape:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ArgumentError(f"shape: {shown(size)} is not a size")
        if spec.values is not None and len(spec.values) != math.prod(shape):
            raise ArgumentError(f"init: values: {len(spec.values)} values for shape "
                                f"{shape}, which holds {math.prod(shape)}")
        tensor = torch.empty(shape, dtype=TORCH_DTYPES[spec.dtype], device="meta")
        for rule in node.inits:  # fails as it would in the generated __init__
            getattr(nn.init, f"{rule.init.fn}_")(tensor, **dict(call_args(
                Args((), rule.init.kwargs), params)[1]))
        if spec.buffer:
            self.register_buffer("tensor", tensor, spec.persistent)
        else:
            self.tensor = nn.Parameter(tensor, requires_grad=not node.frozen)

    def forward(self) -> torch.Tensor:
        return self.tensor


@functools.lru_cache(maxsize=None)
def _named_class(name: str) -> type:
    """A MetaBlock subclass named after the block (tools key on class names)."""
    return type(name, (MetaBlock,), {"__module__": __name__})


def meta_tensor(shape: Sequence[int], dtype: str) -> torch.Tensor:
    return torch.empty(list(shape), dtype=TORCH_DTYPES[dtype], device="meta")


#: A recurrent layer called over more time steps than this is run at stand-in
#: lengths instead (NOTE [Symbolic dims] in ``shapes``, NOTE [Cost formulas]
#: in ``costs``).
SHORT_SEQUENCE = 3

#: ``short(forward, input, dim, args, kwargs)``: run ``forward`` (a recurrent
#: module's own) at stand-in lengths of ``input``'s time dim ``dim``; returns
#: what forward returns there.
ShortRun = Callable[[Callable, torch.Tensor, int, tuple, dict], Any]


@contextlib.contextmanager
def short_sequences(module: Optional[nn.Module], short: ShortRun) -> Iterator[None]:
    """While active, every ``nn.RNN``/``LSTM``/``GRU`` in ``module`` (itself
    or a submodule) called on a sequence longer than :data:`SHORT_SEQUENCE`
    runs ``short`` instead, and its output gets the sequence's real length:
    on meta, their kernels loop over the sequence in Python, a minute for
    each run at the prime sizes of symbolic dims, or at a long training
    ``seq``. The state it returns does not depend on the length."""
    rnns = [m for m in (module.modules() if module is not None else ())
            if isinstance(m, nn.RNNBase) and "forward" not in vars(m)]

    def patched(rnn: nn.RNNBase) -> Callable:
        original = rnn.forward

        def forward(input, *args, **kwargs):
            if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
                return original(input, *args, **kwargs)
            dim = 1 if rnn.batch_first and input.dim() == 3 else 0
            if input.shape[dim] <= SHORT_SEQUENCE:
                return original(input, *args, **kwargs)
            out, state = short(original, input, dim, args, kwargs)
            return stand_in(out, dim, input.shape[dim]), state

        return forward

    for rnn in rnns:
        rnn.forward = patched(rnn)
    try:
        yield
    finally:
        for rnn in rnns:
            del rnn.forward


def stand_in(input: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """A fresh tensor like ``input`` with ``length`` steps along ``dim``."""
    shape = list(input.shape)
    shape[dim] = length
    return input.new_empty(shape).requires_grad_(input.requires_grad)


# -- the values of index tensors ----------------------------------------------
# NOTE: [Index ranges]
# Meta tensors hold no values, and meta kernels check no index: an
# ``Embedding`` of 64 rows runs on meta at any index, so a position table
# read through ``torch.arange(size(idx, 1))`` passes every meta run, at
# sizes far past the table. Where the values of an integer tensor follow
# from the spec alone, the interpreter keeps their range on the tensor
# (:func:`value_range`): ``torch.arange`` makes one, ops that move or pick
# values keep it (:data:`_SAME_VALUES`, :data:`_JOINED`), ``add``/``sub``
# of a number or another range shift it, ``mul`` by a number scales it,
# ``clamp`` bounds it. Anything
# else drops it: an unknown range is never a guess. ``shapes`` compares it
# with the table an ``Embedding`` reads (NOTE [Symbolic dims]).


@dataclasses.dataclass(frozen=True)
class Range:
    """The least and greatest value of an integer tensor, and the
    ``torch.arange`` layer they come from (``count``: how many values it made)."""

    low: int
    high: int
    count: int
    origin: Node


_RANGE = "_mpgen_range"
#: Ops whose output holds some of their first input's values, moved.
_SAME_VALUES = frozenset({
    "unsqueeze", "squeeze", "reshape", "flatten", "unflatten", "permute", "transpose",
    "swapaxes", "swapdims", "movedim", "moveaxis", "broadcast_to", "tile", "repeat_interleave",
    "flip", "fliplr", "flipud", "roll", "narrow", "select", "index_select", "clone", "t",
    "ravel", "atleast_1d", "atleast_2d", "atleast_3d", "take", "gather", "diagonal",
    "take_along_dim", "contiguous", "expand_copy", "view_copy", "squeeze_copy",
    "unsqueeze_copy", "permute_copy", "transpose_copy", "select_copy", "narrow_copy",
    "to", "type_as"})  # casts (torch.Tensor.to), kept where the result is of integers
#: Ops whose output holds values of all their tensor inputs.
_JOINED = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
                     "column_stack", "row_stack"})


def value_range(tensor: Any) -> Optional[Range]:
    """The range of ``tensor``'s values, where the interpreter knows it."""
    return getattr(tensor, _RANGE, None) if isinstance(tensor, torch.Tensor) else None


def track_range(node: Node, fn: Callable, tensors: Sequence[Any], args: Sequence[Any],
                kwargs: Mapping[str, Any], result: Any) -> None:
    """Keep the range of ``result``'s values on it (NOTE [Index ranges]);
    an output whose range is not known holds none."""
    if not isinstance(result, torch.Tensor):
        return
    found = None
    if result.dtype in _INTEGERS:
        try:
            found = _range_of(node, getattr(fn, "__name__", ""), list(tensors), list(args),
                              dict(kwargs), result)
        except Exception:  # noqa: BLE001 - a range is an aid: never a build's failure
            found = None
    if found is None:
        if _RANGE in vars(result):  # the input itself, returned with other values
            delattr(result, _RANGE)
        return
    setattr(result, _RANGE, found)


_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _number(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _range_of(node: Node, name: str, tensors: list, args: list, kwargs: dict,
              result: torch.Tensor) -> Optional[Range]:
    count = result.numel()
    if name == "arange" and not tensors:
        # arange(end), arange(start, end[, step]), any of them by keyword.
        if len(args) >= 2 or (len(args) == 1 and "end" in kwargs):
            start = _number(args[0])
            step = _number(args[2] if len(args) > 2 else kwargs.get("step", 1))
        else:
            start = _number(kwargs.get("start", 0))
            step = _number(kwargs.get("step", 1))
        if start is None or step is None or count == 0:
            return None
        last = start + (count - 1) * step
        return Range(min(start, last), max(start, last), count, node)
    ranges = [value_range(t) for t in tensors]
    first = ranges[0] if ranges else None
    if name in _SAME_VALUES:
        return first
    if name in _JOINED and ranges and all(ranges):
        return Range(min(r.low for r in ranges), max(r.high for r in ranges),
                     max(r.count for r in ranges), first.origin)
    if first is None:
        return None
    other = ranges[1] if len(ranges) > 1 else None
    scalar = _number(args[0]) if len(tensors) == 1 and args else None
    if name in ("add", "sub", "subtract"):
        alpha = _number(kwargs.get("alpha", 1))
        sign = 1 if name == "add" else -1
        if alpha is None or alpha < 0 or (other is None and scalar is None):
            return None
        if other is not None:
            low = other.low if sign > 0 else -other.high
            high = other.high if sign > 0 else -other.low
            return Range(first.low + alpha * low, first.high + alpha * high, first.count,
                         first.origin)
        return Range(first.low + sign * alpha * scalar, first.high + sign * alpha * scalar,
                     first.count, first.origin)
    if name in ("mul", "multiply") and scalar is not None and scalar >= 0:
        return Range(first.low * scalar, first.high * scalar, first.count, first.origin)
    if name in ("clamp", "clip"):
        low = _number(kwargs.get("min", args[0] if args else None))
        high = _number(kwargs.get("max", args[1] if len(args) > 1 else None))
        return Range(first.low if low is None else max(first.low, low),
                     first.high if high is None else min(first.high, high), first.count,
                     first.origin)
    return None

