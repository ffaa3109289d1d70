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

A class dim left to the default rule is refused where it reads dim 1 of an
output that holds a score per position of an input (``[batch, 32, 96]``
from token ids ``[batch, 32]``): the classes are surely its last dim, and
the message says ``class_dim: -1``.

A target whose batch dim sits inside a product (``[seq*batch]``: an output
``[seq, batch, vocab]`` reshaped to ``[seq*batch, vocab]``, as pytorch/examples'
word language model trains) is stacked like its output: the layer that
flattened the product is found by walking back from the output, and the
order of its separate dims there (``seq`` then ``batch``: index
``s*batch + b``) says where the samples go (``Loss.flat_batch``). A product
whose order the build cannot find is refused at the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mpgen.compiler.ir import Graph, Loss, SymDim, TensorType
from mpgen.errors import Collector


def infer_targets(graph: Graph) -> Graph:
    """The graph with every loss's target type; raises MpgenError when a
    class-index loss reads an output without a class dim."""
    errors = Collector()
    losses = []
    for loss in graph.train.losses:
        out = graph.type_of(loss.output)
        shape = out.shape if out else ()
        if out is not None and loss.module is None and not _floating(out.dtype):
            if loss.written:
                errors.add(loss.pos, f"train.loss: {loss.op} needs a floating-point output to "
                           f"train through, but {loss.output!r} {out} is {out.dtype}: no "
                           "gradient flows back through it; give the loss the floating-point "
                           "output before the argmax, comparison or cast, or leave this output "
                           "out of train.loss")
                continue
            if any(_floating(graph.type_of(other.output).dtype) for other in graph.train.losses):
                continue  # the default loss trains the outputs that carry gradients
            # no output carries a gradient: placement's check names the output at its layer
        if loss.target != "classes":
            target = dataclasses.replace(loss, target_type=TensorType(tuple(shape)))
        else:
            dim = _class_dim(graph, loss, out, errors)
            if dim is None:
                continue
            target = dataclasses.replace(
                loss, target_type=TensorType(shape[:dim] + shape[dim + 1:], "int64"),
                classes=shape[dim], class_dim=dim, rank=len(shape))
        target = _flat_batch(graph, target, errors)
        if target is not None:
            losses.append(target)
    errors.raise_if_any()
    train = dataclasses.replace(graph.train, losses=tuple(losses))
    for column in train.metric_columns():  # top-k of fewer than k classes
        metric, loss = column.metric, train.losses[column.loss]
        if metric.op == "top_k_accuracy" and isinstance(loss.classes, int) \
                and metric.k >= loss.classes:
            errors.add(metric.pos, f"train.metrics: {column.name} of {loss.output!r}, which has "
                       f"{loss.classes} classes: k must be fewer than the classes")
    errors.raise_if_any()
    return dataclasses.replace(graph, train=train)


def _class_dim(graph: Graph, loss: Loss, out: Optional[TensorType],
               errors: Collector) -> Optional[int]:
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
    per_token = _scores_per_position(graph, out) if given is None and dim != rank - 1 else None
    if per_token is not None and isinstance(shape[-1], int):
        name, tokens = per_token
        errors.add(pos, f"train.loss: {loss.op} reads the classes on dim {dim} of {loss.output!r} "
                   f"{out} ({shape[dim]} classes, targets "
                   f"{TensorType(shape[:dim] + shape[dim + 1:])}), but {loss.output!r} holds a "
                   f"score per position of input {name!r} {tokens}: set class_dim: -1 for "
                   f"{shape[-1]} classes on the last dim (targets "
                   f"{TensorType(shape[:-1])}), or class_dim: {dim} to keep dim {dim}")
        return None
    return dim


def _scores_per_position(graph: Graph, out: TensorType) -> Optional[tuple[str, TensorType]]:
    """An input ``out`` gives scores for, position by position: token ids
    shaped like ``out`` without its last dim (``[batch, 32]`` for ``[batch,
    32, 96]``), or features ``[batch, 32, 10]`` mapped to another last dim.
    None: no such input."""
    shape = out.shape
    if len(shape) < 3:
        return None
    for t in graph.inputs:
        given = t.type.shape
        floating = _floating(t.type.dtype)
        if (not floating and given == shape[:-1]) or (
                floating and len(given) == len(shape) and given[:-1] == shape[:-1]
                and given[-1] != shape[-1]):
            return t.name, t.type
    return None


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _is_batch(dim) -> bool:
    return isinstance(dim, SymDim) and dim.symbols == ("batch",) and dim.factor == 1


def _flat_batch(graph: Graph, loss: Loss, errors: Collector) -> Optional[Loss]:
    """``loss`` with ``flat_batch`` when its target's batch dim sits inside a
    product (module docstring); None after an error."""
    target = loss.target_type
    if target.batch_dim is not None:
        return loss
    flat = [k for k, d in enumerate(target.shape)
            if isinstance(d, SymDim) and d.known and "batch" in d.symbols]
    if not flat:
        return loss
    k, dim = flat[0], target.shape[flat[0]]
    place = _flattened_order(graph, loss.output, dim)
    if place is None:
        errors.add(loss.pos, f"train.loss: the target of {loss.output!r} is {target}, its "
                   f"samples inside {dim}, and the build finds no layer that flattened "
                   f"{dim} from separate dims with batch first or last, so it cannot tell "
                   f"where each sample's targets go; return {loss.output!r} with a batch dim "
                   "of its own (class_dim: -1 reads [batch, seq, vocab] flattened)")
        return None
    return dataclasses.replace(loss, flat_batch=(k, place))


def _flattened_order(graph: Graph, name: str, dim: SymDim) -> Optional[int]:
    """Where the batch sits in the product ``dim`` of value ``name``: 0 when
    its outer factor, 1 when its inner one, found at the layer that merged
    separate dims into it (walking back through the layers that keep it);
    None: not found, or the batch in the middle."""
    seen = set()
    while name not in seen:
        seen.add(name)
        node = graph.producer(name)
        if node is None:
            return None
        types = []
        for value in node.inputs:
            try:
                types.append((value, graph.type_of(value)))
            except KeyError:
                continue
        keeping = [v for v, t in types if t is not None and dim in t.shape]
        if keeping:
            name = keeping[0]
            continue
        for _, t in types:
            if t is None:
                continue
            for run in _runs(t.shape, dim):
                if _is_batch(run[0]):
                    return 0
                if _is_batch(run[-1]):
                    return 1
        return None
    return None


def _runs(shape: tuple, dim: SymDim) -> list[tuple]:
    """The runs of at least two adjacent dims of ``shape`` whose product is ``dim``."""
    found = []
    for i in range(len(shape)):
        symbols, factor = [], 1
        for j in range(i, len(shape)):
            d = shape[j]
            if isinstance(d, int):
                factor *= d
            elif d.known:
                symbols += d.symbols
                factor *= d.factor
            else:
                break
            if j > i and sorted(symbols) == sorted(dim.symbols) and factor == dim.factor:
                found.append(shape[i:j + 1])
    return found
