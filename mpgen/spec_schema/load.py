"""YAML -> plain data, with a source position for every node.

The spec is parsed with PyYAML's safe composer and converted by hand, so that
each mapping key and value keeps its line and column (the pydantic stage maps
a validation error's ``loc`` back through :class:`SourceMap`).

# NOTE: [What a spec may contain]
# A spec is data, never code: only plain scalars, sequences and mappings with
# string keys. Anchors/aliases (the "billion laughs" vector), merge keys,
# tags other than the standard scalar/sequence/mapping ones (``!!python/...``,
# ``!custom``, also on keys), values YAML would read as dates or sets, and
# duplicate keys are errors here, as is a file larger than MAX_BYTES or
# nested deeper than MAX_DEPTH (checked while composing, before PyYAML's
# recursive composer can overflow the stack).
#
# Numbers follow YAML 1.2, not PyYAML's YAML 1.1: ``3e-4`` is a float (YAML
# 1.1 reads it as a string, a classic trap for ``lr``), while ``1:30`` (a
# base-60 integer in YAML 1.1) and ``010`` (octal 8 in YAML 1.1) are strings,
# so a typo there is an error instead of a silently different number.
# Booleans keep YAML 1.1's ``yes``/``no``/``on``/``off``: reading ``bias: no``
# as the string "no" would make it true.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mpgen.errors import Collector, MpgenError, Position, shown
from mpgen.files import FileTooLarge, read_regular, reason

MAX_BYTES = 1 << 20
MAX_DEPTH = 64

YamlPath = tuple[str | int, ...]

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null")}
_INT = re.compile(r"""^(?:[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+
    |[-+]?0o[0-7_]+
    |[-+]?0b[01_]+)$""", re.X)
_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
#: What a value YAML resolves to a non-standard type reads as, for messages.
_IMPLICIT_KINDS = {_TAG + "timestamp": "a date", _TAG + "value": "a YAML value key",
                   _TAG + "merge": "a YAML merge key"}


class _SpecError(yaml.MarkedYAMLError):
    """A refusal of the spec loader (not a YAML syntax error)."""


class _Loader(yaml.SafeLoader):
    """Safe loader that refuses anchors and aliases and limits nesting."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_TAG + "int", _TAG + "float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _SpecError(
                problem=f"YAML aliases (*{event.anchor[:40]}) are not allowed in a spec; "
                "write the value out",
                problem_mark=event.start_mark,
            )
        if getattr(event, "anchor", None) is not None:
            raise _SpecError(
                problem=f"YAML anchors (&{event.anchor[:40]}) are not allowed in a spec; "
                "write the value out",
                problem_mark=event.start_mark,
            )
        if self._depth >= MAX_DEPTH:
            raise _SpecError(
                problem=f"spec is nested deeper than {MAX_DEPTH} levels",
                problem_mark=event.start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver(_TAG + "int", _INT, list("-+0123456789"))
_Loader.add_implicit_resolver(_TAG + "float", _FLOAT, list("-+0123456789."))


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
    loader = None
    try:
        loader = _Loader(text)
        node = loader.get_single_node()
    except yaml.reader.ReaderError as exc:
        raise MpgenError(_offset_position(text, exc.position, path),
                         f"invalid character {_char(exc.character)} in the spec") from None
    except _SpecError as exc:
        raise MpgenError(_mark_position(exc.problem_mark, path), exc.problem) from None
    except yaml.MarkedYAMLError as exc:
        pos, message = _describe_yaml_error(exc, path)
        raise MpgenError(pos, f"invalid YAML: {message}") from None
    except yaml.YAMLError as exc:
        raise MpgenError(Position(path, 1, 1), f"invalid YAML: {exc}") from None
    except RecursionError:  # MAX_DEPTH should make this unreachable
        raise MpgenError(Position(path, 1, 1),
                         f"spec is nested deeper than {MAX_DEPTH} levels") from None
    finally:
        if loader is not None:
            loader.dispose()
    if node is None or (node.tag == _TAG + "null" and isinstance(node, yaml.ScalarNode)):
        raise MpgenError(Position(path, 1, 1), "spec is empty")
    source = SourceMap(path)
    errors = Collector()
    data = _Converter(text, source, errors, loader).convert(node, ())
    errors.raise_if_any()
    return LoadedSpec(path, text, data, source)


def read_spec(path: str | Path) -> str:
    """The text of the spec file at ``path``: a regular file (a symbolic link
    to one is fine) of at most MAX_BYTES bytes of UTF-8, read without reading
    more (NOTE [Bounded reads] in ``mpgen/files.py``); else an
    :class:`MpgenError`."""
    name = str(path)
    try:
        raw = read_regular(path, MAX_BYTES)
    except FileTooLarge:
        raise MpgenError(Position(name, 1, 1), f"spec is larger than {MAX_BYTES} bytes") from None
    except OSError as exc:
        raise MpgenError(Position(name), f"cannot read spec: {reason(exc)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = raw.rfind(b"\n", 0, exc.start) + 1
        line = raw.count(b"\n", 0, exc.start) + 1
        col = len(raw[line_start:exc.start].decode("utf-8", "replace")) + 1
        raise MpgenError(Position(name, line, col), f"spec is not UTF-8: byte "
                         f"0x{raw[exc.start]:02x} here is not valid UTF-8 ({exc.reason}); "
                         "save the file as UTF-8") from None
    return text


def load_file(path: str | Path) -> LoadedSpec:
    """Read and parse a spec file; a missing file is an :class:`MpgenError`."""
    return load_text(read_spec(path), str(path))


# -- YAML syntax errors, in plain words -----------------------------------

def _mark_position(mark, path: str) -> Position:
    return Position(path, mark.line + 1, mark.column + 1) if mark else Position(path, 1, 1)


def _offset_position(text: str, offset: int, path: str) -> Position:
    line_start = text.rfind("\n", 0, offset) + 1
    return Position(path, text.count("\n", 0, offset) + 1, offset - line_start + 1)


def _char(code: int) -> str:
    return f"U+{code:04X}" + (f" ({chr(code)!r})" if chr(code).isprintable() else "")


def _describe_yaml_error(exc: yaml.MarkedYAMLError, path: str) -> tuple[Position, str]:
    """Where a YAML syntax error is, and what it means for a spec author."""
    problem = (exc.problem or "").strip()
    context = (exc.context or "").strip()
    pos = _mark_position(exc.problem_mark or exc.context_mark, path)
    ctx_pos = _mark_position(exc.context_mark, path) if exc.context_mark else None
    at_end = "<stream end>" in problem or "end of stream" in problem
    if context.startswith("while parsing a flow") and ctx_pos and problem.startswith(
            "expected ','") and (at_end or pos.line != ctx_pos.line):
        bracket = "[" if "sequence" in context else "{"
        closing = "]" if bracket == "[" else "}"
        if at_end:
            return ctx_pos, f"this {bracket!r} is never closed (expected {closing!r})"
        return ctx_pos, (f"this {bracket!r} is not closed: expected ',' or {closing!r} "
                         f"before line {pos.line}, column {pos.col}")
    if "quoted scalar" in context and at_end and ctx_pos:
        return ctx_pos, "this quoted string is never closed"
    if "'\\t'" in problem:
        return pos, "tab character; indent YAML with spaces, and separate values with spaces"
    if context == "expected a single document in the stream":
        return pos, "a spec is one YAML document, but a second one starts here"
    if problem == "mapping values are not allowed here":
        return pos, ("unexpected ':' (check the indentation of this line, or quote a value "
                     "that contains ': ')")
    if context == "while scanning a simple key" and ctx_pos:
        return ctx_pos, "expected 'key: value', but this line has no ':'"
    if problem.startswith("expected <block end>"):
        found = problem.split("but found", 1)[-1].strip()
        what = "this line" if found in ("'?'", "'-'", "'<block mapping start>'",
                                        "'<block sequence start>'") else found
        return pos, (f"{what} does not fit the structure above it "
                     "(check its indentation and the brackets before it)")
    if problem.endswith("that cannot start any token"):
        return pos, f"{problem}; put the value in quotes"
    message = problem or context or "invalid YAML"
    if context and problem and ctx_pos:
        message += f" ({context} at line {ctx_pos.line}, column {ctx_pos.col})"
    return pos, message


# -- nodes -> plain data ---------------------------------------------------

class _Converter:
    """Composed YAML nodes -> dicts, lists and scalars, recording positions."""

    def __init__(self, text: str, source: SourceMap, errors: Collector, loader) -> None:
        self.text = text
        self.source = source
        self.errors = errors
        self.loader = loader

    def pos(self, node: yaml.Node) -> Position:
        return Position(self.source.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def explicit_tag(self, node: yaml.Node) -> bool:
        """Was the node's tag written in the file (``!!x`` / ``!x``)?"""
        return self.text.startswith("!", node.start_mark.index)

    def tag_problem(self, node: yaml.Node) -> str | None:
        tag = node.tag
        if isinstance(node, yaml.ScalarNode):
            ok = tag in _SCALAR_TAGS
        elif isinstance(node, yaml.SequenceNode):
            ok = tag == _TAG + "seq"
        else:
            ok = tag == _TAG + "map"
        if ok:
            return None
        if not self.explicit_tag(node) and isinstance(node, yaml.ScalarNode):
            kind = _IMPLICIT_KINDS.get(tag, f"a YAML {tag.removeprefix(_TAG)}")
            return (f"{shown(node.value)} reads as {kind} in YAML; "
                    f"quote it ('{node.value}') to make it a string")
        return f"YAML tag {shown(tag.replace(_TAG, '!!'))} is not allowed in a spec"

    def convert(self, node: yaml.Node, path: YamlPath) -> Any:
        self.source.values[path] = self.pos(node)
        problem = self.tag_problem(node)
        if problem:
            self.errors.add(self.pos(node), problem)
            return None
        if isinstance(node, yaml.ScalarNode):
            try:
                return self.loader.construct_object(node, deep=True)
            except Exception:  # ``!!float x``, ``!!bool maybe``: the tag does not fit
                tag = node.tag.replace(_TAG, "!!")
                self.errors.add(self.pos(node), f"{shown(node.value)} is not a valid {tag} value")
                return None
        if isinstance(node, yaml.SequenceNode):
            return [self.convert(item, path + (i,)) for i, item in enumerate(node.value)]
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key_pos = self.pos(key_node)
            if key_node.tag == _TAG + "merge":
                self.errors.add(key_pos, "YAML merge keys (<<) are not allowed in a spec; "
                                "write the keys out")
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.errors.add(key_pos, "mapping keys must be plain names, not lists or "
                                "mappings")
                continue
            if self.explicit_tag(key_node):
                tag = key_node.tag.replace(_TAG, "!!")
                self.errors.add(key_pos, f"YAML tag {shown(tag)} is not allowed in a spec")
                continue
            key = key_node.value
            if key in result or path + (key,) in self.source.keys:
                first = self.source.keys[path + (key,)]
                self.errors.add(key_pos, f"duplicate key {shown(key)} (first defined at line "
                                f"{first.line}, column {first.col})")
                continue
            self.source.keys[path + (key,)] = key_pos
            result[key] = self.convert(value_node, path + (key,))
        return result
