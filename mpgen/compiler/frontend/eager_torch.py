"""Running torch eagerly at build time without importing ``torch._dynamo``.

# NOTE: [No dynamo at build time]
# A build runs torch only eagerly: layers on the meta device, a sample
# optimizer step, a backward pass for the costs. Yet torch 2.x imports
# ``torch._dynamo`` (and through it sympy, FSDP and DTensor) on the first
# call of any function wrapped by ``torch._disable_dynamo`` -- the Python
# meta kernels of ``mm`` and friends, every ``Optimizer.__init__`` and
# ``step`` -- only to wrap that function in "do not compile this", which
# means nothing when nothing is being compiled. That import was 80% of a
# build beyond ``import torch``.
#
# While :func:`eager_torch` is active and dynamo is not already imported,
# ``sys.modules["torch._dynamo"]`` is a stand-in whose ``disable`` returns the
# function itself and whose ``graph_break`` does nothing: exactly what the
# real ones do outside a compiled region. Anything else asked of it (user
# code calling ``torch.compile``, importing a submodule of dynamo) puts the
# real ``torch._dynamo`` back first and answers from it, so behaviour never
# differs, only the import is saved when it is not needed. (The memory plan
# after placement runs on FakeTensorMode, which does need it: the analysis
# before placement is what runs without dynamo.) On exit the
# stand-in is removed, and so is what ``torch._disable_dynamo`` cached on the
# functions it wrapped (``fn.__dynamo_disable``), so that a later real dynamo
# wraps them properly.
#
# Importing the real one has a side effect on the process's environment:
# dynamo's cache module sets ``TORCHINDUCTOR_CACHE_DIR`` in ``os.environ``
# (torch/_inductor/runtime/cache_dir_utils.py). A spec's own module built
# after that saw a variable the user never set (the contained child's
# environment is kept to a fixed list). :func:`import_dynamo` imports it
# where the build needs it and leaves ``os.environ`` as it found it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from typing import Any, Callable, Iterator

import torch

_NAME = "torch._dynamo"
_CACHE = "__dynamo_disable"  # the attribute torch._disable_dynamo caches its wrapper in


class _StandIn(types.ModuleType):
    """``torch._dynamo`` as far as eager code outside any compiled region
    needs it (see NOTE [No dynamo at build time])."""

    def __init__(self) -> None:
        super().__init__(_NAME)
        self.wrapped: list[Callable] = []  # the functions disable() was given
        self.active = True

    def disable(self, fn: Any = None, recursive: bool = True, *args: Any,
                **kwargs: Any) -> Any:
        if fn is None:  # used as @disable(recursive=False)
            return lambda f: self.disable(f, recursive)
        self.wrapped.append(fn)
        return fn

    @staticmethod
    def graph_break() -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        # A module's optional dunders (``__file__``, probed by inspect over all
        # of sys.modules) are simply absent; anything else, and ``__path__``
        # for the import of a submodule, comes from the real one.
        if name.startswith("__") and name.endswith("__") and name != "__path__":
            raise AttributeError(name)
        return getattr(self.restore(), name)

    def restore(self) -> types.ModuleType:
        """Put the real ``torch._dynamo`` in place (importing it) and return it."""
        if self.active:
            self.active = False
            self.forget()
            if sys.modules.get(_NAME) is self:
                del sys.modules[_NAME]
            if vars(torch).get("_dynamo") is self:
                delattr(torch, "_dynamo")
        return importlib.import_module(_NAME)

    def forget(self) -> None:
        """Drop the caches ``torch._disable_dynamo`` left on the functions it
        wrapped through this stand-in."""
        for fn in self.wrapped:
            if getattr(fn, _CACHE, None) is fn:
                try:
                    delattr(fn, _CACHE)
                except (AttributeError, TypeError):
                    pass
        self.wrapped.clear()


@contextlib.contextmanager
def eager_torch() -> Iterator[None]:
    """Run torch eagerly without importing ``torch._dynamo`` unless something
    really needs it (NOTE [No dynamo at build time]). Re-entrant; does
    nothing when dynamo is already imported."""
    if _NAME in sys.modules:
        yield
        return
    stand_in = _StandIn()
    sys.modules[_NAME] = stand_in
    try:
        yield
    finally:
        if stand_in.active:
            stand_in.active = False
            stand_in.forget()
            if sys.modules.get(_NAME) is stand_in:
                del sys.modules[_NAME]
            if vars(torch).get("_dynamo") is stand_in:
                delattr(torch, "_dynamo")


def import_dynamo() -> types.ModuleType:
    """The real ``torch._dynamo``, imported (if it was not) without the
    variables its import sets in ``os.environ`` (NOTE [No dynamo at build
    time])."""
    stand_in = sys.modules.get(_NAME)
    before = dict(os.environ)
    try:
        if isinstance(stand_in, _StandIn):
            return stand_in.restore()
        return importlib.import_module(_NAME)
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
