"""Exact contiguous partitioning of layer units onto an ordered device list.

Automatic placement splits the ordered units of a model (a layer, one block
instance, one instance of a repeated layer -- never split further) into
contiguous *stages*; stage ``k`` runs on device ``k``.  :func:`partition`
returns the split that is optimal for the lexicographic objective

1. the smallest bottleneck ``max_k load_k`` with
   ``load_k = sum(costs in stage k) / speed[k]``;
2. among those, the smallest total cut cost of the boundaries used;
3. among those, the lexicographically *largest* ``bounds`` (every device in
   order takes as many units as it can without worsening 1 or 2; trailing
   devices are the ones left empty).

The result is exact (no tolerances): see ``docs/partition.md`` for the
algorithm and the precise float semantics.  :func:`greedy_fill` is the
HF-Accelerate-style baseline the benchmarks compare against.

Pure Python, stdlib only.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections import deque
from typing import Optional, Sequence

from mpgen.compiler.ir import Partition

__all__ = ["Partition", "PartitionError", "partition", "greedy_fill", "stage_load"]

_INF = float("inf")
_EXACT_FLOAT_INT = 2**53  # integers up to this are exact in a double


class PartitionError(ValueError):
    """No placement satisfies the device capacities.

    ``unit`` is the index of the first unit that cannot be placed and
    ``reason`` a plain sentence (without the unit) the caller can format,
    e.g. ``"needs 5e+09 but the largest remaining capacity is 4e+09"``.
    """

    def __init__(self, unit: int, reason: str, *, need: float = 0.0,
                 room: Optional[float] = None, room_kind: str = "capacity"):
        super().__init__(f"unit {unit}: {reason}")
        self.unit = unit
        self.reason = reason
        #: The unit's memory, and the most room any device had left for it
        #: (None: it fits, but only by leaving a later device empty).
        #: ``room_kind`` says which room: "capacity" (of an empty device),
        #: "remaining capacity", or "capacity left on the last device".
        self.need = need
        self.room = room
        self.room_kind = room_kind


# --------------------------------------------------------------------------
# exact number handling


def _ratio(x, what: str, index: int) -> tuple[int, int]:
    """``x`` as an exact ``(numerator, power-of-two denominator)``; x >= 0."""
    if isinstance(x, bool):
        raise ValueError(f"{what}[{index}] must be a number, got {x!r}")
    if isinstance(x, numbers.Integral):
        v = int(x)
        if v < 0:
            raise ValueError(f"{what}[{index}] must be >= 0, got {v}")
        return v, 1
    try:
        f = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{what}[{index}] must be a number, got {x!r}") from None
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{what}[{index}] must be finite and >= 0, got {x!r}")
    return (f + 0.0).as_integer_ratio()  # + 0.0 turns -0.0 into 0.0


def _scaled(values: Sequence, what: str) -> tuple[list[int], int]:
    """Exact integers ``ints`` and a power of two ``scale`` with
    ``values[i] == ints[i] / scale`` exactly."""
    ratios = [_ratio(v, what, i) for i, v in enumerate(values)]
    scale = max((d for _, d in ratios), default=1)
    return [num * (scale // den) for num, den in ratios], scale


class _Prefix:
    """Prefix sums of non-negative numbers with exact range sums.

    ``sum(a, b)`` is the exact real sum of ``values[a:b]`` rounded once to
    the nearest double (what :func:`math.fsum` returns).  ``p`` and ``d`` are
    exposed so hot loops can inline ``(p[b] - p[a]) / d``: when every prefix
    sum is a small enough multiple of ``1 / scale`` the prefixes are stored
    as doubles whose differences are exact (``d == 1``); otherwise they are
    Python ints and ``d`` is the scale (int / int true division rounds
    correctly).
    """

    def __init__(self, values: Sequence, what: str):
        ints, scale = _scaled(values, what)
        acc = 0
        pre = [0]
        for v in ints:
            acc += v
            pre.append(acc)
        self.ints = ints
        self.iprefix = pre  # exact
        self.scale = scale
        if acc <= _EXACT_FLOAT_INT:
            # every prefix is k / scale with k <= 2**53 and scale <= 2**1074,
            # a double; so is the difference of two of them.
            self.p = [v / scale for v in pre]
            self.d = 1
            self.floats = True
        else:
            self.p = pre
            self.d = scale
            self.floats = False

    def sum(self, a: int, b: int) -> float:
        return (self.p[b] - self.p[a]) / self.d


def stage_load(
    costs: Sequence[float], start: int, stop: int, speed: float = 1.0
) -> float:
    """The load :func:`partition` assigns to a stage holding ``costs[start:stop]``
    on a device of the given speed: the exact sum of those costs rounded once
    to a double (what ``math.fsum`` gives for float costs), then divided by
    ``speed`` (one more rounding)."""
    ints, scale = _scaled(list(costs[start:stop]), "costs")
    return sum(ints) / scale / float(speed)


def _to_float(num: int, den: int) -> float:
    try:
        return num / den
    except OverflowError:
        return _INF


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _unbits(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


# --------------------------------------------------------------------------
# the solver


class _Problem:
    """Validated inputs plus the stage rules shared by every pass."""

    def __init__(self, costs, devices, cut_cost, speed, capacity, memory, use_all):
        try:
            d = int(devices)
        except (TypeError, ValueError):
            raise ValueError(f"devices must be an integer, got {devices!r}") from None
        if isinstance(devices, bool) or d != devices or d < 1:
            raise ValueError(f"devices must be an integer >= 1, got {devices!r}")
        costs = list(costs)
        n = len(costs)
        self.n, self.d, self.use_all = n, d, bool(use_all)
        self.cost = _Prefix(costs, "costs")

        if speed is None:
            self.speed = [1.0] * d
        else:
            speed = list(speed)
            if len(speed) != d:
                raise ValueError(f"speed has {len(speed)} entries for {d} devices")
            self.speed = []
            for k, s in enumerate(speed):
                try:
                    s = float(s)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"speed[{k}] must be a number, got {s!r}"
                    ) from None
                if not (math.isfinite(s) and s > 0):
                    raise ValueError(f"speed[{k}] must be finite and > 0, got {s!r}")
                self.speed.append(s)

        if cut_cost is None:
            cut_ints, self.cut_scale = [0] * max(n - 1, 0), 1
        else:
            cut_cost = list(cut_cost)
            if len(cut_cost) != max(n - 1, 0):
                raise ValueError(
                    f"cut_cost has {len(cut_cost)} entries, expected {max(n - 1, 0)} "
                    f"(one per boundary between {n} units)"
                )
            cut_ints, self.cut_scale = _scaled(cut_cost, "cut_cost")
        # cutw[b]: exact scaled cost of a boundary at position b (between
        # units b - 1 and b); positions 0 and n are free.
        self.cutw = [0] + cut_ints + [0] if n >= 1 else [0]

        # capacities: None = unlimited.  cap_cmp[k] is what the stage memory
        # prefix difference mem.p[b] - mem.p[a] is compared with; both sides
        # are exact, so the test is "exact memory sum <= capacity".
        self.capacity: list[Optional[float]] = [None] * d  # for messages
        self.cap_cmp: list = [None] * d
        self.mem: Optional[_Prefix] = None
        if memory is not None:
            memory = list(memory)
            if len(memory) != n:
                raise ValueError(f"memory has {len(memory)} entries for {n} units")
        if capacity is not None:
            capacity = list(capacity)
            if len(capacity) != d:
                raise ValueError(
                    f"capacity has {len(capacity)} entries for {d} devices"
                )
            caps: list = []
            for k, c in enumerate(capacity):
                if c is None:
                    caps.append(None)
                elif isinstance(c, numbers.Integral) and not isinstance(c, bool):
                    if c < 0:
                        raise ValueError(
                            f"capacity[{k}] must be >= 0 or None, got {c!r}"
                        )
                    caps.append((int(c), 1))
                else:
                    try:
                        cf = float(c)
                    except (TypeError, ValueError):
                        raise ValueError(
                            f"capacity[{k}] must be a number or None, got {c!r}"
                        ) from None
                    if math.isnan(cf) or cf < 0 or isinstance(c, bool):
                        raise ValueError(
                            f"capacity[{k}] must be >= 0 or None, got {c!r}"
                        )
                    caps.append(None if cf == _INF else (cf + 0.0).as_integer_ratio())
            if any(c is not None for c in caps):
                self.mem = self.cost if memory is None else _Prefix(memory, "memory")
                for k, c in enumerate(caps):
                    if c is None:
                        continue
                    num, den = c
                    self.capacity[k] = _to_float(num, den)
                    if self.mem.floats:
                        # float prefixes: exact multiples of 1/scale, at most
                        # 2**53/scale; a capacity rounded to a double keeps
                        # every comparison with them (exact when it is one).
                        self.cap_cmp[k] = self.capacity[k]
                    else:
                        # integer prefixes: sum <= num/den * scale exactly
                        self.cap_cmp[k] = (num * self.mem.scale) // den
        if memory is not None and self.mem is None:
            _scaled(memory, "memory")  # validate only

        # stage rules.  With use_all the first m = min(n, d) stages must be
        # non-empty and the rest empty; stage k may end no later than
        # bmax[k] so the later non-empty stages still get a unit each.
        m = min(n, d)
        self.m = m
        self.nonempty = [use_all and k < m for k in range(d)]
        self.mustempty = [use_all and k >= m for k in range(d)]
        self.bmax = [n - (m - k - 1) if (use_all and k < m) else n for k in range(d)]

    # one stage [a, b) on device k fits under threshold t?  (used outside the
    # hot loops; the hot loops inline exactly the same expressions)
    def ok(self, a: int, b: int, k: int, t: float) -> bool:
        c = self.cost
        if (c.p[b] - c.p[a]) / c.d / self.speed[k] > t:
            return False
        cap = self.cap_cmp[k]
        return cap is None or self.mem.p[b] - self.mem.p[a] <= cap

    def load(self, a: int, b: int, k: int) -> float:
        c = self.cost
        return (c.p[b] - c.p[a]) / c.d / self.speed[k]

    # ------------------------------------------------------------------
    # pass 1: feasibility of a threshold

    def reach(self, t: float, keep: bool = False):
        """Reachable boundaries: R[k] = sorted positions a such that units
        [0, a) can be placed on devices 0..k-1 with every stage load <= t,
        within capacity and following the stage rules.  Returns True/False,
        or the list of all R[k] when ``keep``."""
        n, d = self.n, self.d
        P, D = self.cost.p, self.cost.d
        M = self.mem.p if self.mem is not None else None
        R = [0]
        out = [R] if keep else None
        for k in range(d):
            if self.mustempty[k]:
                new = R
            else:
                s = self.speed[k]
                cap = self.cap_cmp[k]
                bmax = self.bmax[k]
                new = []
                push = new.append
                nonempty = self.nonempty[k]
                last = len(R) - 1
                # For each b the best predecessor is the largest reachable
                # a before it (a shorter stage is never worse), so each a
                # only extends up to the next reachable position.
                for i, a in enumerate(R):
                    if nonempty:
                        b = a + 1
                        stop = R[i + 1] if i < last else n
                    else:
                        push(a)
                        b = a + 1
                        stop = R[i + 1] - 1 if i < last else n
                    if stop > bmax:
                        stop = bmax
                    pa = P[a]
                    if cap is None:
                        while b <= stop and (P[b] - pa) / D / s <= t:
                            push(b)
                            b += 1
                    else:
                        ma = M[a]
                        while (
                            b <= stop and (P[b] - pa) / D / s <= t and M[b] - ma <= cap
                        ):
                            push(b)
                            b += 1
                if not new:
                    if keep:
                        out.extend([[]] * (d - k))
                        return out
                    return False
            R = new
            if keep:
                out.append(R)
        if keep:
            return out
        return R[-1] == n

    # ------------------------------------------------------------------
    # pass 2: minimum cut under a threshold, lexicographically largest bounds

    def min_cut(self, t: float) -> tuple[list[int], int]:
        n, d = self.n, self.d
        P, D = self.cost.p, self.cost.d
        M = self.mem.p if self.mem is not None else None
        cutw = self.cutw
        # h[k][a]: least exact cut sum placing units [a, n) on devices k..d-1
        h_next = [_INF] * (n + 1)
        h_next[n] = 0
        hs = [h_next]
        for k in reversed(range(d)):
            if self.mustempty[k]:
                hs.append(h_next)
                continue
            s = self.speed[k]
            cap = self.cap_cmp[k]
            bmax = self.bmax[k]
            nonempty = self.nonempty[k]
            w = [cutw[b] + h_next[b] for b in range(n + 1)]
            h = [_INF] * (n + 1)
            win: deque = deque()  # indices b, increasing w
            hi = 0  # largest b pushed so far
            for a in range(n + 1):
                if hi < a:
                    hi = a
                pa = P[a]
                ma = M[a] if cap is not None else 0
                while (
                    hi < bmax
                    and (P[hi + 1] - pa) / D / s <= t
                    and (cap is None or M[hi + 1] - ma <= cap)
                ):
                    hi += 1
                    wb = w[hi]
                    while win and w[win[-1]] >= wb:
                        win.pop()
                    win.append(hi)
                while win and win[0] <= a:
                    win.popleft()
                best = w[win[0]] if win else _INF
                if not nonempty and h_next[a] < best:
                    best = h_next[a]
                h[a] = best
            hs.append(h)
            h_next = h
        hs.reverse()  # hs[k] for k = 0..d
        if hs[0][0] == _INF:
            raise AssertionError("threshold infeasible in min_cut")  # pragma: no cover

        bounds = [0]
        a = 0
        for k in range(d):
            target = hs[k][a]
            nxt = hs[k + 1]
            if self.mustempty[k]:
                bounds.append(a)
                continue
            b = a
            while b < self.bmax[k] and self.ok(a, b + 1, k, t):
                b += 1
            lo = a + 1 if self.nonempty[k] else a
            while b >= lo:
                val = nxt[b] if b == a else cutw[b] + nxt[b]
                if val == target:
                    break
                b -= 1
            else:  # pragma: no cover
                raise AssertionError("reconstruction failed")
            bounds.append(b)
            a = b
        return bounds, hs[0][0]

    # ------------------------------------------------------------------
    # capacity diagnostics

    def infeasible(self) -> PartitionError:
        n, d = self.n, self.d
        mem = self.mem
        finite = [c for c in self.capacity if c is not None]
        if len(finite) == d:
            top = max(finite)
            for i in range(n):
                if not any(
                    mem.p[i + 1] - mem.p[i] <= self.cap_cmp[k] for k in range(d)
                ):
                    need = mem.sum(i, i + 1)
                    return PartitionError(
                        i, f"needs {need:.4g} but the largest capacity is {top:.4g}",
                        need=need, room=top, room_kind="capacity",
                    )
        Rs = self.reach(_INF, keep=True)
        p = max((R[-1] for R in Rs if R), default=0)
        if p >= n:  # pragma: no cover - reach() said infeasible
            raise AssertionError("capacity diagnostics found no culprit")
        # Unit p fits nowhere after any placeable prefix [0, a) -- or only
        # where use_all's reservation forbids it.  Report the most room any
        # such device had left for it.
        need = mem.sum(p, p + 1)
        fits = False
        room = 0.0
        for k in range(d):
            if self.mustempty[k]:
                continue
            cap = self.cap_cmp[k]
            for a in Rs[k]:
                if a > p:
                    break
                if cap is None:
                    fits, room = True, _INF
                    break
                if mem.p[p + 1] - mem.p[a] <= cap:
                    fits = True
                if mem.p[p] - mem.p[a] <= cap:
                    room = max(room, self.capacity[k] - mem.sum(a, p))
        if fits:
            reason = (
                f"needs {need:.4g}; it fits only where the devices after it could no "
                f"longer each get a unit (use_all=True)"
            )
            return PartitionError(p, reason, need=need, room=None)
        reason = f"needs {need:.4g} but the largest remaining capacity is {room:.4g}"
        return PartitionError(p, reason, need=need, room=room,
                              room_kind="remaining capacity")

    def result(self, bounds: Sequence[int], cut_int: Optional[int] = None) -> Partition:
        loads = tuple(self.load(bounds[k], bounds[k + 1], k) for k in range(self.d))
        if cut_int is None:
            cut_int = sum(
                self.cutw[bounds[k + 1]]
                for k in range(self.d)
                if bounds[k + 1] > bounds[k]
            )
        return Partition(
            bounds=tuple(bounds),
            loads=loads,
            bottleneck=max(loads),
            cut_bytes=cut_int / self.cut_scale,
        )


def partition(
    costs: Sequence[float],
    devices: int,
    *,
    cut_cost: Sequence[float] | None = None,
    speed: Sequence[float] | None = None,
    capacity: Sequence[float | None] | None = None,
    memory: Sequence[float] | None = None,
    use_all: bool = True,
) -> Partition:
    """Optimal contiguous split of ``costs`` over ``devices`` ordered devices.

    Args:
        costs: ``costs[i] >= 0`` is the balanced quantity of unit ``i``.
        devices: number of devices (stages), ``>= 1``.
        cut_cost: ``cut_cost[j] >= 0`` is the cost of a boundary between
            units ``j`` and ``j + 1`` (``n - 1`` entries; default all 0).
        speed: per-device divisor of the load (default 1.0 each).
        capacity: per-device bound on the summed ``memory`` of its stage
            (``None`` or ``inf`` = unlimited).
        memory: per-unit memory for ``capacity`` (default: ``costs``).
        use_all: every device gets at least one unit when ``n >= devices``;
            when ``n < devices`` devices ``0..n-1`` get one unit each and the
            rest stay empty.  With ``use_all=False`` any stage may be empty.

    Returns:
        the :class:`Partition` minimising (bottleneck, cut total) and, among
        ties, with the lexicographically largest ``bounds``.

    Raises:
        PartitionError: no placement fits the capacities; ``.unit`` is the
            first unit whose memory exceeds every capacity, else the first
            unit past the longest prefix that can be placed at all.
        ValueError: malformed arguments.
    """
    pb = _Problem(costs, devices, cut_cost, speed, capacity, memory, use_all)
    n, d = pb.n, pb.d
    if n == 0:
        return pb.result([0] * (d + 1), 0)

    if not pb.reach(_INF):
        raise pb.infeasible()

    # Bracket the optimum: any stage holding unit i loads device k with at
    # least load(i, i+1, k), so lo is a lower bound; any stage loads its
    # device at most as much as the whole model would, so hi is feasible.
    lo = max(min(pb.load(i, i + 1, k) for k in range(d)) for i in range(n))
    hi = max(pb.load(0, n, k) for k in range(d))
    # The optimum is the smallest double t with reach(t) true (it is one of
    # the stage loads).  Non-negative doubles order like their bit patterns,
    # so bisect on those: at most 64 feasibility passes, each O(n * d).
    lo_b, hi_b = _bits(lo), _bits(hi)
    while lo_b < hi_b:
        mid = (lo_b + hi_b) // 2
        if pb.reach(_unbits(mid)):
            hi_b = mid
        else:
            lo_b = mid + 1
    best = _unbits(hi_b)

    bounds, cut_int = pb.min_cut(best)
    res = pb.result(bounds, cut_int)
    assert res.bottleneck == best, (res.bottleneck, best)
    return res


def greedy_fill(
    costs: Sequence[float],
    devices: int,
    capacity: Sequence[float | None] | None = None,
    *,
    memory: Sequence[float] | None = None,
    cut_cost: Sequence[float] | None = None,
) -> Partition:
    """The HF-Accelerate-style baseline: fill devices in order.

    Each device ``k`` in turn takes the next units while adding the next one
    keeps it within its budget, then the next device starts:

    * with a capacity (``capacity[k]`` not None) the budget is that
      capacity, compared with the stage's summed ``memory`` (default
      ``costs``); it is hard: a unit that does not fit moves on, even if the
      device stays empty, and units left after the last device raise
      :class:`PartitionError`;
    * without one the budget is ``total / devices`` (total of ``costs``),
      soft: an empty device always takes its first unit, and the last device
      takes every remaining unit.

    Sums are compared exactly.  Loads use speed 1.0; ``cut_bytes`` uses
    ``cut_cost`` when given.
    """
    pb = _Problem(costs, devices, cut_cost, None, capacity, memory, False)
    n, d = pb.n, pb.d
    ints = pb.cost.ints
    total = pb.cost.iprefix[n]
    bounds = [0]
    i = 0
    for k in range(d):
        cap = pb.cap_cmp[k]
        last = k == d - 1
        if cap is None:
            if last:
                i = n
            else:
                acc = 0
                while i < n and (i == bounds[-1] or (acc + ints[i]) * d <= total):
                    acc += ints[i]
                    i += 1
        else:
            M = pb.mem.p
            a = i
            while i < n and M[i + 1] - M[a] <= cap:
                i += 1
        bounds.append(i)
    if i < n:
        start = bounds[-2]
        need = pb.mem.sum(i, i + 1)
        room = pb.capacity[d - 1] - pb.mem.sum(start, i)
        raise PartitionError(
            i,
            f"needs {need:.4g} but the last device has {max(room, 0.0):.4g} left "
            f"(greedy fill)",
            need=need, room=max(room, 0.0), room_kind="capacity left on the last device",
        )
    return pb.result(bounds)
