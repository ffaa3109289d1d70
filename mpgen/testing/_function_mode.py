"""The torch-function level: device arguments and moves.

A ``TorchFunctionMode`` translates device arguments before they reach
PyTorch's C++ argument parser, which refuses ``cuda`` on a CPU build:
factories with ``device=``, ``Tensor.to``/``.cuda``/``.cpu``, cross-device
``copy_``, ``Tensor.new_*``, ``.type("torch.cuda.FloatTensor")``.
"""

from __future__ import annotations

import types as _pytypes

import torch

from mpgen.testing._moves import tensor_copy, tensor_cuda, tensor_to
from mpgen.testing._state import (
    CPU,
    CPU_DEVICE,
    TORCH_CUDA,
    UNSET,
    State,
    VirtualDeviceError,
    dev_str,
)
from mpgen.testing._tensor import VirtualTensor, logical, swap_data, wrap
from mpgen.testing._torch_compat import TensorBase, TorchFunctionMode, redispatch

_FACTORY_NAMES = [
    "empty",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "tensor",
    "as_tensor",
    "asarray",
    "scalar_tensor",
    "empty_strided",
    "empty_permuted",
    "tril_indices",
    "triu_indices",
    "normal",
    "bartlett_window",
    "blackman_window",
    "hamming_window",
    "hann_window",
    "kaiser_window",
    "from_numpy",
    "frombuffer",
]
_FACTORIES = set()
for _n in _FACTORY_NAMES:
    _f = getattr(torch, _n, None)
    if _f is not None:
        _FACTORIES.add(_f)


def _unwrap_plain(x):
    if type(x) is VirtualTensor:
        return x._elem
    if isinstance(x, (list, tuple)) and any(type(y) is VirtualTensor for y in x):
        return type(x)(_unwrap_plain(y) for y in x)
    return x


def _devirtualize(r):
    """Return a plain CPU tensor for a wildcard result reaching user code."""
    if type(r) is VirtualTensor and r._vi is None:
        if r.grad_fn is None:
            e = r._elem
            if r.requires_grad:
                e = e.detach().requires_grad_(True)
            return e
    return r


class VirtualFunctionMode(TorchFunctionMode):
    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._inside: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        h = _TF_HANDLERS.get(func)
        if h is not None:
            return h(self, func, types, args, kwargs)
        if "device" in kwargs or func in _FACTORIES:
            return self._factory(func, types, args, kwargs)
        if type(func) is _pytypes.FunctionType and func not in self._inside and redispatch:
            # Python-level function (F.*, Tensor methods written in Python):
            # keep the mode active for its body, so device arguments used
            # inside it are translated too.  A second request for the same
            # function comes from its own C++ base implementation
            # (e.g. Tensor.unflatten -> super().unflatten): run that plainly.
            self._inside.add(func)
            try:
                with self:
                    r = redispatch(func, types, args, kwargs)
            finally:
                self._inside.discard(func)
        else:
            r = func(*args, **kwargs)
        if type(r) is VirtualTensor and r._vi is None:
            r = _devirtualize(r)
        return r

    def _factory(self, func, types, args, kwargs):
        state = self.state
        dev = kwargs.get("device", None)
        if dev is None and func is torch.as_tensor and len(args) > 2:
            dev = args[2]
        target = state.parse(dev) if dev is not None else UNSET
        if target is UNSET and dev is not None:  # some other real device: leave alone
            state.factory_depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                state.factory_depth -= 1
        data = args[0] if args else kwargs.get("data")
        if func in (torch.as_tensor, torch.asarray) and isinstance(data, torch.Tensor):
            dtype = kwargs.get(
                "dtype", args[1] if len(args) > 1 and func is torch.as_tensor else None
            )
            kw = {}
            if dtype is not None:
                kw["dtype"] = dtype
            if target is not UNSET:
                kw["device"] = TORCH_CUDA[target] if target >= 0 else CPU_DEVICE
            return tensor_to(data, (), kw)
        if target is UNSET:
            # no device given: default (cpu) unless a tensor argument decides
            if any(isinstance(a, torch.Tensor) for a in args):
                return func(*args, **kwargs)
            target = CPU
        nkw = dict(kwargs)
        if "device" in nkw:
            nkw["device"] = CPU_DEVICE
        if func is torch.as_tensor and len(args) > 2:
            args = args[:2]
        nargs = [_unwrap_plain(a) for a in args]
        nkw = {k: _unwrap_plain(v) for k, v in nkw.items()}
        state.factory_depth += 1
        try:
            r = func(*nargs, **nkw)
        finally:
            state.factory_depth -= 1
        if target == CPU or not isinstance(r, torch.Tensor):
            return r
        if type(r) is VirtualTensor:  # e.g. a wildcard from internals
            r = r._elem
        return wrap(r.detach(), target, state, requires_grad=r.requires_grad)


def _tf_to(mode, func, types, args, kwargs):
    return tensor_to(args[0], args[1:], kwargs)


def _tf_cuda(mode, func, types, args, kwargs):
    x = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    return tensor_cuda(x, device, False, kwargs.get("memory_format", torch.preserve_format))


def _tf_cpu(mode, func, types, args, kwargs):
    mf = args[1] if len(args) > 1 else kwargs.get("memory_format", torch.preserve_format)
    return tensor_to(args[0], (CPU_DEVICE,), {"memory_format": mf})


def _tf_copy(mode, func, types, args, kwargs):
    src = args[1] if len(args) > 1 else kwargs["src"]
    nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return tensor_copy(func, args[0], src, nb)


def _tf_pin(mode, func, types, args, kwargs):
    x = args[0]
    if type(x) is VirtualTensor:
        return x.pin_memory()
    return x  # pinning is meaningless here; return the tensor itself


def _tf_is_pinned(mode, func, types, args, kwargs):
    return False


def _tf_noop(mode, func, types, args, kwargs):
    return None


def _tf_new(mode, func, types, args, kwargs):
    """Tensor.new_* on a virtual tensor: the result lives on its device."""
    x = args[0]
    if type(x) is VirtualTensor and x._vi is not None and kwargs.get("device") is None:
        kwargs = dict(kwargs)
        kwargs["device"] = TORCH_CUDA[x._vi]
    if kwargs.get("device") is not None:
        return mode._factory(func, types, args, kwargs)
    return func(*args, **kwargs)


def _tf_set_grad(mode, func, types, args, kwargs):
    t, g = args
    if g is not None and isinstance(g, torch.Tensor):
        dt, dg = logical(t), logical(g)
        if dt != dg and dt is not None and dg is not None:
            raise VirtualDeviceError(
                f"assigned grad has data located on {dev_str(dg)}, "
                f"but the tensor is on {dev_str(dt)}"
            )
    return func(*args, **kwargs)


def _tf_type(mode, func, types, args, kwargs):
    x = args[0]
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    if dtype is None:
        name = func(*args, **kwargs)
        if type(x) is VirtualTensor and x._vi is not None and isinstance(name, str):
            name = name.replace("torch.", "torch.cuda.", 1)
        return name
    if isinstance(dtype, str) and dtype.startswith("torch."):
        cls = getattr(torch, dtype.split(".")[-1], None)
        if cls is not None and hasattr(cls, "dtype"):
            dev = mode.state.current if dtype.startswith("torch.cuda.") else CPU
            target = TORCH_CUDA[dev] if dev != CPU else CPU_DEVICE
            return tensor_to(x, (target, cls.dtype), {})
    return func(*args, **kwargs)


def _tf_set_data(mode, func, types, args, kwargs):
    t, new = args
    if type(t) is not VirtualTensor and type(new) is VirtualTensor:
        return swap_data(t, new)
    return func(*args, **kwargs)


_TF_HANDLERS = {
    TensorBase.to: _tf_to,
    TensorBase.cuda: _tf_cuda,
    TensorBase.cpu: _tf_cpu,
    TensorBase.copy_: _tf_copy,
    TensorBase.pin_memory: _tf_pin,
    TensorBase.is_pinned: _tf_is_pinned,
    TensorBase.record_stream: _tf_noop,
    TensorBase.data.__set__: _tf_set_data,
    TensorBase.grad.__set__: _tf_set_grad,
    TensorBase.type: _tf_type,
}
for _n in (
    "new_tensor",
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty_strided",
    "new",
):
    _TF_HANDLERS[getattr(TensorBase, _n)] = _tf_new
