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
are the CPU's (not a GPU's) while optimizer ``foreach`` defaults resolve as
on a GPU, and tensors created inside the context should not be used after it
exits (``.cpu()`` still works and returns a plain CPU tensor) until it is
entered again.  Everything is single-threaded: the modes are thread-local,
so code running in other threads (e.g. DataLoader pin-memory threads) does
not see the virtual devices, while the ``torch.cuda`` patches are
process-wide.

A handle can be entered again after it exits (``with vd: ...`` once more):
the tensors made in it are on its devices again, and its transfers, memory
counters and current device carry on from where they were.

The implementation is split by level: ``_state`` (logical devices, transfers,
memory accounting), ``_tensor`` (the wrapper tensor), ``_moves`` (device
moves), ``_dispatch`` (the ATen level), ``_function_mode`` (device arguments),
``_cuda`` (the ``torch.cuda`` stand-ins) and ``_torch_compat`` (every private
torch API used, and the torch versions tested).  This module is the public
context manager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

from mpgen.testing import _state
from mpgen.testing._cuda import Patcher, install_patches
from mpgen.testing._dispatch import VirtualDispatchMode
from mpgen.testing._function_mode import VirtualFunctionMode
from mpgen.testing._state import (
    CUDA_STR,
    MAX_DEVICES,
    State,
    Transfer,
    VirtualDeviceError,
    dev_str,
)
from mpgen.testing._tensor import VirtualTensor, is_virtual, logical
from mpgen.testing._torch_compat import preload_dynamo

__all__ = [
    "virtual_devices",
    "VirtualDevices",
    "VirtualDeviceError",
    "VirtualTensor",
    "Transfer",
    "Recording",
    "is_virtual",
]


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
        return {CUDA_STR[i]: self._peak[i] for i in range(self._n)}

    @property
    def forward_transfers(self) -> List[Transfer]:
        return [t for t in self.transfers if t.phase == "forward"]

    @property
    def backward_transfers(self) -> List[Transfer]:
        return [t for t in self.transfers if t.phase == "backward"]


class VirtualDevices:
    """Handle returned by :func:`virtual_devices`; also usable after exit,
    and can be entered again (not while it is active)."""

    def __init__(self, cuda: int, merge: bool = False):
        if not isinstance(cuda, int) or cuda < 1 or cuda > MAX_DEVICES:
            raise ValueError(f"cuda must be an int in 1..{MAX_DEVICES}, got {cuda!r}")
        self._state = State(cuda, merge)
        self._modes: List[Any] = []
        self._patcher = Patcher()

    # ---- context management ----
    def __enter__(self) -> "VirtualDevices":
        if _state.ACTIVE is not None:
            raise VirtualDeviceError("virtual_devices() contexts cannot be nested")
        state = self._state
        if state.active:
            raise VirtualDeviceError("this virtual_devices() context is already active")
        preload_dynamo()
        install_patches(self._patcher, self, state)
        state.active = True
        _state.ACTIVE = state
        tf = VirtualFunctionMode(state)
        dm = VirtualDispatchMode(state)
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
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        self._patcher.restore()
        self._state.active = False
        if _state.ACTIVE is self._state:
            _state.ACTIVE = None

    # ---- devices ----
    @property
    def active(self) -> bool:
        """True while the context is entered."""
        return self._state.active

    @property
    def num_devices(self) -> int:
        return self._state.n

    @property
    def merged(self) -> bool:
        """True if all cuda:i are merged into cuda:0 (``merge=True``)."""
        return self._state.merge

    @property
    def devices(self) -> List[str]:
        return [CUDA_STR[i] for i in range(self._state.n)]

    def device_of(self, t) -> str:
        """Logical device string of a tensor, e.g. ``"cuda:1"`` or ``"cpu"``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(t).__name__}")
        return dev_str(logical(t))

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
        return {CUDA_STR[i]: s.cur[i] for i in range(s.n)}

    @property
    def peak_bytes(self) -> Dict[str, int]:
        """Peak of :attr:`current_bytes` per device since entry / reset_peak()."""
        s = self._state
        return {CUDA_STR[i]: s.peak[i] for i in range(s.n)}

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
