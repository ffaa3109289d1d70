"""``mpgen ci-summary --base REV [SPEC...]``: a pull request's layout changes, in Markdown.

For CI (``docs/ci.md``): the specs whose layout differs between the merge
base of REV and HEAD and the working tree, each compared as ``mpgen diff
BASE:path path`` does (a new spec shown as ``mpgen show`` shows it, a deleted
one listed), written as Markdown for ``$GITHUB_STEP_SUMMARY`` or a pull
request comment. Paths are the repository's, relative to its root.

Which files are specs (NOTE [Every change seen]) is decided on each side from
what the files hold, never from ``git diff``'s or ``git grep``'s view of
them: the files ``[tool.mpgen] specs`` of that side's ``pyproject.toml``
matches, and every ``*.yaml``/``*.yml`` file whose YAML has a top-level
``mpgen`` key (quoted or not, in any YAML form). With SPECs, only those. A
change of ``[tool.mpgen]`` (its ``device-map``) compiles the unchanged specs
with each side's settings and shows those whose layers move.

The base side is read from git's objects only (``git ls-tree`` and ``git
cat-file`` of the merge base's full id), never from a file of the working
tree, whatever its name; every name is put in Markdown code
(``printed.code_span``). The new side is the pull request's code,
compiled: run this where no token is (NOTE [A summary without a token]).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import posixpath
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Mapping, Optional

from mpgen import config
from mpgen.commands import diff as layout_diff
from mpgen.commands.diff import GIT, git_env
from mpgen.commands import show
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.errors import MpgenError, Position
from mpgen.files import FileTooLarge, inside, read_regular, reason
from mpgen.printed import code_span, fenced
from mpgen.spec_schema.load import MAX_BYTES, load_text

#: The file names that may be specs without [tool.mpgen] naming them.
SPEC_SUFFIXES = (".yaml", ".yml")
#: A spec's version key, where the YAML around it does not parse: at a
#: line's start or in a flow mapping, quoted or not.
SPEC_MARK = re.compile(r"""(?:^|[{,])[ \t]*(?:mpgen|"mpgen"|'mpgen')[ \t]*:""", re.M)
#: Files of a side looked at, at most (a repository with more is refused).
MAX_FILES = 200_000
#: Renamed specs are paired by content when at most this many were deleted
#: and added; above it, each is shown deleted and new.
MAX_RENAME_PAIRS = 10_000
#: The share of lines a deleted and a new spec have in common to be one spec
#: renamed (a rename that rewrites more shows as deleted and new: both seen).
RENAME_SIMILARITY = 0.8

# NOTE: [Every change seen]
# A pull request controls its tree, so nothing it holds may hide a layout
# change from the summary. git's views of a file are shaped by the tree:
# ``.gitattributes`` can mark ``*.yaml`` binary (``-diff``: ``git grep -I``
# skips it) or give it a clean filter or textconv (what ``git diff`` then
# compares is the filter's output), and the repository's or user's config
# can run a ``core.fsmonitor`` program that tells git which files changed.
# So ci-summary asks git only for names and objects: ``ls-tree`` and
# ``cat-file --batch`` of the merge base (object ids, no attributes, no
# filters), ``ls-files`` of the working tree, whose bytes it reads itself,
# with fsmonitor, the untracked cache, system attributes and the global
# attributes file turned off (:data:`GIT`, :func:`git_env`); a spec is what
# its content says (a top-level ``mpgen`` key, found by the spec loader, so
# ``"mpgen": 1`` and ``{mpgen: 1, ...}`` count) or what ``[tool.mpgen]
# specs`` names, as ``build`` reads it. Settings move layers too: when
# ``[tool.mpgen]`` differs, every spec on both sides is compiled with each
# side's ``device-map`` and shown when its layout differs.

# NOTE: [A summary without a token]
# ci-summary compiles the pull request's specs, and compiling a spec imports
# the modules it names (docs/spec.md, "User modules"): the pull request's code
# runs. Run with a token that can write (GH_TOKEN for `gh pr comment`), that
# code could use it: the "pwn request". Taking the variable out of
# os.environ would not help (the code can read /proc/self/environ, or its
# parent's), and mpgen cannot tell before compiling a spec whether it names
# code. So docs/ci.md computes the summary in a job with no secret and a
# read-only token, and posts it from another job that never runs the pull
# request's code; ci-summary itself warns when it sees one of these
# variables, and otherwise runs as it would (a developer's shell often has
# GH_TOKEN set).

#: The variables that hold a token a CI job can act with.
TOKEN_VARIABLES = ("GITHUB_TOKEN", "GH_TOKEN", "GH_ENTERPRISE_TOKEN", "ACTIONS_RUNTIME_TOKEN",
                   "ACTIONS_ID_TOKEN_REQUEST_TOKEN")


def tokens(environ: Mapping[str, str]) -> list[str]:
    """The token variables set (not empty) in ``environ``."""
    return [name for name in TOKEN_VARIABLES if environ.get(name)]


@dataclass(frozen=True)
class Change:
    """One spec that differs: its path at the merge base and in the working
    tree; ``settings``: only its ``[tool.mpgen]`` settings did."""

    old: Optional[str]  # None: new
    new: Optional[str]  # None: deleted
    settings: bool = False

    def kind(self, cell: bool = False) -> str:
        """In Markdown (in a table ``cell`` or not)."""
        if self.old is None:
            return "new"
        if self.new is None:
            return "deleted"
        if self.settings:
            return f"moved by {code_span('[tool.mpgen]', cell)}"
        return "changed" if self.old == self.new else f"renamed from {code_span(self.old, cell)}"


@dataclass(frozen=True)
class Summary:
    markdown: str
    failed: tuple[str, ...]  # the specs a side of which did not compile


def _git(root: str | Path, *args: str, stdin: Optional[bytes] = None) -> str:
    """Run git (:data:`GIT`) in ``root``; its stdout, or an :class:`MpgenError`
    with git's reason."""
    return _git_bytes(root, *args, stdin=stdin).decode("utf-8", "surrogateescape")


def _git_bytes(root: str | Path, *args: str, stdin: Optional[bytes] = None) -> bytes:
    try:
        done = subprocess.run([*GIT, *args], cwd=root, env=git_env(), capture_output=True,
                              timeout=120, input=stdin,
                              stdin=subprocess.DEVNULL if stdin is None else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = reason(exc) if isinstance(exc, OSError) else "it took longer than 120 s"
        raise MpgenError(None, f"mpgen ci-summary: cannot run git {args[0]}: {why}") from None
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise MpgenError(None, f"mpgen ci-summary: git {args[0]} failed: "
                               f"{message[0] if message else f'exit status {done.returncode}'}")
    return done.stdout


def repository() -> Path:
    """The root of the working directory's repository."""
    return Path(_git(os.getcwd(), "rev-parse", "--show-toplevel").strip())


def merge_base(root: Path, base: str) -> str:
    """The full id of the commit HEAD branched from ``base`` at."""
    if base.startswith("-") or not base.strip():
        raise MpgenError(None, f"mpgen ci-summary: --base {base!r} is not a revision")
    try:
        commit = _git(root, "merge-base", base, "HEAD").strip()
    except MpgenError as exc:
        raise MpgenError(None, f"{exc.message} (is {base!r} fetched? GitHub's checkout "
                               "needs fetch-depth: 0)") from None
    return _git(root, "rev-parse", "--verify", "--end-of-options", f"{commit}^{{commit}}").strip()


# -- the two sides, as git holds the base and the working tree is -------------

@dataclass
class Tree:
    """One side: every file's path (from the repository's root) -> what it
    holds (bytes), or why it was not read (str), read lazily."""

    label: str
    paths: set[str]
    read: Callable[[list[str]], dict[str, "bytes | str"]]
    cache: dict = dataclasses.field(default_factory=dict)

    def content(self, path: str) -> "bytes | str":
        if path not in self.cache:
            self.cache.update(self.read([path]))
        return self.cache[path]

    def prefetch(self, paths: Iterable[str]) -> None:
        wanted = [p for p in paths if p not in self.cache]
        if wanted:
            self.cache.update(self.read(wanted))


def base_tree(root: Path, commit: str) -> Tree:
    """The merge base's files, from ``git ls-tree`` and ``git cat-file``."""
    entries: dict[str, tuple[str, str, int]] = {}  # path -> (mode, oid, size)
    for item in _git(root, "ls-tree", "-r", "-l", "-z", "--full-tree", commit).split("\0"):
        meta, tab, path = item.partition("\t")
        fields = meta.split()
        if not tab or len(fields) != 4 or fields[1] != "blob":
            continue
        mode, _, oid, size = fields
        entries[path] = (mode, oid, int(size) if size.isdigit() else MAX_BYTES + 1)
        if len(entries) > MAX_FILES:
            raise MpgenError(None, f"mpgen ci-summary: the merge base holds more than "
                                   f"{MAX_FILES:,} files")

    def read(paths: list[str]) -> dict[str, "bytes | str"]:
        found: dict[str, "bytes | str"] = {}
        wanted: dict[str, list[str]] = {}
        for path in paths:
            target, why = followed(path)
            if target is None or target not in entries:
                found[path] = why or "not in the merge base"
                continue
            _, oid, size = entries[target]
            if size > MAX_BYTES:
                found[path] = f"spec is larger than {MAX_BYTES} bytes"
            else:
                wanted.setdefault(oid, []).append(path)
        if wanted:
            for oid, data in _cat_file(root, list(wanted)).items():
                for path in wanted[oid]:
                    found[path] = data
        return found

    def followed(path: str) -> tuple[Optional[str], Optional[str]]:
        """The file ``path`` is once links are followed, or None and why.
        A symbolic link in git is a blob holding its target: followed inside
        the tree (at most 8 links), as the file system would."""
        for _ in range(8):
            if path not in entries or entries[path][0] != "120000":
                return path, None
            _, oid, size = entries[path]
            data = _cat_file(root, [oid]).get(oid, b"") if size <= 4096 else b""
            target = posixpath.normpath(posixpath.join(posixpath.dirname(path),
                                                       data.decode("utf-8", "replace")))
            if target.startswith(("../", "/")) or target == "..":
                return None, "a symbolic link to a file outside the repository; not read"
            path = target
        return None, "a chain of more than 8 symbolic links; not read"

    return Tree(commit, set(entries), read)


def _cat_file(root: Path, oids: list[str]) -> dict[str, bytes]:
    """The blobs ``oids`` (``git cat-file --batch``: no filters, no textconv)."""
    out = _git_bytes(root, "cat-file", "--batch", stdin="".join(f"{o}\n" for o in oids).encode())
    blobs, at = {}, 0
    while at < len(out):
        end = out.index(b"\n", at)
        header = out[at:end].split()
        if len(header) != 3:  # "<oid> missing"
            at = end + 1
            continue
        size = int(header[2])
        blobs[header[0].decode()] = out[end + 1:end + 1 + size]
        at = end + 1 + size + 1
    return blobs


def work_tree(root: Path) -> Tree:
    """The working tree's files that git tracks or would add (``git ls-files``,
    fsmonitor off), read from the files themselves (no clean filter)."""
    names = [n for n in _git(root, "ls-files", "-z", "-c", "-o", "--exclude-standard",
                             "--full-name").split("\0") if n]
    paths = list(dict.fromkeys(names))
    if len(paths) > MAX_FILES:
        raise MpgenError(None, f"mpgen ci-summary: the working tree holds more than "
                               f"{MAX_FILES:,} files")
    real = root.resolve()

    def read(wanted: list[str]) -> dict[str, "bytes | str"]:
        found: dict[str, "bytes | str"] = {}
        for path in wanted:
            here = root / path
            if not os.path.lexists(here):
                found[path] = "not in the working tree"
            elif not inside(here.resolve(), real):
                found[path] = "a symbolic link to a file outside the repository; not read"
            else:
                try:
                    found[path] = read_regular(here, MAX_BYTES)
                except FileTooLarge:
                    found[path] = f"spec is larger than {MAX_BYTES} bytes"
                except OSError as exc:
                    found[path] = f"cannot read it: {reason(exc)}"
        return found

    return Tree("working tree", {p for p in paths if os.path.lexists(root / p)}, read)


def is_spec(data: "bytes | str", path: str) -> bool:
    """Whether a file holding ``data`` is a spec: its YAML has a top-level
    ``mpgen`` key (as the spec loader reads it: quoted, in a flow mapping);
    YAML the loader refuses counts when the key is written at a line's start
    or in a flow mapping (a spec with an error is still a spec)."""
    if not isinstance(data, bytes):
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        return bool(SPEC_MARK.search(text))
    try:
        loaded = load_text(text, path)
    except MpgenError:
        return bool(SPEC_MARK.search(text))
    return isinstance(loaded.data, dict) and "mpgen" in loaded.data


# -- [tool.mpgen] of each side -------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """What ``[tool.mpgen]`` of one side says that the summary uses."""

    where: Optional[str]  # the pyproject.toml's folder from the root ("" the root)
    table: Mapping[str, object]  # key -> value, as written
    device_map: Optional[Mapping[str, str]]

    def globs(self) -> list[str]:
        specs = self.table.get("specs")
        return list(specs) if isinstance(specs, list) else []


def _project_file(root: Path) -> Optional[str]:
    """The path, from the root, of the ``pyproject.toml`` build would read
    from the working directory (the nearest project folder at or above it)."""
    folder = config.project_folder(Path.cwd())
    if folder is None or not inside(folder, root):
        return None
    rel = PurePosixPath(Path(os.path.relpath(folder.resolve(), root.resolve())).as_posix())
    return str(rel / config.FILE_NAME).removeprefix("./")


def _settings(data: "bytes | str | None", shown: str, where: Optional[str]) -> Settings:
    """``[tool.mpgen]`` of a pyproject.toml holding ``data`` (None: none),
    checked as ``build`` checks it; errors name ``shown``."""
    if not isinstance(data, bytes):
        return Settings(where, {}, None)
    with tempfile.TemporaryDirectory(prefix="mpgen-summary-") as folder:
        copy = Path(folder) / config.FILE_NAME
        copy.write_bytes(data)
        try:
            project = config.load(Path(folder))
        except MpgenError as exc:
            raise _renamed(exc, str(copy), shown) from None
    if project is None:
        return Settings(where, {}, None)
    table = {k: s.value for k, s in project.settings.items()}
    device_map = None
    if "device-map" in project.settings:
        from mpgen.spec_schema.device_map import parse_device_map

        setting = project.settings["device-map"]
        try:
            device_map = parse_device_map(setting.value)
        except ValueError as exc:
            pos = dataclasses.replace(setting.pos, file=shown)
            raise MpgenError(pos, "[tool.mpgen] device-map: "
                             + str(exc).removeprefix("--device-map: ")) from None
    return Settings(where, table, device_map)


def _renamed(exc: MpgenError, path: str, shown: str) -> MpgenError:
    pos = exc.pos
    if pos is not None and pos.file and pos.file.endswith(config.FILE_NAME):
        pos = dataclasses.replace(pos, file=shown)
    return MpgenError(pos, exc.message.replace(path, shown))


def _matches(path: str, pattern: str) -> bool:
    """Whether ``path`` (from the project folder) is matched by a glob of
    ``[tool.mpgen] specs``, as ``config``'s walk matches it (``*``, ``?``,
    ``[...]`` within a name, ``**`` for any folders, a dot name only by a
    pattern with one)."""
    import fnmatch

    def match(names: list[str], parts: list[str]) -> bool:
        if not parts:
            return not names
        head, rest = parts[0], parts[1:]
        if head == "**":
            return match(names, rest) or (bool(names) and not names[0].startswith(".")
                                          and match(names[1:], parts))
        if not names:
            return False
        name = names[0]
        if any(c in head for c in "*?["):
            if name.startswith(".") and not head.startswith("."):
                return False
            return fnmatch.fnmatchcase(name, head) and match(names[1:], rest)
        return name == head and match(names[1:], rest)

    return match(path.split("/"), [p for p in pattern.split("/") if p not in ("", ".")])


def _specs(tree: Tree, settings: Settings, named: Optional[set[str]]) -> set[str]:
    """The specs of one side: what ``[tool.mpgen] specs`` matches and the
    YAML files with a top-level ``mpgen`` key; with ``named``, those paths
    and every YAML file (the rename of a named spec is found among them)."""
    prefix = f"{settings.where}/" if settings.where else ""
    globs = settings.globs()
    listed = {p for p in tree.paths
              if p.startswith(prefix) and any(_matches(p[len(prefix):], g) for g in globs)}
    yaml_files = sorted(p for p in tree.paths if p.endswith(SPEC_SUFFIXES))
    if named is not None:
        return listed | set(yaml_files) | (named & tree.paths)
    tree.prefetch(yaml_files)
    return listed | {p for p in yaml_files if is_spec(tree.content(p), p)}


@dataclass
class Comparison:
    """The two sides of a pull request, and what differs."""

    found: list[Change]  # specs whose files differ
    same: list[str]  # specs whose files do not, when [tool.mpgen] does (else none)
    old_settings: Settings
    new_settings: Settings
    old_tree: Tree


def changes(root: Path, commit: str, specs: Optional[Iterable[str]] = None) -> list[Change]:
    """The specs whose files differ between ``commit`` and the working tree
    (renames followed); ``specs`` (paths relative to the working directory):
    only those."""
    return compare(root, commit, specs).found


def compare(root: Path, commit: str, specs: Optional[Iterable[str]] = None) -> Comparison:
    """The specs of both sides (NOTE [Every change seen]) and what differs."""
    old_tree, new_tree = base_tree(root, commit), work_tree(root)
    project = _project_file(root)
    short = commit[:12]
    old_settings = _settings(old_tree.content(project) if project in old_tree.paths else None,
                             f"{short}:{project}", _folder(project))
    new_settings = _settings(new_tree.content(project) if project in new_tree.paths else None,
                             project or config.FILE_NAME, _folder(project))
    named = None
    if specs is not None:
        # The folder's links followed, not the file's: a spec that is a link is itself.
        named = {Path(os.path.relpath(Path(s).absolute().parent.resolve() / Path(s).name,
                                      root.resolve())).as_posix() for s in specs}
    old_specs = _specs(old_tree, old_settings, named)
    new_specs = _specs(new_tree, new_settings, named)
    old_tree.prefetch(old_specs)
    new_tree.prefetch(new_specs)
    found: list[Change] = []
    same: list[str] = []  # specs whose bytes did not change
    for path in sorted(old_specs | new_specs):
        here_old = path in old_tree.paths and (path in old_specs or path in new_specs)
        here_new = path in new_tree.paths and (path in old_specs or path in new_specs)
        if here_old and here_new:
            if old_tree.content(path) != new_tree.content(path):
                found.append(Change(path, path))
            else:
                same.append(path)
        elif here_old:
            found.append(Change(path, None))
        elif here_new:
            found.append(Change(None, path))
    found = _renames(found, old_tree, new_tree)
    if named is not None:
        found = [c for c in found if c.old in named or c.new in named]
        same = [p for p in same if p in named]
    moved_by_settings = same if old_settings.table != new_settings.table else []
    return Comparison(found, moved_by_settings, old_settings, new_settings, old_tree)


def _folder(project: Optional[str]) -> Optional[str]:
    return None if project is None else posixpath.dirname(project)


def _renames(found: list[Change], old: Tree, new: Tree) -> list[Change]:
    """Deleted and new specs paired when one holds what the other did, or
    :data:`RENAME_SIMILARITY` of its lines, each at most once."""
    gone = [c.old for c in found if c.new is None]
    added = [c.new for c in found if c.old is None]
    if not gone or not added or len(gone) * len(added) > MAX_RENAME_PAIRS:
        return found
    pairs: dict[str, str] = {}

    def lines(data) -> list[bytes]:
        return data.splitlines() if isinstance(data, bytes) else []

    scored = []
    for a in gone:
        for b in added:
            x, y = old.content(a), new.content(b)
            if not isinstance(x, bytes) or not isinstance(y, bytes):
                continue
            if x == y:
                scored.append((2.0, a, b))
                continue
            matcher = difflib.SequenceMatcher(None, lines(x), lines(y), autojunk=False)
            if min(matcher.real_quick_ratio(), matcher.quick_ratio()) >= RENAME_SIMILARITY:
                ratio = matcher.ratio()
                if ratio >= RENAME_SIMILARITY:
                    scored.append((ratio, a, b))
    used = set()
    for _, a, b in sorted(scored, key=lambda s: (-s[0], s[1], s[2])):
        if a not in pairs and b not in used:
            pairs[a] = b
            used.add(b)
    kept = [c for c in found if c.old not in pairs and c.new not in used]
    kept += [Change(a, b) for a, b in pairs.items()]
    return sorted(kept, key=lambda c: c.new or c.old)


def _inside(repo: Path, path: str) -> str:
    """``path`` of the working tree, relative to the working directory, when it
    is a file inside ``repo`` once links are followed: a spec the pull request
    links to a file outside (``/proc/self/environ``, a credentials file) is
    not read, since its errors would quote it in the summary."""
    here = repo / path
    if not here.resolve().is_relative_to(repo.resolve()):
        raise MpgenError(Position(path), "a symbolic link to a file outside the repository; "
                                         "not read")
    return os.path.relpath(here)


def _layout_moved(d: layout_diff.LayoutDiff) -> bool:
    """Whether a diff shows anything: a layer moved, added or removed, a
    device's parameters, memory or memory-plan peak, a transfer."""
    return bool(d.moved or d.removed or d.added or d.transfers_removed or d.transfers_added
                or d.memory or any(c.params[0] != c.params[1] or c.memory[0] != c.memory[1]
                       for c in d.devices))


def _settings_lines(old: Settings, new: Settings, short: str) -> list[str]:
    """What changed in ``[tool.mpgen]``, one Markdown item per key."""
    shown = code_span(f"{new.where}/{config.FILE_NAME}" if new.where else config.FILE_NAME)
    lines = [f"{code_span('[tool.mpgen]')} of {shown} changed since {code_span(short)}:", ""]
    for key in sorted(set(old.table) | set(new.table)):
        a, b = old.table.get(key), new.table.get(key)
        if a != b:
            lines.append(f"- {code_span(key)}: {code_span(repr(a)) if a is not None else 'unset'}"
                         f" -> {code_span(repr(b)) if b is not None else 'unset'}")
    return lines + [""]


def summarize(base: str, specs: Optional[Iterable[str]] = None,
              root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Summary:
    """The Markdown summary of the specs changed since ``base``. A side that does
    not compile is shown with its errors (and named in ``failed``).
    ``root``, ``time_limit``: as for ``compile_spec``."""
    repo = repository()
    commit = merge_base(repo, base)
    short = _git(repo, "rev-parse", "--short=12", commit).strip()
    seen = compare(repo, commit, specs)
    old_settings, new_settings = seen.old_settings, seen.new_settings
    old_map, new_map = old_settings.device_map, new_settings.device_map
    if time_limit is None:  # the command line's default: the project's, else the budget
        time_limit = new_settings.table.get("time-limit") or DEFAULT_TIME_LIMIT
    failed: list[str] = []
    sections: list[str] = []

    def compiled(change: Change) -> Optional[str]:
        """The section's body, or None for a spec [tool.mpgen] does not move."""
        try:
            new = layout_diff.load_file(_inside(repo, change.new), new_map, root, time_limit)
            if change.old is None:
                return show.to_table(new.graph)
            old = _load_base(seen.old_tree, change.old, f"{short}:{change.old}", old_map, root,
                             time_limit)
            d = layout_diff.diff(old, new)
            if change.settings and not _layout_moved(d):
                return None
            return layout_diff.format_diff(d)
        except MpgenError as exc:
            failed.append(change.new)
            return f"does not compile:\n{exc}"

    shown: list[Change] = []
    for change in seen.found + [Change(p, p, settings=True) for p in seen.same]:
        if change.new is None:
            shown.append(change)
            continue
        body = compiled(change)
        if body is None:
            continue
        shown.append(change)
        sections += ["", f"### {code_span(change.new)} ({change.kind()})", "", *fenced(body)]
    lines = ["## mpgen: layout changes", ""]
    if old_settings.table != new_settings.table:
        lines += _settings_lines(old_settings, new_settings, short)
    if not shown:
        lines.append(f"No spec changed since {code_span(base)} (merge base {code_span(short)}).")
        return Summary("\n".join(lines) + "\n", ())
    lines += [f"{len(shown)} spec{'s' if len(shown) != 1 else ''} changed since "
              f"{code_span(base)} (merge base {code_span(short)}):", "",
              "| spec | change |", "|---|---|"]
    lines += [f"| {code_span(c.new or c.old, cell=True)} | {c.kind(cell=True)} |" for c in shown]
    return Summary("\n".join(lines + sections) + "\n", tuple(failed))


def _load_base(tree: Tree, path: str, label: str, device_map: Optional[Mapping[str, str]],
               root, time_limit) -> layout_diff.Side:
    """The base side of ``path``: its blob (a link followed inside the tree),
    compiled; errors name ``label``."""
    data = tree.content(path)
    if not isinstance(data, bytes):
        raise MpgenError(Position(label), data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MpgenError(Position(label, 1, 1), f"spec is not UTF-8 ({exc.reason})") from None
    return layout_diff.load_text(text, path, label, device_map, root, time_limit)
