"""Virtual CUDA devices on the CPU, for testing model-parallel code without a GPU.

``virtual_devices(cuda=N)`` is a context manager inside which code written
for ``cuda:0`` ... ``cuda:N-1`` runs unchanged on the CPU, while every tensor
keeps track of the *logical* device it would live on::

    from mpgen.testing import virtual_devices, VirtualDeviceError

    with virtual_devices(cuda=2) as vd:
        model = SimpleModel()               # .to("cuda:1") etc. work
        out = model(torch.randn(5, 10))     # out.device == torch.device("cuda:1")
        out.sum().backward()
    vd.transfers                            # [Transfer("cpu", "cuda:0", 200, ...), ...]
    vd.peak_bytes                           # {"cuda:0": ..., "cuda:1": ...}

How it works
------------
* Tensors on a virtual CUDA device are instances of :class:`VirtualTensor`, a
  wrapper tensor subclass (``_make_wrapper_subclass``) holding a real CPU
  tensor (``_elem``) plus a logical device index.  For PyTorch's C++ core the
  wrapper *is* a CPU tensor (a build without CUDA cannot create tensors whose
  C++ device is ``cuda``: the autograd engine would abort), so autograd, the
  CPU kernels and CompositeImplicit decompositions behave exactly as on the
  CPU.  The *Python* attributes ``.device``, ``.is_cuda``, ``.is_cpu`` and
  ``.get_device()`` report the logical device.
* Tensors on the logical CPU are plain ``torch.Tensor`` objects.
* A ``TorchDispatchMode`` sees every ATen operator while the context is
  active: it unwraps the arguments, checks that all tensor arguments sit on
  one logical device (raising :class:`VirtualDeviceError` with PyTorch's
  message otherwise), runs the ordinary CPU kernel and re-wraps the results
  on the common device.  As on real CUDA, zero-dim CPU tensors may be mixed
  with CUDA tensors, ``copy_`` may cross devices, and CPU index tensors may
  index a CUDA tensor.
* A ``TorchFunctionMode`` translates device arguments before they reach
  PyTorch's C++ argument parser (which would refuse ``cuda`` on a CPU build):
  factory functions with ``device=``, ``Tensor.to`` in all its forms,
  ``Tensor.cuda``/``Tensor.cpu``, cross-device ``Tensor.copy_``.  Device
  moves are a custom ``autograd.Function`` which copies the data, records a
  :class:`Transfer` and, in backward, moves the gradient back (recorded with
  ``phase="backward"``).
* ``torch.cuda.is_available``/``device_count``/``current_device``/
  ``synchronize``/streams/events/``memory_allocated`` ... are patched while the
  context is active and restored afterwards.
* Memory: every storage wrapped on a logical device is counted once (keyed by
  its StorageImpl, so views are free) and un-counted when the storage dies
  (``weakref.finalize`` on the storage object).  ``peak_bytes`` is the maximum
  of that live total per device.

Numerics are bit-for-bit those of the same computation on plain CPU tensors
(same kernels, same strides, "CUDA" random numbers from the CPU generator),
so a model-parallel run can be compared exactly with a single-device run
(``virtual_devices(cuda=N, merge=True)`` maps every ``cuda:i`` to ``cuda:0``).

Limits (see ``docs/testing.md``): no stream/event semantics (everything is
synchronous), no caching allocator (bytes of live storages, not reserved
memory), CUDA-only kernels/custom C++ or Triton kernels cannot run, autocast
for ``"cuda"`` is not emulated, the CUDA RNG is the CPU generator, numerics
are the CPU's (not a GPU's), optimizer ``foreach`` defaults resolve as on the
CPU, and tensors created inside the context should not be used after it
exits (``.cpu()`` still works and returns a plain CPU tensor).  Everything is
single-threaded: the modes are thread-local, so code running in other
threads (e.g. DataLoader pin-memory threads) does not see the virtual
devices, while the ``torch.cuda`` patches are process-wide.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types as _pytypes
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

try:  # torch >= 2.13
    from torch.overrides import redispatch_function as _redispatch
except ImportError:  # pragma: no cover - older torch
    _skip = getattr(torch._C, "_skip_one_hop_torch_function", None)
    if _skip is not None:

        def _redispatch(func, types, args, kwargs):
            return _skip(func, types, args, kwargs)

    else:
        _redispatch = None

__all__ = [
    "virtual_devices",
    "VirtualDevices",
    "VirtualDeviceError",
    "VirtualTensor",
    "Transfer",
    "Recording",
    "is_virtual",
]


class VirtualDeviceError(RuntimeError):
    """Raised where real CUDA would fail: mixed devices, bad ordinals, misuse."""


class Transfer(NamedTuple):
    """One device-to-device copy.

    ``phase`` is ``"backward"`` for copies made by the autograd engine while
    running a backward pass (gradients flowing back through a ``.to()``), and
    ``"forward"`` for everything else (including optimizer steps).
    """

    src: str
    dst: str
    nbytes: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    phase: str = "forward"


# --------------------------------------------------------------------------
# logical devices are encoded as: int >= 0 -> cuda:i, -1 -> cpu,
# None -> "wildcard" (tensor created by C++ internals with no device
# information; adopts the device of whatever it is combined with),
# str -> some other real device of a plain tensor (e.g. "meta").
# --------------------------------------------------------------------------
_CPU = -1
_UNSET = object()
_CPU_DEVICE = torch.device("cpu")
_MAX_DEVICES = 64
_TORCH_CUDA = [torch.device("cuda", i) for i in range(_MAX_DEVICES)]
_CUDA_STR = [f"cuda:{i}" for i in range(_MAX_DEVICES)]


def _dev_str(d) -> str:
    if d is None or d == _CPU:
        return "cpu"
    if isinstance(d, int):
        return _CUDA_STR[d]
    return str(d)


def _no_torch_function():
    return torch._C.DisableTorchFunction()


def _raw_ops():
    """Context in which ops run on plain tensors without any mode/subclass."""
    return _RawCtx()


class _RawCtx:
    __slots__ = ("a", "b")

    def __enter__(self):
        self.a = torch._C.DisableTorchFunction()
        self.b = torch._C._DisableTorchDispatch()
        self.a.__enter__()
        self.b.__enter__()

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        self.a.__exit__(*exc)
        return False


# --------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------
class _State:
    def __init__(self, n: int, merge: bool = False):
        self.n = n
        self.merge = merge
        self.current = 0
        self.active = False
        self.transfers: List[Transfer] = []
        self.recordings: List["Recording"] = []
        self.cur: Dict[Any, int] = {i: 0 for i in range(n)}
        self.cur[None] = 0
        self.peak: Dict[Any, int] = {i: 0 for i in range(n)}
        # StorageImpl address -> [logical device, nbytes]
        self.storages: Dict[int, list] = {}
        self.factory_depth = 0
        self._str_cache: Dict[str, Any] = {}

    # ---- devices ----
    def parse(self, dev):
        """Logical device code for a user-supplied device, or _UNSET if it is
        not a cpu/cuda device (left alone)."""
        if dev is None:
            return _UNSET
        if isinstance(dev, str):
            r = self._str_cache.get(dev)
            if r is not None:
                return r if r != "cur" else self.current
            tdev = torch.device(dev)
            r = self._from_torch_device(tdev)
            if tdev.type == "cuda" and tdev.index is None:
                self._str_cache[dev] = "cur"
            else:
                self._str_cache[dev] = r
            return r
        if isinstance(dev, torch.device):
            return self._from_torch_device(dev)
        if isinstance(dev, int) and not isinstance(dev, bool):
            return self.check_index(dev)
        raise TypeError(f"unsupported device specification {dev!r}")

    def _from_torch_device(self, d: torch.device):
        if d.type == "cpu":
            return _CPU
        if d.type == "cuda":
            return self.check_index(self.current if d.index is None else d.index)
        return _UNSET

    def check_index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise VirtualDeviceError(
                f"CUDA error: invalid device ordinal (requested cuda:{i}, but "
                f"virtual_devices(cuda={self.n}) provides cuda:0..cuda:{self.n - 1})"
            )
        return 0 if self.merge else i

    # ---- transfers ----
    def record(self, t: Transfer) -> None:
        self.transfers.append(t)
        for r in self.recordings:
            r.transfers.append(t)

    # ---- memory ----
    def register(self, elem: torch.Tensor, d, refresh: bool = False) -> None:
        """Count the storage of ``elem`` on device ``d`` (once per storage)."""
        st = elem.untyped_storage()
        key = st._cdata
        info = self.storages.get(key)
        if info is not None:
            if info[0] is None and d is not None:
                self._rehome(info, d)
            if refresh:  # the storage may have been resized in place
                nbytes = st.nbytes()
                if nbytes != info[1]:
                    self.cur[info[0]] -= info[1]
                    info[1] = nbytes
                    self._alloc(info[0], nbytes)
            return
        nbytes = st.nbytes()
        self.storages[key] = [d, nbytes]
        weakref.finalize(st, self._free, key)
        self._alloc(d, nbytes)

    def _alloc(self, d, nbytes: int) -> None:
        c = self.cur[d] + nbytes
        self.cur[d] = c
        if d is None:
            return
        if c > self.peak[d]:
            self.peak[d] = c
        for r in self.recordings:
            if c > r._peak[d]:
                r._peak[d] = c

    def _free(self, key: int) -> None:
        info = self.storages.pop(key, None)
        if info is not None:
            self.cur[info[0]] -= info[1]

    def _rehome(self, info: list, d) -> None:
        self.cur[None] -= info[1]
        info[0] = d
        self._alloc(d, info[1])

    def promote(self, w: "VirtualTensor", d) -> None:
        w._vi = d
        info = self.storages.get(w._elem.untyped_storage()._cdata)
        if info is not None and info[0] is None:
            self._rehome(info, d)


_ACTIVE: Optional[_State] = None


# --------------------------------------------------------------------------
# the wrapper tensor
# --------------------------------------------------------------------------
class VirtualTensor(torch.Tensor):
    """A CPU tensor that reports a virtual CUDA device.

    ``_elem`` is the real CPU tensor holding the data; ``_vi`` the logical
    device index (``None`` for internal tensors whose device is not known
    yet).  Do not construct directly; use ``.to("cuda:i")`` or factories with
    ``device=`` inside :func:`virtual_devices`.
    """

    _elem: torch.Tensor
    _vi: Optional[int]

    @staticmethod
    def __new__(cls, elem, vi, state, requires_grad=False):
        if elem.layout is not torch.strided:
            raise VirtualDeviceError(
                f"virtual devices support only strided tensors, got {elem.layout}"
            )
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=_CPU_DEVICE,
            requires_grad=requires_grad,
        )
        r._elem = elem
        r._vi = vi
        r._vstate = state
        return r

    # torch functions on a VirtualTensor are handled by the mode (inside the
    # context) or by the methods below; no per-call subclass overhead.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only reached when no virtual_devices mode is active (the tensor is
        # used after the context exited): keep checking devices.
        state = _find_state(args, kwargs)
        return _dispatch(state, func, args, kwargs or {})

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
        return _CPU_DEVICE if vi is None else _TORCH_CUDA[vi]

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
        return _tensor_to(self, args, kwargs)

    def cuda(  # type: ignore[override]
        self, device=None, non_blocking=False, memory_format=torch.preserve_format
    ):
        return _tensor_cuda(self, device, non_blocking, memory_format)

    def cpu(self, memory_format=torch.preserve_format):  # type: ignore[override]
        return _tensor_to(self, (_CPU_DEVICE,), {"memory_format": memory_format})

    def copy_(self, src, non_blocking=False):  # type: ignore[override]
        return _tensor_copy(torch._C.TensorBase.copy_, self, src, non_blocking)

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
            f"can't convert {_dev_str(self._vi)} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def tolist(self):  # type: ignore[override]
        with _raw_ops():
            return self._elem.tolist()

    def data_ptr(self) -> int:  # type: ignore[override]
        with _raw_ops():
            return self._elem.data_ptr()

    def untyped_storage(self):  # type: ignore[override]
        with _raw_ops():
            return self._elem.untyped_storage()

    @property
    def data(self):  # type: ignore[override]
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, VirtualTensor):
            # e.g. Module.cpu(): turn this object into a plain tensor in place
            _swap_data(self, new)
            return
        torch._C.TensorBase.data.__set__(self, new)
        self._elem = new._elem
        self._vi = new._vi

    def __format__(self, format_spec):
        if self.dim() == 0 and format_spec:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self, *, tensor_contents=None):  # type: ignore[override]
        with _raw_ops():
            body = repr(self._elem)
        extras = [f"device='{_dev_str(self._vi)}'"]
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        head = "Parameter containing:\n" if getattr(self, "_is_param", False) else ""
        return head + body[:-1] + ", " + ", ".join(extras) + ")"

    def __reduce_ex__(self, proto):
        # Pickling (torch.save) stores the data as a plain CPU tensor.
        with _raw_ops():
            return self._elem.detach().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = _wrap(_raw_clone(self._elem), self._vi, self._vstate)
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        memo[id(self)] = new
        return new


def _swap_data(t: torch.Tensor, new: torch.Tensor) -> None:
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
    torch.utils.swap_tensors(t, repl)
    if grad is not None:
        # keep the gradient, on the new device (not recorded as a transfer:
        # nn.Module._apply moves the gradient itself right after this)
        g = grad._elem if type(grad) is VirtualTensor else grad
        g = _raw_clone(g)
        if type(t) is VirtualTensor:
            g = _wrap(g, t._vi, t._vstate)
        with _no_torch_function():
            t.grad = g


def is_virtual(t) -> bool:
    """True if ``t`` is a tensor on a virtual CUDA device."""
    return type(t) is VirtualTensor and t._vi is not None


def _find_state(args, kwargs) -> _State:
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
    return _ACTIVE or _State(0)


def _wrap(elem: torch.Tensor, vi, state: _State, requires_grad: bool = False):
    w = VirtualTensor(elem, vi, state, requires_grad)
    state.register(elem, vi)
    return w


def _raw_clone(elem: torch.Tensor) -> torch.Tensor:
    with _raw_ops():
        return elem.clone()


def _logical(t):
    """Logical device code of a tensor (int, -1 for cpu, None for wildcard)."""
    if type(t) is VirtualTensor:
        return t._vi
    with _no_torch_function():
        dt = t.device
    return _CPU if dt.type == "cpu" else str(dt)


# --------------------------------------------------------------------------
# device moves (autograd aware)
# --------------------------------------------------------------------------
def _move_raw(x, src, dst, state: Optional[_State], phase: str):
    elem = x._elem if type(x) is VirtualTensor else x
    new = _raw_clone(elem)
    if state is not None and state.active:
        state.record(
            Transfer(
                _dev_str(src),
                _dev_str(dst),
                new.numel() * new.element_size(),
                tuple(new.shape),
                new.dtype,
                phase,
            )
        )
    if dst == _CPU:
        return new
    return _wrap(new, dst, state)


class _Transfer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dst, state):
        ctx.set_materialize_grads(False)
        src = _logical(x)
        ctx.src = src
        ctx.state = state
        return _move_raw(x, src, dst, state, "forward")

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None
        gd = _logical(g)
        if gd == ctx.src or gd is None:
            return g, None, None
        return _move_raw(g, gd, ctx.src, ctx.state, "backward"), None, None


def _transfer(x, dst, state):
    return _Transfer.apply(x, dst, state)


class _OtherDevice:
    """A real, non-cpu/cuda target device (e.g. meta) requested by .to()."""

    __slots__ = ("device",)

    def __init__(self, device):
        self.device = torch.device(device)


def _code_of(state: Optional[_State], dev):
    """Device code for a device given to .to()/.cuda()."""
    if isinstance(dev, int) and not isinstance(dev, bool):
        if state is None:
            return _parse_without_state(dev)
        return state.check_index(dev)
    code = state.parse(dev) if state is not None else _parse_without_state(dev)
    if code is _UNSET:
        return _OtherDevice(dev)
    return code


def _parse_to_args(state: Optional[_State], args, kwargs):
    """Parse ``Tensor.to(...)`` arguments.

    Returns (device code | _UNSET | _OtherDevice, dtype, copy, memory_format).
    Forms: to(dtype, non_blocking, copy, *, memory_format),
    to(device, dtype, non_blocking, copy, *, memory_format),
    to(other, non_blocking, copy), and keyword variants.
    """
    device = _UNSET
    raw_device = None
    dtype = None
    a = list(args)
    if a:
        first = a[0]
        if isinstance(first, torch.Tensor):
            a.pop(0)
            device = _logical(first)
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
        return _CPU
    if d.type == "cuda":
        raise VirtualDeviceError(
            "a virtual tensor was moved to a CUDA device outside of virtual_devices(); "
            "tensors created inside the context should not be used after it exits "
            "(only .cpu() is supported there)"
        )
    return _UNSET


def _tensor_to(x, args, kwargs):
    state = x._vstate if type(x) is VirtualTensor else _ACTIVE
    if state is not None and not state.active:
        state = None  # used after the context exited: only moves to the CPU work
    device, dtype, copy, memory_format = _parse_to_args(state, args, kwargs)
    src = _logical(x)
    if isinstance(device, _OtherDevice):
        if type(x) is VirtualTensor:
            x = _transfer(x, _CPU, state)
        kw = {"device": device.device, "copy": copy}
        if dtype is not None:
            kw["dtype"] = dtype
        if memory_format is not None:
            kw["memory_format"] = memory_format
        return torch._C.TensorBase.to(x, **kw)
    if device is _UNSET or device == src or (src is None and device == _CPU):
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
        return torch._C.TensorBase.to(x, **kw)
    y = x
    if (dtype is not None and dtype != x.dtype) or (
        memory_format is not None and memory_format is not torch.preserve_format
    ):
        kw = {}
        if dtype is not None:
            kw["dtype"] = dtype
        if memory_format is not None:
            kw["memory_format"] = memory_format
        y = torch._C.TensorBase.to(x, **kw)
    return _transfer(y, device, state)


def _tensor_cuda(x, device, non_blocking, memory_format):
    state = x._vstate if type(x) is VirtualTensor else _ACTIVE
    if state is None or not state.active:
        raise VirtualDeviceError("Tensor.cuda() on a virtual tensor outside of virtual_devices()")
    if device is None:
        d = state.current
    elif isinstance(device, int) and not isinstance(device, bool):
        d = state.check_index(device)
    else:
        d = state.parse(device)
        if d == _CPU or d is _UNSET:
            raise VirtualDeviceError(f"Invalid device, must be cuda device, got {device}")
    return _tensor_to(x, (_TORCH_CUDA[d],), {"memory_format": memory_format})


def _tensor_copy(func, dst, src, non_blocking=False):
    if isinstance(src, torch.Tensor):
        dd, ds = _logical(dst), _logical(src)
        if isinstance(dd, int) and isinstance(ds, int) and dd != ds:
            state = (
                dst._vstate
                if type(dst) is VirtualTensor
                else (src._vstate if type(src) is VirtualTensor else _ACTIVE)
            )
            src = _transfer(src, dd, state)
    return func(dst, src, non_blocking)


# --------------------------------------------------------------------------
# dispatch level: device checks, unwrap / rewrap
# --------------------------------------------------------------------------
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
        f"devices, {_dev_str(a)} and {_dev_str(b)}! (when running {opname}) "
        f"[argument '{argname}' is on {_dev_str(other)}, other tensors on "
        f"{_dev_str(common)}; detected by mpgen.testing.virtual_devices]"
    )


class _OpInfo:
    __slots__ = ("kind", "name", "argnames", "exempt")

    def __init__(self, func):
        schema = func._schema
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
        self.dev = _UNSET
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
                d = _CPU
            else:
                d = str(dt)
            e = t
        cur = self.dev
        if cur is _UNSET:
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

    def out_device(self, state: _State):
        if self.dev is not _UNSET:
            return self.dev
        if self.wild:
            return None
        if self.tensor:
            return _CPU
        return _CPU if state.factory_depth else None


def _is_cuda_code(d) -> bool:
    return type(d) is int and d >= 0


def _rewrap(r, d, acc: _Acc, state: _State):
    if isinstance(r, torch.Tensor):
        for e, w in acc.pairs:
            if e is r:
                if w is e:  # a plain input returned (in-place / out=)
                    return w
                if w._vi is None and _is_cuda_code(d):
                    state.promote(w, d)
                if (
                    w.shape != r.shape
                    or w.stride() != r.stride()
                    or w.storage_offset() != r.storage_offset()
                ):
                    _sync_meta(w, state)
                return w
        if d is None or _is_cuda_code(d):
            return _wrap(r, d, state)
        return r
    if isinstance(r, (list, tuple)):
        out = [_rewrap(x, d, acc, state) for x in r]
        return out if isinstance(r, list) else tuple(out)
    return r


def _sync_meta(w: VirtualTensor, state: _State) -> None:
    """An in-place op (resize_, t_, unsqueeze_, set_, out=...) changed the
    size/stride of the inner tensor: mirror it on the wrapper."""
    e = w._elem
    with _raw_ops():
        n = e.untyped_storage().nbytes() // max(e.element_size(), 1)
        if torch._C.TensorBase.untyped_storage(w).nbytes() < n * e.element_size():
            torch._C.TensorBase.resize_(w, (n,))  # wrapper storage has no data
        torch._C.TensorBase.as_strided_(w, e.size(), e.stride(), e.storage_offset())
    state.register(e, w._vi, refresh=True)


def _dispatch(state: _State, func, args, kwargs):
    with _no_torch_function():
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
            code = state.parse(dev_kw) if state.n else _UNSET
            if _is_cuda_code(code):
                nkwargs = dict(nkwargs)
                nkwargs["device"] = _CPU_DEVICE
                if not acc.tensor:
                    d = code
            elif code is _UNSET and not acc.tensor:
                d = _CPU
        r = func(*nargs, **nkwargs)
        if info.kind == "set" and type(args[0]) is VirtualTensor:
            _sync_meta(args[0], state)
        return _rewrap(r, d, acc, state)


def _dispatch_copy(state, func, info, args, kwargs):
    # copy_(self, src, non_blocking): crossing devices is allowed (a transfer)
    dst, src = args[0], args[1]
    dd = dst._vi if type(dst) is VirtualTensor else _logical(dst)
    ds = src._vi if type(src) is VirtualTensor else _logical(src)
    de = dst._elem if type(dst) is VirtualTensor else dst
    se = src._elem if type(src) is VirtualTensor else src
    if dd is None and _is_cuda_code(ds):
        state.promote(dst, ds)
        dd = ds
    if dd != ds and dd is not None and ds is not None and state.active:
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        state.record(
            Transfer(
                _dev_str(ds),
                _dev_str(dd),
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


class _VirtualDispatchMode(TorchDispatchMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state


def _mode_torch_dispatch(self, func, types, args=(), kwargs=None):
    return _dispatch(self.state, func, args, kwargs or {})


# Assigned after class creation on purpose: TorchDispatchMode.__init_subclass__
# would wrap it in torch._disable_dynamo, which costs several microseconds per op.
_VirtualDispatchMode.__torch_dispatch__ = _mode_torch_dispatch


# --------------------------------------------------------------------------
# torch-function level: device arguments, moves
# --------------------------------------------------------------------------
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


class _VirtualFunctionMode(TorchFunctionMode):
    def __init__(self, state: _State):
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
        if type(func) is _pytypes.FunctionType and func not in self._inside and _redispatch:
            # Python-level function (F.*, Tensor methods written in Python):
            # keep the mode active for its body, so device arguments used
            # inside it are translated too.  A second request for the same
            # function comes from its own C++ base implementation
            # (e.g. Tensor.unflatten -> super().unflatten): run that plainly.
            self._inside.add(func)
            try:
                with self:
                    r = _redispatch(func, types, args, kwargs)
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
        target = state.parse(dev) if dev is not None else _UNSET
        if target is _UNSET and dev is not None:  # some other real device: leave alone
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
            if target is not _UNSET:
                kw["device"] = _TORCH_CUDA[target] if target >= 0 else _CPU_DEVICE
            return _tensor_to(data, (), kw)
        if target is _UNSET:
            # no device given: default (cpu) unless a tensor argument decides
            if any(isinstance(a, torch.Tensor) for a in args):
                return func(*args, **kwargs)
            target = _CPU
        nkw = dict(kwargs)
        if "device" in nkw:
            nkw["device"] = _CPU_DEVICE
        if func is torch.as_tensor and len(args) > 2:
            args = args[:2]
        nargs = [_unwrap_plain(a) for a in args]
        nkw = {k: _unwrap_plain(v) for k, v in nkw.items()}
        state.factory_depth += 1
        try:
            r = func(*nargs, **nkw)
        finally:
            state.factory_depth -= 1
        if target == _CPU or not isinstance(r, torch.Tensor):
            return r
        if type(r) is VirtualTensor:  # e.g. a wildcard from internals
            r = r._elem
        return _wrap(r.detach(), target, state, requires_grad=r.requires_grad)


def _tf_to(mode, func, types, args, kwargs):
    return _tensor_to(args[0], args[1:], kwargs)


def _tf_cuda(mode, func, types, args, kwargs):
    x = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    return _tensor_cuda(x, device, False, kwargs.get("memory_format", torch.preserve_format))


def _tf_cpu(mode, func, types, args, kwargs):
    mf = args[1] if len(args) > 1 else kwargs.get("memory_format", torch.preserve_format)
    return _tensor_to(args[0], (_CPU_DEVICE,), {"memory_format": mf})


def _tf_copy(mode, func, types, args, kwargs):
    src = args[1] if len(args) > 1 else kwargs["src"]
    nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return _tensor_copy(func, args[0], src, nb)


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
        kwargs["device"] = _TORCH_CUDA[x._vi]
    if kwargs.get("device") is not None:
        return mode._factory(func, types, args, kwargs)
    return func(*args, **kwargs)


def _tf_set_grad(mode, func, types, args, kwargs):
    t, g = args
    if g is not None and isinstance(g, torch.Tensor):
        dt, dg = _logical(t), _logical(g)
        if dt != dg and dt is not None and dg is not None:
            raise VirtualDeviceError(
                f"assigned grad has data located on {_dev_str(dg)}, "
                f"but the tensor is on {_dev_str(dt)}"
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
            dev = mode.state.current if dtype.startswith("torch.cuda.") else _CPU
            target = _TORCH_CUDA[dev] if dev != _CPU else _CPU_DEVICE
            return _tensor_to(x, (target, cls.dtype), {})
    return func(*args, **kwargs)


def _tf_set_data(mode, func, types, args, kwargs):
    t, new = args
    if type(t) is not VirtualTensor and type(new) is VirtualTensor:
        return _swap_data(t, new)
    return func(*args, **kwargs)


_TF_HANDLERS = {
    torch._C.TensorBase.to: _tf_to,
    torch._C.TensorBase.cuda: _tf_cuda,
    torch._C.TensorBase.cpu: _tf_cpu,
    torch._C.TensorBase.copy_: _tf_copy,
    torch._C.TensorBase.pin_memory: _tf_pin,
    torch._C.TensorBase.is_pinned: _tf_is_pinned,
    torch._C.TensorBase.record_stream: _tf_noop,
    torch._C.TensorBase.data.__set__: _tf_set_data,
    torch._C.TensorBase.grad.__set__: _tf_set_grad,
    torch._C.TensorBase.type: _tf_type,
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
    _TF_HANDLERS[getattr(torch._C.TensorBase, _n)] = _tf_new


# --------------------------------------------------------------------------
# torch.cuda emulation (patched while the context is active)
# --------------------------------------------------------------------------
class _VirtualStream:
    """Stand-in for torch.cuda.Stream: all work is synchronous."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = device
        self.priority = priority

    def synchronize(self):
        return None

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _VirtualEvent()

    def query(self):
        return True

    def is_capturing(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _VirtualEvent:
    """Stand-in for torch.cuda.Event: completes immediately, elapsed_time is 0."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def synchronize(self):
        return None

    def elapsed_time(self, end_event):
        return 0.0


class _Patcher:
    def __init__(self):
        self._saved: List[Tuple[Any, str, Any, bool]] = []

    def set(self, obj, name, value):
        had = hasattr(obj, name)
        self._saved.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)

    def restore(self):
        for obj, name, value, had in reversed(self._saved):
            if had:
                setattr(obj, name, value)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
        self._saved.clear()


def _cuda_patches(vd: "VirtualDevices", state: _State) -> Dict[str, Any]:
    def _idx(device=None):
        if device is None:
            return state.current
        if isinstance(device, int) and not isinstance(device, bool):
            return state.check_index(device)
        d = state.parse(device)
        if not _is_cuda_code(d):
            raise VirtualDeviceError(f"Expected a cuda device, but got: {device}")
        return d

    def set_device(device):
        state.current = _idx(device)

    class device:  # noqa: N801 - mirrors torch.cuda.device
        def __init__(self, device):
            self.idx = (
                -1 if device is None or (isinstance(device, int) and device < 0) else _idx(device)
            )
            self.prev = -1

        def __enter__(self):
            self.prev = state.current
            if self.idx >= 0:
                state.current = self.idx

        def __exit__(self, *exc):
            state.current = self.prev
            return False

    @contextlib.contextmanager
    def stream(s=None):
        yield s

    def memory_allocated(device=None):
        return state.cur[_idx(device)]

    def max_memory_allocated(device=None):
        return state.peak[_idx(device)]

    def reset_peak_memory_stats(device=None):
        if device is None:
            vd.reset_peak()
        else:
            i = _idx(device)
            state.peak[i] = state.cur[i]

    def rng_state(device="cuda"):
        return torch.get_rng_state()

    return {
        "is_available": lambda: True,
        "device_count": lambda: state.n,
        "current_device": lambda: state.current,
        "set_device": set_device,
        "device": device,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_allocated,
        "max_memory_reserved": max_memory_allocated,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_max_memory_allocated": reset_peak_memory_stats,
        "get_device_name": lambda device=None: f"Virtual CUDA device {_idx(device)}",
        "get_device_capability": lambda device=None: (8, 0),
        "is_bf16_supported": lambda *a, **k: True,
        "Stream": _VirtualStream,
        "Event": _VirtualEvent,
        "stream": stream,
        "current_stream": lambda device=None: _VirtualStream(device),
        "default_stream": lambda device=None: _VirtualStream(device),
        "get_rng_state": rng_state,
        "set_rng_state": lambda new_state, device="cuda": None,
        "get_rng_state_all": lambda: [torch.get_rng_state() for _ in range(state.n)],
        "set_rng_state_all": lambda new_states: None,
    }


# --------------------------------------------------------------------------
# public context manager
# --------------------------------------------------------------------------
@dataclass
class Recording:
    """Transfers and peak memory observed inside one ``vd.record()`` window."""

    transfers: List[Transfer] = field(default_factory=list)
    _peak: Dict[Any, int] = field(default_factory=dict, repr=False)
    _n: int = 0

    @property
    def peak_bytes(self) -> Dict[str, int]:
        """Peak live bytes per device during the window (starting from the
        bytes live when the window opened)."""
        return {_CUDA_STR[i]: self._peak[i] for i in range(self._n)}

    @property
    def forward_transfers(self) -> List[Transfer]:
        return [t for t in self.transfers if t.phase == "forward"]

    @property
    def backward_transfers(self) -> List[Transfer]:
        return [t for t in self.transfers if t.phase == "backward"]


class VirtualDevices:
    """Handle returned by :func:`virtual_devices`; also usable after exit."""

    def __init__(self, cuda: int, merge: bool = False):
        if not isinstance(cuda, int) or cuda < 1 or cuda > _MAX_DEVICES:
            raise ValueError(f"cuda must be an int in 1..{_MAX_DEVICES}, got {cuda!r}")
        self._state = _State(cuda, merge)
        self._modes: List[Any] = []
        self._patcher = _Patcher()

    # ---- context management ----
    def __enter__(self) -> "VirtualDevices":
        global _ACTIVE
        if _ACTIVE is not None:
            raise VirtualDeviceError("virtual_devices() contexts cannot be nested")
        state = self._state
        if state.active:
            raise VirtualDeviceError("this virtual_devices() context is already active")
        if "torch._dynamo" not in sys.modules:
            # torch._dynamo registers polyfills keyed by the functions patched
            # below when it is first imported (which e.g. the optimizers do
            # lazily): import it now so it sees the originals.
            importlib.import_module("torch._dynamo")
        p = self._patcher
        for name, value in _cuda_patches(self, state).items():
            p.set(torch.cuda, name, value)
        acc = getattr(torch, "accelerator", None)
        if acc is not None:
            for name, value in {
                "is_available": lambda: True,
                "device_count": lambda: state.n,
                "current_accelerator": lambda *a, **k: torch.device("cuda"),
                "current_device_index": lambda: state.current,
                "current_device_idx": lambda: state.current,
                "set_device_index": lambda d: setattr(
                    state,
                    "current",
                    state.check_index(
                        int(d) if not isinstance(d, (str, torch.device)) else state.parse(d)
                    ),
                ),
                "synchronize": lambda device=None: None,
                "current_stream": lambda device=None: _VirtualStream(device),
                "set_stream": lambda stream: None,
            }.items():
                if hasattr(acc, name):
                    p.set(acc, name, value)
        orig_parse_to = torch._C._nn._parse_to

        def _parse_to(*args, **kwargs):
            if args and isinstance(args[0], int) and not isinstance(args[0], bool):
                args = (torch.device("cuda", state.check_index(args[0])),) + args[1:]
            return orig_parse_to(*args, **kwargs)

        p.set(torch._C._nn, "_parse_to", _parse_to)
        # there is no cuDNN here: RNN modules would warn about it on every call
        p.set(torch.backends.cudnn, "is_acceptable", lambda tensor: False)
        state.active = True
        _ACTIVE = state
        tf = _VirtualFunctionMode(state)
        dm = _VirtualDispatchMode(state)
        try:
            tf.__enter__()
            self._modes.append(tf)
            dm.__enter__()
            self._modes.append(dm)
        except BaseException:
            self._exit()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._exit()
        return False

    def _exit(self):
        global _ACTIVE
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        self._patcher.restore()
        self._state.active = False
        if _ACTIVE is self._state:
            _ACTIVE = None

    # ---- devices ----
    @property
    def num_devices(self) -> int:
        return self._state.n

    @property
    def merged(self) -> bool:
        """True if all cuda:i are merged into cuda:0 (``merge=True``)."""
        return self._state.merge

    @property
    def devices(self) -> List[str]:
        return [_CUDA_STR[i] for i in range(self._state.n)]

    def device_of(self, t) -> str:
        """Logical device string of a tensor, e.g. ``"cuda:1"`` or ``"cpu"``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(t).__name__}")
        return _dev_str(_logical(t))

    # ---- transfers ----
    @property
    def transfers(self) -> List[Transfer]:
        """All transfers since entry (or the last reset), in order."""
        return self._state.transfers

    def reset_transfers(self) -> None:
        self._state.transfers = []

    @contextlib.contextmanager
    def record(self):
        """Record only a window::

        with vd.record() as rec:
            out = model(x)
        rec.transfers, rec.peak_bytes
        """
        state = self._state
        rec = Recording(_peak={i: state.cur[i] for i in range(state.n)}, _n=state.n)
        state.recordings.append(rec)
        try:
            yield rec
        finally:
            state.recordings.remove(rec)

    # ---- memory ----
    @property
    def current_bytes(self) -> Dict[str, int]:
        """Bytes of live tensor storages per logical CUDA device."""
        s = self._state
        return {_CUDA_STR[i]: s.cur[i] for i in range(s.n)}

    @property
    def peak_bytes(self) -> Dict[str, int]:
        """Peak of :attr:`current_bytes` per device since entry / reset_peak()."""
        s = self._state
        return {_CUDA_STR[i]: s.peak[i] for i in range(s.n)}

    def reset_peak(self) -> None:
        s = self._state
        for i in range(s.n):
            s.peak[i] = s.cur[i]


def virtual_devices(cuda: int = 2, *, merge: bool = False) -> VirtualDevices:
    """Context manager emulating ``cuda`` CUDA devices on the CPU.

    ``with virtual_devices(cuda=4) as vd: ...`` provides ``cuda:0`` ..
    ``cuda:3``; see the module docstring for what is emulated.

    With ``merge=True`` every ``cuda:i`` (still validated against ``cuda``)
    means ``cuda:0``: the same model-parallel code runs as a single-device
    model, with no transfers between GPUs -- a reference run to compare
    outputs with, bit for bit.
    """
    return VirtualDevices(cuda, merge)
