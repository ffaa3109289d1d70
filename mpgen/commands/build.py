"""``mpgen build`` and ``mpgen check``: generate every spec, then write or compare."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional

from mpgen.compiler.codegen.common import file_names
from mpgen.compiler.codegen.write import Changes, Differences, diff_files, write_files
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.compiler.ir import Graph, Node, OpKind
from mpgen.compiler.pipeline import Generated, generate_all


def build(paths: Iterable[str | Path], out_dir: str | Path,
          device_map: Optional[Mapping[str, str]] = None, force: bool = False,
          root: str | Path | None = None,
          time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
          prune: bool = False) -> tuple[list[Generated], Changes]:
    """Generate all specs, then (only if all succeeded) write the files and
    remove the orphans of these specs (with ``prune``, also those of specs
    that no longer exist), as one unit. ``root`` and ``time_limit``: as for
    ``pipeline.compile_spec``.

    Returns what was generated and what changed on disk (and the orphans
    left in place).
    """
    results = generate_all(paths, device_map, root, time_limit)
    return results, write_files(Path(out_dir), _files(results), _specs(results), force, prune)


def _files(results: Iterable[Generated]) -> dict[str, str]:
    return {n: t for r in results for n, t in r.files.items()}


def _specs(results: Iterable[Generated]) -> dict[str, str]:
    """Each spec as the generated headers name it -> its path."""
    return {r.graph.spec_path: r.spec_path for r in results}


def summary_line(result: Generated) -> str:
    """``spec: Model, N parameters on cuda:0 (a), cuda:1 (b); T transfers in forward``."""
    graph = result.graph
    devices = ", ".join(f"{d} ({n:,})" for d, n in graph.params_by_device().items())
    moves = len(graph.plan.transfers)
    return (f"{result.spec_path}: {graph.name}, {graph.total_params:,} parameters on "
            f"{devices}; {moves} transfer{'s' if moves != 1 else ''} in forward")


def check(paths: Iterable[str | Path], out_dir: str | Path,
          device_map: Optional[Mapping[str, str]] = None,
          root: str | Path | None = None,
          time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Differences:
    """What ``build`` would change: a unified diff for every generated file
    that is stale, missing or edited, and each file it would refuse to
    overwrite or would remove (with ``--prune``, for a deleted spec's)."""
    results = generate_all(paths, device_map, root, time_limit)
    return diff_files(Path(out_dir), _files(results), _specs(results))


def _user_nodes(graph: Graph) -> Iterable[Node]:
    """Layers of the model and of its blocks whose op is a user module."""
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
