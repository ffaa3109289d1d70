"""analysis.cache: which specs are decoders, which layers the KV cache swaps,
and the one note that says why a decoder's form cannot be cached."""

from __future__ import annotations

import pytest

from helpers import ROOT, write_spec
from mpgen.compiler import driver
from mpgen.compiler.analysis import cache
from mpgen.compiler.codegen.generate import cache_notes

CPU = {"*": "cpu"}

DECODER = """\
mpgen: 1
name: Tiny
inputs:
  idx: {{shape: [batch, seq], dtype: int64}}
layers:
  wte: {{op: Embedding, args: [16, 8], in: idx}}
  pos: {{op: torch.arange, in: [], args: ["=size(idx, 1)"]}}
  wpe: {{op: Embedding, args: [8, 8], in: pos}}
  emb: {{op: torch.add, in: [wte, wpe]}}
  qkv: {{op: Linear, args: [8, 24]}}
  split: {{op: torch.split, args: [8], dim: 2, outputs: [q, k, v]}}
  qh: {{op: torch.unflatten, in: q, dim: -1, sizes: [2, 4]}}
  kh: {{op: torch.unflatten, in: k, dim: -1, sizes: [2, 4]}}
  vh: {{op: torch.unflatten, in: v, dim: -1, sizes: [2, 4]}}
  qt: {{op: torch.transpose, in: qh, dim0: 1, dim1: 2}}
  kt: {{op: torch.transpose, in: kh, dim0: 1, dim1: 2}}
  vt: {{op: torch.transpose, in: vh, dim0: 1, dim1: 2}}
  att: {{op: F.scaled_dot_product_attention, in: [qt, kt, vt]{attention}}}
  merged: {{op: torch.transpose, dim0: 1, dim1: 2}}
  flat: {{op: torch.flatten, start_dim: 2}}
{extra}  head: {{op: Linear, args: [8, 16]}}
train:
  dims: {{seq: 8}}
"""


def _graph(tmp_path, attention=", is_causal: true", extra=""):
    spec = write_spec(tmp_path, DECODER.format(attention=attention, extra=extra))
    return driver.compile_spec(spec, CPU)


def test_a_causal_decoder_swaps_its_attention_and_its_positions(tmp_path):
    graph = _graph(tmp_path)
    plan = cache.plan(graph)
    assert plan.tokens == "idx" and plan.vocab == 16 and plan.cacheable
    assert plan.attention == {cache.Site(None, "att")}
    assert plan.positions == {cache.Site(None, "pos")}
    per_token, known = cache.bytes_per_token(graph, plan)
    assert per_token == {"cpu": 2 * 8 * 4} and known  # keys and values, 2 heads of 4, fp32
    assert cache_notes(graph) == []


def test_attention_that_sees_later_positions_has_no_cache(tmp_path):
    graph = _graph(tmp_path, attention="")
    plan = cache.plan(graph)
    assert not plan.cacheable
    (note,) = cache_notes(graph)
    assert note.startswith(f"{plan.problem[0]}: note: generate_tiny.py runs without a KV cache")
    assert "is_causal is not true" in note
    assert ":18:" in note.split(": note")[0]  # at the attention's line


def test_a_cumulative_sum_over_data_has_no_cache(tmp_path):
    extra = "  running: {op: torch.cumsum, in: flat, dim: 1}\n"
    plan = cache.plan(_graph(tmp_path, extra=extra))
    assert plan.problem[1] == "torch.cumsum mixes the sequence's positions"


def test_a_reduction_along_the_sequence_has_no_cache(tmp_path):
    extra = "  mixed: {op: torch.softmax, in: flat, dim: 1}\n"
    plan = cache.plan(_graph(tmp_path, extra=extra))
    assert plan.problem[1] == "torch.softmax runs along the sequence's dim"


def test_a_recurrent_language_model_names_its_lstm():
    graph = driver.compile_spec(ROOT / "examples" / "lstm_lm.yaml", CPU)
    plan = cache.plan(graph)
    if plan is None:  # not a decoder by the definition: nothing to say
        assert cache_notes(graph) == []
        return
    assert not plan.cacheable and "LSTM" in plan.problem[1]


def test_blocks_are_followed_through_their_instances():
    graph = driver.compile_spec(ROOT / "examples" / "tiny_llama.yaml", CPU)
    plan = cache.plan(graph)
    assert plan.cacheable
    assert plan.attention == {cache.Site("LlamaAttention", "attn")}
    # the rotary tables' positions, inside the block that makes them
    assert plan.positions == {cache.Site("LlamaRotaryEmbedding", "positions")}


def test_a_model_that_is_not_a_decoder_has_no_plan():
    graph = driver.compile_spec(ROOT / "examples" / "seed.yaml", CPU)
    assert cache.plan(graph) is None


@pytest.mark.slow  # 5 s: too long for the quick loop
def test_transformer_encoder_layers_with_a_causal_mask_are_cached():
    graph = driver.compile_spec(ROOT / "examples" / "gpt2_small.yaml", CPU)
    plan = cache.plan(graph)
    assert plan.cacheable and plan.attention == frozenset()
    assert plan.layers == {cache.Site(None, "h")}
    assert plan.positions == {cache.Site(None, "pos")}
    per_token, known = cache.bytes_per_token(graph, plan)
    assert per_token == {"cpu": 12 * 2 * 768 * 4} and known


def test_positions_counted_otherwise_than_by_arange_have_no_cache(tmp_path):
    """OPT's form: positions as a cumulative sum of ones the size of the
    sequence; the cache could not start them at its length."""
    spec = write_spec(tmp_path, """\
mpgen: 1
name: Counted
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  wte: {op: Embedding, args: [16, 8], in: idx}
  ones: {op: torch.ones, in: [], args: ["=size(idx, 0)", "=size(idx, 1)"], dtype: int64}
  counted: {op: torch.cumsum, dim: 1}
  wpe: {op: Embedding, args: [9, 8], in: counted}
  emb: {op: torch.add, in: [wte, wpe]}
  head: {op: Linear, args: [8, 16]}
train:
  dims: {seq: 8}
""")
    plan = cache.plan(driver.compile_spec(spec, CPU))
    assert not plan.cacheable
    assert plan.problem[1].startswith("torch.ones makes a tensor of the sequence's size")
    assert plan.problem[0].line == 7


def test_the_position_table_bounds_the_sequence(tmp_path):
    assert cache.plan(_graph(tmp_path)).table == 8  # wpe: Embedding(8, 8)
    graph = driver.compile_spec(ROOT / "examples" / "tiny_llama.yaml", CPU)
    assert cache.plan(graph).table is None  # rotary: no table


def test_multihead_attention_must_attend_a_sequence_to_itself(tmp_path):
    spec = write_spec(tmp_path, """\
mpgen: 1
name: Cross
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  wte: {op: Embedding, args: [16, 8], in: idx}
  other: {op: Linear, args: [8, 8]}
  attn: {op: MultiheadAttention, args: [8, 2], batch_first: true, in: [wte, other, other],
         output: 0, call: {is_causal: false}}
  head: {op: Linear, args: [8, 16]}
""")
    plan = cache.plan(driver.compile_spec(spec, CPU))
    assert plan.problem[1] == ("its query, key and value differ: the cache keeps a sequence "
                               "attending to itself")


def test_a_table_narrowed_to_the_sequence_has_no_cache(tmp_path):
    """Positions as the first rows of a Parameter (``wpe[:seq]``): the cache
    would read rows 0... again at every step."""
    spec = write_spec(tmp_path, """\
mpgen: 1
name: Narrowed
inputs:
  idx: {shape: [batch, 8], dtype: int64}
layers:
  wte: {op: Embedding, args: [16, 8], in: idx}
  table: {op: Parameter, shape: [8, 8]}
  wpe: {op: torch.narrow, in: table, args: [0, 0, "=size(idx, 1)"]}
  emb: {op: torch.add, in: [wte, wpe]}
  head: {op: Linear, args: [8, 16]}
""")
    plan = cache.plan(driver.compile_spec(spec, CPU))
    assert plan.problem[1].startswith("torch.narrow reads the first rows of a table")
    assert plan.problem[0].line == 8
