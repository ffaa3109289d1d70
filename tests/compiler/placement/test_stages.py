"""Pipeline stages (placement.stages): each section of the forward plan with
what it takes from the stage before and gives to the one after."""

from __future__ import annotations

import pytest

from helpers import EXAMPLES, write_spec
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.placement.stages import stages


def shape(path) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    return [(s.device, s.takes, s.gives) for s in stages(compile_spec(path))]


def test_the_seed_passes_one_tensor():
    assert shape(EXAMPLES / "seed.yaml") == [("cuda:0", ("x",), ("layer1",)),
                                            ("cuda:1", ("layer1",), ("layer2",))]


@pytest.mark.slow  # 6 s: too long for the quick loop
def test_skip_connections_and_outputs_are_passed_through_every_stage_between():
    # U-Net: the encoder's skips cross to the decoder's device.
    assert shape(EXAMPLES / "unet.yaml")[0][2] == ("inc", "down1", "down2", "down3")
    # Multi-task heads: the first head's output rides through the last stage.
    assert shape(EXAMPLES / "multitask.yaml") == [
        ("cuda:0", ("image", "features"), ("trunk_act",)),
        ("cuda:1", ("trunk_act",), ("trunk_act", "cls_head")),
        ("cuda:2", ("trunk_act", "cls_head"), ("cls_head", "reg_head"))]


def test_a_device_visited_twice_is_two_stages_and_inputs_enter_at_the_first(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: M
        inputs: {x: [batch, 4], y: [batch, 4]}
        layers:
          a: {op: Linear, args: [4, 4], in: x}
          b: {op: Linear, args: [4, 4]}
          c: {op: torch.add, in: [b, y]}
        placement: {a: cuda:0, b: cuda:1, c: cuda:0}
        """)
    # Variables keep the order they became available in: inputs first.
    assert shape(spec) == [("cuda:0", ("x", "y"), ("y", "a")),
                           ("cuda:1", ("y", "a"), ("y", "b")),
                           ("cuda:0", ("y", "b"), ("c",))]


def test_a_size_read_by_an_expression_is_taken(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: M
        inputs: {idx: {shape: [batch, seq], dtype: int64}}
        layers:
          emb: {op: Embedding, args: [10, 4], in: idx}
          fc: {op: Linear, args: [4, 4]}
          pos: {op: torch.arange, in: [], args: ["=size(idx, 1)"]}
        outputs: [fc, pos]
        placement: {emb: cuda:0, fc: cuda:1, pos: cuda:1}
        """)
    assert shape(spec)[1][1] == ("idx", "emb")
