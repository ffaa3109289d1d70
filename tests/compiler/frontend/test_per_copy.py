"""``$index`` and ``$repeat``: per-copy values in a repeated layer's
arguments (a stochastic-depth rate growing with the block index, as in
EfficientNet and ConvNeXt), generated as a loop over ``index``."""

from __future__ import annotations

import pytest
import torch

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.errors import MpgenError
from mpgen.testing.virtual import virtual_devices

SPEC = """
mpgen: 1
name: Deep
inputs:
  x: [batch, 8]
blocks:
  Res:
    params: [dim, rate]
    layers:
      fc: {op: Linear, args: [$dim, $dim]}
      dropped: {op: F.dropout, p: $rate}
      add: {op: torch.add, in: [x, dropped]}
layers:
  stage: {op: Res, args: [8, "=0.1 * $index / $repeat"], repeat: 4}
  scale: {op: Dropout, args: ["=0.25 * $index"], repeat: 3}
"""


def build(tmp_path, text, device_map=None):
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", device_map)
    path = tmp_path / "out" / "deep.py"
    return getattr(import_generated(path), "Deep"), path.read_text()


def test_each_copy_gets_its_index(tmp_path):
    Model, code = build(tmp_path, SPEC, {"*": "cpu"})
    model = Model()
    assert [block.rate for block in model.stage] == [0.1 * k / 4 for k in range(4)]
    assert [layer.p for layer in model.scale] == [0.0, 0.25, 0.5]
    assert '[Res(8, 0.1 * index / 4).to("cpu") for index in range(4)]' in code
    model.eval()
    x = torch.randn(2, 8)
    assert model(x).shape == (2, 8)


def test_copies_split_over_devices_keep_their_indices(tmp_path):
    text = SPEC + "placement:\n  stage.0-2: cuda:0\n  stage.3: cuda:1\n"
    Model, code = build(tmp_path, text)
    assert '[Res(8, 0.1 * index / 4).to("cuda:0") for index in range(3)]' in code
    assert '[Res(8, 0.1 * 3 / 4).to("cuda:1")]' in code
    with virtual_devices(2):
        model = Model()
        assert [block.rate for block in model.stage] == [0.1 * k / 4 for k in range(4)]


@pytest.mark.parametrize("layers, message", [
    ("  a: {op: Dropout, args: [$index]}\n",
     "spec.yaml:6:27: layer 'a': '$index' is the index of each copy of a repeated layer, in "
     "its arguments and keywords; this layer has no repeat:"),
    ("  a: {op: Linear, args: [4, \"=4 + $index\"], repeat: 2}\n",
     "spec.yaml:6:3: layer 'a': copy 1 has 25 parameters and copy 0 20: $index may change "
     "how a copy computes (a rate, a scale), not its sizes"),
])
def test_mistakes(tmp_path, layers, message):
    text = "mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n" + layers
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert message in str(info.value).replace(f"{tmp_path}/", "")


def test_a_block_param_may_not_be_named_index(tmp_path):
    text = ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nblocks:\n  B:\n    params: [index]\n"
            "    layers:\n      fc: {op: Linear, args: [4, 4]}\nlayers:\n  b: {op: B, args: [1]}\n")
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert "spec.yaml:7:14: block 'B' param: $index is the index of a copy" in \
        str(info.value).replace(f"{tmp_path}/", "")
