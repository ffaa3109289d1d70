"""A model held in the user's own class (a head added, a different forward)
imports like the library's model itself (docs/import.md, "Which tracer").

Each wrapper is a module of the project (written into ``tmp_path``, the
working directory), imported with the real command line and no ``--trace``;
the spec is built for the CPU, the wrapper's own ``state_dict()`` loads into
the generated model strictly by name, and outputs and every gradient agree
within 1e-5. Ties inside a block (``GPT2LMHeadModel``'s head, held in a
wrapper) are the compiler's (docs/spec.md, "Tied parameters"): the first
tests build them from a hand-written spec.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
from torch import nn

from bench.common import let_torchvision_import
from helpers import build_to, import_generated, mpgen, write_spec
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError

CPU = {"*": "cpu"}

# -- ties inside a block (the compiler) ---------------------------------------------

TIED_BLOCK = """
mpgen: 1
name: Wrapper
inputs:
  idx: {shape: [batch, 8], dtype: int64}
blocks:
  Body:
    inputs: [idx]
    layers:
      wte: {op: Embedding, args: [50, 16]}
      ln: {op: LayerNorm, args: [16]}
      proj: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}}
      unproj: {op: Linear, args: [50, 16]}
  Seq2Seq:
    inputs: [idx]
    layers:
      encoder: {op: Body}
      decoder: {op: Body, in: idx}
      both: {op: torch.add, in: [encoder, decoder]}
      head: {op: Linear, args: [16, 50], bias: false, tie: {weight: decoder.wte.weight}}
layers:
  lm: {op: Seq2Seq}
  out: {op: torch.log_softmax, dim: -1}
"""


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)

        self.proj = nn.Linear(16, 50, bias=False)
        self.proj.weight = self.wte.weight
        self.unproj = nn.Linear(50, 16)

    def forward(self, idx):
        return self.unproj(self.proj(self.ln(self.wte(idx))))


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Body()
        self.decoder = Body()
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.decoder.wte.weight

    def forward(self, idx):
        return self.head(self.encoder(idx) + self.decoder(idx))


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = Seq2Seq()

    def forward(self, idx):
        return torch.log_softmax(self.lm(idx), dim=-1)


def _built(tmp_path, text: str, device_map=CPU):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    module = import_generated(tmp_path / "out" / file_names(result.graph)["model"])
    return result, getattr(module, result.graph.name)()


def test_ties_inside_a_block_share_one_parameter_as_pytorch_does(tmp_path):
    result, generated = _built(tmp_path, TIED_BLOCK)
    lm = generated.lm
    assert lm.head.weight is lm.decoder.wte.weight is lm.decoder.proj.weight
    assert lm.encoder.proj.weight is lm.encoder.wte.weight is not lm.decoder.wte.weight
    reference = Wrapper()
    assert sorted(generated.state_dict()) == sorted(reference.state_dict())
    assert [n for n, _ in generated.named_parameters()] == \
        [n for n, _ in reference.named_parameters()]
    assert result.graph.total_params == sum(p.numel() for p in reference.parameters())
    generated.load_state_dict(reference.state_dict(), strict=True)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    expected, got = reference(idx), generated(idx)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    expected.sum().backward()
    got.sum().backward()
    theirs = dict(reference.named_parameters())
    for name, param in generated.named_parameters():  # the tie's grad: all three uses
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-5)


def test_a_tie_inside_a_split_block_instance_is_the_models(tmp_path):
    """Placement splits ``lm``: its layers become the model's, and so do its
    ties, with owners by path; the one parameter moves once to cuda:1."""
    text = TIED_BLOCK + "placement:\n  lm.encoder: cuda:0\n  lm.decoder: cuda:1\n"
    result, _ = _built(tmp_path, text, device_map=CPU)
    ties = {(n.name, t.param): t.source for n in result.graph.nodes for t in n.ties}
    assert ties == {("lm.head", "weight"): "lm.decoder.wte.weight"}


@pytest.mark.parametrize("layers, message", [
    ("      head: {op: Linear, args: [16, 50], bias: false, tie: {weight: later.weight}}\n"
     "      later: {op: Embedding, args: [50, 16], in: idx}\n",
     "layer 'head' of block 'B': tie: weight: 'later' is not an earlier layer with parameters"),
    ("      wte: {op: Embedding, args: [50, 16]}\n"
     "      head: {op: Linear, args: [16, 40], bias: false, tie: {weight: wte.weight}}\n",
     "layer 'lm.head': tie: weight: (40, 16) cannot be wte.weight, which is (50, 16)"),
])
def test_a_bad_tie_inside_a_block_is_an_error_at_the_tie(tmp_path, layers, message):
    text = ("mpgen: 1\nname: Bad\ninputs:\n  idx: {shape: [batch, 8], dtype: int64}\n"
            "blocks:\n  B:\n    inputs: [idx]\n    layers:\n" + layers +
            "layers:\n  lm: {op: B}\n")
    with pytest.raises(MpgenError) as refused:
        _built(tmp_path, text)
    assert message in str(refused.value), str(refused.value)
