"""The capture of ``mpgen import``: the model's ``forward`` traced by
TorchDynamo (``torch._dynamo.export``), which runs Python's control flow on
the sample inputs and records torch-level calls (``F.linear``, ``x.view``,
``+``) with symbolic sizes, so that library models torch.fx cannot trace
(Hugging Face transformers' masks, torchvision's shape asserts) import.

Each node carries the modules it ran in (``nn_module_stack``): the nodes of
one call of a ``torch.nn`` layer become one :class:`LeafCall` (its
arguments read from an eager run with forward hooks), and the other modules
form the tree of :class:`Scope` objects that :mod:`.scopes` writes as
blocks (NOTE [Module hierarchy])."""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from mpgen.commands.importer.trace import (
    InputSpec, TraceFailure, check_placeholders, writes_in_place)
from mpgen.compiler.frontend import ops

# NOTE: [Module hierarchy]
# The generated model's state-dict keys are the original's when every
# module of the original is a layer of the same name in its parent's
# block: a ``torch.nn`` layer (Linear, LayerNorm: a leaf, written as that
# op), any other module a block of its own (its own parameters and
# buffers as ``Parameter``/``Buffer`` layers, its children as layers), and
# the N children of a ``ModuleList``/``Sequential`` called one after the
# other a layer with ``repeat: N`` of one block. TorchDynamo inlines every
# call, so a module's calls are found again from the nodes' stacks: the
# nodes of one stack entry (one call) are contiguous, since Python runs a
# call to its end before the caller goes on.


#: Library modules kept whole, as a dotted op (the package in ``imports:``),
#: since their forward cannot be written as spec layers in every mode: the
#: class -> the op (the path its package exports it at).
LIBRARY_LEAVES = {"torchvision.ops.stochastic_depth.StochasticDepth": "torchvision.ops.StochasticDepth"}


def is_leaf(cls: type) -> bool:
    """A ``torch.nn`` layer a spec names as an op (not a container)."""
    return (getattr(nn, cls.__name__, None) is cls and cls.__name__ in ops.nn_module_names()
            and not issubclass(cls, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def library_leaf(cls: type) -> Optional[str]:
    return LIBRARY_LEAVES.get(f"{cls.__module__}.{cls.__qualname__}")


@dataclass
class LeafCall:
    """One call of a leaf module: its nodes, and the call's arguments."""

    path: str
    module: nn.Module
    nodes: list[fx.Node]
    args: tuple = ()  # the eager call's arguments: tensors or constants
    kwargs: dict = field(default_factory=dict)
    output: Any = None  # the eager call's result (a tensor or a tuple)


@dataclass
class Scope:
    """One call of a module traced through: a block (the root: the model)."""

    path: str
    module: nn.Module
    parent: Optional["Scope"]
    items: list = field(default_factory=list)  # fx.Node | LeafCall | Scope, in order
    args: tuple = ()  # the eager call's arguments
    kwargs: dict = field(default_factory=dict)

    def nodes(self, leaves: bool = True) -> list[fx.Node]:
        """The nodes of this call (``leaves=False``: but those inside the
        leaf modules it calls, which a spec does not write)."""
        found = []
        for item in self.items:
            if isinstance(item, fx.Node):
                found.append(item)
            elif isinstance(item, LeafCall):
                found.extend(item.nodes if leaves else ())
            else:
                found.extend(item.nodes(leaves))
        return found


@dataclass
class Captured:
    gm: fx.GraphModule
    inputs: list[InputSpec]
    root: Scope
    values: dict  # node -> its example value (fake tensors, SymInts)
    attributes: dict  # get_attr target -> the original's dotted name
    placeholders: dict  # placeholder node -> the input's name


def _path(stack_path: str) -> str:
    """``L['self'].model.layers[0]`` -> ``model.layers.0``."""
    path = re.sub(r"^L\['(self|args)'\](\[0\])?\.?", "", stack_path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    # ``.__dict__['_modules']['conv_in']``: a class with its own __getattr__ (diffusers')
    return re.sub(r"(?:^|\.)(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]", r".\1",
                  path).strip(".")


@contextlib.contextmanager
def _recording_calls(root: nn.Module, calls: dict):
    """Forward hooks on the leaves that keep each call's arguments."""
    handles = []
    for name, module in root.named_modules(remove_duplicate=False):
        if module is root:
            continue

        def hook(mod, args, kwargs, output, name=name):
            calls.setdefault(name, []).append((args, dict(kwargs), output))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture(root: nn.Module, inputs: Sequence[InputSpec]) -> Captured:
    import torch._dynamo as dynamo  # noqa: PLC0415 (slow to import)

    samples = {spec.name: spec.sample() for spec in inputs}
    for spec in inputs:
        for dim, size in enumerate(spec.dims):
            if isinstance(size, str):
                dynamo.mark_dynamic(samples[spec.name], dim)
    cls = type(root).__name__
    _check_arguments(root, inputs)
    calls: dict[str, list] = {}
    dynamo.reset()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            gm, _ = dynamo.export(root, tracing_mode="symbolic")(**samples)
    except Exception as exc:  # whatever the library's code raised: its line
        raise TraceFailure(exc, "dynamo", cls) from None
    finally:
        dynamo.reset()
    _eliminate_dead_code(root, gm)
    _probes_at_readers(root, gm)
    with _recording_calls(root, calls), torch.no_grad():
        root(**{k: v.clone() for k, v in samples.items()})
    names = {}
    for name, tensor in [*root.named_parameters(remove_duplicate=False),
                         *root.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    attributes = {}
    values = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            attributes[node.target] = names.get(id(value), None)
            values[node] = value
        else:
            values[node] = node.meta.get("example_value")
    ordered, placeholders = _placeholders(gm, inputs)
    _functional_calls(root, gm, calls)
    scope = _scopes(root, gm, calls, attributes)
    return Captured(gm, ordered, scope, values, attributes, placeholders)


def _check_arguments(root: nn.Module, inputs: Sequence[InputSpec]) -> None:
    params = inspect.signature(root.forward).parameters
    wanted = [n for n, p in params.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [n for n in wanted if params[n].default is inspect.Parameter.empty]
    check_placeholders(type(root).__name__, wanted, required, inputs)


def _placeholders(gm: fx.GraphModule, inputs: Sequence[InputSpec]
                  ) -> tuple[list[InputSpec], dict[fx.Node, str]]:
    """The inputs the graph reads, in its order, and the input each of its
    placeholders is (``l_kwargs_input_ids_``, ``l_x_``)."""
    by_name = {spec.name: spec for spec in inputs}
    ordered, names = [], {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = re.sub(r"^l_(kwargs_)?(.*)_$", r"\2", node.name)
            if name in by_name:
                ordered.append(by_name[name])
                names[node] = name
    used = {spec.name for spec in ordered}
    return ordered + [spec for spec in inputs if spec.name not in used], names


def _scopes(root: nn.Module, gm: fx.GraphModule, calls: dict, attributes: dict) -> Scope:
    """The tree of module calls (NOTE [Module hierarchy])."""
    top = Scope("", root, None)
    open_scopes: dict[str, Scope] = {}  # a stack entry's key -> its scope
    leaves: dict[str, LeafCall] = {}
    seen_calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).items())
        if node.op == "get_attr":
            stack = _owner_stack(root, stack, getattr(gm, node.target))
        scope = top
        for key, (where, cls) in stack:
            path = _path(where)
            if not path or not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                continue
            try:
                module = root.get_submodule(path)
            except AttributeError:
                continue  # a function dynamo lists on the stack (apply_rotary_pos_emb)
            last = scope.items[-1] if scope.items else None
            if is_leaf(type(module)) or library_leaf(type(module)):
                leaf = leaves.get(key)
                if leaf is None or leaf is not last:  # a new call
                    index = seen_calls.get(path, 0)
                    seen_calls[path] = index + 1
                    recorded = calls.get(path, [])
                    args, kwargs, output = (recorded[index] if index < len(recorded)
                                            else ((), {}, None))
                    leaf = leaves[key] = LeafCall(path, module, [], args, kwargs, output)
                    scope.items.append(leaf)
                leaf.nodes.append(node)
                break
            child = open_scopes.get(key)
            if child is None or child is not last:  # a new call
                index = seen_calls.get(path, 0)
                seen_calls[path] = index + 1
                recorded = calls.get(path, [])
                args, kwargs, _ = recorded[index] if index < len(recorded) else ((), {}, None)
                child = open_scopes[key] = Scope(path, module, scope, [], args, kwargs)
                scope.items.append(child)
            scope = child
        else:
            scope.items.append(node)
    return top


def _eliminate_dead_code(root: nn.Module, gm: fx.GraphModule) -> None:
    """The nodes no output needs removed (torch's bookkeeping, sizes read and
    dropped), but the calls of modules holding parameters whose result
    ``forward`` drops: PyTorch runs them (``BertModel``'s pooler, in a
    wrapper that reads only ``last_hidden_state``), and their layers keep
    the original's keys (:mod:`.scopes` writes them ``requires_grad:
    false``, since no gradient reaches them)."""
    nodes = list(gm.graph.nodes)
    live: set[fx.Node] = set()

    def keep(node: fx.Node) -> None:
        todo = [node]
        while todo:
            node = todo.pop()
            if node not in live:
                live.add(node)
                todo.extend(node.all_input_nodes)

    for node in nodes:
        if node.op in ("placeholder", "output") or node.is_impure() or writes_in_place(node):
            keep(node)
    calls: dict[str, list[fx.Node]] = {}  # a call's stack key -> its nodes
    for node in nodes:
        for key in node.meta.get("nn_module_stack") or {}:
            calls.setdefault(key, []).append(node)
    for key, members in calls.items():
        if any(m in live for m in members) or not any(
                m.op in ("call_function", "call_method", "call_module") for m in members):
            continue
        where, _ = members[0].meta["nn_module_stack"][key]
        try:
            module = root.get_submodule(_path(where))
        except AttributeError:
            continue
        if _path(where) and any(True for _ in module.parameters()):
            for member in members:
                keep(member)
    for node in reversed(nodes):  # users before what they read
        if node not in live:
            gm.graph.erase_node(node)


def _probes_at_readers(root: nn.Module, gm: fx.GraphModule) -> None:
    """A parameter first read where no module of the stack holds it, then by
    the module that does: its node moved to that reader, in its stack.

    ``self.dtype`` in a diffusers model's forward is its first parameter's
    dtype (``next(self.parameters()).dtype``): TorchDynamo folds the dtype to
    a constant but keeps the parameter's node, made at the probe, for the
    parameter's own read later (``conv_in``'s). The probe disappears; the
    read is the holder's. (``self.device`` likewise: placement decides.)"""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not node.users:
            continue
        tensor = getattr(gm, node.target)
        stack = list((node.meta.get("nn_module_stack") or {}).items())
        if holds(root, tensor) or _owner_stack(root, stack, tensor) is not stack:
            continue  # a module of its stack holds it
        reader = min(node.users, key=order.__getitem__)
        theirs = list((reader.meta.get("nn_module_stack") or {}).items())
        if theirs and _owner_stack(root, theirs, tensor) is not theirs:
            reader.prepend(node)
            node.meta["nn_module_stack"] = dict(reader.meta["nn_module_stack"])


def _functional_calls(root: nn.Module, gm: fx.GraphModule, calls: dict) -> None:
    """``F.linear(x, self.qkv.weight, self.qkv.bias)`` (torchvision's Swin
    attention) for an ``nn.Linear`` forward never calls: a call of that
    module, its nodes on its stack and the call's arguments stood in for
    by tensors of their shapes (what a leaf's layer is matched by)."""
    linears = {id(m.weight): (path, m) for path, m in root.named_modules()
               if type(m) is nn.Linear and path not in calls}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (F.linear, torch._C._nn.linear):
            continue
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            continue
        path, module = linears.get(id(getattr(gm, weight.target)), (None, None))
        params = [weight] + ([bias] if isinstance(bias, fx.Node) else [])
        if module is None or (module.bias is None) != (bias is None) or (
                bias is not None and (not isinstance(bias, fx.Node) or bias.op != "get_attr"
                                      or getattr(gm, bias.target) is not module.bias)) or any(
                len(p.users) != 1 for p in params):
            continue
        stack = dict(node.meta.get("nn_module_stack") or {})
        stack[f"functional {path}"] = (f"L['self'].{path}", nn.Linear)
        for item in (*params, node):
            node.prepend(item) if item is not node else None
            item.meta["nn_module_stack"] = dict(stack)
        x, out = node.args[0].meta.get("example_value"), node.meta.get("example_value")
        calls[path] = [((_stand_in(x),), {}, _stand_in(out))]


def _stand_in(value: torch.Tensor) -> torch.Tensor:
    return torch.zeros([s.node.hint if isinstance(s, torch.SymInt) else s for s in value.shape],
                       dtype=value.dtype)


def holds(module: nn.Module, tensor: torch.Tensor) -> Optional[str]:
    """The name under which ``module`` holds ``tensor`` itself, if it does."""
    for name, own in [*module.named_parameters(recurse=False),
                      *module.named_buffers(recurse=False)]:
        if own is tensor:
            return name
    return None


def _owner_stack(root: nn.Module, stack: list, tensor: torch.Tensor) -> list:
    """The stack of a parameter's node cut at the module that holds it (the
    deepest caller that does); empty for the model's own; as it is when no
    caller holds it (``self.out_proj.weight`` read in the caller's forward)."""
    for depth in range(len(stack), 0, -1):
        where = _path(stack[depth - 1][1][0])
        try:
            module = root.get_submodule(where) if where else root
        except AttributeError:
            continue
        if holds(module, tensor):
            return stack[:depth]
    return stack if not holds(root, tensor) else []


def sym_expression(value: Union[int, torch.SymInt], symbols: dict) -> Optional[str]:
    """A size as a spec expression, with each symbol (``s27``) read from a
    tensor in scope (``size(hidden_states, 1)``); None where one is not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    expr = value.node.expr
    return _sympy_text(expr, symbols)


def _sympy_text(expr: Any, symbols: dict) -> Optional[str]:
    import sympy  # noqa: PLC0415

    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod  # noqa: PLC0415

    def text(e: Any) -> Optional[str]:
        if isinstance(e, sympy.Integer):
            return str(int(e))
        if isinstance(e, sympy.Symbol):
            return symbols.get(str(e))
        if isinstance(e, FloorDiv):
            parts = [text(a) for a in e.args]
            return None if None in parts else f"({parts[0]}) // ({parts[1]})"
        if isinstance(e, (Mod, PythonMod, sympy.Mod)):  # padding to a multiple: (7 - w % 7) % 7
            parts = [text(a) for a in e.args]
            return None if None in parts else f"({parts[0]}) % ({parts[1]})"
        if isinstance(e, (sympy.Add, sympy.Mul)):
            parts = [text(a) for a in e.args]
            if None in parts:
                return None
            joiner = " + " if isinstance(e, sympy.Add) else " * "
            return "(" + joiner.join(parts) + ")"
        if isinstance(e, sympy.Pow) and isinstance(e.args[1], sympy.Integer) and e.args[1] > 0:
            base = text(e.args[0])
            return None if base is None else f"({base}) ** {int(e.args[1])}"
        return None

    result = text(expr)
    if result is not None and result.startswith("(") and _balanced(result[1:-1]):
        result = result[1:-1]
    return result


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0
