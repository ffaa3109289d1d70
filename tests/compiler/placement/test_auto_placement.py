"""placement: auto, end to end through compile_spec; and the placement report."""

from __future__ import annotations

import re

import pytest

from helpers import EXAMPLES, write_spec
from mpgen.cli import main
from mpgen.compiler import driver as build
from mpgen.compiler.codegen import common as render
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.codegen.report import md_code, md_text, mermaid_text
from mpgen.errors import MpgenError

GPT2_AUTO = EXAMPLES / "gpt2_auto.yaml"


def devices_of(graph):
    return {n.name: n.devices for n in graph.nodes}


# -- the outside acceptance check -------------------------------------------

@pytest.mark.slow  # 7 s: too long for the quick loop
def test_gpt2_small_over_four_gpus_by_params(tmp_path):
    result = build.generate(GPT2_AUTO)
    graph = result.graph
    per_device = graph.params_by_device()
    assert max(per_device.values()) == 42_527_232
    assert sorted(per_device) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert graph.total_params == 163_037_184
    # Blocks are never split, and the stack is cut in the middle.
    assert devices_of(graph)["h"] == ("cuda:1",) * 6 + ("cuda:2",) * 6
    report = result.files["gpt2_auto.placement.md"]
    for device in per_device:
        assert f"`{device}`" in report
    assert "42,527,232" in report
    assert main(["build", str(GPT2_AUTO), "-o", str(tmp_path)]) == 0
    assert (tmp_path / "gpt2_auto.placement.md").read_text() == report


# -- choosing ----------------------------------------------------------------

LINEARS = """
    mpgen: 1
    name: Chain
    inputs:
      x: [batch, 64]
    layers:
      a: {{op: Linear, args: [64, 64]}}
      b: {{op: Linear, args: [64, 64]}}
      c: {{op: Linear, args: [64, 64]}}
      d: {{op: Linear, args: [64, 64]}}
    placement:
      auto:
        {auto}
    train: {{batch_size: 2}}
"""


def chain(tmp_path, auto: str):
    body = "\n        ".join(auto.strip().splitlines())
    return write_spec(tmp_path, LINEARS.format(auto=body))


def test_params_balance_splits_evenly(tmp_path):
    graph = compile_spec(chain(tmp_path, "devices: [cuda:0, cuda:1]\nbalance: params"))
    assert [n.devices[0] for n in graph.nodes] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_every_device_gets_a_unit(tmp_path):
    graph = compile_spec(chain(tmp_path, "devices: [cuda:0, cuda:1, cuda:2, cuda:3]"))
    assert [n.devices[0] for n in graph.nodes] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_speed_divides_the_load(tmp_path):
    graph = compile_spec(chain(tmp_path, "devices: [cuda:0, cuda:1]\nbalance: flops\n"
                                         "speed: {cuda:0: 3.0}"))
    assert [n.devices[0] for n in graph.nodes] == ["cuda:0", "cuda:0", "cuda:0", "cuda:1"]


def test_device_map_applies_after_choosing(tmp_path):
    path = chain(tmp_path, "devices: [cuda:0, cuda:1]")
    graph = compile_spec(path, {"cuda:1": "cpu"})
    assert [n.devices[0] for n in graph.nodes] == ["cuda:0", "cuda:0", "cpu", "cpu"]
    assert graph.device_map == (("cuda:1", "cpu"),)


def test_flops_balance_uses_flops_not_params(tmp_path):
    # The same parameters, but the conv runs over 32x32 positions: 1024x the FLOPs.
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Mixed
        inputs:
          x: [batch, 16, 32, 32]
        layers:
          conv: {op: Conv2d, args: [16, 16, 1]}
          pool: {op: AdaptiveAvgPool2d, args: [1]}
          flat: {op: torch.flatten, start_dim: 1}
          fc1: {op: Linear, args: [16, 16]}
          fc2: {op: Linear, args: [16, 16]}
          fc3: {op: Linear, args: [16, 16]}
        placement:
          auto: {devices: [cuda:0, cuda:1], balance: flops}
        train: {batch_size: 2}
    """)
    by_flops = devices_of(compile_spec(path))
    # The conv alone is the bottleneck; the FLOP-free pool and flatten join it
    # because the cut after them is 128 bytes instead of 128 KiB.
    assert by_flops["conv"] == by_flops["flat"] == ("cuda:0",)
    assert by_flops["fc1"] == ("cuda:1",)
    path.write_text(path.read_text().replace("balance: flops", "balance: params"))
    by_params = devices_of(compile_spec(path))
    assert by_params["fc1"] == ("cuda:0",)


def test_capacity_moves_layers_off_a_small_device(tmp_path):
    # Each Linear(64, 64) needs about 33 KiB for training with SGD (weights,
    # grads, a saved input); cuda:0 holds only one.
    graph = compile_spec(chain(tmp_path, "devices: [cuda:0, cuda:1]\ncapacity: {cuda:0: 40KiB}"))
    assert [n.devices[0] for n in graph.nodes] == ["cuda:0", "cuda:1", "cuda:1", "cuda:1"]


def test_capacity_error_names_the_layer_at_the_placement_key(tmp_path):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Big
        inputs:
          x: [batch, 256]
        layers:
          h: {op: Linear, args: [256, 256], bias: false, repeat: 3}
        placement:
          auto:
            devices: [cuda:0, cuda:1]
            capacity: {cuda:0: 1MiB, cuda:1: 1MiB}
        train: {batch_size: 1}
    """)
    with pytest.raises(MpgenError) as info:
        compile_spec(path)
    message = str(info.value)
    assert re.fullmatch(
        # h.2 also keeps the model output (1 KiB) for the loss.
        re.escape(str(path)) + r":7:1: placement: layer 'h\.2' \(514\.0 KiB\) does not fit: "
        r"the largest remaining capacity is 511\.0 KiB", message), message


def test_a_unit_larger_than_every_capacity(tmp_path, capsys):
    path = chain(tmp_path, "devices: [cuda:0, cuda:1]\ncapacity: {cuda:0: 1KiB, cuda:1: 2KiB}")
    assert main(["build", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:10:1: placement: layer 'a' (")
    assert "does not fit: the largest capacity is 2.0 KiB" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_capacity_for_an_unlisted_device_is_an_error(tmp_path):
    path = chain(tmp_path, "devices: [cuda:0, cuda:1]\ncapacity: {cuda:2: 1GiB}")
    with pytest.raises(MpgenError, match=r":13:16: placement.auto.capacity: 'cuda:2' is not "
                                         r"one of the devices \(cuda:0, cuda:1\)"):
        compile_spec(path)


def test_a_size_with_a_non_ascii_letter_is_invalid_not_a_crash(tmp_path):
    # 'ı' (dotless i) matches 'i' case-insensitively outside ASCII; its unit is no unit.
    path = chain(tmp_path, "devices: [cuda:0, cuda:1]\ncapacity: {cuda:0: 1K\u0131B}")
    with pytest.raises(MpgenError, match=r"invalid memory size '1K\u0131B'"):
        compile_spec(path)


def test_explicit_beside_auto_is_an_error_not_ignored(tmp_path):
    path = chain(tmp_path, "devices: [cuda:0, cuda:1]")
    path.write_text(path.read_text().replace("train:", "  explicit: {a: cuda:1}\ntrain:"))
    with pytest.raises(MpgenError, match=r"placement: \{auto: \.\.\.\} stands alone"):
        compile_spec(path)


def test_fewer_units_than_devices_leaves_the_last_ones_empty(tmp_path):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Two
        inputs:
          x: [batch, 4]
        layers:
          a: {op: Linear, args: [4, 4]}
          b: {op: Linear, args: [4, 4]}
        placement:
          auto: {devices: [cuda:0, cuda:1, cuda:2]}
    """)
    result = build.generate(path)
    assert result.graph.devices == ("cuda:0", "cuda:1")
    report = result.files["two.placement.md"]
    assert "| `cuda:2` | (none) |" in report


# -- the report --------------------------------------------------------------

def test_report_of_an_explicit_layout(tmp_path):
    result = build.generate(EXAMPLES / "residual_mlp.yaml")
    names = render.file_names(result.graph)
    report = result.files[names["report"]]
    assert names["report"] == "residual_mlp.placement.md"
    assert report.startswith("<!-- Generated by mpgen from examples/residual_mlp.yaml. DO NOT "
                             "EDIT. -->\n")
    assert "**Explicit.**" in report
    assert "| `cuda:0` | `embed`, `norm1`, `fc1`, `act1`, `proj1`, `res1` |" in report
    # Transfers: the skip connection res1 and the main path proj1 cross to cuda:1.
    assert "| `res1` | `cuda:0` | `cuda:1` | `[batch, 128]` | 32,768 (32.0 KiB) |" in report
    assert "```mermaid\nflowchart TD\n" in report
    assert "classDef dev0 fill:" in report and "classDef dev1 fill:" in report
    assert "  n4 --> n5\n" in report  # proj1 -> res1, same device
    assert '  n5 -->|"cuda:0 to cuda:1, 32.0 KiB"| n10\n' in report  # res1 -> res2
    assert "% of capacity" not in report


def test_report_of_the_default_layout(tmp_path):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: One
        inputs:
          x: [batch, 4]
        layers:
          a: {op: Linear, args: [4, 4]}
    """)
    report = build.generate(path).files["one.placement.md"]
    assert "**Default.**" in report
    assert str(tmp_path) not in report


def test_report_of_an_auto_layout_with_capacity(tmp_path):
    path = chain(tmp_path, "devices: [cuda:0, cuda:1]\nbalance: memory\n"
                           "capacity: {cuda:0: 1MiB, cuda:1: 1MiB}")
    report = build.generate(path).files["chain.placement.md"]
    assert "balance **memory**" in report
    assert "Bottleneck: **" in report
    assert "% of capacity" in report and "% of 1.0 MiB" in report
    assert "capacities `cuda:0` 1.0 MiB, `cuda:1` 1.0 MiB" in report


@pytest.mark.slow  # 19 s: too long for the quick loop
def test_report_is_deterministic_and_check_covers_it(tmp_path):
    first = build.generate(GPT2_AUTO).files
    second = build.generate(GPT2_AUTO).files
    assert first == second
    out = tmp_path / "out"
    assert main(["build", str(GPT2_AUTO), "-o", str(out)]) == 0
    report = out / "gpt2_auto.placement.md"
    report.write_text(report.read_text().replace("42,527,232", "1"))
    assert main(["check", str(GPT2_AUTO), "-o", str(out)]) == 1


def test_escaping_of_spec_strings():
    assert md_code("a|b") == "`a\\|b`"
    assert md_code("x`y") == "`` x`y ``"
    assert md_text("a_b*<c>") == "a\\_b\\*&lt;c&gt;"
    assert mermaid_text('h.0-5 "x"<br>') == "h.0-5 #34;x#34;#60;br#62;"
