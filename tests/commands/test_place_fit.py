"""`mpgen place --fit`: the largest batch whose memory plan fits every capacity,
and --write putting it in the spec (NOTE [The largest batch that fits])."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import build_to, mpgen, write_spec
from mpgen.commands.place import fit, write_fit
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.placement.memory import plan
from mpgen.errors import MpgenError
from run_generated import train_one_step

PLAIN = """\
mpgen: 1
name: Tiny
inputs:
  x: [batch, 32]
layers:
  embed: {op: Linear, args: [32, 64]}
  body: {op: Linear, args: [64, 64], repeat: 4}
  head: {op: Linear, args: [64, 10]}
placement:
  embed: cuda:0
  body.2: cuda:1
train:
  loss: CrossEntropyLoss   # the classes of head
  optimizer: {op: AdamW, lr: 1.0e-3}
  batch_size: 8
  steps: 2
"""

PIPELINED = PLAIN.replace("train:\n", """\
pipeline:
  microbatches: 3   # more than the default
  schedule: 1f1b
  dp: 2
train:
""")

CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
KIB = 1024


def peaks(graph, batch: int, microbatches=None) -> dict[tuple[str, str], int]:
    """(run, device) -> the plan's peak at ``batch``, for the runs --fit bounds."""
    made = plan(graph, batch=batch, microbatches=microbatches)
    runs = ("train", "pipeline") if graph.pipeline else ("train",)
    return {(run, m.device): m.peak for run in runs for m in getattr(made, run)}


def fits(graph, capacity, batch: int, microbatches=None) -> bool:
    return all(peak <= capacity[device]
               for (_, device), peak in peaks(graph, batch, microbatches).items())


pytestmark = pytest.mark.slow  # each fit plans a few dozen batches and compiles a few specs


def test_the_answer_fits_and_its_double_does_not(tmp_path):
    spec = write_spec(tmp_path, PLAIN)
    capacity = {"cuda:0": 300 * KIB, "cuda:1": 250 * KIB}
    found = fit(spec, capacity=capacity)
    b = found.batch
    assert b > 8  # the capacities bind far above the spec's batch
    graph = compile_spec(spec)
    assert fits(graph, capacity, b)
    assert not fits(graph, capacity, b + 1)
    assert not fits(graph, capacity, 2 * b)
    device, run = found.need.device, found.need.run
    assert found.need.peak == peaks(graph, b)[run, device] <= capacity[device]
    above, need = found.over
    assert above == b + 1 and need.peak > need.capacity
    # written, the spec trains at that batch, one step, and its own plan fits
    assert write_fit(spec, found)
    assert spec.read_text() == PLAIN.replace("batch_size: 8", f"batch_size: {b}")
    written = compile_spec(spec)
    assert dict(written.dims)["batch"] == b
    assert all(m.peak <= capacity[m.device] for m in written.memory.train)
    out = tmp_path / "out"
    build_to(spec, out, CPU)
    assert "step 1" in train_one_step(out / "train_tiny.py").lower()
    assert not write_fit(spec, fit(spec, capacity=capacity))  # the same answer: unchanged


def test_a_pipeline_gets_a_batch_its_replicas_and_micro_batches_divide(tmp_path):
    spec = write_spec(tmp_path, PIPELINED)
    capacity = {"cuda:0": 300 * KIB, "cuda:1": 250 * KIB}
    found = fit(spec, capacity=capacity)
    b, m = found.batch, found.microbatches
    # 2 replicas, each part split into the spec's 3 micro-batches of the same size (or 6, 12)
    assert b % 6 == 0 and m in (3, 6, 12) and (b // 2) % m == 0
    graph = compile_spec(spec)
    assert fits(graph, capacity, b, m)
    # the next such batch does not fit, whatever count of those it takes; nor does the double
    above, need = found.over
    assert above == b + 6 and need.peak > need.capacity
    assert not any(fits(graph, capacity, above, k) for k in (3, 6, 12) if (above // 2) % k == 0)
    assert not fits(graph, capacity, 2 * b, m)
    write_fit(spec, found)
    text = spec.read_text()
    assert f"batch_size: {b}\n" in text
    assert f"microbatches: {m}   # more than the default" in text
    written = compile_spec(spec)
    assert written.pipeline.microbatches == m
    assert all(x.peak <= capacity[x.device] for x in (*written.memory.train,
                                                       *written.memory.pipeline))
    out = tmp_path / "out"
    build_to(spec, out, CPU)
    assert "step 1" in train_one_step(out / "train_tiny.py").lower()
    # the pipeline program takes the batch and count the spec now states: 2 stages x 2 replicas
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", "pp_tiny.py", "--steps", "1"], cwd=out,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 1/1  loss" in run.stdout


def test_the_cli_prints_the_binding_device_and_writes_the_spec(tmp_path):
    spec = write_spec(tmp_path, PLAIN)
    ran = mpgen("place", str(spec), "--fit", "--capacity", "cuda:0=300KiB,cuda:1=250KiB")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith(f"# {spec}: the largest batch that fits: train.batch_size ")
    assert lines[0].endswith("(the spec: batch_size 8)")
    assert lines[1].startswith("binding at batch ") and " needs " in lines[1]
    assert "(does not fit)" in lines[2]
    assert spec.read_text() == PLAIN
    ran = mpgen("place", str(spec), "--fit", "--capacity", "cuda:0=300KiB,cuda:1=250KiB",
                "--write")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == f"rewrote: {spec}"
    assert spec.read_text() != PLAIN


def test_the_capacity_of_an_automatic_placement_is_the_spec_s(tmp_path):
    spec = write_spec(tmp_path, PLAIN.replace(
        "  embed: cuda:0\n  body.2: cuda:1\n",
        "  auto:\n    devices: [cuda:0, cuda:1]\n    capacity: {cuda:0: 300KiB, cuda:1: 250KiB}\n"))
    found = fit(spec)
    assert dict(found.capacity) == {"cuda:0": 300 * KIB, "cuda:1": 250 * KIB}
    assert found.need.peak <= found.need.capacity
    # the spec rewritten at the answer builds (its capacity checked at build) ...
    write_fit(spec, found)
    compile_spec(spec)
    # ... and at the next batch it does not fit, by the plan or by the build
    above, need = found.over
    assert isinstance(need, str) or need.peak > need.capacity


def test_not_even_the_smallest_batch_fits_is_one_line(tmp_path):
    spec = write_spec(tmp_path, PLAIN)
    ran = mpgen("place", str(spec), "--fit", "--capacity", "cuda:1=10KiB")
    assert ran.returncode == 2
    [line] = ran.stderr.splitlines()
    assert line.startswith("mpgen place --fit: not even a batch of 1 fits: cuda:1 needs ")
    assert "of its 10,240 (10.0 KiB)" in line


@pytest.mark.parametrize("args, message", [
    ((), "mpgen place --fit: no device has a capacity: give one with --capacity "),
    (("--capacity", "cuda:7=1GiB"), "mpgen place --fit: --capacity names cuda:7, not a device "
                                   "of this build (it uses cuda:0, cuda:1)"),
])
def test_no_capacity_or_an_unknown_device_is_a_usage_error(tmp_path, args, message):
    spec = write_spec(tmp_path, PLAIN)
    ran = mpgen("place", str(spec), "--fit", *args)
    assert ran.returncode == 2
    [line] = ran.stderr.splitlines()
    assert line.startswith(message)


def test_a_spec_over_its_own_capacity_gets_a_batch_that_builds(tmp_path):
    over = PLAIN.replace("batch_size: 8", "batch_size: 4096") + (
        "capacity: {cuda:0: 300KiB, cuda:1: 250KiB}\n")
    spec = write_spec(tmp_path, over)
    with pytest.raises(MpgenError, match="needs .* but its capacity is"):
        compile_spec(spec)  # the build refuses it
    found = fit(spec)
    assert found.before == (4096, None)
    assert 8 < found.batch < 4096
    write_fit(spec, found)
    assert dict(compile_spec(spec).dims)["batch"] == found.batch  # it builds now


def test_device_map_renames_the_devices_capacities_name(tmp_path):
    spec = write_spec(tmp_path, PLAIN)
    plain = fit(spec, capacity={"cuda:0": 300 * KIB, "cuda:1": 250 * KIB})
    mapped = fit(spec, {"cuda:1": "cuda:2"}, capacity={"cuda:0": 300 * KIB, "cuda:2": 250 * KIB})
    assert mapped.batch == plain.batch
    assert mapped.need.device == {"cuda:1": "cuda:2"}.get(plain.need.device, plain.need.device)


def test_capacities_that_never_bind_give_the_largest_batch_a_spec_may_state(tmp_path):
    spec = write_spec(tmp_path, PLAIN)
    ran = mpgen("place", str(spec), "--fit", "--capacity", "cuda:0=100000TiB,cuda:1=100000TiB")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert "train.batch_size 2147483647 " in lines[0]
    assert lines[2] == "no larger batch: 2147483647 is the largest a spec may state"
