"""The output of ``mpgen import``: the spec's text, compiled once to check
that it builds, and written."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

from torch import nn

from mpgen.commands.importer.layers import Layer, layer_lines, scalar
from mpgen.commands.importer.nodes import Importer
from mpgen.compiler import driver
from mpgen.compiler.frontend.namespace import model_name_problem
from mpgen.errors import MpgenError


def model_name(cls: type) -> str:
    """The spec's ``name:``: the class's name, else with ``Model`` or ``Net`` added."""
    for name in (cls.__name__, f"{cls.__name__}Model", f"{cls.__name__}Net"):
        if model_name_problem(name) is None:
            return name
    raise MpgenError(None, f"{cls.__name__}: {model_name_problem(cls.__name__)}")


def render(root: nn.Module, importer: Importer, layers: list[Layer],
           blocks: dict[str, list[str]], command: str, devices: Optional[int]) -> str:
    """The spec of a torch.fx import (its blocks' layers as lines)."""
    bodies = {name: ["  layers:", *(f"  {line}" for line in block)]
              for name, block in blocks.items()}
    return spec_text(root, "torch.fx", importer.inputs, (), bodies, layers,
                     importer.outputs, command, devices)


def spec_text(root: nn.Module, tracer: str, inputs: list, imports: Iterable[str],
              blocks: dict[str, list[str]], layers: list[Layer], outputs: list[str],
              command: str, devices: Optional[int], split: Sequence[str] = ()) -> str:
    """A spec's text: ``blocks`` maps a block's name to its body's lines;
    ``split``, the block instances an automatic placement splits."""
    cls = type(root)
    lines = [f"# Made by `{command}`:",
             f"# {cls.__module__}.{cls.__qualname__} traced with {tracer} (docs/import.md).",
             "mpgen: 1", f"name: {model_name(cls)}", "", "inputs:"]
    for spec in inputs:
        shape = scalar(list(spec.dims))
        lines.append(f"  {spec.name}: " + (shape if spec.dtype == "float32"
                                           else f"{{shape: {shape}, dtype: {spec.dtype}}}"))
    if imports:
        lines += ["", f"imports: {scalar(sorted(imports))}"]
    if blocks:
        lines += ["", "blocks:"]
        for name, body in blocks.items():
            lines += [f"  {name}:", *(f"  {line}" for line in body)]
    lines += ["", "layers:", *layer_lines(layers, inputs[0].name)]
    if outputs != [layers[-1].name] or layers[-1].elements is not None:
        lines += ["", f"outputs: {scalar(outputs)}"]
    if devices:
        lines += ["", "placement:", "  auto:",
                  f"    devices: {scalar([f'cuda:{i}' for i in range(devices)])}"]
        if split:
            lines.append(f"    split: {scalar(list(split))}")
    return "\n".join(lines) + "\n"


def train_lines(graph) -> list[str]:
    """A ``train:`` that fits the imported model, or none (the defaults:
    MSELoss against targets shaped like the output): a language model's
    logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]`` train with
    cross-entropy over the last dim, their targets shaped like the ids."""
    tokens = [t for t in graph.inputs if not t.type.dtype.startswith(("float", "bfloat"))]
    vocab = _vocabularies(graph)
    for name in graph.outputs:
        out = graph.type_of(name)
        if out is None or not out.dtype.startswith(("float", "bfloat")):
            continue
        if (len(out.shape) >= 2 and out.shape[-1] in vocab
                and any(t.type.shape == out.shape[:-1] for t in tokens)):
            loss = "{op: CrossEntropyLoss, class_dim: -1}"
            if len(graph.outputs) > 1:
                loss = f"{{{name}: {loss}}}"
            return ["", "train:", f"  loss: {loss}  # logits {out}, a class per token id"]
    return []


def _vocabularies(graph) -> set[int]:
    """The row counts of the model's embedding tables: logits over one of
    them are a language model's (hidden states of a body without a head,
    ``[batch, seq, hidden]``, are not, whatever their width)."""
    rows: set[int] = set()
    for node in [*graph.nodes, *(n for block in graph.blocks for n in block.nodes)]:
        target = node.op.target
        if isinstance(target, type) and issubclass(target, nn.Embedding):
            count = (node.init.positional[0] if node.init.positional
                     else dict(node.init.keyword).get("num_embeddings"))
            if isinstance(count, int):
                rows.add(count)
    return rows


def check_builds(text: str, time_limit: Optional[float], inputs: Sequence = ()) -> str:
    """Compile the spec; a failure is mpgen import's, reported as such (with
    a hint where a symbolic dim of ``inputs`` other than ``batch`` may be
    the cause). The text returned has a ``train:`` where one fits the model
    (:func:`train_lines`; compiled again with it)."""
    graph = _compiled(text, time_limit, inputs)
    extra = train_lines(graph)
    if not extra:
        return text
    text += "\n".join(extra) + "\n"
    _compiled(text, time_limit, inputs)
    return text


def _compiled(text: str, time_limit: Optional[float], inputs: Sequence):
    """The spec's graph, compiled for the CPU; raises MpgenError (check_builds)."""
    with tempfile.TemporaryDirectory(prefix="mpgen-import-") as folder:
        path = Path(folder) / "imported.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            return driver.compile_spec(path, {"*": "cpu"}, root=folder, time_limit=time_limit)
        except MpgenError as exc:
            shown = str(exc).replace(str(path), "<imported spec>")
            lines = text.splitlines()
            quoted = [f"  line {n}: {lines[int(n) - 1].strip()}"
                      for n in dict.fromkeys(re.findall(r"<imported spec>:(\d+):", shown))
                      if 0 < int(n) <= len(lines)]
            dims = [f"{spec.name}: {d}" for spec in inputs for d in spec.dims
                    if isinstance(d, str) and d != "batch"]
            hint = ([f"hint: the build checks symbolic dims ({', '.join(dims)}) at sizes "
                     "far beyond any table of fixed length (position embeddings); if the "
                     "model indexes one along such a dim, give it a size in --input"]
                    if dims else [])
            # A table read along a dim with no end is the model's, not the importer's.
            why = ("the model reads a table of fixed rows along a symbolic dim"
                   if "is symbolic with no size in train.dims" in shown
                   else "a model mpgen import cannot express yet; please report it")
            raise MpgenError(None, f"the imported spec does not build ({why}):\n"
                                   + "\n".join([shown, *quoted, *hint])) from None


def write_spec(text: str, out: Optional[str], force: bool) -> None:
    """Write ``text`` to ``out`` (not over an existing file unless ``force``)."""
    path = Path(out)
    if path.exists() and not force:
        raise MpgenError(None, f"{out}: exists; refusing to overwrite it (pass --force)")
    path.write_text(text, encoding="utf-8")
