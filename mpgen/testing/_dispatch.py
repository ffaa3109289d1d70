"""The dispatch level: every ATen op sees logical devices.

While a virtual_devices() context is active, a ``TorchDispatchMode`` unwraps
the arguments of every op, checks that its tensors sit on one logical device
(raising :class:`~mpgen.testing.VirtualDeviceError` with PyTorch's message
otherwise), runs the CPU kernel and re-wraps the results on that device.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from mpgen.testing._state import (
    CPU,
    CPU_DEVICE,
    UNSET,
    State,
    Transfer,
    VirtualDeviceError,
    dev_str,
)
from mpgen.testing._tensor import VirtualTensor, logical, wrap
from mpgen.testing._torch_compat import (
    TensorBase,
    TorchDispatchMode,
    in_autograd_backward,
    no_torch_function,
    op_schema,
    raw_ops,
    set_torch_dispatch,
)


def _dev_order(d):
    # cuda devices by index, then cpu, then anything else
    if isinstance(d, int):
        return (0, d, "") if d >= 0 else (1, 0, "")
    return (2, 0, str(d))


def _mixed_error(common, other, opname: str, argname: str) -> VirtualDeviceError:
    # The two devices are named in a fixed order (cuda:0 < cuda:1 < ... < cpu)
    # so that messages do not depend on argument order; the bracket says
    # which argument is where.
    a, b = sorted((common, other), key=_dev_order)
    return VirtualDeviceError(
        "Expected all tensors to be on the same device, but found at least two "
        f"devices, {dev_str(a)} and {dev_str(b)}! (when running {opname}) "
        f"[argument '{argname}' is on {dev_str(other)}, other tensors on "
        f"{dev_str(common)}; detected by mpgen.testing.virtual_devices]"
    )


class _OpInfo:
    __slots__ = ("kind", "name", "argnames", "exempt")

    def __init__(self, func):
        schema = op_schema(func)
        self.name = schema.name
        self.argnames = [a.name for a in schema.arguments]
        base = self.name.split("::")[-1]
        if base.startswith("_foreach_") or base.startswith("_fused_"):
            self.kind = "foreach"
        elif base in ("copy_", "_copy_from", "_copy_from_and_resize"):
            self.kind = "copy"
        elif base == "set_":
            self.kind = "set"
        else:
            self.kind = "default"
        # arguments that may hold CPU tensors next to CUDA ones (index tensors)
        self.exempt = set()
        if base in (
            "index",
            "index_put",
            "index_put_",
            "_index_put_impl_",
            "_unsafe_index",
            "_unsafe_index_put",
        ):
            self.exempt.add("indices")


_OPINFO: Dict[Any, _OpInfo] = {}


def _opinfo(func) -> _OpInfo:
    info = _OPINFO.get(func)
    if info is None:
        info = _OPINFO[func] = _OpInfo(func)
    return info


class _Acc:
    """Accumulates the logical devices of an op's tensor arguments."""

    __slots__ = ("dev", "wild", "tensor", "pairs", "opname")

    def __init__(self, opname):
        self.dev = UNSET
        self.wild = False
        self.tensor = False
        self.pairs = []
        self.opname = opname

    def see(self, t, argname, exempt=False):
        self.tensor = True
        if type(t) is VirtualTensor:
            d = t._vi
            e = t._elem
            self.pairs.append((e, t))
            if d is None:
                self.wild = True
                return e
        else:
            self.pairs.append((t, t))  # so in-place results map back to it
            dt = t.device
            if dt.type == "cpu":
                if exempt or t.dim() == 0:
                    return t
                d = CPU
            else:
                d = str(dt)
            e = t
        cur = self.dev
        if cur is UNSET:
            self.dev = d
        elif cur != d:
            raise _mixed_error(cur, d, self.opname, argname)
        return e

    def unwrap(self, x, argname, exempt=False):
        if isinstance(x, torch.Tensor):
            return self.see(x, argname, exempt)
        if isinstance(x, (list, tuple)) and x:
            out = None
            for i, y in enumerate(x):
                if isinstance(y, torch.Tensor):
                    if out is None:
                        out = list(x)
                    out[i] = self.see(y, argname, exempt)
            if out is not None:
                return out if isinstance(x, list) else tuple(out)
        return x

    def out_device(self, state: State):
        if self.dev is not UNSET:
            return self.dev
        if self.wild:
            return None
        if self.tensor:
            return CPU
        return CPU if state.factory_depth else None


def is_cuda_code(d) -> bool:
    return type(d) is int and d >= 0


def _rewrap(r, d, acc: _Acc, state: State):
    if isinstance(r, torch.Tensor):
        for e, w in acc.pairs:
            if e is r:
                if w is e:  # a plain input returned (in-place / out=)
                    return w
                if w._vi is None and is_cuda_code(d):
                    state.promote(w, d)
                if (
                    w.shape != r.shape
                    or w.stride() != r.stride()
                    or w.storage_offset() != r.storage_offset()
                ):
                    sync_meta(w, state)
                return w
        if d is None or is_cuda_code(d):
            return wrap(r, d, state)
        return r
    if isinstance(r, (list, tuple)):
        out = [_rewrap(x, d, acc, state) for x in r]
        return out if isinstance(r, list) else tuple(out)
    return r


def sync_meta(w: VirtualTensor, state: State) -> None:
    """An in-place op (resize_, t_, unsqueeze_, set_, out=...) changed the
    size/stride of the inner tensor: mirror it on the wrapper."""
    e = w._elem
    with raw_ops():
        n = e.untyped_storage().nbytes() // max(e.element_size(), 1)
        if TensorBase.untyped_storage(w).nbytes() < n * e.element_size():
            TensorBase.resize_(w, (n,))  # wrapper storage has no data
        TensorBase.as_strided_(w, e.size(), e.stride(), e.storage_offset())
    state.register(e, w._vi, refresh=True)


def dispatch(state: State, func, args, kwargs):
    with no_torch_function():
        info = _opinfo(func)
        if info.kind == "foreach":
            return _dispatch_foreach(state, func, info, args, kwargs)
        if info.kind == "copy":
            return _dispatch_copy(state, func, info, args, kwargs)
        acc = _Acc(info.name)
        names = info.argnames
        exempt = info.exempt
        nargs = []
        for i, a in enumerate(args):
            n = names[i] if i < len(names) else "?"
            nargs.append(acc.unwrap(a, n, n in exempt))
        nkwargs = kwargs
        if kwargs:
            nkwargs = {k: acc.unwrap(v, k, k in exempt) for k, v in kwargs.items()}
        d = acc.out_device(state)
        dev_kw = nkwargs.get("device") if nkwargs else None
        if dev_kw is not None:
            # Only C++ internals reach here with a device (always cpu, since a
            # virtual tensor is a CPU tensor for C++).  A genuine cuda device
            # (should not happen) is honoured on factory ops; factories for
            # other real devices (meta) give plain tensors.
            code = state.parse(dev_kw) if state.n else UNSET
            if is_cuda_code(code):
                nkwargs = dict(nkwargs)
                nkwargs["device"] = CPU_DEVICE
                if not acc.tensor:
                    d = code
            elif code is UNSET and not acc.tensor:
                d = CPU
        r = func(*nargs, **nkwargs)
        if info.kind == "set" and type(args[0]) is VirtualTensor:
            sync_meta(args[0], state)
        return _rewrap(r, d, acc, state)


def _dispatch_copy(state, func, info, args, kwargs):
    # copy_(self, src, non_blocking): crossing devices is allowed (a transfer)
    dst, src = args[0], args[1]
    dd = dst._vi if type(dst) is VirtualTensor else logical(dst)
    ds = src._vi if type(src) is VirtualTensor else logical(src)
    de = dst._elem if type(dst) is VirtualTensor else dst
    se = src._elem if type(src) is VirtualTensor else src
    if dd is None and is_cuda_code(ds):
        state.promote(dst, ds)
        dd = ds
    if dd != ds and dd is not None and ds is not None and state.active:
        phase = "backward" if in_autograd_backward() else "forward"
        state.record(
            Transfer(
                dev_str(ds),
                dev_str(dd),
                se.numel() * de.element_size(),
                tuple(se.shape),
                de.dtype,
                phase,
            )
        )
    r = func(de, se, *args[2:], **kwargs)
    return dst if r is de else r


def _dispatch_foreach(state, func, info, args, kwargs):
    names = info.argnames
    n = None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            n = len(a)
            break
    if n is None:
        acc = _Acc(info.name)
        nargs = [acc.unwrap(a, "?") for a in args]
        nkw = {k: acc.unwrap(v, k) for k, v in kwargs.items()}
        return _rewrap(func(*nargs, **nkw), acc.out_device(state), acc, state)
    accs = [_Acc(info.name) for _ in range(n)]

    def conv(a, argname):
        if (
            isinstance(a, (list, tuple))
            and len(a) == n
            and any(isinstance(x, torch.Tensor) for x in a)
        ):
            return [
                accs[i].see(x, argname) if isinstance(x, torch.Tensor) else x
                for i, x in enumerate(a)
            ]
        if isinstance(a, torch.Tensor):
            e = None
            for acc in accs:
                e = acc.see(a, argname)
            return e
        return a

    nargs = [conv(a, names[i] if i < len(names) else "?") for i, a in enumerate(args)]
    nkw = {k: conv(v, k) for k, v in kwargs.items()}
    r = func(*nargs, **nkw)
    if isinstance(r, (list, tuple)) and len(r) == n:
        return [_rewrap(x, accs[i].out_device(state), accs[i], state) for i, x in enumerate(r)]
    if r is None:
        return None
    return _rewrap(r, None, _Acc(info.name), state)


class VirtualDispatchMode(TorchDispatchMode):
    def __init__(self, state: State):
        super().__init__()
        self.state = state


def _mode_torch_dispatch(self, func, types, args=(), kwargs=None):
    return dispatch(self.state, func, args, kwargs or {})


# Assigned after class creation on purpose (see set_torch_dispatch).
set_torch_dispatch(VirtualDispatchMode, _mode_torch_dispatch)
