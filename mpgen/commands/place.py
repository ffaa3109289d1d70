"""``mpgen place``: show a spec's layout in the explicit form, or write it back.

# NOTE: [Writing the placement back]
# ``mpgen place`` prints every layer, a repeated layer's instances compressed
# to ranges per device (``h.0-5: cuda:1``): a view of where everything is.
# ``--write`` writes the shortest explicit form that gives the same layout
# (``shortest_entries``), so that the spec's own diff shows the move and not a
# listing of every layer. Explicit entries are bookmarks: a named unit takes
# the entry's device and the units after it keep it, those before the first
# entry take the first entry's device. One entry per device run is therefore
# both necessary (a run's first unit differs from the unit before it, so it
# must be named; the first run needs some entry, or it would take the second
# run's device) and enough; the default (no entries) is shorter still when
# every unit is on cuda:0. Among the shortest forms the one closest to the
# spec's current block is written: an old key that still names units of one
# run only (its first unit, for every run but the first) is kept, with the
# same device where it still holds, so an unchanged entry is an unchanged
# line. Otherwise a run is named from its first unit to the end of that
# layer's part of the run (``h.6-11``, or ``h`` for all of a layer). The
# entries are resolved again by the compiler's own explicit resolver and
# must give every unit its device (an internal error otherwise), and the
# rewritten text is compiled before it replaces the file.
#
# The new block is spliced into the file's text in place of the old one,
# using the positions PyYAML gives for the ``placement`` key and the last
# token of its value: every byte outside that range is kept (comments, blank
# lines, flow mappings, quoting, line endings), which a YAML round trip
# (ruamel.yaml included) does not promise for reflowed flow mappings. An
# automatic block is kept above the new entries as comments, so the settings
# it was chosen from stay in the file. In an explicit block the comments of a
# kept key stay with it (the lines above its entry and the comment after it);
# those above an entry that goes move down to the next one kept. Two comment
# lines say how the layout was chosen and how the form was (a later --write
# replaces them).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import yaml

from mpgen.compiler.analysis.costs import human_bytes
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT, MAX_ELEMENTS, MAX_TRAIN_SIZE
from mpgen.compiler.ir import (
    ExplicitPlacement,
    Graph,
    MemoryPlan,
    PlacementEntry,
    UnitRange,
    device_runs,
    unit_labels,
)
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.placement.auto import BALANCE_UNITS
from mpgen.compiler.placement.devices import DEFAULT_DEVICE
from mpgen.compiler.placement.explicit import place_explicit
from mpgen.errors import MpgenError, Position
from mpgen.files import reason
from mpgen.spec_schema.load import read_spec
from mpgen.spec_schema.models import TrainSpec


@dataclass(frozen=True)
class Placed:
    """The layout of one spec, in the explicit form."""

    graph: Graph
    entries: tuple[tuple[str, str], ...]  # key -> device, in layers order
    how: str  # one line: how the layout was chosen
    auto: bool
    bottleneck: str = ""  # automatic: "bottleneck 42,527,232 parameters on cuda:1"
    renamed: str = ""  # "devices renamed by --device-map cuda:1=cuda:0"
    root: str | Path | None = None  # the project it was compiled in (``compile_spec``)
    time_limit: Optional[float] = DEFAULT_TIME_LIMIT  # and the analysis budget
    shortest: tuple[tuple[str, str], ...] = ()  # what --write writes (``shortest_entries``)
    kept: int = 0  # how many of its keys the spec's current block already has

    def block(self, indent: str = "  ", newline: str = "\n") -> str:
        """The ``placement:`` block in the explicit form (without a final newline)."""
        return newline.join(["placement:", *_entry_lines(self.entries, indent)])


def explicit_entries(graph: Graph) -> list[tuple[str, str]]:
    """Every layer -> device; a repeated layer's instances as ranges per device."""
    return [(unit_labels([node.unit(k) for k in range(start, stop)], graph.repeats,
                         whole=True)[0], device)
            for node in graph.nodes for start, stop, device in device_runs(node.devices)]


def shortest_entries(graph: Graph, current: Sequence[tuple[str, str]] = ()
                     ) -> list[tuple[str, str]]:
    """The fewest explicit entries (key, device) that give ``graph``'s devices.

    One bookmark per device run, none when every unit is on the default
    device; among those, the keys of ``current`` (the spec's block, as key ->
    device) where they fit (NOTE [Writing the placement back]). Raises
    :class:`MpgenError` (an internal error) if the entries do not resolve to
    the same devices.
    """
    units = [(node, k) for node in graph.nodes for k in range(node.instances)]
    runs = device_runs([node.devices[k] for node, k in units])
    if len(runs) == 1 and runs[0][2] == DEFAULT_DEVICE:
        return []
    position = {node.unit(k): i for i, (node, k) in enumerate(units)}
    spans = [(key, device, span) for key, device in current
             if (span := _span(graph, key, position)) is not None]
    entries = []
    for r, (start, stop, device) in enumerate(runs):
        fits = [(key, old) for key, old, (lo, hi) in spans
                if start <= lo and hi < stop and (r == 0 or lo == start)]
        key = next((k for k, old in fits if old == device), fits[0][0] if fits else None)
        if key is None:
            node, first = units[start]
            last = min(node.instances, first + stop - start)
            key = unit_labels([node.unit(k) for k in range(first, last)], graph.repeats,
                              whole=True)[0]
        entries.append((key, device))
    entries = _inside_splits(graph, entries, position)
    _check_resolves(graph, entries)
    return entries


def _inside_splits(graph: Graph, entries: list[tuple[str, str]], position: Mapping
                   ) -> list[tuple[str, str]]:
    """``entries`` with a key for each layer of a split block instance that
    the bookmarks leave elsewhere: inside one, a layer no key names is on the
    instance's device, not the run's (NOTE [Placement inside a block
    instance]; ``model.norm`` after ``model.layers.2-3: cuda:1``)."""
    while graph.splits:
        request = ExplicitPlacement(tuple(PlacementEntry(k, d, Position("<mpgen place>"))
                                          for k, d in entries))
        got = {n.name: n.devices for n in place_explicit(graph, request).nodes}
        wrong = next(((node, k) for node in graph.nodes
                      for k, device in enumerate(node.devices) if got[node.name][k] != device),
                     None)
        if wrong is None:
            return entries
        node, k = wrong
        start, stop, device = next(r for r in device_runs(node.devices) if r[0] <= k < r[1])
        key = unit_labels([node.unit(i) for i in range(start, stop)], graph.repeats,
                          whole=True)[0]
        if any(key == old for old, _ in entries):  # pragma: no cover - a bug in mpgen
            return entries  # _check_resolves says so
        entries = sorted([*entries, (key, device)],
                         key=lambda entry: _span(graph, entry[0], position)[0])
    return entries


def _span(graph: Graph, key: str, position: Mapping) -> Optional[tuple[int, int]]:
    """The first and last unit positions a placement key names (None: none)."""
    # a layer's whole name first: features.3 is a layer of a split nn.Sequential
    label = UnitRange(key) if key in graph.repeats else UnitRange.parse(key)
    if label is None or label.node not in graph.repeats:
        return None
    node = graph.node(label.node)
    if label.first is None:
        first, last = 0, node.instances - 1
    elif node.repeat and label.first <= label.last < node.repeat:
        first, last = label.first, label.last
    else:
        return None
    return position[node.unit(first)], position[node.unit(last)]


def _check_resolves(graph: Graph, entries: Sequence[tuple[str, str]]) -> None:
    """Resolve ``entries`` as the compiler does; they must give every unit its device."""
    where = Position("<mpgen place --write>")
    request = ExplicitPlacement(tuple(PlacementEntry(k, d, where) for k, d in entries))
    got = [n.devices for n in place_explicit(graph, request).nodes]
    if got != [n.devices for n in graph.nodes]:  # pragma: no cover - a bug in mpgen
        raise MpgenError(where, "internal error: the shortest placement form "
                         f"{dict(entries)} does not reproduce the layout")


def place(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
          root: str | Path | None = None,
          time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Placed:
    """Compile the spec and return its layout in the explicit form."""
    graph = compile_spec(path, device_map, root, time_limit)
    auto = graph.layout.method == "auto"
    bottleneck = renamed = ""
    if auto:
        choice = graph.layout.auto
        value = choice.split.bottleneck
        amount = f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"
        bottleneck = (f"bottleneck {amount} {BALANCE_UNITS[choice.request.balance]} on "
                      f"{choice.bottleneck_device}")
        how = (f"chosen automatically (balance {choice.request.balance} over "
               f"{', '.join(choice.devices)}); {bottleneck}")
    elif graph.layout.method == "explicit":
        how = "explicit in the spec"
    else:
        how = "the default: no placement, everything on cuda:0"
    if device_map:
        renamed = "devices renamed by --device-map " + ",".join(
            f"{k}={v}" for k, v in sorted(device_map.items()))
        how += f"; {renamed}"
    request = graph.placement
    current = ([(e.key, e.device) for e in request.entries]
               if isinstance(request, ExplicitPlacement) else [])
    shortest = shortest_entries(graph, current)
    kept = len({key for key, _ in shortest} & {key for key, _ in current})
    return Placed(graph, tuple(explicit_entries(graph)), how, auto, bottleneck, renamed, root,
                  time_limit, tuple(shortest), kept)


def write_placement(path: str | Path, placed: Placed) -> bool:
    """Rewrite ``path``'s placement block into ``placed``'s shortest explicit form.

    Returns False when there is nothing to change: a spec built without a
    device map whose layout is not automatic (explicit, or the default) already
    says what it gives. Every line outside the placement block is kept byte for
    byte; the new text is compiled and checked before it is written.
    A symbolic link is written through (its target changes, the link stays);
    the file keeps its mode and is replaced in one rename; a read-only spec
    or folder is an :class:`MpgenError`.
    """
    text = read_spec(path)
    if not placed.auto and not placed.graph.device_map:
        return False  # already explicit (or the default): the spec's own spelling stays
    new_text = rewrite_text(text, placed, str(path))
    if new_text == text:
        return False

    def check(graph: Graph) -> None:
        got = [(n.name, n.devices) for n in graph.nodes]
        want = [(n.name, n.devices) for n in placed.graph.nodes]
        if got != want:  # pragma: no cover - a bug in mpgen, never a user mistake
            raise MpgenError(Position(str(path), 1, 1), "internal error: the rewritten placement "
                             "does not reproduce the layout; the spec was not changed")

    _replace_spec(path, new_text, placed.root, placed.time_limit, check)
    return True


def _replace_spec(path: str | Path, new_text: str, root, time_limit,
                  check: Callable[[Graph], None]) -> None:
    """Replace the spec ``path`` by ``new_text`` once it compiles and passes
    ``check``: through a symbolic link, keeping the file's mode, in one rename
    in its own folder; a read-only spec or folder is an :class:`MpgenError`."""
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat()
    except OSError as exc:
        raise MpgenError(Position(str(path)), f"cannot rewrite the spec: {reason(exc)}") from None
    if not (mode.st_mode & 0o222 and os.access(target, os.W_OK)):
        raise MpgenError(Position(str(path)), "cannot rewrite the spec: it is read-only "
                         f"(mode {stat.S_IMODE(mode.st_mode):04o}); make it writable first")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:100]}.", suffix=".tmp",
                                   dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new_text)
            f.flush()
            os.fsync(f.fileno())
        check(compile_spec(tmp, root=root, time_limit=time_limit))
        os.chmod(tmp, stat.S_IMODE(mode.st_mode))
        with contextlib.suppress(OSError):  # only root may give a file away
            os.chown(tmp, mode.st_uid, mode.st_gid)
        os.replace(tmp, target)
    except OSError as exc:
        where = f"writing in {target.parent}" if tmp is None else f"replacing {target}"
        raise MpgenError(Position(str(path)), f"cannot rewrite the spec: {reason(exc)} "
                         f"({where}); the spec was not changed") from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


# -- the largest batch that fits ----------------------------------------------

# NOTE: [The largest batch that fits]
# ``mpgen place --fit`` looks for the largest ``train.batch_size`` at which
# every device's memory-plan peak (placement/memory.py: the training script's,
# and the pipeline program's when the spec has ``pipeline:``) is within its
# capacity. The layout is the spec's as compiled; only the batch (and the
# pipeline's micro-batch count) varies, through ``memory.plan(graph,
# batch=..., microbatches=...)``, which reuses the work that does not depend
# on the batch. A batch is a candidate only where the programs run it
# alike, micro-batch for micro-batch: a multiple of ``pipeline.dp`` times
# the spec's ``microbatches`` (at least one per stage under 1F1B, as
# ``pp_<name>.py``'s own default), so that the replicas share it equally and
# each replica's part splits into that many micro-batches of the same size
# (``pp_<name>.py`` refuses counts that do not divide it). The count stays
# the spec's unless the pipeline's peak no longer fits with it; then twice
# and four times it are tried, where they divide the part, and the smallest
# that fits is written. (Counts that merely divide, at any batch, would find
# a few more samples at the price of odd micro-batches, down to one sample
# each, which a BatchNorm cannot train on.)
# The search starts at the spec's batch and doubles until a batch fails (or
# halves until one fits), then bisects between the last that fitted and the
# first that failed: the plan grows with the batch (activations, the batch
# itself, transients) and nothing shrinks, so the boundary is one. The
# answer is then checked the way it will be used: the spec rewritten with
# it is compiled (its shapes at that batch, an automatic placement chosen
# again, the build's own capacity check) and its own plan must fit, and so
# must not the spec rewritten with the next candidate. Where the two
# disagree (an automatic layout chosen differently at that batch), the
# search goes on over compiled specs, down or up. The next candidate's
# binding device and need (or its build error) are shown, so the answer's
# margin is visible.

#: The runs of the memory plan a capacity bounds (inference runs no step).
FIT_RUNS = ("train", "pipeline")


@dataclass(frozen=True)
class Need:
    """One device's peak in one run, at one batch, against its capacity."""

    device: str
    run: str
    peak: int
    capacity: int
    largest: tuple[tuple[str, int], ...] = ()

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def __str__(self) -> str:
        return (f"{self.device} needs {self.peak:,} bytes ({human_bytes(self.peak)}, its "
                f"{self.run} peak) of its {self.capacity:,} ({human_bytes(self.capacity)}): "
                f"{100 * self.peak / self.capacity:.1f}%"
                + ("" if self.fits else f", {self.peak - self.capacity:,} bytes over"))


@dataclass(frozen=True)
class Fit:
    """What ``mpgen place --fit`` found (NOTE [The largest batch that fits])."""

    graph: Graph  # the spec as it is
    batch: int  # the answer
    microbatches: Optional[int]  # the pipeline's at the answer (None: no ``pipeline:``)
    plan: MemoryPlan  # at the answer
    need: Need  # the binding device at the answer (the highest share of its capacity)
    #: The next candidate batch and the device it fails on (or the spec's
    #: first build error there); None: the answer is the largest batch a spec may state.
    over: Optional[tuple[int, "Need | str"]]
    capacity: tuple[tuple[str, int], ...]
    root: str | Path | None = None
    time_limit: Optional[float] = DEFAULT_TIME_LIMIT
    spec: str = ""  # as given
    before: tuple[int, Optional[int]] = (0, None)  # the spec's batch and micro-batch count


def parse_capacity(text: str) -> dict[str, int]:
    """``--capacity cuda:0=24GiB,cuda:1=40GiB`` -> device -> bytes; raises
    :class:`MpgenError` naming the bad item."""
    from mpgen.spec_schema.models import check_device, parse_size

    found: dict[str, int] = {}
    for item in text.split(","):
        device, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not device or not size:
            raise MpgenError(None, f"--capacity: {item.strip()!r} is not DEVICE=SIZE (such as "
                             "cuda:0=24GiB)")
        if device in found:
            raise MpgenError(None, f"--capacity: {device} is given twice")
        try:
            check_device(device)
            found[device] = parse_size(size)
        except ValueError as exc:  # pydantic's errors are ValueErrors
            message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
            raise MpgenError(None, f"--capacity: {message}") from None
    return found


def spec_capacity(graph: Graph) -> dict[str, int]:
    """The capacities the spec states, by the build's devices (after
    ``--device-map``), as the build checks them."""
    from mpgen.compiler.placement.memory import capacities

    return {device: size for device, (size, _) in capacities(graph).items()}


def fit(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
        capacity: Optional[Mapping[str, int]] = None, root: str | Path | None = None,
        time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Fit:
    """The largest batch (and micro-batch count) whose memory plan fits every
    capacity: the spec's, with ``capacity`` (device -> bytes, after
    ``device_map``) replacing it device by device. Raises
    :class:`MpgenError`: no capacity, no batch dim, or not even the smallest
    batch fits (one line naming the device and its need)."""
    try:
        graph = compile_spec(path, device_map, root, time_limit)
        before = (dict(graph.dims).get("batch"),
                  graph.pipeline.microbatches if graph.pipeline else None)
    except MpgenError as exc:  # its own batch over its own capacity, say: from a smaller one
        graph, before = _smaller(path, device_map, root, time_limit, exc)
    caps = {**spec_capacity(graph), **(capacity or {})}
    if not caps:
        raise MpgenError(None, "mpgen place --fit: no device has a capacity: give one with "
                         "--capacity cuda:0=24GiB,... or in the spec (capacity: {cuda:0: 24GiB})")
    used = list(graph.devices)
    unknown = [d for d in caps if d not in used]
    if unknown:
        raise MpgenError(None, f"mpgen place --fit: --capacity names {', '.join(unknown)}, not "
                         f"a device of this build (it uses {', '.join(used)}"
                         f"{' after --device-map' if graph.device_map else ''})")
    if "batch" not in dict(graph.dims):
        raise MpgenError(None, "mpgen place --fit: no input has a 'batch' dim, so "
                         "train.batch_size changes no memory")
    search = _Search(graph, caps)
    # from the spec's batch: doubling up while it fits, else halving down until it does
    step = search.step
    good, bad = max(step, min(dict(graph.dims)["batch"], search.most) // step * step), None
    while not search.fits(good):
        if good == step:
            need = search.need(step)
            raise MpgenError(None, f"mpgen place --fit: not even a batch of {step} fits: "
                             f"{need}{_largest(need)}")
        good, bad = max(step, good // 2 // step * step), good
    while bad is None:
        if good * 2 > search.most:
            if search.fits(search.most):
                good = search.most
                break
            bad = search.most
        elif search.fits(good * 2):
            good *= 2
        else:
            bad = good * 2
    good = search.bisect(good, bad)
    good, built, above = _verified(path, graph, search, good, device_map, root, time_limit)
    compiled = built.graph
    return Fit(graph, good, compiled.pipeline.microbatches if compiled.pipeline else None,
               compiled.memory, built.detail, above and (above[0], above[1].detail),
               tuple(caps.items()), root, time_limit, str(path), before)


def _largest(need: Need) -> str:
    if not need.largest:
        return ""
    return "; largest: " + ", ".join(f"{name} {human_bytes(n)}" for name, n in need.largest)


def fit_lines(found: Fit) -> list[str]:
    """What ``mpgen place --fit`` prints: the answer, the binding device at
    it and at the next batch, and each device's peaks."""
    batch, count = found.before
    spec = found.spec
    answer = f"train.batch_size {found.batch}"
    if found.microbatches is not None:
        answer += f", pipeline.microbatches {found.microbatches}"
    was = f"batch_size {batch}" + (f", microbatches {count}" if count is not None else "")
    lines = [f"# {spec}: the largest batch that fits: {answer} (the spec: {was})",
             f"binding at batch {found.batch}: {found.need}{_largest(found.need)}"]
    if found.over is not None:
        above, need = found.over
        lines.append(f"at batch {above}: {need} (does not fit)" if isinstance(need, Need) else
                     f"at batch {above}: the spec does not build: {need}")
    else:
        lines.append(f"no larger batch: {found.batch} is the largest a spec may state")
    caps = dict(found.capacity)
    for run in FIT_RUNS:
        for m in getattr(found.plan, run):
            if run == "pipeline" and found.microbatches is None:
                continue
            cap = caps.get(m.device)
            limit = f" of {human_bytes(cap)}" if cap else " (no capacity)"
            lines.append(f"  {m.device} {run} peak {human_bytes(m.peak)}{limit}")
    return lines


class _Search:
    """The candidate batches of one compiled spec and their plans, cached."""

    def __init__(self, graph: Graph, capacity: Mapping[str, int]) -> None:
        self.graph, self.capacity = graph, dict(capacity)
        pipeline = graph.pipeline
        self.dp = pipeline.dp if pipeline else 1
        self.runs = FIT_RUNS if pipeline else FIT_RUNS[:1]
        stages = len(graph.spec_plan.sections) if graph.spec_plan else 1
        # the spec's micro-batch count, at least a micro-batch per stage under 1F1B (as
        # pp_<name>.py's default): every batch tried splits into it on every replica
        self.least = (max(pipeline.microbatches, stages if pipeline.schedule == "1f1b" else 1)
                      if pipeline else 1)
        self.step = self.dp * self.least
        dims = dict(graph.dims)
        per_sample = [t.type.numel({**dims, "batch": 1}) for t in graph.inputs
                      if t.type.batch_dim is not None]
        most = min([MAX_TRAIN_SIZE, *(MAX_ELEMENTS // max(n, 1) for n in per_sample)])
        self.most = max(self.step, most - most % self.step)
        self._plans: dict[tuple[int, Optional[int]], MemoryPlan] = {}

    def _plan(self, batch: int, microbatches: Optional[int]) -> MemoryPlan:
        from mpgen.compiler.placement import memory

        key = (batch, microbatches)
        if key not in self._plans:
            self._plans[key] = memory.plan(self.graph, batch=batch, microbatches=microbatches)
        return self._plans[key]

    def candidates(self, batch: int) -> list[Optional[int]]:
        """The micro-batch counts tried at ``batch`` (a multiple of
        :attr:`step`), the smallest first: the spec's, then twice and four
        times it where they divide a replica's part (None: no pipeline)."""
        if self.graph.pipeline is None:
            return [None]
        part = batch // self.dp
        return [self.least * k for k in _COUNT_FACTORS if part % (self.least * k) == 0]

    def needs(self, plan: MemoryPlan) -> list[Need]:
        return [Need(m.device, run, m.peak, self.capacity[m.device], m.largest)
                for run in self.runs for m in getattr(plan, run) if m.device in self.capacity]

    def microbatches(self, batch: int) -> Optional[int]:
        """The smallest count that fits at ``batch`` (else the smallest)."""
        counts = self.candidates(batch)
        for m in counts:
            needs = self.needs(self._plan(batch, m))
            if all(n.fits for n in needs):
                return m
            if not all(n.fits for n in needs if n.run == "train"):
                break  # the pipeline's count does not rescue the training script
        return counts[0]

    def plan(self, batch: int) -> MemoryPlan:
        return self._plan(batch, self.microbatches(batch))

    def fits(self, batch: int) -> bool:
        return all(n.fits for n in self.needs(self.plan(batch)))

    def need(self, batch: int) -> Need:
        """The device nearest (or furthest over) its capacity at ``batch``."""
        return _binding(self.needs(self.plan(batch)))

    def bisect(self, good: int, bad: Optional[int]) -> int:
        """The largest candidate in [good, bad) that fits, ``good`` fitting."""
        if bad is None:
            return good
        lo, hi = good // self.step, bad // self.step  # in steps: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid * self.step) else (lo, mid)
        return lo * self.step


#: The micro-batch counts tried at one batch, as multiples of the spec's:
#: more micro-batches hold fewer samples each in flight, with diminishing
#: returns and a growing share of each stage's fixed cost.
_COUNT_FACTORS = (1, 2, 4)


@dataclass(frozen=True)
class _Built:
    """The spec rewritten at one batch, compiled: whether its own plan fits,
    and the binding device (or, where it does not build, the first error)."""

    fits: bool
    graph: Optional[Graph]
    detail: "Need | str"


def _verified(path, graph: Graph, search: _Search, batch: int, device_map, root,
              time_limit) -> tuple[int, _Built, tuple[int, _Built] | None]:
    """The largest batch whose rewritten spec compiles and whose own plan
    fits, searched from ``batch`` (the plan's answer on the spec's layout),
    with what it is at that batch and at the next (NOTE [The largest batch
    that fits])."""
    text = read_spec(path)
    built: dict[int, _Built] = {}

    def truth(b: int) -> _Built:
        if b not in built:
            written = fit_text(text, b, search.microbatches(b), str(path))
            try:
                compiled = _compiled(path, written, device_map, root, time_limit)
            except MpgenError as exc:
                built[b] = _Built(False, None, str(exc).splitlines()[0])
            else:
                again = _Search(compiled, search.capacity)
                needs = again.needs(compiled.memory) if compiled.memory is not None else []
                built[b] = _Built(bool(needs) and all(n.fits for n in needs), compiled,
                                  _binding(needs) if needs else "no memory plan")
        return built[b]

    step = search.step
    if truth(batch).fits:  # then upwards while the next fits (a layout chosen anew may)
        lo, hi = batch // step, None
        while hi is None:
            if (lo + 1) * step > search.most:
                return lo * step, truth(lo * step), None
            if not truth((lo + 1) * step).fits:
                hi = lo + 1
            elif lo * 2 * step <= search.most and truth(lo * 2 * step).fits:
                lo *= 2
            else:
                lo, hi = lo + 1, min(lo * 2, search.most // step + 1)
    else:
        lo, hi = 0, batch // step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if truth(mid * step).fits else (lo, mid)
    if lo == 0:
        failed = truth(step).detail
        raise MpgenError(None, f"mpgen place --fit: the spec at a batch of {step} does not fit: "
                         f"{failed}{_largest(failed) if isinstance(failed, Need) else ''}")
    above = None if hi * step > search.most else (hi * step, truth(hi * step))
    return lo * step, truth(lo * step), above


def _binding(needs: Sequence[Need]) -> Need:
    """The device nearest (or furthest over) its capacity."""
    return max(needs, key=lambda n: (n.peak / n.capacity, n.peak))


def _smaller(path, device_map, root, time_limit,
             error: MpgenError) -> tuple[Graph, tuple[int, Optional[int]]]:
    """The spec compiled at the smallest batch its pipeline takes (``dp``
    times ``microbatches``, as it states them), where it does not compile at
    its own (its plan over its capacity), and the batch and micro-batch count
    it states; raises ``error`` where it does not compile at that batch either."""
    text = read_spec(path)
    root_node = _root_mapping(text, str(path))
    train = _child(root_node, "train")
    pipeline = _child(root_node, "pipeline")
    stated = [_child(_child(train, "dims"), "batch"), _child(train, "batch_size"),
              _child(pipeline, "dp"), _child(pipeline, "microbatches")]
    batch, size, dp, count = (int(n.value) if isinstance(n, yaml.ScalarNode)
                              and n.value.isdigit() else None for n in stated)
    try:
        graph = _compiled(path, fit_text(text, (dp or 1) * (count or 1), None, str(path)),
                          device_map, root, time_limit)
    except MpgenError:
        raise error from None
    return graph, (batch or size or TrainSpec.model_fields["batch_size"].default, count)


def _compiled(path, text: str, device_map, root, time_limit) -> Graph:
    """``text`` compiled as the spec ``path`` would be, from a copy beside it."""
    target = Path(os.path.realpath(path))
    try:  # beside it: its folder and project are the spec's
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:100]}.", suffix=".fit.yaml",
                                   dir=target.parent)
    except OSError:  # a read-only folder: a copy elsewhere, its modules from the spec's folder
        with tempfile.TemporaryDirectory(prefix="mpgen-fit-") as folder:
            copy = Path(folder) / target.name
            copy.write_text(text, encoding="utf-8")
            return compile_spec(copy, device_map,
                                root=root if root is not None else target.parent,
                                time_limit=time_limit)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        return compile_spec(tmp, device_map, root=root, time_limit=time_limit)
    finally:
        os.unlink(tmp)


def fit_text(text: str, batch: int, microbatches: Optional[int],
             name: str = "spec.yaml") -> str:
    """``text`` with the batch (``train.dims.batch`` where the spec sizes it
    there, else ``train.batch_size``) and ``pipeline.microbatches`` set; every
    other byte kept."""
    root = _root_mapping(text, name)
    edits: list[tuple[int, int, str]] = []
    train = _child(root, "train")
    where = next((v for v in (_child(_child(train, "dims"), "batch"),
                              _child(train, "batch_size")) if v is not None), None)
    if where is not None:
        edits.append((where.start_mark.index, where.end_mark.index, str(batch)))
    elif isinstance(train, yaml.MappingNode) and (train.value or train.flow_style):
        edits.append(_added_key(text, train, "batch_size", batch))
    elif train is None:
        newline = "\r\n" if "\r\n" in text else "\n"
        sep = "" if not text or text.endswith("\n") else newline
        indent = _indent(text, None)
        edits.append((len(text), len(text),
                      f"{sep}{newline}train:{newline}{indent}batch_size: {batch}{newline}"))
    else:
        raise MpgenError(_pos(name, train), "train: cannot add batch_size here; write "
                         f"train: {{batch_size: {batch}}}")
    count = _child(_child(root, "pipeline"), "microbatches")
    if microbatches is not None and count is not None and count.value != str(microbatches):
        edits.append((count.start_mark.index, count.end_mark.index, str(microbatches)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _root_mapping(text: str, name: str):
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:  # compile_spec has read it: not expected
        raise MpgenError(Position(name, 1, 1), f"invalid YAML: {exc}") from None
    if not isinstance(root, yaml.MappingNode):
        raise MpgenError(Position(name, 1, 1), "spec is not a mapping")
    return root


def _child(node, key: str):
    """The value node of ``key`` in the mapping ``node`` (None: none)."""
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((v for k, v in node.value
                 if isinstance(k, yaml.ScalarNode) and k.value == key), None)


def _added_key(text: str, mapping, key: str, value: int) -> tuple[int, int, str]:
    """An edit adding ``key: value`` to ``mapping``: after its last entry, in
    its style (a line at its keys' column, or ``, key: value`` before a flow
    mapping's ``}``)."""
    if mapping.flow_style:
        end = mapping.end_mark.index - 1  # the closing brace
        return end, end, f"{', ' if mapping.value else ''}{key}: {value}"
    newline = "\r\n" if "\r\n" in text else "\n"
    column = mapping.value[0][0].start_mark.column
    at = _line_end(text, _content_end(mapping))
    return at, at, f"{newline}{' ' * column}{key}: {value}"


def write_fit(path: str | Path, found: Fit) -> bool:
    """Write ``found``'s batch (and micro-batch count) into the spec ``path``:
    False when it already says them. As :func:`write_placement`: every other
    byte kept, checked by compiling it, replaced in one rename."""
    text = read_spec(path)
    new_text = fit_text(text, found.batch, found.microbatches, str(path))
    if new_text == text:
        return False

    def check(graph: Graph) -> None:
        if dict(graph.dims).get("batch") != found.batch:  # pragma: no cover - a bug in mpgen
            raise MpgenError(Position(str(path), 1, 1), "internal error: the rewritten spec "
                             "does not train at the batch found; the spec was not changed")

    _replace_spec(path, new_text, found.root, found.time_limit, check)
    return True


def rewrite_text(text: str, placed: Placed, name: str = "spec.yaml") -> str:
    """``text`` with its placement block replaced by ``placed``'s shortest explicit form."""
    newline = "\r\n" if "\r\n" in text else "\n"
    found = _find_placement(text, name)
    indent = _indent(text, found)
    if found is None:
        if not placed.shortest:  # the default: no block is the shortest form
            return text
        block = newline.join(["placement:", *_written_lines(placed, indent, [], _Comments())])
        sep = "" if not text or text.endswith("\n") else newline
        return f"{text}{sep}{newline}{block}{newline}"
    key, value = found
    start = text.rfind("\n", 0, key.start_mark.index) + 1
    if text[start:key.start_mark.index].strip():
        raise MpgenError(_pos(name, key), "placement: cannot rewrite a placement key that does "
                         "not start its line; write the explicit form by hand")
    content_end = _content_end(value)
    end = _line_end(text, content_end)
    rest = text[content_end:end].strip()
    if rest and not rest.startswith("#"):
        raise MpgenError(_pos(name, key), "placement: cannot rewrite the placement block: "
                         "other content follows it on its last line")
    key_line_end = _line_end(text, key.start_mark.index)
    colon = text[start:key.end_mark.index] + (": {}" if not placed.shortest else ":")
    if value.start_mark.index >= key_line_end:  # the value starts on a later line
        first = colon + text[key.end_mark.index:key_line_end].split(":", 1)[1]
        old = text[key_line_end:end].lstrip("\r\n")
    else:
        first = colon
        old = text[value.start_mark.index:end]
    old_lines = _dedent(old.splitlines()) if placed.auto else []
    comments = _Comments() if placed.auto else _old_comments(text, key, value, content_end)
    block = newline.join([first, *_written_lines(placed, indent, old_lines, comments)])
    return text[:start] + block + text[end:]


#: The first words of the two comment lines ``--write`` puts above the entries.
_OUR_COMMENTS = ("# mpgen place --write:", "# shortest form:")


@dataclass(frozen=True)
class _Comments:
    """The comments of an explicit block: the lines above each entry (by its
    key, in the block's order) and the comment after it on its line. Those
    below the last entry are outside the block, and stay where they are."""

    above: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    after: Mapping[str, str] = field(default_factory=dict)


def _old_comments(text: str, key, value, content_end: int) -> _Comments:
    """The comments of a block-style explicit placement, to keep with the keys
    ``--write`` keeps; a comment above an entry whose key goes moves down to
    the next one kept (``--write``'s own two lines are written afresh)."""
    if not isinstance(value, yaml.MappingNode) or value.flow_style:
        return _Comments()
    entries = {k.start_mark.line: (k.value, v) for k, v in value.value}
    lines = text.splitlines()
    last = text.count("\n", 0, content_end)
    above: dict[str, tuple[str, ...]] = {}
    after: dict[str, str] = {}
    pending: list[str] = []
    for number in range(key.start_mark.line + 1, last + 1):
        line = lines[number].strip()
        if number in entries:
            name, node = entries[number]
            above[name] = tuple(pending)
            pending = []
            if node.end_mark.line == number:
                rest = text[node.end_mark.index:_line_end(text, node.end_mark.index)]
                if rest.strip().startswith("#"):
                    after[name] = rest.rstrip()
        elif line.startswith("#") and not line.startswith(_OUR_COMMENTS):
            pending.append(line)
    return _Comments(above, after)


def _entry_lines(entries: Sequence[tuple[str, str]], indent: str) -> list[str]:
    return [f"{indent}{_yaml_key(key)}: {device}" for key, device in entries]


def _written_lines(placed: Placed, indent: str, old_lines: list[str],
                   comments: _Comments) -> list[str]:
    """The comment saying how the layout and its form were chosen, then the
    entries with the old block's comments of the keys kept."""
    origin = placed.graph.layout.method
    notes = [n for n in (placed.bottleneck, placed.renamed) if n]
    if placed.auto:
        choice = placed.graph.layout.auto
        notes.insert(0, f"balance {choice.request.balance} over {len(choice.devices)} devices")
    n = len(placed.shortest)
    if n == 0:
        form = f"the default (no entries: every layer on {DEFAULT_DEVICE})"
    else:
        runs = len(device_runs([d for node in placed.graph.nodes for d in node.devices]))
        form = f"{n} bookmark{'s' if n > 1 else ''}, one per device run"
        if n > runs:  # inside a split instance, a layer off the instance's device
            form = (f"{n} bookmarks, one per device run and per layer of a split block "
                    "instance placed apart from it")
        if placed.kept:
            form += f", keeping {placed.kept} key{'s' if placed.kept > 1 else ''} of the old block"
    replaced = placed.auto and old_lines
    lines = [f"{_OUR_COMMENTS[0]} {origin}" + (f" ({'; '.join(notes)})" if notes else "") + ",",
             f"{_OUR_COMMENTS[1]} {form}" + ("; it replaced:" if replaced else "")]
    if replaced:
        lines.extend(f"#   {line}".rstrip() for line in old_lines)
    kept = {key for key, _ in placed.shortest}
    above: dict[str, list[str]] = {}
    carried: list[str] = []  # the comments above entries that go, for the next one kept
    for key, comment_lines in comments.above.items():
        carried.extend(comment_lines)
        if key in kept:
            above[key], carried = carried, []
    for (key, _), entry in zip(placed.shortest, _entry_lines(placed.shortest, "")):
        lines.extend(above.get(key, ()))
        lines.append(entry + comments.after.get(key, ""))
    lines.extend(carried)
    return [f"{indent}{line}" for line in lines]


def _yaml_key(key: str) -> str:
    try:
        plain = yaml.safe_load(f"{key}: x")
    except yaml.YAMLError:
        plain = None
    if isinstance(plain, dict) and list(plain) == [key]:
        return key
    return "'" + key.replace("'", "''") + "'"


def _find_placement(text: str, name: str):
    """``(key node, value node)`` of the top-level ``placement``, or None."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:  # compile_spec has read it: not expected
        raise MpgenError(Position(name, 1, 1), f"invalid YAML: {exc}") from None
    if not isinstance(root, yaml.MappingNode):
        raise MpgenError(Position(name, 1, 1), "spec is not a mapping")
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "placement":
            if root.flow_style:
                raise MpgenError(_pos(name, key), "placement: cannot rewrite a spec written as "
                                 "one flow mapping ({...}); write the explicit form by hand")
            return key, value
    if root.flow_style:
        raise MpgenError(Position(name, 1, 1), "placement: cannot add a block to a spec written "
                         "as one flow mapping ({...}); write the explicit form by hand")
    return None


def _content_end(node) -> int:
    """Index just after the last character of ``node``'s own text."""
    if isinstance(node, yaml.ScalarNode) or node.flow_style:
        return node.end_mark.index
    children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else list(node.value))
    return max((_content_end(c) for c in children), default=node.start_mark.index)


def _line_end(text: str, index: int) -> int:
    """Index of the end of the line holding ``index`` (before its \\r\\n or \\n)."""
    end = text.find("\n", index)
    if end < 0:
        return len(text)
    return end - 1 if end > 0 and text[end - 1] == "\r" else end


def _dedent(lines: list[str]) -> list[str]:
    body = [line for line in lines if line.strip()]
    if not body:
        return []
    first_is_inline = bool(lines) and not lines[0][:1].isspace()
    rest = body[1:] if first_is_inline else body
    cut = min((len(line) - len(line.lstrip(" ")) for line in rest), default=0)
    return [line if (first_is_inline and i == 0) else line[cut:]
            for i, line in enumerate(lines)]


def _indent(text: str, found) -> str:
    """The indentation step the spec uses (from the placement block, else layers)."""
    if found is not None:
        value = found[1]
        if isinstance(value, yaml.MappingNode) and not value.flow_style and value.start_mark.column:
            return " " * value.start_mark.column
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return "  "
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if (isinstance(value, yaml.MappingNode) and not value.flow_style
                    and value.start_mark.column > key.start_mark.column):
                return " " * (value.start_mark.column - key.start_mark.column)
    return "  "


def _pos(name: str, node) -> Position:
    return Position(name, node.start_mark.line + 1, node.start_mark.column + 1)
