"""Casts written by hand (docs/spec.md, "Casts"): ``{op: torch.Tensor.to,
dtype: int64}`` and ``{op: torch.Tensor.type_as, in: [x, ref]}``.

T5's relative position buckets, computed in the spec rather than read from
a constant table, are built, their generated model run against the same
computation written in PyTorch (outputs and gradients within 1e-5); the
dtypes the build infers, the code it writes, ``type_as`` under autocast,
a cast crossing to another device, and each mistake at its FILE:LINE:COL."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError
from mpgen.testing.virtual import virtual_devices

BUCKETS, DISTANCE, HEADS = 8, 16, 2
CPU = {"*": "cpu"}

#: T5's bidirectional relative position bias over a [batch, seq] of ids: the
#: buckets are integer positions, a float logarithm cast back to int64.
SPEC = f"""
mpgen: 1
name: RelativeBias
inputs:
  ids: {{shape: [batch, 12], dtype: int64}}
layers:
  context: {{op: torch.arange, in: [], end: "=size(ids, 1)", dtype: int64}}
  query: {{op: torch.unsqueeze, args: [1]}}
  memory: {{op: torch.unsqueeze, in: context, args: [0]}}
  relative: {{op: torch.sub, in: [memory, query]}}
  positive: {{op: torch.gt, args: [0]}}
  sided: {{op: torch.Tensor.to, dtype: int64}}
  side: {{op: torch.mul, args: [{BUCKETS // 2}]}}
  distance: {{op: torch.abs, in: relative}}
  small: {{op: torch.lt, args: [{BUCKETS // 4}]}}
  as_float: {{op: torch.Tensor.to, in: distance, dtype: float32}}
  scaled: {{op: torch.div, args: [{BUCKETS // 4}]}}
  log: {{op: torch.log}}
  ratio: {{op: torch.div, args: [{math.log(DISTANCE / (BUCKETS // 4))!r}]}}
  spread: {{op: torch.mul, args: [{BUCKETS // 4}]}}
  as_int: {{op: torch.Tensor.to, dtype: int64}}
  large: {{op: torch.add, args: [{BUCKETS // 4}]}}
  top: {{op: torch.clamp, max: {BUCKETS // 2 - 1}}}
  bucket: {{op: torch.where, in: [small, distance, top]}}
  buckets: {{op: torch.add, in: [side, bucket]}}
  bias: {{op: Embedding, args: [{BUCKETS}, {HEADS}]}}
  heads: {{op: torch.permute, dims: [2, 0, 1]}}
  token: {{op: Embedding, in: ids, args: [64, {HEADS}]}}
  mask: {{op: torch.Tensor.type_as, in: [ids, token]}}
  token_heads: {{op: torch.permute, in: token, dims: [0, 2, 1]}}
  by_query: {{op: torch.unsqueeze, args: [-1]}}
  scores: {{op: torch.mul, in: [heads, by_query]}}
  row: {{op: torch.unsqueeze, in: mask, args: [1]}}
  col: {{op: torch.unsqueeze, args: [1]}}
  masked: {{op: torch.mul, in: [scores, col]}}
"""


def _reference_buckets(length: int) -> torch.Tensor:
    """transformers' T5Attention._relative_position_bucket, bidirectional."""
    context = torch.arange(length, dtype=torch.long)[:, None]
    memory = torch.arange(length, dtype=torch.long)[None, :]
    relative = memory - context
    half = BUCKETS // 2
    buckets = (relative > 0).to(torch.long) * half
    relative = torch.abs(relative)
    exact = half // 2
    small = relative < exact
    large = exact + (torch.log(relative.float() / exact) / math.log(DISTANCE / exact)
                     * (half - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return buckets + torch.where(small, relative, large)


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(BUCKETS, HEADS)
        self.token = nn.Embedding(64, HEADS)

    def forward(self, ids):
        heads = self.bias(_reference_buckets(ids.size(1))).permute(2, 0, 1)
        token = self.token(ids)
        scores = heads * token.permute(0, 2, 1).unsqueeze(-1)
        return scores * ids.type_as(token)[:, None, None, :]


def _build(tmp_path, text, device_map=CPU):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    path = tmp_path / "out" / file_names(result.graph)["model"]
    return result.graph, getattr(import_generated(path), result.graph.name), path.read_text()


@pytest.mark.slow
def test_t5_buckets_reproduce_the_reference(tmp_path):
    graph, Model, code = _build(tmp_path, SPEC)
    types = {n.name: n.out.dtype for n in graph.nodes}
    assert (types["sided"], types["as_float"], types["as_int"], types["mask"]) == (
        "int64", "float32", "int64", "float32")
    assert "sided = positive.to(torch.int64)" in code
    assert "as_float = distance.to(torch.float32)" in code
    assert "mask = ids.type_as(token)" in code
    model, reference = Model(), Reference()
    torch.manual_seed(0)
    for param in reference.parameters():
        nn.init.normal_(param)
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    got, expected = model(ids), reference(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    expected.square().sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, dict(reference.named_parameters())[name].grad,
                                   rtol=1e-5, atol=1e-5, msg=name)
    # both of T5's ranges are read (exact and logarithmic; bucket 4 is "after, at
    # distance 0", which cannot be)
    assert set(_reference_buckets(12).unique().tolist()) == set(range(BUCKETS)) - {4}


CASTS = """
mpgen: 1
name: Casts
inputs:
  x: [batch, 8]
layers:
  fc: {op: Linear, args: [8, 8]}
  half: {op: torch.Tensor.to, dtype: float16}
  back: {op: torch.Tensor.to, dtype: float32}
  like: {op: torch.Tensor.type_as, in: [x, fc]}
  out: {op: torch.add, in: [back, like]}
"""


def test_a_float_cast_keeps_the_gradient_and_type_as_follows_autocast(tmp_path):
    text = CASTS.replace("half:", "halved:")
    graph, Model, code = _build(tmp_path, text)
    assert [n.out.dtype for n in graph.nodes] == ["float32", "float16", "float32", "float32",
                                                  "float32"]
    assert "halved = fc.to(torch.float16)  # [batch, 8]" in code
    model = Model()
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    seen = {}
    model.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fc = model.fc(x)
        assert x.type_as(fc).dtype == torch.bfloat16  # what type_as follows, at run time
        model(x)
    assert seen["out"].dtype == torch.float32  # back: float32, like: bfloat16, promoted


def test_a_cast_read_on_another_device_is_moved_once(tmp_path):
    text = CASTS.replace("half:", "halved:") + "placement:\n  fc: cuda:0\n  back: cuda:1\n"
    _, Model, code = _build(tmp_path, text, None)  # on virtual devices
    assert 'halved = halved.to("cuda:1")' in code
    with virtual_devices(2):
        model = Model()
        out = model(torch.randn(2, 8))
        assert out.device.index == 1 and out.dtype == torch.float32
        out.sum().backward()
        assert model.fc.weight.grad is not None


@pytest.mark.parametrize("layer, where, message", [
    ("{op: torch.Tensor.to, in: x}", "6:3",
     "layer 'c': torch.Tensor.to needs dtype:, the dtype it casts to (float32, float16, "
     "bfloat16, int64, int32, bool)"),
    ("{op: torch.Tensor.to, in: x, dtype: int8}", "6:42",
     "layer 'c': unknown dtype 'int8' (did you mean 'int64'?)"),
    ("{op: torch.Tensor.to, in: x, dtype: 3}", "6:42",
     "layer 'c': dtype: expected one of float32, float16, bfloat16, int64, int32, bool, got 3"),
    ("{op: torch.Tensor.to, in: x, dtype: int64, device: cpu}", "6:49",
     "layer 'c': torch.Tensor.to takes no device: (its one key is dtype: {op: "
     "torch.Tensor.to, dtype: int64})"),
    ("{op: torch.Tensor.to, in: x, dtyp: int64}", "6:35",
     "layer 'c': torch.Tensor.to takes no dtyp: (did you mean 'dtype'?)"),
    ("{op: torch.Tensor.to, in: x, args: [int64]}", "6:35",
     "layer 'c': torch.Tensor.to takes no args:"),
    ("{op: torch.Tensor.to, in: [x, x], dtype: int64}", "6:32",
     "layer 'c': torch.Tensor.to casts the one tensor it reads"),
    ("{op: torch.Tensor.to, in: [], dtype: int64}", "6:11",
     "layer 'c': torch.Tensor.to casts the tensor it reads: remove 'in: []'"),
    ("{op: torch.Tensor.type_as, in: x}", "6:37",
     "layer 'c': torch.Tensor.type_as reads two tensors: the one it casts, then the one "
     "whose dtype it takes ({op: torch.Tensor.type_as, in: [x, ref]})"),
    ("{op: torch.Tensor.type_as, in: [x, x], dtype: int64}", "6:45",
     "layer 'c': torch.Tensor.type_as takes no dtype: (it takes the dtype of the tensor it "
     "reads second"),
    ("{op: torch.Tensor.long, in: x}", "6:11",
     "layer 'c': unknown op 'torch.Tensor.long': the tensor methods a layer applies are the "
     "casts, torch.Tensor.to and torch.Tensor.type_as"),
])
def test_mistakes_are_reported_at_their_line(tmp_path, layer, where, message):
    text = f"mpgen: 1\nname: M\ninputs:\n  x: [batch, 2]\nlayers:\n  c: {layer}\n"
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert f"spec.yaml:{where}: {message}" in str(info.value)


@pytest.mark.parametrize("dtype, reader, message", [
    ("int64", "{op: Linear, args: [2, 4]}",
     "layer 'r': Linear(2, 4) expects floating-point input but c gives [batch, 2] int64"),
    ("bool", "{op: LayerNorm, args: [2]}",
     "layer 'r': LayerNorm(2) expects floating-point input but c gives [batch, 2] bool"),
    ("float16", "{op: Linear, args: [2, 4]}",
     "layer 'r': Linear(2, 4) has float32 weights but c gives float16"),
    ("float32", "{op: Embedding, args: [10, 4]}",
     "layer 'r': Embedding(10, 4) expects integer indices but c gives [batch, 2] float32"),
])
def test_a_dtype_the_next_layer_cannot_take_is_an_error_there(tmp_path, dtype, reader,
                                                             message):
    text = (f"mpgen: 1\nname: M\ninputs:\n  x: {{shape: [batch, 2], dtype: "
            f"{'int64' if dtype == 'float32' else 'float32'}}}\nlayers:\n"
            f"  c: {{op: torch.Tensor.to, dtype: {dtype}}}\n  r: {reader}\n")
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert f"spec.yaml:7:3: {message}" in str(info.value)


def test_an_integer_cast_keeps_the_range_of_positions_a_table_is_checked_against(tmp_path):
    """RoBERTa's position ids are int32 on their way to the table: the build
    still knows which rows they read."""
    text = ("mpgen: 1\nname: M\ninputs:\n  ids: {shape: [batch, 12], dtype: int64}\nlayers:\n"
            "  pos: {op: torch.arange, in: [], end: \"=size(ids, 1)\"}\n"
            "  pos32: {op: torch.Tensor.to, dtype: int32}\n"
            "  table: {op: Embedding, args: [8, 4]}\n")
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert ("spec.yaml:8:3: layer 'table': Embedding(8, 4) has 8 rows, but 'pos32' reads it "
            "at indices up to 11, made by layer 'pos'") in str(info.value)
    driver.compile_spec(write_spec(tmp_path, text.replace("[8, 4]", "[12, 4]")))
