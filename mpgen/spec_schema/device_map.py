"""``--device-map``: parsed with the spec language's device syntax (no torch:
``mpgen check`` keys its manifest on the parsed map before compiling anything)."""

from __future__ import annotations

from mpgen.spec_schema.models import check_device


def parse_device_map(text: str) -> dict[str, str]:
    """``cuda:1=cuda:0,cuda:2=cpu`` -> mapping; ``cpu`` alone maps everything.

    The key ``*`` stands for every device. Raises ValueError on bad syntax.
    """
    result: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        src, sep, dst = item.partition("=")
        if not sep:
            src, dst = "*", src
        for device in ([src] if src != "*" else []) + [dst]:
            try:
                check_device(device.strip())
            except Exception as exc:
                raise ValueError(f"--device-map: {exc}") from None
        result[src.strip()] = dst.strip()
    if not result:
        raise ValueError("--device-map: empty mapping")
    return result
