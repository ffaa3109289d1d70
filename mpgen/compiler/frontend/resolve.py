"""Spec (pydantic models) -> IR :class:`~mpgen.compiler.ir.Graph`.

Resolves every name: ops against torch, blocks and user modules; ``in:``
references to edges; ``$param`` values to :class:`~mpgen.compiler.ir.Param`;
keyword arguments against the callee's real signature. All identifiers of
the generated code are handed out here by :class:`Namespace`. Errors are
collected and reported together, each at its YAML node.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

from torch import nn

from mpgen.compiler.frontend import ops
from mpgen.compiler.ir import (
    Args,
    BlockClass,
    Expr,
    Graph,
    InputTensor,
    Node,
    Op,
    OpKind,
    Param,
    SymDim,
    TensorType,
)
from mpgen.compiler.frontend.namespace import GLOBALS, Namespace, identifier_problem
from mpgen.errors import Collector, Position, did_you_mean
from mpgen.spec_schema.load import LoadedSpec, SourceMap
from mpgen.spec_schema.models import DTYPES, LayerSpec, Spec

#: Attributes every nn.Module has; a layer attribute must not shadow them.
_MODULE_ATTRS = frozenset(dir(nn.Module)) | {"training"}


def display_path(spec_path: str) -> str:
    """The spec path shown in generated headers: stable across directories.

    Relative to the enclosing project (the nearest folder above the spec with
    ``.git`` or ``pyproject.toml``), else the file name, so that building from
    another directory, or with an absolute path, gives the same bytes.
    """
    path = Path(os.path.abspath(spec_path))
    shown = path.name
    for parent in path.parents:
        if (parent / ".git").exists() or (parent / "pyproject.toml").exists():
            shown = path.relative_to(parent).as_posix()
            break
    # It lands in comments and docstrings: escape anything unusual.
    return shown.encode("unicode_escape").decode("ascii").replace('"', '\\"')


def resolve(spec: Spec, loaded: LoadedSpec) -> Graph:
    """Build the graph; raises MpgenError (or ErrorList) for every mistake."""
    return _Resolver(spec, loaded).graph()


class _Resolver:
    def __init__(self, spec: Spec, loaded: LoadedSpec) -> None:
        self.spec = spec
        self.loaded = loaded
        self.src: SourceMap = loaded.source
        self.errors = Collector()
        self.search_path = [str(Path(loaded.path).resolve().parent), os.getcwd()]
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
        problem = identifier_problem(spec.name)
        if problem is None and self.globals.taken(spec.name):
            problem = f"{spec.name!r} clashes with a name the generated code imports"
        if problem:
            self.errors.add(self.value("name"), f"name: {problem}")
        else:
            self.globals.claim(spec.name)
        for block_name in spec.blocks:
            problem = identifier_problem(block_name)
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
        nodes = self.layers(
            ("layers",), spec.layers, inputs, [b.name for b in blocks], params=None,
            ns=self.forward_namespace(inputs),
        )
        outputs = self.outputs(("outputs",), spec.outputs, nodes)
        self.errors.raise_if_any()
        return Graph(
            name=spec.name,
            spec_path=display_path(self.loaded.path),
            spec_hash=hashlib.sha256(self.loaded.text.encode("utf-8")).hexdigest(),
            inputs=tuple(inputs),
            nodes=tuple(nodes),
            outputs=tuple(outputs),
            blocks=tuple(blocks),
            pos=self.value("name"),
        )

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
        for index, (name, layer) in enumerate(layers.items()):
            where = self.key(*path, name)
            problem = identifier_problem(name)
            if problem is None and name in _MODULE_ATTRS:
                problem = f"{name!r} would shadow nn.Module.{name}"
            if problem is None and name in input_names:
                problem = f"{name!r} is also the name of an input"
            if problem:
                self.errors.add(where, f"{self.label((*path, name))}: {problem}")
                failed.add(name)
                continue
            node = self.layer(path, name, layer, index, nodes, input_names, all_names,
                              blocks, params, ns, failed)
            if node is None:
                failed.add(name)
            else:
                nodes.append(node)
        return nodes

    def layer(self, path, name, layer: LayerSpec, index, earlier: list[Node],
              input_names, all_names, blocks, params, ns: Namespace,
              failed: set[str]) -> Optional[Node]:
        lpath = (*path, name)
        try:
            op = ops.resolve_op(layer.op, blocks, self.search_path)
        except ops.OpError as exc:
            hint = did_you_mean(layer.op, ops.candidates(blocks)) if "unknown op" in str(exc) else ""
            if layer.op in self.spec.blocks and layer.op not in blocks:
                hint = " (a block can only use blocks defined before it)" if params is not None \
                    else ""
            self.errors.add(self.value(*lpath, "op"), f"{self.label(lpath)}: {exc}{hint}")
            return None
        # Inputs: default is the previous layer, or the first input.
        if layer.in_ is None:
            refs = [all_names[index - 1]] if index else input_names[:1]
            ref_pos = [self.key(*lpath)] * len(refs)
        else:
            refs = list(layer.in_)
            in_path = (*lpath, "in")
            is_list = isinstance(self._raw(in_path), list)
            ref_pos = [self.value(*in_path, i) if is_list else self.value(*in_path)
                       for i in range(len(refs))]
        known = input_names + [n.name for n in earlier]
        ok = True
        for ref, pos in zip(refs, ref_pos):
            if ref in known:
                continue
            ok = False
            if ref in failed:
                continue  # its own error is reported
            if ref == name:
                msg = f"{self.label(lpath)} cannot read its own output"
            elif ref in all_names:
                msg = (f"{self.label(lpath)} reads {ref!r}, which is defined later; "
                       "layers may only read inputs and earlier layers")
            else:
                hint = did_you_mean(ref, known) or (
                    f" (it can read {', '.join(known)})" if len(known) <= 8 else "")
                msg = f"{self.label(lpath)} reads unknown {ref!r}{hint}"
            self.errors.add(pos, msg)
        if layer.repeat is not None and op.kind is OpKind.FUNCTION:
            self.errors.add(self.value(*lpath, "repeat"),
                            f"{self.label(lpath)}: repeat needs a module or block op, not a function")
            ok = False
        label = self.label(lpath)
        args = tuple(self.literal(v, (*lpath, "args", i), params, label)
                     for i, v in enumerate(layer.args))
        kwargs = tuple((k, self.literal(v, (*lpath, k), params, label, key=k))
                       for k, v in layer.kwargs.items())
        ok = self.check_call(op, lpath, name, args, kwargs, len(refs)) and ok
        if not ok:
            return None
        var = ns.fresh(name)
        given = Args(args, kwargs)
        init, call = (Args(), given) if op.kind is OpKind.FUNCTION else (given, Args())
        return Node(name=name, var=var, op=op, init=init, call=call, inputs=tuple(refs),
                    pos=self.key(*lpath), repeat=layer.repeat, output=layer.output)

    def _raw(self, path):
        node = self.loaded.data
        for part in path:
            node = node[part]
        return node

    def literal(self, value, path, params: Optional[list[str]], label: str, key: str = ""):
        """A spec value as IR data: ``$p`` -> Param, dtypes -> Expr."""
        if isinstance(value, list):
            return [self.literal(v, (*path, i), params, label) for i, v in enumerate(value)]
        if isinstance(value, str) and value.startswith("$"):
            pname = value[1:]
            if params is None:
                self.errors.add(self.value(*path), f"{label}: {value!r} is a block "
                                "parameter, but this layer is not inside a block")
            elif pname not in params:
                self.errors.add(self.value(*path), f"{label}: unknown block parameter "
                                f"{value!r}{did_you_mean(pname, params)}")
            return Param(pname)
        if key == "dtype" and isinstance(value, str):
            if value not in DTYPES:
                self.errors.add(self.value(*path), f"{label}: unknown dtype "
                                f"{value!r}{did_you_mean(value, DTYPES)}")
            return Expr(f"torch.{value}")
        return value

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
            if n_inputs != want:
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
                hint = did_you_mean(key, [*allowed, "op", "in", "args", "repeat", "output"])
                self.errors.add(self.key(*lpath, key), f"{self.label(lpath)}: unknown keyword "
                                f"argument {key!r} for {op.spelled}{hint}")
                ok = False
        return ok

    def outputs(self, path, outputs: Optional[list[str]], nodes: list[Node]) -> list[str]:
        if outputs is None:
            return [nodes[-1].name] if nodes else []
        names = [n.name for n in nodes]
        raw = self._raw(path)
        result = []
        for i, out in enumerate(outputs):
            pos = self.value(*path, i) if isinstance(raw, list) else self.value(*path)
            if out not in names:
                self.errors.add(pos, f"outputs: unknown layer {out!r}{did_you_mean(out, names)}")
            elif out in result:
                self.errors.add(pos, f"outputs: {out!r} is listed twice")
            else:
                result.append(out)
        return result


def _user_roots(spec: Spec) -> set[str]:
    layers = list(spec.layers.values())
    for block in spec.blocks.values():
        layers.extend(block.layers.values())
    return {
        layer.op.split(".")[0]
        for layer in layers
        if "." in layer.op and not layer.op.startswith(("torch.", "F."))
        and layer.op.split(".")[0].isidentifier()
    }


def _flat(args, kwargs):
    for v in list(args) + [v for _, v in kwargs]:
        if isinstance(v, list):
            yield from _flat(v, ())
        else:
            yield v
