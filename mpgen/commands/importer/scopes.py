"""The module hierarchy of a captured model as blocks (NOTE [Module
hierarchy] in :mod:`.capture`): each module called in ``forward`` is a
layer of its parent's block named after its attribute, so the generated
model's state-dict keys are the original's."""

from __future__ import annotations

import inspect
import pydoc
import re
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

from mpgen.commands.importer.arguments import MISSING, constructor, yaml_value
from mpgen.commands.importer.capture import (
    Captured, LeafCall, Scope, holds, library_leaf, sym_expression)
from mpgen.commands.importer.layers import Layer, Leaf, layer_lines, rename_reads, scalar
from mpgen.commands.importer.nodes import Importer
from mpgen.commands.importer.trace import node_error, node_position
from mpgen.compiler.frontend import ops
from mpgen.compiler.frontend.namespace import Namespace, positional_name_problem
from mpgen.errors import MpgenError

#: ``x.new_ones(...)``: the factory, with ``x``'s dtype unless given.
_NEW_TENSORS = {"new_ones": "ones", "new_zeros": "zeros", "new_full": "full",
                "new_empty": "empty", "new_tensor": "tensor"}


class Blocks:
    """The blocks written so far: name -> text lines, and what they import."""

    def __init__(self, model: str) -> None:
        self.lines: dict[str, list[str]] = {}
        self.taken = {model, *ops.nn_module_names()}
        self.imports: set[str] = set()
        self.notes: list[str] = []
        self.written: dict[int, str] = {}  # id(tensor) -> where the spec first holds it
        #: a module's path in the generated model -> in the original, where
        #: they differ (NOTE [Module hierarchy]: a child of a Sequential)
        self.renamed: dict[str, str] = {}
        #: a module's class and parameter shapes -> the block its call became
        #: (for a held module of that class: NOTE [Held layers])
        self.made: dict[tuple, str] = {}
        #: each block instance that is not a copy of a repeated layer (its
        #: path in the generated model) -> its parameter count
        self.instances: dict[str, int] = {}

    def split(self, total: int) -> list[str]:
        """The block instances an automatic placement places layer by layer:
        those of the model holding more than half of the ``total``
        parameters (a Llama's ``model``), else one device would hold them
        whole, and such instances inside them (a wrapper's ``lm``, then its
        ``lm.transformer``), outer first."""
        chosen: list[str] = []
        for path, count in sorted(self.instances.items(), key=lambda i: i[0].count(".")):
            outer = path.rpartition(".")[0]
            if 2 * count > total and (not outer or outer in chosen):
                chosen.append(path)
        return chosen

    def add(self, cls: type, lines: list[str], path: str = "") -> str:
        """The block of these lines: a known one, or a new one named after
        ``cls`` (a plain nn.Sequential after its ``path``: ``conv1``'s is
        ``Conv1``, ``features.1``'s ``Features1``)."""
        for name, known in self.lines.items():
            if known == lines:
                return name
        base = cls.__name__ if cls.__name__.isidentifier() else "Block"
        if cls in (nn.Sequential, nn.ModuleList):
            parts = path.split(".")
            while len(parts) > 1 and not parts[-1][:1].isalpha():
                parts[-2:] = ["_".join(parts[-2:])]
            camel = "".join(w[:1].upper() + w[1:] for w in re.findall(r"[A-Za-z0-9]+",
                                                                        parts[-1]))
            base = camel if camel.isidentifier() else base
        name, i = base, 2
        while name in self.taken or name in self.lines:
            name, i = f"{base}{i}", i + 1
        self.lines[name] = lines
        return name


def _signature(module: nn.Module) -> tuple:
    """A module's class and its parameters' names and shapes."""
    return (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def _hint(size: Any) -> Optional[int]:
    if isinstance(size, torch.SymInt):
        return size.node.hint
    return int(size)


def _hinted_shape(value: Any) -> Optional[tuple]:
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(_hint(s) for s in value.shape), value.dtype


class ScopeImporter(Importer):
    """The layers of one module call (a block; the root: the model)."""

    def __init__(self, captured: Captured, scope: Scope, blocks: Blocks,
                 root: nn.Module, generated_path: str = "") -> None:
        self.root = root
        self.generated_path = generated_path  # this call's path in the generated model
        self.captured = captured
        self.scope = scope
        self.blocks = blocks
        self.gm, self.values = captured.gm, captured.values
        self.graph = self.gm.graph
        self.refs: dict[fx.Node, Any] = {}
        self.sizes: dict[fx.Node, str] = {}
        self.size_lists: dict[fx.Node, list[str]] = {}
        self.shapes: dict[fx.Node, str] = {}
        self.devices: set[fx.Node] = set()
        self.layers: list[Layer] = []
        self.by_module: dict[int, Layer] = {}
        self.outputs: list[str] = []
        self.symbols: dict[str, str] = {}
        self.relative: dict[int, str] = {}  # id(layer) -> its module's path in this scope
        #: ties whose owner is outside this scope: a parameter's path in it
        #: (``embed_tokens.weight``) -> the owner's path, for the parent's layer
        self.hoisted: dict[str, str] = {}
        self.inside = set(scope.nodes())
        module = scope.module
        self.names = Namespace(set())
        for name, _ in [*module.named_children(), *module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            if name.isidentifier():
                self.names.claim(name)
        self.input_nodes = self.external_inputs()
        if scope.parent is None:
            self.inputs = captured.inputs
            for node, name in captured.placeholders.items():
                self.refs[node] = name
                self.names.claim(name) if not self.names.taken(name) else None
                self.register(name, self.values.get(node))
        else:
            self.inputs = []
            named = _argument_names(scope, self.input_nodes, self.values)
            for node in self.input_nodes:
                # named after forward's arguments, alike in every copy of a block
                name = self.names.fresh(named.get(node) or _base(node.name))
                self.refs[node] = name
                self.register(name, self.values.get(node))
        self.input_names = [self.refs[n] for n in self.input_nodes] if scope.parent else [
            spec.name for spec in captured.inputs]

    # -- what crosses the block's boundary ------------------------------------------
    def external_inputs(self) -> list[fx.Node]:
        """The tensors read from outside; a parameter this module holds
        itself though another module's node reads it first (weights tied
        between modules) is its own Parameter layer instead (:attr:`own`)."""
        found: dict[fx.Node, None] = {}
        self.own: list[fx.Node] = []
        for node in self.scope.nodes():
            for arg in node.all_input_nodes:
                if arg not in self.inside and _is_tensor(self.values.get(arg)):
                    if arg.op == "get_attr" and holds(self.scope.module, self.values[arg]):
                        if arg not in self.own:
                            self.own.append(arg)
                    elif arg.op == "get_attr" and _subtree_holds(self.scope, self.values[arg]):
                        continue  # a module inside holds it too: its own there
                    else:
                        found.setdefault(arg)
        known = {str(d.node.expr) for n in found for d in getattr(self.values[n], "shape", ())
                 if isinstance(d, torch.SymInt)}
        for node in self.scope.nodes(leaves=False):  # sizes of tensors it does not read
            for arg in node.all_input_nodes:
                if arg not in self.inside and isinstance(self.values.get(arg), torch.SymInt):
                    for source in _size_sources(arg):
                        shape = self.values[source].shape
                        if any(isinstance(d, torch.SymInt) and str(d.node.expr) not in known
                               for d in shape):
                            found.setdefault(source)
                            known |= {str(d.node.expr) for d in shape
                                      if isinstance(d, torch.SymInt)}
        return list(found)

    def external_outputs(self) -> list[fx.Node]:
        """The values read outside; of a call whose result forward drops
        (:func:`.capture._eliminate_dead_code`), its last tensor."""
        found = [n for n in self.scope.nodes()
                 if any(u not in self.inside for u in n.users) and n.op != "get_attr"
                 and _is_tensor(self.values.get(n))]
        if found or self.scope.parent is None:
            return found
        last = [n for n in self.scope.nodes() if n.op != "get_attr" and n in self.refs
                and _is_tensor(self.values.get(n))]
        return last[-1:]

    def register(self, name: str, value: Any) -> None:
        """Symbols of ``value``'s shape, read from ``name`` where not yet known."""
        if not isinstance(value, torch.Tensor) or "." in name:  # block.0: no size(...) name
            return
        for dim, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if getattr(expr, "is_Symbol", False):
                    self.symbols.setdefault(str(expr), f"size({name}, {dim})")

    def layer_name(self, node: fx.Node) -> str:
        return self.names.fresh(_base(node.name))

    # -- nodes -----------------------------------------------------------------------
    def run(self) -> None:
        self.held: list[Layer] = []  # held layers whose block is known once the calls ran
        self.held_layers()
        for node in self.own:
            self.tensor_layer(node)
            self.blocks.notes.append(
                f"{self.scope.path}.{self.refs[node]} is a parameter of its own: the "
                f"original ties it to {self.captured.attributes.get(node.target)}")
        for item in self.scope.items:
            if isinstance(item, LeafCall):
                self.leaf_layer(item)
            elif isinstance(item, Scope):
                self.scope_layer(item)
            elif item.op == "get_attr":
                self.tensor_layer(item)
            elif (item.op == "call_function" and not item.users and self.values.get(item) is None
                  and getattr(item.target, "__name__", "") != "setitem"):
                continue  # torch's own bookkeeping (_log_api_usage_once)
            else:
                self.function_node(item)
        for layer in self.held:
            layer.op = self.blocks.made.get(_signature(layer.module), "")
        self.layers = [layer for layer in self.layers if layer.op]  # else not held (rare)
        self.fold_repeats()
        if self.scope.parent is None:
            output = next(n for n in self.graph.nodes if n.op == "output")
            self.model_outputs(output)
        else:
            self.outputs = [self.ref_name(self.refs[n]) for n in self.external_outputs()]

    def held_layers(self) -> None:
        """A layer with ``call: false`` for each torch.nn child of this scope's
        module that no call reaches and that holds state (T5's ``shared``,
        BART's ``model.shared``), so its keys are the generated model's too;
        its parameters are owned here, so the layers that read them tie to it
        (NOTE [Held layers] in compiler/frontend/resolve.py)."""
        root = self.scope
        while root.parent is not None:
            root = root.parent
        called: set[str] = set()
        stack = [root]
        while stack:
            for item in stack.pop().items:
                if isinstance(item, (LeafCall, Scope)):
                    called.add(item.path)
                if isinstance(item, Scope):
                    stack.append(item)
        nodes = self.scope.nodes()
        prefix = f"{self.scope.path}." if self.scope.path else ""
        for name, child in self.scope.module.named_children():
            path = prefix + name
            if (not name.isidentifier() or not nodes or any(
                    c == path or c.startswith(path + ".") for c in called)
                    or next(iter(child.children()), None) is not None
                    or not any(True for _ in child.parameters())):
                continue
            dotted = library_leaf(type(child))
            if dotted is None and not type(child).__module__.startswith("torch.nn"):
                # a library's module (BART's BartScaledWordEmbedding): the block a
                # called one of its class and parameters became, once it has run
                layer = Layer(name, "", nodes[0], child, call=False)
                self.held.append(layer)
            else:
                try:
                    args, kwargs = constructor(child, name)
                except MpgenError:
                    continue  # its keys stay the original's alone (docs/import.md)
                if dotted:
                    self.blocks.imports.add(dotted.partition(".")[0])
                layer = Layer(name, dotted or type(child).__name__, nodes[0], child,
                              args=args, kwargs=kwargs, call=False)
            for pname, param in child.named_parameters():
                self.blocks.written.setdefault(id(param), f"{path}.{pname}")
            mine = {id(p) for p in child.parameters()}
            if not any(id(p) in mine and not key.startswith(path + ".") for key, p in
                       self.root.named_parameters(remove_duplicate=False)):
                layer.kwargs["requires_grad"] = False  # no layer ties to it: nothing trains it
            self.relative[id(layer)] = name
            self.layers.append(layer)

    def add_layer(self, layer: Layer, node: fx.Node) -> None:
        super().add_layer(layer, node)
        if isinstance(self.refs.get(node), str):
            self.register(self.refs[node], self.values.get(node))

    def size_node(self, node: fx.Node, value: Any) -> bool:
        if isinstance(value, torch.Size) or (isinstance(value, tuple) and value and all(
                isinstance(v, (int, torch.SymInt)) for v in value)):
            texts = [sym_expression(v, self.symbols) for v in value]
            if None not in texts:
                self.size_lists[node] = texts  # x.shape[:-1] + (n,)
            return True
        if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
            return False
        text = sym_expression(value, self.symbols)
        if text is None:
            where = self.scope.path or type(self.root).__name__
            raise node_error(node, f"a size ({value}) that no tensor of {where}'s call "
                                   "has as a dim")
        self.sizes[node] = text
        return True

    def is_size_list(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg in self.size_lists

    def value(self, arg: Any, user: fx.Node, reads: list) -> Any:
        if isinstance(arg, fx.Node) and arg in self.size_lists:
            written = []
            for text in self.size_lists[arg]:
                reads.extend(re.findall(r"size\((\w+),", text))
                written.append(int(text) if re.fullmatch(r"-?\d+", text) else f"={text}")
            return written
        if isinstance(arg, fx.Node) and arg in self.sizes and self.sizes[arg].isdigit():
            return int(self.sizes[arg])
        if isinstance(arg, fx.Node) and arg not in self.sizes and isinstance(
                self.values.get(arg), (int, torch.SymInt)):
            self.size_node(arg, self.values[arg])  # a size computed in another module
        return super().value(arg, user, reads)

    def function_node(self, node: fx.Node) -> None:
        args = node.args
        if node.op == "call_method" and node.target in _NEW_TENSORS:
            source, *rest = args  # x.new_ones(size): torch.ones(size, dtype=x.dtype)
            kwargs = {"dtype": self.values[source].dtype, **node.kwargs}
            self.function_layer(node, f"torch.{_NEW_TENSORS[node.target]}", list(rest), kwargs)
            return
        if node.op == "call_function" and getattr(node.target, "__name__", "") in (
                "_assert_tensor_metadata", "_check", "_check_is_size", "sym_constrain_range"):
            return
        super().function_node(node)

    def indexing(self, node: fx.Node) -> None:
        """``x[:, a:b]``, ``x[None, :, 0]``, ``x[..., :n]``: narrow, select and
        unsqueeze layers, one per indexed dim."""
        source, index = node.args
        index = list(index) if isinstance(index, tuple) else [index]
        rank = self.values[source].dim()
        if len(index) == rank and all(self.is_tensor_ref(i) for i in index):
            self.gather_all(node, source, index)
            return
        if any(self.is_tensor_ref(i) for i in index):
            self.tensor_index(node, source, index)
            return
        if Ellipsis in index:
            at = index.index(Ellipsis)
            used = sum(1 for i in index if i is not None and i is not Ellipsis)
            index[at:at + 1] = [slice(None)] * (rank - used)
        current, dim, steps = source, 0, []
        for item in index:
            if item is None:
                steps.append(("torch.unsqueeze", [dim]))
                dim += 1
            elif isinstance(item, slice):
                if not isinstance(item.step, (int, type(None))) or (item.step or 1) < 1:
                    raise node_error(node, "indexing with a step that is not a positive "
                                           "number, which a spec cannot write")
                if item.start is None and item.stop is None and item.step in (None, 1):
                    dim += 1
                    continue
                steps.append(("slice", [dim, item.start, item.stop, item.step or 1]))
                dim += 1
            elif isinstance(item, int) or (isinstance(item, fx.Node) and item in self.sizes):
                steps.append(("torch.select", [dim, item]))
            else:
                raise node_error(node, "indexing with a tensor, which a spec cannot write")
        if not steps:
            self.refs[node] = self.refs[source]
            return
        for k, (op, args) in enumerate(steps):
            name = self.layer_name(node)
            layer = Layer(name, "torch.narrow" if op == "slice" else op, node)
            layer.inputs.append(self.tensor(current, node, layer.reads))
            if op == "slice":
                d, start, stop, step = args
                size = f"size({layer.inputs[0]}, {d})"
                begin = self.bound(start, size, node, layer) if start is not None else "0"
                end = self.bound(stop, size, node, layer) if stop is not None else size
                if stop is not None and not isinstance(stop, fx.Node) and stop >= 2 ** 62:
                    end = size
                length = f"{end} - ({begin})" if begin != "0" else end
                layer.reads.append(layer.inputs[0])
                layer.args = [d, _number(begin), _number(length)]
                if step != 1:  # x[..., 0::2, :]: every step-th from begin, before end
                    layer.op = "torch.slice_copy"
                    layer.args = [d, _number(begin), _number(end), step]
            else:
                layer.args = [self.value(a, node, layer.reads) for a in args]
            self.layers.append(layer)
            if k == len(steps) - 1:
                self.refs[node] = name
                self.register(name, self.values.get(node))
            else:
                self.refs[_Step(name)] = name
                current = _Step(name)

    def gather_all(self, node: fx.Node, source: fx.Node, index: list) -> None:
        """``x[i, j]`` with a tensor for every dim: ``torch.take`` of the flat
        index ``i * size(x, 1) + j`` (the index tensors broadcast)."""
        name = self.ref_name(self.refs[source])
        flat: Any = index[-1]
        for d in range(len(index) - 2, -1, -1):
            stride = " * ".join(f"size({name}, {k})" for k in range(d + 1, len(index)))
            scaled = self.step_layer(node, "torch.mul", [index[d]], [f"={stride}"], [name])
            flat = self.step_layer(node, "torch.add", [scaled, flat], [], [])
        taken = self.step_layer(node, "torch.take", [source, flat], [], [])
        self.refs[node] = self.refs[taken]
        self.register(self.refs[node], self.values.get(node))

    def step_layer(self, node: fx.Node, op: str, inputs: list, args: list,
                   reads: list) -> "_Step":
        """A layer of its own for one step of ``node``: its value a _Step."""
        layer = Layer(self.layer_name(node), op, node)
        for arg in inputs:
            layer.inputs.append(self.tensor(arg, node, layer.reads))
        layer.args = args
        layer.reads.extend(reads)
        self.layers.append(layer)
        step = _Step(layer.name)
        self.refs[step] = layer.name
        return step

    def bound(self, value: Any, size: str, node: fx.Node, layer: Layer) -> str:
        """A slice bound as an expression (negative ints count from the end)."""
        if isinstance(value, fx.Node):
            written = self.value(value, node, layer.reads)
            return str(written).removeprefix("=")
        if value < 0:
            return f"{size} - {-value}"
        return str(value)

    def tensor_layer(self, node: fx.Node) -> None:
        """A parameter or buffer of this module: a ``Parameter``/``Buffer`` layer."""
        value = self.values[node]
        module = self.scope.module
        attr = holds(module, value)
        if attr is None:
            full = self.captured.attributes.get(node.target) or node.target
            raise node_error(node, f"reads the tensor {full} outside the module that "
                                   "holds it, which a spec cannot write (a block's "
                                   "tensors are its own)")
        layer = Layer(attr, "Parameter" if isinstance(value, nn.Parameter) else "Buffer", node)
        layer.factory = True
        layer.kwargs["shape"] = list(value.shape)
        if value.dtype != torch.float32:
            layer.kwargs["dtype"] = str(value.dtype).removeprefix("torch.")
        if layer.op == "Parameter" and not value.requires_grad:
            layer.kwargs["requires_grad"] = False  # frozen: it does not train
        if layer.op == "Buffer" and attr in module._non_persistent_buffers_set:
            layer.kwargs["persistent"] = False  # not loaded: its values written
            layer.kwargs["init"] = {"values": value.flatten().tolist()}
        self.refs[node] = attr
        self.layers.append(layer)
        self.register(attr, value)
        path = f"{self.scope.path}.{attr}".lstrip(".")
        owner = self.blocks.written.setdefault(id(value), path)
        if owner != path and isinstance(value, nn.Parameter) and not self.holds(owner):
            self.hoisted[attr] = owner  # BART's embed_tokens.weight: tied on the instance

    # -- module calls ------------------------------------------------------------
    def rel(self, path: str) -> str:
        prefix = self.scope.path + "." if self.scope.path else ""
        return path[len(prefix):] if path.startswith(prefix) else path

    def leaf_layer(self, call: LeafCall) -> None:
        group = set(call.nodes)
        first = call.nodes[0]
        rel = self.rel(call.path)
        again = self.by_module.get(id(call.module))  # a module called again (relu)
        name = rel if self.nameable(rel) and again is None else self.names.fresh(
            rel.replace(".", "_"))
        dotted = library_leaf(type(call.module))
        op = dotted or type(call.module).__name__
        try:
            args, kwargs = constructor(call.module, name)
        except MpgenError as exc:
            raise MpgenError(node_position(first), exc.message) from None
        layer = Layer(name, op, first, call.module, args=args, kwargs=kwargs)
        self.by_module.setdefault(id(call.module), layer)
        if again is None:
            self.relative[id(layer)] = rel
        else:  # its parameters are the first call's
            layer.tie = {p: f"{again.name}.{p}" for p, _ in call.module.named_parameters()}
        if dotted:
            self.blocks.imports.add(dotted.partition(".")[0])
        outside = []
        for node in call.nodes:
            for arg in node.all_input_nodes:
                if arg not in group and arg not in outside and _is_tensor(self.values.get(arg)):
                    outside.append(arg)
        tensors = [a for a in outside if a.op != "get_attr"]
        self.tie_params(layer, call, [a for a in outside if a.op == "get_attr"])
        bound = _bind(call)
        eager = [v for v in bound.values() if isinstance(v, torch.Tensor)]
        distinct = list({id(t): t for t in eager}.values())
        matched = _match(distinct, tensors, self.values)
        if matched is None:
            raise node_error(first, f"cannot tell which tensors the call of {call.path} "
                                    f"({op}) reads")
        by_id = {id(t): node for t, node in zip(distinct, matched)}
        positional = True
        for key, arg in bound.items():
            if isinstance(arg, torch.Tensor):
                node = by_id[id(arg)]
                if positional and key in _positional(call):
                    layer.inputs.append(self.tensor(node, first, layer.reads))
                else:
                    layer.keyword_inputs[key] = self.tensor(node, first, layer.reads)
            else:
                positional = False
                written = yaml_value(arg)
                if written is MISSING:
                    raise node_error(first, f"calls {call.path} with {key}={arg!r}, which "
                                            "a spec cannot write")
                layer.call[key] = written
        self.layers.append(layer)
        self.leaf_outputs(layer, call, group)

    def tie_params(self, layer: Layer, call: LeafCall, read: list) -> None:
        """A parameter a layer before it holds (``lm_head.weight = wte.weight``)."""
        for pname, param in call.module.named_parameters():
            owner = self.blocks.written.get(id(param))
            if owner and owner != f"{call.path}.{pname}" and not self.holds(owner):
                self.hoisted[f"{layer.name}.{pname}"] = owner  # T5's decoder.embed_tokens
            elif owner and owner != f"{call.path}.{pname}":
                layer.tie[pname] = self.rel(owner)
            else:  # the first layer to hold it (T5's shared: a module forward never calls)
                self.blocks.written.setdefault(id(param), f"{call.path}.{pname}")

    def holds(self, path: str) -> bool:
        """Whether ``path`` is inside this scope (the root's holds every path)."""
        return not self.scope.path or path.startswith(self.scope.path + ".")

    def leaf_outputs(self, layer: Layer, call: LeafCall, group: set) -> None:
        read = [n for n in call.nodes if any(u not in group for u in n.users)
                and _is_tensor(self.values.get(n)) and n.op != "get_attr"]
        if isinstance(call.output, torch.Tensor):
            if len(read) > 1:
                raise node_error(read[1], f"reads a value inside {call.path}")
            if not read:  # a result forward drops: the call's last value, for a kept call
                read = [n for n in call.nodes if not n.users
                        and _is_tensor(self.values.get(n)) and n.op != "get_attr"][-1:]
            if read:
                self.refs[read[0]] = layer.name
                self.register(layer.name, self.values.get(read[0]))
            return
        if not isinstance(call.output, tuple):
            raise node_error(call.nodes[0], f"{call.path} returns "
                                            f"{type(call.output).__name__}")
        layer.elements = [Leaf() for _ in call.output]
        shapes = [_hinted_shape(v) for v in call.output]
        for node in read:
            shape = _hinted_shape(self.values.get(node))
            hits = [i for i, s in enumerate(shapes) if s == shape and s is not None]
            if len(hits) != 1:
                raise node_error(node, f"cannot tell which element of {call.path}'s "
                                       "result this is")
            self.refs[node] = layer.elements[hits[0]]
            if layer.elements[hits[0]].name is None:
                layer.elements[hits[0]].name = self.names.fresh(_base(node.name))

    def nameable(self, rel: str) -> bool:
        """Whether a layer can have the name ``rel`` (a module's path here): an
        identifier, or in a block a child's name in an nn.Sequential (``0``,
        ``block1-0``; NOTE [Layers named by position] in codegen/model.py)."""
        return rel.isidentifier() or self.item(rel) or (
            self.scope.parent is not None and "." not in rel
            and positional_name_problem(rel) is None)

    def item(self, rel: str) -> bool:
        """Whether ``rel`` (``block.0``) is an item of an nn.ModuleList or
        nn.Sequential this scope's module holds, called here on its own: a
        layer of that name (NOTE [Items of a ModuleList] in
        compiler/frontend/resolve.py)."""
        container, _, number = rel.partition(".")
        held = dict(self.scope.module.named_children()).get(container)
        return (container.isidentifier() and number.isdigit() and number == str(int(number))
                and isinstance(held, (nn.ModuleList, nn.Sequential)) and int(number) < len(held))

    def scope_layer(self, child: Scope) -> None:
        rel = self.rel(child.path)
        name = rel if self.nameable(rel) else self.names.fresh(rel.replace(".", "_"))
        inner = ScopeImporter(self.captured, child, self.blocks, self.root,
                              f"{self.generated_path}.{name}".lstrip("."))
        inner.run()
        first = child.nodes()[0]
        copies = inner.copies()
        if copies:  # an nn.Sequential of alike children: one repeated layer
            model = copies[0]
            layer = Layer(name, model.op, first, child.module, args=list(model.args),
                          kwargs=dict(model.kwargs), call=dict(model.call), repeat=len(copies))
            for copy in copies:  # placed as copies, each whole
                self.blocks.instances.pop(f"{inner.generated_path}.{copy.name}", None)
        else:
            lines = inner.block_lines()
            block = self.blocks.add(type(child.module), lines, child.path)
            self.blocks.made.setdefault(_signature(child.module), block)
            layer = Layer(name, block, first, child.module)
            for param, owner in inner.hoisted.items():  # tied on the instance
                if self.holds(owner):
                    layer.tie[param] = self.rel(owner)
                else:
                    self.hoisted[f"{name}.{param}"] = owner
        for node in inner.input_nodes:
            layer.inputs.append(self.tensor(node, first, layer.reads))
        outs = inner.external_outputs()
        if not any(u not in inner.inside for n in outs for u in n.users):
            layer.kwargs["requires_grad"] = False  # forward drops it: no gradient reaches it
        if len(outs) == 1:
            self.refs[outs[0]] = name
            self.register(name, self.values.get(outs[0]))
        else:
            layer.elements = [Leaf() for _ in outs]
            for node, leaf in zip(outs, layer.elements):
                self.refs[node] = leaf
                leaf.name = self.names.fresh(_base(node.name))
        self.relative[id(layer)] = rel
        self.layers.append(layer)
        # not a repeated layer, whose copies are placed whole (nor, yet, one with outputs)
        if layer.elements is None and layer.repeat == 1:
            self.blocks.instances[inner.generated_path] = sum(
                p.numel() for p in child.module.parameters())

    def block_lines(self) -> list[str]:
        lines = [f"  inputs: {scalar(self.input_names)}", "  layers:",
                 *(f"  {line}" for line in layer_lines(self.layers, self.input_names[0]))]
        last = self.layers[-1]
        if self.outputs != [last.name] or last.elements is not None:
            lines.append(f"  outputs: {scalar(self.outputs)}")
        return lines

    # -- ModuleList / Sequential children ----------------------------------------------
    def copies(self) -> list[Layer]:
        """This call's layers when it is an nn.Sequential's (``0`` ... ``N-1``)
        and they are its alike children, each reading only the one before:
        the copies of one repeated layer (``layer1: {op: Bottleneck, repeat:
        3}``, keys ``layer1.0.conv1.weight`` as in the original); else none."""
        module, layers = self.scope.module, self.layers
        if (not isinstance(module, nn.Sequential) or len(layers) < 2
                or len(layers) != len(module) or self.outputs != [layers[-1].name]):
            return []
        previous = self.input_names[0] if len(self.input_names) == 1 else None
        for i, layer in enumerate(layers):
            if (layer.name != str(i) or layer.key() != layers[0].key() or layer.tie
                    or layer.elements is not None or layer.keyword_inputs
                    or layer.inputs != [previous] or layer.module is None):
                return []
            previous = layer.name
        readers = [r for layer in layers for r in layer.reads]
        if any(readers.count(layer.name) != 1 for layer in layers[:-1]):
            return []
        return layers

    def fold_repeats(self) -> None:
        """``layers.0`` ... ``layers.N-1``, alike and chained: ``layers`` with
        ``repeat: N`` (NOTE [Module hierarchy])."""
        result: list[Layer] = []
        k = 0
        while k < len(self.layers):
            run = self.run_at(k)
            if run:
                container = self.relative[id(self.layers[k])].rpartition(".")[0]
                first, last = self.layers[k], self.layers[k + run - 1]
                folded = Layer(container, first.op, first.node, first.module,
                               inputs=list(first.inputs), keyword_inputs=first.keyword_inputs,
                               reads=list(first.reads), repeat=run)
                self.names.claim(container) if not self.names.taken(container) else None
                for node, ref in list(self.refs.items()):
                    if ref == last.name:
                        self.refs[node] = container
                for later in self.layers[k + run:]:
                    rename_reads(later, {last.name: container})
                for copy in self.layers[k:k + run]:  # placed as copies, each whole
                    self.blocks.instances.pop(f"{self.generated_path}.{copy.name}".lstrip("."),
                                              None)
                result.append(folded)
                k += run
                continue
            layer = self.layers[k]
            rel = self.relative.get(id(layer), layer.name)
            if rel != layer.name and layer.module is not None and any(
                    True for _ in layer.module.state_dict()):
                self.blocks.renamed[f"{self.generated_path}.{layer.name}".lstrip(".")] = \
                    f"{self.scope.path}.{rel}".lstrip(".")
            result.append(layer)
            k += 1
        self.layers = result
        self.number_items()

    def number_items(self) -> None:
        """Items of a ModuleList not called once each, 0 to N-1 in order (some
        folded, one called twice): renamed ``block_2``, their keys recorded
        as renamed, as a spec numbers a ModuleList's items in order from 0."""
        seen: dict[str, list[Layer]] = {}
        for layer in self.layers:
            container, _, number = layer.name.partition(".")
            if number:
                seen.setdefault(container, []).append(layer)
        taken = {layer.name for layer in self.layers}
        for container, items in seen.items():
            if container not in taken and [i.name for i in items] == [
                    f"{container}.{k}" for k in range(len(items))]:
                continue
            names = {i.name: self.names.fresh(i.name.replace(".", "_")) for i in items}
            for layer in self.layers:
                rename_reads(layer, names)
                if layer.name in names:
                    if layer.module is not None and any(True for _ in layer.module.state_dict()):
                        self.blocks.renamed[f"{self.generated_path}.{names[layer.name]}".lstrip(
                            ".")] = f"{self.scope.path}.{layer.name}".lstrip(".")
                    layer.name = names[layer.name]
            for node, ref in list(self.refs.items()):
                if isinstance(ref, str) and ref in names:
                    self.refs[node] = names[ref]

    def run_at(self, k: int) -> int:
        """How many layers from ``k`` fold into one repeated layer (0: none)."""
        first = self.layers[k]
        rel = self.relative.get(id(first))
        if rel is None or not rel.endswith(".0"):
            return 0
        container = rel[:-2]
        if not container.isidentifier():
            return 0
        module = self.scope.module.get_submodule(container)
        count = len(module)
        if count < 2 or k + count > len(self.layers):
            return 0  # one child is no repeat (its key keeps the ``.0``)
        run = self.layers[k:k + count]
        for i, layer in enumerate(run):
            if self.relative.get(id(layer)) != f"{container}.{i}" or layer.op != first.op:
                return 0
            if layer.elements is not None or layer.tie or len(layer.inputs) < 1:
                return 0
            if i and (layer.inputs[0] != run[i - 1].name
                      or layer.inputs[1:] != first.inputs[1:]
                      or layer.keyword_inputs != first.keyword_inputs):
                return 0
        readers = [r for l in self.layers for r in l.reads]
        if any(readers.count(l.name) != 1 for l in run[:-1]):
            return 0
        return count


class _Step:
    """A value between two layers of one indexing node."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Step) and other.name == self.name


def _number(text: str) -> Any:
    return int(text) if re.fullmatch(r"-?\d+", text) else f"={text}"


def _subtree_holds(scope: Scope, tensor: torch.Tensor) -> bool:
    for item in scope.items:
        if isinstance(item, LeafCall) and holds(item.module, tensor):
            return True
        if isinstance(item, Scope) and (holds(item.module, tensor)
                                        or _subtree_holds(item, tensor)):
            return True
    return False


def _size_sources(node: fx.Node) -> list[fx.Node]:
    """The tensors a size node reads the sizes of (through size arithmetic)."""
    found = []
    for arg in node.all_input_nodes:
        value = arg.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            found.append(arg)
        elif isinstance(value, (torch.SymInt, int)):
            found += _size_sources(arg)
    return found


def _argument_names(scope: Scope, nodes: list, values: dict) -> dict:
    """The name of the argument of ``forward`` each input node was passed as
    (``position_embeddings_0`` for an element of a tuple argument)."""
    tensors = []
    for key, value in _bind(scope).items():
        if isinstance(value, torch.Tensor):
            tensors.append((key, value))
        elif isinstance(value, (tuple, list)):
            tensors += [(f"{key}_{i}", v) for i, v in enumerate(value)
                        if isinstance(v, torch.Tensor)]
    left = list(nodes)
    names = {}
    for key, tensor in tensors:
        want = (tuple(tensor.shape), tensor.dtype)
        hits = [n for n in left if _hinted_shape(values.get(n)) == want]
        if hits and key.isidentifier() and not hasattr(nn.Module, key):
            names[hits[0]] = key
            left.remove(hits[0])
    return names


def _base(name: str) -> str:
    base = re.sub(r"_\d+$", "", name.removeprefix("l_").removeprefix("l__self___"))
    return base if base.isidentifier() and not hasattr(nn.Module, base) else "value"


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _bind(call: Any) -> dict:
    """The call's arguments by parameter name, in the signature's order."""
    signature = inspect.signature(call.module.forward)
    try:
        bound = signature.bind(*call.args, **call.kwargs)
    except TypeError:
        return {f"arg{i}": a for i, a in enumerate(call.args)} | dict(call.kwargs)
    result = {}
    for key, value in bound.arguments.items():
        kind = signature.parameters[key].kind
        if kind == kind.VAR_POSITIONAL:
            result.update({f"{key}{i}": v for i, v in enumerate(value)})
        elif kind == kind.VAR_KEYWORD:
            result.update(value)
        else:
            default = signature.parameters[key].default
            if not isinstance(value, torch.Tensor) and type(default) is type(value) \
                    and default == value:
                continue
            result[key] = value
    return result


def _positional(call: LeafCall) -> set:
    params = inspect.signature(call.module.forward).parameters
    names = list(params)[:len(call.args)]
    return set(names) | {f"arg{i}" for i in range(len(call.args))} | {
        n for n in params if params[n].kind == inspect.Parameter.VAR_POSITIONAL}


def _match(eager: list, nodes: list, values: dict) -> Optional[list]:
    """The graph node of each eager tensor argument (by shape and dtype, in
    order of use where several fit)."""
    if len(eager) != len(nodes):
        return None
    left = list(nodes)
    result = []
    for tensor in eager:
        want = (tuple(tensor.shape), tensor.dtype)
        hits = [n for n in left if _hinted_shape(values.get(n)) == want]
        if not hits:
            return None
        result.append(hits[0])
        left.remove(hits[0])
    return result


def import_hierarchy(captured: Captured, root: nn.Module, model: str
                     ) -> tuple[ScopeImporter, Blocks]:
    """The model's layers (the root call's) and the blocks they use."""
    blocks = Blocks(model)
    top = ScopeImporter(captured, captured.root, blocks, root)
    top.run()
    merge_alike(blocks, top.layers)
    if blocks.renamed:
        shown = ", ".join(f"{o} is {g}" for g, o in list(blocks.renamed.items())[:3])
        blocks.notes.append(f"{len(blocks.renamed)} modules of an nn.Sequential or "
                            f"nn.ModuleList that a repeat cannot hold have other names "
                            f"({shown}, ...): their state-dict keys differ from the "
                            "original's")
    return top, blocks


# NOTE: [Alike blocks]
# Two calls of one class often differ only in numbers: ConvNeXt's blocks in
# their widths and stochastic-depth rates, EfficientNet's in kernel sizes.
# Their blocks' lines are then the same but for the numbers at some places,
# so they become one block with ``params:``, each instance giving its
# values as ``args:``. Places whose numbers agree in every instance keep
# them; places whose numbers go together (a width written five times) share
# one parameter. Blocks are merged from the innermost out, since a parent's
# lines name its children's blocks: merging children can make parents alike.

_NUMBER = re.compile(r"(?<![\w.$\"])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
#: At most this many parameters for a merged block: more is not one design.
MAX_PARAMS = 6


#: A layer's name at the start of its line (``0:``, ``block1-0:``): no number of its own.
_KEY = re.compile(r"\s*[\w-]+:(?=\s)")


def _parts(line: str) -> list[str]:
    """The line in parts, numbers only in the even ones: what its layer's name
    and its quoted strings (expressions) leave."""
    key = _KEY.match(line)
    head = key.end() if key else 0
    return ["", line[:head], *re.split(r'("(?:[^"\\]|\\.)*")', line[head:])]


def _numbers(line: str) -> list[tuple[int, int, str]]:
    """The numbers of a line outside its layer's name and its quoted strings
    (expressions): their start, end and text."""
    found, offset = [], 0
    for i, part in enumerate(_parts(line)):
        if i % 2 == 0:
            found += [(offset + m.start(), offset + m.end(), m.group())
                      for m in _NUMBER.finditer(part)]
        offset += len(part)
    return found


def _skeleton(lines: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The lines with each number outside names and quotes a ``#``, and the numbers."""
    skeleton, numbers = [], []
    for line in lines:
        parts = _parts(line)
        for i in range(0, len(parts), 2):
            numbers += _NUMBER.findall(parts[i])
            parts[i] = _NUMBER.sub("#", parts[i])
        skeleton.append("".join(parts))
    return tuple(skeleton), numbers


def merge_alike(blocks: Blocks, layers: list[Layer]) -> None:
    """Blocks alike but for numbers: one block with params (NOTE [Alike
    blocks]); ``layers`` (the model's) and the blocks' lines call it."""
    while True:
        families: dict[tuple, list[str]] = {}
        for name, lines in blocks.lines.items():
            if lines[0].startswith("  params:"):
                continue  # merged already
            skeleton, _ = _skeleton(lines)
            families.setdefault((re.sub(r"\d+$", "", name), skeleton), []).append(name)
        merged = {}
        for (_, skeleton), names in families.items():
            if len(names) > 1:
                merged.update(_merge(blocks, names))
        if not merged:
            return
        for name in blocks.lines:
            blocks.lines[name] = [_call(line, merged) for line in blocks.lines[name]]
        for layer in layers:
            if layer.op in merged:
                layer.op, layer.args = merged[layer.op][0], list(merged[layer.op][1])


def _merge(blocks: Blocks, names: list[str]) -> dict[str, tuple[str, list]]:
    """``names`` as one block (the first's name): each old name -> the block
    and the values its calls give."""
    values = [_skeleton(blocks.lines[n])[1] for n in names]
    differ = [i for i in range(len(values[0])) if len({v[i] for v in values}) > 1]
    groups: dict[tuple, list[int]] = {}
    for i in differ:
        groups.setdefault(tuple(v[i] for v in values), []).append(i)
    if not groups or len(groups) > MAX_PARAMS:
        return {}
    first = blocks.lines[names[0]]
    param_at: dict[int, str] = {}
    taken: set[str] = {"index", "repeat"}
    for places in groups.values():
        name = _param_name(first, places[0], taken, blocks)
        taken.add(name)
        param_at.update({i: name for i in places})
    lines, k = [], 0
    for line in first:
        pieces, last = [], 0
        for start, end, text in _numbers(line):
            pieces.append(line[last:start])
            pieces.append(f"${param_at[k]}" if k in param_at else text)
            last, k = end, k + 1
        lines.append("".join(pieces) + line[last:])
    params = list(dict.fromkeys(param_at[places[0]] for places in groups.values()))
    target = names[0]
    blocks.lines[target] = [f"  params: {scalar(params)}", *lines]
    for name in names[1:]:
        del blocks.lines[name]
    result = {}
    for name, own in zip(names, values):
        args = [_literal(own[places[0]]) for places in groups.values()]
        result[name] = (target, args)
    return result


def _literal(text: str) -> Any:
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


def _param_name(lines: list[str], place: int, taken: set[str], blocks: Blocks) -> str:
    """A parameter's name after where its first number is: the keyword it is
    the value of (``p``, ``eps``), or the argument of the op it is
    (``in_channels`` of a ``Conv2d``'s ``args``), else the layer's name."""
    k = 0
    base = f"value{place}"
    for line in lines:
        numbers = _numbers(line)
        if place < k + len(numbers):
            before = line[:numbers[place - k][0]]
            keys = re.findall(r"(\w+): ", before)
            key = keys[-1] if keys else "value"
            base = key if key not in ("args", "shape", "size", "dims", "op", "in") else (
                _argument(line, before, blocks) or f"{keys[0]}_{key}")
            break
        k += len(numbers)
    name, i = base, 2
    while name in taken:
        name, i = f"{base}{i}", i + 1
    return name


def _argument(line: str, before: str, blocks: Blocks) -> Optional[str]:
    """The name of the positional argument ``before`` ends in, in ``args:``
    of a torch.nn op or a block with params."""
    op = re.search(r"\{op: ([\w.]+)", line)
    listed = before.rpartition("args: [")
    if not op or not listed[1] or "]" in listed[2]:
        return None
    index = listed[2].count(",")
    if op.group(1) in blocks.lines:
        head = blocks.lines[op.group(1)][0]
        names = re.findall(r"\w+", head.partition("params:")[2]) if "params:" in head else []
    else:
        cls = getattr(nn, op.group(1), None) or pydoc.locate(op.group(1))
        try:
            names = list(inspect.signature(cls).parameters) if cls else []
        except (TypeError, ValueError):
            names = []
    return names[index] if index < len(names) else None


def _call(line: str, merged: dict) -> str:
    """A layer's line calling a merged block: its new name and ``args:``."""
    match = re.search(r"\{op: (\w+)(?=[,}])", line)
    if not match or match.group(1) not in merged:
        return line
    target, args = merged[match.group(1)]
    return (line[:match.start()] + f"{{op: {target}, args: {scalar(args)}"
            + line[match.end():])
