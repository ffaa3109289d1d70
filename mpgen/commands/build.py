"""``mpgen build`` and ``mpgen check``: generate every spec, then write or compare.

A spec whose files the output folder's manifest shows current is not
compiled (NOTE [Build manifest] in ``output/manifest.py``): this
module imports the compiler (torch, jinja2, black) only when a spec needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

from mpgen.output import manifest
from mpgen.output import runtime
from mpgen.output.write import Changes, Differences, diff_files, write_files
from mpgen.errors import Collector, MpgenError, Position
from mpgen.printed import escaped
from mpgen.spec_schema.digest import display_path
from mpgen.spec_schema.load import read_spec

if TYPE_CHECKING:  # imported where used: a check of current specs needs neither
    from mpgen.compiler.ir import Graph, Node
    from mpgen.compiler.driver import Generated
    from mpgen.spec_schema.models import Spec

#: ``time_limit=...``: the default budget (``frontend.limits.DEFAULT_TIME_LIMIT``),
#: looked up only when a spec is compiled; None: no limit.
TimeLimit = Optional[float] | EllipsisType


@dataclass(frozen=True)
class Built:
    """One spec of a build or check: its files, compiled or current on disk,
    and its manifest entry (NOTE [Build manifest])."""

    spec_path: str  # as given
    files: dict[str, str]  # name -> text
    entry: manifest.Entry  # what the manifest records of this spec's files
    result: Optional[Generated] = None  # None: current, or compiled in a child process
    # build.path_notes of the compiled result (NOTE [User code in a child]:
    # found where the spec's code was imported)
    notes: tuple[str, ...] = ()
    ran_user_code: bool = False  # compiled in a child process: the spec's own code ran
    model: Optional[tuple[str, Position]] = None  # compiled: the model's name, where written

    @property
    def line(self) -> str:
        """The build's line for this spec: ``SPEC: Model, N parameters on ...``."""
        return f"{escaped(self.spec_path)}: {self.entry.summary}"


def _seconds(time_limit: TimeLimit) -> Optional[float]:
    """``time_limit`` with ``...`` as the default budget (imported only now:
    a check of current specs imports no compiler)."""
    from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT

    return DEFAULT_TIME_LIMIT if time_limit is ... else time_limit


def build(paths: Iterable[str | Path], out_dir: str | Path,
          device_map: Optional[Mapping[str, str]] = None, force: bool = False,
          root: str | Path | None = None, time_limit: TimeLimit = ...,
          prune: bool = False) -> tuple[list[Generated], Changes]:
    """Generate all specs, then (only if all succeeded) write the files and
    remove the orphans of these specs (with ``prune``, also those of specs
    that no longer exist), as one unit, with the manifest. ``root`` and
    ``time_limit``: as for ``driver.compile_spec`` (``...``: the default budget).

    Returns what was generated and what changed on disk (and the orphans
    left in place).
    """
    built = _compile(list(paths), device_map, root, time_limit)
    return [b.result for b in built], _write(Path(out_dir), built, device_map, force, prune)


def update(paths: Iterable[str | Path], out_dir: str | Path,
           device_map: Optional[Mapping[str, str]] = None, force: bool = False,
           root: str | Path | None = None, time_limit: TimeLimit = ...,
           prune: bool = False) -> tuple[list[Built], Changes]:
    """``mpgen build``: as :func:`build`, but a spec that the manifest shows
    current (NOTE [Build manifest]) is not compiled; its files on disk stand
    in for the compiled ones. The same files result."""
    built = _gather(list(paths), Path(out_dir), device_map, root, time_limit)
    return built, _write(Path(out_dir), built, device_map, force, prune)


def check(paths: Iterable[str | Path], out_dir: str | Path,
          device_map: Optional[Mapping[str, str]] = None,
          root: str | Path | None = None, time_limit: TimeLimit = ...) -> Differences:
    """What ``build`` would change: a unified diff for every generated file
    that is stale, missing or edited, and each file it would refuse to
    overwrite or would remove (with ``--prune``, for a deleted spec's). Specs
    the manifest shows current are not compiled (NOTE [Build manifest])."""
    return check_specs(paths, out_dir, device_map, root, time_limit)[1]


def check_specs(paths: Iterable[str | Path], out_dir: str | Path,
                device_map: Optional[Mapping[str, str]] = None,
                root: str | Path | None = None,
                time_limit: TimeLimit = ...) -> tuple[list[Built], Differences]:
    """:func:`check`, and each spec as it was checked (``ran_user_code``:
    its check ran the project's own code, in a child process)."""
    before = _state(Path(out_dir))
    built = _gather(list(paths), Path(out_dir), device_map, root, time_limit)
    differences = diff_files(Path(out_dir), _files(built), _specs(built))
    if any(b.ran_user_code for b in built) and _state(Path(out_dir)) != before:
        raise MpgenError(None, f"{escaped(str(out_dir))}: its files changed while check ran the "
                         "project's own code (a spec's module wrote there); check judges the "
                         "tree as it was before, so run it again on an unchanged tree")
    return built, differences


def _state(out_dir: Path) -> Optional[list[tuple]]:
    """Every entry under ``out_dir`` as ``lstat`` sees it (kind, inode,
    size, times of change): what check compares, taken before any child
    runs the project's code and again after, so that a child that writes
    there cannot change what check judges (NOTE [A contained child] in
    ``commands/isolate.py``: where the child cannot be given a read-only
    tree). A change of content changes ``st_ctime_ns``, which no call can
    set back. None where ``out_dir`` is not there."""
    import os

    found = []

    def add(path: str) -> None:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            found.append((path, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns,
                          st.st_ctime_ns))

    if not out_dir.is_dir():
        return None
    for folder, dirs, names in os.walk(out_dir):
        dirs.sort()
        for name in sorted(dirs + names):
            add(os.path.join(folder, name))
    return found


def _write(out_dir: Path, built: list[Built], device_map: Optional[Mapping[str, str]],
           force: bool, prune: bool) -> Changes:
    return write_files(out_dir, _files(built), _specs(built), force, prune,
                       [b.entry for b in built])


def _key(digest: str, device_map: Optional[Mapping[str, str]]) -> str:
    # In the map's order: the header lists it so.
    return manifest.build_key(digest, list((device_map or {}).items()))


def _files(built: Iterable[Built]) -> dict[str, str]:
    """Every spec's files, and the runtime folder they share (NOTE [One
    runtime per output folder])."""
    files = {n: t for b in built for n, t in b.files.items()}
    return {**files, **runtime.files()} if files else files


def _specs(built: Iterable[Built]) -> dict[str, str]:
    """Each spec as the generated headers name it -> its path."""
    return {b.entry.spec: b.spec_path for b in built}


def spec_text(path: str | Path) -> Optional[str]:
    try:
        return read_spec(path)
    except MpgenError:
        return None


def compiled(result: Generated, device_map: Optional[Mapping[str, str]],
             before: Optional[str] = None, out_dir: str | Path | None = None) -> Built:
    """``result`` as the manifest records it. ``before``: the spec's text read
    before the compile; its hash is recorded only when the file still holds
    it (a spec edited during the build is never taken as built). ``out_dir``:
    where its code will run from, for its path notes."""
    text = spec_text(result.spec_path)
    source = manifest.sha256(text.encode("utf-8")) if text is not None and text == before else None
    graph = result.graph
    user_code = any(_user_nodes(graph)) or bool(graph.train and graph.train.modules)
    entry = manifest.entry(graph.spec_path, _key(graph.spec_hash, device_map), result.files,
                           _summary(graph), source, graph.spec_hash, user_code)
    from mpgen.compiler.analysis.schedule import profile_notes
    from mpgen.compiler.codegen.pp import batch_norm_notes, memory_notes
    from mpgen.compiler.codegen.generate import cache_notes

    notes = tuple(path_notes([result], out_dir)) if out_dir is not None else ()
    notes += tuple(batch_norm_notes(graph)) + tuple(profile_notes(graph))
    notes += tuple(memory_notes(graph))
    notes += tuple(cache_notes(graph))
    return Built(result.spec_path, result.files, entry, result, notes, False,
                 (graph.name, graph.pos))


#: How a spec names torch's own functions: a dotted op with another prefix is
#: a class or function of the user's code.
_TORCH_SPELLINGS = ("torch.", "F.", "nn.")


def _ops(spec: Spec) -> Iterable[str]:
    """Every name a spec resolves to code: layer ops (of the model and of its
    blocks), the losses, the optimizer and the schedule."""
    for layers in (spec.layers, *(block.layers for block in spec.blocks.values())):
        yield from (layer.op for layer in layers.values())
    train = spec.train
    if train is None:
        return
    losses = train.loss.values() if isinstance(train.loss, dict) else [train.loss]
    yield from (loss.op for loss in losses)
    yield train.optimizer.op
    if train.scheduler is not None:
        yield train.scheduler.op


def names_user_code(spec: Spec) -> bool:
    """Whether the spec imports code of the user's (``imports:``, or a dotted
    op, loss, optimizer or schedule that is not torch's), whose changes the
    spec's digest cannot see. A data factory does not count: the build never
    imports it (the generated script does, at run time)."""
    return bool(spec.imports) or any(
        "." in op and not op.startswith(_TORCH_SPELLINGS) for op in _ops(spec))


def _has_profile(path: str | Path) -> bool:
    """A profile beside the spec (``mpgen profile``) shapes its files and is
    not in its digest: such a spec is always compiled."""
    spec = Path(path)
    return spec.with_name(f"{spec.stem}.profile.yaml").exists()


def _current(path: str | Path, out_dir: Path, entries: Mapping[str, manifest.Entry],
             device_map: Optional[Mapping[str, str]]) -> Optional[Built]:
    """The spec at ``path`` as its files in ``out_dir`` hold it, when the
    manifest shows them current; None when it must be compiled (anything
    wrong with the spec is then reported by the compile). A spec whose text
    is the one built is not even parsed; another text is current when its
    meaning is (NOTE [Build manifest])."""
    found = entries.get(display_path(path))
    if found is None or found.user_code or _has_profile(path):
        return None
    text = spec_text(path)
    if text is None:
        return None
    source = manifest.sha256(text.encode("utf-8"))
    if source == found.source:
        digest = found.digest
    else:
        from mpgen.spec_schema.digest import spec_digest
        from mpgen.spec_schema.load import load_text
        from mpgen.spec_schema.validate import validate

        try:
            spec = validate(load_text(text, str(path)))
        except MpgenError:
            return None
        if names_user_code(spec):
            return None
        digest = spec_digest(spec)
    if found.key != _key(digest, device_map):
        return None
    texts = manifest.current_files(out_dir, found)
    if texts is None:
        return None
    # Recorded with this text, so that the next check need not parse it.
    return Built(str(path), texts, dataclasses.replace(found, source=source))


def _gather(paths: list[str | Path], out_dir: Path,
            device_map: Optional[Mapping[str, str]], root: str | Path | None,
            time_limit: TimeLimit) -> list[Built]:
    """Every spec, from the manifest where current, else compiled; in order.
    Two specs whose files share a name are compiled together, so that the
    compiler reports the clash."""
    entries = manifest.read(out_dir)
    current = [_current(p, out_dir, entries, device_map) for p in paths]
    names = [n for b in current if b is not None for n in b.files]
    if len(set(names)) < len(names):
        current = [None] * len(paths)
    missed = [p for p, b in zip(paths, current) if b is None]
    if not missed:
        return current
    fresh = iter(_compile(missed, device_map, root, time_limit, out_dir))
    built = [b if b is not None else next(fresh) for b in current]
    every = [n for b in built for n in b.files]
    if len(set(every)) < len(every):  # a compiled spec clashes with a current one
        return _compile(paths, device_map, root, time_limit, out_dir)
    return built


def _compile(paths: list[str | Path], device_map: Optional[Mapping[str, str]],
             root: str | Path | None, time_limit: TimeLimit,
             out_dir: Optional[Path] = None) -> list[Built]:
    """Every spec compiled (the compiler reports clashes between them).
    With ``out_dir`` (``mpgen build`` and ``check``), a spec that names code
    of its own is compiled in a child process (NOTE [User code in a child]),
    the others in this one; ``out_dir``: where the generated code will run
    from, for the path notes."""
    from mpgen.compiler.driver import Model, check_clashes, generate

    errors = Collector()
    built: list[Built] = []
    # Every spec read before any of them runs code: one spec's module
    # cannot change what another's check reads (NOTE [User code in a child]).
    texts = [spec_text(path) for path in paths]
    for path, text in zip(paths, texts):
        facts = None if out_dir is None else child_facts(path, text)
        try:
            if facts is None:
                result = generate(path, device_map, root, _seconds(time_limit))
                built.append(compiled(result, device_map, text, out_dir))
            else:
                built.append(_compile_in_child(str(path), device_map, root, time_limit,
                                               out_dir, *facts, text))
        except MpgenError as exc:
            errors.extend(exc)
    check_clashes([Model(b.spec_path, *b.model, tuple(b.files)) for b in built], errors)
    errors.raise_if_any()
    return built


def child_facts(path: str | Path, text: Optional[str]) -> Optional[tuple[str, Position]]:
    """For a spec that names code of its own: its digest and where its name
    is written, computed here without running that code; None for any
    other spec (and for one that does not load or validate: compiling it
    here reports why, before anything is imported)."""
    from mpgen.spec_schema.digest import spec_digest
    from mpgen.spec_schema.load import load_text
    from mpgen.spec_schema.validate import validate

    if text is None:
        return None
    try:
        loaded = load_text(text, str(path))
        spec = validate(loaded)
    except MpgenError:
        return None
    if not names_user_code(spec):
        return None
    return spec_digest(spec), loaded.source.value(("name",))


def _compile_in_child(path: str, device_map: Optional[Mapping[str, str]],
                      root: str | Path | None, time_limit: TimeLimit, out_dir: Path,
                      digest: str, name_pos: Position, text: Optional[str]) -> Built:
    from mpgen.commands import isolate

    child = isolate.generate(path, device_map, root, _seconds(time_limit), out_dir, digest,
                             name_pos, text)
    entry = manifest.Entry(**child.entry)
    return Built(path, child.files, entry, None, child.notes, True, (child.name, child.pos))


def _summary(graph: Graph) -> str:
    """``Model, N parameters on cuda:0 (a), cuda:1 (b); T transfers in forward``."""
    devices = ", ".join(f"{d} ({n:,})" for d, n in graph.params_by_device().items())
    moves = len(graph.plan.transfers)
    trainable = (f" ({graph.trainable_params:,} trainable)" if graph.frozen_params else "")
    return (f"{graph.name}, {graph.total_params:,} parameters{trainable} on "
            f"{devices}; {moves} transfer{'s' if moves != 1 else ''} in forward")


def _user_nodes(graph: Graph) -> Iterable[Node]:
    """Layers of the model and of its blocks whose op is a user module."""
    from mpgen.compiler.ir import OpKind

    for node in [*graph.nodes, *(n for b in graph.blocks for n in b.nodes)]:
        if node.op.kind is OpKind.USER and node.op.module:
            yield node


def _import_root(module: str) -> Optional[Path]:
    """The folder the top-level package (or module) of ``module`` was
    imported from at build time: the entry it needs on ``sys.path``."""
    top = sys.modules.get(module.split(".")[0])
    if top is None:
        return None
    paths = list(getattr(top, "__path__", None) or [])
    if paths:
        return Path(paths[0]).resolve().parent
    file = getattr(top, "__file__", None)
    return Path(file).resolve().parent if file else None


def _importable_everywhere(root: Path) -> bool:
    """Whether ``root`` is on the path of every Python run here (installed
    packages, PYTHONPATH); the working directory does not count: the
    generated code runs from its own folder."""
    cwd = Path.cwd().resolve()
    for entry in sys.path:
        if entry in ("", "."):
            continue
        try:
            path = Path(entry).resolve()
        except OSError:
            continue
        if path == root and path != cwd:
            return True
    return False


def missing_roots(result: Generated, out_dir: str | Path) -> list[tuple[Node, Path]]:
    """The folders the generated code of ``result`` needs on ``PYTHONPATH``
    when run from ``out_dir``: each user module's import root (as found at
    build time) that is not importable from there, with the first layer
    that uses it."""
    out = Path(out_dir).resolve()
    found: dict[Path, Node] = {}
    for node in _user_nodes(result.graph):
        root = _import_root(node.op.module)
        if root is None or root in found or root == out or _importable_everywhere(root):
            continue
        found[root] = node
    return [(node, root) for root, node in found.items()]


def path_notes(results: Iterable[Generated], out_dir: str | Path) -> list[str]:
    """``SPEC:LINE:COL: note: ...`` for each user module the generated code
    imports but cannot find when run from ``out_dir`` (it was found next to
    the spec or in the working directory at build time): what to put on
    ``PYTHONPATH``. The generated files themselves name no folder, so that
    they stay the same wherever they are built."""
    from mpgen.compiler.codegen.common import file_names

    notes = []
    for result in results:
        for node, root in missing_roots(result, out_dir):
            top = node.op.module.split(".")[0]
            train = shlex.quote(str(Path(out_dir) / file_names(result.graph)["train"]))
            tests = shlex.quote(str(Path(out_dir) / file_names(result.graph)["test"]))
            path = shlex.quote(str(root))
            notes.append(
                f"{node.pos}: note: the generated code imports {top!r} (op "
                f"{node.op.spelled!r}), which mpgen found in {root} at build time; it is "
                f"not importable from {out_dir}, so run the generated code and tests with "
                f"PYTHONPATH={path} (e.g. PYTHONPATH={path} python {train}, "
                f"PYTHONPATH={path} pytest {tests})")
    return notes
