"""The front end: a validated spec -> the IR :class:`~mpgen.compiler.ir.Graph`.

The only part of the compiler that reads ``spec_schema`` types; every later
stage works on the IR alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from mpgen.compiler.frontend import imports
from mpgen.compiler.frontend.limits import check_sizes, check_structure
from mpgen.compiler.frontend.pipeline import resolve_pipeline
from mpgen.compiler.frontend.placement import capacities, placement_request
from mpgen.compiler.frontend.profile import needs_profile, read_profile
from mpgen.compiler.frontend.resolve import resolve
from mpgen.compiler.frontend.training import resolve_train
from mpgen.compiler.ir import Graph
from mpgen.errors import Collector, MpgenError
from mpgen.spec_schema.load import LoadedSpec
from mpgen.spec_schema.models import Spec


def lower(spec: Spec, loaded: LoadedSpec, root: Optional[str | Path] = None,
          profile: bool = True) -> Graph:
    """Layers, training settings, the placement request and the pipeline
    settings, with every mistake of the four reported together; raises
    MpgenError. ``root``: the project a dotted op may import from
    (``frontend.imports``). ``profile``: read ``<spec stem>.profile.yaml``
    beside the spec (``frontend.profile``; ``mpgen profile`` builds without)."""
    check_structure(spec, loaded.source)  # before anything is resolved or built
    graph = resolve(spec, loaded, root)
    errors = Collector()
    try:
        project = imports.Project.of(loaded.path, root, spec.imports or ())
        graph = resolve_train(graph, spec.train, loaded.source, project)
        check_sizes(graph, spec.train, loaded.source)
    except MpgenError as exc:
        errors.extend(exc)
    try:  # without train settings (they failed) the batch size is not checked
        graph = dataclasses.replace(graph, pipeline=resolve_pipeline(spec.pipeline, graph,
                                                                     loaded.source))
    except MpgenError as exc:
        errors.extend(exc)
    try:
        graph = dataclasses.replace(graph, placement=placement_request(spec.placement,
                                                                       loaded.source))
        graph = dataclasses.replace(graph, capacity=capacities(spec.capacity, loaded.source))
    except MpgenError as exc:
        errors.extend(exc)
    if profile:
        try:
            graph = dataclasses.replace(graph, profile=read_profile(loaded.path))
            needs_profile(graph, loaded.source, loaded.path)
        except MpgenError as exc:
            errors.extend(exc)
    errors.raise_if_any()
    return graph
