"""Validate loaded YAML against the pydantic models, with positions.

A pydantic error's ``loc`` names model fields, which mostly follow the YAML;
:func:`_yaml_path` walks the loaded data along the ``loc`` and drops the
segments that exist only in the models (union tags, normalised forms), so the
error is reported at the node the user wrote.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from mpgen.errors import Collector, Position, did_you_mean, shown
from mpgen.spec_schema.load import LoadedSpec, YamlPath
from mpgen.spec_schema.models import FIELDS, Spec

_TYPE_MESSAGES = {
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "too_short": "must not be empty",
}

#: Fields that hold a name or a list of names (``outputs: head`` or ``[a, b]``).
_NAME_LISTS = {"in": "a layer name or a list of names",
               "outputs": "a layer name or a list of layer names",
               "inputs": "an input name or a list of names",
               "params": "a list of parameter names"}

#: What the mappings that are not model-checked elsewhere look like.
_MAPPINGS = {
    ("placement", "auto"): "a mapping like {devices: [cuda:0, cuda:1], balance: params}",
    ("train",): "a mapping of training settings, like {loss: MSELoss, steps: 100}",
    ("train", "dims"): "a mapping of symbolic dim -> size, like {seq: 128}",
}

#: Error types whose position is the mapping key, not its value.
_KEY_ERRORS = {"extra_forbidden", "kwarg_name"}


def validate(loaded: LoadedSpec) -> Spec:
    """The spec as pydantic models, or an error per problem, with positions."""
    try:
        return Spec.model_validate(loaded.data)
    except ValidationError as exc:
        errors = Collector()
        found: dict[YamlPath, dict] = {}
        for error in exc.errors():
            # The alternatives of one union fail together: report the node once.
            found.setdefault(_yaml_path(loaded.data, error["loc"]), error)
        for path, error in found.items():
            if error["type"] == "missing" and _misspelled(path, found):
                continue  # "unknown key 'shap' (did you mean 'shape'?)" says it all
            errors.add(*_describe(loaded, path, error))
        errors.raise_if_any()
        raise AssertionError("unreachable: validation failed without errors") from exc


def _yaml_path(data: Any, loc: tuple) -> YamlPath:
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            path.append(part)
            node = node[part]
        elif _model_only(tuple(path), node, part):
            continue
        elif isinstance(node, (dict, list)) or node is None:
            path.append(part)  # a missing key: report it at its parent
            node = None
        else:
            break
    return tuple(path)


def _misspelled(missing: YamlPath, found: dict[YamlPath, dict]) -> bool:
    """Is the missing key suggested for an unknown key next to it?"""
    parent, key = missing[:-1], str(missing[-1])
    allowed = _fields_at(parent)
    return any(
        error["type"] == "extra_forbidden" and path[:-1] == parent
        and did_you_mean(str(path[-1]), allowed) == f" (did you mean {key!r}?)"
        for path, error in found.items()
    )


def _model_only(path: YamlPath, node: Any, part: Any) -> bool:
    """Is ``part`` a ``loc`` segment the YAML does not have at ``path``?"""
    if part == "explicit":  # placement: {layer: device} is PlacementSpec.explicit
        return path == ("placement",)
    if part == "shape":  # inputs: {x: [batch, 10]} is InputSpec(shape=...)
        return isinstance(node, list)
    if part in ("one", "each"):  # the two forms of train.loss
        return path == ("train", "loss")
    return part in ("[key]", "function-after[check_device(), any]")


def _describe(loaded: LoadedSpec, path: YamlPath, error: dict) -> tuple[Position, str]:
    source = loaded.source
    kind = error["type"]
    if kind == "extra_forbidden":
        key = str(path[-1])
        allowed = _fields_at(path[:-1])
        hint = did_you_mean(key, allowed)
        if not hint and allowed:
            hint = f" (expected one of: {', '.join(allowed)})"
        return source.key(path), f"unknown key {shown(key)} in {_label(path[:-1])}{hint}"
    if kind == "missing":
        key = str(path[-1])
        return source.value(path[:-1]), f"missing required key {shown(key)} in {_label(path[:-1])}"
    if kind in _KEY_ERRORS:  # the message names the key
        return source.key(path), f"{_label(path[:-1])}: {error['msg']}"
    pos = source.value(path)
    label = _label(path)
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return pos, f"{label}: expected {expected}, got {shown(error.get('input'))}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        message = error["msg"].replace("Input should be", "must be")
        return pos, f"{label}: {message}{_got(error)}"
    if path and path[-1] in _NAME_LISTS and kind in ("list_type", "string_type"):
        return pos, f"{label}: expected {_NAME_LISTS[path[-1]]}"
    if kind == "string_type" and len(path) >= 2 and path[-2] in _NAME_LISTS:
        return pos, f"{label}: expected a name, got {shown(error.get('input'))}"
    if kind in ("model_type", "dict_type") and not path:
        got = type(error.get("input")).__name__
        got = {"list": "a list", "str": "a string", "int": "a number", "float": "a number",
               "bool": "a boolean"}.get(got, got)
        return pos, (f"a spec is a mapping with the keys mpgen, name, inputs and layers, "
                     f"but this file holds {got}")
    if kind in ("model_type", "dict_type") and path in _MAPPINGS:
        return pos, f"{label}: expected {_MAPPINGS[path]}"
    if kind in _TYPE_MESSAGES:
        return pos, f"{label}: {_TYPE_MESSAGES[kind]}{_got(error)}"
    return pos, f"{label}: {error['msg']}"


def _got(error: dict) -> str:
    """``, got 1.5`` for a scalar input (a list or mapping is not shown)."""
    value = error.get("input")
    if value is None or isinstance(value, (bool, int, float, str)):
        return f", got {shown(value)}"
    return ""


def _label(path: YamlPath) -> str:
    """The node at ``path`` in the spec's own terms: ``layer 'fc1' of block 'B': args[0]``."""
    if not path:
        return "spec"
    head, rest = path[0], list(path[1:])
    if head == "layers" and rest:
        owner = f"layer {shown(rest.pop(0))}"
    elif head == "blocks" and len(rest) >= 3 and rest[1] == "layers":
        block, _, layer = rest[:3]
        owner, rest = f"layer {shown(layer)} of block {shown(block)}", rest[3:]
    elif head == "blocks" and rest:
        owner = f"block {shown(rest.pop(0))}"
    elif head == "inputs" and rest:
        owner = f"input {shown(rest.pop(0))}"
        rest = [p for p in rest if p != "shape" and not isinstance(p, int)]
    elif head == "placement" and rest and rest[0] != "auto":
        owner = f"placement of {shown(rest.pop(0))}"
    else:
        return _dotted([head, *rest])
    text = _dotted(rest)
    return f"{owner}: {text}" if text else owner


def _dotted(parts: list) -> str:
    """``train.dims.seq``, ``args[0]``, ``capacity['cuda:0']``."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif str(part).isidentifier():
            text += f".{part}"
        else:
            text += f"[{shown(part)}]"
    return text.lstrip(".")


def _fields_at(path: YamlPath) -> list[str]:
    """The keys allowed in the mapping at ``path`` (for did-you-mean)."""
    if not path:
        return FIELDS["Spec"]
    if len(path) == 2 and path[0] in ("inputs", "blocks"):
        return FIELDS["InputSpec" if path[0] == "inputs" else "BlockSpec"]
    if path == ("placement", "auto"):
        return FIELDS["AutoPlacementSpec"]
    if path == ("placement",):  # with auto, nothing else
        return ["auto"]
    if path == ("train",):
        return FIELDS["TrainSpec"]
    if path == ("pipeline",):
        return FIELDS["PipelineSpec"]
    return []
