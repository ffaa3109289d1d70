"""Run model-parallel code as a single-device model: every ``cuda:i`` means one device.

Generated code names its devices literally (``nn.Linear(10, 20).to("cuda:1")``,
``x.to("cuda:1")``).  To ask whether *splitting* a model changes its
result on real GPUs, the same code has to run once split and once on a
single GPU, with the same kernels.  Inside ``merged_devices("cuda:0")`` every
CUDA device argument of a tensor operation is replaced by ``cuda:0``::

    from mpgen.testing import merged_devices

    split = SimpleModel()(x)                   # cuda:0 and cuda:1
    with merged_devices("cuda:0"):
        merged = SimpleModel()(x)              # everything on cuda:0

What is remapped: ``Tensor.to`` in all its forms (a device string,
``torch.device``, an ordinal), ``Tensor.cuda(i)``, and the ``device=``
argument of any torch function (factories, ``Tensor.new_*``, modules built
with ``device=``); ``Module.to``/``.cuda`` go through ``Tensor.to``/``.cuda``.
CPU and other devices are left alone.  Not remapped: ``torch.device``
objects themselves (``x.device == torch.device("cuda:1")`` is False inside),
``torch.cuda.set_device``/``torch.cuda.device(i)``, and code in other
threads (the mode is thread-local).

It works on real GPUs and inside :func:`~mpgen.testing.virtual_devices`.
There, tensors already on a virtual device move by their own methods
rather than through torch-function modes, so the context also turns on the
virtual devices' own merging for its duration (what
``virtual_devices(cuda=N, merge=True)`` does for a whole context).  The
project's tests check both: the mode alone (remapping onto the meta device
on a CPU-only machine) and the two together on virtual devices.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

import torch

from mpgen.testing import _state
from mpgen.testing._torch_compat import TensorBase, TorchFunctionMode

__all__ = ["merged_devices"]

# Tensor methods whose first argument after self may be a device.
_DEVICE_FIRST = {TensorBase.to, TensorBase.cuda}

# The targets of the merged_devices() contexts now active, innermost last.
_TARGETS: List[torch.device] = []


def merging_onto() -> Optional[torch.device]:
    """The device the innermost active merged_devices() merges onto, or None
    outside them (ModelSuite keeps a merged build apart from a split one)."""
    return _TARGETS[-1] if _TARGETS else None


class _MergeDevices(TorchFunctionMode):
    def __init__(self, target: torch.device):
        super().__init__()
        self.target = target

    def remap(self, device: Any) -> Any:
        if isinstance(device, bool):  # Tensor.to(dtype, non_blocking) etc.
            return device
        if isinstance(device, int):  # an ordinal: cuda:i
            return self.target
        if isinstance(device, str) and device.split(":")[0] == "cuda":
            return self.target
        if isinstance(device, torch.device) and device.type == "cuda":
            return self.target
        return device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DEVICE_FIRST and len(args) > 1:
            args = (args[0], self.remap(args[1]), *args[2:])
        if kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": self.remap(kwargs["device"])}
        return func(*args, **kwargs)


@contextlib.contextmanager
def merged_devices(target: str | torch.device = "cuda:0") -> Iterator[torch.device]:
    """Inside, every CUDA device argument means ``target`` (a CUDA device).

    Yields ``target`` as a ``torch.device``.  Exits cleanly on an exception.
    """
    device = torch.device(target)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"merged_devices needs one CUDA device such as 'cuda:0', got {target!r}")
    virtual = _state.ACTIVE
    if virtual is not None and device.index != 0:
        raise ValueError("inside virtual_devices(), devices merge into cuda:0")
    merged_before = virtual.merge if virtual is not None else False
    if virtual is not None:
        virtual.set_merge(True)
    _TARGETS.append(device)
    try:
        with _MergeDevices(device):
            yield device
    finally:
        _TARGETS.pop()
        if virtual is not None:
            virtual.set_merge(merged_before)
