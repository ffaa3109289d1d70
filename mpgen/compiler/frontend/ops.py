"""Resolve an ``op:`` string against torch, the spec's blocks and user code.

An op is looked up, never evaluated: ``torch.NAME`` and ``F.NAME`` must be
in the allowlist of tensor functions (:func:`function_names`), a ``torch.nn``
class name must be an ``nn.Module`` subclass, and a dotted user path is
imported under the policy of :mod:`~mpgen.compiler.frontend.imports` and must
name an ``nn.Module`` subclass. Keyword arguments are
checked against the callee's real signature: ``inspect.signature`` where
Python has one, otherwise the ATen operator schemas of the same name.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mpgen.compiler.frontend import imports
from mpgen.compiler.ir import Op, OpKind
from mpgen.spec_schema.models import TENSOR_OPS

#: nn classes that only hold other modules; the spec has blocks for that.
_CONTAINERS = {"Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList",
               "ParameterDict", "Container"}


class OpError(Exception):
    """An op cannot be resolved; the message is user-facing."""


@functools.cache
def nn_module_names() -> tuple[str, ...]:
    names = []
    for name in dir(nn):
        obj = getattr(nn, name)
        if (
            inspect.isclass(obj)
            and issubclass(obj, nn.Module)
            and not name.startswith("_")
            and name not in _CONTAINERS
        ):
            names.append(name)
    return tuple(sorted(names))


@functools.cache
def function_names(prefix: str) -> frozenset[str]:
    """``NAME`` of every function op ``torch.NAME`` (``prefix`` "torch") or
    ``F.NAME`` ("F"): an allowlist, the public functions of the namespace
    that torch itself lists as taking tensors (the functions
    ``__torch_function__`` can override), plus the :data:`FACTORIES`."""
    overridable = torch.overrides.get_overridable_functions()
    module, namespaces = (torch, (torch, torch.functional)) if prefix == "torch" else (F, (F,))
    allowed = {id(fn) for namespace in namespaces for fn in overridable.get(namespace, ())}
    names = {name for name, obj in vars(module).items()
             if not name.startswith("_") and id(obj) in allowed and not inspect.isclass(obj)}
    return frozenset(names | (FACTORIES if prefix == "torch" else set()))


def candidates(blocks: Iterable[str]) -> list[str]:
    """Every op name, for did-you-mean suggestions."""
    return [*nn_module_names(), *TENSOR_OPS, *CASTS, *blocks,
            *(f"{prefix}.{name}" for prefix in ("torch", "F")
              for name in sorted(function_names(prefix)))]


#: torch functions that make a tensor from sizes: layers with ``in: []``,
#: created on their layer's device.
FACTORIES = frozenset({"arange", "zeros", "ones", "full", "eye", "empty", "linspace",
                       "logspace", "tril_indices", "triu_indices", "rand", "randn",
                       "randint", "randperm", "tensor"})


#: The casts (docs/spec.md, "Casts"): tensor methods, applied as methods in
#: the generated ``forward`` (``x.to(torch.int64)``, ``x.type_as(ref)``).
#: ``torch.Tensor.NAME`` is the very function applied, and no dotted user
#: op can be spelled so (``torch`` is never a user module).
CASTS = {"torch.Tensor.to": torch.Tensor.to, "torch.Tensor.type_as": torch.Tensor.type_as}


def resolve_op(spelled: str, blocks: Iterable[str],
               project: Optional[imports.Project] = None, factory: bool = False) -> Op:
    """Find what ``spelled`` names (``factory``: a layer with ``in: []``); a
    dotted op's module comes from ``project`` (default: that of a spec in the
    working directory); raises :class:`OpError`."""
    blocks = list(blocks)
    name = spelled.removeprefix("torch.")
    if spelled.startswith("torch.") and name in FACTORIES:
        if not factory:
            raise OpError(f"{spelled} makes a new tensor: mark the layer as a factory with "
                          "'in: []' (it is then created on its layer's device)")
        return Op(OpKind.FUNCTION, spelled, spelled, target=getattr(torch, name))
    if spelled in CASTS:
        if factory:
            raise OpError(f"{spelled} casts the tensor it reads: remove 'in: []'")
        return Op(OpKind.FUNCTION, spelled, spelled, target=CASTS[spelled])
    if spelled.startswith("torch.Tensor."):
        raise OpError(f"unknown op {spelled!r}: the tensor methods a layer applies are the "
                      f"casts, {' and '.join(CASTS)}; other methods are torch.NAME")
    if spelled in blocks:
        return Op(OpKind.BLOCK, spelled, spelled, target=spelled)
    if spelled in TENSOR_OPS:
        if factory:
            raise OpError(f"a {spelled} reads no tensor: remove 'in: []'")
        return Op(OpKind.TENSOR, spelled, spelled, target=spelled)
    if spelled.startswith(("torch.", "F.")) and spelled.count(".") == 1:
        prefix, name = spelled.split(".")
        module = torch if prefix == "torch" else F
        if name not in function_names(prefix):
            if name.startswith("_") or name not in vars(module):
                raise OpError(f"unknown op {spelled!r}")
            # torch.save, torch.manual_seed, torch.Tensor: not a layer, and
            # running it on meta tensors at build time could have side effects.
            raise OpError(f"{spelled!r} is not a tensor operation a layer can apply; a "
                          f"function op is one of torch's functions over tensors "
                          f"(torch.add, F.relu, ...)")
        fn = getattr(module, name)
        return Op(OpKind.FUNCTION, spelled, spelled, target=fn, seq_input=_takes_sequence(fn))
    if "." not in spelled:
        if spelled.startswith("Lazy") and spelled[4:] in nn_module_names():
            raise OpError(f"{spelled!r} infers its sizes at run time; use {spelled[4:]!r} "
                          "with the sizes, which mpgen checks at build time")
        obj = getattr(nn, spelled, None)
        if spelled in nn_module_names() and obj is not None:
            return Op(OpKind.MODULE, spelled, f"nn.{spelled}", target=obj)
        if spelled in _CONTAINERS:
            raise OpError(f"{spelled!r} is a container; define a block instead")
        raise OpError(f"unknown op {spelled!r}")
    return _user_op(spelled, project)


def _user_op(spelled: str, project: Optional[imports.Project]) -> Op:
    if not all(p.isidentifier() for p in spelled.split(".")):
        raise OpError(f"unknown op {spelled!r}: not a dotted Python path")
    try:
        cls, module = imports.user_class(spelled, project or imports.Project.of("spec.yaml"))
    except imports.Refused as exc:
        raise OpError(str(exc)) from None
    return Op(OpKind.USER, spelled, spelled, target=cls, module=module)


@dataclass(frozen=True)
class Signature:
    """What a callee accepts beyond its tensor inputs."""

    names: tuple[str, ...]  # keyword-capable parameter names
    var_kwargs: bool
    bind: Optional[Callable[..., Any]]  # raises TypeError on a bad call


def module_signature(cls: type) -> Signature:
    """Parameters of ``cls.__init__`` (excluding ``self``)."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return Signature((), True, None)
    params = list(sig.parameters.values())[1:]
    names = tuple(
        p.name for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    return Signature(names, var_kwargs, functools.partial(sig.bind, None))


def function_signature(fn: Callable, n_inputs: int) -> Signature:
    """Keyword names of a torch function, after its ``n_inputs`` tensors."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = list(sig.parameters.values())
        names = tuple(
            p.name for p in params[n_inputs:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
        return Signature(names, any(p.kind is p.VAR_KEYWORD for p in params), None)
    schemas = _schemas(fn)
    if not schemas:
        return Signature((), True, None)
    names: dict[str, None] = {}
    for schema in schemas:
        args = schema.arguments
        skip = 1
        if args and str(args[0].type) not in ("List[Tensor]", "Tensor[]"):
            skip = sum(1 for a in args[:n_inputs] if "Tensor" in str(a.type))
        for arg in args[skip:]:
            if arg.name != "out":
                names.setdefault(arg.name)
    return Signature(tuple(names), False, None)


def _schemas(fn: Callable) -> list:
    name = getattr(fn, "__name__", "")
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except RuntimeError:
        return []
    return [
        s for s in schemas
        if s.arguments and "Tensor" in str(s.arguments[0].type) and not s.overload_name.endswith("out")
    ]


def _takes_sequence(fn: Callable) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        first = next(iter(sig.parameters.values()), None)
        return first is not None and first.name == "tensors"
    schemas = _schemas(fn)
    return bool(schemas) and all(
        str(s.arguments[0].type) in ("List[Tensor]", "Tensor[]") for s in schemas
    )
