"""Logical devices, transfers and the bookkeeping of one virtual_devices() context.

A logical device is encoded as an int >= 0 for ``cuda:i``, :data:`CPU` (-1)
for the CPU, ``None`` for a *wildcard* (a tensor created by C++ internals
with no device information, which adopts the device of whatever it is
combined with), or a string for some other real device of a plain tensor
(e.g. ``"meta"``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from mpgen.testing._torch_compat import storage_key

if TYPE_CHECKING:
    from mpgen.testing._tensor import VirtualTensor
    from mpgen.testing.virtual import Recording


class VirtualDeviceError(RuntimeError):
    """Raised where real CUDA would fail: mixed devices, bad ordinals, misuse."""

    __module__ = "mpgen.testing"  # where users import it from


class Transfer(NamedTuple):
    """One device-to-device copy.

    ``phase`` is ``"backward"`` for copies made by the autograd engine while
    running a backward pass (gradients flowing back through a ``.to()``), and
    ``"forward"`` for everything else (including optimizer steps).
    """

    __module__ = "mpgen.testing"

    src: str
    dst: str
    nbytes: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    phase: str = "forward"


CPU = -1
UNSET = object()
CPU_DEVICE = torch.device("cpu")
MAX_DEVICES = 64
TORCH_CUDA = [torch.device("cuda", i) for i in range(MAX_DEVICES)]
CUDA_STR = [f"cuda:{i}" for i in range(MAX_DEVICES)]


def dev_str(d) -> str:
    if d is None or d == CPU:
        return "cpu"
    if isinstance(d, int):
        return CUDA_STR[d]
    return str(d)


class State:
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
        """Logical device code for a user-supplied device, or UNSET if it is
        not a cpu/cuda device (left alone)."""
        if dev is None:
            return UNSET
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
            return CPU
        if d.type == "cuda":
            return self.check_index(self.current if d.index is None else d.index)
        return UNSET

    def check_index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise VirtualDeviceError(
                f"CUDA error: invalid device ordinal (requested cuda:{i}, but "
                f"virtual_devices(cuda={self.n}) provides cuda:0..cuda:{self.n - 1})"
            )
        return 0 if self.merge else i

    def set_merge(self, merge: bool) -> None:
        """Turn merging of every cuda:i into cuda:0 on or off from now on."""
        self.merge = merge
        self._str_cache.clear()  # parsed device strings depend on it

    # ---- transfers ----
    def record(self, t: Transfer) -> None:
        self.transfers.append(t)
        for r in self.recordings:
            r.transfers.append(t)

    # ---- memory ----
    def register(self, elem: torch.Tensor, d, refresh: bool = False) -> None:
        """Count the storage of ``elem`` on device ``d`` (once per storage)."""
        st = elem.untyped_storage()
        key = storage_key(st)
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
        info = self.storages.get(storage_key(w._elem.untyped_storage()))
        if info is not None and info[0] is None:
            self._rehome(info, d)


#: The state of the virtual_devices() context that is active, if any
#: (contexts do not nest).  Set by :class:`mpgen.testing.virtual.VirtualDevices`.
ACTIVE: Optional[State] = None
