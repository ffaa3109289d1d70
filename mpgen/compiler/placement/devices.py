"""Device names after placement: the default device and ``--device-map``."""

from __future__ import annotations

DEFAULT_DEVICE = "cuda:0"


def map_device(device: str, device_map: dict[str, str]) -> str:
    return device_map.get(device, device_map.get("*", device))


