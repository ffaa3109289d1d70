"""The wrapper tensor: a CPU tensor that reports a virtual CUDA device."""

from __future__ import annotations

from typing import Optional

import torch

from mpgen.testing import _state
from mpgen.testing._state import CPU, CPU_DEVICE, TORCH_CUDA, State, VirtualDeviceError, dev_str
from mpgen.testing._torch_compat import (
    TensorBase,
    disabled_torch_function_impl,
    is_parameter_data,
    make_wrapper_subclass,
    mark_parameter_data,
    no_torch_function,
    raw_ops,
    swap_tensors,
)


class VirtualTensor(torch.Tensor):
    """A CPU tensor that reports a virtual CUDA device.

    ``_elem`` is the real CPU tensor holding the data; ``_vi`` the logical
    device index (``None`` for internal tensors whose device is not known
    yet).  Do not construct directly; use ``.to("cuda:i")`` or factories with
    ``device=`` inside :func:`virtual_devices`.
    """

    __module__ = "mpgen.testing"

    _elem: torch.Tensor
    _vi: Optional[int]

    @staticmethod
    def __new__(cls, elem, vi, state, requires_grad=False):
        if elem.layout is not torch.strided:
            raise VirtualDeviceError(
                f"virtual devices support only strided tensors, got {elem.layout}"
            )
        r = make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=CPU_DEVICE,
            requires_grad=requires_grad,
        )
        r._elem = elem
        r._vi = vi
        r._vstate = state
        return r

    # torch functions on a VirtualTensor are handled by the mode (inside the
    # context) or by the methods below; no per-call subclass overhead.
    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only reached when no virtual_devices mode is active (the tensor is
        # used after the context exited): keep checking devices.
        state = find_state(args, kwargs)
        return _dispatch.dispatch(state, func, args, kwargs or {})

    # traceable-wrapper-subclass protocol: makes nn.Module._apply use
    # torch.utils.swap_tensors, so Module.to("cuda:i") keeps Parameter identity.
    def __tensor_flatten__(self):
        return ["_elem"], (self._vi, self._vstate)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        vi, state = meta
        return VirtualTensor(inner["_elem"], vi, state)

    # ---- device reporting ----
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        vi = self._vi
        return CPU_DEVICE if vi is None else TORCH_CUDA[vi]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return self._vi is not None

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return self._vi is None

    def get_device(self) -> int:  # type: ignore[override]
        return -1 if self._vi is None else self._vi

    # ---- moves ----
    def to(self, *args, **kwargs):  # type: ignore[override]
        return _moves.tensor_to(self, args, kwargs)

    def cuda(  # type: ignore[override]
        self, device=None, non_blocking=False, memory_format=torch.preserve_format
    ):
        return _moves.tensor_cuda(self, device, non_blocking, memory_format)

    def cpu(self, memory_format=torch.preserve_format):  # type: ignore[override]
        return _moves.tensor_to(self, (CPU_DEVICE,), {"memory_format": memory_format})

    def copy_(self, src, non_blocking=False):  # type: ignore[override]
        return _moves.tensor_copy(TensorBase.copy_, self, src, non_blocking)

    def pin_memory(self, *args, **kwargs):  # type: ignore[override]
        raise VirtualDeviceError("cannot pin 'cuda' memory: only dense CPU tensors can be pinned")

    def is_pinned(self, *args, **kwargs):  # type: ignore[override]
        return False

    def record_stream(self, stream):  # type: ignore[override]
        return None

    # ---- data access ----
    def numpy(self, *args, **kwargs):  # type: ignore[override]
        if self._vi is None:
            return self._elem.numpy(*args, **kwargs)
        raise TypeError(
            f"can't convert {dev_str(self._vi)} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def tolist(self):  # type: ignore[override]
        with raw_ops():
            return self._elem.tolist()

    def data_ptr(self) -> int:  # type: ignore[override]
        with raw_ops():
            return self._elem.data_ptr()

    def untyped_storage(self):  # type: ignore[override]
        with raw_ops():
            return self._elem.untyped_storage()

    @property
    def data(self):  # type: ignore[override]
        return TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, VirtualTensor):
            # e.g. Module.cpu(): turn this object into a plain tensor in place
            swap_data(self, new)
            return
        TensorBase.data.__set__(self, new)
        self._elem = new._elem
        self._vi = new._vi

    def __format__(self, format_spec):
        if self.dim() == 0 and format_spec:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None):  # type: ignore[override]
        with raw_ops():
            body = repr(self._elem)
        extras = [f"device='{dev_str(self._vi)}'"]
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        head = "Parameter containing:\n" if is_parameter_data(self) else ""
        return head + body[:-1] + ", " + ", ".join(extras) + ")"

    def __reduce_ex__(self, proto):
        # Pickling (torch.save) stores the data as a plain CPU tensor.
        with raw_ops():
            return self._elem.detach().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = wrap(raw_clone(self._elem), self._vi, self._vstate)
        new.requires_grad_(self.requires_grad)
        if is_parameter_data(self):
            mark_parameter_data(new)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        memo[id(self)] = new
        return new


def swap_data(t: torch.Tensor, new: torch.Tensor) -> None:
    """``t.data = new`` where exactly one of them is a VirtualTensor: the C++
    ``set_data`` cannot change the Python class, so swap the tensor objects
    (keeps the identity of ``t``, e.g. a module's Parameter)."""
    requires_grad = t.requires_grad
    grad = t.grad
    with torch.no_grad():
        repl = new.detach()
    if isinstance(t, torch.nn.Parameter):
        repl = torch.nn.Parameter(repl, requires_grad=requires_grad)
    elif requires_grad:
        repl.requires_grad_(True)
    if grad is not None:
        t.grad = None
    swap_tensors(t, repl)
    if grad is not None:
        # keep the gradient, on the new device (not recorded as a transfer:
        # nn.Module._apply moves the gradient itself right after this)
        g = grad._elem if type(grad) is VirtualTensor else grad
        g = raw_clone(g)
        if type(t) is VirtualTensor:
            g = wrap(g, t._vi, t._vstate)
        with no_torch_function():
            t.grad = g


def is_virtual(t) -> bool:
    """True if ``t`` is a tensor on a virtual CUDA device."""
    return type(t) is VirtualTensor and t._vi is not None


def find_state(args, kwargs) -> State:
    for a in args:
        if type(a) is VirtualTensor:
            return a._vstate
        if isinstance(a, (list, tuple)):
            for b in a:
                if type(b) is VirtualTensor:
                    return b._vstate
    for a in (kwargs or {}).values():
        if type(a) is VirtualTensor:
            return a._vstate
    return _state.ACTIVE or State(0)


def wrap(elem: torch.Tensor, vi, state: State, requires_grad: bool = False):
    w = VirtualTensor(elem, vi, state, requires_grad)
    state.register(elem, vi)
    return w


def raw_clone(elem: torch.Tensor) -> torch.Tensor:
    with raw_ops():
        return elem.clone()


def logical(t):
    """Logical device code of a tensor (int, -1 for cpu, None for wildcard)."""
    if type(t) is VirtualTensor:
        return t._vi
    with no_torch_function():
        dt = t.device
    return CPU if dt.type == "cpu" else str(dt)


# The tensor's methods call into these modules, which import this one: bound
# as modules, last, so that importing any of them first works.
from mpgen.testing import _dispatch, _moves  # noqa: E402
