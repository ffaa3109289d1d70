"""Layers built and run on the meta device: one interpreter of the IR.

``compiler.shapes`` runs it at symbolic sizes (to infer shapes and report
mismatches), ``compiler.costs`` at the training sizes (to measure saved
activations and flops). Both build the same modules the generated code
builds, named the same way, so parameter counts and names agree with the
generated state dict. What each stage adds (error reporting, recording) it
passes in as a :class:`Hooks` object.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from mpgen.compiler.ir import Args, BlockClass, Expr, Node, OpKind, Param

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def value(v: Any, params: Mapping[str, Any]) -> Any:
    """An IR literal as a Python value: ``$param`` substituted, dtypes resolved."""
    if isinstance(v, Param):
        return params[v.name]
    if isinstance(v, Expr):  # the only Exprs are dtypes: torch.float16
        return TORCH_DTYPES[v.code.removeprefix("torch.")]
    if isinstance(v, list):
        return [value(x, params) for x in v]
    return v


def call_args(args: Args, params: Mapping[str, Any]) -> tuple[list, dict]:
    """Positional and keyword values of ``args``, with block params set."""
    return ([value(a, params) for a in args.positional],
            {k: value(v, params) for k, v in args.keyword})


class Hooks:
    """How a stage observes the interpreter; the default just runs things."""

    def build(self, node: Node, label: str, params: Mapping[str, Any],
              make: Callable[[], nn.Module]) -> nn.Module:
        return make()

    def run(self, node: Node, label: str, params: Mapping[str, Any],
            module: Optional[nn.Module], fn: Callable, inputs: Sequence[torch.Tensor],
            call: Callable[[], Any]) -> Any:
        return call()

    def block_done(self, block: BlockClass, params: Mapping[str, Any],
                   outputs: Mapping[str, torch.Tensor], module: nn.Module) -> None:
        pass


PLAIN = Hooks()


def build(node: Node, params: Mapping[str, Any], blocks: Mapping[str, BlockClass],
          hooks: Hooks = PLAIN, where: str = "") -> nn.Module:
    """One instance of a module, user or block node, on meta."""
    args, kwargs = call_args(node.init, params)
    label = f"{where}{node.name}"
    if node.op.kind is OpKind.BLOCK:
        return MetaBlock(blocks[node.op.target], args, blocks, hooks, f"{label}.")

    def make() -> nn.Module:
        with torch.device("meta"):
            return node.op.target(*args, **kwargs)

    return hooks.build(node, label, params, make)


def run(node: Node, module: Optional[nn.Module], inputs: Sequence[torch.Tensor],
        params: Mapping[str, Any], hooks: Hooks = PLAIN, where: str = "") -> Any:
    """Apply one instance of ``node`` (its module, or its function) to ``inputs``."""
    label = f"{where}{node.name}"
    args, kwargs = call_args(node.call, params)
    if node.op.kind is OpKind.FUNCTION:
        tensors = [list(inputs)] if node.op.seq_input else list(inputs)
        fn = node.op.target
        return hooks.run(node, label, params, None, fn, inputs,
                         lambda: pick(node, fn(*tensors, *args, **kwargs)))
    return hooks.run(node, label, params, module, module, inputs,
                     lambda: pick(node, module(*inputs, *args, **kwargs)))


class OutputError(Exception):
    """``output:`` does not fit what the layer returns (message is user-facing)."""


def pick(node: Node, result: Any) -> Any:
    """The layer's output: ``result``, or its element ``node.output``."""
    if node.output is None:
        return result
    if not isinstance(result, (tuple, list)):
        raise OutputError(f"returns a single {type(result).__name__}; 'output: "
                          f"{node.output}' selects from a tuple, remove it")
    if not -len(result) <= node.output < len(result):
        raise OutputError(f"returns {len(result)} values, so 'output: {node.output}' is "
                          "out of range")
    return result[node.output]


class MetaBlock(nn.Module):
    """A block instance as a real ``nn.Module``, children named as in the
    generated block class (a repeated layer is an ``nn.ModuleList``)."""

    def __init__(self, block: BlockClass, args: Sequence[Any],
                 blocks: Mapping[str, BlockClass], hooks: Hooks = PLAIN,
                 where: str = "") -> None:
        super().__init__()
        self.block = block
        self.values = dict(zip(block.params, args))
        self.hooks = hooks
        self.where = where
        for node in block.nodes:
            if not node.op.has_module:
                continue
            if node.repeat:
                self.add_module(node.name, nn.ModuleList(
                    build(node, self.values, blocks, hooks, where)
                    for _ in range(node.repeat)))
            else:
                self.add_module(node.name, build(node, self.values, blocks, hooks, where))
        self.__class__ = _named_class(block.name)

    def forward(self, *inputs: torch.Tensor):
        env = {t.name: x for t, x in zip(self.block.inputs, inputs)}
        for node in self.block.nodes:
            xs = [env[name] for name in node.inputs]
            module = getattr(self, node.name) if node.op.has_module else None
            if node.repeat:
                out = xs[0]
                for layer in module:
                    out = run(node, layer, [out, *xs[1:]], self.values, self.hooks, self.where)
            else:
                out = run(node, module, xs, self.values, self.hooks, self.where)
            env[node.name] = out
        self.hooks.block_done(self.block, self.values, env, self)
        outs = [env[name] for name in self.block.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


@functools.lru_cache(maxsize=None)
def _named_class(name: str) -> type:
    """A MetaBlock subclass named after the block (tools key on class names)."""
    return type(name, (MetaBlock,), {"__module__": __name__})


def meta_tensor(shape: Sequence[int], dtype: str) -> torch.Tensor:
    return torch.empty(list(shape), dtype=TORCH_DTYPES[dtype], device="meta")
