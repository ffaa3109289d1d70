"""Validate loaded YAML against the pydantic models, with positions.

A pydantic error's ``loc`` names model fields, which mostly follow the YAML;
:func:`_yaml_path` walks the loaded data along the ``loc`` and drops the
segments that exist only in the models (union tags, normalised forms), so the
error is reported at the node the user wrote.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from mpgen.errors import Collector, Position, did_you_mean
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


def validate(loaded: LoadedSpec) -> Spec:
    """The spec as pydantic models, or an error per problem, with positions."""
    try:
        return Spec.model_validate(loaded.data)
    except ValidationError as exc:
        errors = Collector()
        seen: set[tuple[YamlPath, str]] = set()
        for error in exc.errors():
            path = _yaml_path(loaded.data, error["loc"])
            pos, message = _describe(loaded, path, error)
            if (path, message) not in seen:
                seen.add((path, message))
                errors.add(pos, message)
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
        elif isinstance(node, (dict, list)) or node is None:
            # Model-only segment (``explicit``, a union tag, ``shape`` of
            # the short input form): skip it, keep walking.
            if part in ("explicit", "shape", "one", "each"):
                continue
            path.append(part)
            node = None
        else:
            break
    return tuple(path)


def _describe(loaded: LoadedSpec, path: YamlPath, error: dict) -> tuple[Position, str]:
    source = loaded.source
    kind = error["type"]
    where = _where(path[:-1]) if path else "spec"
    if kind == "extra_forbidden":
        key = str(path[-1])
        hint = did_you_mean(key, _fields_at(path[:-1]))
        return source.key(path), f"unknown key {key!r} in {where}{hint}"
    if kind == "missing":
        key = str(path[-1])
        parent = path[:-1]
        return source.value(parent), f"missing required key {key!r} in {where}"
    field = ".".join(str(p) for p in path) or "spec"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return source.value(path), f"{field}: expected {expected}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return source.value(path), f"{field}: {error['msg'].replace('Input should be', 'must be')}"
    if path and path[-1] == "in" and kind in ("list_type", "string_type"):
        return source.value(path), f"{field}: expected a layer name or a list of names"
    message = _TYPE_MESSAGES.get(kind, error["msg"])
    return source.value(path), f"{field}: {message}"


def _where(path: YamlPath) -> str:
    if not path:
        return "spec"
    if len(path) == 2 and path[0] in ("layers", "inputs", "blocks"):
        return f"{path[0][:-1]} {path[1]!r}"
    if len(path) == 4 and path[0] == "blocks" and path[2] == "layers":
        return f"layer {path[3]!r} of block {path[1]!r}"
    return ".".join(str(p) for p in path)


def _fields_at(path: YamlPath) -> list[str]:
    """The keys allowed in the mapping at ``path`` (for did-you-mean)."""
    if not path:
        return FIELDS["Spec"]
    if len(path) == 2 and path[0] in ("inputs", "blocks"):
        return FIELDS["InputSpec" if path[0] == "inputs" else "BlockSpec"]
    if path == ("placement", "auto"):
        return FIELDS["AutoPlacementSpec"]
    if path == ("train",):
        return FIELDS["TrainSpec"]
    return []
