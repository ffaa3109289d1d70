"""``mpgen diff OLD NEW``: what a placement change moves, per layer and device.

Each side is a spec path or ``REV:path``, read with ``git cat-file blob REV:path`` in
the current directory's repository (the path is relative to the repository
root, or to the current directory when written ``REV:./path``). Both sides
are compiled in full; the diff lists the layer instances whose device
changed (compressed to ranges), the parameters and estimated training memory
of each device before and after, and the forward transfers added and
removed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from mpgen.compiler.analysis.costs import human_bytes
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.compiler.ir import Costs, Graph, UnitRef, unit_labels
from mpgen.compiler.pipeline import compile_spec
from mpgen.errors import ErrorList, MpgenError, Position
from mpgen.files import reason
from mpgen.spec_schema.load import MAX_BYTES


@dataclass(frozen=True)
class Side:
    """One compiled side of a diff."""

    label: str  # as the user wrote it
    graph: Graph

    @property
    def costs(self) -> Costs:
        return self.graph.costs


@dataclass(frozen=True)
class DeviceChange:
    device: str
    params: tuple[int, int]  # before, after
    memory: tuple[int, int]


@dataclass(frozen=True)
class TransferKey:
    tensor: str
    src: str
    dst: str
    shape: str
    nbytes: int

    def __str__(self) -> str:
        return (f"{self.tensor} {self.shape}: {self.src} -> {self.dst} "
                f"({self.nbytes:,} bytes)")


@dataclass(frozen=True)
class LayoutDiff:
    old: str
    new: str
    moved: tuple[tuple[str, str, str], ...]  # (layers, old device, new device)
    removed: tuple[tuple[str, str], ...]  # (layers, device) only in OLD
    added: tuple[tuple[str, str], ...]  # (layers, device) only in NEW
    devices: tuple[DeviceChange, ...]
    transfers_removed: tuple[TransferKey, ...]
    transfers_added: tuple[TransferKey, ...]


def load_side(arg: str, device_map: Optional[Mapping[str, str]] = None,
              root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Side:
    """Compile a spec path, or ``REV:path`` from git; errors name ``arg``.
    ``root``: the project its dotted ops may import from; for ``REV:path``
    (compiled from a temporary copy) the working directory by default.
    ``time_limit``: as for ``compile_spec``."""
    if os.path.lexists(arg) or ":" not in arg:
        graph = compile_spec(arg, device_map, root, time_limit)
        return Side(arg, graph)
    text = _git_show(arg)
    name = os.path.basename(arg.partition(":")[2])
    if name in ("", ".", "..") or len(name) > 100:
        name = "spec.yaml"
    with tempfile.TemporaryDirectory(prefix="mpgen-diff-") as folder:
        path = os.path.join(folder, name)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        try:
            graph = compile_spec(path, device_map, os.getcwd() if root is None else root,
                                 time_limit)
        except MpgenError as exc:
            raise _renamed(exc, path, arg) from None
        return Side(arg, graph)


#: A revision mpgen passes to git: names, ``~N``, ``^N``, ``@{...}``; never an
#: option (``-``), a range (``..``), a path inside the revision or a space.
_REVISION = re.compile(r"[\w@{}~^/+.,=-]+")


def _git_show(arg: str) -> str:
    """The spec ``REV:path`` in git: one blob, at most MAX_BYTES of UTF-8."""
    pos = Position(arg, 1, 1)
    rev, _, path = arg.partition(":")
    if (arg.startswith("-") or not path or not _REVISION.fullmatch(rev) or ".." in rev
            or rev.endswith(".") or any(c in path for c in "\0\n\r")):
        raise MpgenError(pos, f"{arg!r} is not a revision:path (such as HEAD~1:spec.yaml); "
                         "ranges (a..b), options and other revision syntax are not accepted")
    try:
        with tempfile.TemporaryFile() as errors:
            done = subprocess.Popen(["git", "cat-file", "blob", arg], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=errors)
            timer = threading.Timer(60, done.kill)
            timer.start()
            try:
                data = done.stdout.read(MAX_BYTES + 1)
                if len(data) > MAX_BYTES:
                    done.kill()
            finally:
                done.stdout.close()
                returncode = done.wait()
                timer.cancel()
            errors.seek(0)
            message = errors.read(4096).decode("utf-8", "replace").strip().splitlines()
    except OSError as exc:
        raise MpgenError(pos, f"cannot run git: {reason(exc)}") from None
    if len(data) > MAX_BYTES:
        raise MpgenError(pos, f"spec is larger than {MAX_BYTES} bytes")
    if returncode != 0:
        why = message[0] if message else f"git exited with {returncode}"
        raise MpgenError(pos, f"cannot read {arg!r} from git: {why}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MpgenError(pos, f"spec is not UTF-8 ({exc.reason})") from None


def _renamed(exc: MpgenError, path: str, arg: str) -> MpgenError:
    """The same error(s) with the temporary file's name replaced by ``arg``."""
    def one(e: MpgenError) -> MpgenError:
        pos = e.pos
        if pos is not None and pos.file == path:
            pos = dataclasses.replace(pos, file=arg)
        return MpgenError(pos, e.message.replace(path, arg))

    if isinstance(exc, ErrorList):
        return ErrorList([one(e) for e in exc.errors], stopped=exc.stopped)
    return one(exc)


def diff(old: Side, new: Side) -> LayoutDiff:
    """Compare two compiled layouts."""
    def placed(side: Side) -> dict[UnitRef, str]:
        return {u.unit: side.graph.nodes[u.node].devices[u.instance] for u in side.costs.units}

    before, after = placed(old), placed(new)
    moved_runs = _runs([(unit, before[unit], dev) for unit, dev in after.items()
                        if unit in before and before[unit] != dev])
    added = _runs([(unit, dev, "") for unit, dev in after.items() if unit not in before])
    removed = _runs([(unit, dev, "") for unit, dev in before.items() if unit not in after])

    old_totals, new_totals = _totals(old), _totals(new)
    devices = list(dict.fromkeys([*new_totals, *old_totals]))
    changes = tuple(DeviceChange(d, (old_totals.get(d, (0, 0))[0], new_totals.get(d, (0, 0))[0]),
                                 (old_totals.get(d, (0, 0))[1], new_totals.get(d, (0, 0))[1]))
                    for d in devices)
    old_t, new_t = _transfers(old), _transfers(new)
    return LayoutDiff(
        old=old.label, new=new.label,
        moved=tuple((label, a, b) for label, a, b in moved_runs),
        removed=tuple((label, a) for label, a, _ in removed),
        added=tuple((label, a) for label, a, _ in added),
        devices=changes,
        transfers_removed=tuple(t for t in old_t if t not in new_t),
        transfers_added=tuple(t for t in new_t if t not in old_t),
    )


def _runs(items) -> list[tuple[str, str, str]]:
    """Consecutive instances of one layer with the same change, as one range."""
    groups: list[list] = []  # [[unit, ...], a, b]
    for unit, a, b in items:
        last = groups[-1][0][-1] if groups else None
        if (last is not None and groups[-1][1:] == [a, b] and last.node == unit.node
                and last.instance is not None and last.instance + 1 == unit.instance):
            groups[-1][0].append(unit)
        else:
            groups.append([[unit], a, b])
    return [(unit_labels(units)[0], a, b) for units, a, b in groups]


def _totals(side: Side) -> dict[str, tuple[int, int]]:
    totals: dict[str, tuple[int, int]] = {}
    for unit in side.costs.units:
        device = side.graph.nodes[unit.node].devices[unit.instance]
        params, memory = totals.get(device, (0, 0))
        totals[device] = (params + unit.params, memory + unit.memory)
    return totals


def _transfers(side: Side) -> list[TransferKey]:
    keys = []
    for t in side.graph.plan.transfers:
        keys.append(TransferKey(str(t.value), t.src or "caller", t.dst,
                                str(t.type), side.costs.nbytes(t.value)))
    return keys


def format_diff(d: LayoutDiff) -> str:
    """The diff as plain text, for the terminal."""
    lines = [f"--- {d.old}", f"+++ {d.new}", ""]
    if d.moved:
        lines.append("moved:")
        lines.extend(f"  {label}: {a} -> {b}" for label, a, b in d.moved)
    else:
        lines.append("moved: nothing")
    if d.removed:
        lines.append("only in old:")
        lines.extend(f"  {label}: {device}" for label, device in d.removed)
    if d.added:
        lines.append("only in new:")
        lines.extend(f"  {label}: {device}" for label, device in d.added)
    lines += ["", "per device (parameters; estimated training memory):"]
    rows = [("device", "params before", "params after", "memory before", "memory after")]
    for c in d.devices:
        rows.append((c.device, f"{c.params[0]:,}", f"{c.params[1]:,}",
                     human_bytes(c.memory[0]), human_bytes(c.memory[1])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    lines += ["", "transfers in forward:"]
    if not d.transfers_removed and not d.transfers_added:
        lines.append("  unchanged")
    lines.extend(f"  - {t}" for t in d.transfers_removed)
    lines.extend(f"  + {t}" for t in d.transfers_added)
    return "\n".join(lines) + "\n"
