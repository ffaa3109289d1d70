"""The placement report's memory plan: one row per device and run, the parts
alive at the peak, the largest contributors and the share of a capacity."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import write_spec
from mpgen.compiler.analysis.costs import human_bytes
from mpgen.compiler.codegen.report import binding, render_report
from mpgen.compiler.driver import compile_spec, generate
from mpgen.compiler.ir import MEMORY_PARTS, DeviceMemory, MemoryPlan

SPEC = """\
mpgen: 1
name: Tiny
inputs:
  x: [batch, 32]
layers:
  embed: {op: Linear, args: [32, 64]}
  body: {op: Linear, args: [64, 64], repeat: 4}
  head: {op: Linear, args: [64, 10]}
placement:
  auto:
    devices: [cuda:0, cuda:1]
%s
train:
  loss: CrossEntropyLoss
  optimizer: {op: AdamW, lr: 1.0e-3}
  batch_size: 8
  steps: 2
"""


def device_memory(device: str, k: int, phase: str = "backward") -> DeviceMemory:
    """A device's memory whose parts at the peak add up to its peak."""
    at_peak = (("weights", 10000 * k), ("gradients", 10000 * k), ("optimizer", 20000 * k),
               ("activations", 50000 * k), ("transfers", 1000 * k), ("transient", 3000))
    return DeviceMemory(device, 10000 * k, 10000 * k, 20000 * k, 60000 * k,
                        sum(n for _, n in at_peak), phase, at_peak,
                        (("body.1", 40000 * k), ("head", 700)))


CAPACITY = {"cuda:0": 400 * 1024, "cuda:1": 640 * 1024}


def plan() -> MemoryPlan:
    return MemoryPlan(
        8, train=(device_memory("cuda:0", 1), device_memory("cuda:1", 3)),
        pipeline=(device_memory("cuda:0", 2, "B1"), device_memory("cuda:1", 2, "F0")),
        inference=(device_memory("cuda:0", 1, "forward"), device_memory("cuda:1", 1, "forward")),
        schedule="gpipe", microbatches=2)


def memory_rows(report: str) -> list[dict[str, str]]:
    lines = report.splitlines()
    start = lines.index("## Memory plan")
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| device | run |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
    return rows


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    capacity = "    capacity: {cuda:0: 400KiB, cuda:1: 640KiB}"
    return compile_spec(write_spec(tmp_path_factory.mktemp("report"), SPEC % capacity))


def test_one_row_per_device_and_run_with_its_parts(graph):
    made = plan()
    report = render_report(dataclasses.replace(graph, memory=made))
    rows = memory_rows(report)
    assert [(r["device"], r["run"]) for r in rows] == [
        (f"`{d}`", run) for d in ("cuda:0", "cuda:1")
        for run in ("training", "pipeline", "inference")]
    for row, (run, device) in zip(rows, [(r, d) for d in ("cuda:0", "cuda:1")
                                         for r in ("train", "pipeline", "inference")]):
        m = made.of(run)[device]
        assert row["peak"] == f"**{human_bytes(m.peak)}**"
        assert row["reached in"] == f"`{m.phase}`"
        assert [row[p] for p in MEMORY_PARTS] == [human_bytes(n) for _, n in m.at_peak]
        assert row["largest at the peak"] == ", ".join(
            f"`{name}` {human_bytes(n)}" for name, n in m.largest)
        capacity = CAPACITY[device]
        assert row["of capacity"] == (f"{100 * m.peak / capacity:.1f}% of "
                                      f"{human_bytes(capacity)}")
    assert "under `gpipe` with 2 micro-batches (pipeline)" in report


def test_the_binding_device_is_the_nearest_its_capacity(graph):
    made = plan()
    # cuda:0's pipeline peak, 185,000 bytes of 400 KiB (45.2%), binds before cuda:1's
    # larger training peak, 276,000 bytes of 640 KiB (42.1%)
    assert binding(made, CAPACITY) == ("cuda:0", "pipeline", 185000)
    assert binding(made, {"cuda:1": CAPACITY["cuda:1"]}) == ("cuda:1", "train", 276000)
    assert binding(made, {}) is None
    report = render_report(dataclasses.replace(graph, memory=made))
    assert ("Binding: `cuda:0`, whose pipeline peak 180.7 KiB is 45.2% of its capacity "
            "400.0 KiB (within it)") in report


def test_without_capacity_the_largest_peak_is_named(tmp_path):
    graph = compile_spec(write_spec(tmp_path, SPEC % ""))
    report = render_report(dataclasses.replace(graph, memory=plan()))
    assert "of capacity" not in report
    assert "Largest: `cuda:1`, training peak 269.5 KiB. No capacity is stated" in report


def test_a_plan_over_capacity_says_so(graph):
    over = dataclasses.replace(plan(), train=(device_memory("cuda:0", 9),
                                              device_memory("cuda:1", 1)))
    report = render_report(dataclasses.replace(graph, memory=over))
    assert "Binding: `cuda:0`, whose training peak" in report
    assert "(**over** it)" in report


def test_rendered_the_same_every_time_and_absent_without_a_plan(graph):
    placed = dataclasses.replace(graph, memory=plan())
    assert render_report(placed) == render_report(dataclasses.replace(graph, memory=plan()))
    assert "## Memory plan" not in render_report(dataclasses.replace(graph, memory=None))


def test_a_build_reports_its_own_plan_the_same_every_time(tmp_path):
    spec = write_spec(tmp_path, SPEC % "    capacity: {cuda:0: 400KiB, cuda:1: 640KiB}")
    first = generate(spec).files["tiny.placement.md"]
    again = generate(spec).files["tiny.placement.md"]
    assert first == again
    made = compile_spec(spec).memory
    rows = memory_rows(first)
    assert [(r["device"], r["run"], r["peak"]) for r in rows] == [
        (f"`{m.device}`", name, f"**{human_bytes(m.peak)}**")
        for device in ("cuda:0", "cuda:1")
        for run, name in (("train", "training"), ("pipeline", "pipeline"),
                          ("inference", "inference"))
        for m in getattr(made, run) if m.device == device]
