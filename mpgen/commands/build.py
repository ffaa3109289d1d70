"""``mpgen build`` and ``mpgen check``: generate every spec, then write or compare."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Optional

from mpgen.compiler.codegen.write import diff_files, write_files
from mpgen.compiler.pipeline import Generated, generate_all


def build(paths: Iterable[str | Path], out_dir: str | Path,
          device_map: Optional[Mapping[str, str]] = None) -> tuple[list[Generated], list[Path]]:
    """Generate all specs, then (only if all succeeded) write the files.

    Returns what was generated and the files that changed on disk.
    """
    results = generate_all(paths, device_map)
    files = {n: t for r in results for n, t in r.files.items()}
    return results, write_files(Path(out_dir), files)


def summary_line(result: Generated) -> str:
    """``spec: Model, N parameters on cuda:0 (a), cuda:1 (b); T transfers in forward``."""
    graph = result.graph
    devices = ", ".join(f"{d} ({n:,})" for d, n in graph.params_by_device().items())
    moves = len(graph.plan.transfers)
    return (f"{result.spec_path}: {graph.name}, {graph.total_params:,} parameters on "
            f"{devices}; {moves} transfer{'s' if moves != 1 else ''} in forward")


def check(paths: Iterable[str | Path], out_dir: str | Path,
          device_map: Optional[Mapping[str, str]] = None) -> list[str]:
    """Unified diffs for every generated file that is stale, missing or edited."""
    diffs: list[str] = []
    for result in generate_all(paths, device_map):
        diffs.extend(diff_files(Path(out_dir), result.files))
    return diffs
