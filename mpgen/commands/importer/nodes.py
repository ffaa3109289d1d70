"""``mpgen import`` reads the trace: each node becomes a layer of the spec, a
size expression, or the ``outputs:`` names of a layer's tuple (the list in
the package's docstring)."""

from __future__ import annotations

import builtins
import operator
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from mpgen.commands.importer.arguments import (
    LAYER_FIELDS, MISSING, argument_names, constructor, drop_defaults, yaml_value)
from mpgen.commands.importer.layers import Layer, Leaf, Ref, flat, rename_reads, swap
from mpgen.commands.importer.trace import InputSpec, node_error, node_position, trace
from mpgen.compiler.analysis import meta
from mpgen.compiler.frontend import ops
from mpgen.compiler.frontend.namespace import Namespace
from mpgen.compiler.frontend.resolve import _TRAINING_FLAG  # the dropout-like functions
from mpgen.errors import MpgenError

_OPERATORS = {operator.add: "torch.add", operator.iadd: "torch.add",
              operator.sub: "torch.sub", operator.isub: "torch.sub",
              operator.mul: "torch.mul", operator.imul: "torch.mul",
              operator.truediv: "torch.div", operator.itruediv: "torch.div",
              operator.floordiv: "torch.floor_divide", operator.matmul: "torch.matmul",
              operator.pow: "torch.pow", operator.mod: "torch.remainder",
              operator.neg: "torch.neg", operator.eq: "torch.eq", operator.ne: "torch.ne",
              operator.lt: "torch.lt", operator.le: "torch.le", operator.gt: "torch.gt",
              operator.ge: "torch.ge", operator.and_: "torch.bitwise_and",
              operator.iand: "torch.bitwise_and", operator.or_: "torch.bitwise_or",
              operator.ior: "torch.bitwise_or", operator.xor: "torch.bitwise_xor",
              operator.invert: "torch.bitwise_not"}
#: ``2 * x``: the tensor goes first, the spec's order (inputs, then args).
_SWAPPED = {operator.add: "torch.add", operator.mul: "torch.mul", operator.sub: "torch.rsub"}
#: Size arithmetic: ``x.size(0) * 2`` -> ``size(x, 0) * 2``.
_INT_OPERATORS = {operator.add: "+", operator.sub: "-", operator.mul: "*",
                  operator.floordiv: "//", operator.truediv: "/", operator.mod: "%",
                  operator.pow: "**"}
#: Tensor methods spelled as another torch function (``view`` copies only
#: where the tensor is not contiguous; the values are the same).
_METHOD_NAMES = {"view": "reshape", "expand": "broadcast_to"}
#: Methods whose sizes may come as separate arguments: ``x.view(b, -1)``.
_VARARG_METHODS = frozenset({"view", "reshape", "permute", "flip", "tile", "expand"})
#: Methods that return their input's values unchanged.
_IDENTITY_METHODS = frozenset({"contiguous"})
#: In-place tensor methods whose torch function (the name without ``_``)
#: gives the values they write: ``h.mul_(2)`` is ``torch.mul(h, 2)``.
_IN_PLACE_METHODS = frozenset({
    "add_", "sub_", "mul_", "div_", "neg_", "pow_", "masked_fill_", "clamp_", "clamp_min_",
    "clamp_max_", "relu_", "sigmoid_", "tanh_", "exp_", "sqrt_", "abs_", "tril_", "triu_",
    "addcmul_", "addcdiv_", "lerp_"})
#: Tensor methods and torch functions whose result may share storage with
#: their input: a write in place after one would show through it.
_VIEWS = frozenset({"view", "view_as", "reshape", "transpose", "permute", "unsqueeze",
                    "squeeze", "expand", "expand_as", "narrow", "select", "t", "flatten",
                    "unflatten", "split", "chunk", "unbind", "as_strided", "movedim",
                    "swapaxes", "diagonal", "contiguous", "detach", "alias"})
#: Factories whose sizes may come as separate arguments: ``torch.ones(n)``.
_VARARG_FACTORIES = frozenset({"ones", "zeros", "empty", "rand", "randn"})
#: Casts (docs/spec.md, "Casts"): tensor methods, and the functions that
#: cast a tensor they are given (``torch.as_tensor(x, dtype=...)``).
_CAST_METHODS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16",
                           "long", "int", "short", "bool"})
_CAST_FUNCTIONS = (torch.as_tensor, torch.asarray, torch.Tensor.to, torch.Tensor.type_as)


class Importer:
    """The layers of a traced module, read node by node (:meth:`run`)."""

    def __init__(self, root: nn.Module, inputs: Sequence[InputSpec]) -> None:
        self.root = root
        self.gm, self.inputs, self.values = trace(root, inputs)
        self.graph = self.gm.graph
        self.names = Namespace({n.name for n in self.graph.nodes})
        self.refs: dict[fx.Node, Ref] = {}
        self.sizes: dict[fx.Node, str] = {}  # an int node's expression
        self.shapes: dict[fx.Node, str] = {}  # x.shape / x.size(): x's name
        self.devices: set[fx.Node] = set()  # x.device
        self.layers: list[Layer] = []
        self.by_module: dict[int, Layer] = {}  # a module called again is tied to its first
        self.outputs: list[str] = []

    # -- nodes ------------------------------------------------------------------
    def run(self) -> None:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.refs[node] = node.name
            elif node.op == "get_attr":
                what = ("a parameter" if isinstance(self.values[node], nn.Parameter)
                        else "a buffer or constant")
                raise node_error(node, f"forward reads {what} of the module as a tensor "
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
            raise node_error(user, f"reads {node.name!r}, which is not a tensor a spec can "
                                   "pass (a size, or a value it cannot express)")
        name = self.ref_name(self.refs[node])
        reads.extend(flat(name))
        return name

    def value(self, arg: Any, user: fx.Node, reads: list) -> Any:
        """A literal argument as the spec writes it (sizes as expressions)."""
        if isinstance(arg, fx.Node):
            if arg in self.sizes:
                reads.extend(re.findall(r"size\((\w+),", self.sizes[arg]))
                return f"={self.sizes[arg]}"
            raise node_error(user, f"passes {arg.name!r} where a spec can only write a "
                                   "literal or a size expression")
        if isinstance(arg, (tuple, list)):
            return [self.value(a, user, reads) for a in arg]
        if isinstance(arg, torch.dtype):
            return str(arg).removeprefix("torch.")
        written = yaml_value(arg)
        if written is MISSING:
            raise node_error(user, f"argument {arg!r} cannot be written in a spec")
        return written

    def is_size_list(self, arg: Any) -> bool:
        """Whether ``arg`` is a node of sizes (``x.shape[:-1] + (n,)``)."""
        return False

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
            raise node_error(node, f"returns {type(value).__name__}, not a tensor or a "
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
            raise node_error(node, f"{cls.__module__}.{cls.__qualname__} is a leaf of the "
                                   "trace but not a torch.nn layer; mpgen import maps "
                                   "torch.nn modules and traces through your own")
        try:
            args, kwargs = constructor(module, name)
        except MpgenError as exc:
            raise MpgenError(node_position(node), exc.message) from None
        layer = Layer(name, cls.__name__, node, module, args=args, kwargs=kwargs)
        for arg in node.args:
            if not self.is_tensor_ref(arg):
                raise node_error(node, f"calls {node.target} with {arg!r} positionally; "
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
            rename_reads(layer, {old: new})
        self.outputs = swap(self.outputs, {old: new})

    def function_node(self, node: fx.Node) -> None:
        value = self.values[node]
        target, args = node.target, list(node.args)
        if isinstance(value, torch.device):  # x.device: placement decides devices
            self.devices.add(node)
            return
        if node.op == "call_method" and target in _IDENTITY_METHODS:
            self.refs[node] = self.refs[args[0]]
            return
        if (isinstance(value, torch.Tensor) and args and self.is_tensor_ref(args[0]) and (
                (node.op == "call_method" and target in _CAST_METHODS)
                or (node.op == "call_function" and target in _CAST_FUNCTIONS))):
            self.cast(node, args[0], value.dtype)
            return
        if self.size_node(node, value):
            return
        if target is operator.setitem:
            self.setitem(node)
            return
        if node.op == "call_method" and target in _IN_PLACE_METHODS:
            self.in_place(node)
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

    def cast(self, node: fx.Node, source: fx.Node, dtype: torch.dtype) -> None:
        """``x.long()``, ``x.to(torch.float16)``, ``x.type_as(y)``,
        ``torch.as_tensor(x, dtype=...)``: a ``torch.Tensor.to`` layer of the
        dtype the trace gave (none where the dtype stays: ``x.to(device)``)."""
        before = self.values[source].dtype
        if before == dtype:
            self.refs[node] = self.refs[source]
            return
        written = meta.DTYPE_NAMES.get(dtype)
        if written is None:
            raise node_error(node, f"casts {str(before).removeprefix('torch.')} to "
                                   f"{str(dtype).removeprefix('torch.')}, a dtype a spec does "
                                   f"not have ({', '.join(meta.TORCH_DTYPES)})")
        layer = Layer(self.layer_name(node), "torch.Tensor.to", node)
        layer.inputs.append(self.tensor(source, node, layer.reads))
        layer.kwargs["dtype"] = written
        self.add_layer(layer, node)

    def size_node(self, node: fx.Node, value: Any) -> bool:
        """Sizes and shapes become expressions; True when ``node`` was one."""
        target, args = node.target, node.args
        if isinstance(value, torch.Size):
            if (target is builtins.getattr and args[1] == "shape") or (
                    node.op == "call_method" and target == "size" and len(args) == 1
                    and not node.kwargs):
                self.shapes[node] = self.ref_name(self.refs[args[0]])
                return True
            raise node_error(node, "computes a shape a spec cannot write; read single "
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
                raise node_error(node, "size arithmetic on a value a spec cannot write")
            self.sizes[node] = f"{parts[0]} {_INT_OPERATORS[target]} {parts[1]}"
            return True
        else:
            raise node_error(node, "computes an integer a spec cannot write (it has "
                                   "size(x, DIM) and + - * / // % **)")
        if not isinstance(dim, int):
            raise node_error(node, "a size of a dim that is not a constant")
        name = self.shapes[args[0]] if source is None else self.ref_name(self.refs[source])
        rank = self.values[source].dim() if source is not None else len(self.values[args[0]])
        self.sizes[node] = f"size({name}, {dim % rank})"
        return True

    def indexing(self, node: fx.Node) -> None:
        """``x[:, 0]`` is ``torch.select``; ``x[:, 1:3]`` is ``torch.narrow``."""
        source, index = node.args
        index = index if isinstance(index, tuple) else (index,)
        if any(self.is_tensor_ref(i) for i in index):
            self.tensor_index(node, source, list(index))
            return
        full = slice(None, None, None)
        picked = [(d, i) for d, i in enumerate(index) if i != full]
        if len(picked) != 1 or any(i is Ellipsis or i is None for i in index):
            raise node_error(node, "indexing a spec cannot write: one integer or one "
                                   "slice, after full slices (x[:, 0], x[:, 1:3])")
        dim, item = picked[0]
        if isinstance(item, int) and not isinstance(item, bool):
            self.function_layer(node, "torch.select", [source, dim, item], {})
            return
        if isinstance(item, slice) and item.step in (None, 1) and all(
                v is None or (isinstance(v, int) and v >= 0) for v in (item.start, item.stop)):
            start, size = item.start or 0, self.values[source].shape[dim]
            if item.stop is not None and item.stop > size:
                raise node_error(node, f"the slice ends past the sample's size {size} "
                                       "of that dim: a spec cannot write min(stop, size)")
            name = self.ref_name(self.refs[source])
            length = (item.stop - start if item.stop is not None
                      else _Expr(f"size({name}, {dim})" + (f" - {start}" if start else ""), name))
            self.function_layer(node, "torch.narrow", [source, dim, start, length], {})
            return
        if isinstance(item, slice) and isinstance(item.step, int) and item.step > 1 and all(
                v is None or (isinstance(v, int) and v >= 0) for v in (item.start, item.stop)):
            name = self.ref_name(self.refs[source])  # x[:, 1::2]: every other from 1
            stop = item.stop if item.stop is not None else _Expr(f"size({name}, {dim})", name)
            self.function_layer(node, "torch.slice_copy",
                                [source, dim, item.start or 0, stop, item.step], {})
            return
        raise node_error(node, "indexing a spec cannot write (a negative bound or step)")

    def setitem(self, node: fx.Node) -> None:
        """``mask[a:b, c:d] = 3`` (Swin's shifted-window mask): the tensor
        written anew without writing in place: the region narrowed dim by
        dim, filled (``torch.full_like``) and scattered back
        (``torch.slice_scatter``); later reads of the tensor read the new one."""
        target, index, fill = node.args
        index = list(index) if isinstance(index, tuple) else [index]
        if not self.is_tensor_ref(target) or not isinstance(self.refs[target], str):
            raise node_error(node, "assigns into a value that is not a tensor a spec names")
        if isinstance(fill, bool) or not isinstance(fill, (int, float)):
            raise node_error(node, "assigns a value other than a number into a tensor, which "
                                   "a spec cannot write")
        parts = []
        for dim, item in enumerate(index):
            if not isinstance(item, slice) or item.step not in (None, 1) or not all(
                    v is None or (isinstance(v, int) and not isinstance(v, bool))
                    or (isinstance(v, fx.Node) and v in self.sizes)
                    for v in (item.start, item.stop)):
                raise node_error(node, "assigns into a tensor at an index other than slices "
                                       "(x[a:b, c:d] = 1), which a spec cannot write")
            if item != slice(None):
                parts.append((dim, item.start, item.stop))
        self.written_unread(node, target)

        def bound(value: Any, tensor: str, dim: int, reads: list) -> str:
            if isinstance(value, fx.Node):
                return str(self.value(value, node, reads)).removeprefix("=")
            return f"size({tensor}, {dim}) - {-value}" if value < 0 else str(value)

        def filled(tensor: str, parts: list) -> str:
            if not parts:
                return self.added_layer(node, "torch.full_like", [tensor], [], [fill], tensor)
            dim, start, stop = parts[0]
            reads = [tensor]
            size = f"size({tensor}, {dim})"
            begin = bound(start, tensor, dim, reads) if start is not None else "0"
            end = size if stop is None or (isinstance(stop, int) and stop >= 2 ** 62) else (
                bound(stop, tensor, dim, reads))
            length = f"{end} - ({begin})" if begin != "0" else end
            region = self.added_layer(node, "torch.narrow", [tensor], reads,
                                      [dim, _number(begin), _number(length)], tensor)
            inner = filled(region, parts[1:])
            return self.added_layer(node, "torch.slice_scatter", [tensor, inner], reads, [],
                                    tensor, dim=dim, start=_number(begin), end=_number(end))

        self.refs[target] = filled(self.refs[target], parts)

    def written_unread(self, node: fx.Node, target: fx.Node) -> None:
        """``node`` writes into ``target`` in place: refused where a view of
        ``target`` was taken before (it would see the write; a spec's tensors
        are never written in place, so earlier reads read the values before),
        or where ``target`` comes from outside the block (its caller would)."""
        if target not in getattr(self, "inside", (target,)):
            raise node_error(node, f"writes in place into {target.name}, which its caller "
                                   "passed, so the caller would see the write: a spec "
                                   "cannot write it (its tensors are not written in place)")
        earlier = node.prev
        while earlier is not target and earlier.op != "root":
            name = earlier.target if earlier.op == "call_method" else getattr(
                earlier.target, "__name__", None)
            if earlier in target.users and (name in _VIEWS or earlier.target is operator.getitem):
                raise node_error(node, f"writes into {target.name} in place after a view of "
                                       f"it was taken ({earlier.name}), which a spec cannot "
                                       "write (its tensors are not written in place)")
            earlier = earlier.prev

    def in_place(self, node: fx.Node) -> None:
        """``h.mul_(2)``, ``scores.masked_fill_(mask, -inf)``: the torch function
        of the method's name, and later reads of ``h`` read its result."""
        target = node.args[0]
        if not self.is_tensor_ref(target) or not isinstance(self.refs[target], str):
            raise node_error(node, "writes in place into a value that is not a tensor a "
                                   "spec names")
        self.written_unread(node, target)
        name = node.target.removesuffix("_")
        self.function_layer(node, f"torch.{name}", list(node.args), dict(node.kwargs))
        self.refs[target] = self.refs[node]

    def added_layer(self, node: fx.Node, op: str, inputs: list, reads: list, args: list,
                    base: str, **kwargs: Any) -> str:
        """A layer of one step of ``node``, named after ``base``: its name."""
        layer = Layer(self.names.fresh(base), op, node, args=list(args), kwargs=kwargs)
        for ref in inputs:
            if isinstance(ref, dict):
                layer.keyword_inputs.update(ref)
                layer.reads.extend(ref.values())
            else:
                layer.inputs.append(ref)
                layer.reads.append(ref)
        layer.reads.extend(reads)
        self.layers.append(layer)
        return layer.name

    def tensor_index(self, node: fx.Node, source: fx.Node, index: list) -> None:
        """``table[idx]``, ``x[:, idx]``, ``x[a, b]``: index tensors at adjacent
        dims, full slices around them. ``torch.index_select`` along the dim,
        of the index flattened (several index tensors: their flat index into
        those dims, ``a * size(x, 1) + b``, of ``x`` flattened there), and the
        result reshaped to the index's shape where it has other than one dim."""
        full = slice(None, None, None)
        at = [d for d, item in enumerate(index) if self.is_tensor_ref(item)]
        rank = self.values[source].dim()
        if (any(item != full for d, item in enumerate(index) if d not in at)
                or at != list(range(at[0], at[0] + len(at))) or len(index) > rank):
            raise node_error(node, "indexing with tensors a spec cannot write: it writes "
                                   "index tensors at adjacent dims, the other dims full "
                                   "slices (table[idx], x[:, idx], x[a, b])")
        for item in (index[d] for d in at):
            dtype = self.values[item].dtype
            if dtype == torch.bool:
                raise node_error(node, "indexing with a boolean mask, whose result's size "
                                       "depends on the mask's values, which a spec cannot "
                                       "write (torch.where keeps the shape)")
            if dtype not in (torch.int64, torch.int32):
                raise node_error(node, f"indexing with a tensor of {dtype}, which is no "
                                       "index")
        first, last = at[0], at[-1]
        result = self.layer_name(node)  # the node's own name for the last step
        table = self.ref_name(self.refs[source])
        indices = [self.ref_name(self.refs[index[d]]) for d in at]

        def step(op: str, inputs: list, reads: list, args: tuple = (), final: bool = False,
                 **kwargs) -> str:
            layer = Layer(result if final else self.names.fresh(f"{result}_index"), op, node)
            for ref in inputs:
                if isinstance(ref, dict):
                    layer.keyword_inputs.update(ref)
                else:
                    layer.inputs.append(ref)
            layer.reads.extend([*flat(inputs[0]), *reads,
                                *(v for r in inputs[1:] if isinstance(r, dict) for v in r.values())])
            layer.args = list(args)
            layer.kwargs.update(kwargs)
            if final:
                self.add_layer(layer, node)
            else:
                self.layers.append(layer)
            return layer.name

        flat_index = indices[-1]
        for k in range(len(at) - 2, -1, -1):  # a * size(x, 1) + b
            stride = " * ".join(f"size({table}, {d})" for d in range(at[k] + 1, last + 1))
            scaled = step("torch.mul", [indices[k]], [table], [f"={stride}"])
            flat_index = step("torch.add", [scaled, flat_index], [])
        if len(at) > 1:
            table = step("torch.flatten", [table], [], start_dim=first, end_dim=last)
        index_rank = max(self.values[index[d]].dim() for d in at)
        final = index_rank == 1
        if index_rank != 1:
            shape_of = flat_index
            flat_index = step("torch.flatten", [flat_index], [])
        picked = step("torch.index_select", [table, {"index": flat_index}], [],
                      final=final, dim=first)
        if final:
            return
        source_name = self.ref_name(self.refs[source])
        shape = ([f"=size({source_name}, {d})" for d in range(first)]
                 + [f"=size({shape_of}, {d})" for d in range(index_rank)]
                 + [f"=size({source_name}, {d})" for d in range(last + 1, rank)])
        step("torch.reshape", [picked], [source_name, shape_of], final=True, shape=shape)

    def function_op(self, node: fx.Node, args: list) -> tuple[str, list]:
        target = node.target
        if node.op == "call_method":
            name = _METHOD_NAMES.get(target, target)
            if name not in ops.function_names("torch"):
                raise node_error(node, f"the tensor method {target!r} has no torch function "
                                       "a spec can apply (torch.NAME)")
            if target in _VARARG_METHODS and not (len(args) == 2 and (
                    isinstance(args[1], (list, tuple)) or self.is_size_list(args[1]))):
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
                if prefix == "torch" and name in _VARARG_FACTORIES and args and not (
                        isinstance(args[0], (list, tuple)) or self.is_size_list(args[0])):
                    args = [list(args)]  # torch.ones(n) -> torch.ones([n])
                return f"{prefix}.{name}", args
        if target is torch._C._nn.pad:  # what F.pad calls, the same arguments
            return "F.pad", args
        spelled = f"{getattr(target, '__module__', None) or '?'}.{name or target}"
        raise node_error(node, f"{spelled} is not a torch.NAME or F.NAME tensor function a "
                               "spec can apply")

    def function_layer(self, node: fx.Node, op: str, args: list, kwargs: dict) -> None:
        name = self.layer_name(node)
        layer = Layer(name, op, node)
        try:
            fn = ops.resolve_op(op, (), factory=True)
        except ops.OpError as exc:
            raise node_error(node, str(exc)) from None
        names = argument_names(fn.target, args, kwargs, self.values)
        if fn.seq_input and args and isinstance(args[0], (list, tuple)):
            layer.inputs = [self.tensor(a, node, layer.reads) for a in args[0]]
            args = args[1:]
            names = names and names[1:]
        else:
            while args and self.is_tensor_ref(args[0]):
                layer.inputs.append(self.tensor(args.pop(0), node, layer.reads))
        layer.factory = not layer.inputs
        if layer.factory and op.removeprefix("torch.") not in ops.FACTORIES:
            raise node_error(node, f"{op} reads no tensor first; a spec's function layer "
                                   "takes its tensors before its other arguments")
        names = names and names[len(layer.inputs):]
        for i, arg in enumerate(args):
            key = names[i] if names else None
            if self.is_tensor_ref(arg):
                if key is None:
                    raise node_error(node, f"{op} takes a tensor after a non-tensor "
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
        drop_defaults(fn.target, layer.kwargs)
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
                raise node_error(node, "the model returns something a spec's outputs cannot "
                                       "name: each output must be one tensor a layer makes")
            name = self.ref_name(ref)
            if name in [spec.name for spec in self.inputs]:
                raise node_error(node, f"the model returns its input {name!r} unchanged")
            self.outputs.append(name)


def _number(text: str) -> Any:
    return int(text) if re.fullmatch(r"-?\d+", text) else f"={text}"


def _grouped(expression: str) -> str:
    return f"({expression})" if " " in expression.replace(", ", ",") else expression


@dataclass(frozen=True)
class _Expr:
    """An expression computed in ``forward`` from the size of ``read``."""

    text: str
    read: str


def _leaves(value: tuple) -> list:
    return [_leaves(v) if isinstance(v, tuple) else Leaf() for v in value]
