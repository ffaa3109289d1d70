"""Layers named as an ``nn.Sequential`` names its children (``0``, ``1``,
RegNet's ``block1-0``): the generated model's state-dict keys are those of a
model written with ``nn.Sequential`` (NOTE [Layers named by position]), so
its ``state_dict()`` loads strictly, by name; ties, ``init:``, ``in:`` and
placement keys (splitting such an instance) reach such layers, and the names
that would be ambiguous or cannot be attributes are errors at their line."""

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
name: SeqNet
inputs:
  x: [batch, 3, 8, 8]
blocks:
  ConvBN:
    params: [cin, cout]
    layers:
      0: {op: Conv2d, args: [$cin, $cout, 3], padding: 1, bias: false}
      "1": {op: BatchNorm2d, args: [$cout]}
      2: {op: ReLU}
  Stage:
    layers:
      block1-0: {op: ConvBN, args: [8, 8]}
      block1-1: {op: ConvBN, args: [8, 8]}
      sum: {op: torch.add, in: ["block1-0", block1-1]}
      0: {op: Conv2d, args: [8, 8, 1], init: {weight: zeros, bias: ones}}
layers:
  conv1: {op: ConvBN, args: [3, 8]}
  stage: {op: Stage}
  again: {op: Conv2d, args: [8, 8, 3], padding: 1, bias: false,
          tie: {weight: stage.block1-0.0.weight}}
  pool: {op: AdaptiveAvgPool2d, args: [1]}
  flat: {op: torch.flatten, start_dim: 1}
  head: {op: Linear, args: [8, 4]}
"""


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())


class Stage(nn.Sequential):
    """As torchvision's RegNet names a stage's blocks (``add_module``)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("block1-0", conv_bn(8, 8))
        self.add_module("block1-1", conv_bn(8, 8))
        self.add_module("0", nn.Conv2d(8, 8, 1))

    def forward(self, x):
        first = self[0](x)
        return self[2](first + self[1](first))


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = conv_bn(3, 8)
        self.stage = Stage()
        self.again = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.again.weight = self.stage[0][0].weight
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.again(self.stage(self.conv1(x)))), 1))


def _generated(tmp_path, text=SPEC):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    path = tmp_path / "out" / file_names(result.graph)["model"]
    return getattr(import_generated(path), result.graph.name)(), path.read_text()


def test_keys_are_those_of_nn_sequential_and_load_by_name(tmp_path):
    model, _ = _generated(tmp_path)
    torch.manual_seed(0)
    reference = Reference()
    assert list(model.state_dict()) == list(reference.state_dict())
    assert "stage.block1-0.1.running_mean" in model.state_dict()
    model.load_state_dict(reference.state_dict(), strict=True)
    model.train(), reference.train()
    x = torch.randn(2, 3, 8, 8)
    expected, got = reference(x), model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-5)


def test_the_block_is_an_nn_sequential_called_by_index(tmp_path):
    model, code = _generated(tmp_path)
    assert "class ConvBN(nn.Sequential):" in code
    assert 'self.add_module("0", nn.Conv2d(cin, cout, 3, padding=1, bias=False))' in code
    assert 'self.add_module("block1-1", ConvBN(8, 8))' in code
    assert "conv2d = self[0](x)" in code  # its variable named for its op
    assert "class SeqNet(nn.Module):" in code
    assert isinstance(model.stage, nn.Sequential)
    assert model.stage[1] is model.stage.get_submodule("block1-1")


def test_tie_and_init_reach_layers_named_by_position(tmp_path):
    model, code = _generated(tmp_path)
    assert "self.again.weight = self.stage[0][0].weight" in code
    assert model.again.weight is model.stage.get_submodule("block1-0.0").weight
    assert len(list(model.parameters())) == len(set(map(id, model.parameters())))
    inner = model.stage.get_submodule("0")
    assert torch.equal(inner.weight, torch.zeros_like(inner.weight))
    assert torch.equal(inner.bias, torch.ones_like(inner.bias))


def test_placement_places_an_instance_with_such_layers_whole(tmp_path):
    text = SPEC + "placement:\n  conv1: cuda:0\n  stage: cuda:1\n"
    result = build_to(write_spec(tmp_path, text), tmp_path / "out")
    devices = {n.name: n.devices for n in result.graph.nodes}
    assert devices["conv1"] == ("cuda:0",) and devices["stage"] == ("cuda:1",)


def test_a_tie_to_such_a_layer_crosses_devices(tmp_path):
    text = SPEC + "placement:\n  conv1: cuda:0\n  again: cuda:1\n"
    result = build_to(write_spec(tmp_path, text), tmp_path / "out")
    path = tmp_path / "out" / file_names(result.graph)["model"]
    code = path.read_text()
    assert 'self.stage[0][0].weight.to("cuda:1")' in code
    torch.manual_seed(0)
    reference = Reference().eval()
    x = torch.randn(2, 3, 8, 8)
    with virtual_devices(cuda=2):
        model = import_generated(path).SeqNet().eval()
        model.load_state_dict(reference.state_dict(), strict=True)
        got = model(x)
    torch.testing.assert_close(got.cpu(), reference(x), rtol=1e-5, atol=1e-5)


def test_a_placement_key_inside_such_an_instance_splits_it(tmp_path):
    text = SPEC + "placement:\n  conv1: cuda:0\n  stage.block1-1: cuda:1\n  again: cuda:0\n"
    result = build_to(write_spec(tmp_path, text), tmp_path / "out")
    path = tmp_path / "out" / file_names(result.graph)["model"]
    code = path.read_text()
    assert "self.stage = nn.Sequential()" in code
    assert 'self.stage.add_module("block1-1", ConvBN(8, 8).to("cuda:1"))' in code
    assert "convbn_1 = self.stage[1](convbn_cuda1)" in code
    assert {n.name: n.devices for n in result.graph.nodes}["stage.block1-1"] == ("cuda:1",)
    torch.manual_seed(0)
    reference = Reference().eval()
    x = torch.randn(2, 3, 8, 8)
    with virtual_devices(cuda=2):
        model = import_generated(path).SeqNet().eval()
        assert list(model.state_dict()) == list(reference.state_dict())
        model.load_state_dict(reference.state_dict(), strict=True)
        got = model(x)
    torch.testing.assert_close(got.cpu(), reference(x), rtol=1e-5, atol=1e-5)


def test_a_pipeline_stage_keeps_the_indices_of_such_layers(tmp_path):
    text = (SPEC + "placement:\n  conv1: cuda:0\n  stage.block1-1: cuda:1\n  again: cuda:0\n"
            "train: {loss: MSELoss, batch_size: 4}\n")
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    pp = import_generated(tmp_path / "out" / file_names(result.graph)["pp"])
    stage1 = pp.Stage1()  # stage.block1-1 alone: block1-0 a placeholder before it
    assert isinstance(stage1.stage[0], pp.mpgen_runtime.pipeline.Elsewhere)
    assert stage1.stage[1] is stage1.stage.get_submodule("block1-1")
    keys = [k for stage in (pp.Stage0(), stage1, pp.Stage2()) for k in stage.state_dict()]
    assert sorted(set(keys)) == sorted(Reference().state_dict())


def test_a_range_over_layers_named_by_position_is_an_error_at_its_key(tmp_path):
    text = SPEC + "placement:\n  conv1: cuda:0\n  stage.0-1: cuda:1\n"
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    line = text.splitlines().index("  stage.0-1: cuda:1") + 1
    assert (f"spec.yaml:{line}:3: placement: 'stage.0-1': 'stage' is a block instance whose "
            "layers are named by position, not a repeated layer") in str(info.value)


def _block(layers: str) -> str:
    return ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nblocks:\n  B:\n    layers:\n"
            f"{layers}layers:\n  b: {{op: B}}\n")


@pytest.mark.parametrize("text, where, message", [
    ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n  0: {op: Linear, args: [4, 4]}\n",
     "6:3", "'0' is not a valid Python identifier (a layer named like an nn.Sequential's "
            "child, 0 or block1-0, belongs in a block)"),
    (_block("      01: {op: Linear, args: [4, 4]}\n"), "8:7",
     "'01': a number names a layer without leading zeros (1)"),
    (_block("      0-3: {op: Linear, args: [4, 4]}\n"), "8:7",
     "'0-3' reads as a range of instances (h.0-3) in placement keys"),
    (_block('      "a b": {op: Linear, args: [4, 4]}\n'), "8:7",
     "'a b' is not a valid layer name: an identifier, or a child's name in an nn.Sequential"),
    (_block("      0: {op: Parameter, shape: [4]}\n      y: {op: torch.add, in: [x, \"0\"]}\n"),
     "8:7", "a Parameter layer is named by an identifier, not '0'"),
    (_block("      0: {op: torch.relu}\n"), "8:7",
     "a function layer is named by an identifier, not '0'"),
    (_block("      0: {op: Linear, args: [4, 4]}\n      1: {op: torch.add, in: [0, x]}\n"),
     "9:31", 'got 0 (a layer named 0 is read as "0", quoted)'),
    (_block('      0: {op: Linear, args: [4, 4]}\n      "0": {op: Linear, args: [4, 4]}\n'),
     "9:7", "duplicate key '0'"),
])
def test_names_that_cannot_be_layers_are_errors_at_their_line(tmp_path, text, where, message):
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert f"spec.yaml:{where}: " in str(info.value)
    assert message in str(info.value)
