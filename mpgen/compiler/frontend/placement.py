"""``placement:`` -> the IR's placement request, with positions for errors.

The request says what the spec asks for; the ``placement`` stage resolves it
against the layers and their costs. Device keys of ``capacity`` and ``speed``
must be among ``devices``: that is checked here, as part of the spec.
"""

from __future__ import annotations

from typing import Optional

from mpgen.compiler.ir import (AutoPlacement, Capacity, ExplicitPlacement, PlacementEntry,
                               PlacementRequest)
from mpgen.errors import Collector
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import PlacementSpec


def placement_request(spec: Optional[PlacementSpec], source: SourceMap) -> PlacementRequest:
    """The explicit entries, or the automatic settings; raises MpgenError."""
    if spec is None:
        return ExplicitPlacement()
    auto = spec.auto
    if auto is None:
        return ExplicitPlacement(tuple(
            PlacementEntry(key, device, source.key(("placement", key)))
            for key, device in spec.explicit.items()))
    errors = Collector()
    for field in ("capacity", "speed"):
        for device in getattr(auto, field):
            if device not in auto.devices:
                errors.add(source.key(("placement", "auto", field, device)),
                           f"placement.auto.{field}: {device!r} is not one of the devices "
                           f"({', '.join(auto.devices)})")
    errors.raise_if_any()
    return AutoPlacement(
        devices=tuple(auto.devices),
        balance=auto.balance,
        capacity=tuple((d, int(c)) for d, c in auto.capacity.items()),
        speed=tuple((d, float(s)) for d, s in auto.speed.items()),
        pos=source.key(("placement",)),
    )


def capacities(given: Optional[dict], source: SourceMap) -> tuple[Capacity, ...]:
    """The top-level ``capacity:``: device -> bytes, each with its key's position."""
    return tuple(Capacity(device, int(size), source.key(("capacity", device)))
                 for device, size in (given or {}).items())
