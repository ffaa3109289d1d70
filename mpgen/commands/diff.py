"""``mpgen diff OLD NEW``: what a placement change moves, per layer and device.

Each side is a spec path or ``REV:path``, read with ``git cat-file blob REV:path`` in
the current directory's repository (the path is relative to the repository
root, or to the current directory when written ``REV:./path``) when REV is a
commit, else a file of that name; when both exist the side is refused, never
guessed (``./REV:path`` names the file). ``ci-summary`` passes a
:class:`GitBlob` instead, which is only ever git's. Both sides
are compiled in full; the diff lists the layer instances whose device
changed (compressed to ranges), the parameters and estimated training memory
of each device before and after, each device's memory-plan peak (training,
pipeline, inference) where it changed, and the forward transfers added and
removed. It starts with a warning when the bytes crossing devices per step
at least double (and grow by at least ``TRAFFIC_FLOOR``). A ``REV:path``
that git cannot find at the root but finds as ``REV:./path`` gets an error
that suggests the latter.
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
from mpgen.compiler.ir import Costs, Graph, MemoryPlan, UnitRef, unit_labels
from mpgen.commands.isolate import compile_spec  # NOTE [User code in a child]
from mpgen.errors import ErrorList, MpgenError, Position
from mpgen.files import reason
from mpgen.printed import escaped
from mpgen.spec_schema.load import MAX_BYTES


#: git with what a repository's config or tree could change switched off.
GIT = ("git", "-c", "core.fsmonitor=false", "-c", "core.untrackedCache=false",
       "-c", "core.attributesFile=/dev/null", "-c", "core.quotePath=false",
       "-c", "core.hooksPath=/dev/null")


def git_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of mpgen's git calls (``ci-summary``'s, ``diff``'s): no system attributes, no
    external diff, no optional locks (nothing written to the index)."""
    env = {k: v for k, v in environ.items()
           if k not in ("GIT_EXTERNAL_DIFF", "GIT_DIFF_OPTS", "GIT_ATTR_SOURCE")}
    env.update(GIT_ATTR_NOSYSTEM="1", GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0")
    return env


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
class MemoryChange:
    """One device's peak in one run of the memory plan (``train``,
    ``pipeline``, ``inference``) that differs; None: not on that side."""

    device: str
    run: str
    before: Optional[int]
    after: Optional[int]

    def __str__(self) -> str:
        a, b = self.before, self.after
        shown = f"{self.device} {self.run} peak {_bytes(a)} -> {_bytes(b)}"
        if a is None or b is None:
            return f"{shown} ({'new' if a is None else 'gone'})"
        if a == 0:
            return shown
        change = 100 * (b - a) / a
        return f"{shown} ({change:+.0f}%)" if abs(change) >= 1 else f"{shown} ({change:+.1f}%)"


def _bytes(n: Optional[int]) -> str:
    return "none" if n is None else human_bytes(n)


#: The runs of the memory plan, in the order a diff lists them.
MEMORY_RUNS = ("train", "pipeline", "inference")


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


#: Traffic growth below this many bytes per step is not worth a warning: a
#: copy that small costs the launch latency of a transfer, whatever its size.
TRAFFIC_FLOOR = 64 * 1024


@dataclass(frozen=True)
class TrafficGrowth:
    """Bytes crossing devices per training step in forward, before and after,
    with the device pairs whose share grew and the tensors added on each.
    ``warn``: the new layout sends at least twice as much, and at least
    :data:`TRAFFIC_FLOOR` bytes more."""

    before: int
    after: int
    grown: tuple[tuple[str, str, int, tuple[TransferKey, ...]], ...]  # src, dst, added, tensors

    @property
    def warn(self) -> bool:
        return self.after >= 2 * self.before and self.after - self.before >= TRAFFIC_FLOOR


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
    traffic: TrafficGrowth
    #: The memory plan's per-device peaks that differ (empty: the same, or a
    #: side without a plan), and the batches the plans are at (None: no plan).
    memory: tuple[MemoryChange, ...] = ()
    memory_batch: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class GitBlob:
    """A spec as git holds it: ``path`` (from the repository's root) in
    ``commit`` (a full commit id), read with ``git cat-file blob``, never from
    the working tree; shown as ``label``."""

    commit: str
    path: str
    label: str


def load_file(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
              root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Side:
    """Compile the spec file ``path`` (a path, whatever characters it holds)."""
    return Side(str(path), compile_spec(path, device_map, root, time_limit))


def load_blob(blob: GitBlob, device_map: Optional[Mapping[str, str]] = None,
              root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
              repository: str | Path | None = None) -> Side:
    """Compile ``blob``, read from the git repository at ``repository`` (default:
    the working directory's); errors name ``blob.label``. ``root``: as for
    :func:`load_side`."""
    pos = Position(blob.label, 1, 1)
    if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", blob.commit):
        raise MpgenError(pos, f"{blob.commit!r} is not a full commit id")
    if not blob.path or "\0" in blob.path:
        raise MpgenError(pos, f"{blob.path!r} is not a path in git")
    text = _read_blob(f"{blob.commit}:{blob.path}", pos, repository)
    return _compile_text(text, blob.path, blob.label, device_map, root, time_limit)


def load_side(arg: str, device_map: Optional[Mapping[str, str]] = None,
              root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Side:
    """Compile a side as ``mpgen diff`` is given it: a spec path, or
    ``REV:path`` from git; errors name ``arg``. ``REV:path`` is git's when REV
    is a commit, a file's when it is not and the file exists; both at once is
    an error (never a silent choice). ``root``: the project its dotted ops may
    import from; for ``REV:path`` (compiled from a temporary copy) the working
    directory by default. ``time_limit``: as for ``compile_spec``."""
    if ":" not in arg:
        return load_file(arg, device_map, root, time_limit)
    rev, _, path = arg.partition(":")
    commit = _commit(rev)
    if os.path.lexists(arg):
        if commit is None:
            return load_file(arg, device_map, root, time_limit)
        raise MpgenError(Position(arg, 1, 1), f"{arg!r} is both a file and a revision:path "
                         f"({rev!r} is commit {commit[:12]}); write {'./' + arg!r} for the "
                         f"file, or {commit + ':' + path!r} for the one in git")
    text = _git_show(arg)
    return _compile_text(text, path, arg, device_map, root, time_limit)


def _commit(rev: str) -> Optional[str]:
    """The full id of the commit ``rev`` names in the working directory's
    repository, or None (no repository, no such commit, no revision syntax)."""
    if not _REVISION.fullmatch(rev) or rev.startswith("-") or ".." in rev:
        return None
    found = _git_quiet("rev-parse", "--verify", "--quiet", "--end-of-options",
                       f"{rev}^{{commit}}")
    return found.strip() if found else None


def load_text(text: str, path: str, label: str,
              device_map: Optional[Mapping[str, str]] = None, root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Side:
    """Compile a spec's ``text`` (read from git by the caller) as the file
    ``path``; errors name ``label``. ``root``: as for :func:`load_side`."""
    return _compile_text(text, path, label, device_map, root, time_limit)


def _compile_text(text: str, path: str, label: str, device_map: Optional[Mapping[str, str]],
                  root: str | Path | None, time_limit: Optional[float]) -> Side:
    """Compile a spec's ``text`` (from git) from a temporary copy named as
    ``path``'s file (when that name is an ordinary one); errors name ``label``."""
    name = os.path.basename(path)
    if name in ("", ".", "..") or len(name) > 100 or escaped(name) != name:
        name = "spec.yaml"
    with tempfile.TemporaryDirectory(prefix="mpgen-diff-") as folder:
        copy = os.path.join(folder, name)
        with open(copy, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        try:
            graph = compile_spec(copy, device_map, os.getcwd() if root is None else root,
                                 time_limit)
        except MpgenError as exc:
            raise _renamed(exc, copy, label) from None
        return Side(label, graph)


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
        return _read_blob(arg, pos)
    except MpgenError as exc:
        if not exc.message.startswith("cannot read "):
            raise
        raise MpgenError(pos, f"{exc.message}{_cwd_hint(rev, path)}") from None


def _read_blob(name: str, pos: Position, repository: str | Path | None = None) -> str:
    """The blob git names ``name`` (``COMMIT:path``): at most MAX_BYTES of UTF-8."""
    try:
        with tempfile.TemporaryFile() as errors:
            done = subprocess.Popen([*GIT, "cat-file", "blob", name], cwd=repository,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=errors, env=git_env())
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
        raise MpgenError(pos, f"cannot read {pos.file!r} from git: {why}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MpgenError(pos, f"spec is not UTF-8 ({exc.reason})") from None


def _cwd_hint(rev: str, path: str) -> str:
    """A did-you-mean when ``REV:path`` (from the repository root) is missing
    but ``REV:./path`` (from the current directory) exists: git reads a
    ``REV:path`` from the root, which surprises a user in a subfolder."""
    if path.startswith(("./", "../", "/")):
        return ""
    prefix = (_git_quiet("rev-parse", "--show-prefix") or "").strip()
    here = f"{rev}:./{path}"
    if not prefix or (_git_quiet("cat-file", "-t", here) or "").strip() != "blob":
        return ""  # at the root, or no file there either
    return (f"; a REV:path is relative to the repository root, and {rev} has {path!r} in the "
            f"current directory: did you mean {here!r} or {rev + ':' + prefix + path!r}?")


def _git_quiet(*args: str) -> Optional[str]:
    """Stdout of a short git command, or None when it fails."""
    try:
        done = subprocess.run([*GIT, *args], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=60, env=git_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None


def _renamed(exc: MpgenError, path: str, arg: str) -> MpgenError:
    """The same error(s) with the temporary file's name replaced by ``arg``."""
    def one(e: MpgenError) -> MpgenError:
        pos = e.pos
        if pos is not None and pos.file == path:
            pos = dataclasses.replace(pos, file=arg)
        return MpgenError(pos, e.message.replace(path, escaped(arg)))

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
        traffic=_traffic(old_t, new_t),
        memory=_memory(old.graph.memory, new.graph.memory),
        memory_batch=(None if old.graph.memory is None or new.graph.memory is None
                      else (old.graph.memory.batch, new.graph.memory.batch)),
    )


def _memory(old: Optional[MemoryPlan], new: Optional[MemoryPlan]) -> tuple[MemoryChange, ...]:
    """Each device's plan peak, per run, where it differs (devices in the new
    side's order, then the old side's)."""
    if old is None or new is None:
        return ()
    found = []
    for run in MEMORY_RUNS:
        before = {m.device: m.peak for m in getattr(old, run)}
        after = {m.device: m.peak for m in getattr(new, run)}
        found += [MemoryChange(d, run, before.get(d), after.get(d))
                  for d in dict.fromkeys([*after, *before]) if before.get(d) != after.get(d)]
    order = {d: i for i, d in enumerate(dict.fromkeys(c.device for c in found))}
    return tuple(sorted(found, key=lambda c: (order[c.device], MEMORY_RUNS.index(c.run))))


def _traffic(old: list[TransferKey], new: list[TransferKey]) -> TrafficGrowth:
    """Cross-device bytes of each side's transfers (inputs from the caller not
    counted, as in the report), and where they grew."""
    def per_pair(keys: list[TransferKey]) -> dict[tuple[str, str], int]:
        pairs: dict[tuple[str, str], int] = {}
        for t in keys:
            if t.src != CALLER:
                pairs[t.src, t.dst] = pairs.get((t.src, t.dst), 0) + t.nbytes
        return pairs

    before, after = per_pair(old), per_pair(new)
    grown = tuple((src, dst, n - before.get((src, dst), 0),
                   tuple(t for t in new if (t.src, t.dst) == (src, dst) and t not in old))
                  for (src, dst), n in after.items() if n > before.get((src, dst), 0))
    return TrafficGrowth(sum(before.values()), sum(after.values()), grown)


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


#: The source of a model input's transfer: the caller's device, not a layer's.
CALLER = "caller"


def _transfers(side: Side) -> list[TransferKey]:
    keys = []
    for t in side.graph.plan.transfers:
        keys.append(TransferKey(str(t.value), t.src or CALLER, t.dst,
                                str(t.type), side.costs.nbytes(t.value)))
    return keys


def _amount(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({human_bytes(nbytes)})"


def format_diff(d: LayoutDiff) -> str:
    """The diff as plain text, for the terminal."""
    lines = [f"--- {escaped(d.old)}", f"+++ {escaped(d.new)}", ""]
    traffic = d.traffic
    if traffic.warn:
        grows = (f"grows {traffic.after / traffic.before:.1f}x" if traffic.before
                 else "grows from none")
        lines.append(f"warning: cross-device traffic {grows} per training step (forward): "
                     f"{_amount(traffic.before)} -> {_amount(traffic.after)}; added by:")
        lines.extend(f"  {src} -> {dst}: +{_amount(added)}: "
                     + ", ".join(f"{t.tensor} {t.shape}" for t in tensors)
                     for src, dst, added, tensors in traffic.grown)
        lines.append("")
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
    if d.memory_batch is not None:
        a, b = d.memory_batch
        at = f"batch {a}" if a == b else f"batch {a} -> {b}"
        if d.memory:
            lines += ["", f"memory plan (peak per device, {at}):"]
            lines.extend(f"  {c}" for c in d.memory)
        else:
            lines += ["", f"memory plan ({at}): unchanged"]
    lines += ["", "transfers in forward:"]
    if not d.transfers_removed and not d.transfers_added:
        lines.append("  unchanged")
    else:
        lines.append(f"  between devices: {_amount(traffic.before)} -> "
                     f"{_amount(traffic.after)} per training step")
    lines.extend(f"  - {t}" for t in d.transfers_removed)
    lines.extend(f"  + {t}" for t in d.transfers_added)
    return "\n".join(lines) + "\n"
