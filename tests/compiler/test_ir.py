"""The IR's small types: placement units and their labels, values, symbolic dims."""

from __future__ import annotations

import pytest

from mpgen.compiler import driver
from mpgen.compiler.ir import SymDim, TensorType, UnitRange, UnitRef, ValueRef, unit_labels

from helpers import EXAMPLES


def test_unit_labels_compress_runs_of_instances():
    units = [UnitRef("a"), UnitRef("h", 0), UnitRef("h", 1), UnitRef("h", 2), UnitRef("h", 4)]
    assert unit_labels(units) == ["a", "h.0-2", "h.4"]
    every = [UnitRef("h", k) for k in range(6)]
    assert unit_labels(every) == ["h.0-5"]
    assert unit_labels(every, {"h": 6}, whole=True) == ["h"]
    assert unit_labels(every[:5], {"h": 6}, whole=True) == ["h.0-4"]
    # Instances of different layers never merge, nor do gaps.
    assert unit_labels([UnitRef("g", 0), UnitRef("h", 1)]) == ["g.0", "h.1"]


@pytest.mark.parametrize("label", ["embed", "h.3", "h.0-5", "h.10-2", "model.layers.16-31",
                                   "model.norm"])
def test_unit_range_labels_round_trip(label):
    assert str(UnitRange.parse(label)) == label


@pytest.mark.parametrize("label", ["", "h.", "h.1-", "h.-2", "1h", "h.2.x", "h..x"])
def test_unit_range_parse_refuses_what_is_not_a_label(label):
    assert UnitRange.parse(label) is None


def test_unit_range_parse_gives_the_instances():
    assert UnitRange.parse("h.0-5") == UnitRange("h", 0, 5)
    # A layer inside a split block instance is named by its path.
    assert UnitRange.parse("model.layers.3") == UnitRange("model.layers", 3, 3)
    assert UnitRange.parse("h.3") == UnitRange("h", 3, 3)
    assert UnitRange.parse("h") == UnitRange("h")


def test_sym_dims_print_and_size_as_written():
    batch_seq = SymDim(("batch", "seq"), 768)
    assert str(batch_seq) == "batch*seq*768"
    assert str(SymDim.named("batch")) == "batch"
    assert str(SymDim(known=False)) == "?"
    assert batch_seq.size({"batch": 2, "seq": 3}) == 2 * 3 * 768
    assert batch_seq.size({"batch": 2}) is None
    assert SymDim(known=False).size({"batch": 2}) is None


def test_tensor_types_at_concrete_sizes():
    t = TensorType((SymDim.named("batch"), SymDim(known=False), 4), "float16")
    assert str(t) == "[batch, ?, 4]"
    assert t.symbols == ("batch",)
    assert t.concrete({"batch": 3}) == (3, None, 4)
    assert t.numel({"batch": 3}) == 12  # an unknown dim counts as 1
    assert t.nbytes({"batch": 3}) == 24


@pytest.mark.slow  # 12 s: too long for the quick loop
def test_a_repeated_layer_split_over_devices_moves_the_output_of_an_instance():
    graph = driver.compile_spec(EXAMPLES / "gpt2_small.yaml")
    moved = [t.value for t in graph.plan.transfers if t.src is not None]
    # h.5's output, then what the blocks and the tied head on cuda:1 also read:
    # the causal mask and the embedding's weight.
    assert moved[0] == ValueRef("h", 5)
    assert [str(v) for v in moved] == ["h.5", "causal", "wte.weight"]
    assert str(moved[0]) == "h.5" and moved[0].name == "h"
    assert graph.node("h").units[:2] == (UnitRef("h", 0), UnitRef("h", 1))
    assert graph.node("wte").units == (UnitRef("wte"),)


@pytest.mark.slow  # 13 s: too long for the quick loop
def test_modules_and_functions_keep_constructor_and_call_arguments_apart():
    graph = driver.compile_spec(EXAMPLES / "gpt2_small.yaml")
    lm_head = graph.node("lm_head")
    assert lm_head.init.positional == (768, 50257) and not lm_head.call
    embed = graph.node("embed")  # torch.add(wte, wpe)
    assert not embed.init
