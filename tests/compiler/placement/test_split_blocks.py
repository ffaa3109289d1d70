"""Placement inside a block instance (``model.layers.2-3: cuda:1``,
``model.norm: cuda:1``): the instance is split, its layers placed one by
one, and the generated model keeps the state-dict keys of the unsplit
block, so a reference written with the same hierarchy loads strictly with
no key mapping and gives the same outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.errors import MpgenError
from mpgen.testing.virtual import virtual_devices

SPEC = """
mpgen: 1
name: TinyLM
inputs:
  ids: {shape: [batch, seq], dtype: int64}
blocks:
  Layer:
    params: [dim]
    layers:
      norm: {op: LayerNorm, args: [$dim]}
      fc: {op: Linear, args: [$dim, "=2 * $dim"]}
      act: {op: F.gelu}
      proj: {op: Linear, args: ["=2 * $dim", $dim]}
      add: {op: torch.add, in: [x, proj]}
  Body:
    params: [vocab, dim, depth]
    inputs: [ids]
    layers:
      embed: {op: Embedding, args: [$vocab, $dim]}
      scale: {op: Parameter, shape: [$dim], init: ones}
      scaled: {op: torch.mul, in: [embed, scale]}
      layers: {op: Layer, args: [$dim], repeat: 4}
      norm: {op: LayerNorm, args: [$dim]}
layers:
  model: {op: Body, args: [64, 16, 4]}
  lm_head: {op: Linear, args: [16, 64], bias: false}
"""
SPLIT = """placement:
  model.layers.0-1: cuda:0
  model.layers.2-3: cuda:1
  model.norm: cuda:1
  lm_head: cuda:1
"""


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Body(nn.Module):
    def __init__(self, vocab, dim, depth):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.layers = nn.ModuleList(Layer(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Body(64, 16, 4)
        self.lm_head = nn.Linear(16, 64, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def build(tmp_path, text, device_map=None):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    path = tmp_path / "out" / "tiny_lm.py"
    return result.graph, import_generated(path).TinyLM, path.read_text()


def check_against_reference(model):
    reference = Reference()
    with torch.no_grad():  # a perturbed scale and norms: every parameter matters
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.randint(0, 64, (3, 5))
    out, want = model(ids), reference(ids)
    assert torch.equal(out.cpu(), want)
    out.sum().backward()
    want.sum().backward()
    ours = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(ours[name].grad.cpu(), p.grad), name


def test_a_split_instance_keeps_the_keys_of_the_unsplit_block(tmp_path):
    graph, Model, code = build(tmp_path, SPEC + SPLIT, {"*": "cpu"})
    assert [s.path for s in graph.splits] == ["model"]
    assert list(Model().state_dict()) == list(Reference().state_dict())
    check_against_reference(Model())
    assert "self.model = nn.Module()" in code and "class Body" not in code


def test_a_split_instance_over_two_devices(tmp_path):
    graph, Model, code = build(tmp_path, SPEC + SPLIT)
    devices = {n.name: n.devices for n in graph.nodes}
    assert devices["model.embed"] == ("cuda:0",)  # not named: the instance's device
    assert devices["model.layers"] == ("cuda:0", "cuda:0", "cuda:1", "cuda:1")
    assert devices["model.norm"] == devices["lm_head"] == ("cuda:1",)
    assert "for block in self.model.layers[2:4]:" in code
    with virtual_devices(2):
        check_against_reference(Model())


def test_the_unsplit_spec_has_the_same_keys(tmp_path):
    _, Model, code = build(tmp_path, SPEC, {"*": "cpu"})
    assert "class Body" in code
    assert list(Model().state_dict()) == list(Reference().state_dict())


def test_an_instance_placed_by_its_own_key(tmp_path):
    text = SPEC + "placement:\n  model: cuda:1\n  model.layers.0: cuda:0\n  lm_head: cuda:0\n"
    graph, _, _ = build(tmp_path, text)
    devices = {n.name: n.devices for n in graph.nodes}
    assert devices["model.embed"] == devices["model.norm"] == ("cuda:1",)
    assert devices["model.layers"] == ("cuda:0", "cuda:1", "cuda:1", "cuda:1")


@pytest.mark.parametrize("placement, message", [
    ("  model.layers.1.fc: cuda:1\n",
     "spec.yaml:27:3: placement: 'model.layers.1.fc' reaches inside one copy of "
     "'model.layers', which is repeated"),
    ("  model.nrom: cuda:1\n",
     "spec.yaml:27:3: placement: 'model.nrom' matches no layer (did you mean 'model.norm'?)"),
])
def test_mistakes(tmp_path, placement, message):
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, SPEC + "placement:\n" + placement))
    assert message in str(info.value).replace(f"{tmp_path}/", "")


def test_an_instance_that_is_a_model_output_splits(tmp_path):
    """The output keeps its name; its value is the one the block returns."""
    text = SPEC.replace("  lm_head: {op: Linear, args: [16, 64], bias: false}\n", "") + \
        "placement:\n  model.norm: cuda:1\n"
    graph = driver.compile_spec(write_spec(tmp_path, text))
    assert graph.outputs == ("model",) and graph.aliases == (("model", "model.norm"),)
    assert graph.node("model.norm").devices == ("cuda:1",)
    assert graph.type_of("model") == graph.node("model.norm").out


@pytest.mark.slow  # 3 s: too long for the quick loop
def test_automatic_placement_splits_the_instances_it_is_told_to(tmp_path):
    text = SPEC + "placement:\n  auto: {devices: [cuda:0, cuda:1], split: [model]}\n"
    graph, Model, _ = build(tmp_path, text)
    devices = {n.name: n.devices for n in graph.nodes}
    assert devices["model.layers"] == ("cuda:0", "cuda:0", "cuda:1", "cuda:1")
    assert devices["lm_head"] == ("cuda:1",)
    with virtual_devices(2):
        check_against_reference(Model())


@pytest.mark.parametrize("split, message", [
    ("[modle]", "placement.auto.split: 'modle': 'modle' is not a layer here; split names a "
                "block instance that is not repeated (did you mean 'model'?)"),
    ("[lm_head]", "'lm_head' is not a block instance"),
    ("[model.layers]", "'layers' is a repeated layer"),
])
def test_automatic_split_mistakes(tmp_path, split, message):
    text = SPEC + f"placement:\n  auto: {{devices: [cuda:0, cuda:1], split: {split}}}\n"
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert "spec.yaml:27:" in str(info.value) and message in str(info.value)


def test_a_split_instance_of_a_block_with_two_outputs(tmp_path):
    """The instance's elements (outputs:) or its one element (output:) read
    the block's outputs; a checkpointed instance checkpoints its layers."""
    text = """
mpgen: 1
name: Two
inputs:
  x: [batch, 4]
blocks:
  Pair:
    layers:
      a: {op: Linear, args: [4, 4]}
      b: {op: Linear, args: [4, 4]}
    outputs: [a, b]
layers:
  pair: {op: Pair, outputs: [p, q]}
  one: {op: Pair, in: x, output: 1, checkpoint: true}
  sum: {op: torch.add, in: [p, q]}
  out: {op: torch.add, in: [sum, one]}
placement:
  pair.a: cuda:0
  pair.b: cuda:1
  one.a: cuda:1
"""
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    nodes = {n.name: n for n in result.graph.nodes}
    assert nodes["out"].inputs == ("sum", "one.b")
    assert nodes["one.a"].checkpoint and nodes["one.b"].checkpoint
    model = import_generated(tmp_path / "out" / "two.py").Two()
    x = torch.randn(3, 4)
    a = model.pair.a(x)
    want = a + model.pair.b(a) + model.one.b(model.one.a(x))
    assert torch.allclose(model(x), want)


def test_a_tie_to_a_parameter_inside_a_split_instance(tmp_path):
    """GPT-2's head tied to transformer.wte.weight, the transformer split: the
    tie's owner is the layer that holds the parameter now."""
    text = SPEC.replace("lm_head: {op: Linear, args: [16, 64], bias: false}",
                        "lm_head: {op: Linear, args: [16, 64], bias: false, "
                        "tie: {weight: model.embed.weight}}") + SPLIT
    graph, Model, code = build(tmp_path, text)
    (tie,) = graph.node("lm_head").ties
    assert (tie.owner, tie.owner_param) == ("model.embed", "weight")
    assert "self.lm_head.weight = self.model.embed.weight" in code
    with virtual_devices(2):
        model = Model()
        assert model.lm_head.weight is model.model.embed.weight
        model(torch.randint(0, 64, (2, 5))).sum().backward()
        assert model.model.embed.weight.grad is not None


NESTED = """
mpgen: 1
name: Nest
inputs:
  x: [batch, 4]
blocks:
  Inner:
    layers:
      a: {op: Linear, args: [4, 4]}
      b: {op: Linear, args: [4, 4]}
    outputs: [a, b]
  Outer:
    layers:
      pre: {op: Linear, args: [4, 4]}
      inner: {op: Inner, outputs: [p, q]}
      post: {op: torch.add, in: [p, q]}
layers:
  model: {op: Outer}
  head: {op: Linear, args: [4, 2]}
placement:
  auto: {devices: [cuda:0, cuda:1], split: [model, model.inner]}
"""


def test_an_instance_split_inside_a_split_instance(tmp_path):
    result = build_to(write_spec(tmp_path, NESTED), tmp_path / "out", {"*": "cpu"})
    assert [s.path for s in result.graph.splits] == ["model", "model.inner"]
    assert result.graph.node("model.post").inputs == ("model.inner.a", "model.inner.b")
    model = import_generated(tmp_path / "out" / "nest.py").Nest()
    x = torch.randn(2, 4)
    a = model.model.inner.a(model.model.pre(x))
    assert torch.allclose(model(x), model.head(a + model.model.inner.b(a)))


def test_an_instance_whose_elements_are_model_outputs_splits(tmp_path):
    text = NESTED.replace("layers:\n  model: {op: Outer}\n  head: {op: Linear, args: [4, 2]}\n",
                          "layers:\n  pre: {op: Linear, args: [4, 4]}\n"
                          "  inner: {op: Inner, outputs: [p, q]}\n"
                          "outputs: [p, q]\n").replace("split: [model, model.inner]",
                                                       "split: [inner]")
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    graph = result.graph
    assert graph.outputs == ("p", "q")
    assert graph.aliases == (("p", "inner.a"), ("q", "inner.b"))
    model = import_generated(tmp_path / "out" / "nest.py").Nest()
    x = torch.randn(2, 4)
    p, q = model(x)
    a = model.inner.a(model.pre(x))
    assert torch.equal(p, a) and torch.equal(q, model.inner.b(a))
