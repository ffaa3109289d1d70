"""Placement: a device for every layer instance, then the transfer plan.

``explicit`` resolves the explicit form, ``auto`` chooses the layout by the
unit costs (``partition`` is the exact optimiser), ``transfers`` plans the
``.to()`` calls of forward, and ``devices`` applies ``--device-map``;
``memory`` plans every device's memory (``graph.memory``) and checks it
against the capacities the spec states.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from mpgen.compiler.ir import AutoPlacement, Graph
from mpgen.errors import ErrorList
from mpgen.compiler.placement.auto import place_auto
from mpgen.compiler.placement.explicit import place_explicit
from mpgen.compiler.placement.memory import check_capacity, plan
from mpgen.compiler.placement.pipelining import check_pipeline
from mpgen.compiler.placement.training import check_training


def place(graph: Graph, device_map: Optional[Mapping[str, str]] = None) -> Graph:
    """The graph with devices, its :class:`~mpgen.compiler.ir.Layout` and
    :class:`~mpgen.compiler.ir.ForwardPlan`; raises MpgenError."""
    device_map = dict(device_map or {})
    if isinstance(graph.placement, AutoPlacement):
        placed = place_auto(graph, graph.placement, device_map)
    else:
        placed = place_explicit(graph, graph.placement, device_map)
    check_training(placed)
    placed = check_pipeline(placed)
    placed = dataclasses.replace(placed, memory=plan(placed))
    errors = check_capacity(placed)
    if errors:
        raise errors[0] if len(errors) == 1 else ErrorList(errors)
    return placed
