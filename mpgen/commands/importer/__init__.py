"""``mpgen import``: trace an existing ``nn.Module`` with torch.fx into a spec.

The module is built from the user's class (``MODULE:CLASS``, the working
directory on ``sys.path``), traced with ``torch.fx.symbolic_trace``'s tracer
(``torch.nn`` modules are leaves, user modules are traced through) and run
once on sample inputs of the ``--input`` shapes, so that every node's value
is known: a tensor, a tuple of tensors, or a size. Then each node becomes a
layer of the spec (docs/import.md):

- a ``call_module`` of a ``torch.nn`` class: a layer of that op, with the
  constructor arguments recovered from the module (:func:`constructor`);
- a ``call_function`` / ``call_method``: a ``torch.NAME`` / ``F.NAME``
  layer (``+`` is ``torch.add``, ``x.view(...)`` is ``torch.reshape``);
- sizes (``x.size(0)``, ``x.shape[1] * 2``): expressions (``=size(x, 0)``);
- ``getitem`` of a returned tuple: the layer's ``outputs:`` names.

# NOTE: [Parameter order]
# The generated model registers its layers in spec order, so its
# ``parameters()`` are the layers' parameters in that order (a tie adds
# none). The imported model must give them in the original's order, so that
# ``zip(original.parameters(), generated.parameters())`` pairs them. The
# layers start in execution order; when that order does not give the
# original's parameter order, they are re-sorted topologically, each ready
# layer taken by the earliest original parameter it or a layer reading it
# holds. Folding repeats keeps the order (a run is contiguous). When no
# order of the data flow can match (a module registered before one whose
# output it reads), the spec is still written and :attr:`Imported.notes`
# says so.
"""

from __future__ import annotations

import builtins
import copy
import importlib
import inspect
import json
import linecache
import operator
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
import yaml
from torch import nn
from torch.fx.operator_schemas import normalize_function

from mpgen.compiler import pipeline
from mpgen.compiler.frontend import ops
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.compiler.frontend.namespace import Namespace, model_name_problem
from mpgen.compiler.frontend.resolve import _TRAINING_FLAG  # the dropout-like functions
from mpgen.errors import MpgenError, Position, did_you_mean
from mpgen.spec_schema.models import DTYPES  # the input dtypes of the spec language

#: Sizes of symbolic dims in the sample run that tells tensors from sizes.
SAMPLE_BATCH, SAMPLE_DIM = 2, 16
#: Keys of a layer that are not keyword arguments (docs/spec.md, "Layers").
LAYER_FIELDS = frozenset({"op", "in", "args", "repeat", "outputs", "output", "call", "tie",
                          "init", "checkpoint"})

_OPERATORS = {operator.add: "torch.add", operator.iadd: "torch.add",
              operator.sub: "torch.sub", operator.isub: "torch.sub",
              operator.mul: "torch.mul", operator.imul: "torch.mul",
              operator.truediv: "torch.div", operator.itruediv: "torch.div",
              operator.floordiv: "torch.floor_divide", operator.matmul: "torch.matmul",
              operator.pow: "torch.pow", operator.mod: "torch.remainder",
              operator.neg: "torch.neg", operator.eq: "torch.eq", operator.ne: "torch.ne",
              operator.lt: "torch.lt", operator.le: "torch.le", operator.gt: "torch.gt",
              operator.ge: "torch.ge"}
#: ``2 * x``: the tensor goes first, the spec's order (inputs, then args).
_SWAPPED = {operator.add: "torch.add", operator.mul: "torch.mul", operator.sub: "torch.rsub"}
#: Size arithmetic: ``x.size(0) * 2`` -> ``size(x, 0) * 2``.
_INT_OPERATORS = {operator.add: "+", operator.sub: "-", operator.mul: "*",
                  operator.floordiv: "//", operator.truediv: "/", operator.mod: "%",
                  operator.pow: "**"}
#: Tensor methods spelled as another torch function (``view`` copies only
#: where the tensor is not contiguous; the values are the same).
_METHOD_NAMES = {"view": "reshape"}
#: Methods whose sizes may come as separate arguments: ``x.view(b, -1)``.
_VARARG_METHODS = frozenset({"view", "reshape", "permute", "flip", "tile"})
#: Methods that return their input's values unchanged.
_IDENTITY_METHODS = frozenset({"contiguous"})


# -- the command line's values -------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    """``--input NAME=D0,D1,...[:DTYPE]``."""

    name: str
    dims: tuple[Union[int, str], ...]
    dtype: str = "float32"

    def sample(self) -> torch.Tensor:
        sizes = [d if isinstance(d, int) else SAMPLE_BATCH if d == "batch" else SAMPLE_DIM
                 for d in self.dims]
        dtype = getattr(torch, self.dtype)
        if dtype.is_floating_point:
            return torch.randn(sizes, generator=torch.Generator().manual_seed(0)).to(dtype)
        return torch.zeros(sizes, dtype=dtype)  # index 0 is valid for any embedding


def parse_input(text: str) -> InputSpec:
    """``x=batch,3,32,32`` or ``idx=batch,seq:int64``; raises MpgenError."""
    name, eq, rest = text.partition("=")
    shape, colon, dtype = rest.partition(":")
    usage = f"--input {text!r}: expected NAME=D0,D1,... with optional :DTYPE, like x=batch,3,32,32"
    if not eq or not name.isidentifier() or not shape:
        raise MpgenError(None, usage)
    dims: list[Union[int, str]] = []
    for part in shape.split(","):
        part = part.strip()
        if part.isdigit() and int(part) >= 1:
            dims.append(int(part))
        elif part.isidentifier():
            dims.append(part)
        else:
            raise MpgenError(None, f"--input {text!r}: {part!r} is not a size (an integer "
                                   f">= 1) or a symbolic dim (a name such as batch)")
    if colon and dtype not in DTYPES:
        raise MpgenError(None, f"--input {text!r}: unknown dtype {dtype!r}"
                               f"{did_you_mean(dtype, DTYPES)}; one of {', '.join(DTYPES)}")
    return InputSpec(name, tuple(dims), dtype if colon else "float32")


def load_module(target: str, args_json: Optional[str] = None) -> nn.Module:
    """Import ``MODULE:CLASS`` (the working directory first on ``sys.path``,
    as the generated training script finds ``module:function`` data) and
    build ``CLASS(**args)`` (a JSON object) or ``CLASS(*args)`` (a list)."""
    module_name, colon, class_name = target.partition(":")
    if not colon or not class_name.isidentifier() or not all(
            p.isidentifier() for p in module_name.split(".")):
        raise MpgenError(None, f"{target!r}: expected MODULE:CLASS, like mymodels.resnet:ResNet")
    args = _json_args(args_json) if args_json is not None else {}
    if not isinstance(args, (dict, list)):
        raise MpgenError(None, "--args: expected a JSON object (keyword arguments) or a "
                               "list (positional arguments)")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's code: any failure is theirs to see
        raise MpgenError(None, f"{target}: cannot import {module_name!r}: "
                               f"{type(exc).__name__}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        names = [n for n, v in vars(module).items()
                 if inspect.isclass(v) and issubclass(v, nn.Module)]
        raise MpgenError(None, f"{target}: {module_name} has no nn.Module class {class_name!r}"
                               f"{did_you_mean(class_name, names)}")
    try:
        return cls(**args) if isinstance(args, dict) else cls(*args)
    except Exception as exc:
        where = _user_frame(exc)
        raise MpgenError(where, f"{class_name}({_shown_args(args)}) failed: "
                                f"{type(exc).__name__}: {exc}") from None


#: How deeply ``--args`` may nest lists and objects (as a spec's YAML).
MAX_ARGS_DEPTH = 64


def _json_args(text: str) -> Any:
    """``--args``, parsed: JSON nested at most MAX_ARGS_DEPTH levels (measured
    before parsing, which recurses once per level), integers within Python's
    digit limit."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    if deepest > MAX_ARGS_DEPTH:
        raise MpgenError(None, f"--args: nested {deepest} levels deep; at most "
                               f"{MAX_ARGS_DEPTH} are supported")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MpgenError(None, f"--args: not JSON: {exc}") from None
    except ValueError:  # an integer of more digits than Python converts
        raise MpgenError(None, f"--args: an integer of more than "
                               f"{sys.get_int_max_str_digits():,} digits") from None


def _shown_args(args: Union[dict, list]) -> str:
    if isinstance(args, dict):
        return ", ".join(f"{k}={v!r}" for k, v in args.items())
    return ", ".join(repr(v) for v in args)


# -- where in the user's source ---------------------------------------------------

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _display(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _user_frame(exc: BaseException) -> Optional[Position]:
    """The innermost frame of ``exc``'s traceback outside torch and mpgen."""
    found = None
    mpgen_dir = str(Path(__file__).resolve().parents[2])  # mpgen/
    for frame in traceback.extract_tb(exc.__traceback__):
        where = str(Path(frame.filename).resolve()) if frame.filename else ""
        if where.startswith((_TORCH_DIR, mpgen_dir)) or not frame.lineno:
            continue
        found = Position(_display(frame.filename), frame.lineno, (frame.colno or 0) + 1)
    return found


def _node_position(node: fx.Node) -> Optional[Position]:
    """The source line of ``node`` (recorded by the tracer), if any."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)[^\n]*\n([^\n]*)', trace)
    if not frames:
        return None
    frames = [f for f in frames if not str(Path(f[0]).resolve()).startswith(_TORCH_DIR)]
    if not frames:
        return None
    file, line, _ = frames[-1]
    source = linecache.getline(file, int(line))
    return Position(_display(file), int(line), len(source) - len(source.lstrip()) + 1)


def _node_error(node: fx.Node, message: str) -> MpgenError:
    return MpgenError(_node_position(node), f"fx node {node.name!r} ({_describe(node)}): "
                                            f"{message}")


def _describe(node: fx.Node) -> str:
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return f"call_function {name}"
    return f"{node.op} {node.target}"


# -- constructor arguments ----------------------------------------------------------

_MISSING = object()

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
        lambda m: {F.relu: "relu", F.gelu: "gelu"}.get(m.activation, _MISSING),
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "layer_norm_eps"):
        lambda m: m.norm1.eps,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "batch_first"):
        lambda m: m.self_attn.batch_first,
    ((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), "bias"):
        lambda m: m.linear1.bias is not None,
}


def _recover(module: nn.Module, param: inspect.Parameter) -> Any:
    """The value ``param`` of ``type(module).__init__`` had, or _MISSING."""
    for (classes, name), read in _KNOWN_ARGUMENTS.items():
        if name == param.name and isinstance(module, classes):
            return read(module)
    value = getattr(module, param.name, _MISSING)
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


def _yaml_value(value: Any) -> Any:
    """``value`` as the spec writes it (tuples are lists), or _MISSING."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [_yaml_value(v) for v in value]
        return _MISSING if any(v is _MISSING for v in items) else items
    return _MISSING


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
        written = _MISSING if value is _MISSING else _yaml_value(value)
        if written is _MISSING:
            if param.default is param.empty:
                shown = "" if value is _MISSING else f" ({value!r} cannot be written in a spec)"
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
                               f"({_shown_args(values)}) builds a different module")
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


# -- the spec being built -------------------------------------------------------------

class Leaf:
    """One element of a returned tuple; named when something reads it."""

    def __init__(self) -> None:
        self.name: Optional[str] = None


Ref = Union[str, Leaf, list]  # a value, a tuple element, or a tuple of them


@dataclass
class Layer:
    name: str
    op: str
    node: fx.Node
    module: Optional[nn.Module] = None
    inputs: list = field(default_factory=list)  # positional: refs, nested lists
    keyword_inputs: dict = field(default_factory=dict)
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    call: dict = field(default_factory=dict)
    elements: Optional[list] = None  # the tuple it returns: Leafs, nested
    tie: dict = field(default_factory=dict)
    repeat: int = 1
    reads: list = field(default_factory=list)  # every value it reads, sizes included
    factory: bool = False  # no tensor input: in: []
    chain: list = field(default_factory=list)  # the copies a repeated layer folds

    def key(self) -> tuple:
        """What makes two module layers copies of each other."""
        return (self.op, repr(self.args), repr(sorted(self.kwargs.items())),
                repr(sorted(self.call.items())))


@dataclass(frozen=True)
class Imported:
    """The spec's text, and what a user should know about it."""

    text: str
    name: str
    layers: int
    notes: tuple[str, ...]


class _Recorder(fx.Interpreter):
    """Runs the traced graph once and keeps every node's value."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            value = super().run_node(n)
        except Exception as exc:
            raise _node_error(n, f"fails on sample inputs of the --input shapes: "
                                 f"{type(exc).__name__}: {exc}") from None
        self.values[n] = value
        return value


class _Importer:
    def __init__(self, root: nn.Module, inputs: Sequence[InputSpec]) -> None:
        self.root = root
        self.inputs = list(inputs)
        tracer = fx.Tracer()
        tracer.record_stack_traces = True
        cls = type(root).__name__
        try:
            graph = tracer.trace(root)
        except Exception as exc:
            raise MpgenError(_user_frame(exc), f"torch.fx cannot trace {cls}.forward: "
                                               f"{type(exc).__name__}: {exc}") from None
        self.gm = fx.GraphModule(root, graph, cls)
        self.graph = self.gm.graph
        self.graph.eliminate_dead_code()
        self.check_placeholders()
        recorder = _Recorder(self.gm)
        with torch.no_grad():
            recorder.run(*[spec.sample() for spec in self.inputs])
        self.values = recorder.values
        self.names = Namespace({n.name for n in self.graph.nodes})
        self.refs: dict[fx.Node, Ref] = {}
        self.sizes: dict[fx.Node, str] = {}  # an int node's expression
        self.shapes: dict[fx.Node, str] = {}  # x.shape / x.size(): x's name
        self.devices: set[fx.Node] = set()  # x.device
        self.layers: list[Layer] = []
        self.by_module: dict[int, Layer] = {}  # a module called again is tied to its first
        self.outputs: list[str] = []

    # -- inputs -----------------------------------------------------------------
    def check_placeholders(self) -> None:
        wanted = [n.target for n in self.graph.nodes if n.op == "placeholder"]
        given = [spec.name for spec in self.inputs]
        for name in given:
            if given.count(name) > 1:
                raise MpgenError(None, f"--input {name}: given more than once")
            if name not in wanted:
                raise MpgenError(None, f"--input {name}: {type(self.root).__name__}.forward "
                                       f"has no argument {name!r}{did_you_mean(name, wanted)}; "
                                       f"its arguments: {', '.join(wanted)}")
        missing = [n for n in wanted if n not in given]
        if missing:
            raise MpgenError(None, f"{type(self.root).__name__}.forward takes "
                                   f"{', '.join(missing)}: give its shape with --input "
                                   f"{missing[0]}=D0,D1,...")
        self.inputs.sort(key=lambda spec: wanted.index(spec.name))

    # -- nodes ------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.refs[node] = node.name
            elif node.op == "get_attr":
                what = ("a parameter" if isinstance(self.values[node], nn.Parameter)
                        else "a buffer or constant")
                raise _node_error(node, f"forward reads {what} of the module as a tensor "
                                        f"(self.{node.target}); a spec's tensors come from "
                                        "its inputs and layers: move it into a torch.nn "
                                        "module (nn.Embedding, nn.Linear)")
            elif node.op == "call_module":
                self.module_layer(node)
            elif node.op == "output":
                self.model_outputs(node)
            else:
                self.function_node(node)

    def ref_name(self, ref: Ref) -> Any:
        """A ref as ``in:`` writes it; a tuple element read is named here."""
        if isinstance(ref, Leaf):
            if ref.name is None:
                ref.name = self.names.fresh("element")
            return ref.name
        if isinstance(ref, list):
            return [self.ref_name(r) for r in ref]
        return ref

    def tensor(self, node: fx.Node, user: fx.Node, reads: list) -> Any:
        """The ref of ``node``, read as a tensor by ``user``."""
        if node not in self.refs:
            raise _node_error(user, f"reads {node.name!r}, which is not a tensor a spec can "
                                    "pass (a size, or a value it cannot express)")
        name = self.ref_name(self.refs[node])
        reads.extend(_flat(name))
        return name

    def value(self, arg: Any, user: fx.Node, reads: list) -> Any:
        """A literal argument as the spec writes it (sizes as expressions)."""
        if isinstance(arg, fx.Node):
            if arg in self.sizes:
                reads.extend(re.findall(r"size\((\w+),", self.sizes[arg]))
                return f"={self.sizes[arg]}"
            raise _node_error(user, f"passes {arg.name!r} where a spec can only write a "
                                    "literal or a size expression")
        if isinstance(arg, (tuple, list)):
            return [self.value(a, user, reads) for a in arg]
        if isinstance(arg, torch.dtype):
            return str(arg).removeprefix("torch.")
        written = _yaml_value(arg)
        if written is _MISSING:
            raise _node_error(user, f"argument {arg!r} cannot be written in a spec")
        return written

    def is_tensor_ref(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg in self.refs

    def add_layer(self, layer: Layer, node: fx.Node) -> None:
        value = self.values[node]
        if isinstance(value, tuple):
            layer.elements = _leaves(value)
            self.refs[node] = layer.elements
        elif isinstance(value, torch.Tensor):
            self.refs[node] = layer.name
        else:
            raise _node_error(node, f"returns {type(value).__name__}, not a tensor or a "
                                    "tuple of tensors")
        self.layers.append(layer)

    def value_of(self, name: str) -> Any:
        """The sample value of a layer or input (None for a tuple element)."""
        node = next((n for n in self.refs if self.refs[n] == name), None)
        return self.values.get(node)

    def layer_name(self, node: fx.Node) -> str:
        if hasattr(nn.Module, node.name) or node.name == "training":
            return self.names.fresh(node.name + "_layer")  # it would shadow nn.Module's
        return node.name

    def module_layer(self, node: fx.Node) -> None:
        module = self.gm.get_submodule(node.target)
        cls = type(module)
        name = self.layer_name(node)
        if getattr(nn, cls.__name__, None) is not cls or cls.__name__ not in ops.nn_module_names():
            raise _node_error(node, f"{cls.__module__}.{cls.__qualname__} is a leaf of the "
                                    "trace but not a torch.nn layer; mpgen import maps "
                                    "torch.nn modules and traces through your own")
        try:
            args, kwargs = constructor(module, name)
        except MpgenError as exc:
            raise MpgenError(_node_position(node), exc.message) from None
        layer = Layer(name, cls.__name__, node, module, args=args, kwargs=kwargs)
        for arg in node.args:
            if not self.is_tensor_ref(arg):
                raise _node_error(node, f"calls {node.target} with {arg!r} positionally; "
                                        "a spec passes a module's tensors positionally and "
                                        "other arguments by keyword")
            layer.inputs.append(self.tensor(arg, node, layer.reads))
        for key, arg in node.kwargs.items():
            if self.is_tensor_ref(arg):
                layer.keyword_inputs[key] = self.tensor(arg, node, layer.reads)
            else:
                layer.call[key] = self.value(arg, node, layer.reads)
        first = self.by_module.setdefault(id(module), layer)
        if first is not layer:  # the same module called again: share its parameters
            layer.tie = {p: first.tie.get(p, f"{first.name}.{p}")
                         for p, _ in module.named_parameters()}
        self.tie_shared(layer)
        self.add_layer(layer, node)

    def tie_shared(self, layer: Layer) -> None:
        """``lm_head.weight = wte.weight``: a parameter an earlier layer holds."""
        owners: dict[int, str] = {}
        for earlier in self.layers:
            if earlier.module is not None:
                for pname, p in earlier.module.named_parameters():
                    if pname not in earlier.tie:
                        owners.setdefault(id(p), f"{earlier.name}.{pname}")
        for pname, param in layer.module.named_parameters():
            if pname not in layer.tie and id(param) in owners:
                layer.tie[pname] = owners[id(param)]

    def rename(self, old: str, new: str) -> None:
        """Every read of the value ``old`` reads ``new`` (a folded repeat)."""
        for layer in self.layers:
            _rename_reads(layer, {old: new})
        self.outputs = _swap(self.outputs, {old: new})

    def function_node(self, node: fx.Node) -> None:
        value = self.values[node]
        target, args = node.target, list(node.args)
        if isinstance(value, torch.device):  # x.device: placement decides devices
            self.devices.add(node)
            return
        if node.op == "call_method" and target in _IDENTITY_METHODS:
            self.refs[node] = self.refs[args[0]]
            return
        if self.size_node(node, value):
            return
        if target is operator.getitem and isinstance(args[0], fx.Node):
            source = self.refs.get(args[0])
            if isinstance(source, list) and isinstance(args[1], int):
                self.refs[node] = source[args[1]]
                if isinstance(source[args[1]], Leaf) and source[args[1]].name is None:
                    source[args[1]].name = self.layer_name(node)
                return
            if isinstance(source, (str, Leaf)):
                self.indexing(node)
                return
        op, args = self.function_op(node, args)
        self.function_layer(node, op, args, dict(node.kwargs))

    def size_node(self, node: fx.Node, value: Any) -> bool:
        """Sizes and shapes become expressions; True when ``node`` was one."""
        target, args = node.target, node.args
        if isinstance(value, torch.Size):
            if (target is builtins.getattr and args[1] == "shape") or (
                    node.op == "call_method" and target == "size" and len(args) == 1
                    and not node.kwargs):
                self.shapes[node] = self.ref_name(self.refs[args[0]])
                return True
            raise _node_error(node, "computes a shape a spec cannot write; read single "
                                    "sizes (x.size(0), x.shape[1])")
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        if node.op == "call_method" and target == "size":
            dim = args[1] if len(args) > 1 else node.kwargs.get("dim")
            source = args[0]
        elif target is operator.getitem and args[0] in self.shapes:
            source, dim = None, args[1]
        elif target in _INT_OPERATORS and len(args) == 2:
            parts = [_grouped(self.sizes[a]) if isinstance(a, fx.Node) and a in self.sizes
                     else str(a) if isinstance(a, int) and not isinstance(a, bool) else None
                     for a in args]
            if None in parts:
                raise _node_error(node, "size arithmetic on a value a spec cannot write")
            self.sizes[node] = f"{parts[0]} {_INT_OPERATORS[target]} {parts[1]}"
            return True
        else:
            raise _node_error(node, "computes an integer a spec cannot write (it has "
                                    "size(x, DIM) and + - * / // % **)")
        if not isinstance(dim, int):
            raise _node_error(node, "a size of a dim that is not a constant")
        name = self.shapes[args[0]] if source is None else self.ref_name(self.refs[source])
        rank = self.values[source].dim() if source is not None else len(self.values[args[0]])
        self.sizes[node] = f"size({name}, {dim % rank})"
        return True

    def indexing(self, node: fx.Node) -> None:
        """``x[:, 0]`` is ``torch.select``; ``x[:, 1:3]`` is ``torch.narrow``."""
        source, index = node.args
        index = index if isinstance(index, tuple) else (index,)
        full = slice(None, None, None)
        picked = [(d, i) for d, i in enumerate(index) if i != full]
        if len(picked) != 1 or any(i is Ellipsis or i is None for i in index):
            raise _node_error(node, "indexing a spec cannot write: one integer or one "
                                    "slice, after full slices (x[:, 0], x[:, 1:3])")
        dim, item = picked[0]
        if isinstance(item, int) and not isinstance(item, bool):
            self.function_layer(node, "torch.select", [source, dim, item], {})
            return
        if isinstance(item, slice) and item.step in (None, 1) and all(
                v is None or (isinstance(v, int) and v >= 0) for v in (item.start, item.stop)):
            start, size = item.start or 0, self.values[source].shape[dim]
            if item.stop is not None and item.stop > size:
                raise _node_error(node, f"the slice ends past the sample's size {size} "
                                        "of that dim: a spec cannot write min(stop, size)")
            name = self.ref_name(self.refs[source])
            length = (item.stop - start if item.stop is not None
                      else _Expr(f"size({name}, {dim})" + (f" - {start}" if start else ""), name))
            self.function_layer(node, "torch.narrow", [source, dim, start, length], {})
            return
        raise _node_error(node, "indexing a spec cannot write (a step, a negative bound or "
                                "a tensor index)")

    def function_op(self, node: fx.Node, args: list) -> tuple[str, list]:
        target = node.target
        if node.op == "call_method":
            name = _METHOD_NAMES.get(target, target)
            if name not in ops.function_names("torch"):
                raise _node_error(node, f"the tensor method {target!r} has no torch function "
                                        "a spec can apply (torch.NAME)")
            if target in _VARARG_METHODS and not (len(args) == 2
                                                  and isinstance(args[1], (list, tuple))):
                args = [args[0], list(args[1:])]  # x.view(b, -1) -> torch.reshape(x, [b, -1])
            return f"torch.{name}", args
        if target in _OPERATORS:
            if (target in _SWAPPED and len(args) == 2 and not self.is_tensor_ref(args[0])
                    and self.is_tensor_ref(args[1])):
                return _SWAPPED[target], [args[1], args[0]]
            return _OPERATORS[target], args
        name = getattr(target, "__name__", None)
        for prefix, namespace in (("torch", torch), ("F", F)):
            if name and getattr(namespace, name, None) is target \
                    and name in ops.function_names(prefix):
                return f"{prefix}.{name}", args
        spelled = f"{getattr(target, '__module__', None) or '?'}.{name or target}"
        raise _node_error(node, f"{spelled} is not a torch.NAME or F.NAME tensor function a "
                                "spec can apply")

    def function_layer(self, node: fx.Node, op: str, args: list, kwargs: dict) -> None:
        name = self.layer_name(node)
        layer = Layer(name, op, node)
        try:
            fn = ops.resolve_op(op, (), factory=True)
        except ops.OpError as exc:
            raise _node_error(node, str(exc)) from None
        names = _argument_names(fn.target, args, kwargs, self.values)
        if fn.seq_input and args and isinstance(args[0], (list, tuple)):
            layer.inputs = [self.tensor(a, node, layer.reads) for a in args[0]]
            args = args[1:]
            names = names and names[1:]
        else:
            while args and self.is_tensor_ref(args[0]):
                layer.inputs.append(self.tensor(args.pop(0), node, layer.reads))
        layer.factory = not layer.inputs
        if layer.factory and op.removeprefix("torch.") not in ops.FACTORIES:
            raise _node_error(node, f"{op} reads no tensor first; a spec's function layer "
                                    "takes its tensors before its other arguments")
        names = names and names[len(layer.inputs):]
        for i, arg in enumerate(args):
            key = names[i] if names else None
            if self.is_tensor_ref(arg):
                if key is None:
                    raise _node_error(node, f"{op} takes a tensor after a non-tensor "
                                            "argument, which a spec cannot write")
                layer.keyword_inputs[key] = self.tensor(arg, node, layer.reads)
            elif key is not None and key not in LAYER_FIELDS and not layer.args:
                layer.kwargs[key] = self.literal(arg, node, layer)
            else:
                layer.args.append(self.literal(arg, node, layer))
        for key, arg in kwargs.items():
            if key == "device" and (arg in self.devices or not isinstance(arg, fx.Node)):
                continue  # placement decides devices
            if self.is_tensor_ref(arg):
                layer.keyword_inputs[key] = self.tensor(arg, node, layer.reads)
            elif key in LAYER_FIELDS:
                layer.call[key] = self.literal(arg, node, layer)
            else:
                layer.kwargs[key] = self.literal(arg, node, layer)
        _drop_defaults(fn.target, layer.kwargs)
        flag = _TRAINING_FLAG.get(op)
        if flag is not None and layer.kwargs.get(flag) == self.root.training:
            del layer.kwargs[flag]  # the spec ties it to the model's own mode
        self.add_layer(layer, node)

    def literal(self, arg: Any, node: fx.Node, layer: Layer) -> Any:
        if isinstance(arg, _Expr):
            layer.reads.append(arg.read)
            return f"={arg.text}"
        return self.value(arg, node, layer.reads)

    def model_outputs(self, node: fx.Node) -> None:
        result = node.args[0]
        items = list(result) if isinstance(result, (tuple, list)) else [result]
        for item in items:
            ref = self.refs.get(item) if isinstance(item, fx.Node) else None
            if ref is None or isinstance(ref, list):
                raise _node_error(node, "the model returns something a spec's outputs cannot "
                                        "name: each output must be one tensor a layer makes")
            name = self.ref_name(ref)
            if name in [spec.name for spec in self.inputs]:
                raise _node_error(node, f"the model returns its input {name!r} unchanged")
            self.outputs.append(name)


def _swap(value: Any, names: dict[str, str]) -> Any:
    """``value`` with each value name in ``names`` replaced, in expressions too."""
    if isinstance(value, list):
        return [_swap(v, names) for v in value]
    if isinstance(value, dict):
        return {k: _swap(v, names) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("="):
        return re.sub(r"size\((\w+),", lambda m: f"size({names.get(m[1], m[1])},", value)
    return names.get(value, value) if isinstance(value, str) else value


def _rename_reads(layer: Layer, names: dict[str, str]) -> None:
    layer.inputs = _swap(layer.inputs, names)
    layer.keyword_inputs = _swap(layer.keyword_inputs, names)
    layer.reads = _swap(layer.reads, names)
    layer.args, layer.kwargs, layer.call = (_swap(layer.args, names),
                                            _swap(layer.kwargs, names),
                                            _swap(layer.call, names))


def _drop_defaults(fn: Any, kwargs: dict) -> None:
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


def _grouped(expression: str) -> str:
    return f"({expression})" if " " in expression.replace(", ", ",") else expression


@dataclass(frozen=True)
class _Expr:
    """An expression computed in ``forward`` from the size of ``read``."""

    text: str
    read: str


def _leaves(value: tuple) -> list:
    return [_leaves(v) if isinstance(v, tuple) else Leaf() for v in value]


def _flat(ref: Any) -> list:
    if isinstance(ref, list):
        return [x for r in ref for x in _flat(r)]
    return [ref]


def _argument_names(fn: Any, args: list, kwargs: dict, values: dict) -> Optional[list]:
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


# -- repeats and order ----------------------------------------------------------------

def _fold_repeats(layers: list[Layer], importer: _Importer) -> list[Layer]:
    """Runs of copies of one module layer, each reading only the one before
    and read only by the next, become one layer with ``repeat:``."""
    owners = {target.partition(".")[0] for layer in layers for target in layer.tie.values()}
    result: list[Layer] = []
    runs: list[Layer] = []
    for layer in layers:
        prev = result[-1] if result else None
        if (prev is not None and prev.name not in owners and layer.name not in owners
                and _continues(prev, layer, importer)):
            prev.repeat += 1
            prev.chain.append(layer)
            if prev.repeat == 2:
                runs.append(prev)
            continue
        if layer.repeat == 1:  # (a repeated block is already folded)
            layer.chain = [layer]
        result.append(layer)
    for run in runs:
        old = run.chain[-1].name
        run.name = _run_name([m.node.target for m in run.chain], importer) or run.name
        importer.rename(old, run.name)
    return result


def _continues(run: Layer, layer: Layer, importer: _Importer) -> bool:
    last = run.chain[-1]
    if not (run.module is not None and layer.module is not None and run.key() == layer.key()
            and layer.repeat == 1
            and not run.tie and not layer.tie and run.elements is None
            and layer.elements is None and not layer.keyword_inputs and not last.keyword_inputs
            and layer.inputs == [last.name] and len(run.chain[0].inputs) == 1
            and all(m.module is not layer.module for m in run.chain)):
        return False
    users = [u for u in last.node.users]
    if users != [layer.node]:
        return False
    before, after = importer.values[last.node], importer.values[layer.node]
    return before.shape == after.shape and before.dtype == after.dtype


def _run_name(paths: list[str], importer: _Importer) -> Optional[str]:
    """A run that is a whole ``nn.Sequential``/``ModuleList`` (``blocks.0``
    ... ``blocks.N-1``) takes its name, so state-dict keys match."""
    parent = paths[0].rpartition(".")[0]
    if parent and paths == [f"{parent}.{i}" for i in range(len(paths))]:
        container = importer.gm.get_submodule(parent)
        if len(list(container.children())) == len(paths):
            candidate = parent.replace(".", "_")
            if not importer.names.taken(candidate) and not hasattr(nn.Module, candidate):
                return importer.names.claim(candidate)
    return None


# NOTE: [Blocks]
# A user module traced through leaves its layers contiguous in the layer
# order (fx records each node's module path in ``nn_module_stack``). Two or
# more instances in a row that read the same (their layers alike once named
# relative to the instance, and their outside inputs named ``x``), each
# reading only the one before, read only by the next and keeping its shape,
# become one block class and a layer that repeats it; like a leaf run, a
# run that is a whole Sequential/ModuleList takes its name, so state-dict
# keys agree (``layer1.0.conv1.weight``). An instance on its own stays
# unrolled: a block used once would only add a level to read.

@dataclass
class _Instance:
    """One instance of a user module as it would be a block."""

    path: str
    cls: type
    layers: list[Layer]
    lines: list[str]  # its layers inside the block
    input: str  # the value it reads from outside
    output: str  # its value read outside


def _instance_path(layer: Layer) -> Optional[tuple[str, type]]:
    """The outermost user module (not torch's) the layer's node ran in."""
    for path, cls in (layer.node.meta.get("nn_module_stack") or {}).values():
        if (path and path != layer.node.target and isinstance(cls, type)
                and not cls.__module__.startswith("torch.")):
            return path, cls
    return None


def _instance(path: str, cls: type, layers: list[Layer], readers: dict[str, int],
              tied: set[str]) -> Optional[_Instance]:
    """``layers`` (one instance of ``path``) as a block's layers, or None
    where a block cannot hold them simply (NOTE [Blocks])."""
    inside = {l.name for l in layers} | {leaf.name for l in layers
                                         for leaf in _flat(l.elements or []) if leaf.name}
    outside = {r for l in layers for r in l.reads if r not in inside}
    last = layers[-1]
    read_outside = {n for n in inside if readers.get(n, 0) > sum(
        1 for l in layers for r in l.reads if r == n)}
    if (len(outside) != 1 or read_outside != {last.name} or last.elements is not None
            or any(l.tie or l.name in tied for l in layers)):
        return None
    (source,) = outside
    local = Namespace({"x"})
    names = {source: "x"}
    for layer in layers:
        base = (layer.node.target[len(path) + 1:].replace(".", "_")
                if layer.module is not None else re.sub(r"_\d+$", "", layer.node.name))
        if hasattr(nn.Module, base) or base == "training":
            base += "_layer"
        names[layer.name] = local.fresh(base)
        for leaf in _flat(layer.elements or []):
            if leaf.name:
                names[leaf.name] = local.fresh(re.sub(r"_\d+$", "", leaf.name))
    copies = []
    for layer in layers:
        twin = copy.copy(layer)
        _rename_reads(twin, names)
        twin.name = names[layer.name]
        copies.append(twin)
    return _Instance(path, cls, layers, _layer_lines(copies, "x", names), source, last.name)


def _fold_blocks(layers: list[Layer], importer: _Importer, model: str
                 ) -> tuple[list[Layer], dict[str, list[str]]]:
    """Runs of alike instances of a user module: a block and a repeated layer."""
    readers: dict[str, int] = {}
    for layer in layers:
        for name in layer.reads:
            readers[name] = readers.get(name, 0) + 1
    for name in importer.outputs:
        readers[name] = readers.get(name, 0) + 1
    tied = {t.partition(".")[0] for layer in layers for t in layer.tie.values()}
    segments: list[tuple[Optional[tuple[str, type]], list[Layer]]] = []
    for layer in layers:
        where = _instance_path(layer)
        if segments and segments[-1][0] == where:
            segments[-1][1].append(layer)
        else:
            segments.append((where, [layer]))
    seen = [where for where, _ in segments if where]
    instances = [_instance(where[0], where[1], group, readers, tied)
                 if where and seen.count(where) == 1 else None for where, group in segments]
    result: list[Layer] = []
    blocks: dict[str, list[str]] = {}
    k = 0
    while k < len(segments):
        run = [instances[k]] if instances[k] else []
        while run and k + len(run) < len(instances):
            following = instances[k + len(run)]
            if not (following and following.cls is run[0].cls and following.lines == run[0].lines
                    and following.input == run[-1].output
                    and _same_type(importer, following.input, following.output)
                    and readers[following.input] == sum(
                        r == following.input for l in following.layers for r in l.reads)):
                break
            run.append(following)
        if len(run) < 2 or not _same_type(importer, run[0].input, run[0].output):
            result.extend(segments[k][1])
            k += 1
            continue
        name = next((n for n, lines in blocks.items() if lines == run[0].lines),
                    None) or _block_name(run[0].cls, blocks, model)
        blocks[name] = run[0].lines
        first = run[0].layers[0]
        layer = Layer(first.name, name, first.node, inputs=[run[0].input], reads=[run[0].input],
                      repeat=len(run))
        layer.chain = [instance.layers[-1] for instance in run]
        layer.name = _run_name([i.path for i in run], importer) or _path_name(run[0].path,
                                                                               importer)
        importer.rename(run[-1].output, layer.name)
        result.append(layer)
        k += len(run)
    return result, blocks


def _same_type(importer: _Importer, source: str, result: str) -> bool:
    before, after = importer.value_of(source), importer.value_of(result)
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
            and before.shape == after.shape and before.dtype == after.dtype)


def _block_name(cls: type, blocks: dict, model: str) -> str:
    taken = {*blocks, model, *ops.nn_module_names()}
    name, i = cls.__name__, 2
    while name in taken or not name.isidentifier():
        name, i = f"{cls.__name__}{i}", i + 1
    return name


def _path_name(path: str, importer: _Importer) -> str:
    return importer.names.fresh(path.replace(".", "_"))


def _param_order(layers: list[Layer]) -> list[int]:
    seen: dict[int, None] = {}
    for layer in layers:
        if layer.module is not None:
            for pname, p in layer.module.named_parameters():
                if pname not in layer.tie:
                    seen.setdefault(id(p))
    return list(seen)


def _reorder(layers: list[Layer], rank: dict[int, int]) -> list[Layer]:
    """Layers in an order of the data flow that follows the original's
    parameter order where it can (NOTE [Parameter order])."""
    producer: dict[str, Layer] = {}
    for layer in layers:
        producer[layer.name] = layer
        for leaf in _flat(layer.elements or []):
            if leaf.name:
                producer[leaf.name] = layer
    deps = {id(l): {id(producer[r]) for r in l.reads if r in producer} for l in layers}
    readers: dict[int, list[Layer]] = {id(l): [] for l in layers}
    for layer in layers:
        for d in deps[id(layer)]:
            readers[d].append(layer)
    inf = len(rank) + 1
    key: dict[int, int] = {}
    for layer in reversed(layers):  # the earliest parameter it or a later reader holds
        own = min((rank.get(id(p), inf) for p in (layer.module.parameters()
                                                  if layer.module is not None else ())),
                  default=inf)
        key[id(layer)] = min([own, *(key[id(r)] for r in readers[id(layer)])])
    index = {id(l): i for i, l in enumerate(layers)}
    done: set[int] = set()
    result = []
    while len(result) < len(layers):
        ready = [l for l in layers if id(l) not in done and deps[id(l)] <= done]
        chosen = min(ready, key=lambda l: (key[id(l)], index[id(l)]))
        done.add(id(chosen))
        result.append(chosen)
    return result


# -- writing the spec -----------------------------------------------------------------

def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return {"inf": ".inf", "-inf": "-.inf", "nan": ".nan"}.get(text, text)
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z_][\w.:]*", value) is not None
        if plain and yaml.safe_load(f"[{value}]") == [value]:
            return value
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(_scalar(v) for v in value) + "]"


def _element_names(elements: list, names: Optional[dict] = None) -> list:
    names = names or {}
    return [_element_names(e, names) if isinstance(e, list)
            else names.get(e.name, e.name) if e.name else "_" for e in elements]


def _layer_lines(layers: list[Layer], first_input: str,
                 names: Optional[dict] = None) -> list[str]:
    """The ``layers:`` entries; ``in:`` is left out where it is the default."""
    lines, previous = [], first_input
    for layer in layers:
        lines.append(_layer_line(layer, previous, names))
        previous = layer.name if layer.elements is None else None
    return lines


def _layer_line(layer: Layer, default_input: Optional[str],
                names: Optional[dict] = None) -> str:
    fields: dict[str, Any] = {"op": layer.op}
    items: list = list(layer.inputs)
    if layer.keyword_inputs:
        items.append(dict(layer.keyword_inputs))
    if layer.factory:
        fields["in"] = []
    elif items != [default_input] or default_input is None:
        fields["in"] = items[0] if len(items) == 1 and isinstance(items[0], str) else items
    if layer.args:
        fields["args"] = layer.args
    fields.update(layer.kwargs)
    if layer.call:
        fields["call"] = layer.call
    if layer.elements is not None:
        fields["outputs"] = _element_names(layer.elements, names)
    if layer.repeat > 1:
        fields["repeat"] = layer.repeat
    if layer.tie:
        fields["tie"] = layer.tie
    return f"  {layer.name}: {_scalar(fields)}"


def _model_name(cls: type) -> str:
    for name in (cls.__name__, f"{cls.__name__}Model", f"{cls.__name__}Net"):
        if model_name_problem(name) is None:
            return name
    raise MpgenError(None, f"{cls.__name__}: {model_name_problem(cls.__name__)}")


def import_module(root: nn.Module, inputs: Sequence[InputSpec], command: str,
                  devices: Optional[int] = None,
                  time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Imported:
    """The spec of ``root`` traced with torch.fx; raises MpgenError. The spec
    is compiled before it is returned, so it builds."""
    importer = _Importer(root, inputs)
    importer.run()
    notes = []
    original = [id(p) for p in root.parameters()]
    used = set(_param_order(importer.layers))
    unused = [n for n, p in root.named_parameters() if id(p) not in used]
    if unused:
        raise MpgenError(None, f"{type(root).__name__}: forward does not use the "
                               f"parameters {', '.join(unused[:5])}"
                               f"{' ...' if len(unused) > 5 else ''}; a spec holds only the "
                               "layers forward calls (remove the unused modules)")
    layers = importer.layers
    if _param_order(layers) != original:
        layers = _reorder(layers, {p: i for i, p in enumerate(original)})
        if _param_order(layers) != original:
            notes.append(f"no order of the layers gives {type(root).__name__}'s parameter "
                         "order (a module registered before one whose output it reads); "
                         "copy weights by name, not by position")
    layers, blocks = _fold_blocks(layers, importer, _model_name(type(root)))
    layers = _fold_repeats(layers, importer)
    text = _render(root, importer, layers, blocks, command, devices)
    _check_builds(text, time_limit)
    return Imported(text, _model_name(type(root)), len(layers), tuple(notes))


def _render(root: nn.Module, importer: _Importer, layers: list[Layer],
            blocks: dict[str, list[str]], command: str, devices: Optional[int]) -> str:
    cls = type(root)
    lines = [f"# Made by `{command}`:",
             f"# {cls.__module__}.{cls.__qualname__} traced with torch.fx (docs/import.md).",
             "mpgen: 1", f"name: {_model_name(cls)}", "", "inputs:"]
    for spec in importer.inputs:
        shape = _scalar(list(spec.dims))
        lines.append(f"  {spec.name}: " + (shape if spec.dtype == "float32"
                                           else f"{{shape: {shape}, dtype: {spec.dtype}}}"))
    if blocks:
        lines += ["", "blocks:"]
        for name, block in blocks.items():
            lines += [f"  {name}:", "    layers:", *(f"    {line}" for line in block)]
    lines += ["", "layers:", *_layer_lines(layers, importer.inputs[0].name)]
    outputs = importer.outputs
    if outputs != [layers[-1].name] or layers[-1].elements is not None:
        lines += ["", f"outputs: {_scalar(outputs)}"]
    if devices:
        lines += ["", "placement:", "  auto:",
                  f"    devices: {_scalar([f'cuda:{i}' for i in range(devices)])}"]
    return "\n".join(lines) + "\n"


def _check_builds(text: str, time_limit: Optional[float]) -> None:
    """Compile the spec; a failure is mpgen import's, reported as such."""
    with tempfile.TemporaryDirectory(prefix="mpgen-import-") as folder:
        path = Path(folder) / "imported.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            pipeline.compile_spec(path, {"*": "cpu"}, root=folder, time_limit=time_limit)
        except MpgenError as exc:
            shown = str(exc).replace(str(path), "<imported spec>")
            lines = text.splitlines()
            quoted = [f"  line {n}: {lines[int(n) - 1].strip()}"
                      for n in dict.fromkeys(re.findall(r"<imported spec>:(\d+):", shown))
                      if 0 < int(n) <= len(lines)]
            raise MpgenError(None, "the imported spec does not build (a model mpgen import "
                                   "cannot express yet; please report it):\n"
                                   + "\n".join([shown, *quoted])) from None


def write_spec(text: str, out: Optional[str], force: bool) -> None:
    """Write ``text`` to ``out`` (not over an existing file unless ``force``)."""
    path = Path(out)
    if path.exists() and not force:
        raise MpgenError(None, f"{out}: exists; refusing to overwrite it (pass --force)")
    path.write_text(text, encoding="utf-8")
