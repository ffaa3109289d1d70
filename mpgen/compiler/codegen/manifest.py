"""The build manifest: which files a build wrote for each spec, and from what.

# NOTE: [Build manifest]
# ``mpgen build`` writes ``.mpgen-manifest.json`` in the output folder, with
# the generated files and as part of the same unit (NOTE [Writes as one
# unit]). Per spec (as its headers name it) it records a key and the sha256
# of every file generated from it. The key hashes everything the files are a
# function of, for a spec that imports no code of its own:
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

import functools
import hashlib
import importlib.metadata
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from mpgen import __version__
from mpgen.files import read_regular

#: The manifest's name in the output folder (a dot file: never an orphan).
FILE_NAME = ".mpgen-manifest.json"
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

_PACKAGE = Path(__file__).resolve().parents[2]


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


def read(out_dir: Path) -> dict[str, Entry]:
    """The entries of the manifest in ``out_dir`` by spec; none when there is
    no manifest or it cannot be trusted (unreadable, corrupt, another format)."""
    try:
        data = json.loads(read_regular(out_dir / FILE_NAME, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    return _entries(data) or {}


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
