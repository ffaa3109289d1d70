"""Testing helpers for mpgen-generated model-parallel code.

See :mod:`mpgen.testing.virtual` and ``docs/testing.md``.
"""

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
    "Recording",
    "Transfer",
    "VirtualDeviceError",
    "VirtualDevices",
    "VirtualTensor",
    "is_virtual",
    "virtual_devices",
]
