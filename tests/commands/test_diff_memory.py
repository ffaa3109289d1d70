"""`mpgen diff` and `ci-summary`: each device's memory-plan peak before -> after,
only where it changed."""

from __future__ import annotations

import dataclasses
import re

import pytest

from helpers import mpgen, write_spec
from mpgen.commands import ci_summary
from mpgen.commands.diff import MemoryChange, Side, diff, format_diff
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.ir import DeviceMemory, MemoryPlan

SPEC = """\
mpgen: 1
name: Tiny
inputs:
  x: [batch, 16]
layers:
  a: {op: Linear, args: [16, 16]}
  h: {op: Linear, args: [16, 16], repeat: 4}
placement:
  a: cuda:0
  h.2: cuda:1
train:
  batch_size: 4
"""


def memory(device: str, peak: int) -> DeviceMemory:
    return DeviceMemory(device, peak // 4, peak // 4, peak // 4, peak // 4, peak)


def plan(batch: int, train: dict, pipeline: dict, inference: dict) -> MemoryPlan:
    return MemoryPlan(batch, *(tuple(memory(d, n) for d, n in run.items())
                               for run in (train, pipeline, inference)))


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return compile_spec(write_spec(tmp_path_factory.mktemp("diff"), SPEC))


def sides(graph, old: MemoryPlan | None, new: MemoryPlan | None) -> tuple[Side, Side]:
    return (Side("old.yaml", dataclasses.replace(graph, memory=old)),
            Side("new.yaml", dataclasses.replace(graph, memory=new)))


def test_only_the_peaks_that_changed_are_listed(graph):
    gib = 1024 ** 3
    old = plan(8, {"cuda:0": int(1.2 * gib), "cuda:1": 2 * gib},
               {"cuda:0": gib, "cuda:1": gib}, {"cuda:0": gib // 2, "cuda:1": gib // 2})
    new = plan(16, {"cuda:0": 1.5 * gib, "cuda:1": 2 * gib},
               {"cuda:0": gib, "cuda:1": gib + gib // 200}, {"cuda:0": gib // 2})
    d = diff(*sides(graph, old, new))
    assert d.memory_batch == (8, 16)
    assert [(c.device, c.run) for c in d.memory] == [
        ("cuda:0", "train"), ("cuda:1", "pipeline"), ("cuda:1", "inference")]
    text = format_diff(d)
    assert ("memory plan (peak per device, batch 8 -> 16):\n"
            "  cuda:0 train peak 1.2 GiB -> 1.5 GiB (+25%)\n"
            "  cuda:1 pipeline peak 1.0 GiB -> 1.0 GiB (+0.5%)\n"
            "  cuda:1 inference peak 512.0 MiB -> none (gone)\n") in text
    assert ci_summary._layout_moved(d)


def test_the_same_plan_is_one_line_and_no_change(graph):
    same = plan(4, {"cuda:0": 1000}, {"cuda:0": 900}, {"cuda:0": 100})
    d = diff(*sides(graph, same, same))
    assert d.memory == ()
    assert "memory plan (batch 4): unchanged" in format_diff(d)
    assert not ci_summary._layout_moved(d)


def test_a_side_without_a_plan_shows_no_memory_plan(graph):
    d = diff(*sides(graph, None, plan(4, {"cuda:0": 1000}, {}, {})))
    assert d.memory == () and d.memory_batch is None
    assert "memory plan" not in format_diff(d)


@pytest.mark.parametrize("before, after, shown", [
    (None, 2048, "cuda:2 train peak none -> 2.0 KiB (new)"),
    (2048, 1024, "cuda:2 train peak 2.0 KiB -> 1.0 KiB (-50%)"),
    (0, 1024, "cuda:2 train peak 0 B -> 1.0 KiB"),
])
def test_a_change_reads_as_one_line(before, after, shown):
    assert str(MemoryChange("cuda:2", "train", before, after)) == shown


# -- with the plan the build makes ---------------------------------------------

def test_a_larger_batch_shows_every_device_s_peaks_growing(tmp_path):
    old = write_spec(tmp_path, SPEC, "old.yaml")
    new = write_spec(tmp_path, SPEC.replace("batch_size: 4", "batch_size: 64"), "new.yaml")
    ran = mpgen("diff", str(old), str(new))
    assert ran.returncode == 0, ran.stderr
    section = ran.stdout.split("memory plan (peak per device, batch 4 -> 64):\n")[1]
    lines = section.split("\n\n")[0].splitlines()
    assert [line.split(" peak ")[0].strip() for line in lines] == [
        f"{d} {run}" for d in ("cuda:0", "cuda:1") for run in ("train", "pipeline", "inference")]
    assert all(re.search(r" -> .* \(\+\d+%\)$", line) for line in lines)


def test_a_moved_layer_changes_the_peaks_of_both_devices_only(tmp_path):
    old = write_spec(tmp_path, SPEC, "old.yaml")
    new = write_spec(tmp_path, SPEC.replace("h.2: cuda:1", "h.3: cuda:1"), "new.yaml")
    ran = mpgen("diff", str(old), str(new))
    assert ran.returncode == 0, ran.stderr
    assert "memory plan (peak per device, batch 4):" in ran.stdout
    grew = re.findall(r"^  cuda:0 train peak .* \(\+\d+%\)$", ran.stdout, re.M)
    shrank = re.findall(r"^  cuda:1 train peak .* \(-\d+%\)$", ran.stdout, re.M)
    assert grew and shrank
