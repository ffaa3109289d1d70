"""Spec (pydantic models) -> IR :class:`~mpgen.compiler.ir.Graph`.

Resolves every name: ops against torch, blocks and user modules; ``in:``
references to edges; ``$param`` values to :class:`~mpgen.compiler.ir.Param`;
keyword arguments against the callee's real signature. All identifiers of
the generated code are handed out here by :class:`Namespace`. Errors are
collected and reported together, each at its YAML node.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional

from torch import nn
from torch.utils.checkpoint import checkpoint

from mpgen.compiler.frontend import expressions, imports, ops
from mpgen.compiler.ir import (
    Args,
    BinOp,
    BlockClass,
    Element,
    Expr,
    Feed,
    Graph,
    Initializer,
    InitRule,
    InputTensor,
    Node,
    Op,
    OpKind,
    Neg,
    OwnTensor,
    Param,
    Split,
    SymDim,
    TensorType,
    INDEX,
    REPEAT,
    IfTraining,
    Tie,
    Training,
    params_used,
    sizes_used,
    substitute,
)
from mpgen.compiler.frontend.namespace import (
    GLOBALS,
    Namespace,
    identifier_problem,
    model_name_problem,
    positional_name_problem,
)
from mpgen.errors import Collector, Position, did_you_mean, shown
from mpgen.spec_schema.digest import display_path, spec_digest
from mpgen.spec_schema.load import LoadedSpec, SourceMap
from mpgen.spec_schema.models import DTYPES, LayerSpec, Spec

#: The keywords torch.utils.checkpoint.checkpoint keeps for itself (it pops
#: preserve_rng_state from its **kwargs).
CHECKPOINT_OWN = (*(p.name for p in inspect.signature(checkpoint).parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)),
                  "preserve_rng_state")

#: Attributes every nn.Module has; a layer attribute must not shadow them.
_MODULE_ATTRS = frozenset(dir(nn.Module)) | {"training"}

# NOTE: [Items of a ModuleList]
# A layer named ``NAME.N`` is item N of an nn.ModuleList ``NAME`` that the
# model or block holds, so that the keys are a library's whose ModuleList
# holds unlike modules, each called on its own from the parent's forward
# (T5's ``block.0``, which alone holds the relative attention bias, and
# ``block.1``: keys ``block.0.layer.0...``). The items of one NAME are numbered
# from 0 in spec order without gaps, each a module layer that is not
# repeated; no layer is named NAME itself. Codegen makes ``self.block =
# nn.ModuleList()`` before the first item, adds each (``self.block.append``)
# and calls ``self.block[1](...)``; placement keys name an item (``block.1``)
# or a range of them (``block.0-1``) as the copies of a repeated layer.
# NOTE: [Held layers]
# ``call: false`` on a module layer: the model (or block) holds the module,
# so its parameters are in the state dict and layers may tie to them or it to
# theirs, but forward never calls it (T5's ``shared``, whose weight its
# stacks' ``embed_tokens`` tie to; BART's ``model.shared``). It reads and
# gives no value (Node.held: no value_names), so a layer after it without
# ``in:`` reads the one before it; it is placed as any layer (a unit of its
# parameters, no flops), and generated as its attribute alone.
_ITEM = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.([0-9]+)")


def resolve(spec: Spec, loaded: LoadedSpec, root: Optional[str | Path] = None) -> Graph:
    """Build the graph; raises MpgenError (or ErrorList) for every mistake.
    ``root``: the project dotted ops may import from (default: the spec's
    repository, see :class:`~mpgen.compiler.frontend.imports.Project`)."""
    return _Resolver(spec, loaded, root).graph()


class _Resolver:
    def __init__(self, spec: Spec, loaded: LoadedSpec,
                 root: Optional[str | Path] = None) -> None:
        self.spec = spec
        self.loaded = loaded
        self.src: SourceMap = loaded.source
        self.errors = Collector()
        self.project = imports.Project.of(loaded.path, root, spec.imports or ())
        # Top-level packages of user ops are imported by the generated module,
        # so no generated name may shadow them.
        self.globals = Namespace(GLOBALS | _user_roots(spec))

    # -- positions and names ---------------------------------------------
    @staticmethod
    def label(lpath) -> str:
        """``layer 'fc1'``, or ``layer 'fc1' of block 'MLPBlock'``, for messages."""
        if lpath[0] == "blocks":
            return f"layer {lpath[-1]!r} of block {lpath[1]!r}"
        return f"layer {lpath[-1]!r}"

    def key(self, *path: Any) -> Position:
        return self.src.key(tuple(path))

    def value(self, *path: Any) -> Position:
        return self.src.value(tuple(path))

    # -- the whole graph -------------------------------------------------
    def graph(self) -> Graph:
        spec = self.spec
        problem = identifier_problem(spec.name) or model_name_problem(spec.name,
                                                                      _user_roots(spec))
        if problem is None and spec.name == "self":  # each method's first parameter
            problem = "'self' clashes with a name the generated code uses"
        if problem is None and self.globals.taken(spec.name):
            problem = f"{spec.name!r} clashes with a name the generated code imports"
        if problem:
            self.errors.add(self.value("name"), f"name: {problem}")
        else:
            self.globals.claim(spec.name)
        for block_name in spec.blocks:
            problem = identifier_problem(block_name) or (
                "'self' clashes with a name the generated code uses" if block_name == "self"
                else None)
            if problem or self.globals.taken(block_name):
                self.errors.add(
                    self.key("blocks", block_name),
                    f"block {block_name!r}: " + (problem or "clashes with another class or import"),
                )
            else:
                self.globals.claim(block_name)
        blocks: list[BlockClass] = []
        for block_name in spec.blocks:
            blocks.append(self.block(block_name, [b.name for b in blocks]))
        inputs = self.model_inputs()
        ns = self.forward_namespace(inputs)
        nodes = self.layers(
            ("layers",), spec.layers, inputs, [b.name for b in blocks], params=None, ns=ns,
        )
        outputs = self.outputs(("outputs",), spec.outputs, nodes)
        splits: list[Split] = []
        splitter = _Splitter(self, {b.name: b for b in blocks}, outputs, ns)
        if not self.errors.errors:
            nodes = splitter.split(nodes, splits)
        init_rules = self.model_inits()
        self.errors.raise_if_any()
        return Graph(
            name=spec.name,
            spec_path=display_path(self.loaded.path),
            spec_hash=spec_digest(spec),
            inputs=tuple(inputs),
            nodes=tuple(nodes),
            outputs=tuple(outputs),
            blocks=tuple(blocks),
            pos=self.value("name"),
            init_rules=tuple(init_rules),
            splits=tuple(splits),
            aliases=splitter.aliases,
        )

    def model_inits(self) -> list[InitRule]:
        """The top-level ``init:``: torch.nn class -> parameter -> initializer."""
        rules: list[InitRule] = []
        names = ops.nn_module_names()
        for cls, mapping in (self.spec.init or {}).items():
            if cls not in names:
                self.errors.add(self.key("init", cls), f"init: unknown torch.nn module "
                                f"{cls!r}{did_you_mean(cls, names)}")
                continue
            found = self.initializers(("init", cls), mapping, f"init: {cls}")
            rules += [dataclasses.replace(r, module=cls) for r in found or []]
        return rules

    def forward_namespace(self, inputs: list[InputTensor]) -> Namespace:
        ns = self.globals.child()
        ns.claim("self")
        for tensor in inputs:
            if not ns.taken(tensor.var):
                ns.claim(tensor.var)
        return ns

    def model_inputs(self) -> list[InputTensor]:
        result = []
        for name, spec in self.spec.inputs.items():
            problem = identifier_problem(name)
            if problem is None and (name == "self" or self.globals.taken(name)):
                problem = f"{name!r} clashes with a name the generated code uses"
            if problem:
                self.errors.add(self.key("inputs", name), f"input {name!r}: {problem}")
                continue
            shape = tuple(SymDim.named(d) if isinstance(d, str) else d for d in spec.shape)
            result.append(InputTensor(name, name, TensorType(shape, spec.dtype),
                                      self.key("inputs", name)))
        return result

    # -- blocks ----------------------------------------------------------
    def block(self, name: str, earlier_blocks: list[str]) -> BlockClass:
        spec = self.spec.blocks[name]
        ns = self.globals.child()
        ns.claim("self")
        params: list[str] = []
        for i, param in enumerate(spec.params):
            problem = identifier_problem(param)
            if problem is None and param in (INDEX, REPEAT):
                problem = (f"${param} is the {'index of a copy' if param == INDEX else 'number of copies'} "
                           "of a repeated layer; name the param otherwise")
            if problem or ns.taken(param):
                self.errors.add(self.value("blocks", name, "params", i),
                                f"block {name!r} param: " + (problem or f"{param!r} is already used"))
                continue
            params.append(ns.claim(param))
        inputs: list[InputTensor] = []
        for i, inp in enumerate(spec.inputs):
            problem = identifier_problem(inp)
            if problem or ns.taken(inp):
                self.errors.add(self.value("blocks", name, "inputs", i),
                                f"block {name!r} input: " + (problem or f"{inp!r} is already used"))
                continue
            inputs.append(InputTensor(inp, ns.claim(inp), TensorType(()),
                                      self.value("blocks", name, "inputs", i)))
        path = ("blocks", name, "layers")
        nodes = self.layers(path, spec.layers, inputs, earlier_blocks, params=params, ns=ns)
        outputs = self.outputs(("blocks", name, "outputs"), spec.outputs, nodes)
        return BlockClass(name, tuple(params), tuple(inputs), tuple(nodes), tuple(outputs),
                          self.key("blocks", name))

    # -- layers ----------------------------------------------------------
    def layers(self, path, layers: dict[str, LayerSpec], inputs: list[InputTensor],
               blocks: list[str], params: Optional[list[str]], ns: Namespace) -> list[Node]:
        input_names = [t.name for t in inputs]
        all_names = list(layers)
        nodes: list[Node] = []
        failed: set[str] = set()  # reading these is not a second error
        # What a layer may read: the inputs and earlier layers' values, kept as
        # the layers resolve (in order; a dict for constant-time lookups).
        known: dict[str, None] = dict.fromkeys(input_names)
        tuples: dict[str, Node] = {}  # earlier layers returning named tuples
        items: dict[str, int] = {}  # a ModuleList -> its items so far
        # NOTE [Held layers]: no value; a layer after one reads the one before it
        self.held = {n for n, l in layers.items() if l.call is False}
        for index, (name, layer) in enumerate(layers.items()):
            where = self.key(*path, name)
            problem = identifier_problem(name)
            item = _ITEM.fullmatch(name) if isinstance(name, str) else None
            if item is not None:  # NOTE: [Items of a ModuleList]
                problem = self.item_problem(name, item, layer, all_names, items)
            elif problem is not None and not name.isidentifier():
                # NOTE: [Layers named by position]
                if params is not None:
                    problem = positional_name_problem(name)
                elif positional_name_problem(name) is None:
                    problem += (" (a layer named like an nn.Sequential's child, 0 or "
                                "block1-0, belongs in a block)")
            if problem is None and name in _MODULE_ATTRS:
                problem = f"{name!r} would shadow nn.Module.{name}"
            if problem is None and name in input_names:
                problem = f"{name!r} is also the name of an input"
            if problem is None and params is not None and name in params:
                problem = f"{name!r} is also the name of a block parameter"
            if problem:
                self.errors.add(where, f"{self.label((*path, name))}: {problem}")
                failed.add(name)
                continue
            node = self.layer(path, name, layer, index, nodes, input_names, all_names,
                              blocks, params, ns, failed, known, tuples)
            if node is None:
                failed.add(name)
            else:
                nodes.append(node)
                known.update(dict.fromkeys(node.value_names))
                if node.pattern:
                    tuples[node.name] = node
        if any(not n.name.isidentifier() and "." not in n.name for n in nodes):
            modules = (n for n in nodes if n.op.has_module and n.op.runs)
            at = {n.name: i for i, n in enumerate(modules)}
            nodes = [n if n.name.isidentifier() else dataclasses.replace(n, position=at[n.name])
                     for n in nodes]
        return nodes

    def item_problem(self, name: str, item: re.Match, layer: LayerSpec,
                     all_names: list[str], items: dict[str, int]) -> Optional[str]:
        """Why ``name`` (``block.0``) cannot be the next item of the
        nn.ModuleList it names, or None (NOTE [Items of a ModuleList])."""
        container, number = item.group(1), int(item.group(2))
        problem = identifier_problem(container)
        if problem is not None:
            return problem
        if container in _MODULE_ATTRS:
            return f"{container!r} would shadow nn.Module.{container}"
        if container in all_names:
            return (f"{name!r} is an item of the nn.ModuleList {container!r}, and a layer "
                    f"is named {container!r} too; name one otherwise")
        if item.group(2) != str(number):
            return f"{name!r}: an item is numbered without leading zeros ({container}.{number})"
        expected = items.get(container, 0)
        if number != expected:
            return (f"{name!r}: the items of the nn.ModuleList {container!r} are numbered "
                    f"from 0 in order, without gaps: expected {container}.{expected} here")
        if layer.repeat is not None:
            return (f"{name!r}: an item of an nn.ModuleList is one module, not repeated "
                    f"(a layer {container} with repeat: N holds N alike copies)")
        items[container] = expected + 1
        return None

    def layer(self, path, name, layer: LayerSpec, index, earlier: list[Node],
              input_names, all_names, blocks, params, ns: Namespace,
              failed: set[str], known: dict[str, None],
              tuples: dict[str, Node]) -> Optional[Node]:
        lpath = (*path, name)
        try:
            op = ops.resolve_op(layer.op, blocks, self.project,
                                factory=layer.in_ is not None and not layer.in_)
        except ops.OpError as exc:
            hint = did_you_mean(layer.op, ops.candidates(blocks)) if "unknown op" in str(exc) else ""
            if layer.op in self.spec.blocks and layer.op not in blocks:
                hint = " (a block can only use blocks defined before it)" if params is not None \
                    else ""
            self.errors.add(self.value(*lpath, "op"), f"{self.label(lpath)}: {exc}{hint}")
            return None
        if not name.isidentifier() and not (op.has_module and op.runs):
            what = op.spelled if op.kind is OpKind.TENSOR else "function"
            kind = ("a name like block.0 is a module's: an item of an nn.ModuleList"
                    if _ITEM.fullmatch(name) else
                    "names like 0 or block1-0 are for modules: an nn.Sequential's children")
            self.errors.add(self.key(*lpath), f"{self.label(lpath)}: a {what} layer is named "
                            f"by an identifier, not {name!r} ({kind})")
            return None
        held = layer.call is False
        if held:  # NOTE: [Held layers]
            refused = ("a Parameter or Buffer layer is never called" if op.kind is OpKind.TENSOR
                       else "a function layer computes only when called"
                       if op.kind is OpKind.FUNCTION else
                       "'in:' is what forward calls it with" if layer.in_ is not None else
                       "a repeated layer is called copy after copy" if layer.repeat is not None
                       else "it returns nothing to name"
                       if layer.outputs is not None or layer.output is not None else None)
            if refused is not None:
                self.errors.add(self.value(*lpath, "call"), f"{self.label(lpath)}: call: false "
                                f"holds a module that forward never calls; {refused}")
                return None
        if op.kind is OpKind.TENSOR:
            return self.tensor_layer(lpath, name, layer, op, params, ns)
        # Inputs: default is the previous layer (not a held one), or the first input.
        factory = layer.in_ is not None and not layer.in_
        while index and all_names[index - 1] in self.held:
            index -= 1
        if held:
            refs: list = []
            ref_pos: list = []
            feed = None
        elif layer.in_ is None:
            previous = earlier[-1] if index and earlier and earlier[-1].name == all_names[
                index - 1] else None
            if previous is not None and previous.pattern:
                self.errors.add(self.key(*lpath), f"{self.label(lpath)}: the layer before it, "
                                f"{previous.name!r}, returns a tuple named by its outputs "
                                f"({', '.join(previous.value_names)}); say which to read with "
                                "'in:'")
                return None
            refs = [all_names[index - 1]] if index else input_names[:1]
            ref_pos = [self.key(*lpath)] * len(refs)
            feed = None
        else:
            refs, ref_pos, feed = self.feed((*lpath, "in"), layer.in_)
        ok = True
        for ref, pos in zip(refs, ref_pos):
            if ref in known:
                continue
            ok = False
            if ref in failed:
                continue  # its own error is reported
            if ref in tuples:
                msg = (f"{self.label(lpath)} reads {ref!r}, which returns a tuple named by "
                       f"its outputs; read its elements ({', '.join(tuples[ref].value_names)})")
            elif ref == name:
                msg = f"{self.label(lpath)} cannot read its own output"
            elif ref in self.held:
                msg = (f"{self.label(lpath)} reads {ref!r}, which forward never calls "
                       "(call: false), so it has no value")
            elif ref in all_names:
                msg = (f"{self.label(lpath)} reads {ref!r}, which is defined later; "
                       "layers may only read inputs and earlier layers")
            else:
                hint = did_you_mean(ref, known) or (
                    f" (it can read {', '.join(known)})" if len(known) <= 8 else "")
                msg = f"{self.label(lpath)} reads unknown {ref!r}{hint}"
            self.errors.add(pos, msg)
        if factory and op.kind is not OpKind.FUNCTION:
            self.errors.add(self.value(*lpath, "in"), f"{self.label(lpath)}: 'in: []' marks a "
                            f"factory such as torch.arange or torch.zeros; {op.spelled} is a "
                            "module and reads a tensor")
            ok = False
        if layer.repeat is not None and op.kind is OpKind.FUNCTION:
            self.errors.add(self.value(*lpath, "repeat"),
                            f"{self.label(lpath)}: repeat needs a module or block op, not a function")
            ok = False
        label = self.label(lpath)
        # size() reads a tensor in forward: only arguments of a call made there.
        in_forward = op.kind is OpKind.FUNCTION
        scope = Scope(params, known if in_forward else None, layer.repeat is not None)
        args = tuple(self.literal(v, (*lpath, "args", i), scope, label)
                     for i, v in enumerate(layer.args))
        kwargs = tuple((k, self.literal(v, (*lpath, k), scope, label, key=k))
                       for k, v in layer.kwargs.items())
        if layer.requires_grad is not None and in_forward:  # a function's own keyword
            kwargs += (("requires_grad", layer.requires_grad),)
        call_kwargs = tuple((k, self.literal(v, (*lpath, "call", k), Scope(params, known), label,
                                             key=k))
                            for k, v in (layer.call or {}).items())
        if in_forward:
            for key, _ in call_kwargs:
                if key in dict(kwargs):
                    self.errors.add(self.key(*lpath, "call", key), f"{label}: {key!r} is given "
                                    f"both as a keyword and in call:")
                    ok = False
        n_inputs = None if held else len(refs) if feed is None else len(feed.positional)
        if op.spelled in ops.CASTS:
            ok = self.check_cast(lpath, layer, op, refs, feed) and ok
        else:
            ok = self.check_call(op, lpath, name, args, kwargs, n_inputs) and ok
        pattern, elements = self.elements(lpath, layer, ns, input_names, all_names, earlier)
        if layer.outputs is not None and pattern is None:
            ok = False
        ties = self.ties(lpath, layer, op, params, earlier)
        inits = self.layer_inits(lpath, layer, op)
        if ties is None or inits is None or not self.checkpoint_ok(lpath, layer, op, params):
            ok = False
        if not ok:
            return None
        if layer.repeat is not None:  # $repeat is N: written as the number
            args = tuple(substitute(a, {REPEAT: layer.repeat}) for a in args)
            kwargs = tuple((k, substitute(v, {REPEAT: layer.repeat})) for k, v in kwargs)
        # a layer named by position holds its output in a variable named for its op
        var = ns.fresh(name if name.isidentifier() or _ITEM.fullmatch(name) else re.sub(
            r"(?<=[a-z0-9])(?=[A-Z][a-z])", "_", op.spelled.rpartition(".")[2]).lower())
        if op.kind is OpKind.FUNCTION:
            init, call = Args(), Args(args, _train_mode(op, n_inputs, args,
                                                         kwargs + call_kwargs))
        else:
            init, call = Args(args, kwargs), Args((), call_kwargs)
        return Node(name=name, var=var, op=op, init=init, call=call, inputs=tuple(refs),
                    pos=self.key(*lpath), repeat=layer.repeat, output=layer.output, feed=feed,
                    pattern=pattern, elements=elements, factory=factory, ties=ties or (),
                    inits=inits or (), checkpoint=bool(layer.checkpoint),
                    frozen=layer.requires_grad is False and not in_forward, held=held)

    def tensor_layer(self, lpath, name: str, layer: LayerSpec, op: Op, params,
                     ns: Namespace) -> Optional[Node]:
        """``{op: Parameter, shape: [...], dtype, init}`` (or a Buffer, with
        ``persistent``): a tensor of the layer's own, read by later layers."""
        label = self.label(lpath)
        buffer = op.spelled == "Buffer"
        ok = True
        for key, given in (("in", layer.in_ is not None), ("args", bool(layer.args)),
                           ("repeat", layer.repeat is not None),
                           ("output", layer.output is not None),
                           ("outputs", layer.outputs is not None), ("call", layer.call),
                           ("tie", layer.tie), ("checkpoint", layer.checkpoint),
                           ("requires_grad", buffer and layer.requires_grad is not None)):
            if key == "requires_grad" and given:
                self.errors.add(self.key(*lpath, key), f"{label}: a Buffer takes no "
                                "requires_grad: (it never trains; a Parameter with "
                                "requires_grad: false is one that does not train)")
                ok = False
            elif given:
                self.errors.add(self.key(*lpath, key), f"{label}: a {op.spelled} takes no "
                                f"{key}: (it reads no tensor; a block with it can be repeated)"
                                if key == "repeat" else
                                f"{label}: a {op.spelled} takes no {key}: (it reads no tensor)")
                ok = False
        allowed = ["shape", "dtype", *(["persistent"] if buffer else [])]
        takes = [*allowed, "init", *([] if buffer else ["requires_grad"])]
        extra = dict(layer.model_extra or {})
        for key in extra:
            if key not in allowed:
                self.errors.add(self.key(*lpath, key), f"{label}: unknown key {key!r} for a "
                                f"{op.spelled}{did_you_mean(key, takes)} (it takes "
                                f"{', '.join(takes[:-1])} and {takes[-1]})")
                ok = False
        shape = extra.get("shape")
        if not isinstance(shape, list):
            where = self.value(*lpath, "shape") if "shape" in extra else self.key(*lpath)
            self.errors.add(where, f"{label}: a {op.spelled} needs shape: a list of sizes, "
                            "like [1, 1, 768] or [$dim] ([] for a scalar)")
            return None
        dims = []
        scope = Scope(params, None)
        for i, dim in enumerate(shape):
            value = self.literal(dim, (*lpath, "shape", i), scope, label)
            if isinstance(value, bool) or isinstance(value, (float, str, list)) or (
                    isinstance(value, int) and value < 0):
                self.errors.add(self.value(*lpath, "shape", i), f"{label}: shape: expected a "
                                f"size (a number >= 0, $param or expression), got {shown(dim)}")
                ok = False
            dims.append(value)
        dtype = extra.get("dtype", "float32")
        if dtype not in DTYPES:
            self.errors.add(self.value(*lpath, "dtype"), f"{label}: unknown dtype "
                            f"{shown(dtype)}{did_you_mean(str(dtype), DTYPES)}")
            ok = False
        elif not buffer and dtype not in ("float32", "float16", "bfloat16"):
            self.errors.add(self.value(*lpath, "dtype"), f"{label}: a Parameter is trained, "
                            f"so its dtype is a floating one (float32, float16, bfloat16), not "
                            f"{dtype}; use a Buffer")
            ok = False
        persistent = extra.get("persistent", True)
        if not isinstance(persistent, bool):
            self.errors.add(self.value(*lpath, "persistent"), f"{label}: persistent: expected "
                            f"true or false, got {shown(persistent)}")
            ok = False
        values, inits = None, ()
        given = layer.init_
        if isinstance(given, dict) and list(given) == ["values"]:
            values = self.tensor_values(lpath, given["values"], dims, dtype, label)
            ok = ok and values is not None
        elif given is not None:
            rules = self.initializers(lpath, {"init": given}, label)
            if rules is None:
                ok = False
            else:
                inits = tuple(dataclasses.replace(r, param="", layer=name) for r in rules)
        if not ok:
            return None
        tensor = OwnTensor(tuple(dims), dtype, buffer, persistent, values)
        return Node(name=name, var=ns.fresh(name), op=op, init=Args(), call=Args(), inputs=(),
                    pos=self.key(*lpath), inits=inits, tensor=tensor,
                    frozen=layer.requires_grad is False)

    def tensor_values(self, lpath, values: list, dims: list, dtype: str,
                      label: str) -> Optional[tuple]:
        """``init: {values: [...]}``: the tensor's elements, flat, in order."""
        where = self.value(*lpath, "init", "values")
        floating = dtype in ("float32", "float16", "bfloat16")
        kinds = (bool,) if dtype == "bool" else (int, float) if floating else (int,)
        for v in values:
            if not isinstance(v, kinds) or (isinstance(v, bool) and dtype != "bool"):
                self.errors.add(where, f"{label}: init: values: expected a flat list of "
                                f"{dtype} values, got {shown(v)}")
                return None
        if all(isinstance(d, int) for d in dims) and len(values) != math.prod(dims):
            self.errors.add(where, f"{label}: init: values: {len(values)} values for shape "
                            f"{dims}, which holds {math.prod(dims)}")
            return None
        return tuple(float(v) for v in values) if floating else tuple(values)

    # -- the new forms of a layer -------------------------------------------
    def feed(self, in_path, items: list) -> tuple[list[str], list[Position], Feed]:
        """``in:`` items -> the names read (flat), their positions, the Feed."""
        refs: list[str] = []
        where: list[Position] = []
        raw = self._raw(in_path)

        def item(value, path) -> Any:
            if isinstance(value, list):
                return tuple(item(v, (*path, i)) for i, v in enumerate(value))
            refs.append(value)
            where.append(self.value(*path))
            return len(refs) - 1

        def top(i):
            return (*in_path, i) if isinstance(raw, list) else in_path

        positional, keyword = [], []
        for i, value in enumerate(items):
            if isinstance(value, dict):
                for key, ref in value.items():
                    keyword.append((key, item(ref, (*top(i), key))))
            else:
                positional.append(item(value, top(i)))
        return refs, where, Feed(tuple(positional), tuple(keyword))

    def elements(self, lpath, layer: LayerSpec, ns: Namespace, input_names, all_names,
                 earlier: list[Node]) -> tuple[Optional[tuple], tuple[Element, ...]]:
        """A layer's ``outputs:`` -> the unpacking pattern and its named elements."""
        if layer.outputs is None:
            return None, ()
        label = self.label(lpath)
        if layer.repeat is not None or layer.output is not None:
            what = "repeat" if layer.repeat is not None else "output"
            self.errors.add(self.key(*lpath, "outputs"), f"{label}: 'outputs' names the "
                            f"elements of a returned tuple and cannot be combined with "
                            f"'{what}'")
            return None, ()
        taken = set(input_names) | set(all_names) | {v for n in earlier for v in n.value_names}
        elements: list[Element] = []
        ok = True

        def walk(items, path, at) -> tuple:
            nonlocal ok
            pattern = []
            for i, value in enumerate(items):
                if isinstance(value, list):
                    pattern.append(walk(value, (*path, i), (*at, i)))
                    continue
                if value == "_":
                    pattern.append(None)
                    continue
                pos = self.value(*path, i)
                problem = identifier_problem(value)
                if problem is None and value in _MODULE_ATTRS:
                    problem = f"{value!r} would shadow nn.Module.{value}"
                if problem is None and (value in taken or value in [e.name for e in elements]):
                    problem = f"{value!r} is already the name of an input, a layer or a value"
                if problem:
                    self.errors.add(pos, f"{label}: outputs: {problem}")
                    ok = False
                    pattern.append(None)
                    continue
                elements.append(Element(value, ns.fresh(value), (*at, i)))
                pattern.append(value)
            return tuple(pattern)

        pattern = walk(layer.outputs, (*lpath, "outputs"), ())
        if ok and not elements:
            self.errors.add(self.key(*lpath, "outputs"), f"{label}: outputs: name at least "
                            "one element ('_' drops one)")
            ok = False
        return (pattern, tuple(elements)) if ok else (None, ())

    def ties(self, lpath, layer: LayerSpec, op: Op, params, earlier: list[Node]
             ) -> Optional[tuple[Tie, ...]]:
        if not layer.tie:
            return ()
        label = self.label(lpath)
        if not op.has_module or layer.repeat is not None:
            why = "on a function layer" if not op.has_module else "on a repeated layer"
            self.errors.add(self.key(*lpath, "tie"), f"{label}: tie: is not supported {why}; "
                            "tie a layer to an earlier one of the model or of its block")
            return None
        ties = []
        owners = {n.name: n for n in earlier if n.op.has_module and n.op.runs}
        for param, target in layer.tie.items():
            pos = self.value(*lpath, "tie", param)
            owner, dot, owner_param = target.partition(".")
            if not dot or not owner or not owner_param:
                self.errors.add(pos, f"{label}: tie: {param}: expected LAYER.PARAM, like "
                                f"'wte.weight', got {target!r}")
                return None
            if owner not in owners:
                known = list(owners)
                self.errors.add(pos, f"{label}: tie: {param}: {owner!r} is not an earlier "
                                f"layer with parameters{did_you_mean(owner, known)}")
                return None
            if owners[owner].repeat is not None:
                self.errors.add(pos, f"{label}: tie: {param}: {owner!r} is repeated; tie to "
                                "a layer that is not")
                return None
            ties.append(Tie(param, owner, owner_param, pos))
        return tuple(ties)

    def checkpoint_ok(self, lpath, layer: LayerSpec, op: Op, params) -> bool:
        """``checkpoint: true`` needs a module or block layer of the model."""
        if not layer.checkpoint:
            return True
        why = None
        if params is not None:
            why = ("is set on the block's instances in the model's layers, not on a layer "
                   "inside a block")
        elif not op.has_module:
            why = (f"needs a module or block layer; {op.spelled} is a function, which keeps "
                   "no state to recompute: checkpoint the layers around it, or put it in a "
                   "block and checkpoint the block")
        else:
            given = [*(layer.call or {}), *(k for item in layer.in_ or []
                                            if isinstance(item, dict) for k in item)]
            clash = next((k for k in given if k in CHECKPOINT_OWN), None)
            if clash:
                why = (f"torch.utils.checkpoint takes {clash!r} itself, so the layer's "
                       f"keyword {clash!r} cannot be passed through it")
        if why:
            self.errors.add(self.key(*lpath, "checkpoint"),
                            f"{self.label(lpath)}: checkpoint: {why}")
        return why is None

    def layer_inits(self, lpath, layer: LayerSpec, op: Op) -> Optional[tuple[InitRule, ...]]:
        if not layer.init_map:
            return ()
        if not op.has_module:
            self.errors.add(self.key(*lpath, "init"), f"{self.label(lpath)}: init: needs a "
                            "module with parameters, not a function")
            return None
        rules = self.initializers((*lpath, "init"), layer.init_map, f"{self.label(lpath)}: init")
        if rules is None:
            return None
        return tuple(dataclasses.replace(r, layer=lpath[-1]) for r in rules)

    def initializers(self, path, mapping: dict, label: str) -> Optional[list[InitRule]]:
        """``{param: initializer}`` -> rules; errors at each bad entry."""
        rules = []
        ok = True
        for param, spec in mapping.items():
            pos = self.value(*path, param)
            name, arg = (spec, None) if isinstance(spec, str) else next(iter(spec.items()))
            fn = init_functions().get(name)
            if fn is None:
                self.errors.add(pos, f"{label}: {param}: unknown initializer {name!r}"
                                f"{did_you_mean(name, list(init_functions()))}")
                ok = False
                continue
            if arg is None:
                kwargs = {}
            elif isinstance(arg, dict):
                kwargs = dict(arg)
            else:  # {constant: 0.5}: the one value argument
                kwargs = {fn.value_arg: arg} if fn.value_arg else None
                if kwargs is None:
                    self.errors.add(pos, f"{label}: {param}: {name} takes keyword arguments "
                                    f"({', '.join(fn.names) or 'none'}), like "
                                    f"{{{name}: {{{fn.names[0] if fn.names else 'x'}: ...}}}}")
                    ok = False
                    continue
            values = []
            for key, value in kwargs.items():
                if key not in fn.names:
                    self.errors.add(pos, f"{label}: {param}: unknown argument {key!r} for "
                                    f"{name}{did_you_mean(key, fn.names)}")
                    ok = False
                    continue
                values.append((key, self.literal(value, (*path, param), Scope(None, None),
                                                 label)))
            rules.append(InitRule(param, Initializer(name, tuple(values)), pos))
        return rules if ok else None

    def _raw(self, path):
        node = self.loaded.data
        for part in path:
            node = node[part]
        return node

    def literal(self, value, path, scope: "Scope", label: str, key: str = ""):
        """A spec value as IR data: ``$p`` -> Param, ``=...`` -> an expression,
        dtypes -> Expr."""
        if isinstance(value, list):
            return [self.literal(v, (*path, i), scope, label) for i, v in enumerate(value)]
        if isinstance(value, str) and value.startswith("$"):
            self.check_param(value[1:], value, path, scope, label)
            return Param(value[1:])
        if expressions.is_expression(value):
            written = shown(value, 80)  # a long one cut: the position shows where
            try:
                tree = expressions.parse(value)
            except expressions.ExpressionError as exc:
                self.errors.add(self.value(*path), f"{label}: expression {written}: {exc}")
                return 0
            for name in sorted(params_used(tree)):
                self.check_param(name, value, path, scope, label)
            for name in sorted(sizes_used(tree)):
                if scope.sizes is None:
                    self.errors.add(self.value(*path), f"{label}: expression {written}: "
                                    "size() is read in forward, so it can only be used in the "
                                    "arguments of a torch.*/F.* layer or in call:, not in a "
                                    "module's constructor arguments")
                elif name not in scope.sizes:
                    self.errors.add(self.value(*path), f"{label}: expression {written}: "
                                    f"size() of {name!r}, which is not in scope here"
                                    f"{did_you_mean(name, scope.sizes)}")
            return tree
        if key == "dtype" and isinstance(value, str):
            if value not in DTYPES:
                self.errors.add(self.value(*path), f"{label}: unknown dtype "
                                f"{value!r}{did_you_mean(value, DTYPES)}")
            return Expr(f"torch.{value}")
        return value

    def check_param(self, name: str, written: str, path, scope: "Scope", label: str) -> None:
        shown = f"${name}"
        if name in (INDEX, REPEAT) and (scope.params is None or name not in scope.params):
            if not scope.copies:
                what = "index of each copy" if name == INDEX else "number of copies"
                self.errors.add(self.value(*path), f"{label}: {shown!r} is the {what} of a "
                                "repeated layer, in its arguments and keywords; this layer has "
                                "no repeat:")
            return
        if scope.params is None:
            self.errors.add(self.value(*path), f"{label}: {shown!r} is a block parameter, but "
                            "this layer is not inside a block")
        elif name not in scope.params:
            self.errors.add(self.value(*path), f"{label}: unknown block parameter "
                            f"{shown!r}{did_you_mean(name, scope.params)}")

    def check_cast(self, lpath, layer: LayerSpec, op: Op, refs, feed) -> bool:
        """``{op: torch.Tensor.to, dtype: int64}`` casts the one tensor it reads;
        ``{op: torch.Tensor.type_as, in: [x, ref]}`` casts ``x`` to ``ref``'s
        dtype. Nothing else is given: the device is placement's."""
        label, ok = self.label(lpath), True
        to = op.spelled == "torch.Tensor.to"
        form = ("{op: torch.Tensor.to, dtype: int64}" if to else
                "{op: torch.Tensor.type_as, in: [x, ref]}")
        want = 1 if to else 2
        plain = feed is None or (not feed.keyword and all(
            isinstance(item, int) for item in feed.positional))
        if len(refs) != want or not plain:
            what = ("casts the one tensor it reads" if to else "reads two tensors: the one "
                    "it casts, then the one whose dtype it takes")
            where = self.value(*lpath, "in") if layer.in_ is not None else self.key(*lpath)
            self.errors.add(where, f"{label}: {op.spelled} {what} ({form})")
            ok = False
        extra = dict(layer.model_extra or {})
        allowed = ["dtype"] if to else []
        why = ("its one key is dtype" if to else
               "it takes the dtype of the tensor it reads second")
        for key, given in (("args", bool(layer.args)), ("call", bool(layer.call)),
                           ("output", layer.output is not None),
                           ("outputs", layer.outputs is not None),
                           ("requires_grad", getattr(layer, "requires_grad", None) is not None),
                           *((k, k not in allowed) for k in extra)):
            if given:
                hint = did_you_mean(key, allowed) if key in extra else ""
                self.errors.add(self.key(*lpath, key), f"{label}: {op.spelled} takes no "
                                f"{key}:{hint} ({why}: {form})")
                ok = False
        if to and "dtype" not in extra:
            self.errors.add(self.key(*lpath), f"{label}: {op.spelled} needs dtype:, the "
                            f"dtype it casts to ({', '.join(DTYPES)})")
            ok = False
        elif to and not isinstance(extra["dtype"], str):
            self.errors.add(self.value(*lpath, "dtype"), f"{label}: dtype: expected one of "
                            f"{', '.join(DTYPES)}, got {shown(extra['dtype'])}")
            ok = False
        return ok

    def check_call(self, op: Op, lpath, name, args, kwargs, n_inputs) -> bool:
        if op.kind is OpKind.BLOCK:
            block = self.spec.blocks[op.target]
            if kwargs:
                self.errors.add(self.key(*lpath, kwargs[0][0]), f"{self.label(lpath)}: block "
                                f"{op.spelled} takes its params ({', '.join(block.params)}) as "
                                "args, in order")
                return False
            if len(args) != len(block.params):
                self.errors.add(self.value(*lpath, "args") if args else self.key(*lpath),
                                f"{self.label(lpath)}: block {op.spelled} takes {len(block.params)} "
                                f"args ({', '.join(block.params) or 'none'}), got {len(args)}")
                return False
            want = len(block.inputs)
            if n_inputs != want and n_inputs is not None:  # None: held, never called
                self.errors.add(self.key(*lpath), f"{self.label(lpath)}: block {op.spelled} takes "
                                f"{want} input(s) ({', '.join(block.inputs)}), got {n_inputs}")
                return False
            return True
        for key, _ in kwargs:
            if key == "device":
                self.errors.add(self.key(*lpath, key), f"{self.label(lpath)}: 'device' is set by "
                                "placement, not by a keyword argument")
                return False
        if op.kind is OpKind.FUNCTION:
            sig = ops.function_signature(op.target, 1 if op.seq_input else n_inputs)
        else:
            sig = ops.module_signature(op.target)
        if not sig.var_kwargs:
            allowed = [n for n in sig.names if n not in ("device",)]
            if not self._unknown_kw(lpath, name, kwargs, allowed, op):
                return False
        if sig.bind is not None and not any(isinstance(v, Param) for v in _flat(args, kwargs)):
            try:
                bound = sig.bind(*args, **dict(kwargs))
            except TypeError as exc:
                self.errors.add(self.key(*lpath), f"{self.label(lpath)}: {op.spelled}: {exc}")
                return False
            if "device" in bound.arguments:
                self.errors.add(self.value(*lpath, "args"), f"{self.label(lpath)}: the device "
                                "is set by placement, not by an argument")
                return False
        return True

    def _unknown_kw(self, lpath, name, kwargs, allowed, op) -> bool:
        ok = True
        for key, _ in kwargs:
            if key not in allowed:
                hint = did_you_mean(key, [*allowed, "op", "in", "args", "repeat", "output",
                                          "checkpoint", "requires_grad"])
                self.errors.add(self.key(*lpath, key), f"{self.label(lpath)}: unknown keyword "
                                f"argument {key!r} for {op.spelled}{hint}")
                ok = False
        return ok

    def outputs(self, path, outputs: Optional[list[str]], nodes: list[Node]) -> list[str]:
        if outputs is None:
            return list(nodes[-1].value_names) if nodes else []
        names = [v for n in nodes for v in n.value_names]
        tuples = {n.name: n for n in nodes if n.pattern}
        raw = self._raw(path)
        result = []
        for i, out in enumerate(outputs):
            pos = self.value(*path, i) if isinstance(raw, list) else self.value(*path)
            if out in tuples:
                self.errors.add(pos, f"outputs: {out!r} returns a tuple named by its outputs; "
                                f"list its elements ({', '.join(tuples[out].value_names)})")
            elif out not in names:
                self.errors.add(pos, f"outputs: unknown layer {out!r}{did_you_mean(out, names)}")
            elif out in result:
                self.errors.add(pos, f"outputs: {out!r} is listed twice")
            else:
                result.append(out)
        return result


# NOTE: [Placement inside a block instance]
# A placement key may name a layer inside a block instance (``model.norm``),
# or instances of a repeated layer there (``model.layers.16-31``). Such an
# instance is split: its block's layers become the graph's own nodes, named
# by their path (so ``self.model.norm``, and the state-dict keys of the unsplit
# block), its params set to the instance's arguments, its inputs and outputs
# wired to the values around it; a ``Split`` records which nodes it became.
# From there every stage sees ordinary layers: placement, transfers, costs,
# pipeline stages. The generated model makes ``self.model = nn.Module()`` and
# its layers under it, each on its device; forward runs them in place of the
# block's call. A key that reaches inside one copy of a repeated block
# (``model.layers.3.mlp``) is refused: the copies are made alike in one loop.
# Splitting is asked only by explicit placement keys; a split is by path, so
# nested instances split as far as the keys reach. An instance that is a
# model output (a body without a head) keeps the output's name: the graph's
# ``aliases`` say which value it became (``model`` -> ``model.norm``), and
# ``Graph.value_name`` is how every stage finds the value an output names.


class _Splitter:
    """Block instances that explicit placement keys reach inside, split
    (NOTE [Placement inside a block instance])."""

    def __init__(self, resolver: "_Resolver", blocks: dict[str, BlockClass],
                 outputs: list[str], ns: Namespace) -> None:
        self.r = resolver
        self.blocks = blocks
        self.outputs = list(outputs)
        #: a model output that is a split instance (or its element) -> the value
        #: it became: the output keeps its name (Graph.aliases)
        self.aliases: tuple[tuple[str, str], ...] = ()
        self.ns = ns
        self.top: dict[str, Node] = {}  # the model's layers, by name
        self.wanted: dict[str, str] = {}  # instance path -> the key that splits it

    def walk(self, parts: list[str]):
        """``(path, node, scope)`` for each part of a dotted path, stepping into
        the block of each instance that is not repeated; stops after a part
        that is not one (``node`` None where the scope has no such layer)."""
        scope = self.top
        end = 0
        while end < len(parts):
            part, end = parts[end], end + 1
            if part not in scope and end < len(parts) and f"{part}.{parts[end]}" in scope:
                part, end = f"{part}.{parts[end]}", end + 1  # an item: block.0
            node = scope.get(part)
            yield ".".join(parts[:end]), node, scope
            if node is None or node.op.kind is not OpKind.BLOCK or node.repeat is not None:
                return
            scope = {n.name: n for n in self.blocks[node.op.target].nodes}

    def reach(self, key: str) -> None:
        """Mark the block instances ``key`` names a layer inside of."""
        parts = key.split(".")
        for path, node, _ in self.walk(parts[:-1]):
            if node is None or node.op.kind is not OpKind.BLOCK:
                return
            if node.repeat is not None:
                rest = key[len(path) + 1:].split(".")  # the copy, then what is inside it
                if len(rest) > 1:
                    self.r.errors.add(self.r.key("placement", key), f"placement: {key!r} "
                                      f"reaches inside one copy of {path!r}, which is repeated: "
                                      f"its copies are made alike; place whole copies "
                                      f"({path}.{rest[0]})")
                return
            self.wanted.setdefault(path, key)

    def instance(self, path: str, i: int) -> None:
        """``placement.auto.split[i]``: split block instance ``path`` and those
        it is inside of."""
        for inner, node, scope in self.walk(path.split(".")):
            part = inner.rpartition(".")[2]
            if node is None or node.op.kind is not OpKind.BLOCK or node.repeat is not None:
                known = [n.name for n in scope.values() if n.op.kind is OpKind.BLOCK
                         and n.repeat is None]
                what = (f"{part!r} is not a layer here" if node is None else
                        f"{part!r} is a repeated layer" if node.op.kind is OpKind.BLOCK else
                        f"{part!r} is not a block instance")
                self.r.errors.add(self.r.value("placement", "auto", "split", i),
                                  f"placement.auto.split: {path!r}: {what}; split names a "
                                  f"block instance that is not repeated"
                                  f"{did_you_mean(part, known)}")
                return
            self.wanted.setdefault(inner, path)

    def split(self, nodes: list[Node], splits: list["Split"]) -> list[Node]:
        self.top = {n.name: n for n in nodes}
        placement = self.r.spec.placement
        if placement is not None and placement.auto is not None:
            for i, path in enumerate(placement.auto.split):
                self.instance(path, i)
        for key in (placement.explicit if placement is not None and placement.auto is None
                    else {}):
            self.reach(key)
        if not self.wanted:
            return nodes
        result: list[Node] = []
        rename: dict[str, str] = {}
        for node in nodes:
            node = self.renamed(node, "", {}, rename)
            if node.name in self.wanted:
                result += self.expand(node, splits, rename)
            else:
                result.append(node)
        self.aliases = tuple((out, rename[out]) for out in self.outputs if out in rename)
        return [self.retied(node, result) if node.ties else node for node in result]

    def retied(self, node: Node, nodes: list[Node]) -> Node:
        """``node``'s ties to a parameter of a split instance, owned by the layer
        of the instance that holds it now (``transformer.wte.weight``: the
        layer ``transformer.wte``'s ``weight``)."""
        owners = {n.name: n for n in nodes if n.op.has_module}
        ties = []
        for tie in node.ties:
            if tie.owner in owners:
                ties.append(tie)
                continue
            parts = tie.source.split(".")
            owner = next((".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)
                          if ".".join(parts[:end]) in owners), None)
            if owner is None or owners[owner].repeat is not None:
                self.r.errors.add(tie.pos, f"layer {node.name!r}: tie: {tie.param}: "
                                  f"{tie.source!r} is in block instance {tie.owner!r}, which "
                                  "placement splits, and not in a layer of it that is not "
                                  "repeated")
                ties.append(tie)
                continue
            ties.append(dataclasses.replace(tie, owner=owner,
                                            owner_param=tie.source[len(owner) + 1:]))
        return dataclasses.replace(node, ties=tuple(ties))

    def renamed(self, node: Node, prefix: str, params: dict, rename: dict[str, str]) -> Node:
        """``node`` of a block split at ``prefix``, as a node of the graph: its
        path for a name, a fresh variable, its values and params set."""
        if not prefix and not rename:
            return node
        inputs = tuple(rename.get(r, r) for r in node.inputs)
        changes: dict[str, Any] = dict(
            inputs=inputs, init=_folded(node.init.substitute(params, rename)),
            call=_folded(node.call.substitute(params, rename)))
        if prefix:
            elements = tuple(dataclasses.replace(e, name=prefix + e.name,
                                                 var=self.ns.fresh(e.name))
                             for e in node.elements)
            changes.update(
                name=prefix + node.name, elements=elements,
                var=self.ns.fresh(node.name if node.name.isidentifier() else node.var),
                pattern=_renamed_pattern(node.pattern, prefix),
                inits=tuple(dataclasses.replace(r, layer=prefix + node.name)
                            for r in node.inits),
                ties=tuple(dataclasses.replace(t, owner=prefix + t.owner) for t in node.ties))
            if node.tensor is not None:
                changes["tensor"] = dataclasses.replace(node.tensor, shape=tuple(
                    _folded_value(substitute(d, params)) for d in node.tensor.shape))
        return dataclasses.replace(node, **changes)

    def expand(self, node: Node, splits: list["Split"], rename: dict[str, str]) -> list[Node]:
        """The nodes block instance ``node`` becomes; ``rename`` learns what its
        values are now called."""
        path, key = node.name, self.wanted[node.name]
        block = self.blocks[node.op.target]
        auto = self.r.spec.placement.auto
        where = (self.r.value("placement", "auto", "split", auto.split.index(key))
                 if auto is not None else self.r.key("placement", key))
        if node.feed is not None and (node.feed.keyword or any(
                isinstance(i, tuple) for i in node.feed.positional)):
            self.r.errors.add(where, f"placement: {key!r}: block instance {path!r} takes a "
                              "tuple or keyword input, so it cannot be split")
            return [node]
        params = dict(zip(block.params, node.init.positional))
        inner = {t.name: node.inputs[i] for i, t in
                 zip(node.feeding.positional, block.inputs)}
        made: list[Node] = []
        first = len(splits)
        splits.append(None)  # its place, outer before inner
        for n in block.nodes:
            n = self.renamed(n, f"{path}.", params, inner)
            own = n.name.removeprefix(f"{path}.")  # the instance's ties to a layer inside it
            moved = tuple(dataclasses.replace(t, param=t.param.removeprefix(f"{own}."))
                          for t in node.ties if t.param.startswith(f"{own}."))
            if moved:  # tie: {embed_tokens.weight: shared.weight} on a split T5Stack
                n = dataclasses.replace(n, ties=n.ties + moved)
            if node.checkpoint and n.op.has_module and n.op.runs:  # each layer, recomputed
                n = dataclasses.replace(n, checkpoint=True)
            if node.frozen and n.op.has_module:  # every parameter inside, frozen
                n = dataclasses.replace(n, frozen=True)
            for old, new in zip(_plain_names(n, f"{path}."), n.value_names):
                inner[old] = new
            if n.name in self.wanted:
                made += self.expand(n, splits, inner)
                for old in _plain_names(n, f"{path}."):  # read as what it became
                    inner[old] = inner.get(inner[old], inner[old])
            else:
                made.append(n)
        outs = [inner[o] for o in block.outputs]
        if node.pattern:
            for element, out in zip(node.elements, outs):
                rename[element.name] = out
        elif node.output is not None and len(outs) > 1:  # its element node.output
            if not -len(outs) <= node.output < len(outs):
                self.r.errors.add(node.pos, f"layer {path!r}: block {block.name} returns "
                                  f"{len(outs)} values, so 'output: {node.output}' is out "
                                  "of range")
                return made
            rename[node.name] = outs[node.output]
        else:
            rename[node.name] = outs[0]
        splits[first] = Split(path, block.name, tuple(n.name for n in made), node.pos)
        return made


def _plain_names(node: Node, prefix: str) -> tuple[str, ...]:
    """The names a node of a block had there (``node`` renamed under ``prefix``)."""
    return tuple(v.removeprefix(prefix) for v in node.value_names)


def _renamed_pattern(pattern, prefix: str):
    if pattern is None:
        return None
    return tuple(_renamed_pattern(p, prefix) if isinstance(p, tuple) else
                 (prefix + p if p else p) for p in pattern)


def _folded(args: Args) -> Args:
    return Args(tuple(_folded_value(v) for v in args.positional),
                tuple((k, _folded_value(v)) for k, v in args.keyword))


def _folded_value(value: Any) -> Any:
    """An expression whose params are all set, computed: ``3 * 768`` -> 2304."""
    if isinstance(value, list):
        return [_folded_value(v) for v in value]
    if isinstance(value, Neg):
        inner = _folded_value(value.operand)
        return -inner if _number(inner) else Neg(inner)
    if isinstance(value, BinOp):
        left, right = _folded_value(value.left), _folded_value(value.right)
        if _number(left) and _number(right):
            try:
                return expressions.fold(value.op, left, right)
            except expressions.ExpressionError:
                pass
        return BinOp(value.op, left, right)
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: Functions whose randomness is for training only, and the name of their flag.
_TRAINING_FLAG = {
    **{f"F.{n}": "training" for n in ("dropout", "alpha_dropout", "feature_alpha_dropout",
                                      "dropout1d", "dropout2d", "dropout3d", "rrelu")},
    **{f"torch.{n}": "train" for n in ("dropout", "alpha_dropout", "feature_dropout",
                                       "feature_alpha_dropout")},
}


def _train_mode(op: Op, n_inputs: int, args: tuple, kwargs: tuple) -> tuple:
    """A function layer's keywords, with what depends on training mode tied
    to the module's (``model.eval()`` turns dropout off, as nn.Dropout does):
    a dropout-like function not given its flag gets ``self.training``, and a
    ``dropout_p`` applies only while training."""
    given = dict(kwargs)
    flag = _TRAINING_FLAG.get(op.spelled)
    if flag is not None and flag not in given:
        try:
            names = list(inspect.signature(op.target).parameters)
        except (TypeError, ValueError):  # torch.dropout(input, p, train)
            names = ["input", "p", flag]
        position = names.index(flag) if flag in names else len(names)
        if n_inputs + len(args) <= position:
            given[flag] = Training()
    if "dropout_p" in given and given["dropout_p"] not in (0, 0.0, None):
        given["dropout_p"] = IfTraining(given["dropout_p"], 0.0)
    return tuple(given.items())


@dataclass(frozen=True)
class Scope:
    """What a value may read: block params (None outside a block) and the
    tensors whose sizes it may take (None where it is not computed in forward)."""

    params: Optional[list[str]]
    sizes: Optional[Collection[str]]
    copies: bool = False  # a repeated layer's arguments: $index and $repeat


@functools.cache
def init_functions() -> dict[str, "InitFunction"]:
    """``torch.nn.init`` by the spec's names: ``normal`` -> ``nn.init.normal_``."""
    result = {}
    for attr in sorted(dir(nn.init)):
        fn = getattr(nn.init, attr)
        if not (attr.endswith("_") and not attr.startswith("_") and callable(fn)):
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]
        names = [p.name for p in params if p.name != "generator"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        required = [p.name for p in params if p.default is p.empty and p.name in names]
        result[attr[:-1]] = InitFunction(attr, tuple(names), required[0] if required else None)
    return result


@dataclass(frozen=True)
class InitFunction:
    attr: str  # nn.init attribute: normal_
    names: tuple[str, ...]  # keyword arguments after the tensor
    value_arg: Optional[str]  # the one required argument ({constant: 0.5} -> val)


def _user_roots(spec: Spec) -> set[str]:
    """The top-level modules of the spec's own code that the generated files
    import: those of dotted ops, of a loss or optimizer class, and of data
    factories (``package.module:function``)."""
    layers = list(spec.layers.values())
    for block in spec.blocks.values():
        layers.extend(block.layers.values())
    ops = [layer.op for layer in layers]
    modules = []
    if spec.train is not None:
        losses = spec.train.loss.values() if isinstance(spec.train.loss, dict) else [
            spec.train.loss]
        ops += [loss.op for loss in losses] + [spec.train.optimizer.op]
        modules += [data.factory.partition(":")[0] for data in (spec.train.data,
                                                                  spec.train.eval_data)
                    if data is not None and data.factory is not None]
    modules += [op for op in ops if "." in op and not op.startswith(("torch.", "F."))]
    return {module.split(".")[0] for module in modules if module.split(".")[0].isidentifier()}


def _flat(args, kwargs):
    for v in list(args) + [v for _, v in kwargs]:
        if isinstance(v, list):
            yield from _flat(v, ())
        else:
            yield v
