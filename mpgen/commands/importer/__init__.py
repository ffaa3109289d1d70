"""``mpgen import``: trace an existing ``nn.Module`` into a spec.

Two tracers. A library's model (Hugging Face, torchvision) is traced with
TorchDynamo and keeps its module hierarchy as blocks, so that the generated
state-dict keys are the original's: :mod:`.capture` and :mod:`.scopes`
(NOTE [Module hierarchy]), reusing :mod:`.nodes`' reading of each node. The
project's own classes are traced with torch.fx, as follows.

The module is built from the user's class (``MODULE:CLASS``, the working
directory on ``sys.path``), traced with ``torch.fx.symbolic_trace``'s tracer
(``torch.nn`` modules are leaves, user modules are traced through) and run
once on sample inputs of the ``--input`` shapes, so that every node's value
is known: a tensor, a tuple of tensors, or a size. Then each node becomes a
layer of the spec (docs/import.md):

- a ``call_module`` of a ``torch.nn`` class: a layer of that op, with the
  constructor arguments recovered from the module (:func:`constructor`);
- a ``call_function`` / ``call_method``: a ``torch.NAME`` / ``F.NAME``
  layer (``+`` is ``torch.add``, ``x.view(...)`` is ``torch.reshape``);
- sizes (``x.size(0)``, ``x.shape[1] * 2``): expressions (``=size(x, 0)``);
- ``getitem`` of a returned tuple: the layer's ``outputs:`` names.

The passes, one module each, each importing only those before it:
:mod:`.trace` (the command line's values, the class built, traced and run
on samples), :mod:`.inputs` (the inputs a library's model takes, without
``--input``), :mod:`.arguments` (constructor and function arguments),
:mod:`.layers` (the spec being built), :mod:`.nodes` (each node a layer),
:mod:`.order` (NOTE [Parameter order]), :mod:`.fold` (repeats and blocks),
:mod:`.capture` and :mod:`.scopes` (the TorchDynamo path) and :mod:`.emit`
(the spec's text); :func:`import_module` runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch import nn

from mpgen.commands.importer.arguments import LAYER_FIELDS, constructor
from mpgen.commands.importer.capture import capture
from mpgen.commands.importer.emit import (
    check_builds, model_name, render, spec_text, write_spec)
from mpgen.commands.importer.fold import fold_blocks, fold_repeats
from mpgen.commands.importer.inputs import KnownInputs, known_inputs, no_inputs
from mpgen.commands.importer.nodes import Importer
from mpgen.commands.importer.order import param_order, reorder
from mpgen.commands.importer.scopes import import_hierarchy
from mpgen.commands.importer.trace import (
    MAX_ARGS_DEPTH, SAMPLE_BATCH, SAMPLE_DIM, InputSpec, TraceFailure, default_tracer,
    library_modules, load_module, parse_input)
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.errors import MpgenError

__all__ = ["LAYER_FIELDS", "MAX_ARGS_DEPTH", "SAMPLE_BATCH", "SAMPLE_DIM", "Imported",
           "InputSpec", "KnownInputs", "TRY_INSTEAD", "TraceFailure", "constructor",
           "default_tracer", "import_module", "known_inputs", "library_modules",
           "load_module", "no_inputs", "parse_input", "write_spec"]


@dataclass(frozen=True)
class Imported:
    """The spec's text, and what a user should know about it."""

    text: str
    name: str
    layers: int
    notes: tuple[str, ...]
    #: modules the spec names otherwise than the original (generated path ->
    #: original path): the children of an nn.Sequential that a repeat
    #: cannot hold (docs/import.md, "State-dict keys")
    renamed: dict = field(default_factory=dict)

    def original_key(self, key: str) -> str:
        """The original's state-dict key of the generated model's ``key``."""
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in self.renamed:
                return ".".join([self.renamed[prefix], *parts[cut:]])
        return key


#: What a failed trace says to try: the other tracer, and why it may do.
TRY_INSTEAD = {
    "fx": "try --trace dynamo (TorchDynamo runs forward's Python: control flow, library "
          "code)",
    "dynamo": "try --trace fx (torch.fx traces forward symbolically, your modules through)",
}


def import_module(root: nn.Module, inputs: Sequence[InputSpec], command: str,
                  devices: Optional[int] = None,
                  time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
                  tracer: str = "fx", fallback: bool = False) -> Imported:
    """The spec of ``root`` traced with torch.fx (``tracer="fx"``) or, its
    module hierarchy kept as blocks, with TorchDynamo (``"dynamo"``);
    raises MpgenError. The spec is compiled before it is returned, so it
    builds. With ``fallback`` (fx the default, not asked for), a model fx
    cannot import is traced with TorchDynamo instead, and a note says so
    (docs/import.md, "Which tracer")."""
    try:
        with _quiet_fake_tensors():
            if not fallback or tracer != "fx":
                imported, checked = _unchecked(root, inputs, command, devices, tracer)
            else:
                imported, checked = _fx_or_dynamo(root, inputs, command, devices)
    except TraceFailure as failed:
        raise failed.hinted(TRY_INSTEAD[failed.tracer]) from None
    # A spec that does not build is the model's (a table read along a
    # symbolic dim) or mpgen's to report: the other tracer is not tried.
    text = check_builds(imported.text, time_limit, checked)
    return dataclasses.replace(imported, text=text)


@contextlib.contextmanager
def _quiet_fake_tensors():
    """torch's fake tensors log a traceback (``log.exception``) when an op's
    meta kernel raises, before the error reaches the tracer, whose failure
    the import says in one line: not while a model is traced."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fx_or_dynamo(root: nn.Module, inputs: Sequence[InputSpec], command: str,
                  devices: Optional[int]) -> tuple[Imported, list[InputSpec]]:
    """torch.fx's import of ``root``, else TorchDynamo's with a note that says
    why; where both fail, torch.fx's failure and TorchDynamo's in one line."""
    try:
        return _unchecked(root, inputs, command, devices, "fx")
    except MpgenError as fx_failed:
        first = str(fx_failed).splitlines()[0]
        try:
            imported, checked = _unchecked(root, inputs, command, devices, "dynamo")
        except MpgenError as also:
            if str(also) == str(fx_failed):  # not the tracers' (an --input's)
                raise fx_failed from None
            again = str(also).splitlines()[0]
            raise MpgenError(fx_failed.pos, f"{fx_failed.message.splitlines()[0]}; --trace "
                                            f"dynamo, tried next, fails too: {again}") from None
    said = first if "fx" in first else f"with torch.fx, {first}"
    note = f"{said}; traced with TorchDynamo instead (--trace dynamo)"
    return dataclasses.replace(imported, notes=(note, *imported.notes)), checked


def _unchecked(root: nn.Module, inputs: Sequence[InputSpec], command: str,
               devices: Optional[int], tracer: str) -> tuple[Imported, list[InputSpec]]:
    """The spec of ``root`` traced with ``tracer``, not yet compiled, and the
    inputs in the order of its ``inputs:``."""
    if tracer == "dynamo":
        captured = capture(root, inputs)
        name = model_name(type(root))
        top, blocks = import_hierarchy(captured, root, name)
        total = sum(p.numel() for p in root.parameters())
        text = spec_text(root, "TorchDynamo", captured.inputs, blocks.imports, blocks.lines,
                         top.layers, top.outputs, command, devices, blocks.split(total))
        return (Imported(text, name, len(top.layers), tuple(blocks.notes), blocks.renamed),
                captured.inputs)
    importer = Importer(root, inputs)
    importer.run()
    notes = []
    original = [id(p) for p in root.parameters()]
    used = set(param_order(importer.layers))
    unused = [n for n, p in root.named_parameters() if id(p) not in used]
    if unused:
        raise MpgenError(None, f"{type(root).__name__}: forward does not use the "
                               f"parameters {', '.join(unused[:5])}"
                               f"{' ...' if len(unused) > 5 else ''}; a spec holds only the "
                               "layers forward calls (remove the unused modules)")
    layers = importer.layers
    if param_order(layers) != original:
        layers = reorder(layers, {p: i for i, p in enumerate(original)})
        if param_order(layers) != original:
            notes.append(f"no order of the layers gives {type(root).__name__}'s parameter "
                         "order (a module registered before one whose output it reads); "
                         "copy weights by name, not by position")
    layers, blocks = fold_blocks(layers, importer, model_name(type(root)))
    layers = fold_repeats(layers, importer)
    text = render(root, importer, layers, blocks, command, devices)
    return Imported(text, model_name(type(root)), len(layers), tuple(notes)), list(inputs)
