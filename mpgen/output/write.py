"""Write the generated files as one unit, or compare them with what is on disk.

# NOTE: [Writes as one unit]
# A build changes its output folder all at once or not at all. First the
# folder is surveyed (:func:`survey`): each file the build would write is
# missing, the same, ours and stale, or not ours (no mpgen header on its first
# line, a symbolic link, a pipe...: refused unless ``--force``); a file with an
# mpgen header that this build no longer produces is an orphan when its header
# names a spec being built (a renamed model: always removed, the spec says
# what it generates now) or a spec that no longer exists in its project
# (removed only with ``--prune``: the build was not asked about that spec,
# and a header's path is the only evidence it is gone). Then every new file is written to a staging folder inside
# the output folder (so each rename stays on one file system) and renamed
# over its target; each file replaced or removed is kept in the staging folder
# (a hard link, else a copy) until the end. If any step fails, everything
# done is undone from those backups (and a runtime folder the build made is
# removed), so the folder is as it was. SIGINT and
# SIGTERM are held from the first write to the cleanup and delivered after
# (Python handlers, not a signal mask: torch's threads would still take a
# signal). ``check`` reads the same survey, so it reports exactly what
# ``build`` would change, byte for byte.

# NOTE: [Every file of the output folder accounted for]
# CI runs the generated tests (``pytest generated``), so anything in the
# output folder can run: a ``conftest.py``, a ``.pth``, a ``pytest.ini``, a
# committed ``__pycache__/*.pyc`` that Python loads without its source. The
# survey therefore lists every file there and gives each an owner: a file a
# checked spec generates (a target), or an orphan of one (a renamed model's,
# a deleted spec's). Every other file is a stranger (:class:`Stranger`),
# which ``check`` reports (exit 1) and ``build`` leaves in place with a
# note: no mpgen header; a header naming a spec outside the project (an
# absolute path, ``..``), or one not found in any project of the checked
# specs while the folder is outside them; a spec of the project that was
# not among the specs checked (a pull request that narrowed ``[tool.mpgen]
# specs`` so that a hand-edited file is no longer compared); anything in a
# sub-folder (mpgen writes none); a link, a folder, a pipe. Inside a git
# work tree the files listed are those git tracks or would add (``git
# ls-files -c -o --exclude-standard``): what a commit can carry, and what
# is not ignored, less the caches Python and pytest write themselves when
# untracked (``__pycache__``, ``.pytest_cache``); outside one (or when git
# cannot say: a repository of another owner), every file but
# ``.pytest_cache`` and, in a ``__pycache__``, the ``.pyc`` files Python
# checks against their source (an unchecked-hash one, PEP 552, would run
# as it is: a stranger). ``build --prune`` removes a deleted spec's files only
# from an output folder inside that spec's project (its git work tree, or
# its folder): a header's path is the only evidence the spec is gone, and
# in another project's folder it is no evidence at all.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, Mapping, Optional

from mpgen import __version__
from mpgen.output import manifest as build_manifest
from mpgen.output import runtime
from mpgen.errors import Collector, MpgenError, Position
from mpgen.files import (FileTooLarge, inside, is_project_folder, kind, read_head,
                         read_regular, reason, work_tree)
from mpgen.printed import escaped

#: An existing file is read up to this many bytes more than the generated one.
MAX_EXTRA_BYTES = 1 << 20
#: Bytes read to find a file's header (its first line).
HEAD_BYTES = 4096
#: The prefix of the staging folder a build writes in (inside the output folder).
STAGING_PREFIX = ".mpgen-staging-"
#: At most this many entries of the output folder are looked at for strangers.
MAX_LISTED = 100_000
#: Folders Python and pytest write themselves when the generated tests run:
#: never strangers when git neither tracks them nor would add them.
CACHES = ("__pycache__", ".pytest_cache")


@dataclass(frozen=True)
class Target:
    """A file the build writes, and what is at its place now."""

    path: Path
    data: bytes  # what the build writes
    current: Optional[bytes] = None  # what is there, when it is mpgen's file and readable
    exists: bool = False
    foreign: str = ""  # why the file there is not mpgen's to replace
    note: str = ""  # why ``current`` could not be compared (too large)

    @property
    def changed(self) -> bool:
        return self.current != self.data


@dataclass(frozen=True)
class Orphan:
    """A file with mpgen's header that the build no longer produces."""

    path: Path
    spec: str  # as its header names it
    gone: bool  # the spec no longer exists; else a spec being built no longer generates it

    @property
    def why(self) -> str:
        return (f"generated from {self.spec}, which no longer "
                f"{'exists' if self.gone else 'generates it'}")

    def removed_by(self, prune: bool) -> bool:
        """Whether a build (with ``--prune`` or not) removes it."""
        return prune or not self.gone


@dataclass(frozen=True)
class Stranger:
    """A file in the output folder that no spec of this build or check owns
    (NOTE [Every file of the output folder accounted for])."""

    path: Path
    why: str
    spec: Optional[Path] = None  # the spec of the project that generates it, not checked


@dataclass
class Survey:
    """The output folder against a build: targets, orphans and strangers."""

    out_dir: Path
    targets: list[Target] = field(default_factory=list)
    orphans: list[Orphan] = field(default_factory=list)
    strangers: list[Stranger] = field(default_factory=list)


@dataclass(frozen=True)
class Changes:
    """What a build did to the output folder."""

    written: list[Path]
    removed: list[Path]
    kept: list[Orphan] = field(default_factory=list)  # orphans left in place: no --prune
    strangers: list[Stranger] = field(default_factory=list)  # left in place, check reports them


@dataclass(frozen=True)
class Differences:
    """What ``check`` found: one text per file that ``build`` would change."""

    texts: list[str]
    prune: bool = False  # some are orphans only ``build --prune`` removes
    strangers: int = 0  # the last texts: files no build changes (:class:`Stranger`)
    #: the specs of the project, not checked, whose files are among the strangers
    unchecked: tuple[Path, ...] = ()
    unchecked_files: int = 0  # how many of the strangers those specs generate

    def __bool__(self) -> bool:
        return bool(self.texts)

    @property
    def build_fixes(self) -> bool:
        """Whether ``build`` would change anything (strangers it leaves)."""
        return len(self.texts) > self.strangers


#: The first line of every generated file: a Python file's header, or the
#: placement report's HTML comment (``report.py``), as ``common.header`` and the
#: report template write it; what names its spec.
_GENERATED_FROM = re.compile(r"# Code generated by mpgen from (?P<py>.+)\. DO NOT EDIT\."
                             r"|<!-- Generated by mpgen from (?P<md>.+)\. DO NOT EDIT\. -->")


def generated_from(first_line: str) -> Optional[str]:
    """The spec a file's first line says it was generated from (as the header
    writes the path), or None when it has no mpgen header: not mpgen's file."""
    found = _GENERATED_FROM.fullmatch(first_line.rstrip("\r\n"))
    if found is None:
        return None
    return found["py"] if found["py"] is not None else found["md"].replace("&gt;", ">")


def _first_line(head: bytes) -> str:
    return head.split(b"\n", 1)[0].decode("utf-8", "replace")


def _target(path: Path, data: bytes) -> Target:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return Target(path, data)
    except OSError as exc:
        return Target(path, data, exists=True, foreign=f"cannot look at it: {reason(exc)}")
    if not stat.S_ISREG(mode):
        return Target(path, data, exists=True, foreign=f"{kind(mode)}, not a file mpgen wrote")
    current, note = None, ""
    try:
        current = read_regular(path, len(data) + MAX_EXTRA_BYTES)
        head = current[:HEAD_BYTES]
    except FileTooLarge as exc:
        note = f"{exc}; it differs from the generated file"
        try:
            head = read_head(path, HEAD_BYTES)
        except OSError as again:
            return Target(path, data, exists=True, foreign=f"cannot read it: {reason(again)}")
    except OSError as exc:
        return Target(path, data, exists=True, foreign=f"cannot read it: {reason(exc)}")
    line = _first_line(head)
    if generated_from(line) is None and runtime.version_of(line) is None:
        return Target(path, data, current, exists=True,
                      foreign="not generated by mpgen (no mpgen header)")
    return Target(path, data, current, exists=True, note=note)


def _project_roots(specs: Mapping[str, str | Path], out_dir: Path) -> list[Path]:
    """The project folders the built specs' headers are relative to (the
    folder with ``.git`` or ``pyproject.toml`` the spec path is shown from)
    that hold ``out_dir`` (in their git work tree, or below them): a header
    names a spec of such a project only (NOTE [Every file of the output
    folder accounted for])."""
    roots = []
    for shown, spec in specs.items():
        parts = PurePosixPath(shown).parts
        full = Path(os.path.abspath(spec))
        if len(parts) >= len(full.parts) or full.parts[-len(parts):] != parts:
            continue  # escaped in the header: cannot be matched to the disk
        root = full.parents[len(parts) - 1]
        if is_project_folder(root) and inside(out_dir, work_tree(root) or root):
            roots.append(root)
    return roots


def _spellings(shown: str) -> set[str]:
    """The paths a header's spec may be (the header escapes it)."""
    spellings = {shown, shown.replace("- -", "--")}  # the report's comment escapes "--"
    with contextlib.suppress(UnicodeError):
        spellings.add(shown.replace('\\"', '"').encode("ascii", "backslashreplace")
                      .decode("unicode_escape"))
    return spellings


def _outside(shown: str) -> bool:
    """Whether a header names a spec outside any project (``/x``, ``../x``)."""
    return any(PurePosixPath(s).is_absolute() or ".." in PurePosixPath(s).parts
               for s in _spellings(shown))


def _spec_exists(shown: str, roots: list[Path]) -> bool:
    """Whether the spec a header names may still exist (True when unsure)."""
    if _outside(shown):
        return True
    return any((root / PurePosixPath(spelling)).exists()
               for spelling in _spellings(shown) for root in roots)


def _spec_path(shown: str, roots: list[Path]) -> Optional[Path]:
    """The spec a header names, found in one of the projects ``roots``."""
    return next((root / PurePosixPath(spelling) for spelling in sorted(_spellings(shown))
                 for root in roots if (root / PurePosixPath(spelling)).exists()), None)


def _orphans(out_dir: Path, files: Mapping[str, str],
             specs: Mapping[str, str | Path]) -> list[Orphan]:
    """Files in ``out_dir`` with an mpgen header that this build does not
    produce, whose header names a spec being built or one that no longer
    exists; files of other specs that exist are never touched."""
    ours = {text.split("\n", 1)[0] for text in files.values()}
    roots = _project_roots(specs, out_dir)
    found = []
    for path, line in _first_lines(out_dir, "", files, (".py", ".md")):
        spec = generated_from(line)
        if spec is None:
            continue
        if line in ours:
            found.append(Orphan(path, spec, gone=False))
        elif roots and not _spec_exists(spec, roots):
            found.append(Orphan(path, spec, gone=True))
    # Files of an older runtime that this one no longer has: the runtime
    # folder is the output folder's, so every build removes them.
    for path, line in _first_lines(out_dir, runtime.FOLDER, files):
        version = runtime.version_of(line)
        if version is not None:
            found.append(Orphan(path, f"the runtime of mpgen {version}", gone=False))
    return found


def _first_lines(out_dir: Path, folder: str, files: Mapping[str, str],
                 suffixes: Optional[tuple[str, ...]] = None) -> Iterator[tuple[Path, str]]:
    """Each regular file directly in ``out_dir/folder`` that is not among
    ``files`` (named by their paths in ``out_dir``), in name order, with its
    first line; with ``suffixes``, only files ending so, not dot files; a
    file that cannot be read is passed over."""
    try:
        entries = sorted(os.scandir(out_dir / folder), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        name = f"{folder}/{entry.name}" if folder else entry.name
        if suffixes and (entry.name.startswith(".") or not entry.name.endswith(suffixes)):
            continue
        try:
            if name in files or not entry.is_file(follow_symlinks=False):
                continue
            line = _first_line(read_head(entry.path, HEAD_BYTES))
        except OSError:
            continue
        yield out_dir / name, line


def survey(out_dir: Path, files: Mapping[str, str],
           specs: Optional[Mapping[str, str | Path]] = None) -> Survey:
    """Compare the output folder with a build of ``files`` from ``specs``
    (each spec as its headers name it -> its path)."""
    with contextlib.suppress(OSError):
        mode = os.stat(out_dir).st_mode
        if not stat.S_ISDIR(mode):
            what = "a file" if stat.S_ISREG(mode) else kind(mode)
            raise MpgenError(Position(str(out_dir)), f"the output folder (-o) is {what}, "
                             "not a folder")
    result = Survey(out_dir)
    result.targets = [_target(out_dir / name, text.encode("utf-8"))
                      for name, text in files.items()]
    result.orphans = _orphans(out_dir, files, specs or {})
    result.strangers = _strangers(out_dir, files, specs or {}, result.orphans)
    return result


def _git_listed(out_dir: Path) -> Optional[list[str]]:
    """The files under ``out_dir`` that git tracks, or would add (untracked,
    not ignored, and not in one of the :data:`CACHES`), as paths relative to
    it; None outside a git work tree or when git cannot say."""
    if work_tree(out_dir) is None:
        return None
    try:
        ran = subprocess.run(
            ["git", "-c", "core.fsmonitor=false", "ls-files", "-z", "-t", "-c", "-o",
             "--exclude-standard", "--", "."],
            cwd=out_dir, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    if ran.returncode != 0:
        return None
    listed: dict[str, None] = {}
    for item in ran.stdout.split(b"\0"):
        if len(item) < 3:
            continue
        tag, name = item[:1], os.fsdecode(item[2:]).rstrip("/")
        if tag == b"?" and any(part in CACHES for part in name.split("/")[:-1]):
            continue
        listed.setdefault(name)
        if len(listed) > MAX_LISTED:
            break
    return list(listed)


def _walked(out_dir: Path) -> Optional[list[str]]:
    """Every file under ``out_dir`` as relative paths (links not followed),
    but ``.pytest_cache`` and, in a ``__pycache__``, the files Python would
    check against their source (:func:`_python_s_own`); None when there are
    more than :data:`MAX_LISTED` entries."""
    listed: list[str] = []
    folders = [""]
    seen = 0
    while folders:
        folder = folders.pop()
        cache = folder.rsplit("/", 1)[-1] == "__pycache__"
        try:
            with os.scandir(out_dir / folder if folder else out_dir) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_LISTED:
                        return None
                    name = f"{folder}/{entry.name}" if folder else entry.name
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if entry.name != ".pytest_cache":
                            folders.append(name)
                    elif not (cache and _python_s_own(entry)):
                        listed.append(name)
        except OSError:
            continue
    return listed


def _python_s_own(entry: os.DirEntry) -> bool:
    """Whether a file in a ``__pycache__`` is a compiled module Python checks
    against its source before using it (a timestamp or checked-hash ``.pyc``,
    as Python and pytest write them), not one it would run as it is (an
    unchecked-hash ``.pyc``, PEP 552) or anything else."""
    if not entry.name.endswith(".pyc") or not entry.is_file(follow_symlinks=False):
        return False
    try:
        head = read_head(entry.path, 8)
    except OSError:
        return False
    return len(head) == 8 and int.from_bytes(head[4:8], "little") in (0, 3)


def _strangers(out_dir: Path, files: Mapping[str, str], specs: Mapping[str, str | Path],
               orphans: list[Orphan]) -> list[Stranger]:
    """Every file in ``out_dir`` that is neither a target nor an orphan
    (NOTE [Every file of the output folder accounted for])."""
    if not out_dir.is_dir():
        return []
    listed = _git_listed(out_dir)
    if listed is None:
        listed = _walked(out_dir)
    if listed is None:
        return [Stranger(out_dir, f"holds more than {MAX_LISTED} files and folders, more "
                                  "than mpgen looks at for files it does not own")]
    owned = {*files, *(o.path.relative_to(out_dir).as_posix() for o in orphans)}
    roots = _project_roots(specs, out_dir)
    found = []
    for name in sorted(listed):
        if name in owned or not os.path.lexists(out_dir / name):
            continue
        if len(found) == MAX_LISTED:
            found.append(Stranger(out_dir, f"holds more than {MAX_LISTED} files mpgen does "
                                           "not own; the rest were not looked at"))
            break
        found.append(_stranger(out_dir / name, name, specs, roots))
    return found


def _stranger(path: Path, name: str, specs: Mapping[str, str | Path],
              roots: list[Path]) -> Stranger:
    """The file at ``path`` (``name`` in the folder), which no spec checked
    generates: why, and the project's spec that does when there is one."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return Stranger(path, f"cannot look at it: {reason(exc)}")
    if not stat.S_ISREG(mode):
        return Stranger(path, f"{kind(mode)}, not a file mpgen wrote")
    if name.startswith(f"{runtime.FOLDER}/") and name.count("/") == 1:
        return Stranger(path, f"not a file of mpgen {__version__}'s runtime ({runtime.FOLDER}/)")
    if "/" in name:
        return Stranger(path, f"in a sub-folder other than {runtime.FOLDER}/, where mpgen "
                              "writes nothing")
    if name == build_manifest.FILE_NAME:
        return Stranger(path, "the build manifest of an older mpgen, never read now (mpgen "
                              "keeps it outside the output folder)")
    try:
        spec = generated_from(_first_line(read_head(path, HEAD_BYTES)))
    except OSError as exc:
        return Stranger(path, f"cannot read it: {reason(exc)}")
    if spec is None or not name.endswith((".py", ".md")):
        return Stranger(path, "not generated by mpgen (no mpgen header)")
    if _outside(spec):
        return Stranger(path, f"generated from {spec}, a spec outside the project")
    if spec in specs:
        return Stranger(path, f"generated from {spec}, which does not generate it")
    if roots and not _spec_exists(spec, roots):  # an orphan, but for a spelling
        return Stranger(path, f"generated from {spec}, which no longer exists")
    if roots:  # a spec of the project holding the folder, which exists
        return Stranger(path, f"generated from {spec}, another spec of the project",
                        _spec_path(spec, roots))
    return Stranger(path, f"generated from {spec}, which is not among the specs checked (check "
                          "every spec of the output folder together)")


# -- build -------------------------------------------------------------------

def write_files(out_dir: Path, files: Mapping[str, str],
                specs: Optional[Mapping[str, str | Path]] = None, force: bool = False,
                prune: bool = False,
                manifest: Optional[Iterable[build_manifest.Entry]] = None) -> Changes:
    """Make ``out_dir`` hold ``files`` (name -> text) and none of the orphans
    of ``specs`` (with ``prune``, none of the deleted specs' either), as one
    unit (NOTE [Writes as one unit]). Files whose content is unchanged are
    left untouched (their mtime too). A file at a name the build writes that
    mpgen did not write is an error unless ``force``; OS errors become
    :class:`MpgenError` and leave the folder as it was. ``manifest``: this
    build's entries, recorded in the folder's manifest once the files are
    written (NOTE [Build manifest]); entries of other specs are kept while
    their files are neither rewritten nor removed.
    """
    _refuse_a_linked_folder(out_dir, files)
    found = survey(out_dir, files, specs)
    foreign = [t for t in found.targets if t.foreign]
    if foreign and not force:
        errors = Collector()
        for t in foreign:
            errors.add(Position(str(t.path)), f"{t.foreign}; refusing to overwrite it; move it "
                       "away or pass --force")
        errors.raise_if_any()
    changed = {t.path: t.data for t in found.targets if t.changed}
    removed = [o.path for o in found.orphans if o.removed_by(prune)]
    if changed or removed:
        with held_signals():
            _apply(out_dir, changed, removed)
    if manifest is not None:  # after the files: NOTE [Build manifest]
        build_manifest.store(out_dir, list(manifest),
                             {*files, *(p.relative_to(out_dir).as_posix() for p in removed)})
    return Changes(list(changed), removed,
                   [o for o in found.orphans if not o.removed_by(prune)], found.strangers)


def _refuse_a_linked_folder(out_dir: Path, files: Mapping[str, str]) -> None:
    """Refuse, even with --force, to write into a sub-folder (the runtime's)
    that is a link or not a folder: a build would write through it, outside
    the output folder (a pull request can commit such a link)."""
    for folder in sorted({PurePosixPath(name).parent for name in files} - {PurePosixPath(".")}):
        path = out_dir / folder
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):  # the survey says what out_dir is
            continue
        except OSError as exc:
            raise MpgenError(Position(str(path)), f"cannot look at it: {reason(exc)}") from None
        if not stat.S_ISDIR(mode):
            raise MpgenError(Position(str(path)), f"{kind(mode)}, not the folder mpgen writes "
                             f"{folder}/ in; remove it and build again")


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """SIGINT and SIGTERM are recorded, not acted on, inside; delivered after.

    Only the main thread can set handlers; elsewhere this does nothing.
    """
    wanted = [s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None))
              if s is not None]
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous: dict[int, object] = {}
    try:
        for sig in wanted:
            previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python, cannot be put back
                signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


class _Unrestored(Exception):
    """A failed build whose undo failed too: the previous files are kept."""

    def __init__(self, error: OSError, lost: list[tuple[Path, Path]]) -> None:
        super().__init__(error)
        self.error = error
        self.lost = lost


def _apply(out_dir: Path, changed: Mapping[Path, bytes], removed: list[Path]) -> None:
    staging: Optional[Path] = None
    keep = False
    created: list[Path] = []  # the sub-folders this build made: gone again if it fails
    done = False
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))
        new, old = staging / "new", staging / "old"
        new.mkdir()
        old.mkdir()
        for k, data in enumerate(changed.values()):  # by number: two folders may share a name
            with open(new / str(k), "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(new / str(k), 0o644)
        for folder in dict.fromkeys(path.parent for path in changed):
            if folder != out_dir and not os.path.lexists(folder):
                folder.mkdir()  # the runtime's folder
                created.append(folder)
        _swap(changed, removed, new, old)
        done = True
    except _Unrestored as exc:
        keep = True
        kept = ", ".join(f"{path} (its previous content is in {backup})"
                         for path, backup in exc.lost)
        raise MpgenError(Position(str(out_dir)), f"cannot write the generated files: "
                         f"{reason(exc.error)}: {exc.error.filename}; could not restore "
                         f"{kept}") from None
    except OSError as exc:
        where = exc.filename
        if where is None or STAGING_PREFIX in str(where):  # not a path the user knows
            where = out_dir
        raise MpgenError(Position(str(out_dir)), f"cannot write the generated files: "
                         f"{reason(exc)}: {where}; nothing was changed") from None
    finally:
        if staging is not None and not keep:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in created if not done else ():
            with contextlib.suppress(OSError):  # not empty: a file it held is kept
                os.rmdir(folder)


def _backup(path: Path, backup: Path) -> None:
    """Keep the file at ``path`` as ``backup`` without moving it away."""
    try:
        os.link(path, backup, follow_symlinks=False)
    except OSError:  # a file system without hard links
        shutil.copy2(path, backup, follow_symlinks=False)


def _swap(changed: Mapping[Path, bytes], removed: list[Path], new: Path, old: Path) -> None:
    """Rename every new file over its target and move every orphan into
    ``old``; on failure undo what was done and raise the OSError, or
    :class:`_Unrestored` when an undo failed too."""
    done: list[tuple[Path, Optional[Path]]] = []  # (target, its previous file, if any)
    try:
        for k, path in enumerate(changed):
            backup = None
            if os.path.lexists(path):
                backup = old / str(k)
                _backup(path, backup)
            os.replace(new / str(k), path)
            done.append((path, backup))
        for k, path in enumerate(removed, len(changed)):
            os.replace(path, old / str(k))
            done.append((path, old / str(k)))
    except OSError as exc:
        lost = _undo(done)
        if lost:
            raise _Unrestored(exc, lost) from None
        raise


def _undo(done: list[tuple[Path, Optional[Path]]]) -> list[tuple[Path, Path]]:
    """Restore every target in ``done``, last first; the ones that failed."""
    lost = []
    for path, backup in reversed(done):
        try:
            if backup is None:
                os.unlink(path)
            else:
                os.replace(backup, path)
        except OSError:
            if backup is not None:
                lost.append((path, backup))
    return lost


# -- check -------------------------------------------------------------------

def diff_files(out_dir: Path, files: Mapping[str, str],
               specs: Optional[Mapping[str, str | Path]] = None) -> Differences:
    """What ``build`` would change in ``out_dir``, one text per file: a
    unified diff of each stale file (bytes compared exactly), each missing
    file, each file in the way that mpgen did not write, each orphan (and
    whether removing it takes ``build --prune``)."""
    found = survey(out_dir, files, specs)
    report = []
    for t in found.targets:
        if t.foreign:
            report.append(f"{escaped(str(t.path))}: {t.foreign}; build would refuse to overwrite it "
                          "(move it away, or build with --force)\n")
        elif not t.exists:
            report.append(f"missing: {escaped(str(t.path))}\n")
        elif t.note:
            report.append(f"{escaped(str(t.path))}: {t.note}\n")
        elif t.changed:
            report.append(_other_version(t) + _diff(t.path, t.current or b"", t.data))
    for orphan in found.orphans:
        build = "build" if orphan.removed_by(prune=False) else "build --prune"
        report.append(f"{escaped(str(orphan.path))}: {orphan.why}; {build} would remove it\n")
    for stranger in found.strangers:
        if stranger.spec is not None:  # another spec's file: not compared, never "remove"
            owner = "; not checked here, so not compared"
        elif stranger.path == out_dir:  # the folder itself: too large
            owner = ""
        else:
            owner = "; no spec checked owns it, and build leaves it: remove it"
        report.append(f"{escaped(str(stranger.path))}: {stranger.why}{owner}\n")
    owned = [s.spec for s in found.strangers if s.spec is not None]
    return Differences(report, any(not o.removed_by(prune=False) for o in found.orphans),
                       len(found.strangers), tuple(dict.fromkeys(owned)), len(owned))


def _other_version(target: Target) -> str:
    """A line saying a runtime file on disk comes from another mpgen, or ""."""
    version = runtime.version_of(_first_line(target.current or b""))
    if version is None or version == __version__:
        return ""
    return (f"{escaped(str(target.path))}: from mpgen {escaped(version)}'s runtime; this is "
            f"mpgen {__version__}\n")


def _diff(path: Path, current: bytes, data: bytes) -> str:
    if current.replace(b"\r\n", b"\n") == data:
        return f"{escaped(str(path))}: line endings differ (\\r\\n on disk; mpgen writes \\n)\n"
    old = current.decode("utf-8", "replace").splitlines(keepends=True)
    new = data.decode("utf-8").splitlines(keepends=True)
    text = "".join(difflib.unified_diff(old, new, fromfile=f"{escaped(str(path))} (on disk)",
                                        tofile=f"{escaped(str(path))} (generated)"))
    return text if text.endswith("\n") else text + "\n"
