"""Explicit placement (bookmarks, ranges) and the transfer plan."""

from __future__ import annotations

import pytest

from helpers import write_spec
from mpgen.compiler import driver as build
from mpgen.spec_schema.device_map import parse_device_map
from mpgen.errors import MpgenError

STACK = """
mpgen: 1
name: Stack
inputs:
  x: [batch, 8]
layers:
  embed: {op: Linear, args: [8, 16]}
  h: {op: Linear, args: [16, 16], repeat: 6}
  norm: {op: LayerNorm, args: [16]}
  head: {op: Linear, args: [16, 2]}
"""


def compiled(tmp_path, placement: str, device_map=None):
    return build.compile_spec(write_spec(tmp_path, STACK + placement), device_map)


def devices(graph):
    return {n.name: n.devices for n in graph.nodes}


def test_no_placement_puts_everything_on_cuda0(tmp_path):
    graph = compiled(tmp_path, "")
    assert set(d for ds in devices(graph).values() for d in ds) == {"cuda:0"}
    assert [(t.src, t.dst) for t in graph.plan.transfers] == [(None, "cuda:0")]


def test_entries_work_like_bookmarks(tmp_path):
    graph = compiled(tmp_path, """
placement:
  h.2: cuda:1
  head: cuda:2
""")
    assert devices(graph) == {
        "embed": ("cuda:1",),  # before the first entry: the first entry's device
        "h": ("cuda:1",) * 6,
        "norm": ("cuda:1",),  # stays on the device of the one before it
        "head": ("cuda:2",),
    }


def test_instance_ranges(tmp_path):
    graph = compiled(tmp_path, """
placement:
  embed: cuda:0
  h.0-2: cuda:0
  h.3-5: cuda:1
""")
    assert devices(graph)["h"] == ("cuda:0",) * 3 + ("cuda:1",) * 3
    assert devices(graph)["head"] == ("cuda:1",)
    moves = [(t.value.name, t.src, t.dst) for t in graph.plan.transfers]
    assert moves == [("x", None, "cuda:0"), ("h", "cuda:0", "cuda:1")]


def test_a_repeat_split_renders_one_loop_per_device(tmp_path):
    spec = write_spec(tmp_path, STACK + """
placement:
  h.0-2: cuda:0
  h.3-5: cuda:1
""")
    text = build.generate(spec).files["stack.py"]
    assert "for layer in self.h[0:3]:" in text
    assert 'h = h.to("cuda:1")' in text
    assert "for layer in self.h[3:6]:" in text
    assert ('[nn.Linear(16, 16).to("cuda:0") for _ in range(3)]\n'
            '            + [nn.Linear(16, 16).to("cuda:1") for _ in range(3)]') in text


def test_device_changes_back_and_forth(tmp_path):
    graph = compiled(tmp_path, """
placement:
  embed: cuda:0
  h.1: cuda:1
  h.2: cuda:0
  norm: cpu
""")
    assert devices(graph)["h"] == ("cuda:0", "cuda:1", "cuda:0", "cuda:0", "cuda:0", "cuda:0")
    pairs = [(t.src, t.dst) for t in graph.plan.transfers]
    assert pairs == [(None, "cuda:0"), ("cuda:0", "cuda:1"), ("cuda:1", "cuda:0"),
                     ("cuda:0", "cpu")]


@pytest.mark.parametrize("placement, message", [
    ("  hh.0: cuda:1\n", "'hh.0' matches no layer (did you mean 'h'?)"),
    ("  h.6: cuda:1\n", "'h.6': layer 'h' has instances 0-5"),
    ("  h.4-2: cuda:1\n", "'h.4-2': a range goes from the lower to the higher instance, "
                         "e.g. 'h.2-4'"),
    ("  norm.0: cuda:1\n", "'norm.0': layer 'norm' is not repeated"),
    ("  h: cuda:0\n  h.3-5: cuda:1\n", "'h.3-5' places h.3-5 again (already placed by 'h')"),
    ("  head: cuda:x\n", "invalid device 'cuda:x'"),
    ("  head: gpu1\n", "invalid device 'gpu1': expected 'cpu' or 'cuda:N' (did you mean 'cuda:1'?)"),
])
def test_placement_mistakes(tmp_path, placement, message):
    with pytest.raises(MpgenError) as info:
        compiled(tmp_path, "placement:\n" + placement)
    text = str(info.value)
    assert message in text
    assert ("spec.yaml:11:" in text) != ("spec.yaml:12:" in text)


def test_each_tensor_moves_once_per_reading_device(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: Fan
        inputs:
          x: [batch, 4]
        layers:
          trunk: {op: Linear, args: [4, 4]}
          a1: {op: Linear, args: [4, 4], in: trunk}
          a2: {op: torch.add, in: [a1, trunk]}
          b1: {op: Linear, args: [4, 4], in: trunk}
          b2: {op: torch.mul, in: [b1, trunk]}
          c: {op: torch.sub, in: [trunk, x]}
        outputs: [a2, b2, c]
        placement:
          trunk: cuda:0
          a1: cuda:1
          b1: cuda:2
          c: cuda:1
    """)
    graph = build.compile_spec(spec)
    moves = [(str(t.value), t.src, t.dst) for t in graph.plan.transfers]
    assert moves == [("x", None, "cuda:0"), ("trunk", "cuda:0", "cuda:1"),
                     ("trunk", "cuda:0", "cuda:2"), ("x", None, "cuda:1")]
    text = build.generate(spec).files["fan.py"]
    assert 'trunk_cuda1 = trunk.to("cuda:1")' in text
    assert "c = torch.sub(trunk_cuda1, x_cuda1)" in text


def test_device_map_parsing():
    assert parse_device_map("cpu") == {"*": "cpu"}
    assert parse_device_map("cuda:1=cuda:0, cuda:2=cuda:0") == {"cuda:1": "cuda:0",
                                                              "cuda:2": "cuda:0"}
    for bad in ["", "cuda:1=", "gpu=cuda:0", "cuda:1=cuda"]:
        with pytest.raises(ValueError):
            parse_device_map(bad)


def test_device_map_merges_devices_and_drops_transfers(tmp_path):
    graph = compiled(tmp_path, """
placement:
  embed: cuda:0
  h.3: cuda:1
  head: cuda:2
""", {"cuda:2": "cuda:1"})
    pairs = [(t.src, t.dst) for t in graph.plan.transfers]
    assert pairs == [(None, "cuda:0"), ("cuda:0", "cuda:1")]
