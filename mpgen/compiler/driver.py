"""The compiler driver: load -> validate -> frontend -> analysis -> placement -> codegen.

The library entry point under the commands: :func:`compile_spec` gives the
IR of one spec, :func:`generate` its formatted files, :func:`generate_all`
those of several specs with every error of every spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from mpgen.compiler import frontend, placement
from mpgen.compiler.analysis import costs, shapes, targets
from mpgen.compiler.analysis.budget import Budget
from mpgen.compiler.codegen import common, model, pp, predict, report, tests, train
from mpgen.compiler.codegen import generate as generate_codegen
from mpgen.compiler.codegen.format import check_source
from mpgen.compiler.frontend.eager_torch import eager_torch
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.compiler.ir import Graph
from mpgen.errors import Collector, MpgenError, Position
from mpgen.spec_schema.load import load_file
from mpgen.spec_schema.validate import validate


@dataclass
class Generated:
    """The compiled graph of one spec and its generated files (name -> text)."""

    spec_path: str
    graph: Graph
    files: dict[str, str]


def compile_spec(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
                 root: str | Path | None = None,
                 time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
                 budget: Optional[Budget] = None) -> Graph:
    """Every stage up to the IR with devices and transfers; raises MpgenError.
    ``root``: the project the spec's dotted ops may import from (default: the
    spec's repository; see ``docs/spec.md``, "User modules"). ``time_limit``:
    CPU seconds the build may take once the spec is read (None: no limit;
    ``docs/spec.md``, "Limits"); ``budget``: one already running, whose
    time the caller goes on spending (:func:`generate`)."""
    loaded = load_file(path)
    budget = budget or Budget(time_limit)
    with eager_torch(), budget.active():  # NOTE [No dynamo at build time]
        graph = frontend.lower(validate(loaded), loaded, root)  # bounded by limits.check_structure
        graph = shapes.infer(graph, budget)
        graph = targets.infer_targets(graph)
        graph = costs.measure_graph(graph, budget)
        with budget.task(graph.pos, f"placement of model {graph.name!r}", _TOO_LARGE):
            return placement.place(graph, device_map)


#: Why a build outside the analysis of one layer may run out of its budget.
_TOO_LARGE = "the spec asks for too much work to build in that time"


def generate(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
             root: str | Path | None = None,
             time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Generated:
    """Compile one spec and render its files, the Python ones written in
    black's layout (NOTE [Written in black's layout]) and each proved to
    compile; all under one CPU budget of ``time_limit`` seconds."""
    budget = Budget(time_limit)
    graph = compile_spec(path, device_map, root, budget=budget)
    names = common.file_names(graph)
    renders = {
        names["model"]: model.render_model,
        names["train"]: train.render_train,
        names["test"]: tests.render_test,
        names["pp"]: pp.render_pp,
        names["predict"]: predict.render_predict,
        names["report"]: report.render_report,
    }
    if generate_codegen.wanted(graph):  # a decoder: generate_<name>.py
        renders[names["generate"]] = generate_codegen.render_generate
    files = {}
    with budget.active():
        for name, render in renders.items():
            with budget.task(graph.pos, f"generating {name}", _TOO_LARGE):
                text = render(graph)
                files[name] = text if name == names["report"] else check_source(text, name)
    return Generated(str(path), graph, files)


def generate_all(paths: Iterable[str | Path],
                 device_map: Optional[Mapping[str, str]] = None,
                 root: str | Path | None = None,
                 time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> list[Generated]:
    """Generate every spec (each with its own ``time_limit``); all errors of
    all specs are raised together."""
    errors = Collector()
    results: list[Generated] = []
    for path in paths:
        try:
            results.append(generate(path, device_map, root, time_limit))
        except MpgenError as exc:
            errors.extend(exc)
    check_clashes([Model(r.spec_path, r.graph.name, r.graph.pos, tuple(r.files))
                   for r in results], errors)
    errors.raise_if_any()
    return results


@dataclass(frozen=True)
class Model:
    """What :func:`check_clashes` needs of one built spec."""

    spec_path: str
    name: str  # the model's name
    pos: Position  # where it is written
    files: tuple[str, ...]


def check_clashes(models: Sequence[Model], errors: Collector) -> None:
    """An error in ``errors`` for each model that would generate a file of
    an earlier one."""
    owners: dict[str, Model] = {}
    for model_ in models:
        clash = next((n for n in model_.files if n in owners), None)
        if clash is None:
            owners.update(dict.fromkeys(model_.files, model_))
            continue
        other = owners[clash]
        what = (f"is also the name of the model in {other.spec_path}"
                if model_.name == other.name else
                f"and {other.name!r} in {other.spec_path} have the same file name")
        errors.add(model_.pos, f"name: {model_.name!r} {what}, and both would generate "
                   f"{clash}; give the models different names")
