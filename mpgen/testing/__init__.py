"""Testing helpers for mpgen-generated model-parallel code (see ``docs/testing.md``).

* :func:`virtual_devices`: virtual CUDA devices on the CPU
  (:mod:`mpgen.testing.virtual`).
* :func:`merged_devices`: run model-parallel code with every ``cuda:i``
  meaning one device (:mod:`mpgen.testing.merge`).
* :func:`check_split_outputs`: did splitting change the outputs, with the
  tolerances for real GPUs and their rationale (:mod:`mpgen.testing.compare`).
* :class:`MemoryTracker`, :func:`measure_training_step`,
  :func:`measure_forward`: per-device peak memory of a real step, measured
  (:mod:`mpgen.testing.memory`).
* :class:`ModelSuite`: the checks of the generated tests
  (:mod:`mpgen.testing.suite`; imported on first use, since it needs pytest).
"""

from typing import Any

from .compare import check_split_outputs
from .memory import DevicePeak, MemoryTracker, measure_forward, measure_training_step
from .merge import merged_devices
from .virtual import (
    Recording,
    Transfer,
    VirtualDeviceError,
    VirtualDevices,
    VirtualTensor,
    is_virtual,
    virtual_devices,
)

__all__ = [
    "DevicePeak",
    "MemoryTracker",
    "ModelSuite",
    "Recording",
    "Transfer",
    "VirtualDeviceError",
    "VirtualDevices",
    "VirtualTensor",
    "check_split_outputs",
    "is_virtual",
    "measure_forward",
    "measure_training_step",
    "merged_devices",
    "virtual_devices",
]


def __getattr__(name: str) -> Any:
    if name == "ModelSuite":
        from .suite import ModelSuite

        return ModelSuite
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
