"""``<spec stem>.profile.yaml`` -> the IR's Profile: what ``mpgen profile``
measured beside the spec (NOTE [Measured time] in ``commands/profile.py``).

The file is untrusted input like the spec: read through ``files.read_regular``
(a regular file, at most :data:`MAX_BYTES`), parsed by the spec's own YAML
loader (safe, no aliases or tags, bounded depth), and every field checked,
each mistake at its ``FILE:LINE:COL``. Whether its units are the spec's (a
stale profile) is checked against the cost model by ``Profile.stale``, once
the units are known.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from mpgen.compiler.ir import Profile, UnitTime
from mpgen.errors import Collector, MpgenError, Position, did_you_mean, shown
from mpgen.files import FileTooLarge, read_regular, reason
from mpgen.spec_schema.load import load_text

#: The format number the file's ``mpgen_profile`` key holds.
FORMAT = 1
#: The largest profile file read (a unit's line is about 80 bytes).
MAX_BYTES = 4 * 1024 * 1024
KEYS = ("mpgen_profile", "spec", "batch", "threads", "warmup", "repeats", "kinds", "devices",
        "call", "units", "transfers")
UNIT_KEYS = ("unit", "params", "flops")
TRANSFER_KEYS = ("from", "to", "bytes_per_ms")


def profile_path(spec_path: str | Path) -> Path:
    """Where a spec's profile is: beside it, ``<stem>.profile.yaml``."""
    spec = Path(spec_path)
    return spec.with_name(f"{spec.stem}.profile.yaml")


def read_profile(spec_path: str | Path) -> Optional[Profile]:
    """The profile beside the spec, None when there is none; raises
    MpgenError (at the profile's FILE:LINE:COL) when it is malformed."""
    path = profile_path(spec_path)
    name = str(path)
    if not path.exists() and not path.is_symlink():
        return None
    try:
        raw = read_regular(path, MAX_BYTES)
    except FileTooLarge:
        raise MpgenError(Position(name, 1, 1),
                         f"profile is larger than {MAX_BYTES} bytes") from None
    except OSError as exc:
        raise MpgenError(Position(name), f"cannot read profile: {reason(exc)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MpgenError(Position(name, 1, 1), "profile is not UTF-8: rerun mpgen profile") \
            from None
    loaded = load_text(text, name)
    return _Reader(loaded.data, loaded.source, name).profile()


class _Reader:
    def __init__(self, data: Any, source, name: str) -> None:
        self.data, self.source, self.name = data, source, name
        self.errors = Collector()

    def fail(self, path: tuple, message: str) -> None:
        self.errors.add(self.source.value(path), f"profile: {message}")

    def mapping(self, value: Any, path: tuple, keys: Optional[tuple] = None) -> dict:
        if not isinstance(value, dict):
            self.fail(path, f"{_where(path)} must be a mapping")
            return {}
        for key in value:
            if keys is not None and key not in keys:
                self.errors.add(self.source.key((*path, key)),
                                f"profile: unknown key {shown(key)} in {_where(path)}"
                                f"{did_you_mean(str(key), keys)}")
        return value

    def number(self, value: Any, path: tuple, integer: bool = False) -> float:
        good = (isinstance(value, int) if integer else isinstance(value, (int, float))) \
            and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        if not good:
            self.fail(path, f"{_where(path)} must be a {'whole ' if integer else ''}number "
                            f">= 0, not {shown(value)}")
            return 0
        return value

    def text(self, value: Any, path: tuple) -> str:
        if not isinstance(value, str) or not value:
            self.fail(path, f"{_where(path)} must be a non-empty string, not {shown(value)}")
            return ""
        return value

    def profile(self) -> Profile:
        top = self.mapping(self.data, (), KEYS)
        for key in KEYS:
            if key not in top and isinstance(self.data, dict):
                self.fail((), f"the key {key!r} is missing: rerun mpgen profile")
        self.errors.raise_if_any()
        if top["mpgen_profile"] != FORMAT:
            self.fail(("mpgen_profile",), f"format {shown(top['mpgen_profile'])} is not "
                                          f"{FORMAT}: rerun mpgen profile")
        batch = self.number(top["batch"], ("batch",), integer=True)
        kinds = {k: self.text(v, ("kinds", k))
                 for k, v in self.mapping(top["kinds"], ("kinds",)).items()}
        if not kinds and isinstance(top["kinds"], dict):
            self.fail(("kinds",), "no device kind was measured")
        devices = {}
        for device, kind in self.mapping(top["devices"], ("devices",)).items():
            if kind not in kinds:
                self.fail(("devices", device), f"devices.{device}: the kind {shown(kind)} is not "
                                               f"one of kinds{did_you_mean(str(kind), kinds)}")
            devices[str(device)] = str(kind)
        call = []
        for kind, pair in self.mapping(top["call"], ("call",), tuple(kinds)).items():
            if not (isinstance(pair, list) and len(pair) == 2):
                self.fail(("call", kind), f"call.{kind} must be [forward ms, backward ms]")
                continue
            call.append((str(kind), float(self.number(pair[0], ("call", kind, 0))),
                         float(self.number(pair[1], ("call", kind, 1)))))
        units = []
        listed = top["units"]
        if not isinstance(listed, list):
            self.fail(("units",), "units must be a list")
            listed = []
        for i, item in enumerate(listed):
            unit = self.mapping(item, ("units", i), UNIT_KEYS + tuple(kinds))
            if not unit:
                continue
            times = []
            for kind in kinds:
                pair = unit.get(kind)
                if not (isinstance(pair, list) and len(pair) == 2):
                    self.fail(("units", i, kind) if kind in unit else ("units", i),
                              f"unit {i} needs [forward ms, backward ms] for kind {kind!r}")
                    continue
                times.append((kind, float(self.number(pair[0], ("units", i, kind, 0))),
                              float(self.number(pair[1], ("units", i, kind, 1)))))
            units.append(UnitTime(self.text(unit.get("unit"), ("units", i, "unit")),
                                  int(self.number(unit.get("params"), ("units", i, "params"),
                                                  integer=True)),
                                  int(self.number(unit.get("flops"), ("units", i, "flops"),
                                                  integer=True)),
                                  tuple(times)))
        transfers = []
        moves = top["transfers"]
        if not isinstance(moves, list):
            self.fail(("transfers",), "transfers must be a list")
            moves = []
        for i, item in enumerate(moves):
            move = self.mapping(item, ("transfers", i), TRANSFER_KEYS)
            if len(move) == 3:
                transfers.append((self.text(move.get("from"), ("transfers", i, "from")),
                                  self.text(move.get("to"), ("transfers", i, "to")),
                                  float(self.number(move.get("bytes_per_ms"),
                                                    ("transfers", i, "bytes_per_ms")))))
        self.errors.raise_if_any()
        return Profile(self.name, tuple(kinds.items()), tuple(devices.items()), int(batch),
                       tuple(units), tuple(transfers), tuple(call))


def _where(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "the profile"


def needs_profile(graph, source, spec_path: str | Path) -> None:
    """``balance: time`` without a profile beside the spec: MpgenError at
    the ``balance`` value, naming the command that measures one."""
    request = graph.placement
    if getattr(request, "balance", None) != "time" or graph.profile is not None:
        return
    raise MpgenError(source.value(("placement", "auto", "balance")),
                     f"placement.auto.balance: 'time' places by measured times, and "
                     f"{profile_path(spec_path)} does not exist: run `mpgen profile {spec_path}` "
                     "on the machine that trains (or balance 'flops', the cost model's estimate)")
