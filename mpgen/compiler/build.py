"""The pipeline: load -> validate -> resolve -> shapes -> place -> render.

This is the library entry point under the CLI: :func:`compile_spec` gives the
IR of one spec, :func:`generate` the formatted files, :func:`build` and
:func:`check` do it for several specs and write or compare the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from mpgen.compiler import (
    auto_placement,
    costs,
    placement,
    render,
    report,
    resolve,
    shapes,
    training,
)
from mpgen.compiler.format import format_source
from mpgen.compiler.ir import Graph
from mpgen.compiler.write import diff_files, write_files
from mpgen.errors import Collector, MpgenError
from mpgen.spec_schema.load import load_file
from mpgen.spec_schema.validate import validate


@dataclass
class Generated:
    """The compiled graph of one spec and its generated files (name -> text)."""

    spec_path: str
    graph: Graph
    files: dict[str, str]


def compile_spec(path: str | Path, device_map: Optional[Mapping[str, str]] = None) -> Graph:
    """Every stage up to the IR with devices and transfers; raises MpgenError."""
    loaded = load_file(path)
    spec = validate(loaded)
    graph = resolve.resolve(spec, loaded)
    graph = shapes.infer(graph)
    graph = training.resolve_train(graph, spec.train, loaded.source)
    graph = costs.measure_graph(graph)
    if spec.placement is not None and spec.placement.auto is not None:
        return auto_placement.place_auto(graph, spec.placement.auto, loaded.source,
                                         dict(device_map or {}))
    return placement.place_explicit(graph, spec.placement, loaded.source,
                                    dict(device_map or {}))


def generate(path: str | Path, device_map: Optional[Mapping[str, str]] = None) -> Generated:
    """Compile one spec and render its files, formatted."""
    graph = compile_spec(path, device_map)
    names = render.file_names(graph)
    sources = {
        names["model"]: render.render_model(graph),
        names["train"]: render.render_train(graph),
        names["test"]: render.render_test(graph),
        names["report"]: report.render_report(graph),
    }
    files = {name: format_source(text, name) if name.endswith(".py") else text
             for name, text in sources.items()}
    return Generated(str(path), graph, files)


def generate_all(paths: Iterable[str | Path],
                 device_map: Optional[Mapping[str, str]] = None) -> list[Generated]:
    """Generate every spec; all errors of all specs are raised together."""
    errors = Collector()
    results: list[Generated] = []
    owners: dict[str, Generated] = {}
    for path in paths:
        try:
            result = generate(path, device_map)
        except MpgenError as exc:
            errors.extend(exc)
            continue
        clash = next((n for n in result.files if n in owners), None)
        if clash is not None:
            other = owners[clash]
            name, other_name = result.graph.name, other.graph.name
            what = (f"is also the name of the model in {other.spec_path}"
                    if name == other_name else
                    f"and {other_name!r} in {other.spec_path} have the same file name")
            errors.add(result.graph.pos, f"name: {name!r} {what}, and both would generate "
                       f"{clash}; give the models different names")
            continue
        owners.update(dict.fromkeys(result.files, result))
        results.append(result)
    errors.raise_if_any()
    return results


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
