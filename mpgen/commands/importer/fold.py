"""The folds of ``mpgen import``: runs of copies of a module layer become one
layer with ``repeat:``, and runs of alike instances of a user module one
block (NOTE [Blocks])."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from mpgen.commands.importer.layers import Layer, flat, layer_lines, rename_reads
from mpgen.commands.importer.nodes import Importer
from mpgen.compiler.frontend import ops
from mpgen.compiler.frontend.namespace import Namespace


def fold_repeats(layers: list[Layer], importer: Importer) -> list[Layer]:
    """Runs of copies of one module layer, each reading only the one before
    and read only by the next, become one layer with ``repeat:``."""
    owners = {target.partition(".")[0] for layer in layers for target in layer.tie.values()}
    result: list[Layer] = []
    runs: list[Layer] = []
    for layer in layers:
        prev = result[-1] if result else None
        if (prev is not None and prev.name not in owners and layer.name not in owners
                and _continues(prev, layer, importer)):
            prev.repeat += 1
            prev.chain.append(layer)
            if prev.repeat == 2:
                runs.append(prev)
            continue
        if layer.repeat == 1:  # (a repeated block is already folded)
            layer.chain = [layer]
        result.append(layer)
    for run in runs:
        old = run.chain[-1].name
        run.name = _run_name([m.node.target for m in run.chain], importer) or run.name
        importer.rename(old, run.name)
    return result


def _continues(run: Layer, layer: Layer, importer: Importer) -> bool:
    last = run.chain[-1]
    if not (run.module is not None and layer.module is not None and run.key() == layer.key()
            and layer.repeat == 1
            and not run.tie and not layer.tie and run.elements is None
            and layer.elements is None and not layer.keyword_inputs and not last.keyword_inputs
            and layer.inputs == [last.name] and len(run.chain[0].inputs) == 1
            and all(m.module is not layer.module for m in run.chain)):
        return False
    users = [u for u in last.node.users]
    if users != [layer.node]:
        return False
    before, after = importer.values[last.node], importer.values[layer.node]
    return before.shape == after.shape and before.dtype == after.dtype


def _run_name(paths: list[str], importer: Importer) -> Optional[str]:
    """A run that is a whole ``nn.Sequential``/``ModuleList`` (``blocks.0``
    ... ``blocks.N-1``) takes its name, so state-dict keys match."""
    parent = paths[0].rpartition(".")[0]
    if parent and paths == [f"{parent}.{i}" for i in range(len(paths))]:
        container = importer.gm.get_submodule(parent)
        if len(list(container.children())) == len(paths):
            candidate = parent.replace(".", "_")
            if not importer.names.taken(candidate) and not hasattr(nn.Module, candidate):
                return importer.names.claim(candidate)
    return None


# NOTE: [Blocks]
# A user module traced through leaves its layers contiguous in the layer
# order (fx records each node's module path in ``nn_module_stack``). Two or
# more instances in a row that read the same (their layers alike once named
# relative to the instance, and their outside inputs named ``x``), each
# reading only the one before, read only by the next and keeping its shape,
# become one block class and a layer that repeats it; like a leaf run, a
# run that is a whole Sequential/ModuleList takes its name, so state-dict
# keys agree (``layer1.0.conv1.weight``). An instance on its own stays
# unrolled: a block used once would only add a level to read.

@dataclass
class _Instance:
    """One instance of a user module as it would be a block."""

    path: str
    cls: type
    layers: list[Layer]
    lines: list[str]  # its layers inside the block
    input: str  # the value it reads from outside
    output: str  # its value read outside


def _instance_path(layer: Layer) -> Optional[tuple[str, type]]:
    """The outermost user module (not torch's) the layer's node ran in."""
    for path, cls in (layer.node.meta.get("nn_module_stack") or {}).values():
        if (path and path != layer.node.target and isinstance(cls, type)
                and not cls.__module__.startswith("torch.")):
            return path, cls
    return None


def _instance(path: str, cls: type, layers: list[Layer], readers: dict[str, int],
              tied: set[str]) -> Optional[_Instance]:
    """``layers`` (one instance of ``path``) as a block's layers, or None
    where a block cannot hold them simply (NOTE [Blocks])."""
    inside = {l.name for l in layers} | {leaf.name for l in layers
                                         for leaf in flat(l.elements or []) if leaf.name}
    outside = {r for l in layers for r in l.reads if r not in inside}
    last = layers[-1]
    read_outside = {n for n in inside if readers.get(n, 0) > sum(
        1 for l in layers for r in l.reads if r == n)}
    if (len(outside) != 1 or read_outside != {last.name} or last.elements is not None
            or any(l.tie or l.name in tied for l in layers)):
        return None
    (source,) = outside
    local = Namespace({"x"})
    names = {source: "x"}
    for layer in layers:
        base = (layer.node.target[len(path) + 1:].replace(".", "_")
                if layer.module is not None else re.sub(r"_\d+$", "", layer.node.name))
        if hasattr(nn.Module, base) or base == "training":
            base += "_layer"
        names[layer.name] = local.fresh(base)
        for leaf in flat(layer.elements or []):
            if leaf.name:
                names[leaf.name] = local.fresh(re.sub(r"_\d+$", "", leaf.name))
    copies = []
    for layer in layers:
        twin = copy.copy(layer)
        rename_reads(twin, names)
        twin.name = names[layer.name]
        copies.append(twin)
    return _Instance(path, cls, layers, layer_lines(copies, "x", names), source, last.name)


def fold_blocks(layers: list[Layer], importer: Importer, model: str
                ) -> tuple[list[Layer], dict[str, list[str]]]:
    """Runs of alike instances of a user module: a block and a repeated layer."""
    readers: dict[str, int] = {}
    for layer in layers:
        for name in layer.reads:
            readers[name] = readers.get(name, 0) + 1
    for name in importer.outputs:
        readers[name] = readers.get(name, 0) + 1
    tied = {t.partition(".")[0] for layer in layers for t in layer.tie.values()}
    segments: list[tuple[Optional[tuple[str, type]], list[Layer]]] = []
    for layer in layers:
        where = _instance_path(layer)
        if segments and segments[-1][0] == where:
            segments[-1][1].append(layer)
        else:
            segments.append((where, [layer]))
    seen = [where for where, _ in segments if where]
    instances = [_instance(where[0], where[1], group, readers, tied)
                 if where and seen.count(where) == 1 else None for where, group in segments]
    result: list[Layer] = []
    blocks: dict[str, list[str]] = {}
    k = 0
    while k < len(segments):
        run = [instances[k]] if instances[k] else []
        while run and k + len(run) < len(instances):
            following = instances[k + len(run)]
            if not (following and following.cls is run[0].cls and following.lines == run[0].lines
                    and following.input == run[-1].output
                    and _same_type(importer, following.input, following.output)
                    and readers[following.input] == sum(
                        r == following.input for l in following.layers for r in l.reads)):
                break
            run.append(following)
        if len(run) < 2 or not _same_type(importer, run[0].input, run[0].output):
            result.extend(segments[k][1])
            k += 1
            continue
        name = next((n for n, lines in blocks.items() if lines == run[0].lines),
                    None) or _block_name(run[0].cls, blocks, model)
        blocks[name] = run[0].lines
        first = run[0].layers[0]
        layer = Layer(first.name, name, first.node, inputs=[run[0].input], reads=[run[0].input],
                      repeat=len(run))
        layer.chain = [instance.layers[-1] for instance in run]
        layer.name = _run_name([i.path for i in run], importer) or _path_name(run[0].path,
                                                                               importer)
        importer.rename(run[-1].output, layer.name)
        result.append(layer)
        k += len(run)
    return result, blocks


def _same_type(importer: Importer, source: str, result: str) -> bool:
    before, after = importer.value_of(source), importer.value_of(result)
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
            and before.shape == after.shape and before.dtype == after.dtype)


def _block_name(cls: type, blocks: dict, model: str) -> str:
    taken = {*blocks, model, *ops.nn_module_names()}
    name, i = cls.__name__, 2
    while name in taken or not name.isidentifier():
        name, i = f"{cls.__name__}{i}", i + 1
    return name


def _path_name(path: str, importer: Importer) -> str:
    return importer.names.fresh(path.replace(".", "_"))
