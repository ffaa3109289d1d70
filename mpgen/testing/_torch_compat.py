"""Every private PyTorch API that ``mpgen.testing`` uses, in one place.

The virtual devices work at the level PyTorch offers for tensor subclasses
and modes, and part of that level is private: it may change between torch
releases without notice.  Nothing else in ``mpgen.testing`` touches a
``torch._C`` name, ``torch.utils._python_dispatch``, ``_make_wrapper_subclass``,
a storage's ``_cdata`` or an operator's ``_schema``; when a torch release
breaks one of them, this module is the one to change.

Tested on:

* torch 2.14 (PyPI's CUDA build, on a machine without a GPU): the project's
  CI, every test in ``tests/``.
* torch 2.11 (CUDA build, one H200): the generated tests of every example,
  virtual and real-GPU arms.

``pyproject.toml`` states the same range (``torch>=2.11,<2.15``).  What each
name is for, and what older releases lack, is said where it is defined.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode  # public
from torch.utils._python_dispatch import TorchDispatchMode  # private module
from torch.utils._pytree import tree_leaves  # private module (the memory tracker's)

__all__ = [
    "TESTED_TORCH",
    "TensorBase",
    "TorchDispatchMode",
    "TorchFunctionMode",
    "disabled_torch_function_impl",
    "full_float32_on_gpu",
    "in_autograd_backward",
    "is_parameter_data",
    "make_wrapper_subclass",
    "mark_parameter_data",
    "no_torch_function",
    "op_schema",
    "patch_parse_to",
    "preload_dynamo",
    "raw_ops",
    "redispatch",
    "set_torch_dispatch",
    "storage_key",
    "swap_tensors",
    "tree_leaves",
    "trust_foreach",
]

#: The torch releases this package is tested on (see the module docstring).
TESTED_TORCH = ("2.11", "2.13")

#: The C++ tensor base class: its unbound methods (``TensorBase.to``,
#: ``TensorBase.copy_``, ``TensorBase.data.__set__`` ...) are what a
#: ``TorchFunctionMode`` receives as ``func`` for tensor methods, and calling
#: them skips the Python overrides of :class:`VirtualTensor`.
TensorBase = torch._C.TensorBase

#: ``Tensor._make_wrapper_subclass(cls, size, strides=, storage_offset=,
#: dtype=, device=, requires_grad=)``: a tensor object with metadata but no
#: data of its own, the basis of every wrapper tensor subclass.
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass

#: Assigned as a subclass's ``__torch_function__`` to turn the per-call
#: subclass hook off (the modes handle torch functions instead).
disabled_torch_function_impl = torch._C._disabled_torch_function_impl

#: Public since torch 2.1; kept here so the set of torch entry points that
#: the package depends on is in one list.
swap_tensors = torch.utils.swap_tensors


def no_torch_function() -> contextlib.AbstractContextManager:
    """Torch-function handling (modes and subclasses) off inside."""
    return torch._C.DisableTorchFunction()


class raw_ops:  # noqa: N801 - used like a function: ``with raw_ops(): ...``
    """Ops run on plain tensors inside: no torch-function mode or subclass
    hook, no torch-dispatch mode."""

    __slots__ = ("_function", "_dispatch")

    def __enter__(self) -> None:
        self._function = torch._C.DisableTorchFunction()
        self._dispatch = torch._C._DisableTorchDispatch()
        self._function.__enter__()
        self._dispatch.__enter__()

    def __exit__(self, *exc) -> bool:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)
        return False


def _find_redispatch() -> Callable[..., Any] | None:
    # torch >= 2.13: public.
    public = getattr(torch.overrides, "redispatch_function", None)
    if public is not None:
        return public
    # torch 2.11 / 2.12: the private hook it wraps.
    skip = getattr(torch._C, "_skip_one_hop_torch_function", None)
    if skip is None:  # pragma: no cover - not a tested torch
        return None

    def redispatch(func, types, args, kwargs):
        return skip(func, types, args, kwargs)

    return redispatch


#: ``redispatch(func, types, args, kwargs)`` runs a Python-level torch
#: function (``F.linear``, a Tensor method written in Python) from inside a
#: ``TorchFunctionMode.__torch_function__`` with the modes still active, so
#: torch functions called in its body reach the mode too.  None where the
#: running torch has neither form; then such bodies run with the mode off.
redispatch = _find_redispatch()


def storage_key(storage: torch.UntypedStorage) -> int:
    """An id of the C++ StorageImpl, equal for every view of a storage
    (``untyped_storage()`` returns a new Python object on each call)."""
    return storage._cdata


def in_autograd_backward() -> bool:
    """True while the autograd engine runs a backward node."""
    return torch._C._current_autograd_node() is not None


def op_schema(func) -> Any:
    """The ``FunctionSchema`` of an ATen ``OpOverload``: ``.name`` and
    ``.arguments`` (each with ``.name``)."""
    return func._schema


def is_parameter_data(t: torch.Tensor) -> bool:
    """True for the tensor object behind an ``nn.Parameter`` (a tensor
    subclass instance made a Parameter carries ``_is_param``)."""
    return getattr(t, "_is_param", False)


def mark_parameter_data(t: torch.Tensor) -> None:
    t._is_param = True


def set_torch_dispatch(mode_class: type, handler: Callable[..., Any]) -> None:
    """Install ``handler`` as ``mode_class.__torch_dispatch__``.

    Assigned after the class exists on purpose: when the class body defines
    it, ``TorchDispatchMode.__init_subclass__`` wraps it in
    ``torch._disable_dynamo``, which costs several microseconds per op.
    """
    mode_class.__torch_dispatch__ = handler


def patch_parse_to(patcher, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``torch._C._nn._parse_to`` (the argument parser of
    ``nn.Module.to``) by ``wrap(original)`` through ``patcher.set``."""
    patcher.set(torch._C._nn, "_parse_to", wrap(torch._C._nn._parse_to))


def trust_foreach(patcher, tensor_class: type) -> None:
    """Let torch's optimizers and ``clip_grad_norm_`` take their foreach
    form for ``tensor_class`` on a CUDA device, as they do for a real CUDA
    tensor: their default (foreach=None) trusts only the exact types listed
    in ``torch.optim.optimizer._foreach_supported_types`` and
    ``torch.utils._foreach_utils._foreach_supported_types``, and a virtual
    device's tensor is a subclass. Each list is replaced through ``patcher``
    (restored at exit), never changed in place."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    for module in (optimizer, foreach_utils):
        types = getattr(module, "_foreach_supported_types", None)
        if isinstance(types, list) and tensor_class not in types:
            patcher.set(module, "_foreach_supported_types", [*types, tensor_class])


def preload_dynamo() -> None:
    """Import ``torch._dynamo`` now if nothing has.

    It registers polyfills keyed by ``torch.cuda`` functions when first
    imported (the optimizers do that lazily); imported while those are
    patched, it would keep the stand-ins.
    """
    if "torch._dynamo" not in sys.modules:
        importlib.import_module("torch._dynamo")


@contextlib.contextmanager
def full_float32_on_gpu() -> Iterator[None]:
    """Real GPUs compute float32 matmuls and convolutions in full float32
    inside (TF32 off), and restore the previous settings after.

    Uses the interfaces that torch 2.11 and 2.13 both accept without a
    deprecation warning: the matmul precision and ``cudnn.flags``.
    """
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
