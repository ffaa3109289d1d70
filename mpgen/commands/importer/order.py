"""The layer order of ``mpgen import``: an order of the data flow that gives
the original's parameter order (NOTE [Parameter order])."""

from __future__ import annotations

from mpgen.commands.importer.layers import Layer, flat


# NOTE: [Parameter order]
# The generated model registers its layers in spec order, so its
# ``parameters()`` are the layers' parameters in that order (a tie adds
# none). The imported model must give them in the original's order, so that
# ``zip(original.parameters(), generated.parameters())`` pairs them. The
# layers start in execution order; when that order does not give the
# original's parameter order, they are re-sorted topologically, each ready
# layer taken by the earliest original parameter it or a layer reading it
# holds. Folding repeats keeps the order (a run is contiguous). When no
# order of the data flow can match (a module registered before one whose
# output it reads), the spec is still written and :attr:`Imported.notes`
# says so.

def param_order(layers: list[Layer]) -> list[int]:
    """The ids of the parameters the layers hold, in order (ties left out)."""
    seen: dict[int, None] = {}
    for layer in layers:
        if layer.module is not None:
            for pname, p in layer.module.named_parameters():
                if pname not in layer.tie:
                    seen.setdefault(id(p))
    return list(seen)


def reorder(layers: list[Layer], rank: dict[int, int]) -> list[Layer]:
    """Layers in an order of the data flow that follows the original's
    parameter order where it can (NOTE [Parameter order])."""
    producer: dict[str, Layer] = {}
    for layer in layers:
        producer[layer.name] = layer
        for leaf in flat(layer.elements or []):
            if leaf.name:
                producer[leaf.name] = layer
    deps = {id(l): {id(producer[r]) for r in l.reads if r in producer} for l in layers}
    readers: dict[int, list[Layer]] = {id(l): [] for l in layers}
    for layer in layers:
        for d in deps[id(layer)]:
            readers[d].append(layer)
    inf = len(rank) + 1
    key: dict[int, int] = {}
    for layer in reversed(layers):  # the earliest parameter it or a later reader holds
        own = min((rank.get(id(p), inf) for p in (layer.module.parameters()
                                                  if layer.module is not None else ())),
                  default=inf)
        key[id(layer)] = min([own, *(key[id(r)] for r in readers[id(layer)])])
    index = {id(l): i for i, l in enumerate(layers)}
    done: set[int] = set()
    result = []
    while len(result) < len(layers):
        ready = [l for l in layers if id(l) not in done and deps[id(l)] <= done]
        chosen = min(ready, key=lambda l: (key[id(l)], index[id(l)]))
        done.add(id(chosen))
        result.append(chosen)
    return result
