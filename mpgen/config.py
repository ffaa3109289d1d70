"""``[tool.mpgen]`` in the project's ``pyproject.toml``: what ``mpgen build``
and ``mpgen check`` use for what their command line leaves out.

```toml
[tool.mpgen]
specs = ["examples/*.yaml"]   # globs, relative to this file's folder
out = "generated"
device-map = "cpu"            # optional, as --device-map
root = "."                    # optional, as --root
time-limit = 60               # optional, as --time-limit (CPU seconds; raise only)
```

The file is the nearest ``pyproject.toml`` in the working directory or above
it, within the project: the search stops at the first folder that holds a
``pyproject.toml`` or ``.git`` (the folder generated headers are relative
to). Paths in it are relative to its folder; they are handed on relative to
the working directory. A mistake in it is ``pyproject.toml:LINE:COL:
message`` (TOML parsers give values no positions: the key's line is found
by scanning the text, see :class:`_Locator`), exit status 2. This module needs
neither torch nor the compiler.

# NOTE: [A config a pull request can change]
# pyproject.toml is part of every pull request, so nothing in it may widen
# what mpgen does beyond the project or lift a limit unseen: ``out`` and
# ``root`` must be folders inside the project (the git work tree holding
# the file, else the file's folder), also after symbolic links are followed,
# and never inside the git folder; ``specs`` are globs relative to the file's
# folder (no absolute path, no ``..``), walked by :class:`_Walk` without
# following a symbolic link to a folder (no loop, no escape) and over at
# most :data:`MAX_VISITED` entries, and a matched file that is a link must
# lead to a file inside the project; no value holds a control character;
# the TOML nests at most :data:`MAX_NESTING` arrays or tables deep (checked
# by a scan before the parser, which recurses); ``time-limit`` can raise the
# default budget, never remove it (0 is an error, the most is
# :data:`MAX_TIME_LIMIT`), and ``build`` and ``check`` print a note when it
# does, so that the raise shows in the check's output.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from mpgen.errors import Collector, MpgenError, Position, did_you_mean, shown
from mpgen.files import (FileTooLarge, git_dir, inside, is_project_folder, read_regular,
                         reason, work_tree)

FILE_NAME = "pyproject.toml"
#: The table mpgen reads.
TABLE = ("tool", "mpgen")
#: At most this many bytes of pyproject.toml are read.
MAX_BYTES = 4 << 20
#: Arrays and inline tables nest at most this deep in pyproject.toml.
MAX_NESTING = 100
#: The globs of ``specs`` look at most at this many entries of folders in all.
MAX_VISITED = 100_000
#: The analysis budget of a build, in CPU seconds (``frontend.limits``
#: holds the one the compiler uses; a test keeps the two the same: this
#: module must not import the compiler).
DEFAULT_TIME_LIMIT = 16.0
#: The most ``time-limit`` (or ``--time-limit``) may raise the budget to.
MAX_TIME_LIMIT = 600.0

#: Each key, and what its value must be (for messages).
KEYS = {
    "specs": 'a list of spec paths or globs, like ["examples/*.yaml"]',
    "out": 'a folder, like "generated"',
    "device-map": 'a device map, like "cpu" or "cuda:1=cuda:0"',
    "root": 'a folder, like "."',
    "time-limit": "a number of CPU seconds above 0, at most 600 (the default is 8)",
}
#: The keys whose value is a path or a device map: no control characters.
_TEXT_KEYS = ("specs", "out", "root", "device-map")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Setting:
    """One value of ``[tool.mpgen]`` and where it was written."""

    value: Any
    pos: Position


@dataclass(frozen=True)
class ProjectConfig:
    """The ``[tool.mpgen]`` table of one ``pyproject.toml``, checked."""

    path: Path  # the pyproject.toml
    settings: Mapping[str, Setting]

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def shown(self) -> str:
        """The file as messages show it."""
        return relative(self.path)

    def get(self, key: str) -> Optional[Setting]:
        return self.settings.get(key)

    def folder_path(self, key: str) -> Optional[str]:
        """``out`` or ``root``: the folder, relative to the working directory."""
        setting = self.get(key)
        return None if setting is None else relative(self.folder / setting.value)

    @property
    def boundary(self) -> Path:
        """The folder ``out``, ``root`` and ``specs`` must stay in."""
        return boundary(self.folder)

    def time_limit_note(self) -> Optional[str]:
        """``pyproject.toml:L:C: note: ...`` when ``time-limit`` raises the
        default budget (NOTE [A config a pull request can change])."""
        setting = self.get("time-limit")
        if setting is None or setting.value <= DEFAULT_TIME_LIMIT:
            return None
        return (f"{setting.pos}: note: time-limit raised to {setting.value:g} s CPU "
                f"(default {DEFAULT_TIME_LIMIT:g} s)")

    def spec_paths(self) -> list[str]:
        """``specs`` expanded: every file its globs match, in order (each
        glob's matches sorted), relative to the working directory; a glob
        that matches nothing is an error (a typo must not check nothing), as
        is a walk past :data:`MAX_VISITED` entries or a matched link that
        leads out of the project."""
        setting = self.get("specs")
        if setting is None:
            return []
        errors = Collector()
        found: dict[str, None] = {}
        walk = _Walk(self.folder, self.boundary)
        for pattern in setting.value:
            try:
                matches = sorted(walk.glob(pattern))
            except _TooMany:
                raise MpgenError(setting.pos, f"[tool.mpgen] specs: {shown(pattern)} looks at "
                                 f"more than {MAX_VISITED} files and folders in "
                                 f"{relative(self.folder)}; name narrower folders") from None
            if not matches:
                errors.add(setting.pos, f"[tool.mpgen] specs: {shown(pattern)} matches no "
                           f"file in {relative(self.folder)}")
            for match in matches:
                path = self.folder / match
                if not inside(path, self.boundary):
                    errors.add(setting.pos, f"[tool.mpgen] specs: {shown(match)} is a symbolic "
                               f"link to {shown(os.path.realpath(path))}, outside the project "
                               f"({relative(self.boundary)})")
                    continue
                found.setdefault(relative(path))
        errors.raise_if_any()
        return list(found)


class _TooMany(Exception):
    """A glob looked at more than :data:`MAX_VISITED` entries."""


def _has_magic(part: str) -> bool:
    return any(c in part for c in "*?[")


class _Walk:
    """``glob.glob(pattern, root_dir=folder, recursive=True)`` as far as the
    patterns of ``specs`` use it (``*``, ``?``, ``[...]`` within a name,
    ``**`` for any number of folders; a name starting with a dot matched only
    by a pattern that starts with one), but bounded: a symbolic link to a
    folder is never followed by a wildcard (no loop, no escape; a folder named
    as it is is followed when it leads inside the project), and every entry
    looked at counts against :data:`MAX_VISITED` over all the patterns."""

    def __init__(self, folder: Path, boundary: Path) -> None:
        self.folder = folder
        self.boundary = boundary
        self.visited = 0

    def glob(self, pattern: str) -> list[str]:
        parts = [p for p in pattern.split("/") if p not in ("", ".")]
        return list(dict.fromkeys(self._match("", parts))) if parts else []

    def _entries(self, rel: str) -> list[os.DirEntry]:
        try:
            with os.scandir(self.folder / rel if rel else self.folder) as found:
                entries = []
                for entry in found:
                    self.visited += 1
                    if self.visited > MAX_VISITED:
                        raise _TooMany()
                    entries.append(entry)
                return entries
        except OSError:
            return []

    def _match(self, rel: str, parts: list[str]) -> Iterator[str]:
        head, rest = parts[0], parts[1:]

        def join(name: str) -> str:
            return f"{rel}/{name}" if rel else name

        if head == "**":  # no folder, or one more and "**" again
            if rest:
                yield from self._match(rel, rest)
            for entry in self._entries(rel):
                if entry.name.startswith("."):
                    continue
                if not rest:
                    yield join(entry.name)
                if entry.is_dir(follow_symlinks=False):
                    yield from self._match(join(entry.name), parts)
            return
        if not _has_magic(head):
            path = self.folder / join(head)
            if not rest:
                if os.path.lexists(path):
                    yield join(head)
            elif path.is_dir() and (not path.is_symlink() or inside(path, self.boundary)):
                yield from self._match(join(head), rest)
            return
        for entry in self._entries(rel):
            if entry.name.startswith(".") and not head.startswith("."):
                continue
            if not fnmatch.fnmatchcase(entry.name, head):
                continue
            if not rest:
                yield join(entry.name)
            elif entry.is_dir(follow_symlinks=False):
                yield from self._match(join(entry.name), rest)


def boundary(folder: Path) -> Path:
    """The folder a project's paths must stay in: the top of the git work
    tree holding ``folder``, else ``folder`` (real paths)."""
    return work_tree(folder) or Path(os.path.realpath(folder))


def project_folder(start: Path) -> Optional[Path]:
    """The project ``start`` is in: the first folder at or above it holding
    ``.git`` or ``pyproject.toml``; None outside any."""
    start = Path(os.path.abspath(start))
    return next((f for f in (start, *start.parents) if is_project_folder(f)), None)


def folder_problem(path: Path, bound: Path, outside_ok: bool = False) -> Optional[str]:
    """Why ``path`` may not be the output or root folder of the project in
    ``bound``: it is outside it (unless ``outside_ok``: a path written
    outside), or leads out of it through a symbolic link, or it is inside
    the repository's git folder; None when it may."""
    real = os.path.realpath(path)
    written = os.path.normpath(os.path.abspath(path))
    if not inside(real, bound):
        if os.path.commonpath([written, str(bound)]) == str(bound):
            return (f"leads out of the project ({relative(bound)}) through a symbolic "
                    f"link, to {real}")
        return None if outside_ok else f"is outside the project ({relative(bound)})"
    top = work_tree(bound)
    git = git_dir(top) if top is not None else None
    if top is not None and (inside(real, top / ".git") or (git and inside(real, git))):
        return "is inside the repository's git folder"
    return None


def find(start: Path) -> Optional[Path]:
    """The ``pyproject.toml`` of the project ``start`` is in, if it has one."""
    folder = project_folder(start)
    candidate = None if folder is None else folder / FILE_NAME
    return candidate if candidate is not None and candidate.exists() else None


def load(start: Optional[Path] = None) -> Optional[ProjectConfig]:
    """The ``[tool.mpgen]`` settings of the project the working directory (or
    ``start``) is in; None when there is no ``pyproject.toml`` or it has no
    such table. Raises :class:`MpgenError` for a file that cannot be read or
    parsed, or a table with an unknown key or a value of the wrong type."""
    path = find(Path(os.path.abspath(start or Path.cwd())))
    if path is None:
        return None
    shown_path = relative(path)
    try:
        text = read_regular(path, MAX_BYTES).decode("utf-8")
    except FileTooLarge:
        raise MpgenError(Position(shown_path), f"larger than {MAX_BYTES} bytes") from None
    except OSError as exc:
        raise MpgenError(Position(shown_path), f"cannot read it: {reason(exc)}") from None
    except UnicodeDecodeError:
        raise MpgenError(Position(shown_path), "not UTF-8") from None
    deep = _too_deep(text)
    if deep is not None:
        raise MpgenError(Position(shown_path, *deep), f"arrays or tables nested more than "
                         f"{MAX_NESTING} deep")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MpgenError(*_decode_error(shown_path, text, exc)) from None
    except RecursionError:  # past the scan of _too_deep: never expected
        raise MpgenError(Position(shown_path), "nested too deep to parse") from None
    table: Any = data
    for part in TABLE:
        if not isinstance(table, dict) or part not in table:
            return None
        table = table[part]
    where = _Locator(shown_path, text)
    if not isinstance(table, dict):
        raise MpgenError(where.key(()), f"[tool.mpgen]: expected a table, got {shown(table)}")
    return ProjectConfig(path, _check(table, where, path.parent))


def _check(table: Mapping[str, Any], where: "_Locator", folder: Path) -> dict[str, Setting]:
    errors = Collector()
    settings = {}
    for key, value in table.items():
        if key not in KEYS:
            errors.add(where.key((key,)), f"[tool.mpgen]: unknown key {shown(key)}"
                       f"{did_you_mean(key, KEYS)}; known keys: {', '.join(KEYS)}")
            continue
        problem = _problem(key, value)
        if problem:
            errors.add(where.value((key,)), f"[tool.mpgen] {key}: expected {KEYS[key]}, "
                       f"got {problem}")
            continue
        problem = _unsafe(key, value, folder)
        if problem:
            errors.add(where.value((key,)), f"[tool.mpgen] {key}: {problem}")
            continue
        settings[key] = Setting(value, where.value((key,)))
    errors.raise_if_any()
    return settings


def _problem(key: str, value: Any) -> Optional[str]:
    """What is wrong with ``value`` for ``key`` (what was found), or None."""
    if key == "specs":
        if not isinstance(value, list) or not value:
            return shown(value)
        bad = [v for v in value if not isinstance(v, str) or not v]
        return f"the item {shown(bad[0])}" if bad else None
    if key == "time-limit":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and 0 < value <= MAX_TIME_LIMIT:
            return None
        if number and value == 0:
            return "0 (a limit can be raised, never removed)"
        return shown(value)
    return None if isinstance(value, str) and value else shown(value)


def _unsafe(key: str, value: Any, folder: Path) -> Optional[str]:
    """What takes a well-typed value out of bounds (NOTE [A config a pull
    request can change]), or None."""
    if key not in _TEXT_KEYS:
        return None
    for text in (value if isinstance(value, list) else [value]):
        control = _CONTROL.search(text)
        if control:
            return (f"{shown(text)} holds a control character "
                    f"({control.group().encode('unicode_escape').decode()})")
    if key == "specs":
        for pattern in value:
            if os.path.isabs(pattern) or pattern.startswith(("~", "\\")):
                return f"{shown(pattern)} is absolute; write it relative to this file's folder"
            if ".." in pattern.replace("\\", "/").split("/"):
                return f"{shown(pattern)} leaves this file's folder ('..'); specs stay inside it"
    if key in ("out", "root"):
        if os.path.isabs(value):
            return f"{shown(value)} is absolute; write it relative to this file's folder"
        problem = folder_problem(folder / value, boundary(folder))
        if problem:
            return f"{shown(value)} {problem}; {key} must be a folder inside the project"
    return None


#: What the nesting scan stops at: a string's or comment's start, a bracket.
_SCAN = re.compile(r"\"\"\"|'''|[\"'#\[\]{}]")
#: The rest of a string or comment after its start (a basic string's escapes).
_SKIP = {
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*"""', re.S),
    "'''": re.compile(r"(?:[^']|'(?!''))*'''", re.S),
    '"': re.compile(r'(?:[^"\\\n]|\\.)*"'),
    "'": re.compile(r"[^'\n]*'"),
    "#": re.compile(r"[^\n]*"),
}


def _too_deep(text: str) -> Optional[tuple[int, int]]:
    """The line and column of the first bracket nested deeper than
    :data:`MAX_NESTING` (strings and comments skipped), or None; an
    unterminated string ends the scan (the parser reports it)."""
    depth, at = 0, 0
    while True:
        found = _SCAN.search(text, at)
        if found is None:
            return None
        token, at = found.group(), found.end()
        if token in _SKIP:
            rest = _SKIP[token].match(text, at)
            if rest is None:
                return None
            at = rest.end()
        elif token in "[{":
            depth += 1
            if depth > MAX_NESTING:
                start = found.start()
                return text.count("\n", 0, start) + 1, start - text.rfind("\n", 0, start)
        else:
            depth = max(depth - 1, 0)


def relative(path: Path) -> str:
    """``path`` as messages and the commands show it: relative to the working
    directory (``../x`` from a subfolder), absolute where it cannot be."""
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)


_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)$|\s*\(at end of document\)$")


def _decode_error(shown_path: str, text: str, exc: Exception) -> tuple[Position, str]:
    """A TOML syntax error at its line and column (tomllib writes them into
    its message)."""
    message = str(exc)
    found = _AT.search(message)
    if found is None:
        return Position(shown_path), f"invalid TOML: {message}"
    if found.group(1):
        pos = Position(shown_path, int(found.group(1)), int(found.group(2)))
    else:
        lines = text.split("\n")
        pos = Position(shown_path, len(lines), len(lines[-1]) + 1)
    return pos, f"invalid TOML: {message[:found.start()]}"


_HEADER = re.compile(r"^\s*\[(?!\[)(?P<name>[^\]]*)\]")
_KEY_VALUE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_\-\"'. ]+?)\s*=\s*(?P<value>.)?")


def _key_path(text: str) -> tuple[str, ...]:
    """``tool."mpgen" . specs`` -> ("tool", "mpgen", "specs") (keys with dots
    inside quotes are not split correctly; they do not name mpgen's keys)."""
    return tuple(part.strip().strip("\"'") for part in text.split("."))


class _Locator:
    """Where a key of ``[tool.mpgen]`` is written: found by scanning the lines
    for the table's header and the key (in ``[tool.mpgen]``, or dotted in
    ``[tool]`` or at the top); the table's own position when not found (an
    inline table)."""

    def __init__(self, shown_path: str, text: str) -> None:
        self.file = shown_path
        self.table: Optional[Position] = None
        self.keys: dict[tuple[str, ...], tuple[Position, Position]] = {}
        current: tuple[str, ...] = ()
        for number, line in enumerate(text.split("\n"), 1):
            header = _HEADER.match(line)
            if header:
                current = _key_path(header["name"])
                if current == TABLE and self.table is None:
                    self.table = Position(shown_path, number, line.index("[") + 1)
                continue
            pair = _KEY_VALUE.match(line)
            if not pair:
                continue
            path = current + _key_path(pair["key"])
            if path[:len(TABLE)] != TABLE:
                continue
            key_pos = Position(shown_path, number, len(pair["indent"]) + 1)
            value_col = pair.start("value") + 1 if pair["value"] else len(line) + 1
            if path == TABLE and self.table is None:
                self.table = key_pos  # tool.mpgen = {...}
            self.keys.setdefault(path[len(TABLE):], (key_pos, Position(shown_path, number,
                                                                         value_col)))

    def key(self, path: tuple[str, ...]) -> Position:
        found = self.keys.get(path)
        return found[0] if found else self.table or Position(self.file)

    def value(self, path: tuple[str, ...]) -> Position:
        found = self.keys.get(path)
        return found[1] if found else self.table or Position(self.file)
