"""A tie on a block instance, of a parameter inside it (docs/spec.md, "Tied
parameters"): ``tie: {embed.weight: enc.embed.weight}``, as T5's decoder
reads the embedding its encoder holds. Built, the two instances hold one
parameter under both keys, trained by both uses, on one device or two; a key
that is no parameter path is refused at its line."""

from __future__ import annotations

import pytest
import torch

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError
from mpgen.testing.virtual import virtual_devices

SPEC = """
mpgen: 1
name: Shared
inputs:
  src: {shape: [batch, 6], dtype: int64}
  tgt: {shape: [batch, 6], dtype: int64}
blocks:
  Stack:
    inputs: [ids]
    layers:
      embed: {op: Embedding, args: [16, 8]}
      fc: {op: Linear, args: [8, 8]}
layers:
  enc: {op: Stack, in: src}
  dec: {op: Stack, in: tgt, tie: {embed.weight: enc.embed.weight}}
  out: {op: torch.add, in: [enc, dec]}
"""


def _build(tmp_path, text, device_map):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    path = tmp_path / "out" / file_names(result.graph)["model"]
    return getattr(import_generated(path), result.graph.name), path.read_text()


def test_one_parameter_under_both_keys_trained_by_both_uses(tmp_path):
    Model, code = _build(tmp_path, SPEC, {"*": "cpu"})
    assert "self.dec.embed.weight = self.enc.embed.weight" in code
    model = Model()
    assert model.dec.embed.weight is model.enc.embed.weight
    assert {"enc.embed.weight", "dec.embed.weight"} <= set(model.state_dict())
    assert sum(p.numel() for p in model.parameters()) == 16 * 8 + 2 * (8 * 8 + 8)
    src = torch.randint(0, 16, (2, 6))
    model(src, torch.zeros_like(src)).sum().backward()
    both = model.enc.embed.weight.grad
    assert both[0].abs().sum() > 0 and both[src.flatten()].abs().sum() > 0  # each use's rows


def test_across_devices(tmp_path):
    Model, code = _build(tmp_path, SPEC + "placement:\n  enc: cuda:0\n  dec: cuda:1\n", None)
    with virtual_devices(2):
        model = Model()
        src = torch.randint(0, 16, (2, 6))
        out = model(src, src)
        out.sum().backward()
        assert model.enc.embed.weight.grad is not None
        assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))


@pytest.mark.parametrize("tie, message", [
    ("{embed.class: enc.embed.weight}",
     "14:35: layer 'dec': tie: 'class' is a Python keyword, not a keyword argument name"),
    ("{embed.wieght: enc.embed.weight}",
     "14:49: layer 'dec': tie: embed.wieght: Stack has no parameter 'embed.wieght' (did you "
     "mean 'embed.weight'?)"),
])
def test_a_bad_parameter_path_is_an_error_at_the_tie(tmp_path, tie, message):
    text = SPEC.replace("tie: {embed.weight: enc.embed.weight}", f"tie: {tie}")
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert f"spec.yaml:{message}" in str(info.value)
