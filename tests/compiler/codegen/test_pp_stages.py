"""pp_<name>.py's STAGES: the spec's pipeline: defaults (schedule, dp) and
the launch line's process count (NOTE [Pipeline program] in codegen/pp.py)."""

from __future__ import annotations

import ast

import pytest

from helpers import write_spec
from mpgen.compiler.codegen.pp import render_pp
from mpgen.compiler.driver import compile_spec

#: Four stages over two devices in a repeating order: every schedule fits.
SPEC = """
mpgen: 1
name: Net
inputs:
  x: [batch, 8]
layers:
  fc1: {op: Linear, args: [8, 16]}
  fc2: {op: Linear, args: [16, 32]}
  fc3: {op: Linear, args: [32, 16]}
  fc4: {op: Linear, args: [16, 4]}
placement:
  fc1: cuda:0
  fc2: cuda:1
  fc3: cuda:0
  fc4: cuda:1
pipeline: {microbatches: 4, schedule: SCHEDULE, dp: DP}
train:
  loss: MSELoss
  batch_size: 16
"""


def stages_call(text: str) -> dict[str, object]:
    """STAGES' keywords, the literals evaluated."""
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "STAGES":
            found = {}
            for keyword in node.value.keywords:
                try:
                    found[keyword.arg] = ast.literal_eval(keyword.value)
                except ValueError:
                    found[keyword.arg] = ast.unparse(keyword.value)
            return found
    raise AssertionError("no STAGES")


def build(tmp_path, schedule="1f1b", dp=1, device_map=None, text=SPEC):
    spec = write_spec(tmp_path, text.replace("SCHEDULE", schedule).replace("DP", str(dp)))
    graph = compile_spec(spec, device_map)
    return graph, render_pp(graph)


@pytest.mark.parametrize("schedule, dp, processes", [
    ("1f1b", 1, 4), ("gpipe", 2, 8), ("interleaved", 1, 2), ("looped-bfs", 4, 8),
    ("interleaved-zb", 2, 4), ("zbv", 1, 2), ("dualpipev", 2, 4)])
def test_schedule_and_dp_are_the_scripts_defaults(tmp_path, schedule, dp, processes):
    _, text = build(tmp_path, schedule, dp)
    facts = stages_call(text)
    assert facts.get("schedule", "1f1b") == schedule
    assert facts.get("dp", 1) == dp
    assert ("dp" in facts) == (dp != 1)
    assert f"torchrun --nproc-per-node {processes} pp_net.py --steps 100" in text
    doc = ast.get_docstring(ast.parse(text))
    if processes != 4:  # the ranks per replica x dp, said in words
        assert f"{processes} processes." in doc
        assert ("(data parallel, --dp)" in doc) == (dp != 1)
    else:
        assert "processes" not in doc
