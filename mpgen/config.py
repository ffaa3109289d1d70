"""``[tool.mpgen]`` in the project's ``pyproject.toml``: what ``mpgen build``
and ``mpgen check`` use for what their command line leaves out.

```toml
[tool.mpgen]
specs = ["examples/*.yaml"]   # globs, relative to this file's folder
out = "generated"
device-map = "cpu"            # optional, as --device-map
root = "."                    # optional, as --root
time-limit = 60               # optional, as --time-limit (seconds; 0: no limit)
```

The file is the nearest ``pyproject.toml`` in the working directory or above
it, within the project: the search stops at the first folder that holds a
``pyproject.toml`` or ``.git`` (the folder generated headers are relative
to). Paths in it are relative to its folder; they are handed on relative to
the working directory. A mistake in it is ``pyproject.toml:LINE:COL:
message`` (TOML parsers give values no positions: the key's line is found
by scanning the text, see :func:`_locate`), exit status 2. This module needs
neither torch nor the compiler.
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from mpgen.errors import Collector, MpgenError, Position, did_you_mean, shown
from mpgen.files import FileTooLarge, is_project_folder, read_regular, reason

FILE_NAME = "pyproject.toml"
#: The table mpgen reads.
TABLE = ("tool", "mpgen")
#: At most this many bytes of pyproject.toml are read.
MAX_BYTES = 4 << 20

#: Each key, and what its value must be (for messages).
KEYS = {
    "specs": 'a list of spec paths or globs, like ["examples/*.yaml"]',
    "out": 'a folder, like "generated"',
    "device-map": 'a device map, like "cpu" or "cuda:1=cuda:0"',
    "root": 'a folder, like "."',
    "time-limit": "a number of seconds (0: no limit)",
}


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

    def spec_paths(self) -> list[str]:
        """``specs`` expanded: every file its globs match, in order (each
        glob's matches sorted), relative to the working directory; a glob
        that matches nothing is an error (a typo must not check nothing)."""
        setting = self.get("specs")
        if setting is None:
            return []
        errors = Collector()
        found: dict[str, None] = {}
        for pattern in setting.value:
            matches = sorted(glob.glob(pattern, root_dir=self.folder, recursive=True))
            if not matches:
                errors.add(setting.pos, f"[tool.mpgen] specs: {shown(pattern)} matches no "
                           f"file in {relative(self.folder)}")
            for match in matches:
                found.setdefault(relative(self.folder / match))
        errors.raise_if_any()
        return list(found)


def find(start: Path) -> Optional[Path]:
    """The ``pyproject.toml`` of the project ``start`` is in, if it has one."""
    for folder in (start, *start.parents):
        if is_project_folder(folder):
            candidate = folder / FILE_NAME
            return candidate if candidate.exists() else None
    return None


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
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MpgenError(*_decode_error(shown_path, text, exc)) from None
    table: Any = data
    for part in TABLE:
        if not isinstance(table, dict) or part not in table:
            return None
        table = table[part]
    where = _Locator(shown_path, text)
    if not isinstance(table, dict):
        raise MpgenError(where.key(()), f"[tool.mpgen]: expected a table, got {shown(table)}")
    return ProjectConfig(path, _check(table, where))


def _check(table: Mapping[str, Any], where: "_Locator") -> dict[str, Setting]:
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
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and value >= 0)
        return None if ok else shown(value)
    return None if isinstance(value, str) and value else shown(value)


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
