"""Items of an ``nn.ModuleList`` of unlike modules, each called on its own
from the parent's ``forward`` (layers named ``block.0``, ``block.1``: T5's
stack, a UNet's ``down_blocks``), and held layers (``call: false``: a module
the model holds but forward never calls, as T5's ``shared``, which its
stack's embedding ties to). The generated keys are those of the model
written by hand with a ModuleList and a shared embedding, so its
``state_dict()`` loads strictly, by name; placement keys name an item or a
range of items; the forms that cannot be are errors at their line
(docs/spec.md, "Layers"; NOTE [Items of a ModuleList], NOTE [Held layers])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError
from mpgen.testing import virtual_devices

SPEC = """\
mpgen: 1
name: Stacked
inputs:
  ids: {shape: [batch, 6], dtype: int64}
blocks:
  First:
    inputs: [x]
    layers:
      bias: {op: Parameter, shape: [8]}
      fc: {op: Linear, args: [8, 8], in: x}
      out: {op: torch.add, in: [fc, bias]}
    outputs: [out, bias]
  Later:
    inputs: [x, bias]
    layers:
      fc: {op: Linear, args: [8, 8]}
      out: {op: torch.add, in: [fc, bias]}
  Stack:
    inputs: [ids]
    layers:
      embed_tokens: {op: Embedding, args: [16, 8]}
      block.0: {op: First, outputs: [h, bias]}
      block.1: {op: Later, in: [h, bias]}
      block.2: {op: Later, in: [block.1, bias]}
      norm: {op: LayerNorm, args: [8]}
layers:
  shared: {op: Embedding, args: [16, 8], call: false}
  encoder: {op: Stack, tie: {embed_tokens.weight: shared.weight}}
  heads.0: {op: Linear, args: [8, 8]}
  heads.1: {op: Linear, args: [8, 4]}
"""


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) + self.bias, self.bias


class Later(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, bias):
        return self.fc(x) + bias


class Stack(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([First(), Later(), Later()])
        self.norm = nn.LayerNorm(8)

    def forward(self, ids):
        h, bias = self.block[0](self.embed_tokens(ids))
        for layer in self.block[1:]:
            h = layer(h, bias)
        return self.norm(h)


class Reference(nn.Module):
    """As T5 holds its embedding: ``shared``, never called, its stack's too."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 8)
        self.encoder = Stack(self.shared)
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, ids):
        return self.heads[1](self.heads[0](self.encoder(ids)))


def _built(tmp_path, placement: str = "", train: str = "", device_map=None):
    text = SPEC + (f"placement:\n{placement}" if placement else "") + train
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    return result, tmp_path / "out"


def _compare(model: nn.Module, reference: nn.Module, device: str = "cpu") -> None:
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    expected, got = reference(ids), model(ids)
    torch.testing.assert_close(got.to("cpu"), expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.to("cpu"), theirs[name].grad, rtol=1e-5,
                                   atol=1e-5, msg=name)


def test_keys_are_the_references_and_load_by_name(tmp_path):
    result, out = _built(tmp_path, device_map={"*": "cpu"})
    model = getattr(import_generated(out / file_names(result.graph)["model"]), "Stacked")()
    assert model.shared.weight is model.encoder.embed_tokens.weight
    assert isinstance(model.encoder.block, nn.ModuleList) and len(model.encoder.block) == 3
    torch.manual_seed(0)
    _compare(model, Reference())
    assert model.shared.weight.grad is not None  # trained through the layer tied to it


def test_items_are_a_module_list_called_one_by_one_and_held_layers_are_not_called(tmp_path):
    result, out = _built(tmp_path, device_map={"*": "cpu"})
    code = (out / file_names(result.graph)["model"]).read_text()
    assert "self.block = nn.ModuleList()" in code
    assert "self.heads = nn.ModuleList()" in code
    assert "self.block.append(First())" in code
    assert "h, bias = self.block[0](embed_tokens)" in code
    assert "block_1 = self.block[1](h, bias)" in code
    assert "self.heads[1](heads_0)" in code
    assert 'self.shared = nn.Embedding(16, 8).to("cpu")' in code
    assert "self.encoder.embed_tokens.weight = self.shared.weight" in code
    assert "self.shared(" not in code  # held: made, never called
    assert result.graph.total_params == sum(
        p.numel() for p in Reference().parameters())  # the tied weight counted once


def test_placement_keys_name_items_and_ranges_of_items(tmp_path):
    placement = "  shared: cuda:0\n  encoder.block.1-2: cuda:1\n  encoder.norm: cuda:0\n" \
                "  heads.1: cuda:1\n"
    result, out = _built(tmp_path, placement)
    devices = {n.name: n.devices for n in result.graph.nodes}
    assert devices["encoder.block.0"] == ("cuda:0",)
    assert devices["encoder.block.1"] == devices["encoder.block.2"] == ("cuda:1",)
    assert devices["heads.0"] == ("cuda:0",) and devices["heads.1"] == ("cuda:1",)
    code = (out / file_names(result.graph)["model"]).read_text()
    assert "self.encoder.block = nn.ModuleList()" in code
    assert "self.encoder.block.append(Later().to(\"cuda:1\"))" in code
    torch.manual_seed(0)
    reference = Reference()
    with virtual_devices(cuda=2):
        model = getattr(import_generated(out / file_names(result.graph)["model"]), "Stacked")()
        _compare(model, reference)


@pytest.mark.parametrize("placement", [
    "  shared: cuda:0\n  encoder.block.1.fc: cuda:1\n  encoder.norm: cuda:0\n",
    "  auto:\n    devices: [cuda:0, cuda:1]\n    split: [encoder, encoder.block.1]\n",
])
def test_a_key_inside_an_item_splits_it(tmp_path, placement):
    result, out = _built(tmp_path, placement)
    assert "encoder.block.1.fc" in {n.name for n in result.graph.nodes}
    torch.manual_seed(0)
    reference = Reference()
    with virtual_devices(cuda=2):
        model = getattr(import_generated(out / file_names(result.graph)["model"]), "Stacked")()
        _compare(model, reference)


def test_a_pipeline_stage_keeps_the_indices_of_items_on_other_stages(tmp_path):
    train = "train: {loss: MSELoss, batch_size: 4}\n"
    placement = "  shared: cuda:0\n  encoder.block.2: cuda:1\n  encoder.norm: cuda:0\n"
    result, out = _built(tmp_path, placement, train, {"*": "cpu"})
    pp = import_generated(out / file_names(result.graph)["pp"])
    stages = [pp.Stage0(), pp.Stage1(), pp.Stage2()]
    assert isinstance(stages[1].encoder.block[0], pp.mpgen_runtime.pipeline.Elsewhere)
    assert isinstance(stages[1].encoder.block[2], nn.Module)
    keys = {k for stage in stages for k in stage.state_dict()}
    assert keys == set(Reference().state_dict())


def _stack(layers: str, top: str = "  s: {op: S}\n") -> str:
    return ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nblocks:\n  S:\n    layers:\n"
            f"{layers}layers:\n{top}")


LINEAR = "{op: Linear, args: [4, 4]}"


@pytest.mark.parametrize("text, where, message", [
    (_stack(f"      block.0: {LINEAR}\n      block.2: {LINEAR}\n"), "9:7",
     "'block.2': the items of the nn.ModuleList 'block' are numbered from 0 in order, "
     "without gaps: expected block.1 here"),
    (_stack(f"      block.1: {LINEAR}\n      block.0: {LINEAR}\n"), "8:7",
     "expected block.0 here"),
    (_stack(f"      block.00: {LINEAR}\n"), "8:7",
     "'block.00': an item is numbered without leading zeros (block.0)"),
    (_stack(f"      block: {LINEAR}\n      block.0: {LINEAR}\n"), "9:7",
     "'block.0' is an item of the nn.ModuleList 'block', and a layer is named 'block' too"),
    (_stack("      block.0: {op: Linear, args: [4, 4], repeat: 2}\n"), "8:7",
     "'block.0': an item of an nn.ModuleList is one module, not repeated"),
    (_stack("      block.0: {op: torch.relu}\n"), "8:7",
     "a function layer is named by an identifier, not 'block.0' (a name like block.0 is a "
     "module's: an item of an nn.ModuleList)"),
    (_stack(f"      train.0: {LINEAR}\n"), "8:7", "'train' would shadow nn.Module.train"),
    ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n"
     f"  h.0: {LINEAR}\n  h.1: {LINEAR}\nplacement:\n  h.0-2: cuda:1\n", "9:3",
     "placement: 'h.0-2': the nn.ModuleList 'h' has items 0-1"),
    (_stack(f"      a: {LINEAR}\n      e: {{op: torch.relu, call: false}}\n"), "9:33",
     "layer 'e' of block 'S': call: false holds a module that forward never calls; a "
     "function layer computes only when called"),
    (_stack(f"      a: {LINEAR}\n      e: {{op: Linear, args: [4, 4], in: x, call: false}}\n"),
     "9:50", "'in:' is what forward calls it with"),
    ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n"
     f"  e: {{op: Linear, args: [4, 4], call: false}}\n  a: {LINEAR}\n  b: {{op: torch.add, "
     "in: [a, e]}\n", "8:30", "reads 'e', which forward never calls (call: false), so it has "
     "no value"),
    ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n"
     f"  e: {{op: Linear, args: [4, 4], call: false}}\n  a: {LINEAR}\n"
     "train: {loss: MSELoss, batch_size: 4}\n", "6:3",
     "layer 'e': no output depends on it, so training would never update its parameters"),
    # neither false nor a mapping: one line, not pydantic's names of the union's types
    ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n"
     "  a: {op: Linear, args: [4, 4], call: [1]}\n", "6:39",
     "call: expected a mapping of forward's keyword arguments, like {is_causal: true}, or "
     "false (a module forward never calls), got [1]"),
])
def test_forms_that_cannot_be_are_errors_at_their_line(tmp_path, text, where, message):
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert f"spec.yaml:{where}: " in str(info.value)
    assert message in str(info.value)


def test_a_layer_after_a_held_one_reads_the_one_before_it(tmp_path):
    text = ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n"
            f"  a: {LINEAR}\n  e: {{op: Linear, args: [4, 4], call: false}}\n"
            "  b: {op: Linear, args: [4, 4], tie: {weight: e.weight}}\n")
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    assert {n.name: n.inputs for n in result.graph.nodes}["b"] == ("a",)


class _Add(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.fc(x) + y


class _Mul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x, y):
        return self.fc(x) * y


class _Lists(nn.Module):
    """Unlike items called in order (``order``) and in reverse (``back``), and
    a child forward never calls that nothing shares (``spare``)."""

    def __init__(self) -> None:
        super().__init__()
        self.order = nn.ModuleList([_Add(), _Mul()])
        self.back = nn.ModuleList([_Add(), _Mul()])
        self.spare = nn.Linear(4, 4)

    def forward(self, x):
        h = self.order[1](self.order[0](x, x), x)
        return self.back[0](self.back[1](h, x), x)


@pytest.mark.slow
def test_import_writes_items_called_in_order_and_holds_an_uncalled_child(tmp_path):
    from mpgen.commands import importer

    root = _Lists()
    specs = [importer.parse_input("x=batch,4")]
    imported = importer.import_module(root, specs, "mpgen import", None, tracer="dynamo")
    assert "  order.0: {op: " in imported.text and "  order.1: {op: " in imported.text
    assert "  spare: {op: Linear, args: [4, 4], requires_grad: false, call: false}" in \
        imported.text  # nothing ties to it, so nothing would train it
    # called last to first: items of a spec are made in order, so named back_1, back_0
    assert imported.renamed == {"back_1": "back.1", "back_0": "back.0"}
    spec = write_spec(tmp_path, imported.text, "lists.yaml")
    result = build_to(spec, tmp_path / "out", {"*": "cpu"})
    model = getattr(import_generated(tmp_path / "out" / file_names(result.graph)["model"]),
                    result.graph.name)()
    state = {imported.original_key(k): k for k in model.state_dict()}
    model.load_state_dict({state[k]: v for k, v in root.state_dict().items()}, strict=True)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), root(x), rtol=1e-5, atol=1e-5)
