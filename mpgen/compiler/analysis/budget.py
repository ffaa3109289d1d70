"""The work one build's analysis may do: the build's CPU budget
(:class:`~mpgen.compiler.frontend.limits.WorkBudget`) checked inside every
layer, and caps on what building one layer may create and on what one
operator may return.

Shapes and costs run every layer on the meta device, where one innocent
looking layer can take minutes (``nn.Transformer(num_encoder_layers=100000)``
builds 100,000 layers; a user module may loop). :class:`Budget` knows which
layer is being analysed (``meta.build`` and ``meta.run`` say so) and, while
:meth:`Budget.watching`, checks the budget at every module call, every
parameter, buffer or submodule created and every operator run on meta: the
error names that layer at its line. The checks are plain function calls in
this thread: no timer, thread or signal, and torch's global hooks are
removed when the analysis ends, so nothing outlives the build.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode

from mpgen.compiler.frontend.limits import (MAX_LAYER_OBJECTS, MAX_OP_OUTPUTS, OutOfBudget,
                                            WorkBudget)
from mpgen.compiler.ir import Node

__all__ = ["Budget", "OutOfBudget"]

#: Why analysing a layer may run out of the budget (the message's end).
_SLOW_LAYERS = "the layers up to it are too large or too slow to check in that time"


class Budget(WorkBudget):
    """The build's CPU budget (``seconds`` None: none), and the layer under
    analysis, for the message when it is spent."""

    def __init__(self, seconds: Optional[float] = None) -> None:
        super().__init__(seconds)
        self.layers: list[tuple[Node, str]] = []  # the layers being analysed, innermost last
        self.building: Optional[list] = None  # [what, objects created] while a layer builds

    @contextlib.contextmanager
    def layer(self, node: Node, label: str) -> Iterator[None]:
        """While ``node`` (``label``: its path through blocks) is analysed."""
        self.layers.append((node, label))
        try:
            with self.task(node.pos, f"analysis of layer {label!r}", _SLOW_LAYERS):
                yield
        finally:
            self.layers.pop()

    @contextlib.contextmanager
    def build(self, node: Node, label: str, what: str) -> Iterator[None]:
        """While ``node``'s module (``what``: the call, as the spec writes it)
        is constructed: it may create at most :data:`MAX_LAYER_OBJECTS`."""
        outer, self.building = self.building, [what, 0]
        try:
            with self.layer(node, label):
                yield
        finally:
            self.building = outer

    def refuse(self, problem: str) -> None:
        """Raise :class:`OutOfBudget`: the layer being analysed asks for too much."""
        node, label = self.layers[-1]
        raise OutOfBudget(node.pos, f"layer {label!r}: {problem}")

    def created(self, *_) -> None:
        """A parameter, buffer or submodule was created (a torch hook)."""
        if self.building is not None:
            self.building[1] += 1
            if self.building[1] > MAX_LAYER_OBJECTS:
                self.refuse(f"{self.building[0]} creates more than {MAX_LAYER_OBJECTS:,} "
                            "parameter tensors, buffers and submodules; at most "
                            f"{MAX_LAYER_OBJECTS:,} are supported in one layer")
        self.check()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Check the budget inside every module call, every module built and
        every operator run, until the block ends."""
        called = torch_module.register_module_forward_pre_hook(lambda *_: self.check())
        handles = [called] + [register(self.created) for register in (
            torch_module.register_module_parameter_registration_hook,
            torch_module.register_module_buffer_registration_hook,
            torch_module.register_module_module_registration_hook)]
        try:
            with _EveryOperator(self):
                yield
        finally:
            for handle in handles:
                handle.remove()


class _EveryOperator(TorchDispatchMode):
    """Checks the budget before each operator (a meta kernel that loops in
    Python, over a sequence or layers, runs many), and refuses an operator
    that would return more than :data:`MAX_OP_OUTPUTS` tensors in one call
    (``torch.split(x, 1)`` over a training ``seq`` of millions)."""

    def __init__(self, budget: Budget) -> None:
        super().__init__()
        self.budget = budget

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.budget.check()
        count = _outputs(func, args, kwargs)
        if count > MAX_OP_OUTPUTS and self.budget.layers:
            self.budget.refuse(f"{func.overloadpacket.__name__} would return {count:,} "
                               f"tensors; at most {MAX_OP_OUTPUTS:,} are supported from one "
                               "operator")
        return func(*args, **kwargs)


_aten = torch.ops.aten
#: Operators that return one tensor per slice along ``dim`` (the others that
#: split, ``tensor_split`` and ``chunk``, are made of these or of ``slice``).
_SPLITS = {_aten.split.Tensor: 1, _aten.unsafe_split.Tensor: 1, _aten.unbind.int: None}


def _outputs(func, args: tuple, kwargs: dict) -> int:
    """How many tensors ``func`` will return, for the operators in
    :data:`_SPLITS` (0 for any other, or for arguments it will refuse)."""
    if func not in _SPLITS:
        return 0
    size_at = _SPLITS[func]  # where the split size is, None: one slice each
    dim_at = 1 if size_at is None else 2
    dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim", 0)
    try:
        length = int(args[0].shape[dim])
        size = 1 if size_at is None else int(args[size_at])
    except (IndexError, TypeError, ValueError):
        return 0
    return -(-length // size) if size > 0 else 0
