"""``mpgen place``: show a spec's layout in the explicit form, or write it back.

# NOTE: [Writing the placement back]
# ``mpgen place`` prints every layer, a repeated layer's instances compressed
# to ranges per device (``h.0-5: cuda:1``): a view of where everything is.
# ``--write`` writes the shortest explicit form that gives the same layout
# (``shortest_entries``), so that the spec's own diff shows the move and not a
# listing of every layer. Explicit entries are bookmarks: a named unit takes
# the entry's device and the units after it keep it, those before the first
# entry take the first entry's device. One entry per device run is therefore
# both necessary (a run's first unit differs from the unit before it, so it
# must be named; the first run needs some entry, or it would take the second
# run's device) and enough; the default (no entries) is shorter still when
# every unit is on cuda:0. Among the shortest forms the one closest to the
# spec's current block is written: an old key that still names units of one
# run only (its first unit, for every run but the first) is kept, with the
# same device where it still holds, so an unchanged entry is an unchanged
# line. Otherwise a run is named from its first unit to the end of that
# layer's part of the run (``h.6-11``, or ``h`` for all of a layer). The
# entries are resolved again by the compiler's own explicit resolver and
# must give every unit its device (an internal error otherwise), and the
# rewritten text is compiled before it replaces the file.
#
# The new block is spliced into the file's text in place of the old one,
# using the positions PyYAML gives for the ``placement`` key and the last
# token of its value: every byte outside that range is kept (comments, blank
# lines, flow mappings, quoting, line endings), which a YAML round trip
# (ruamel.yaml included) does not promise for reflowed flow mappings. An
# automatic block is kept above the new entries as comments, so the settings
# it was chosen from stay in the file. In an explicit block the comments of a
# kept key stay with it (the lines above its entry and the comment after it);
# those above an entry that goes move down to the next one kept. Two comment
# lines say how the layout was chosen and how the form was (a later --write
# replaces them).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import yaml

from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.compiler.ir import (
    ExplicitPlacement,
    Graph,
    PlacementEntry,
    UnitRange,
    device_runs,
    unit_labels,
)
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.placement.auto import BALANCE_UNITS
from mpgen.compiler.placement.devices import DEFAULT_DEVICE
from mpgen.compiler.placement.explicit import place_explicit
from mpgen.errors import MpgenError, Position
from mpgen.files import reason
from mpgen.spec_schema.load import read_spec


@dataclass(frozen=True)
class Placed:
    """The layout of one spec, in the explicit form."""

    graph: Graph
    entries: tuple[tuple[str, str], ...]  # key -> device, in layers order
    how: str  # one line: how the layout was chosen
    auto: bool
    bottleneck: str = ""  # automatic: "bottleneck 42,527,232 parameters on cuda:1"
    renamed: str = ""  # "devices renamed by --device-map cuda:1=cuda:0"
    root: str | Path | None = None  # the project it was compiled in (``compile_spec``)
    time_limit: Optional[float] = DEFAULT_TIME_LIMIT  # and the analysis budget
    shortest: tuple[tuple[str, str], ...] = ()  # what --write writes (``shortest_entries``)
    kept: int = 0  # how many of its keys the spec's current block already has

    def block(self, indent: str = "  ", newline: str = "\n") -> str:
        """The ``placement:`` block in the explicit form (without a final newline)."""
        return newline.join(["placement:", *_entry_lines(self.entries, indent)])


def explicit_entries(graph: Graph) -> list[tuple[str, str]]:
    """Every layer -> device; a repeated layer's instances as ranges per device."""
    return [(unit_labels([node.unit(k) for k in range(start, stop)], graph.repeats,
                         whole=True)[0], device)
            for node in graph.nodes for start, stop, device in device_runs(node.devices)]


def shortest_entries(graph: Graph, current: Sequence[tuple[str, str]] = ()
                     ) -> list[tuple[str, str]]:
    """The fewest explicit entries (key, device) that give ``graph``'s devices.

    One bookmark per device run, none when every unit is on the default
    device; among those, the keys of ``current`` (the spec's block, as key ->
    device) where they fit (NOTE [Writing the placement back]). Raises
    :class:`MpgenError` (an internal error) if the entries do not resolve to
    the same devices.
    """
    units = [(node, k) for node in graph.nodes for k in range(node.instances)]
    runs = device_runs([node.devices[k] for node, k in units])
    if len(runs) == 1 and runs[0][2] == DEFAULT_DEVICE:
        return []
    position = {node.unit(k): i for i, (node, k) in enumerate(units)}
    spans = [(key, device, span) for key, device in current
             if (span := _span(graph, key, position)) is not None]
    entries = []
    for r, (start, stop, device) in enumerate(runs):
        fits = [(key, old) for key, old, (lo, hi) in spans
                if start <= lo and hi < stop and (r == 0 or lo == start)]
        key = next((k for k, old in fits if old == device), fits[0][0] if fits else None)
        if key is None:
            node, first = units[start]
            last = min(node.instances, first + stop - start)
            key = unit_labels([node.unit(k) for k in range(first, last)], graph.repeats,
                              whole=True)[0]
        entries.append((key, device))
    _check_resolves(graph, entries)
    return entries


def _span(graph: Graph, key: str, position: Mapping) -> Optional[tuple[int, int]]:
    """The first and last unit positions a placement key names (None: none)."""
    label = UnitRange.parse(key)
    if label is None or label.node not in graph.repeats:
        return None
    node = graph.node(label.node)
    if label.first is None:
        first, last = 0, node.instances - 1
    elif node.repeat and label.first <= label.last < node.repeat:
        first, last = label.first, label.last
    else:
        return None
    return position[node.unit(first)], position[node.unit(last)]


def _check_resolves(graph: Graph, entries: Sequence[tuple[str, str]]) -> None:
    """Resolve ``entries`` as the compiler does; they must give every unit its device."""
    where = Position("<mpgen place --write>")
    request = ExplicitPlacement(tuple(PlacementEntry(k, d, where) for k, d in entries))
    got = [n.devices for n in place_explicit(graph, request).nodes]
    if got != [n.devices for n in graph.nodes]:  # pragma: no cover - a bug in mpgen
        raise MpgenError(where, "internal error: the shortest placement form "
                         f"{dict(entries)} does not reproduce the layout")


def place(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
          root: str | Path | None = None,
          time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Placed:
    """Compile the spec and return its layout in the explicit form."""
    graph = compile_spec(path, device_map, root, time_limit)
    auto = graph.layout.method == "auto"
    bottleneck = renamed = ""
    if auto:
        choice = graph.layout.auto
        value = choice.split.bottleneck
        amount = f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"
        bottleneck = (f"bottleneck {amount} {BALANCE_UNITS[choice.request.balance]} on "
                      f"{choice.bottleneck_device}")
        how = (f"chosen automatically (balance {choice.request.balance} over "
               f"{', '.join(choice.devices)}); {bottleneck}")
    elif graph.layout.method == "explicit":
        how = "explicit in the spec"
    else:
        how = "the default: no placement, everything on cuda:0"
    if device_map:
        renamed = "devices renamed by --device-map " + ",".join(
            f"{k}={v}" for k, v in sorted(device_map.items()))
        how += f"; {renamed}"
    request = graph.placement
    current = ([(e.key, e.device) for e in request.entries]
               if isinstance(request, ExplicitPlacement) else [])
    shortest = shortest_entries(graph, current)
    kept = len({key for key, _ in shortest} & {key for key, _ in current})
    return Placed(graph, tuple(explicit_entries(graph)), how, auto, bottleneck, renamed, root,
                  time_limit, tuple(shortest), kept)


def write_placement(path: str | Path, placed: Placed) -> bool:
    """Rewrite ``path``'s placement block into ``placed``'s shortest explicit form.

    Returns False when there is nothing to change: a spec built without a
    device map whose layout is not automatic (explicit, or the default) already
    says what it gives. Every line outside the placement block is kept byte for
    byte; the new text is compiled and checked before it is written.
    A symbolic link is written through (its target changes, the link stays);
    the file keeps its mode and is replaced in one rename; a read-only spec
    or folder is an :class:`MpgenError`.
    """
    text = read_spec(path)
    if not placed.auto and not placed.graph.device_map:
        return False  # already explicit (or the default): the spec's own spelling stays
    new_text = rewrite_text(text, placed, str(path))
    if new_text == text:
        return False
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat()
    except OSError as exc:
        raise MpgenError(Position(str(path)), f"cannot rewrite the spec: {reason(exc)}") from None
    if not (mode.st_mode & 0o222 and os.access(target, os.W_OK)):
        raise MpgenError(Position(str(path)), "cannot rewrite the spec: it is read-only "
                         f"(mode {stat.S_IMODE(mode.st_mode):04o}); make it writable first")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:100]}.", suffix=".tmp",
                                   dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new_text)
            f.flush()
            os.fsync(f.fileno())
        graph = compile_spec(tmp, root=placed.root, time_limit=placed.time_limit)
        got = [(n.name, n.devices) for n in graph.nodes]
        want = [(n.name, n.devices) for n in placed.graph.nodes]
        if got != want:  # pragma: no cover - a bug in mpgen, never a user mistake
            raise MpgenError(Position(str(path), 1, 1), "internal error: the rewritten placement "
                             "does not reproduce the layout; the spec was not changed")
        os.chmod(tmp, stat.S_IMODE(mode.st_mode))
        with contextlib.suppress(OSError):  # only root may give a file away
            os.chown(tmp, mode.st_uid, mode.st_gid)
        os.replace(tmp, target)
    except OSError as exc:
        where = f"writing in {target.parent}" if tmp is None else f"replacing {target}"
        raise MpgenError(Position(str(path)), f"cannot rewrite the spec: {reason(exc)} "
                         f"({where}); the spec was not changed") from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
    return True


def rewrite_text(text: str, placed: Placed, name: str = "spec.yaml") -> str:
    """``text`` with its placement block replaced by ``placed``'s shortest explicit form."""
    newline = "\r\n" if "\r\n" in text else "\n"
    found = _find_placement(text, name)
    indent = _indent(text, found)
    if found is None:
        if not placed.shortest:  # the default: no block is the shortest form
            return text
        block = newline.join(["placement:", *_written_lines(placed, indent, [], _Comments())])
        sep = "" if not text or text.endswith("\n") else newline
        return f"{text}{sep}{newline}{block}{newline}"
    key, value = found
    start = text.rfind("\n", 0, key.start_mark.index) + 1
    if text[start:key.start_mark.index].strip():
        raise MpgenError(_pos(name, key), "placement: cannot rewrite a placement key that does "
                         "not start its line; write the explicit form by hand")
    content_end = _content_end(value)
    end = _line_end(text, content_end)
    rest = text[content_end:end].strip()
    if rest and not rest.startswith("#"):
        raise MpgenError(_pos(name, key), "placement: cannot rewrite the placement block: "
                         "other content follows it on its last line")
    key_line_end = _line_end(text, key.start_mark.index)
    colon = text[start:key.end_mark.index] + (": {}" if not placed.shortest else ":")
    if value.start_mark.index >= key_line_end:  # the value starts on a later line
        first = colon + text[key.end_mark.index:key_line_end].split(":", 1)[1]
        old = text[key_line_end:end].lstrip("\r\n")
    else:
        first = colon
        old = text[value.start_mark.index:end]
    old_lines = _dedent(old.splitlines()) if placed.auto else []
    comments = _Comments() if placed.auto else _old_comments(text, key, value, content_end)
    block = newline.join([first, *_written_lines(placed, indent, old_lines, comments)])
    return text[:start] + block + text[end:]


#: The first words of the two comment lines ``--write`` puts above the entries.
_OUR_COMMENTS = ("# mpgen place --write:", "# shortest form:")


@dataclass(frozen=True)
class _Comments:
    """The comments of an explicit block: the lines above each entry (by its
    key, in the block's order) and the comment after it on its line. Those
    below the last entry are outside the block, and stay where they are."""

    above: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    after: Mapping[str, str] = field(default_factory=dict)


def _old_comments(text: str, key, value, content_end: int) -> _Comments:
    """The comments of a block-style explicit placement, to keep with the keys
    ``--write`` keeps; a comment above an entry whose key goes moves down to
    the next one kept (``--write``'s own two lines are written afresh)."""
    if not isinstance(value, yaml.MappingNode) or value.flow_style:
        return _Comments()
    entries = {k.start_mark.line: (k.value, v) for k, v in value.value}
    lines = text.splitlines()
    last = text.count("\n", 0, content_end)
    above: dict[str, tuple[str, ...]] = {}
    after: dict[str, str] = {}
    pending: list[str] = []
    for number in range(key.start_mark.line + 1, last + 1):
        line = lines[number].strip()
        if number in entries:
            name, node = entries[number]
            above[name] = tuple(pending)
            pending = []
            if node.end_mark.line == number:
                rest = text[node.end_mark.index:_line_end(text, node.end_mark.index)]
                if rest.strip().startswith("#"):
                    after[name] = rest.rstrip()
        elif line.startswith("#") and not line.startswith(_OUR_COMMENTS):
            pending.append(line)
    return _Comments(above, after)


def _entry_lines(entries: Sequence[tuple[str, str]], indent: str) -> list[str]:
    return [f"{indent}{_yaml_key(key)}: {device}" for key, device in entries]


def _written_lines(placed: Placed, indent: str, old_lines: list[str],
                   comments: _Comments) -> list[str]:
    """The comment saying how the layout and its form were chosen, then the
    entries with the old block's comments of the keys kept."""
    origin = placed.graph.layout.method
    notes = [n for n in (placed.bottleneck, placed.renamed) if n]
    if placed.auto:
        choice = placed.graph.layout.auto
        notes.insert(0, f"balance {choice.request.balance} over {len(choice.devices)} devices")
    n = len(placed.shortest)
    if n == 0:
        form = f"the default (no entries: every layer on {DEFAULT_DEVICE})"
    else:
        form = f"{n} bookmark{'s' if n > 1 else ''}, one per device run"
        if placed.kept:
            form += f", keeping {placed.kept} key{'s' if placed.kept > 1 else ''} of the old block"
    replaced = placed.auto and old_lines
    lines = [f"{_OUR_COMMENTS[0]} {origin}" + (f" ({'; '.join(notes)})" if notes else "") + ",",
             f"{_OUR_COMMENTS[1]} {form}" + ("; it replaced:" if replaced else "")]
    if replaced:
        lines.extend(f"#   {line}".rstrip() for line in old_lines)
    kept = {key for key, _ in placed.shortest}
    above: dict[str, list[str]] = {}
    carried: list[str] = []  # the comments above entries that go, for the next one kept
    for key, comment_lines in comments.above.items():
        carried.extend(comment_lines)
        if key in kept:
            above[key], carried = carried, []
    for (key, _), entry in zip(placed.shortest, _entry_lines(placed.shortest, "")):
        lines.extend(above.get(key, ()))
        lines.append(entry + comments.after.get(key, ""))
    lines.extend(carried)
    return [f"{indent}{line}" for line in lines]


def _yaml_key(key: str) -> str:
    try:
        plain = yaml.safe_load(f"{key}: x")
    except yaml.YAMLError:
        plain = None
    if isinstance(plain, dict) and list(plain) == [key]:
        return key
    return "'" + key.replace("'", "''") + "'"


def _find_placement(text: str, name: str):
    """``(key node, value node)`` of the top-level ``placement``, or None."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:  # compile_spec has read it: not expected
        raise MpgenError(Position(name, 1, 1), f"invalid YAML: {exc}") from None
    if not isinstance(root, yaml.MappingNode):
        raise MpgenError(Position(name, 1, 1), "spec is not a mapping")
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "placement":
            if root.flow_style:
                raise MpgenError(_pos(name, key), "placement: cannot rewrite a spec written as "
                                 "one flow mapping ({...}); write the explicit form by hand")
            return key, value
    if root.flow_style:
        raise MpgenError(Position(name, 1, 1), "placement: cannot add a block to a spec written "
                         "as one flow mapping ({...}); write the explicit form by hand")
    return None


def _content_end(node) -> int:
    """Index just after the last character of ``node``'s own text."""
    if isinstance(node, yaml.ScalarNode) or node.flow_style:
        return node.end_mark.index
    children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else list(node.value))
    return max((_content_end(c) for c in children), default=node.start_mark.index)


def _line_end(text: str, index: int) -> int:
    """Index of the end of the line holding ``index`` (before its \\r\\n or \\n)."""
    end = text.find("\n", index)
    if end < 0:
        return len(text)
    return end - 1 if end > 0 and text[end - 1] == "\r" else end


def _dedent(lines: list[str]) -> list[str]:
    body = [line for line in lines if line.strip()]
    if not body:
        return []
    first_is_inline = bool(lines) and not lines[0][:1].isspace()
    rest = body[1:] if first_is_inline else body
    cut = min((len(line) - len(line.lstrip(" ")) for line in rest), default=0)
    return [line if (first_is_inline and i == 0) else line[cut:]
            for i, line in enumerate(lines)]


def _indent(text: str, found) -> str:
    """The indentation step the spec uses (from the placement block, else layers)."""
    if found is not None:
        value = found[1]
        if isinstance(value, yaml.MappingNode) and not value.flow_style and value.start_mark.column:
            return " " * value.start_mark.column
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return "  "
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if (isinstance(value, yaml.MappingNode) and not value.flow_style
                    and value.start_mark.column > key.start_mark.column):
                return " " * (value.start_mark.column - key.start_mark.column)
    return "  "


def _pos(name: str, node) -> Position:
    return Position(name, node.start_mark.line + 1, node.start_mark.column + 1)
