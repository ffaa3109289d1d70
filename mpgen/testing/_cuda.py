"""``torch.cuda`` and ``torch.accelerator`` stand-ins, patched in while a
virtual_devices() context is active and restored when it exits."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch

from mpgen.testing._dispatch import is_cuda_code
from mpgen.testing._state import State, VirtualDeviceError
from mpgen.testing._tensor import VirtualTensor
from mpgen.testing._torch_compat import patch_parse_to, trust_foreach

if TYPE_CHECKING:
    from mpgen.testing.virtual import VirtualDevices


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


class Patcher:
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


def _cuda_patches(vd: "VirtualDevices", state: State) -> Dict[str, Any]:
    def _idx(device=None):
        if device is None:
            return state.current
        if isinstance(device, int) and not isinstance(device, bool):
            return state.check_index(device)
        d = state.parse(device)
        if not is_cuda_code(d):
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


def _accelerator_patches(state: State) -> Dict[str, Any]:
    return {
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
    }


def install_patches(patcher: Patcher, vd: "VirtualDevices", state: State) -> None:
    """Patch ``torch.cuda``, ``torch.accelerator``, ``Module.to``'s argument
    parser and cuDNN's acceptance test for the context of ``vd``."""
    for name, value in _cuda_patches(vd, state).items():
        patcher.set(torch.cuda, name, value)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        for name, value in _accelerator_patches(state).items():
            if hasattr(accelerator, name):
                patcher.set(accelerator, name, value)

    def wrap_parse_to(original):
        def parse_to(*args, **kwargs):
            # Module.to(1): an ordinal means a CUDA device, checked here
            if args and isinstance(args[0], int) and not isinstance(args[0], bool):
                args = (torch.device("cuda", state.check_index(args[0])),) + args[1:]
            return original(*args, **kwargs)

        return parse_to

    patch_parse_to(patcher, wrap_parse_to)
    # there is no cuDNN here: RNN modules would warn about it on every call
    patcher.set(torch.backends.cudnn, "is_acceptable", lambda tensor: False)
    # a GPU's optimizer step runs foreach kernels (temporaries for the whole
    # group at once): so does a virtual device's (docs/testing.md)
    trust_foreach(patcher, VirtualTensor)
