"""Build-time shape inference, shape errors and parameter counts."""

from __future__ import annotations

import pytest

from helpers import EXAMPLES, write_spec
from mpgen.compiler import driver as build
from mpgen.errors import MpgenError


def compile_text(tmp_path, text):
    return build.compile_spec(write_spec(tmp_path, text))


def error_of(tmp_path, text) -> str:
    with pytest.raises(MpgenError) as info:
        compile_text(tmp_path, text)
    return str(info.value)


def test_resnet18_has_the_published_parameter_count_and_state_dict_names():
    graph = build.compile_spec(EXAMPLES / "resnet18.yaml")
    assert graph.total_params == 11_689_512
    assert str(graph.node("fc").out) == "[batch, 1000]"
    assert str(graph.node("layer4").out) == "[batch, 512, 7, 7]"
    assert [t.dst for t in graph.plan.transfers] == ["cuda:0", "cuda:1"]


@pytest.mark.slow  # 4 s: too long for the quick loop
def test_gpt2_small_counts_once_the_head_tied_to_the_embedding():
    graph = build.compile_spec(EXAMPLES / "gpt2_small.yaml")
    assert graph.total_params == 124_439_808  # GPT-2 small as published
    assert graph.params_by_device() == {"cuda:0": 81_911_040, "cuda:1": 42_528_768}
    assert graph.node("h").devices == ("cuda:0",) * 6 + ("cuda:1",) * 6
    assert str(graph.node("lm_head").out) == "[batch, seq, 50257]"


@pytest.mark.slow  # 5 s: too long for the quick loop
def test_bert_base_counts():
    graph = build.compile_spec(EXAMPLES / "bert_base.yaml")
    assert graph.total_params - graph.node("classifier").params == 109_482_240
    assert graph.node("encoder").params == 7_087_872
    assert graph.params_by_device()["cuda:1"] == 3 * 7_087_872


def test_block_parameter_counts_per_instance():
    graph = build.compile_spec(EXAMPLES / "resnet18.yaml")
    blocks = {b.name: b for b in graph.blocks}
    assert blocks["DownBlock"].params_count is None  # differs per use
    assert graph.node("layer1").params == 2 * (64 * 64 * 9) + 2 * 128
    assert graph.node("layer3_down").params == (
        128 * 256 * 9 + 256 * 256 * 9 + 128 * 256 + 3 * 2 * 256)


def test_symbolic_dims_stay_symbolic(tmp_path):
    graph = compile_text(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, seq, 16]
        layers:
          proj: {op: Linear, args: [16, 32]}
          flat: {op: torch.flatten, start_dim: 0, end_dim: 1}
          all: {op: torch.flatten, in: proj}
    """)
    assert str(graph.node("proj").out) == "[batch, seq, 32]"
    assert str(graph.node("flat").out) == "[batch*seq, 32]"
    assert str(graph.node("all").out) == "[batch*seq*32]"


def test_dtypes_are_inferred(tmp_path):
    graph = compile_text(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          ids: {shape: [batch, 5], dtype: int64}
        layers:
          emb: {op: Embedding, args: [100, 8]}
    """)
    assert graph.node("emb").out.dtype == "float32"
    assert graph.inputs[0].high == 100


def test_dtype_mismatch_is_a_build_error(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 8]
        layers:
          half_proj: {op: Linear, args: [8, 8], dtype: float16}
    """)
    assert "layer 'half_proj': Linear(8, 8, dtype=torch.float16) has float16 weights but x " \
           "gives float32" in message


def test_linear_mismatch_names_both_sides_at_the_layer_line(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 10]
        layers:
          layer1: {op: Linear, args: [10, 20]}
          layer2: {op: Linear, args: [30, 10]}
    """)
    assert message.endswith("spec.yaml:7:3: layer 'layer2': Linear(30, 10) expects input "
                            "[..., 30] but layer1 gives [batch, 20]")


def test_conv_channel_mismatch(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          img: [batch, 3, 32, 32]
        layers:
          conv: {op: Conv2d, args: [1, 8, 3]}
    """)
    assert "spec.yaml:6:3: layer 'conv': Conv2d(1, 8, 3) expects input [N, 1, H, W] but " \
           "img gives [batch, 3, 32, 32]" in message


def test_cat_mismatch_is_reported_with_symbolic_sizes(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          a: [batch, 4]
          b: [batch, 3, 2]
        layers:
          both: {op: torch.cat, in: [a, b], dim: 1}
    """)
    assert "spec.yaml:7:3: layer 'both': torch.cat(dim=1) fails on a [batch, 4], b [batch, 3, 2]" \
        in message


def test_shape_error_inside_a_block_points_at_the_block_layer(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 8]
        blocks:
          B:
            params: [d]
            layers:
              fc: {op: Linear, args: [$d, 8]}
        layers:
          ok: {op: B, args: [8]}
          bad: {op: B, args: [4]}
    """)
    assert "spec.yaml:9:7: layer 'bad.fc': Linear(4, 8) expects input [..., 4] but x gives " \
           "[batch, 8]" in message


def test_repeat_needs_matching_shapes(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 8]
        layers:
          grow: {op: Linear, args: [8, 16], repeat: 3}
    """)
    assert "spec.yaml:6:3: layer 'grow': repeat needs the output to match the input, but " \
           "[batch, 8] becomes [batch, 16]" in message


def test_bad_keyword_values_are_build_errors(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 8]
        layers:
          drop: {op: Dropout, p: 1.5}
    """)
    assert "spec.yaml:6:3: layer 'drop': Dropout(p=1.5) cannot be built" in message


def test_block_input_arity(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 8]
        blocks:
          Pair:
            inputs: [a, b]
            layers:
              sum: {op: torch.add, in: [a, b]}
        layers:
          p: {op: Pair}
    """)
    assert "layer 'p': block Pair takes 2 input(s) (a, b), got 1" in message


def test_a_block_may_take_integer_input(tmp_path):
    # The dtype checks apply to the layers inside, not to the block as a whole.
    graph = compile_text(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          ids: {shape: [batch, seq], dtype: int64}
        blocks:
          Embed:
            params: [vocab, dim]
            layers:
              emb: {op: Embedding, args: [$vocab, $dim]}
              norm: {op: LayerNorm, args: [$dim]}
        layers:
          embed: {op: Embed, args: [100, 16]}
    """)
    assert str(graph.node("embed").out) == "[batch, seq, 16]"
    assert graph.node("embed").params == 100 * 16 + 2 * 16


def test_a_tuple_output_needs_output_and_output_needs_a_tuple(tmp_path):
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, seq, 8]
        layers:
          rnn: {op: GRU, args: [8, 8], batch_first: true}
          fc: {op: Linear, args: [8, 2], output: 0}
    """)
    assert "layer 'rnn': GRU returns tuple, not a single tensor; make one element the " \
           "layer's output with 'output: 0' (0 to 1)" in message
    message = error_of(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 8]
        layers:
          fc: {op: Linear, args: [8, 2], output: 0}
    """)
    assert "layer 'fc': Linear returns a single Tensor; 'output: 0' selects from a tuple, " \
           "remove it" in message


def test_block_shape_comments_never_name_a_parameter_that_merely_has_the_value(tmp_path):
    # Issue 9, failure 6: half_channels equals out_channels in every use, so
    # the sizes cannot tell which one a dim comes from; the comment used to
    # name the first parameter with the value (``half_channels`` for the
    # expand conv's out_channels). A parameter that alone has the value in
    # every use still names the dim.
    graph = compile_text(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          x: [batch, 4, 8, 8]
        blocks:
          Expand:
            params: [in_channels, half_channels, out_channels]
            layers:
              same: {op: Identity}
              reduce: {op: Conv2d, args: [$in_channels, $half_channels, 1]}
              expand: {op: Conv2d, args: [$half_channels, $out_channels, 1]}
        layers:
          a: {op: Expand, args: [4, 8, 8]}
          b: {op: Expand, args: [8, 16, 16]}
    """)
    shapes = {name: str(t) for name, t in {b.name: b for b in graph.blocks}["Expand"].shapes}
    assert shapes == {"same": "[batch, in_channels, 8, 8]", "reduce": "[batch, ?, 8, 8]",
                      "expand": "[batch, ?, 8, 8]"}
    code = build.generate(tmp_path / "spec.yaml").files["m.py"]
    assert "half_channels, 8, 8]" not in code and "out_channels, 8, 8]" not in code
    assert "# [batch, ?, 8, 8]" in code
