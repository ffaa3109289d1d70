"""The synthetic target of every loss, from the shape of the output it reads.

Class-index losses take integer targets in ``[0, C)``, shaped like the
output without its class dim. The class dim is the loss's ``class_dim:``
when the spec gives one (negative counts from the end); by default it is
PyTorch's, dim 1 (``[N, C]``, and ``[N, C, H, W]`` for segmentation), except
when dim 1 is symbolic and the last dim is a number: then the last
(``[batch, seq, vocab]``, read flattened to ``[N*seq, vocab]`` as language
models are trained). The class dim must be a number, the count of classes.
``MultiMarginLoss`` takes only ``(N, C)``: its classes are the last dim.
Other losses take targets shaped like the output (see ``frontend.training``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mpgen.compiler.ir import Graph, Loss, TensorType
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
        dim = _class_dim(loss, out, errors)
        if dim is None:
            continue
        losses.append(dataclasses.replace(
            loss, target_type=TensorType(shape[:dim] + shape[dim + 1:], "int64"),
            classes=shape[dim], class_dim=dim, rank=len(shape)))
    errors.raise_if_any()
    train = dataclasses.replace(graph.train, losses=tuple(losses))
    return dataclasses.replace(graph, train=train)


def _class_dim(loss: Loss, out: Optional[TensorType], errors: Collector) -> Optional[int]:
    """The dim of ``out`` holding the classes (module docstring), or None
    after an error."""
    shape = out.shape if out else ()
    rank = len(shape)
    if rank < 2:
        errors.add(loss.pos, f"train.loss: {loss.op} needs an output [N, classes], "
                   f"but {loss.output!r} gives {out}")
        return None
    given = loss.class_dim_given
    if given is None:
        dim = 1 if isinstance(shape[1], int) or not isinstance(shape[-1], int) else rank - 1
        pos = loss.pos
    elif not -rank <= given < rank:
        errors.add(loss.class_dim_pos, f"train.loss.class_dim: {given} is not a dim of output "
                   f"{loss.output!r} {out}, of rank {rank}: expected {-rank} to {rank - 1}")
        return None
    else:
        dim, pos = given % rank, loss.class_dim_pos
    if given is None and not isinstance(shape[dim], int):
        errors.add(pos, f"train.loss: {loss.op} reads the classes from dim 1 of its output "
                   f"(or the last dim, when dim 1 is symbolic), but neither has a fixed size "
                   f"in {loss.output!r} {out}; give the classes a fixed size, or name their "
                   "dim with class_dim")
        return None
    if not isinstance(shape[dim], int):
        errors.add(pos, f"train.loss.class_dim: dim {given} of output {loss.output!r} {out} is "
                   f"{shape[dim]}, not a fixed number of classes")
        return None
    if loss.op == "MultiMarginLoss" and dim != rank - 1:
        errors.add(pos, f"train.loss: MultiMarginLoss takes an output (N, C), its classes on "
                   f"the last dim, but {loss.output!r} {out} has them on dim {dim}; set "
                   "class_dim: -1 to read the last dim, flattened")
        return None
    return dim
