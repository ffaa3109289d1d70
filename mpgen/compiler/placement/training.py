"""The checks of ``train:`` that need the analysed and placed graph.

The front end (``frontend.training``) checks the loss and the optimizer on
their own; what is left needs the facts of later stages: whether backward
from the loss reaches a parameter at all, and every layer with parameters
(the parameters and dtypes that ``analysis`` measured), and whether an
optimizer that needs every parameter on one device (``LBFGS``) gets one, and
one whose step stays on a GPU (``capturable``) no CPU (the devices placement
chose).
"""

from __future__ import annotations

from mpgen.compiler.ir import Graph
from mpgen.errors import Collector

#: Output dtypes that carry a gradient.
_FLOATING = {"float16", "bfloat16", "float32", "float64"}


def check_training(graph: Graph) -> None:
    """Raise MpgenError when the training script of ``graph`` cannot train."""
    train = graph.train
    if train is None or graph.trainable_params == 0:  # the script runs forward and the loss only
        return
    errors = Collector()
    learns: dict[str, bool] = {}  # value -> computed from a parameter that trains
    for node in graph.nodes:  # in order: a node reads only earlier values
        trains = node.params > node.frozen_params or bool(node.ties)
        reaches = trains or any(learns.get(v) for v in node.inputs)
        learns.update(dict.fromkeys(node.value_names, reaches))
    dead = []
    for loss in train.losses:
        dtype = graph.type_of(loss.output).dtype
        if dtype not in _FLOATING:
            dead.append(f"output {loss.output!r} is {dtype}, which carries no gradient")
        elif not learns.get(graph.value_name(loss.output)):
            dead.append(f"output {loss.output!r} is computed without any parameter")
    if train.losses and len(dead) == len(train.losses):
        # At the layer to change: the loss may be the default, written nowhere.
        layer = graph.producer(train.losses[0].output)
        errors.add(layer.pos if layer else train.losses[0].pos, "train.loss: backward from "
                   "the loss reaches no parameter, so the training script cannot train: "
                   + "; ".join(dead))
    # Values some output depends on: an output without a loss is returned, so
    # the layers only it reads are kept, untrained (docs/spec.md, "Training").
    used = {graph.value_name(out) for out in graph.outputs}
    owners = {tie.owner for node in graph.nodes for tie in node.ties}  # trained by readers
    for node in reversed(graph.nodes):
        if used & set(node.value_names):
            used.update(node.inputs)
        elif node.held and node.name in owners:  # NOTE [Held layers]: its users train it
            continue
        elif node.params > node.frozen_params:
            errors.add(node.pos, f"layer {node.name!r}: no output depends on it, so training "
                       "would never update its parameters; read it in a later layer, list it "
                       "in outputs, or remove it")
    for block in graph.blocks:
        for name in block.unused:
            node = next(n for n in block.nodes if n.name == name)
            errors.add(node.pos, f"layer {name!r} of block {block.name!r}: no output of the "
                       "block depends on it, so training would never update its parameters; "
                       "read it in a later layer, list it in the block's outputs, or remove it")
    devices = sorted({d for node in graph.nodes if node.params > node.frozen_params
                      for d in node.devices})
    if train.one_device and len(devices) > 1:
        errors.add(train.optimizer_pos, f"train.optimizer: {train.optimizer} treats all "
                   "parameters as one vector, so it needs them on one device, but they are on "
                   f"{', '.join(devices)}; use another optimizer, or place every layer with "
                   "parameters on one device")
    if dict(train.optimizer_kwargs).get("capturable") and "cpu" in devices:
        errors.add(train.optimizer_pos, f"train.optimizer: {train.optimizer} with capturable "
                   "keeps its step on a GPU, but parameters are on cpu; drop capturable, or "
                   "place every layer with parameters on a GPU")
    errors.raise_if_any()
