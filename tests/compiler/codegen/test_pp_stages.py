"""pp_<name>.py's STAGES: the spec's pipeline: defaults (schedule, dp), the
launch line's process count, and each stage's per-sample costs from the
cost model (NOTE [Pipeline program] in codegen/pp.py)."""

from __future__ import annotations

import ast

import pytest

from helpers import write_spec
from mpgen.compiler.analysis.schedule import stage_times
from mpgen.compiler.codegen.pp import render_pp
from mpgen.compiler.codegen.report import render_report
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


def test_the_report_says_the_ranks_and_replicas(tmp_path):
    graph, _ = build(tmp_path, "interleaved", 2)
    assert ("`pp_<name>.py` runs the spec's 4 stage(s) under `torchrun`, with the schedule "
            "`interleaved` by default: 2 rank(s) per replica of the pipeline, 2 replicas "
            "(data parallel).") in " ".join(render_report(graph).split())


def test_costs_are_one_samples_stage_times(tmp_path):
    graph, text = build(tmp_path)
    facts = stages_call(text)
    times = stage_times(graph)
    assert len(facts["costs"]) == len(facts["devices"]) == 4
    for (f, b), forward, backward in zip(facts["costs"], times.forward, times.backward):
        assert f == pytest.approx(forward / 16, rel=1e-3)
        assert b == pytest.approx(backward / 16, rel=1e-3)
    assert facts["transfers"] == pytest.approx([t / 16 for t in times.transfers], rel=1e-3)
    # Training FLOPs of a sample: 3 x forward's 2 x in x out per Linear.
    assert facts["flops"] == 3 * 2 * (8 * 16 + 16 * 32 + 32 * 16 + 16 * 4)
    # Four significant digits: a rebuild writes the same bytes.
    assert all(x == float(f"{x:.4g}") for pair in facts["costs"] for x in pair)
    assert build(tmp_path)[1] == text


def test_costs_follow_the_specs_stages_under_a_device_map(tmp_path):
    """--device-map cuda:1=cuda:0 puts the whole model on one device; the
    script still has the spec's four stages, and its costs four entries."""
    graph, text = build(tmp_path, device_map={"cuda:1": "cuda:0"})
    assert len(stage_times(graph).forward) == 1
    facts = stages_call(text)
    assert len(facts["costs"]) == 4 and len(facts["transfers"]) == 3
    assert facts["costs"] == stages_call(build(tmp_path)[1])["costs"]


def test_no_costs_where_the_stages_are_not_the_cost_models(tmp_path, monkeypatch):
    """Stages that are not runs of the cost model's units get no costs (the
    runtime predicts no bubble), the FLOPs still."""
    from mpgen.compiler.analysis import schedule

    def unmatched(graph, plan=None):
        raise ValueError("the plan's sections are not runs of units in order")

    monkeypatch.setattr(schedule, "stage_times", unmatched)
    facts = stages_call(build(tmp_path)[1])
    assert "costs" not in facts and "transfers" not in facts
    assert facts["flops"] == 3 * 2 * (8 * 16 + 16 * 32 + 32 * 16 + 16 * 4)
