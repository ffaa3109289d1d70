"""IR -> ``generate_<name>.py``: a decoder's generation, for the runtime.

Only for a decoder (``analysis.cache.decoder``). The loop, its flags, the
prompts, the sampling and the weights are the output folder's
``mpgen_runtime.generate`` (``mpgen/runtime/generate.py``); this file
writes what only the spec knows: the model's classes in their incremental
form (NOTE [The KV cache compiled from the spec]), the same classes as
``<name>.py``'s with each causal attention a ``KVAttention`` and each
position count a ``Positions`` (analysis.cache says which), written by
model.py's emitters; or, where the form cannot be cached, why not.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mpgen.compiler.analysis import cache as cache_analysis
from mpgen.compiler.codegen import train as train_codegen
from mpgen.compiler.codegen.common import file_names, header, literal
from mpgen.compiler.codegen.model import render_model
from mpgen.compiler.codegen.writer import PythonWriter
from mpgen.compiler.ir import Graph, Node, Op, OpKind, SymDim

RUNTIME = train_codegen.RUNTIME
KV_ATTENTION = f"{RUNTIME}.generate.KVAttention"
POSITIONS = f"{RUNTIME}.generate.Positions"


def wanted(graph: Graph) -> bool:
    """Whether the spec is a decoder, which gets ``generate_<name>.py``."""
    return cache_analysis.decoder(graph) is not None


def cache_notes(graph: Graph) -> list[str]:
    """``SPEC:LINE:COL: note: ...`` at the layer that makes a decoder's form
    uncacheable: generation runs without a KV cache (none for another spec)."""
    cache = cache_analysis.plan(graph)
    if cache is None or cache.cacheable:
        return []
    pos, why = cache.problem
    script = file_names(graph)["generate"]
    return [f"{pos}: note: {script} runs without a KV cache (the whole window again for "
            f"every token): {why}"]


def _swapped(node: Node, site: cache_analysis.Site, cache: cache_analysis.CachePlan) -> Node:
    if site in cache.attention:
        op = Op(OpKind.MODULE, "KVAttention", KV_ATTENTION, None)
    elif site in cache.layers:
        op = Op(OpKind.MODULE, node.op.spelled, f"{RUNTIME}.generate.KV{node.op.spelled}", None)
    elif site in cache.positions:
        op = Op(OpKind.MODULE, "Positions", POSITIONS, None)
    else:
        return dataclasses.replace(node, checkpoint=False) if node.checkpoint else node
    return dataclasses.replace(node, op=op, factory=False, checkpoint=False)


def cached_graph(graph: Graph, cache: cache_analysis.CachePlan, name: str) -> Graph:
    """The graph of the incremental form: the swapped layers, one forward (no
    micro-batches, no recomputation), the model class named ``name``."""
    nodes = tuple(_swapped(n, cache_analysis.Site(None, n.name), cache) for n in graph.nodes)
    blocks = tuple(
        dataclasses.replace(b, nodes=tuple(
            _swapped(n, cache_analysis.Site(b.name, n.name), cache) for n in b.nodes))
        for b in graph.blocks)
    return dataclasses.replace(graph, name=name, nodes=nodes, blocks=blocks, pipeline=None)


def _classes(graph: Graph) -> str:
    """The classes of ``graph``'s model module (what follows its imports)."""
    text = render_model(graph)
    start = text.index("\n\n\nclass ")
    return text[start:].strip("\n") + "\n"


def max_length(graph: Graph, cache: cache_analysis.CachePlan) -> Optional[int]:
    """The longest sequence the position tables hold (analysis.shapes' limit
    of the sequence's dim, the rows of an Embedding the positions index),
    None where none is known."""
    seq = graph.inputs[0].type.shape[1]
    limits = [largest for dim, largest, _ in graph.dim_limits
              if isinstance(seq, SymDim) and (dim,) == seq.symbols]
    if cache.table is not None:
        limits.append(cache.table)
    return min(limits) if limits else None


def render_generate(graph: Graph) -> str:
    """``generate_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    cache = cache_analysis.plan(graph)
    names = file_names(graph)
    train_module, stem = names["train"][:-3], names["model"][:-3]
    blocks = {b.name for b in graph.blocks}
    name = f"{graph.name}WithCache"
    while name in blocks:
        name += "_"
    w = PythonWriter()
    for line in header(graph):
        w.line(line)
    how = (f"{name} is {graph.name} in its incremental form: each causal attention "
           "keeps its keys and values (KVAttention), each count of positions starts at "
           "the cache's length (Positions); the rest is the model's code, run on the new "
           "tokens only (NOTE [The KV cache compiled from the spec] in "
           f"{RUNTIME}/generate.py)." if cache.cacheable else
           f"No KV cache: {cache.problem[1]}; the whole window runs again for every token.")
    w.docstring([
        f"Continue prompts with {graph.name}, from {graph.spec_path}, on {RUNTIME}'s "
        "generate (--help: its flags).",
        "",
        *_wrapped(how),
        "",
        "For example:",
        "",
        f"    python {names['generate']} --checkpoint runs/{stem} --prompt 1,2,3 "
        "--max-new-tokens 20",
    ])
    w.line()
    if cache.cacheable:
        model_text = render_model(cached_graph(graph, cache, name))
        for line in model_text[:model_text.index("\n\n\nclass ")].splitlines():
            if line.startswith(("import ", "from ")):
                w.line(line)
        w.line()
    w.line(f"import {RUNTIME}.generate")
    w.line(f"import {train_module}")
    text = w.text()
    if cache.cacheable:
        text = text.rstrip("\n") + "\n\n\n" + _classes(cached_graph(graph, cache, name))
    fields = [("training", f"{train_module}.TRAINING")]
    if cache.cacheable:
        fields.append(("cached", name))
    else:
        fields.append(("uncached", literal(cache.problem[1])))
    fields.append(("vocab", literal(cache.vocab)))
    longest = max_length(graph, cache)
    if longest is not None:
        fields.append(("max_length", literal(longest)))
    w = PythonWriter()
    train_codegen.facts_and_run(w, "GENERATING", f"{RUNTIME}.generate.Generating", fields,
                                f"{RUNTIME}.generate.generate")
    facts = w.text()
    if not cache.cacheable:  # right after the imports: one blank line, as black has it
        facts = facts[1:]
    return text.rstrip("\n") + "\n" + facts


def _wrapped(text: str, width: int = 76) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line] if line else lines
