"""The synthetic target of every loss, from the shape of the output it reads.

Class-index losses take integer targets in ``[0, C)`` with the classes on the
output's last dim; an output with more dims (``[batch, seq, vocab]``) is
flattened to ``[N*seq, vocab]``, as language models are trained. Other
losses take targets shaped like the output (see ``frontend.training``).
"""

from __future__ import annotations

import dataclasses

from mpgen.compiler.ir import Graph, TensorType
from mpgen.errors import Collector


def infer_targets(graph: Graph) -> Graph:
    """The graph with every loss's target type; raises MpgenError when a
    class-index loss reads an output without a class dim."""
    errors = Collector()
    losses = []
    for loss in graph.train.losses:
        out = graph.type_of(loss.output)
        shape = out.shape if out else ()
        if loss.target != "classes":
            losses.append(dataclasses.replace(loss, target_type=TensorType(tuple(shape))))
            continue
        if len(shape) < 2 or not isinstance(shape[-1], int):
            errors.add(loss.pos, f"train.loss: {loss.op} needs an output [N, classes], "
                       f"but {loss.output!r} gives {out}")
            continue
        losses.append(dataclasses.replace(loss, target_type=TensorType(tuple(shape[:-1]), "int64"),
                                          classes=shape[-1], class_dim=len(shape) - 1,
                                          rank=len(shape)))
    errors.raise_if_any()
    train = dataclasses.replace(graph.train, losses=tuple(losses))
    return dataclasses.replace(graph, train=train)
