"""Device moves: ``Tensor.to``/``.cuda``/``.cpu``/cross-device ``copy_``.

A move between logical devices is an autograd function that copies the
data, records a :class:`~mpgen.testing.Transfer` and, in backward, moves the
gradient back (recorded with ``phase="backward"``).
"""

from __future__ import annotations

from typing import Optional

import torch

from mpgen.testing import _state
from mpgen.testing._state import (
    CPU,
    TORCH_CUDA,
    UNSET,
    State,
    Transfer,
    VirtualDeviceError,
    dev_str,
)
from mpgen.testing._tensor import VirtualTensor, logical, raw_clone, wrap
from mpgen.testing._torch_compat import TensorBase


def _move_raw(x, src, dst, state: Optional[State], phase: str):
    elem = x._elem if type(x) is VirtualTensor else x
    new = raw_clone(elem)
    if state is not None and state.active:
        state.record(
            Transfer(
                dev_str(src),
                dev_str(dst),
                new.numel() * new.element_size(),
                tuple(new.shape),
                new.dtype,
                phase,
            )
        )
    if dst == CPU:
        return new
    return wrap(new, dst, state)


class _Transfer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dst, state):
        ctx.set_materialize_grads(False)
        src = logical(x)
        ctx.src = src
        ctx.state = state
        return _move_raw(x, src, dst, state, "forward")

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None
        gd = logical(g)
        if gd == ctx.src or gd is None:
            return g, None, None
        return _move_raw(g, gd, ctx.src, ctx.state, "backward"), None, None


def transfer(x, dst, state):
    return _Transfer.apply(x, dst, state)


class _OtherDevice:
    """A real, non-cpu/cuda target device (e.g. meta) requested by .to()."""

    __slots__ = ("device",)

    def __init__(self, device):
        self.device = torch.device(device)


def _code_of(state: Optional[State], dev):
    """Device code for a device given to .to()/.cuda()."""
    if isinstance(dev, int) and not isinstance(dev, bool):
        if state is None:
            return _parse_without_state(dev)
        return state.check_index(dev)
    code = state.parse(dev) if state is not None else _parse_without_state(dev)
    if code is UNSET:
        return _OtherDevice(dev)
    return code


def _parse_to_args(state: Optional[State], args, kwargs):
    """Parse ``Tensor.to(...)`` arguments.

    Returns (device code | UNSET | _OtherDevice, dtype, copy, memory_format).
    Forms: to(dtype, non_blocking, copy, *, memory_format),
    to(device, dtype, non_blocking, copy, *, memory_format),
    to(other, non_blocking, copy), and keyword variants.
    """
    device = UNSET
    raw_device = None
    dtype = None
    a = list(args)
    if a:
        first = a[0]
        if isinstance(first, torch.Tensor):
            a.pop(0)
            device = logical(first)
            dtype = first.dtype
        elif isinstance(first, torch.dtype):
            a.pop(0)
            dtype = first
        elif first is None or isinstance(first, (str, int, torch.device)):
            a.pop(0)
            raw_device = first
            if a and (a[0] is None or isinstance(a[0], torch.dtype)):
                dtype = a.pop(0)
    copy = bool(a[1]) if len(a) > 1 else False  # a == [non_blocking, copy]
    if kwargs.get("device") is not None:
        raw_device = kwargs["device"]
    if kwargs.get("dtype") is not None:
        dtype = kwargs["dtype"]
    copy = bool(kwargs.get("copy", copy))
    memory_format = kwargs.get("memory_format", None)
    if raw_device is not None:
        device = _code_of(state, raw_device)
    return device, dtype, copy, memory_format


def _parse_without_state(dev):
    if isinstance(dev, int) and not isinstance(dev, bool):
        d = torch.device("cuda", dev)
    else:
        d = torch.device(dev)
    if d.type == "cpu":
        return CPU
    if d.type == "cuda":
        raise VirtualDeviceError(
            "a virtual tensor was moved to a CUDA device outside of virtual_devices(); "
            "tensors created inside the context should not be used after it exits "
            "(only .cpu() is supported there)"
        )
    return UNSET


def tensor_to(x, args, kwargs):
    state = x._vstate if type(x) is VirtualTensor else _state.ACTIVE
    if state is not None and not state.active:
        state = None  # used after the context exited: only moves to the CPU work
    device, dtype, copy, memory_format = _parse_to_args(state, args, kwargs)
    src = logical(x)
    if isinstance(device, _OtherDevice):
        if type(x) is VirtualTensor:
            x = transfer(x, CPU, state)
        kw = {"device": device.device, "copy": copy}
        if dtype is not None:
            kw["dtype"] = dtype
        if memory_format is not None:
            kw["memory_format"] = memory_format
        return TensorBase.to(x, **kw)
    if device is UNSET or device == src or (src is None and device == CPU):
        # no logical device change: ordinary dtype / layout conversion
        kw = {}
        if dtype is not None:
            kw["dtype"] = dtype
        if copy:
            kw["copy"] = True
        if memory_format is not None:
            kw["memory_format"] = memory_format
        if not kw:
            return x
        return TensorBase.to(x, **kw)
    y = x
    if (dtype is not None and dtype != x.dtype) or (
        memory_format is not None and memory_format is not torch.preserve_format
    ):
        kw = {}
        if dtype is not None:
            kw["dtype"] = dtype
        if memory_format is not None:
            kw["memory_format"] = memory_format
        y = TensorBase.to(x, **kw)
    return transfer(y, device, state)


def tensor_cuda(x, device, non_blocking, memory_format):
    state = x._vstate if type(x) is VirtualTensor else _state.ACTIVE
    if state is None or not state.active:
        raise VirtualDeviceError("Tensor.cuda() on a virtual tensor outside of virtual_devices()")
    if device is None:
        d = state.current
    elif isinstance(device, int) and not isinstance(device, bool):
        d = state.check_index(device)
    else:
        d = state.parse(device)
        if d == CPU or d is UNSET:
            raise VirtualDeviceError(f"Invalid device, must be cuda device, got {device}")
    return tensor_to(x, (TORCH_CUDA[d],), {"memory_format": memory_format})


def tensor_copy(func, dst, src, non_blocking=False):
    if isinstance(src, torch.Tensor):
        dd, ds = logical(dst), logical(src)
        if isinstance(dd, int) and isinstance(ds, int) and dd != ds:
            state = (
                dst._vstate
                if type(dst) is VirtualTensor
                else (src._vstate if type(src) is VirtualTensor else _state.ACTIVE)
            )
            src = transfer(src, dd, state)
    return func(dst, src, non_blocking)
