"""mpgen show: the memory plan in the table and in --format json (bytes,
per mode and device; docs/memory.md)."""

from __future__ import annotations

import json

from tests.helpers import mpgen, write_spec

TWO_HEADS = """\
mpgen: 1
name: Shown
inputs:
  x: [batch, 64]
layers:
  trunk: {op: Linear, args: [64, 256]}
  act: {op: GELU}
  cls: {op: Linear, args: [256, 7], in: act}
  reg_hidden: {op: Linear, args: [256, 32], in: act}
  reg: {op: Linear, args: [32, 1]}
outputs: [cls, reg]
placement:
  trunk: cuda:0
  cls: cuda:1
  reg_hidden: cuda:2
train:
  loss:
    cls: CrossEntropyLoss
    reg: MSELoss
  optimizer: {op: Adam, lr: 1.0e-3}
  batch_size: 32
"""


def test_json_has_the_memory_plan_in_bytes_per_mode_and_device(tmp_path):
    spec = write_spec(tmp_path, TWO_HEADS, "shown.yaml")
    ran = mpgen("show", str(spec), "--format", "json")
    assert ran.returncode == 0, ran.stderr
    plan = json.loads(ran.stdout)["memory"]
    assert (plan["batch"], plan["schedule"], plan["microbatches"], plan["dp"]) == (32, "1f1b", 3, 1)
    for mode in ("train", "pipeline", "inference"):
        assert list(plan[mode]) == ["cuda:0", "cuda:1", "cuda:2"]
        for device in plan[mode].values():
            assert {"weights", "gradients", "optimizer", "activations", "peak", "phase",
                    "at_peak", "largest"} <= set(device)
            assert device["peak"] >= device["weights"] > 0
            assert sum(device["at_peak"].values()) == device["peak"]
    # cuda:0 holds the trunk: 64 * 256 weights and 256 biases, float32.
    assert plan["train"]["cuda:0"]["weights"] == (64 * 256 + 256) * 4
    assert plan["inference"]["cuda:0"]["gradients"] == 0


def test_json_keys_the_plan_by_the_mapped_device(tmp_path):
    spec = write_spec(tmp_path, TWO_HEADS, "shown.yaml")
    ran = mpgen("show", str(spec), "--format", "json", "--device-map", "cpu")
    plan = json.loads(ran.stdout)["memory"]
    assert [list(plan[mode]) for mode in ("train", "inference")] == [["cpu"]] * 2
    # pp_shown.py's three ranks, each its own process on the CPU, by their
    # spec devices (as its --memory names them: docs/memory.md)
    assert list(plan["pipeline"]) == ["cuda:0", "cuda:1", "cuda:2"]
    assert plan["microbatches"] == 3  # pp_shown.py keeps the spec's three stages


def test_the_table_ends_with_each_device_in_each_mode(tmp_path):
    spec = write_spec(tmp_path, TWO_HEADS, "shown.yaml")
    out = mpgen("show", str(spec)).stdout.splitlines()
    head = out.index(next(line for line in out if line.startswith("memory at batch 32")))
    assert out[head] == "memory at batch 32; pipeline: 1f1b, 3 micro-batches, 1 replica"
    assert out[head + 1].split() == ["memory", "device", "weights", "gradients", "optimizer",
                                     "activations", "peak", "at"]
    rows = [line.split()[:2] for line in out[head + 3:]]
    assert rows == [[mode, f"cuda:{k}"] for mode in ("train", "pipeline", "inference")
                    for k in range(3)]
