"""`mpgen profile` and `placement: {auto: {balance: time}}`: the plumbing,
never the timing (the machine is shared: bench/stage_times.py measures).

A profile written by hand places exactly by its numbers; a stale one, or
one that names no kind for a device, is refused; `mpgen profile` writes a
file with every unit and device that the build reads back; the format is
byte-stable; the simulator and pp_<name>.py take their stage times from it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import mpgen, write_spec
from mpgen.commands import profile as measure
from mpgen.compiler.analysis.schedule import stage_times
from mpgen.compiler.codegen import pp
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.frontend.profile import profile_path, read_profile
from mpgen.errors import MpgenError

SPEC = """\
mpgen: 1
name: Chain
inputs:
  x: [batch, 8]
layers:
  a: {op: Linear, args: [8, 8]}
  h: {op: Linear, args: [8, 8], repeat: 4}
  act: {op: ReLU}
  head: {op: Linear, args: [8, 4]}
placement:
  auto: {devices: DEVICES, balance: time}
train:
  batch_size: 4
"""
UNITS = ["a", "h.0", "h.1", "h.2", "h.3", "act", "head"]
PARAMS = [72, 72, 72, 72, 72, 0, 36]
FLOPS = [512, 512, 512, 512, 512, 0, 256]


def spec(tmp_path, devices=("cuda:0", "cuda:1")):
    return write_spec(tmp_path, SPEC.replace("DEVICES", f"[{', '.join(devices)}]"))


def hand_profile(path, times, kinds=None, devices=None, units=None, call=(0.01, 0.02)):
    """A profile of ``times`` (per unit, forward + backward ms split 1:2 for
    each kind's factor), as mpgen profile writes one."""
    kinds = kinds or {"cpu": 1.0}
    devices = devices or {"cpu": "cpu"}
    lines = ["mpgen_profile: 1", 'spec: "spec.yaml"', "batch: 4", "threads: 1", "warmup: 2",
             "repeats: 7", "kinds:", *(f'  "{k}": "Hardware {k}"' for k in kinds),
             "devices:", *(f'  "{d}": "{k}"' for d, k in devices.items()),
             "call:", *(f'  "{k}": [{call[0]}, {call[1]}]' for k in kinds), "units:"]
    for name, params, flops, t in zip(units or UNITS, PARAMS, FLOPS, times):
        each = ", ".join(f'"{k}": [{t * f / 3!r}, {t * f * 2 / 3!r}]' for k, f in kinds.items())
        lines.append(f'  - {{unit: "{name}", params: {params}, flops: {flops}, {each}}}')
    lines.append("transfers: []")
    profile_path(path).write_text("\n".join(lines) + "\n")


def best_split(times, devices, speeds=None):
    """The smallest bottleneck over every contiguous split, by brute force."""
    speeds = speeds or [1.0] * devices
    best = None
    for cuts in itertools.combinations(range(1, len(times)), devices - 1):
        bounds = (0, *cuts, len(times))
        load = max(sum(times[a:b]) / s for a, b, s in zip(bounds, bounds[1:], speeds))
        best = load if best is None or load < best else best
    return best


@pytest.mark.parametrize("times", [
    [1, 1, 1, 1, 1, 1, 30],          # the head outweighs the rest
    [12, 1, 1, 1, 1, 1, 12],         # an embedding and a head
    [5, 3, 3, 3, 3, 0.5, 1],
])
@pytest.mark.parametrize("count", [2, 3])
def test_balance_time_is_the_exact_optimum_of_the_profiles_numbers(tmp_path, times, count):
    path = spec(tmp_path, [f"cuda:{k}" for k in range(count)])
    hand_profile(path, times)
    choice = compile_spec(path).layout.auto
    assert choice.split.bottleneck == pytest.approx(best_split(times, count))
    assert compile_spec(path).profile.path == str(profile_path(path))


def test_a_second_kind_measured_is_a_speed(tmp_path):
    """cuda:1 measured 2x slower than cuda:0: its load is its time on its own
    kind, as if its speed were 0.5 (and the spec's speed multiplies in)."""
    path = spec(tmp_path)
    times = [4, 1, 1, 1, 1, 1, 4]
    hand_profile(path, times, kinds={"fast": 1.0, "slow": 2.0},
                 devices={"cuda:0": "fast", "cuda:1": "slow"})
    split = compile_spec(path).layout.auto.split
    assert split.bottleneck == pytest.approx(best_split(times, 2, [1.0, 0.5]))
    assert split.bounds[1] > 4  # the slow device gets less than half


def test_a_stale_profile_is_refused_and_no_kind_for_a_device_is_refused(tmp_path):
    path = spec(tmp_path)
    hand_profile(path, [1] * 7, units=["a", "h.0", "h.1", "h.2", "h.3", "relu", "head"])
    with pytest.raises(MpgenError, match=r"is stale \(it times unit 'relu' where the spec "
                                         r"has 'act'\); rerun `mpgen profile`"):
        compile_spec(path)
    hand_profile(path, [1] * 7, kinds={"one": 1.0, "two": 1.0},
                 devices={"cpu": "one", "cuda:5": "two"})
    with pytest.raises(MpgenError, match=r"measured cpu, cuda:5, not cuda:0; profile on the "
                                         "machine that trains"):
        compile_spec(path)


def test_without_balance_time_a_stale_profile_only_stops_predicting(tmp_path):
    path = write_spec(tmp_path, SPEC.replace("DEVICES", "[cuda:0, cuda:1]")
                      .replace("balance: time", "balance: flops"))
    hand_profile(path, [1] * 7)
    graph = compile_spec(path)
    assert stage_times(graph).measured_on == ("Hardware cpu", "Hardware cpu")
    hand_profile(path, [1] * 6, units=UNITS[:6])
    assert stage_times(compile_spec(path)).measured_on == ()  # the cost model's


def test_stage_times_and_pp_costs_come_from_the_profile(tmp_path):
    path = spec(tmp_path)
    times = [3, 1, 1, 1, 1, 1, 3]
    hand_profile(path, times, call=(0.5, 1.0))
    graph = compile_spec(path)
    bounds = graph.layout.auto.split.bounds
    got = stage_times(graph)
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        assert got.forward[k] == pytest.approx((0.5 + sum(times[a:b]) / 3) / 1000)
        assert got.backward[k] == pytest.approx((1.0 + sum(times[a:b]) * 2 / 3) / 1000)
    assert got.measured_on == ("Hardware cpu",) * 2
    text = pp.render_pp(graph)
    assert "measured_on=('Hardware cpu', 'Hardware cpu')" in text.replace('"', "'")
    # the cost model's times, asked for
    assert stage_times(graph, measured=False).measured_on == ()


def test_the_format_is_byte_stable_and_reads_back(tmp_path):
    path = spec(tmp_path)
    graph = measure.compile_loaded(measure.load_file(path), place=False)
    found = [measure.Measured("cpu", "Some CPU (1 thread)", ("cpu",),
                              tuple((0.25 * (i + 1), 0.5 * (i + 1)) for i in range(7)),
                              (0.0125, 0.03125))]
    text = measure.format_profile("spec.yaml", graph, found, [], 4, 1, 2, 7)
    assert text == measure.format_profile("spec.yaml", graph, found, [], 4, 1, 2, 7)
    assert text.splitlines()[4:16] == [
        "mpgen_profile: 1", 'spec: "spec.yaml"', "batch: 4", "threads: 1", "warmup: 2",
        "repeats: 7", "kinds:", '  "cpu": "Some CPU (1 thread)"', "devices:", '  "cpu": "cpu"',
        "call:", '  "cpu": [0.0125, 0.0312]']
    assert text.splitlines()[17] == \
        '  - {unit: "a", params: 72, flops: 512, "cpu": [0.2375, 0.4688]}'
    profile_path(path).write_text(text)
    read = read_profile(path)
    assert [u.unit for u in read.units] == UNITS
    assert read.unit_ms("cpu")[1] == (0.4875, 0.9688)
    assert read.call == (("cpu", 0.0125, 0.0312),)
    assert read.stale(graph.costs) is None


@pytest.mark.slow
def test_mpgen_profile_writes_every_unit_and_device_and_the_build_reads_it(tmp_path):
    path = spec(tmp_path)
    ran = mpgen("profile", str(path), "--threads", "1", "--warmup", "1", "--repeats", "2")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == f"wrote {profile_path(path)}"
    profile = read_profile(path)
    assert [u.unit for u in profile.units] == UNITS
    assert [u.params for u in profile.units] == PARAMS
    machine = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert [d for d, _ in profile.devices] == machine
    assert all(f >= 0 and b >= 0 for u in profile.units for _, f, b in u.times)
    assert dict(profile.kinds)["cpu"].endswith("(1 thread)")
    graph = compile_spec(path)  # balance: time places by it
    assert graph.layout.auto.split.bottleneck > 0
    ran = mpgen("profile", str(path), "--device", "cuda:99")
    assert ran.returncode == 2 and "no device 'cuda:99' on this machine" in ran.stderr


def test_check_sees_a_changed_profile(tmp_path):
    """The profile is not in the spec's digest: a spec with one is always
    compiled, so a new profile makes the generated files not current."""
    path, out = spec(tmp_path), tmp_path / "out"
    hand_profile(path, [1, 1, 1, 1, 1, 1, 30])
    assert mpgen("build", str(path), "-o", str(out)).returncode == 0
    hand_profile(path, [30, 1, 1, 1, 1, 1, 1])
    ran = mpgen("check", str(path), "-o", str(out))
    assert ran.returncode == 1 and "not current" in ran.stderr
    changed = [line for line in ran.stdout.splitlines() if line.startswith(("-  ", "+  "))]
    assert any("costs=" in line for line in changed), ran.stdout  # the stage times moved


def test_a_stale_profile_is_said_so_at_build(tmp_path):
    path = write_spec(tmp_path, SPEC.replace("DEVICES", "[cuda:0, cuda:1]")
                      .replace("balance: time", "balance: flops"))
    hand_profile(path, [1] * 6, units=UNITS[:6])
    ran = mpgen("build", str(path), "-o", str(tmp_path / "out"))
    assert ran.returncode == 0, ran.stderr
    assert (f"{profile_path(path)}:1:1: note: this profile is stale (it times 6 units and the "
            "spec has 7: the model changed since it was measured), so the pipeline's predicted "
            "times are the cost model's") in ran.stderr


def test_a_profile_that_is_not_a_small_regular_file_is_refused(tmp_path):
    path = spec(tmp_path)
    profile_path(path).symlink_to("/dev/zero")  # never read to its end
    with pytest.raises(MpgenError, match="cannot read profile: "):
        read_profile(path)
    profile_path(path).unlink()
    profile_path(path).write_text("# " + "x" * (4 * 1024 * 1024) + "\n")
    with pytest.raises(MpgenError, match="profile is larger than 4194304 bytes"):
        read_profile(path)
    profile_path(path).write_text("[1, 2]\n")
    with pytest.raises(MpgenError, match="profile: the profile must be a mapping"):
        read_profile(path)
