"""Tests for mpgen.compiler.placement.partition: exactness against brute force."""

from __future__ import annotations

import itertools
import math
import random
import time
from fractions import Fraction

import pytest

from mpgen.compiler.placement.partition import (
    Partition,
    PartitionError,
    greedy_fill,
    partition,
    stage_load,
)

GPT2_SMALL = [38_597_376, 786_432] + [7_087_872] * 12 + [1_536, 38_597_376]


# --------------------------------------------------------------------------
# an independent brute force (exact rationals throughout)


def _frac(x) -> Fraction:
    return Fraction(x)


def _all_bounds(n: int, d: int):
    for inner in itertools.combinations_with_replacement(range(n + 1), d - 1):
        yield (0,) + inner + (n,)


def _stage_rules_ok(bounds, n, d, use_all, upto=None):
    """use_all: the first min(n, d) stages non-empty, the rest empty; a
    partial placement (upto stages) must leave a unit for each later
    non-empty stage."""
    if not use_all:
        return True
    m = min(n, d)
    stages = len(bounds) - 1 if upto is None else upto
    for k in range(stages):
        size = bounds[k + 1] - bounds[k]
        if k < m and size == 0:
            return False
        if k >= m and size != 0:
            return False
        if k < m and bounds[k + 1] > n - (m - k - 1):
            return False
    return True


def _mem_ok(bounds, mem, capacity):
    if capacity is None:
        return True
    for k in range(len(bounds) - 1):
        cap = capacity[k]
        if cap is None:
            continue
        if sum((_frac(x) for x in mem[bounds[k] : bounds[k + 1]]), Fraction(0)) > _frac(
            cap
        ):
            return False
    return True


def _load(costs, a, b, s):
    return float(sum((_frac(x) for x in costs[a:b]), Fraction(0))) / s


def _cut(bounds, n, cut_cost):
    used = sorted({b for b in bounds if 0 < b < n})
    return sum((_frac(cut_cost[b - 1]) for b in used), Fraction(0))


def brute(
    costs, d, cut_cost=None, speed=None, capacity=None, memory=None, use_all=True
):
    """(bounds, bottleneck, exact cut) of the optimum, or ('error', unit)."""
    n = len(costs)
    speed = speed or [1.0] * d
    cut_cost = cut_cost if cut_cost is not None else [0] * max(n - 1, 0)
    mem = costs if memory is None else memory
    best = None
    for bounds in _all_bounds(n, d):
        if not _stage_rules_ok(bounds, n, d, use_all) or not _mem_ok(
            bounds, mem, capacity
        ):
            continue
        loads = [
            _load(costs, bounds[k], bounds[k + 1], float(speed[k])) for k in range(d)
        ]
        key = (max(loads), _cut(bounds, n, cut_cost), tuple(-b for b in bounds))
        if best is None or key < best[0]:
            best = (key, bounds)
    if best is not None:
        return best[1], best[0][0], best[0][1]
    # infeasible: a unit over every capacity, else the end of the longest
    # placeable prefix
    if capacity is not None and all(c is not None for c in capacity):
        for i, x in enumerate(mem):
            if all(_frac(x) > _frac(c) for c in capacity):
                return "error", i
    p = 0
    for k in range(1, d + 1):
        for inner in itertools.combinations_with_replacement(range(n + 1), k):
            bounds = (0,) + inner
            if _stage_rules_ok(bounds, n, d, use_all, upto=k) and _mem_ok(
                bounds, mem, capacity
            ):
                p = max(p, bounds[-1])
    return "error", p


def _check(costs, d, **kw):
    want = brute(costs, d, **kw)
    if want[0] == "error":
        with pytest.raises(PartitionError) as exc:
            partition(costs, d, **kw)
        assert exc.value.unit == want[1], (costs, d, kw, exc.value)
        return None
    got = partition(costs, d, **kw)
    bounds, bottleneck, cut = want
    assert got.bottleneck == bottleneck, (costs, d, kw, got, want)
    assert got.cut_bytes == float(cut), (costs, d, kw, got, want)
    assert got.bounds == bounds, (costs, d, kw, got, want)
    # the returned partition realises what it claims
    speed = kw.get("speed") or [1.0] * d
    n = len(costs)
    assert got.bounds[0] == 0 and got.bounds[-1] == n and len(got.bounds) == d + 1
    assert all(a <= b for a, b in zip(got.bounds, got.bounds[1:]))
    loads = tuple(
        _load(costs, got.bounds[k], got.bounds[k + 1], float(speed[k]))
        for k in range(d)
    )
    assert got.loads == loads
    assert got.bottleneck == max(loads)
    mem = costs if kw.get("memory") is None else kw["memory"]
    assert _mem_ok(got.bounds, mem, kw.get("capacity"))
    assert _stage_rules_ok(got.bounds, n, d, kw.get("use_all", True))
    cut_cost = kw.get("cut_cost") or [0] * max(n - 1, 0)
    assert got.cut_bytes == float(_cut(got.bounds, n, cut_cost))
    return got


def _random_values(rng: random.Random, n: int) -> list:
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randint(0, 5) for _ in range(n)]  # many ties and zeros
    if kind == 1:
        return [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
    if kind == 2:
        return [rng.choice([0.1, 0.2, 0.3, 0.7, 1.1]) for _ in range(n)]  # rounding
    if kind == 3:
        return [
            rng.choice([1e16, 1.0, 3.0, 0.5, 2.0**-40]) for _ in range(n)
        ]  # sums > 2**53
    if kind == 4:
        return [rng.randint(0, 2**62) for _ in range(n)]  # ints beyond doubles
    return [float(rng.randint(1, 100)) for _ in range(n)]


def _random_case(rng: random.Random):
    n = rng.randint(0, 9)
    d = rng.randint(1, 4)
    costs = _random_values(rng, n)
    kw: dict = {"use_all": rng.random() < 0.6}
    if rng.random() < 0.6:
        kw["speed"] = [
            rng.choice([1.0, 2.0, 0.5, 3.0, 0.1, rng.uniform(0.2, 5)]) for _ in range(d)
        ]
    if rng.random() < 0.6 and n >= 1:
        kw["cut_cost"] = [
            rng.choice([0, 1, 2, 5, rng.random(), 0.1]) for _ in range(n - 1)
        ]
    if rng.random() < 0.5:
        mem = costs if rng.random() < 0.5 else _random_values(rng, n)
        if mem is not costs:
            kw["memory"] = mem
        total = float(sum((_frac(x) for x in mem), Fraction(0)))
        caps = []
        for _ in range(d):
            r = rng.random()
            if r < 0.2:
                caps.append(None)
            elif r < 0.3:
                caps.append(0.0)
            elif r < 0.6 and n:
                # exactly the memory of some slice: equality must fit
                a = rng.randrange(n)
                b = rng.randint(a + 1, n)
                exact = sum((_frac(x) for x in mem[a:b]), Fraction(0))
                caps.append(int(exact) if exact.denominator == 1 else float(exact))
            else:
                caps.append(total * rng.choice([0.1, 0.25, 0.4, 0.5, 0.7, 1.0]))
        kw["capacity"] = caps
    return costs, d, kw


# --------------------------------------------------------------------------


@pytest.mark.slow
def test_brute_force_random():
    rng = random.Random(20240611)
    errors = ok = 0
    for _ in range(2500):
        costs, d, kw = _random_case(rng)
        if _check(costs, d, **kw) is None:
            errors += 1
        else:
            ok += 1
    assert errors > 100 and ok > 1500  # both branches were exercised


def test_brute_force_float_ties():
    # loads that tie only up to rounding, cut costs that tie exactly
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 9)
        d = rng.randint(1, 4)
        costs = [rng.choice([0.1, 0.2, 0.3, 0.6]) for _ in range(n)]
        kw = {
            "cut_cost": [rng.choice([0.1, 0.2, 0.3]) for _ in range(n - 1)],
            "speed": [rng.choice([0.1, 0.3, 1.0, 3.0]) for _ in range(d)],
            "use_all": rng.random() < 0.5,
        }
        _check(costs, d, **kw)


def test_torchgpipe_counterexample():
    costs = [50] + [10] * 24 + [50]
    p = partition(costs, 4)
    assert p.bottleneck == 90
    assert p.bounds == (0, 5, 14, 23, 26)
    assert p.loads == (90.0, 90.0, 90.0, 70.0)


def test_gpt2_small():
    p = partition(GPT2_SMALL, 4)
    assert p.bottleneck == 42_527_232
    assert p.bounds == (0, 2, 8, 14, 16)
    want = brute(GPT2_SMALL, 4)
    assert want[1] == 42_527_232 and want[0] == p.bounds

    g = greedy_fill(GPT2_SMALL, 4)
    # total/4 = 40,759,296: wte+wpe | 5 blocks | 5 blocks | 2 blocks + ln + head
    assert g.bounds == (0, 2, 7, 12, 16)
    assert g.bottleneck == 52_774_656
    assert g.bottleneck > p.bottleneck


def test_speed_weighted():
    p = partition([4, 4, 4, 4], 2, speed=[3.0, 1.0])
    assert p.bounds == (0, 3, 4)
    assert p.loads == (4.0, 4.0)
    # a slow first device gets less
    p = partition([4, 4, 4, 4], 2, speed=[1.0, 3.0])
    assert p.bounds == (0, 1, 4)
    assert p.bottleneck == 4.0
    _check([4, 4, 4, 4], 2, speed=[3.0, 1.0])


def test_fewer_units_than_devices():
    p = partition([3, 1, 2], 5)
    assert p.bounds == (0, 1, 2, 3, 3, 3)
    assert p.loads == (3.0, 1.0, 2.0, 0.0, 0.0)
    assert p.bottleneck == 3.0
    # use_all=False: fewer, bigger stages when the bottleneck allows and it
    # saves cuts; trailing devices stay empty
    p = partition([3, 1, 2], 5, cut_cost=[7, 1], use_all=False)
    assert p.bounds == (0, 1, 3, 3, 3, 3)
    assert p.cut_bytes == 7.0
    assert partition([], 3).bounds == (0, 0, 0, 0)
    assert partition([], 3).bottleneck == 0.0


def test_use_all_false_avoids_cuts():
    kw = dict(cut_cost=[10, 1])
    p = partition([1, 1, 4], 3, **kw)
    assert p.bounds == (0, 1, 2, 3) and p.cut_bytes == 11.0 and p.bottleneck == 4.0
    p = partition([1, 1, 4], 3, use_all=False, **kw)
    assert p.bounds == (0, 2, 3, 3) and p.cut_bytes == 1.0 and p.bottleneck == 4.0
    _check([1, 1, 4], 3, use_all=False, **kw)


def test_cut_cost_breaks_bottleneck_ties():
    # bottleneck 2 either way; the cheap boundary wins
    p = partition([1, 1, 1, 1], 2, cut_cost=[0, 5, 0], use_all=True)
    assert p.bottleneck == 2.0
    # splits (0,2,4) load 2/2 cut 5; (0,1,4) load 1/3 -> worse bottleneck
    assert p.bounds == (0, 2, 4) and p.cut_bytes == 5.0
    p = partition([2, 1, 1, 2], 3, cut_cost=[1, 9, 1])
    assert p.bounds == (0, 1, 3, 4) and p.cut_bytes == 2.0


def test_tie_break_lexicographically_largest():
    # (0,2,3) and (0,1,3)? loads 2/1 vs 1/2: both bottleneck 2, no cuts
    p = partition([1, 1, 1], 2)
    assert p.bounds == (0, 2, 3)
    p = partition([0, 0, 5, 0, 0], 2)
    assert p.bounds == (0, 4, 5)


def test_deterministic():
    rng = random.Random(3)
    costs = [rng.random() for _ in range(200)]
    cut = [rng.choice([1.0, 2.0]) for _ in range(199)]
    first = partition(costs, 6, cut_cost=cut)
    for _ in range(3):
        assert partition(list(costs), 6, cut_cost=list(cut)) == first
        assert partition(tuple(costs), 6, cut_cost=tuple(cut)) == first


def test_capacity_single_unit_too_big():
    with pytest.raises(PartitionError) as exc:
        partition([1, 2, 11, 1, 12], 2, capacity=[10, 8])
    assert exc.value.unit == 2
    assert isinstance(exc.value, ValueError)
    assert exc.value.reason == "needs 11 but the largest capacity is 10"


def test_capacity_prefix_culprit():
    # each unit fits somewhere but only [0, 3) can be placed in order
    with pytest.raises(PartitionError) as exc:
        partition([4, 4, 4, 4, 4], 2, capacity=[8, 5])
    assert exc.value.unit == 3
    assert "largest remaining capacity is 1" in exc.value.reason
    # memory separate from the balanced cost
    p = partition([1, 1, 1, 1], 2, memory=[5, 1, 1, 5], capacity=[6, 6])
    assert p.bounds == (0, 2, 4)
    p = partition([1, 1, 1, 1], 2, memory=[5, 1, 1, 5], capacity=[5, None])
    assert p.bounds == (0, 1, 4)
    # use_all reservation: unit 2 fits device 1 but device 2 (capacity 0)
    # cannot get a unit
    with pytest.raises(PartitionError) as exc:
        partition([1, 1, 1], 3, capacity=[10, 10, 0])
    assert exc.value.unit == 2 and "use_all" in exc.value.reason
    assert partition([1, 1, 1], 3, capacity=[10, 10, 0], use_all=False).bounds == (
        0,
        2,
        3,
        3,
    )


def test_capacity_needs_dp_not_greedy():
    # taking the most units on device 0 would strand a big unit on device 1
    p = partition([5, 1, 5, 5], 3, capacity=[100, 1, 100])
    assert p.bounds == (0, 1, 2, 4)


def test_capacity_exact_comparison():
    # 0.1 + 0.2 > 0.3 exactly (and in floats), 0.1 + 0.2 <= 0.30000000000000004
    with pytest.raises(PartitionError):
        partition([0.1, 0.2], 1, capacity=[0.3])
    assert partition([0.1, 0.2], 1, capacity=[0.1 + 0.2]).bounds == (0, 2)
    # sums beyond 2**53 are exact too
    big = 2**60
    assert partition([big, 1], 1, capacity=[big + 1]).bounds == (0, 2)
    with pytest.raises(PartitionError):
        partition([big, 1], 1, capacity=[big])


def test_overflowing_loads():
    p = partition([1e300, 1e300], 2, speed=[1e-300, 1.0])
    assert p.bottleneck == math.inf and p.bounds == (0, 1, 2)
    p = partition([1e300, 1e300], 2, speed=[1e-300, 1.0], use_all=False)
    assert p.bounds == (0, 0, 2) and p.bottleneck == 2e300


def test_stage_load_matches():
    costs = [0.1, 0.2, 0.3, 1e16, 1.0]
    assert stage_load(costs, 0, 3) == math.fsum(costs[:3])
    assert stage_load(costs, 2, 5, 3.0) == math.fsum(costs[2:5]) / 3.0
    p = partition(costs, 2, speed=[1.0, 3.0])
    assert p.loads == tuple(
        stage_load(costs, p.bounds[k], p.bounds[k + 1], [1.0, 3.0][k]) for k in range(2)
    )


def test_greedy_fill_capacity():
    g = greedy_fill([3, 3, 3, 3], 3, capacity=[7, 3, 9])
    assert g.bounds == (0, 2, 3, 4)
    with pytest.raises(PartitionError) as exc:
        greedy_fill([3, 3, 3, 3], 2, capacity=[7, 4])
    assert exc.value.unit == 3
    # a unit over budget still opens an empty device (soft budget)
    assert greedy_fill([10, 1, 1, 1], 3).bounds == (0, 1, 4, 4)
    assert greedy_fill([1, 1], 4).bounds == (0, 1, 2, 2, 2)
    assert greedy_fill([1, 2, 3], 2, cut_cost=[5, 7]).cut_bytes == 7.0


def test_greedy_never_beats_optimum():
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(1, 30)
        d = rng.randint(1, 6)
        costs = [rng.randint(0, 50) for _ in range(n)]
        g = greedy_fill(costs, d)
        p = partition(costs, d, use_all=False)
        assert p.bottleneck <= g.bottleneck


def test_validation():
    with pytest.raises(ValueError):
        partition([1, -1], 2)
    with pytest.raises(ValueError):
        partition([1, float("nan")], 2)
    with pytest.raises(ValueError):
        partition([1, 1], 0)
    with pytest.raises(ValueError):
        partition([1, 1], 2, speed=[1.0, 0.0])
    with pytest.raises(ValueError):
        partition([1, 1], 2, speed=[1.0])
    with pytest.raises(ValueError):
        partition([1, 1], 2, cut_cost=[1, 2])
    with pytest.raises(ValueError):
        partition([1, 1], 2, capacity=[1])
    with pytest.raises(ValueError):
        partition([1, 1], 2, capacity=[1, -1])
    with pytest.raises(ValueError):
        partition([1, 1], 2, memory=[1])


@pytest.mark.slow  # a timing (1,000 units on 8 devices): a benchmark, not for the quick loop
def test_large_is_fast():
    rng = random.Random(5)
    n, d = 1000, 8
    costs = [rng.random() * 100 for _ in range(n)]
    cut = [rng.random() for _ in range(n - 1)]
    speed = [1, 2, 1, 1.5, 1, 1, 3, 1]
    cap = [sum(costs) / 5] * d
    t = time.perf_counter()
    p = partition(costs, d, cut_cost=cut, speed=speed, capacity=cap)
    elapsed = time.perf_counter() - t
    assert isinstance(p, Partition) and len(p.bounds) == d + 1
    assert elapsed < 2.0, elapsed  # typically < 0.1 s
    # the optimum is not beaten by any single-boundary move
    for k in range(1, d):
        for delta in (-1, 1):
            b = list(p.bounds)
            b[k] += delta
            if not b[k - 1] < b[k] < b[k + 1]:
                continue
            loads = [stage_load(costs, b[j], b[j + 1], speed[j]) for j in range(d)]
            mem_ok = all(math.fsum(costs[b[j] : b[j + 1]]) <= cap[j] for j in range(d))
            if mem_ok:
                assert max(loads) >= p.bottleneck
