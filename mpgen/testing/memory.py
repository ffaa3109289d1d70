"""Peak memory of a real training step, per device, measured.

:class:`MemoryTracker` is a ``TorchDispatchMode`` that sees every ATen op
while it is active and counts the bytes of the tensor storages alive on each
device: a storage is counted once (views are free) when an op first returns
it, and un-counted when it dies (``weakref.finalize`` on the storage). The
largest total per device is its peak; at each new peak the tracker notes
the phase of the step (``forward``, ``backward``, ``optimizer step``) and
what is alive then, by part:

* ``weights``: the model's parameters and buffers;
* ``gradients``: each parameter's ``.grad`` (marked when autograd
  accumulates it);
* ``optimizer``: the optimizer's state;
* ``activations``: what autograd saves for backward (marked by a
  ``saved_tensors_hooks`` pack hook), the forward's outputs kept for backward;
* ``transfers``: the copies a device move makes (on virtual devices), not
  saved for backward;
* ``transient``: everything else: the batch, the loss, the outputs, every
  temporary of forward, backward and the optimizer step.

The part names are those of the compiler's memory plan (``MEMORY_PARTS``),
so that a measurement and a plan compare part by part.

It runs on the plain CPU (every storage counts for ``cpu``) and inside
:func:`~mpgen.testing.virtual_devices`, entered after it, where each
storage counts for the logical device it would live on (``cuda:1``). Tensors
made before the tracker starts count from when :meth:`MemoryTracker.track`
is given them (a model, an optimizer, tensors), as torch's ``MemTracker``'s
``track_external``, or else from their first use by an op (so does a
virtual device's move, which no op shows).

:func:`measure_training_step` runs a step (say, the spec's: zero the
gradients to None, forward, the loss, backward, the optimizer's step) once
to make the optimizer's state, then once more under the tracker: the peak
of a steady-state step. :func:`measure_forward` does the same for a forward
without gradients. What it counts: the bytes of live storages, as a GPU's
``torch.cuda.max_memory_allocated`` would without the caching allocator's
rounding (512-byte blocks), cuBLAS/cuDNN workspaces and the CUDA context.
On virtual devices the optimizer's ``foreach`` default resolves as on a GPU
(``virtual_devices`` trusts its tensors with the foreach kernels; on the CPU
torch picks the single-tensor loop), so the optimizer step's temporaries are
a GPU's: the whole group's at once.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from mpgen.testing._state import dev_str
from mpgen.testing._tensor import VirtualTensor
from mpgen.testing._torch_compat import (
    TorchDispatchMode,
    in_autograd_backward,
    no_torch_function,
    op_schema,
    set_torch_dispatch,
    storage_key,
    tree_leaves,
)

__all__ = ["MEMORY_PARTS", "DevicePeak", "MemoryTracker", "measure_forward",
           "measure_training_step"]

#: What is alive, by part (the compiler's ir.MEMORY_PARTS, in its order).
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "transfers", "transient")
#: Which part wins when a storage is two things at once (a weight saved for
#: backward stays a weight): the earlier in this order.
_RANK = {part: k for k, part in enumerate(MEMORY_PARTS)}
#: The ops that copy a tensor to another device.
_MOVES = ("aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize")


@dataclass(frozen=True)
class DevicePeak:
    """One device's measured peak: the largest number of bytes of storages
    alive at once, where the step was then (``phase``) and what was alive
    (``at_peak``: part -> bytes, summing to ``peak``); ``largest``: each
    part at its largest during the window (as the plan's ``weights``,
    ``gradients``, ``optimizer`` and ``activations``)."""

    device: str
    peak: int
    phase: str
    at_peak: dict[str, int] = field(default_factory=dict)
    largest: dict[str, int] = field(default_factory=dict)


class _Storage:
    """One live storage: its device, bytes, part (``own``: what it is by
    itself; ``part``: what it counts as now, an activation while autograd
    holds it saved, ``saved`` times)."""

    __slots__ = ("device", "nbytes", "own", "part", "saved")

    def __init__(self, device: str, nbytes: int, part: str):
        self.device, self.nbytes, self.own, self.part, self.saved = device, nbytes, part, part, 0


class _Saved:
    """What the pack hook gives autograd for a saved tensor: its death (the
    graph freed, or backward done with it) ends the storage's activation."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MemoryTracker(TorchDispatchMode):
    """Counts live storage bytes per device while active (see the module
    docstring)::

        tracker = MemoryTracker()
        tracker.track(model, optimizer)
        with tracker:
            step()
        tracker.peaks["cuda:1"].peak, tracker.peaks["cuda:1"].at_peak
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, _Storage] = {}
        self._current: dict[str, dict[str, int]] = {}  # device -> part -> bytes
        self._peaks: dict[str, DevicePeak] = {}
        self._largest: dict[str, dict[str, int]] = {}  # device -> part -> most bytes
        self._phase = "forward"
        self._optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._opened = False

    # ---- what is tracked ----
    def track(self, *things: torch.nn.Module | torch.optim.Optimizer | torch.Tensor) -> None:
        """Count tensors made before the tracker started: a module's
        parameters and buffers (weights) and their gradients, an optimizer's
        state (and, from then on, each step's new state), or tensors (transient)."""
        for thing in things:
            if isinstance(thing, torch.nn.Module):
                for tensor in thing.parameters():
                    self._see(tensor, "weights")
                    if tensor.grad is not None:
                        self._see(tensor.grad, "gradients")
                for tensor in thing.buffers():
                    self._see(tensor, "weights")
                for param in thing.parameters():
                    if param.requires_grad:
                        self._hooks.append(param.register_post_accumulate_grad_hook(self._grad))
            elif isinstance(thing, torch.optim.Optimizer):
                self._optimizers.append(thing)
                self._mark_state(thing)
                for group in thing.param_groups:
                    for param in group["params"]:
                        self._see(param, "weights")
                self._hooks.append(thing.register_step_pre_hook(self._step_begins))
                self._hooks.append(thing.register_step_post_hook(self._step_ends))
            elif isinstance(thing, torch.Tensor):
                self._see(thing, "transient")
            else:
                raise TypeError(f"cannot track a {type(thing).__name__}")

    # ---- the mode ----
    def __enter__(self) -> "MemoryTracker":
        if self._opened:
            raise RuntimeError("a MemoryTracker is entered once")
        self._opened = True
        self._saved.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._saved.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        phase = self._phase if self._phase != "forward" else (
            "backward" if in_autograd_backward() else "forward")
        name = op_schema(func).name
        source = None
        if name in _MOVES:  # copy_(self, src): the source is the second
            src = args[1] if name != "aten::_to_copy" and len(args) > 1 else args[0]
            source = self._storage(src)[1] if isinstance(src, torch.Tensor) else None
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._see(tensor, "transient", phase, source)
        # Inputs too: a storage made where no op shows it (a virtual device's
        # move, a tensor from before the tracker) counts from its first use,
        # and an op that writes its arguments may have resized them.
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                moved = type(tensor.grad_fn).__name__ == "_TransferBackward"
                self._see(tensor, "transfers" if moved else "transient", phase)
        return out

    # ---- the phases ----
    def _step_begins(self, optimizer, args, kwargs) -> None:
        self._phase = "optimizer step"

    def _step_ends(self, optimizer, args, kwargs) -> None:
        self._mark_state(optimizer)
        self._phase = "forward"

    def _grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._mark(param.grad, "gradients")

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        storage, _ = self._storage(tensor)
        if storage is not None:
            key = storage_key(storage)
            if key not in self._live:
                self._see(tensor, "transient")
            info = self._live.get(key)
            if info is not None:
                info.saved += 1
                self._label(info)
                weakref.finalize(saved, self._unsaved, key, info)
        return saved

    def _unsaved(self, key: int, info: _Storage) -> None:
        if self._live.get(key) is info:
            info.saved -= 1
            self._label(info)

    def _mark_state(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._mark(value, "optimizer")

    # ---- the counting ----
    def _storage(self, tensor: torch.Tensor) -> tuple[Optional[torch.UntypedStorage], str]:
        if type(tensor) is VirtualTensor:
            elem = tensor._elem
            return elem.untyped_storage(), dev_str(tensor._vi)
        with no_torch_function():
            device = tensor.device
            if device.type == "meta" or tensor.is_sparse:
                return None, ""
            return tensor.untyped_storage(), str(device)

    def _see(self, tensor: torch.Tensor, part: str, phase: str | None = None,
             source: str | None = None) -> None:
        storage, device = self._storage(tensor)
        if storage is None:
            return
        key = storage_key(storage)
        info = self._live.get(key)
        nbytes = storage.nbytes()
        if info is None:
            moved = source is not None and source != device
            info = self._live[key] = _Storage(device, 0, "transfers" if moved else part)
            weakref.finalize(storage, self._free, key)
        elif info.device != device and device != "cpu":
            # A wildcard storage of a virtual device that found its device.
            self._add(info, -info.nbytes)
            info.device = device
            self._add(info, info.nbytes)
        elif _RANK[part] < _RANK[info.own]:
            info.own = part
            self._label(info)
        if nbytes != info.nbytes:
            delta, info.nbytes = nbytes - info.nbytes, nbytes
            self._add(info, delta, phase or self._phase)

    def _mark(self, tensor: torch.Tensor, part: str) -> None:
        storage, _ = self._storage(tensor)
        if storage is None:
            return
        info = self._live.get(storage_key(storage))
        if info is None:
            self._see(tensor, part)
        elif _RANK[part] < _RANK[info.own]:
            info.own = part
            self._label(info)

    def _label(self, info: _Storage) -> None:
        """Count ``info`` as its own part, or as an activation while saved."""
        part = info.own
        if info.saved > 0 and _RANK["activations"] < _RANK[part]:
            part = "activations"
        if part != info.part:
            parts = self._current.get(info.device)
            if parts is not None:
                parts[info.part] -= info.nbytes
                parts[part] += info.nbytes
                self._grew(info.device, part, parts)
            info.part = part

    def _grew(self, device: str, part: str, parts: dict[str, int]) -> None:
        largest = self._largest.setdefault(device, dict.fromkeys(MEMORY_PARTS, 0))
        if parts[part] > largest[part]:
            largest[part] = parts[part]

    def _add(self, info: _Storage, delta: int, phase: str | None = None) -> None:
        parts = self._current.get(info.device)
        if parts is None:
            parts = self._current[info.device] = dict.fromkeys(MEMORY_PARTS, 0)
        parts[info.part] += delta
        if delta > 0:
            self._grew(info.device, info.part, parts)
            total = sum(parts.values())
            best = self._peaks.get(info.device)
            if best is None or total > best.peak:
                self._peaks[info.device] = DevicePeak(info.device, total, phase or self._phase,
                                                      dict(parts))

    def _free(self, key: int) -> None:
        info = self._live.pop(key, None)
        if info is not None:
            self._add(info, -info.nbytes)

    # ---- results ----
    @property
    def peaks(self) -> dict[str, DevicePeak]:
        """Device -> its peak so far (devices in order: cuda:0, cuda:1, ..., cpu)."""
        peaks = {device: dataclasses.replace(peak, largest=dict(self._largest[device]))
                 for device, peak in self._peaks.items()}
        return dict(sorted(peaks.items(), key=lambda kv: _device_order(kv[0])))

    @property
    def peak_bytes(self) -> dict[str, int]:
        """Device -> its peak bytes so far."""
        return {device: peak.peak for device, peak in self.peaks.items()}

    @property
    def current_bytes(self) -> dict[str, int]:
        """Device -> the bytes alive now."""
        return {device: sum(parts.values()) for device, parts in self._current.items()}

    @property
    def current_parts(self) -> dict[str, dict[str, int]]:
        """Device -> part -> the bytes alive now."""
        return {device: dict(parts) for device, parts in self._current.items()}

    def reset_peak(self) -> None:
        """Start the peaks (and each part's largest) again from what is alive now."""
        self._largest = {device: dict(parts) for device, parts in self._current.items()}
        self._peaks = {device: DevicePeak(device, sum(parts.values()), self._phase, dict(parts))
                       for device, parts in self._current.items()}


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


def _device_order(device: str) -> tuple:
    kind, _, index = device.partition(":")
    return (kind != "cuda", int(index) if index.isdigit() else 0, device)


# Assigned after class creation, as the virtual devices' mode (see set_torch_dispatch).
set_torch_dispatch(MemoryTracker, lambda self, func, types, args=(), kwargs=None:
                   self._dispatch(func, types, args, kwargs))


def measure_training_step(step: Callable[[], Any], model: torch.nn.Module,
                          optimizer: Optional[torch.optim.Optimizer],
                          extra: Iterable[torch.Tensor] = ()) -> dict[str, DevicePeak]:
    """Each device's peak over one steady-state training step: ``step()``
    (which zeroes the gradients to None, runs forward, the loss, backward
    and ``optimizer``'s step) is run once untracked, to make the optimizer's
    state, then once under a :class:`MemoryTracker` that counts ``model``'s
    weights, ``optimizer``'s state and the ``extra`` tensors alive before it
    (inside :func:`~mpgen.testing.virtual_devices`: per virtual device)."""
    step()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    tracker = MemoryTracker()
    tracker.track(model, *([optimizer] if optimizer is not None else []), *extra)
    with tracker:
        step()
    return tracker.peaks


def measure_forward(forward: Callable[[], Any], model: torch.nn.Module,
                    extra: Iterable[torch.Tensor] = ()) -> dict[str, DevicePeak]:
    """Each device's peak over ``forward()`` without gradients (inference):
    ``model``'s weights, the ``extra`` tensors and what forward makes."""
    tracker = MemoryTracker()
    tracker.track(model, *extra)
    with torch.no_grad(), tracker:
        forward()
    return tracker.peaks
