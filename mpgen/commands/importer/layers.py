"""The spec ``mpgen import`` builds: its layers, what they read, and each
layer's line in the spec (the blocks are compared by it and :mod:`.emit`
writes it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch.fx as fx
import yaml
from torch import nn

from mpgen.errors import MpgenError


#: Ops whose layer is a tensor of its own (no ``in:``).
TENSOR_OPS = frozenset({"Parameter", "Buffer"})


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
                repr(sorted(self.call.items()) if self.call else self.call), frozen(self))


def frozen(layer: Layer) -> bool:
    """Whether a module layer's parameters are all frozen (``requires_grad=False``:
    ``requires_grad: false`` on its line). A torch.nn module freezing some of its
    parameters alone is refused: a spec freezes whole layers."""
    params = dict(layer.module.named_parameters()) if layer.module is not None else {}
    still = [name for name, p in params.items() if not p.requires_grad]
    if not still or len(still) == len(params):
        return bool(still)
    if type(layer.module).__module__.startswith("torch."):
        trains = [name for name in params if name not in still]
        raise MpgenError(None, f"layer {layer.name!r}: {layer.op} trains {', '.join(trains)} "
                         f"but not {', '.join(still)} (requires_grad=False), which a spec "
                         "cannot write: requires_grad: false freezes a whole layer")
    return False  # a block: its layers say which of them are frozen


def swap(value: Any, names: dict[str, str]) -> Any:
    """``value`` with each value name in ``names`` replaced, in expressions too."""
    if isinstance(value, list):
        return [swap(v, names) for v in value]
    if isinstance(value, dict):
        return {k: swap(v, names) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("="):
        return re.sub(r"size\((\w+),", lambda m: f"size({names.get(m[1], m[1])},", value)
    return names.get(value, value) if isinstance(value, str) else value


def rename_reads(layer: Layer, names: dict[str, str]) -> None:
    """Every value ``layer`` reads renamed by ``names``."""
    layer.inputs = swap(layer.inputs, names)
    layer.keyword_inputs = swap(layer.keyword_inputs, names)
    layer.reads = swap(layer.reads, names)
    layer.args, layer.kwargs, layer.call = (swap(layer.args, names),
                                            swap(layer.kwargs, names),
                                            swap(layer.call, names))


def flat(ref: Any) -> list:
    """The names in a ref, nested tuples flattened."""
    if isinstance(ref, list):
        return [x for r in ref for x in flat(r)]
    return [ref]


# -- a layer's line in the spec ------------------------------------------------------

def scalar(value: Any) -> str:
    """``value`` in YAML's flow style, on one line."""
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
        return "{" + ", ".join(f"{k}: {scalar(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(scalar(v) for v in value) + "]"


def _element_names(elements: list, names: Optional[dict] = None) -> list:
    names = names or {}
    return [_element_names(e, names) if isinstance(e, list)
            else names.get(e.name, e.name) if e.name else "_" for e in elements]


def layer_lines(layers: list[Layer], first_input: str,
                names: Optional[dict] = None) -> list[str]:
    """The ``layers:`` entries; ``in:`` is left out where it is the default."""
    lines, previous = [], first_input
    for layer in layers:
        lines.append(_layer_line(layer, previous, names))
        if layer.call is not False:  # a held layer has no value: the next reads the one before
            previous = layer.name if layer.elements is None else None
    return lines


def _layer_line(layer: Layer, default_input: Optional[str],
                names: Optional[dict] = None) -> str:
    fields: dict[str, Any] = {"op": layer.op}
    items: list = list(layer.inputs)
    if layer.keyword_inputs:
        items.append(dict(layer.keyword_inputs))
    if layer.op in TENSOR_OPS or layer.call is False:
        pass  # a tensor of the layer's own, or a module forward never calls, reads nothing
    elif layer.factory:
        fields["in"] = []
    elif items != [default_input] or default_input is None:
        fields["in"] = items[0] if len(items) == 1 and isinstance(items[0], str) else items
    if layer.args:
        fields["args"] = layer.args
    fields.update(layer.kwargs)
    if layer.call or layer.call is False:  # call: false: held, never called
        fields["call"] = layer.call
    if layer.elements is not None:
        fields["outputs"] = _element_names(layer.elements, names)
    if layer.repeat > 1:
        fields["repeat"] = layer.repeat
    if layer.tie:
        fields["tie"] = layer.tie
    if layer.op not in TENSOR_OPS and frozen(layer):
        fields["requires_grad"] = False
    return f"  {layer.name}: {scalar(fields)}"
