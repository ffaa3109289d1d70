"""``{op: Parameter}`` and ``{op: Buffer}``: a tensor of the layer's own.

Each is built, its generated model imported and run on the CPU (and over
two virtual devices), its state-dict keys compared with a hand-written
PyTorch module of the same structure, and each mistake gets its exact
FILE:LINE:COL message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen.common import module_name
from mpgen.errors import MpgenError
from mpgen.testing.virtual import virtual_devices

SPEC = """
mpgen: 1
name: Tokens
inputs:
  x: [batch, 4, 8]
blocks:
  Scaled:
    params: [dim]
    layers:
      fc: {op: Linear, args: [$dim, $dim]}
      gamma: {op: Parameter, shape: [$dim], init: {constant: 0.5}}
      scaled: {op: torch.mul, in: [fc, gamma]}
layers:
  class_token: {op: Parameter, shape: [1, 1, 8], init: ones}
  pos: {op: Parameter, shape: [1, 5, "=4 * 2"], init: {normal: {std: 0.02}}}
  bias: {op: Buffer, shape: [8], init: {values: [0, 1, 2, 3, 4, 5, 6, 7]}}
  scratch: {op: Buffer, shape: [2], dtype: int64, persistent: false}
  expand: {op: torch.broadcast_to, in: class_token, args: [["=size(x, 0)", 1, 8]]}
  cat: {op: torch.cat, in: [expand, x], dim: 1}
  add: {op: torch.add, in: [cat, pos]}
  block: {op: Scaled, args: [8], repeat: 2}
  out: {op: torch.add, in: [block, bias]}
"""


class Reference(nn.Module):
    """What the spec describes, written by hand."""

    class Scaled(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.fc = nn.Linear(dim, dim)
            self.gamma = nn.Parameter(torch.full((dim,), 0.5))

        def forward(self, x):
            return self.fc(x) * self.gamma

    def __init__(self) -> None:
        super().__init__()
        self.class_token = nn.Parameter(torch.ones(1, 1, 8))
        self.pos = nn.Parameter(torch.randn(1, 5, 8) * 0.02)
        self.register_buffer("bias", torch.arange(8.0))
        self.register_buffer("scratch", torch.zeros(2, dtype=torch.int64), persistent=False)
        self.block = nn.ModuleList([self.Scaled(8) for _ in range(2)])

    def forward(self, x):
        y = torch.cat([self.class_token.expand(x.size(0), 1, 8), x], dim=1) + self.pos
        for layer in self.block:
            y = layer(y)
        return y + self.bias


def build(tmp_path, text: str, device_map=None):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    path = tmp_path / "out" / f"{module_name(result.graph.name)}.py"
    return result.graph, getattr(import_generated(path), result.graph.name), path.read_text()


def test_parameters_and_buffers_match_a_hand_written_module(tmp_path):
    graph, Model, code = build(tmp_path, SPEC, {"*": "cpu"})
    model, reference = Model(), Reference()
    assert list(model.state_dict()) == list(reference.state_dict())
    assert graph.total_params == sum(p.numel() for p in reference.parameters())
    # The initializers as written: ones, a constant, the exact values.
    assert torch.equal(model.class_token, torch.ones(1, 1, 8))
    assert torch.equal(model.block[1].gamma, torch.full((8,), 0.5))
    assert torch.equal(model.bias, torch.arange(8.0)) and model.bias.dtype == torch.float32
    assert "scratch" not in model.state_dict() and model.scratch.dtype == torch.int64
    assert isinstance(model.pos, nn.Parameter) and model.pos.std() < 0.1
    reference.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(3, 4, 8)
    out = model(x)
    assert torch.equal(out, reference(x))
    out.sum().backward()
    assert model.class_token.grad is not None and model.block[0].gamma.grad is not None
    # Read as the tensor itself, one statement each.
    assert "class_token = self.class_token  # [1, 1, 8]" in code
    assert '"scratch", torch.zeros(2, dtype=torch.int64, device="cpu"), persistent=False' in code


def test_a_reader_on_another_device_gets_a_planned_transfer(tmp_path):
    text = SPEC + "placement:\n  class_token: cuda:0\n  block.1: cuda:1\n"
    graph, Model, code = build(tmp_path, text)
    assert 'self.class_token = nn.Parameter(torch.ones(1, 1, 8, device="cuda:0"))' in code
    assert 'bias = bias.to("cuda:1")  # [8]' in code
    with virtual_devices(2):
        model = Model()
        assert model.bias.device.index == 0 and model.block[1].gamma.device.index == 1
        model(torch.randn(2, 4, 8)).sum().backward()
        assert model.class_token.grad is not None


@pytest.mark.parametrize("layer, message", [
    ("{op: Parameter}", "layer 'p': a Parameter needs shape: a list of sizes"),
    ("{op: Parameter, shape: [2], in: x}", "layer 'p': a Parameter takes no in:"),
    ("{op: Parameter, shape: [2], repeat: 2}", "layer 'p': a Parameter takes no repeat:"),
    ("{op: Parameter, shape: [2], persistent: false}",
     "layer 'p': unknown key 'persistent' for a Parameter"),
    ("{op: Buffer, shape: [2], persistant: false}",
     "unknown key 'persistant' for a Buffer (did you mean 'persistent'?)"),
    ("{op: Parameter, shape: [2], dtype: int64}", "its dtype is a floating one"),
    ("{op: Parameter, shape: [2.5]}", "shape: expected a size"),
    ("{op: Parameter, shape: [2], init: zero}", "unknown initializer 'zero' (did you mean"),
    ("{op: Parameter, shape: [2], init: {values: [1, 2, 3]}}", "3 values for shape [2]"),
    ("{op: Parameter, shape: [2], init: {xavier_uniform: {gain: 1.0}}}",
     "Fan in and fan out can not be computed"),
    ("{op: Paramter, shape: [2]}", "(did you mean 'Parameter'?)"),
])
def test_mistakes_are_reported_at_their_line(tmp_path, layer, message):
    text = f"mpgen: 1\nname: M\ninputs:\n  x: [batch, 2]\nlayers:\n  p: {layer}\n" \
           "  y: {op: torch.add, in: [x, p]}\n"
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert "spec.yaml:6:" in str(info.value)
    assert message in str(info.value)
