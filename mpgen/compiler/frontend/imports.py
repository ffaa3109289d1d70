"""What code a spec may import, and importing it (``docs/spec.md``, "User
modules: what a spec may import").

A dotted op ``a.b.C`` names a class in Python source that mpgen imports at
build time. The policy is applied to files mpgen finds on disk itself (never
through the import system, which runs parent packages to find a child), and
all of it before anything is imported:

- every part is a public name (none starts with ``_``) and none is
  ``__main__``; ``a`` is not in the standard library, ``torch`` or ``mpgen``;
- ``a`` is found in the spec's folder, the working directory, then the
  project root, each searched only if it lies inside the project
  (:class:`Project`); or, for a package the spec lists under ``imports:``,
  on ``sys.path``;
- each module of the path is a ``.py`` source file (a package's
  ``__init__.py``; a folder without one is a namespace package), a regular
  file that lies, links followed, inside the project (or the listed
  package), with no compiled module of the same name beside it that Python
  could load instead, nor (for a module of the project) a bytecode cache in
  ``__pycache__`` that Python did not write itself (committed, or
  hash-based), nor a module of the same name in another of the project's
  folders searched (NOTE [Bytecode a pull request commits]);
- ``C`` is defined in the module's source by a top-level ``class C`` (also
  under a top-level ``if`` or ``try``), or imported there with
  ``from .x import C`` from a module of the same package that defines it;
- a module of that name already loaded is this very file.

Then the vetted source is what runs: each module of the path is executed
from the bytes that were checked (never a bytecode cache, none written),
and anything raised while importing, ``SystemExit`` and ``KeyboardInterrupt``
included (but not a real Ctrl-C), is the op's error. Code in the project or
in a listed package is trusted once imported: the policy decides which files
a spec can make mpgen run, not what those files do.

A data factory ``a.b:make`` (``train.data``) is code the generated training
script imports: :func:`check_factory` applies the same policy to its modules
and finds ``def make`` in the parsed source, importing nothing.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import importlib.util
import inspect
import os
import signal
import stat
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from torch import nn

from mpgen.files import read_head, work_tree

#: Top-level packages a dotted op never names, beside the standard library.
FORBIDDEN = frozenset({"torch", "mpgen"})
#: A module source larger than this is not read.
MAX_SOURCE_BYTES = 16 * 2**20
#: How many ``from .x import C`` steps are followed to find the class.
MAX_REEXPORTS = 8
#: What to do about a module that is not in the project.
HOW = "put the module in the project, pass --root, or list its package under 'imports:'"

_COMPILED = (*importlib.machinery.EXTENSION_SUFFIXES, *importlib.machinery.BYTECODE_SUFFIXES)


class Refused(Exception):
    """The op may not be imported, or importing it failed; user-facing."""


@dataclass(frozen=True)
class Project:
    """Where the modules of a spec's dotted ops may come from."""

    root: Path  # resolved
    search: tuple[Path, ...]  # resolved folders inside root, searched in order
    outside: tuple[Path, ...]  # the spec's folder or cwd when outside root (for messages)
    imports: frozenset[str]  # packages the spec lists under imports:

    @classmethod
    def of(cls, spec_path: str | Path, root: str | Path | None = None,
           imports: Iterable[str] = ()) -> "Project":
        """The project of the spec at ``spec_path``: ``root`` when given,
        else the spec's repository (the nearest folder above it with a
        ``.git``), else the working directory if the spec is inside it,
        else the spec's folder."""
        spec = Path(os.path.abspath(spec_path))
        cwd = _cwd()
        top = project_root(spec, cwd, root)
        folders = dict.fromkeys(p.resolve() for p in (spec.parent, spec.resolve().parent, cwd, top)
                                if p is not None)
        return cls(top, tuple(p for p in folders if _inside(p, top)),
                   tuple(p for p in folders if not _inside(p, top)), frozenset(imports))


def project_root(spec: Path, cwd: Optional[Path], root: str | Path | None) -> Path:
    """The resolved project root (see :meth:`Project.of`); ``spec`` absolute."""
    if root is not None:
        return Path(root).resolve()
    for folder in spec.parents:
        if os.path.lexists(folder / ".git"):
            return folder.resolve()
    folder = spec.parent.resolve()
    return cwd if cwd is not None and _inside(folder, cwd) else folder


def _cwd() -> Optional[Path]:
    try:
        return Path.cwd().resolve()
    except OSError:  # the working directory was removed
        return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _text(path: Path | str) -> str:
    """A path for a message: printable, on one line."""
    text = str(path)
    return text if text.isprintable() else ascii(text)[1:-1]


# -- locating modules on disk ------------------------------------------------


@dataclass(frozen=True)
class _Module:
    """A module found on disk: ``folder/<last part>.py``, a package's
    ``folder/<last part>/__init__.py``, or a namespace package (no file)."""

    name: str  # dotted
    folder: Path  # the folder the module's file or package folder is in
    file: Optional[Path]  # None: a namespace package
    package: bool
    shown: str  # relative to the folder the top-level was found in: pkg/gates.py

    @property
    def stem(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def location(self) -> Path:
        return self.folder / self.stem if self.package else self.file


def _find(folder: Path, name: str, parent: Optional[_Module], op: str) -> Optional[_Module]:
    """Module ``name`` (dotted; its last part is looked for) in ``folder``,
    the way Python's path finder would: a package, else a module, else a
    namespace package. A compiled module there without its source is refused."""
    stem = name.rpartition(".")[2]
    prefix = f"{parent.shown.removesuffix('__init__.py').rstrip('/')}/" if parent else ""
    init = folder / stem / "__init__.py"
    if init.is_file():
        return _Module(name, folder, init, True, f"{prefix}{stem}/__init__.py")
    source = folder / f"{stem}.py"
    if source.is_file():
        return _Module(name, folder, source, False, f"{prefix}{stem}.py")
    compiled = _compiled(folder, stem)
    if compiled is not None:
        raise Refused(f"{op!r}: {prefix}{_text(compiled.relative_to(folder))} is a compiled "
                      "module without its source; mpgen imports only Python source (.py) files")
    if (folder / stem).is_dir():
        return _Module(name, folder, None, True, f"{prefix}{stem}/")
    return None


def _compiled(folder: Path, stem: str) -> Optional[Path]:
    """A compiled module (extension or ``.pyc``) named ``stem`` in ``folder``,
    or as the ``__init__`` of a package folder ``stem``."""
    for path in (*(folder / f"{stem}{s}" for s in _COMPILED),
                 *(folder / stem / f"__init__{s}" for s in _COMPILED)):
        if os.path.lexists(path):
            return path
    return None


def _child(parent: _Module, part: str, op: str) -> Optional[_Module]:
    return _find(parent.location, f"{parent.name}.{part}", parent, op)


def _python_path() -> list[Path]:
    """The folders of ``sys.path`` (installed packages), resolved."""
    folders = []
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            folders.append(Path(entry).resolve())
    return list(dict.fromkeys(folders))


def _top(project: Project, name: str, op: str,
         noun: str = "op") -> tuple[_Module, Path, str]:
    """The top-level module ``name``, the folder everything of it must lie
    in, and that folder's description for messages (where ``noun`` says
    what ``op`` is: an op, a data factory)."""
    root = f"the spec's project ({_text(project.root)})"
    for folder in project.search:
        found = _find(folder, name, None, op)
        if found is not None:
            _unshadowed(project, found, op)
            return found, project.root, root
    if name in project.imports:
        installed = _first(_python_path(), name, op)
        if installed is None:
            raise Refused(f"{op!r}: no module {name!r} in {root} or on Python's path, which "
                          "'imports:' lists; install it, or put it in the project")
        return installed, installed.location.resolve(), f"the package {name!r}"
    # Not to be imported: found elsewhere, the message says where.
    elsewhere = _first(project.outside, name, op)
    if elsewhere is not None:
        raise Refused(f"{op!r}: module {name!r} is in {_text(elsewhere.folder)}, outside "
                      f"{root}; {HOW}")
    installed = _first(_python_path(), name, op)
    if installed is not None:
        raise Refused(f"{op!r}: {name!r} is an installed package "
                      f"({_text(installed.location)}), outside {root}; mpgen imports it "
                      f"only if the spec lists {name!r} under 'imports:'")
    raise Refused(f"unknown {noun} {op!r}: no module {name!r} in {root}; {HOW}")


def _unshadowed(project: Project, found: _Module, op: str) -> None:
    """Refuse a top-level module of the project that has a namesake in
    another of its folders (the spec's folder, the working directory, the
    root): the generated code finds its modules through its path (the
    working directory under ``python -m``, ``PYTHONPATH``), where the other
    may come first and run instead of the file vetted here."""
    for folder in project.search:
        if folder == found.folder:
            continue
        try:
            other = _find(folder, found.name, None, op)
        except Refused:  # a compiled module without its source: a namesake too
            other = _Module(found.name, folder, None, False, found.name)
        if other is not None:
            raise Refused(f"{op!r}: there are two modules named {found.name!r} in the project, "
                          f"in {_text(found.folder)} and in {_text(folder)}; the generated code "
                          "imports whichever comes first on its path, not necessarily the one "
                          "mpgen checked: rename or remove one")


def _first(folders: Iterable[Path], name: str, op: str) -> Optional[_Module]:
    for folder in folders:
        found = _find(folder, name, None, op)
        if found is not None:
            return found
    return None


def _vet(module: _Module, allowed: Path, where: str, op: str, own: bool = False) -> None:
    """Refuse a module whose file lies outside ``allowed`` (links followed),
    is not a regular file, or has a compiled module beside it; a module of
    the project itself (``own``), also one with a bytecode cache that is not
    Python's own (:func:`_foreign_cache`)."""
    compiled = _compiled(module.folder, module.stem)
    if compiled is not None:
        raise Refused(f"{op!r}: {_text(compiled.name)} beside {module.shown} is a compiled "
                      "module Python may load instead of the source; remove it (mpgen "
                      "imports only Python source)")
    for path, shown in ((module.location, module.shown.removesuffix("__init__.py")),
                        (module.file, module.shown)):
        real = path.resolve() if path is not None else allowed
        if not _inside(real, allowed):
            raise Refused(f"{op!r}: {shown} is a link to {_text(real)}, outside {where}; "
                          f"{HOW}")
    if module.file is not None and not stat.S_ISREG(os.stat(module.file).st_mode):
        raise Refused(f"{op!r}: {module.shown} is not a regular file")
    foreign = _foreign_cache(module) if own else None
    if foreign is not None:
        cache, why = foreign
        shown = f"{module.shown.rpartition('/')[0]}/__pycache__/{cache.name}".lstrip("/")
        raise Refused(f"{op!r}: {_text(shown)} is {why}, which Python would run instead of "
                      f"{module.shown}, the source mpgen checked; remove it (git rm --cached), "
                      "and keep __pycache__/ out of the repository (.gitignore)")


# NOTE: [Bytecode a pull request commits]
# The generated code imports a user module the ordinary way, and Python runs
# ``__pycache__/<module>.cpython-311.pyc`` instead of the source when the
# cache's header matches: the source's modification time and size (both of
# which a checkout can be made to match), or a hash of the source, which a
# forger simply copies (a checked hash-based cache is loaded when the hash
# matches, whatever code follows it; an unchecked one always). The vetted
# source would then not be what runs. Python writes its own caches with a
# time stamp, never a hash, and no checkout holds them unless they are
# committed; so a module of the project is refused when its cache is
# committed (tracked by git: in CI, the only way one is there) or
# hash-based. A cache outside git that Python could have written itself is
# left alone (every run of the generated code writes one); `mpgen test`
# imports the vetted modules from their sources and never reads a cache.

#: The header of a bytecode cache: magic, flags, then the stamp.
_PYC_HEADER = 16


def _caches(module: _Module) -> list[Path]:
    """The bytecode caches Python may load for ``module`` instead of its
    source: ``__pycache__/<stem>.*.pyc`` beside it (for a package, its
    ``__init__``'s in the package folder)."""
    if module.file is None:
        return []
    cache = module.file.parent / "__pycache__"
    prefix = f"{module.file.stem}."
    try:
        names = sorted(os.listdir(cache))
    except OSError:  # none, or not a folder
        return []
    return [cache / name for name in names if name.startswith(prefix) and name.endswith(".pyc")]


def _foreign_cache(module: _Module) -> Optional[tuple[Path, str]]:
    """A bytecode cache of ``module`` that Python did not write for this
    checkout, and why (NOTE [Bytecode a pull request commits])."""
    caches = _caches(module)
    if not caches:
        return None
    for cache in caches:
        try:
            head = read_head(cache, _PYC_HEADER)
        except OSError:  # a link, a folder, a pipe: not Python's own either
            return cache, "not a regular file"
        if len(head) < _PYC_HEADER or int.from_bytes(head[4:8], "little") != 0:
            return cache, "a hash-based bytecode cache (Python writes none of its own)"
    return _tracked(caches)


def _tracked(paths: list[Path]) -> Optional[tuple[Path, str]]:
    """The first of ``paths`` (files of one folder) that git tracks, and
    why; where git cannot tell (no git, a repository it refuses), the first
    of them."""
    folder = paths[0].parent
    if work_tree(folder) is None:
        return None
    unknown = paths[0], "a bytecode cache that git cannot tell is not committed"
    try:
        ran = subprocess.run(
            ["git", "-c", "core.fsmonitor=false", "ls-files", "-z", "--cached", "--",
             *(path.name for path in paths)],
            cwd=folder, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return unknown
    if ran.returncode != 0:
        return unknown
    tracked = {Path(name.decode("utf-8", "surrogateescape")).name
               for name in ran.stdout.split(b"\0") if name}
    committed = next((path for path in paths if path.name in tracked), None)
    return (committed, "committed to the repository") if committed is not None else None


# -- reading the source --------------------------------------------------------


def _source(module: _Module, op: str) -> bytes:
    with open(module.file, "rb") as f:
        data = f.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        raise Refused(f"{op!r}: {module.shown} is larger than {MAX_SOURCE_BYTES >> 20} MiB")
    return data


def _tree(module: _Module, source: bytes, op: str) -> ast.Module:
    try:
        with warnings.catch_warnings():  # invalid escapes and the like: the import says them
            warnings.simplefilter("ignore")
            return ast.parse(source, filename=module.shown)
    except SyntaxError as exc:
        raise Refused(f"{op!r}: {module.shown}:{exc.lineno or 0}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise Refused(f"{op!r}: {module.shown} cannot be parsed: {type(exc).__name__}") from None


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module's statements, including those under a top-level ``if`` or ``try``."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, (ast.Try, ast.TryStar)):
            for part in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse,
                         stmt.finalbody):
                yield from _top_level(part)


def _defines(top: _Module, module: _Module, tree: ast.Module, name: str, op: str,
             depth: int = 0, seen: Optional[set] = None,
             kinds: tuple[type, ...] = (ast.ClassDef,)) -> bool:
    """Whether ``tree`` (the source of ``module``) defines ``name`` by a
    statement of ``kinds`` (a class), itself or through ``from .x import
    name`` within the package of ``top``."""
    seen = set() if seen is None else seen
    seen.add((module.name, name))
    for stmt in _top_level(tree.body):
        if isinstance(stmt, kinds) and stmt.name == name:
            return True
        if not isinstance(stmt, ast.ImportFrom) or depth >= MAX_REEXPORTS:
            continue
        for alias in stmt.names:
            if (alias.asname or alias.name) != name:
                continue
            target = _imported_module(module, stmt, top.name)
            found = _walk(top, target, op) if target else None
            if found is None or found.file is None or (found.name, alias.name) in seen:
                continue
            try:
                tree = _tree(found, _source(found, op), op)
                if _defines(top, found, tree, alias.name, op, depth + 1, seen, kinds):
                    return True
            except (Refused, OSError):
                continue
    return False


def _imported_module(module: _Module, stmt: ast.ImportFrom, top: str) -> Optional[str]:
    """The dotted module a ``from ... import`` in ``module`` reads, when it
    is within the package ``top``."""
    if stmt.level == 0:
        name = stmt.module or ""
    else:
        package = module.name.split(".") if module.package else module.name.split(".")[:-1]
        if stmt.level - 1 >= len(package):
            return None
        base = package[:len(package) - (stmt.level - 1)]
        name = ".".join([*base, *([stmt.module] if stmt.module else [])])
    return name if name == top or name.startswith(f"{top}.") else None


def _walk(top: _Module, name: str, op: str) -> Optional[_Module]:
    """Module ``name`` of the package ``top``, found on disk (no vetting)."""
    module: Optional[_Module] = top
    for part in name.split(".")[1:]:
        if module is None or not module.package:
            return None
        try:
            module = _child(module, part, op)
        except Refused:
            return None
    return module


# -- importing -------------------------------------------------------------------


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Executes the source mpgen checked: no bytecode cache read or written."""

    def __init__(self, fullname: str, path: str, source: bytes) -> None:
        super().__init__(fullname, path)
        self.source = source

    def get_code(self, fullname):
        with warnings.catch_warnings():  # compiling, as a cached import would not warn
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.source_to_code(self.source, self.path)

    def set_data(self, *args, **kwargs) -> None:
        pass


def _loaded_from(module) -> list[Path]:
    """Where a loaded module came from: its file, then its package folders."""
    places = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or [])]
    return list(dict.fromkeys(Path(p).resolve() for p in places if isinstance(p, str)))


def _same(loaded, module: _Module) -> bool:
    where = module.file if module.file is not None else module.location
    return where.resolve() in _loaded_from(loaded)


def _already_loaded(module: _Module, op: str) -> bool:
    """Whether ``module`` is loaded already, from this very file; refused if
    a module of its name was loaded from elsewhere."""
    loaded = sys.modules.get(module.name)
    if loaded is None:
        return False
    if _same(loaded, module):
        return True
    places = [_text(p) for p in _loaded_from(loaded)] or ["a built-in module"]
    raise Refused(f"{op!r}: a module named {module.name!r} is already loaded (from "
                  f"{places[0]}), not from {module.shown}; rename your module")


def _execute(module: _Module, source: Optional[bytes]):
    """Import ``module`` from its checked source; its parent is imported."""
    if module.file is None:
        spec = importlib.machinery.ModuleSpec(module.name, None, is_package=True)
        spec.submodule_search_locations = [str(module.location)]
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module.name] = loaded
    else:
        loader = _SourceLoader(module.name, str(module.file), source)
        spec = importlib.util.spec_from_file_location(
            module.name, str(module.file), loader=loader,
            submodule_search_locations=[str(module.location)] if module.package else None)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module.name] = loaded
        try:
            loader.exec_module(loaded)
        except BaseException:
            if sys.modules.get(module.name) is loaded:
                del sys.modules[module.name]
            raise
        loaded = sys.modules.get(module.name, loaded)
    parent, _, last = module.name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], last, loaded)
    return loaded


@contextlib.contextmanager
def _tracking_interrupts() -> Iterator[list[int]]:
    """Records a real Ctrl-C (SIGINT) while the block runs, so that it can be
    told from a ``KeyboardInterrupt`` that imported code raises itself."""
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield seen  # signals reach the main thread only
        return

    def handler(signum, frame):
        seen.append(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


class UserCodeExit(RuntimeError):
    """User code (an op's class, run at build time) raised what would end the
    build instead of failing it: ``SystemExit``, ``GeneratorExit``, or a
    ``KeyboardInterrupt`` of its own; the message is ``Type: message``."""


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Run code of the user's (a class's ``__init__`` or ``forward``) so that
    nothing it raises can end the build: a ``BaseException`` that is not an
    ``Exception`` becomes :class:`UserCodeExit`, which the stage reports at
    the layer like any failure. A real Ctrl-C still interrupts."""
    with _tracking_interrupts() as interrupted:
        try:
            yield
        except Exception:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit must never end a check
            if isinstance(exc, KeyboardInterrupt) and interrupted:
                raise
            raise UserCodeExit(_describe(exc)) from None


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception from user code, on one short line
    (a :class:`UserCodeExit` as the exception it stands for)."""
    if isinstance(exc, UserCodeExit):
        return str(exc)
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 - a __str__ of user code
        text = ""
    text = " ".join(text.split())
    text = text if text.isprintable() else ascii(text)
    text = text if len(text) <= 200 else f"{text[:196]}..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def user_class(op: str, project: Project, base: type = nn.Module,
               what: str = "an nn.Module class") -> tuple[type, str]:
    """The class the dotted op names (a subclass of ``base``: ``what``) and
    its module's name, imported under the policy of this module; raises
    :class:`Refused`."""
    parts = op.split(".")
    module_name, class_name = ".".join(parts[:-1]), parts[-1]
    if parts[0] in FORBIDDEN:
        raise Refused(f"{op!r} is not an op: use a torch.nn class name (Linear), "
                      "torch.NAME or F.NAME")
    if parts[0] in sys.stdlib_module_names:
        # Importing it can have effects (``this``), and a layer is the user's class.
        raise Refused(f"{op!r} is in the standard library, not an nn.Module class; a "
                      "dotted op names your own class, e.g. 'mypkg.layers.Gate'")
    if "__main__" in parts:
        raise Refused(f"{op!r} names a '__main__' module, a program's entry point, which "
                      "mpgen never imports; a dotted op names a class of your own module, "
                      "e.g. 'mypkg.layers.Gate'")
    private = next((i for i, p in enumerate(parts) if p.startswith("_")), None)
    if private is not None:
        what = "class" if private == len(parts) - 1 else "module"
        raise Refused(f"{op!r} names a private {what} ({parts[private]!r}); a dotted op names "
                      "a public class of a public module (no part starting with '_')")
    try:
        chain, sources = _checked(op, parts, project)
    except (OSError, RuntimeError) as exc:  # unreadable, a loop of links
        raise Refused(f"{op!r}: cannot read its module: {_describe(exc)}") from None
    try:
        with user_code():  # SystemExit too: never ends the build
            for module, source in zip(chain, sources):
                if not _already_loaded(module, op):
                    _execute(module, source)
            cls = getattr(sys.modules[module_name], class_name, None)
            is_module = inspect.isclass(cls) and issubclass(cls, base)
    except Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the module raised is the op's error
        raise Refused(f"cannot import {module_name!r} for op {op!r}: "
                      f"{_describe(exc)}") from None
    if not is_module:
        raise Refused(f"{op!r} is not {what}")
    return cls, module_name


def _checked(op: str, parts: list[str], project: Project) -> tuple[list[_Module], list]:
    """Every module of the op's path, found and checked before anything
    runs, and the source of each (None for a namespace package)."""
    chain, sources = _located(op, parts[:-1], project)
    for module in chain:
        _already_loaded(module, op)
    target, class_name = chain[-1], parts[-1]
    if target.file is None or not _defines(chain[0], target, _tree(target, sources[-1], op),
                                           class_name, op):
        raise Refused(f"{op!r} is not a class defined in {target.shown}: a dotted op names a "
                      f"class its module defines with 'class {class_name}' or imports with "
                      f"'from .module import {class_name}'")
    return chain, sources


def _located(op: str, parts: list[str], project: Project,
             noun: str = "op") -> tuple[list[_Module], list]:
    """The modules ``parts`` names (a package, its subpackages, the module),
    found on disk and vetted, and the source of each (None for a namespace
    package); nothing is imported."""
    top, allowed, where = _top(project, parts[0], op, noun)
    chain = [top]
    for part in parts[1:]:
        parent = chain[-1]
        if not parent.package:
            raise Refused(f"{op!r}: {parent.shown} is a module, not a package: it has no "
                          f"module {part!r}")
        child = _child(parent, part, op)
        if child is None:
            raise Refused(f"{op!r}: no module {part!r} in "
                          f"{parent.shown.removesuffix('__init__.py')}")
        chain.append(child)
    sources = []
    for module in chain:
        _vet(module, allowed, where, op, own=allowed == project.root)
        sources.append(_source(module, op) if module.file is not None else None)
    return chain, sources


def check_factory(text: str, project: Project, what: str = "data factory",
                  example: str = "mydata:make") -> None:
    """Refuse a data factory (or, as ``what`` says, a metric function)
    ``package.module:function`` that the training
    script may not import (:class:`Refused`): the policy of dotted ops
    (the module in the project or a package listed under ``imports:``; not
    the standard library, ``torch`` or ``mpgen``; no ``__main__`` or private
    part; ``.py`` source files inside the project), and ``function`` defined
    in its source by a top-level ``def`` or ``class`` (or imported there from
    a module of the same package). The source is read and parsed, never run:
    the script imports the module when it runs."""
    module_name, _, function = text.partition(":")
    parts = module_name.split(".")
    own = (f"a {what} is a function of your own module, in the project or in a "
           f"package listed under 'imports:', e.g. {example!r}")
    if parts[0] in FORBIDDEN or parts[0] in sys.stdlib_module_names:
        where = "the standard library" if parts[0] in sys.stdlib_module_names else parts[0]
        raise Refused(f"{text!r} is in {where}; {own}")
    if "__main__" in parts:
        raise Refused(f"{text!r} names a '__main__' module, a program's entry point; {own}")
    private = next((p for p in (*parts, function) if p.startswith("_")), None)
    if private is not None:
        raise Refused(f"{text!r} names a private {'function' if private == function else 'module'}"
                      f" ({private!r}); {own}")
    try:
        chain, sources = _located(text, parts, project, what)
    except (OSError, RuntimeError) as exc:  # unreadable, a loop of links
        raise Refused(f"{text!r}: cannot read its module: {_describe(exc)}") from None
    target = chain[-1]
    if target.file is None or not _defines(chain[0], target, _tree(target, sources[-1], text),
                                           function, text, kinds=(ast.FunctionDef, ast.ClassDef)):
        raise Refused(f"{text!r}: {target.shown} does not define {function!r}: a {what} "
                      f"is a function its module defines with 'def {function}' (or a class) "
                      f"or imports with 'from .module import {function}'")


def project_folder_of(name: str, project: Project) -> Optional[Path]:
    """The folder of the project that the generated code's ``import name``
    (dotted) must be served from, ``mpgen test``'s path entry for its
    top-level module: where this policy finds it, every module of the path
    vetted as an op's are (:class:`Refused` otherwise); None when no folder
    of the project holds its top-level module (the standard library, an
    installed package), which the interpreter's own path then finds."""
    parts = name.split(".")
    if parts[0] in FORBIDDEN or parts[0] in sys.stdlib_module_names:
        return None
    if all(_find(folder, parts[0], None, name) is None for folder in project.search):
        return None
    try:
        chain, _ = _located(name, parts, project, "module")
    except (OSError, RuntimeError) as exc:  # unreadable, a loop of links
        raise Refused(f"{name!r}: cannot read its module: {_describe(exc)}") from None
    return chain[0].folder
