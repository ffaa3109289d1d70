"""`mpgen place --write`: the shortest explicit form that gives the same layout."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import EXAMPLES, write_spec
from mpgen.cli import main
from mpgen.commands.place import place, shortest_entries
from mpgen.compiler.driver import compile_spec, generate

#: Six instances of ``h`` between two plain layers; the placement is filled in.
STACK = """\
mpgen: 1
name: Stack
inputs:
  x: [batch, 8]
layers:
  a: {{op: Linear, args: [8, 8]}}
  h: {{op: Linear, args: [8, 8], repeat: 6}}
  z: {{op: Linear, args: [8, 8]}}
placement:
{placement}
train: {{batch_size: 2}}
"""


def stack(tmp_path, *entries: str):
    path = tmp_path / "stack.yaml"
    path.write_text(STACK.format(placement="".join(f"  {e}\n" for e in entries)))
    return path


def devices(path, device_map=None):
    return [(n.name, n.devices) for n in compile_spec(path, device_map).nodes]


def block(path) -> list[str]:
    """The placement block's lines, without its comments."""
    lines = path.read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("placement:")))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        if not line.lstrip().startswith("#"):
            body.append(line)
    return body


@pytest.mark.slow
def test_a_two_line_placement_round_trips_to_the_same_two_lines(tmp_path, capsys):
    path = tmp_path / "resnet18.yaml"
    original = (EXAMPLES / "resnet18.yaml").read_text()
    path.write_text(original)
    assert block(path) == ["  conv1: cuda:0", "  layer3_down: cuda:1"]
    graph = compile_spec(path)
    assert len(graph.units) > 10  # the old --write named every one of them
    assert shortest_entries(graph, [("conv1", "cuda:0"), ("layer3_down", "cuda:1")]) == [
        ("conv1", "cuda:0"), ("layer3_down", "cuda:1")]
    # Swapping the devices changes the two values and nothing else ...
    assert main(["place", str(path), "--write", "--device-map", "cuda:0=cuda:1,cuda:1=cuda:0"]) == 0
    assert block(path) == ["  conv1: cuda:1", "  layer3_down: cuda:0"]
    comment = [line for line in path.read_text().splitlines() if line.startswith("  # ")]
    assert comment == [
        "  # mpgen place --write: explicit (devices renamed by --device-map "
        "cuda:0=cuda:1,cuda:1=cuda:0),",
        "  # shortest form: 2 bookmarks, one per device run, keeping 2 keys of the old block",
    ]
    # ... and swapping them back gives the spec's own two lines again.
    assert main(["place", str(path), "--write", "--device-map", "cuda:0=cuda:1,cuda:1=cuda:0"]) == 0
    assert block(path) == ["  conv1: cuda:0", "  layer3_down: cuda:1"]
    assert devices(path) == devices(EXAMPLES / "resnet18.yaml")
    lines = path.read_text().splitlines()
    assert [line for line in lines if not line.startswith("  # ")] == original.splitlines()


@pytest.mark.slow  # 40 s: too long for the quick loop
def test_an_automatic_gpt_writes_one_bookmark_per_device(tmp_path):
    path = tmp_path / "gpt2_auto.yaml"
    path.write_bytes((EXAMPLES / "gpt2_auto.yaml").read_bytes())
    placed = place(path)
    assert len(placed.graph.units) == 17 and placed.graph.repeats["h"] == 12
    assert placed.shortest == (("wte", "cuda:0"), ("h.0-5", "cuda:1"), ("h.6-11", "cuda:2"),
                               ("ln_f", "cuda:3"))
    assert main(["place", str(path), "--write"]) == 0
    assert block(path) == ["  wte: cuda:0", "  h.0-5: cuda:1", "  h.6-11: cuda:2",
                           "  ln_f: cuda:3"]
    text = path.read_text()
    assert ("  # mpgen place --write: auto (balance params over 4 devices; bottleneck "
            "42,527,232 parameters on cuda:1),\n"
            "  # shortest form: 4 bookmarks, one per device run; it replaced:\n"
            "  #   auto:\n") in text


@pytest.mark.slow  # 37 s: too long for the quick loop
def test_the_written_spec_builds_to_the_same_layout(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, new = tmp_path / "old" / "gpt2_auto.yaml", tmp_path / "new" / "gpt2_auto.yaml"
    old.write_bytes((EXAMPLES / "gpt2_auto.yaml").read_bytes())
    new.write_bytes(old.read_bytes())
    assert main(["place", str(new), "--write"]) == 0
    before, after = generate(old), generate(new)
    assert after.graph.layout.method == "explicit"
    assert [n.devices for n in after.graph.nodes] == [n.devices for n in before.graph.nodes]
    assert after.graph.plan == before.graph.plan

    def code(files):  # the model, less the line with the spec's digest
        return [line for line in files["gpt2_auto.py"].splitlines() if "sha256" not in line]

    assert code(after.files) == code(before.files)


def test_a_device_used_twice_gets_the_fewest_entries_as_ranges(tmp_path):
    path = stack(tmp_path, "a: cuda:0", "h.2: cuda:1", "h.4: cuda:0")
    graph = compile_spec(path)
    # Runs: a, h.0-1 | h.2-3 | h.4-5, z. Named afresh, each run from its first unit.
    assert shortest_entries(graph) == [("a", "cuda:0"), ("h.2-3", "cuda:1"),
                                       ("h.4-5", "cuda:0")]
    # The spec's own keys are kept where they still fit.
    assert shortest_entries(graph, [("a", "cuda:0"), ("h.2", "cuda:1"), ("h.4", "cuda:0")]) == [
        ("a", "cuda:0"), ("h.2", "cuda:1"), ("h.4", "cuda:0")]
    mapped = devices(path, {"cuda:0": "cuda:2"})
    assert main(["place", str(path), "--write", "--device-map", "cuda:0=cuda:2"]) == 0
    assert block(path) == ["  a: cuda:2", "  h.2: cuda:1", "  h.4: cuda:2"]
    assert devices(path) == mapped


def test_every_instance_named_shrinks_to_one_entry_per_run(tmp_path):
    path = stack(tmp_path, "a: cuda:0", "h.0: cuda:0", "h.1: cuda:0", "h.2: cuda:1",
                 "h.3: cuda:1", "h.4-5: cuda:0", "z: cuda:0")
    graph = compile_spec(path)
    current = [(e.key, e.device) for e in graph.placement.entries]
    # A key inside the first run may stand anywhere in it; later runs need their first unit.
    assert shortest_entries(graph, current) == [("a", "cuda:0"), ("h.2", "cuda:1"),
                                                ("h.4-5", "cuda:0")]
    # A key that now spans two runs, or starts inside a run, is not kept.
    moved = stack(tmp_path, "a: cuda:0", "h.3: cuda:1", "z: cuda:0")
    assert shortest_entries(compile_spec(moved), [("h.2-3", "cuda:1"), ("h.4", "cuda:0")]) == [
        ("a", "cuda:0"), ("h.3-5", "cuda:1"), ("z", "cuda:0")]


def test_a_repeated_layer_wholly_on_one_device_is_named_alone(tmp_path):
    path = stack(tmp_path, "a: cuda:0", "h: cuda:1", "z: cuda:2")
    assert shortest_entries(compile_spec(path)) == [("a", "cuda:0"), ("h", "cuda:1"),
                                                    ("z", "cuda:2")]


def test_everything_on_cuda0_writes_the_default(tmp_path):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Two
        inputs:
          x: [batch, 4]
        layers:
          a: {op: Linear, args: [4, 4]}
          b: {op: Linear, args: [4, 4]}
        placement:   # two GPUs
          a: cuda:0
          b: cuda:1
        train: {batch_size: 2}
    """)
    assert main(["place", str(path), "--write", "--device-map", "cuda:1=cuda:0"]) == 0
    text = path.read_text()
    assert ("placement: {}   # two GPUs\n"
            "  # mpgen place --write: explicit (devices renamed by --device-map cuda:1=cuda:0),\n"
            "  # shortest form: the default (no entries: every layer on cuda:0)\n"
            "train: {batch_size: 2}\n") in text
    graph = compile_spec(path)
    assert graph.layout.method == "default"
    assert [n.devices for n in graph.nodes] == [("cuda:0",), ("cuda:0",)]


def test_a_spec_without_placement_on_the_default_is_left_alone(tmp_path, capsys):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Plain
        inputs:
          x: [batch, 4]
        layers:
          a: {op: Linear, args: [4, 4]}
    """)
    original = path.read_text()
    assert main(["place", str(path), "--write"]) == 0
    assert capsys.readouterr().out.startswith(f"unchanged: {path}")
    assert path.read_text() == original


def test_the_comments_of_an_explicit_block_stay_with_the_keys_kept(tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text(STACK.format(placement=(
        "  # the embedding\n"
        "  a: cuda:0   # small\n"
        "  # the stack, in two\n"
        "  h.2: cuda:1   # second part\n"
        "  # redundant\n"
        "  h.4: cuda:1   # goes\n"
        "  # the end\n")).replace("placement:\n", "placement:   # by hand\n"))
    mapped = devices(path, {"cuda:1": "cuda:2"})
    assert main(["place", str(path), "--write", "--device-map", "cuda:1=cuda:2"]) == 0
    written = (
        "placement:   # by hand\n"
        "  # mpgen place --write: explicit (devices renamed by --device-map cuda:1=cuda:2),\n"
        "  # shortest form: 2 bookmarks, one per device run, keeping 2 keys of the old block\n"
        "  # the embedding\n"
        "  a: cuda:0   # small\n"
        "  # the stack, in two\n"
        "  h.2: cuda:2   # second part\n"
        "  # redundant\n"
        "  # the end\n"
        "\ntrain:")
    assert written in path.read_text()
    assert devices(path) == mapped
    # Written again, mpgen's own two lines are replaced, not repeated.
    assert main(["place", str(path), "--write", "--device-map", "cuda:2=cuda:1"]) == 0
    assert written.replace("cuda:1=cuda:2", "cuda:2=cuda:1").replace(
        "h.2: cuda:2", "h.2: cuda:1") in path.read_text()


@pytest.fixture(scope="module")
def two_stacks(tmp_path_factory):
    """A graph with plain layers around two repeated ones, to give layouts to."""
    path = tmp_path_factory.mktemp("stacks") / "stacks.yaml"
    path.write_text(STACK.format(placement="  a: cuda:0").replace(
        "  z: {op: Linear, args: [8, 8]}\n",
        "  m: {op: Linear, args: [8, 8]}\n  g: {op: Linear, args: [8, 8], repeat: 3}\n"
        "  z: {op: Linear, args: [8, 8]}\n"))
    return compile_spec(path)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_layout_gets_one_entry_per_run_and_resolves_to_itself(two_stacks, data):
    graph = two_stacks
    devices_ = ["cuda:0", "cuda:1", "cuda:2"]
    layout = [tuple(data.draw(st.sampled_from(devices_)) for _ in range(node.instances))
              for node in graph.nodes]
    graph = dataclasses.replace(graph, nodes=tuple(
        dataclasses.replace(node, devices=ds) for node, ds in zip(graph.nodes, layout)))
    flat = [d for ds in layout for d in ds]
    runs = 1 + sum(a != b for a, b in zip(flat, flat[1:]))
    # Any keys as the "current" block: they only choose among the shortest forms.
    keys = [f"{n.name}.{k}" if n.repeat else n.name
            for n in graph.nodes for k in range(n.instances)]
    current = data.draw(st.lists(st.tuples(st.sampled_from(keys + ["h", "h.1-4", "g.0-1"]),
                                           st.sampled_from(devices_)), max_size=6))
    entries = shortest_entries(graph, current)  # raises if they do not resolve to the layout
    assert len(entries) == (0 if set(flat) == {"cuda:0"} else runs)
