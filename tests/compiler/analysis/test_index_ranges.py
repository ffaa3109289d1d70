"""Tables read with indices the spec computes (NOTE [Index ranges] in
mpgen/compiler/analysis/meta.py): meta kernels check no index, so the build
follows the range of ``torch.arange``'s values through the ops that keep,
shift or join them, and compares it with the table an ``Embedding`` reads.
The refusals' full messages are the ``shape_position_table_*`` fixtures of
tests/errors."""

from __future__ import annotations

import pytest

from helpers import write_spec
from mpgen.compiler import driver
from mpgen.errors import MpgenError

SPEC = """\
mpgen: 1
name: Positions
inputs:
  idx: {{shape: [batch, {seq}], dtype: int64}}
layers:
  wte: {{op: Embedding, args: [100, 16], in: idx}}
  pos: {{op: torch.arange, in: [], args: {arange}}}
{between}  wpe: {{op: Embedding, args: [{rows}, 16], in: {index}}}
  emb: {{op: torch.add, in: [wte, wpe]}}
{train}"""


def build(tmp_path, seq="seq", arange='["=size(idx, 1)"]', rows=64, between="",
          index="pos", dims=None):
    train = f"train:\n  dims: {{seq: {dims}}}\n" if dims is not None else ""
    path = write_spec(tmp_path, SPEC.format(seq=seq, arange=arange, rows=rows, between=between,
                                            index=index, train=train))
    return driver.compile_spec(path)


def refused(tmp_path, **kwargs) -> str:
    with pytest.raises(MpgenError) as error:
        build(tmp_path, **kwargs)
    return str(error.value)


def test_a_symbolic_dim_the_table_holds_at_its_training_size_builds(tmp_path):
    graph = build(tmp_path, dims=64)
    assert str(graph.node("wpe").out) == "[seq, 16]"
    # From position 1, a table of 64 rows holds 63 positions.
    build(tmp_path, arange='[1, "=size(idx, 1) + 1"]', dims=63)
    assert "indices up to 64" in refused(tmp_path, arange='[1, "=size(idx, 1) + 1"]', dims=64)


def test_a_sized_dim_that_reads_a_table_is_bounded_for_the_scripts(tmp_path):
    # The training script refuses data past the table (Training.dim_limits),
    # and an input an Embedding reads has that table's rows as its range.
    graph = build(tmp_path, dims=32)
    assert graph.dim_limits == (
        ("seq", 64, "layer 'wpe' (Embedding(64, 16)) has 64 rows, read at positions up to seq - 1"),)
    assert [t.high for t in graph.inputs] == [100]
    graph = build(tmp_path, arange='[1, "=size(idx, 1) + 1"]', dims=32)
    assert [limit[:2] for limit in graph.dim_limits] == [("seq", 63)]


def test_a_symbolic_dim_without_a_size_is_refused_at_the_tables_line(tmp_path):
    message = refused(tmp_path)
    assert message.startswith(f"{tmp_path / 'spec.yaml'}:8:3: layer 'wpe': Embedding(64, 16) "
                              "has 64 rows")
    assert "give seq a size of at most 64 in train.dims" in message
    # However many rows: the dim has no end.
    assert "any seq over 100,000" in refused(tmp_path, rows=100_000)
    # Positions from 1: one fewer fits; the bound says so.
    assert "any seq over 63" in refused(tmp_path, arange='[1, "=size(idx, 1) + 1"]')


def test_a_fixed_size_is_checked_against_the_table(tmp_path):
    build(tmp_path, seq="64")
    assert "indices up to 64, made by layer 'pos'" in refused(tmp_path, seq="65")
    assert "make the table at least 65 rows" in refused(tmp_path, seq="65")


@pytest.mark.parametrize("between, index", [
    ("  row: {op: torch.unsqueeze, in: pos, args: [0]}\n", "row"),
    ("  flat: {op: torch.reshape, in: pos, args: [[1, -1]]}\n", "flat"),
    ("  both: {op: torch.cat, in: [pos, pos]}\n", "both"),
    ("  later: {op: torch.add, in: pos, args: [1]}\n", "later"),
    ("  twice: {op: torch.mul, in: pos, args: [2]}\n", "twice"),
])
def test_the_range_follows_ops_that_move_join_or_shift_values(tmp_path, between, index):
    # Positions 0..63 (1..64 shifted, 0..126 doubled) in a table one row short.
    assert "IndexError" in refused(tmp_path, seq="64", between=between, index=index,
                                   rows={"later": 64, "twice": 126}.get(index, 63))


def test_clamp_bounds_the_range_and_an_unknown_op_drops_it(tmp_path):
    clamp = "  kept: {op: torch.clamp, in: pos, max: 63}\n"
    build(tmp_path, seq="100", between=clamp, index="kept")
    assert "indices up to 64" in refused(tmp_path, seq="100", index="kept",
                                         between=clamp.replace("63", "64"))
    # What the build cannot follow (the data in idx, an op it does not know)
    # is not guessed at: no refusal of a spec that may well be right.
    wrapped = "  wrapped: {op: torch.remainder, in: pos, args: [64]}\n"
    build(tmp_path, seq="100", between=wrapped, index="wrapped")


def test_f_embedding_reads_its_table_as_embedding_does(tmp_path):
    path = write_spec(tmp_path, """\
mpgen: 1
name: Functional
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  table: {op: Parameter, shape: [64, 16], init: ones}
  pos: {op: torch.arange, in: [], args: ["=size(idx, 1)"]}
  wpe: {op: F.embedding, in: [pos, table]}
""")
    with pytest.raises(MpgenError) as error:
        driver.compile_spec(path)
    assert ":8:3: layer 'wpe': F.embedding's table 'table' has 64 rows, but 'pos' reads it at " \
           "indices up to seq - 1" in str(error.value)
