"""IR -> ``predict_<name>.py``: the model run forward over data, for the runtime.

The loop, its flags, the weights (--checkpoint, --init), the data and the
file of outputs are the output folder's ``mpgen_runtime.predict``
(``mpgen/runtime/predict.py``, NOTE [Predicting in batches]); the inputs,
their shapes and the loss are train_<name>.py's ``TRAINING``. This file
writes what only the spec knows beyond those: the model's outputs in the
order it returns them, where each holds its samples, which losses score
classes, and the attribute of the model's own micro-batched forward.
"""

from __future__ import annotations

from typing import Optional

from mpgen.compiler.codegen import train as train_codegen
from mpgen.compiler.codegen.common import _tuple, file_names, header, literal, tuple_literal
from mpgen.compiler.codegen.writer import PythonWriter
from mpgen.compiler.frontend.namespace import Namespace
from mpgen.compiler.ir import Graph

RUNTIME = train_codegen.RUNTIME


def output_layout(graph: Graph, name: str) -> "Optional[int] | tuple[int, int]":
    """Where output ``name`` holds its samples: its batch dim; inside a
    product (``[seq*batch, vocab]``), the layout of the loss that reads it
    (``(dim, place)``, Training.batch_dims' form); None: neither known."""
    t = graph.type_of(name)
    if t.batch_dim is not None:
        return t.batch_dim
    for loss in graph.train.losses:
        if loss.output != name or loss.flat_batch is None:
            continue
        k = loss.flat_batch[0]
        if k < len(t.shape) and t.shape[k] == loss.target_type.shape[k]:
            return loss.flat_batch
    return None


def microbatch_attribute(graph: Graph) -> Optional[str]:
    """The model's class attribute holding its micro-batch count (the
    ``pipeline:`` forward, codegen/model.py's ``_Pipelined``), or None."""
    if graph.pipeline is None:
        return None
    return Namespace({n.name for n in graph.nodes}).fresh("microbatches")


def _layout(value) -> str:
    return tuple_literal(value) if isinstance(value, tuple) else literal(value)


def render_predict(graph: Graph) -> str:
    """``predict_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    names = file_names(graph)
    train_module, stem = names["train"][:-3], names["model"][:-3]
    w = PythonWriter()
    for line in header(graph):
        w.line(line)
    w.docstring([
        f"Run {graph.name} forward over data as {graph.spec_path} says, on {RUNTIME}'s "
        "predict (--help: its flags).",
        "",
        "For example:",
        "",
        f"    python {names['predict']} --checkpoint runs/{stem} --data inputs.safetensors "
        "--out outputs.safetensors",
    ])
    w.line()
    w.line(f"import {RUNTIME}.predict")
    w.line(f"import {train_module}")
    layouts = [output_layout(graph, name) for name in graph.outputs]
    scored = [(graph.outputs.index(loss.output), loss.class_dim)
              if loss.class_dim is not None else None for loss in graph.train.losses]
    fields = [("training", f"{train_module}.TRAINING"),
              ("outputs", tuple_literal(graph.outputs)),
              ("output_dims", "(" + _tuple([_layout(v) for v in layouts]) + ")")]
    # Fields at Predicting's defaults (no class scores, no micro-batch attribute) are not written.
    if any(s is not None for s in scored):
        fields.append(("scored", "(" + _tuple([_layout(v) for v in scored]) + ")"))
    attribute = microbatch_attribute(graph)
    if attribute is not None:
        fields.append(("microbatches", literal(attribute)))
    w.line()  # one blank line after the imports: black's, before a statement
    arguments = ", ".join(f"{key}={value}" for key, value in fields)
    w.line(f"PREDICTING = {RUNTIME}.predict.Predicting({arguments},)")
    w.line()
    w.line()
    with w.block('if __name__ == "__main__"'):
        w.line(f"{RUNTIME}.predict.predict(PREDICTING)")
    return w.text()
