"""YAML -> plain data, with a source position for every node.

The spec is parsed with PyYAML's safe composer and converted by hand, so that
each mapping key and value keeps its line and column (the pydantic stage maps
a validation error's ``loc`` back through :class:`SourceMap`).

# NOTE: [What a spec may contain]
# A spec is data, never code: only plain scalars, sequences and mappings with
# string keys. Anchors/aliases (the "billion laughs" vector), merge keys,
# custom tags and duplicate keys are errors here, as is a file larger than
# MAX_BYTES or nested deeper than MAX_DEPTH. Plain scalars like ``3e-4`` are
# floats (YAML 1.1 would read them as strings, a classic trap for ``lr``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mpgen.errors import Collector, MpgenError, Position

MAX_BYTES = 1 << 20
MAX_DEPTH = 64

YamlPath = tuple[str | int, ...]

_STANDARD_TAGS = {
    "tag:yaml.org,2002:" + t
    for t in ("str", "int", "float", "bool", "null", "seq", "map")
}


class _Loader(yaml.SafeLoader):
    """Safe loader that refuses anchors and aliases while composing."""

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.MarkedYAMLError(
                problem="YAML aliases (*name) are not allowed in a spec",
                problem_mark=event.start_mark,
            )
        if getattr(event, "anchor", None) is not None:
            raise yaml.MarkedYAMLError(
                problem="YAML anchors (&name) are not allowed in a spec",
                problem_mark=event.start_mark,
            )
        return super().compose_node(parent, index)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass
class SourceMap:
    """Positions of a loaded spec's nodes, keyed by their path in the data."""

    file: str
    values: dict[YamlPath, Position] = field(default_factory=dict)
    keys: dict[YamlPath, Position] = field(default_factory=dict)

    def value(self, path: YamlPath) -> Position:
        """Position of the value at ``path`` (or of its nearest ancestor)."""
        for end in range(len(path), -1, -1):
            pos = self.values.get(tuple(path[:end]))
            if pos is not None:
                return pos
        return Position(self.file, 1, 1)

    def key(self, path: YamlPath) -> Position:
        """Position of the mapping key that holds ``path``."""
        return self.keys.get(tuple(path)) or self.value(path)


@dataclass
class LoadedSpec:
    """A spec file's data plus where each part of it was written."""

    path: str
    text: str
    data: Any
    source: SourceMap


def load_text(text: str, path: str) -> LoadedSpec:
    """Parse ``text`` (the content of the spec at ``path``)."""
    if len(text.encode("utf-8", "surrogateescape")) > MAX_BYTES:
        raise MpgenError(Position(path, 1, 1), f"spec is larger than {MAX_BYTES} bytes")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        pos = Position(path, mark.line + 1, mark.column + 1) if mark else Position(path)
        problem = exc.problem or exc.context or "invalid YAML"
        raise MpgenError(pos, f"invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise MpgenError(Position(path, 1, 1), f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if node is None:
        raise MpgenError(Position(path, 1, 1), "spec is empty")
    source = SourceMap(path)
    errors = Collector()
    data = _convert(node, (), source, errors, loader, depth=0)
    errors.raise_if_any()
    return LoadedSpec(path, text, data, source)


def load_file(path: str | Path) -> LoadedSpec:
    """Read and parse a spec file; a missing file is an :class:`MpgenError`."""
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise MpgenError(Position(name), f"cannot read spec: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise MpgenError(Position(name, 1, 1), f"spec is larger than {MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MpgenError(Position(name, 1, 1), f"spec is not UTF-8 ({exc.reason})") from None
    return load_text(text, name)


def _pos(source: SourceMap, node: yaml.Node) -> Position:
    return Position(source.file, node.start_mark.line + 1, node.start_mark.column + 1)


def _convert(node, path, source, errors, loader, depth):
    source.values[path] = _pos(source, node)
    if depth > MAX_DEPTH:
        errors.add(_pos(source, node), f"spec is nested deeper than {MAX_DEPTH} levels")
        return None
    if node.tag not in _STANDARD_TAGS:
        errors.add(_pos(source, node), f"YAML tag {node.tag!r} is not allowed in a spec")
        return None
    if isinstance(node, yaml.ScalarNode):
        try:
            return loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            errors.add(_pos(source, node), f"invalid value: {exc}")
            return None
    if isinstance(node, yaml.SequenceNode):
        return [
            _convert(item, path + (i,), source, errors, loader, depth + 1)
            for i, item in enumerate(node.value)
        ]
    result: dict[str, Any] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            errors.add(_pos(source, key_node), "mapping keys must be plain names")
            continue
        key = key_node.value
        if key in result:
            first = source.keys[path + (key,)]
            errors.add(
                _pos(source, key_node),
                f"duplicate key {key!r} (first defined at line {first.line})",
            )
            continue
        source.keys[path + (key,)] = _pos(source, key_node)
        result[key] = _convert(value_node, path + (key,), source, errors, loader, depth + 1)
    return result
