"""The build manifest: which files a build wrote for each spec, and from what.

# NOTE: [Build manifest]
# ``mpgen build`` records, for each output folder, a manifest: per spec (as
# its headers name it) a key and the sha256 of every file generated from it.
# It is a cache of this machine's builds and lives where git never tracks
# it, so that no commit can forge it (a pull request that committed one with
# a hand-edited file's hash would otherwise make CI's ``check`` pass):
# inside the git folder of the repository holding the output folder,
# ``.git/mpgen/manifests/<sha256 of the folder's path in the repository>.json``
# (a worktree's or submodule's ``.git`` file is followed to its git folder),
# else in the user's cache, ``$XDG_CACHE_HOME`` or ``~/.cache``,
# ``mpgen/manifests/<sha256 of the folder's real path>.json``. Nothing is
# read from the output folder itself: a ``.mpgen-manifest.json`` there (an
# older mpgen wrote it) is a file mpgen does not own, and ``check`` reports
# it. A fresh clone has no manifest: its first check compiles every spec.
# It is written after the folder's files, as a separate step: a manifest
# that does not match the files (a build cut short between the two) only
# makes a spec compile, since every file's bytes are compared with it. The
# key hashes everything the files are a function of, for a spec that
# imports no code of its own:
#
# - the spec's meaning (NOTE [Spec digest]: comments and layout do not count);
# - the device map (``--device-map``), in its order (the header lists it);
# - the generator: mpgen's version and a hash of mpgen's own sources (every
#   ``.py`` and template file of the package but ``mpgen/testing``, the
#   runtime of the generated tests, which nothing else in mpgen imports:
#   ``tests/test_layering.py``), so that a changed template in a development
#   checkout is a miss, never a false "up to date";
# - the versions of what shapes the output besides mpgen: torch (signatures,
#   shapes, parameter counts), black (the layout), jinja2, and Python's
#   ``major.minor``; each read from the installed package's metadata, never
#   imported.
#
# The entry also records the sha256 of the spec's text as built and its
# digest, and whether it names code of its own (a dotted op, a loss or
# optimizer class of its project, ``imports:``), whose behaviour can change
# while the spec does not.
#
# ``mpgen check``, and ``mpgen build`` with nothing to do, read each spec's
# text (no torch, no YAML parse when the text is the one built; else YAML
# and pydantic for its digest, so that an edit of comments stays current),
# compute its key, and take the spec as current when its entry has that key
# and every file it lists is a regular file whose bytes have the recorded
# sha256: the bytes on disk are then exactly what a compile would produce,
# and they stand in for it. Any other case compiles the spec as before: no
# manifest, another key, a file edited, missing or replaced by a link, and a
# spec that names code of its own. A manifest that cannot
# be read, is not valid JSON, or has another format number is ignored (all
# specs are compiled), never an error. The file is deterministic: sorted
# keys, fixed indentation, no timestamps, no absolute paths.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from mpgen import __version__
from mpgen.files import git_dir, read_regular, work_tree

#: The name older mpgen versions gave the manifest in the output folder: now
#: a file mpgen does not own (``check`` reports it), never read.
FILE_NAME = ".mpgen-manifest.json"
#: The folder of the manifests inside a repository's git folder or the cache.
_FOLDER = ("mpgen", "manifests")
#: The format this mpgen reads and writes; another number is ignored.
FORMAT = 1
#: A manifest larger than this is not read (ignored).
MAX_MANIFEST_BYTES = 16 << 20
#: A generated file larger than this is never current from the manifest.
MAX_FILE_BYTES = 64 << 20
#: Packages besides mpgen whose versions shape the generated files.
_SHAPING = ("torch", "black", "jinja2")
#: The package's source files that shape the output.
_SOURCE_SUFFIXES = (".py", ".jinja")
#: The package's folders that do not: the generated tests' runtime.
_RUNTIME = ("testing",)

_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Entry:
    """One spec's files as a build wrote them."""

    spec: str  # the spec's path as the generated headers name it
    key: str  # :func:`build_key` of the build
    files: Mapping[str, str]  # file name -> sha256 hex of its bytes
    summary: str  # the build's summary line after ``SPEC: ``
    source: Optional[str]  # sha256 hex of the spec's text as built (None: not known)
    digest: str  # the spec's digest, as the headers write it
    user_code: bool  # the spec names code of its own: never current from the manifest


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def generator_fingerprint() -> str:
    """mpgen's version and the sha256 of its package's ``.py`` and template
    files but the runtime's (relative paths and bytes, in sorted order)."""
    digest = hashlib.sha256(f"mpgen {__version__}\n".encode())
    files = sorted(p for p in _PACKAGE.rglob("*")
                   if p.suffix in _SOURCE_SUFFIXES and "__pycache__" not in p.parts
                   and p.relative_to(_PACKAGE).parts[0] not in _RUNTIME and p.is_file())
    for path in files:
        data = path.read_bytes()
        name = path.relative_to(_PACKAGE).as_posix().encode()
        digest.update(b"%d:%s%d:" % (len(name), name, len(data)))
        digest.update(data)
    return f"{__version__}+{digest.hexdigest()}"


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _environment() -> tuple[tuple[str, Optional[str]], ...]:
    return (("python", "%d.%d" % sys.version_info[:2]),
            *((name, _version(name)) for name in _SHAPING))


def build_key(spec_digest: str, device_map: Iterable[Sequence[str]]) -> str:
    """The key of a spec's files (NOTE [Build manifest]): ``spec_digest`` as
    the headers write it, ``device_map`` as (device, replacement) pairs in order."""
    data = {
        "spec": spec_digest,
        "device_map": [list(pair) for pair in device_map],
        "generator": generator_fingerprint(),
        "versions": dict(_environment()),
    }
    text = json.dumps(data, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return sha256(text.encode("ascii"))


def entry(spec: str, key: str, files: Mapping[str, str], summary: str, source: Optional[str],
          digest: str, user_code: bool) -> Entry:
    """The entry of a build of ``spec`` that produced ``files`` (name -> text)."""
    return Entry(spec, key, {name: sha256(text.encode("utf-8")) for name, text in files.items()},
                 summary, source, digest, user_code)


def dumps(entries: Iterable[Entry]) -> bytes:
    """The manifest's bytes: the same entries give the same bytes."""
    specs = [{"spec": e.spec, "key": e.key, "files": dict(sorted(e.files.items())),
              "summary": e.summary, "source": e.source, "digest": e.digest,
              "user_code": e.user_code}
             for e in sorted(entries, key=lambda e: e.spec)]
    text = json.dumps({"format": FORMAT, "generator": "mpgen", "specs": specs},
                      sort_keys=True, indent=1, ensure_ascii=True)
    return (text + "\n").encode("ascii")


def _str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _entries(data: object) -> Optional[dict[str, Entry]]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    specs = data.get("specs")
    if not isinstance(specs, list):
        return None
    found: dict[str, Entry] = {}
    for item in specs:
        if not isinstance(item, dict):
            return None
        spec, key, files, summary, source, digest, user_code = (
            item.get(k) for k in ("spec", "key", "files", "summary", "source", "digest",
                                  "user_code"))
        if not (isinstance(spec, str) and isinstance(key, str) and isinstance(summary, str)
                and _str_map(files) and isinstance(source, (str, type(None)))
                and isinstance(digest, str) and isinstance(user_code, bool)):
            return None
        if any(os.path.basename(n) != n or n.startswith(".") for n in files):
            return None  # only plain names in the output folder
        found[spec] = Entry(spec, key, dict(files), summary, source, digest, user_code)
    return found


def location(out_dir: Path) -> Optional[Path]:
    """Where the manifest of the output folder ``out_dir`` is kept (NOTE
    [Build manifest]): in the git folder of the repository holding it, else
    in the user's cache; never in the output folder. None: no home folder."""
    real = os.path.realpath(out_dir)
    top = work_tree(real)
    folder = git_dir(top) if top is not None else None
    if top is not None and folder is not None:
        key = Path(os.path.relpath(real, top)).as_posix()
        return folder.joinpath(*_FOLDER, f"{sha256(key.encode('utf-8', 'surrogateescape'))}.json")
    cache = os.environ.get("XDG_CACHE_HOME", "")
    try:
        base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    except (RuntimeError, KeyError):  # no home folder to find
        return None
    return base.joinpath(*_FOLDER, f"{sha256(real.encode('utf-8', 'surrogateescape'))}.json")


def read(out_dir: Path) -> dict[str, Entry]:
    """The entries of the manifest of ``out_dir`` by spec; none when there is
    no manifest or it cannot be trusted (unreadable, corrupt, another format)."""
    path = location(out_dir)
    if path is None:
        return {}
    try:
        data = json.loads(read_regular(path, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    return _entries(data) or {}


def store(out_dir: Path, entries: Sequence[Entry], touched: Iterable[str]) -> None:
    """Record a build of ``entries`` into ``out_dir`` that wrote or removed the
    files named in ``touched``: the entries of other specs are kept while
    their files were neither. Best effort: the manifest is a cache, and a
    failure to write it (a read-only git folder) only leaves the next check
    to compile; a manifest that could not be replaced is removed."""
    mine = {e.spec for e in entries}
    gone = set(touched)
    kept = [e for spec, e in read(out_dir).items()
            if spec not in mine and not gone.intersection(e.files)]
    data = dumps([*entries, *kept])
    path = location(out_dir)
    if path is None:
        return
    with contextlib.suppress(OSError):
        if read_regular(path, len(data) + 1) == data:
            return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(prefix=".manifest-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(staged, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            raise
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)


def current_files(out_dir: Path, found: Entry) -> Optional[dict[str, str]]:
    """The texts of ``found``'s files when each is a regular file (not a
    link) with the recorded bytes: what a build would write there; else None."""
    texts = {}
    for name, digest in found.files.items():
        path = out_dir / name
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return None
            data = read_regular(path, MAX_FILE_BYTES)
        except OSError:
            return None
        if sha256(data) != digest:
            return None
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return texts
