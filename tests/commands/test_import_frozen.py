"""``mpgen import`` of parameters that do not train: ``requires_grad=False``
in the original becomes ``requires_grad: false`` in the spec (on a Parameter
layer, a module layer, a block instance whose parameters are all frozen), so
the generated model trains exactly what the original trains. A user's class
with a frozen ``nn.Parameter``, a frozen ``nn.Linear`` and a frozen backbone,
and Hugging Face Whisper's encoder (its sinusoidal position table), each
loaded strictly by name and compared within 1e-5, outputs and gradients."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import build_to, import_generated
from mpgen.commands import importer
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError

pytestmark = pytest.mark.slow  # TorchDynamo traces, builds

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.relu(self.conv(x)))


class Tagger(nn.Module):
    """A pretrained stem and backbone under a new head that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(8), requires_grad=False)
        self.stem = nn.Linear(8, 16)
        self.stem.requires_grad_(False)
        self.backbone = Backbone()
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.backbone(self.stem(x + self.table)))


def frozen_names(module: nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def reproduce(root: nn.Module, inputs: list[str], tmp_path, config: str | None = None):
    """Import ``root``, build its spec for the CPU, load its weights strictly by
    name and compare outputs and every gradient; the generated model and the spec."""
    specs = [importer.parse_input(text) for text in inputs]
    imported = importer.import_module(root, specs, "mpgen import", tracer="dynamo")
    path = tmp_path / "imported.yaml"
    path.write_text(imported.text)
    result = build_to(path, tmp_path / "out", {"*": "cpu"})
    module = import_generated(tmp_path / "out" / file_names(result.graph)["model"])
    generated = getattr(module, result.graph.name)()
    generated.load_state_dict(root.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randn([2 if d == "batch" else d for d in s.dims], generator=generator)
               for s in specs]
    expected = root(*samples)
    expected = expected if isinstance(expected, torch.Tensor) else expected[0]
    got = generated(*samples)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    expected.sum().backward()
    got.sum().backward()
    theirs = dict(root.named_parameters())
    for name, param in generated.named_parameters():
        if theirs[name].grad is None:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, theirs[name].grad, **TOLERANCE, msg=name)
    return generated, imported.text, result.graph


def test_a_users_frozen_parameter_layer_and_backbone(tmp_path):
    torch.manual_seed(0)
    root = Tagger()
    generated, text, graph = reproduce(root, ["x=batch,8"], tmp_path)
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if "op:" in line}
    assert "requires_grad: false" in lines["table"]
    assert "requires_grad: false" in lines["stem"]
    assert "requires_grad: false" in lines["backbone"]  # every parameter inside
    assert "requires_grad" not in lines["head"]
    assert frozen_names(generated) == frozen_names(root) != set()
    assert graph.trainable_params == sum(p.numel() for p in root.head.parameters())


def test_a_layer_frozen_in_part_is_refused(tmp_path):
    root = Tagger()
    root.head.bias.requires_grad_(False)
    with pytest.raises(MpgenError, match=r"layer 'head': Linear trains weight but not bias "
                                         r"\(requires_grad=False\), which a spec cannot write"):
        importer.import_module(root, [importer.parse_input("x=batch,8")], "mpgen import",
                               tracer="dynamo")


def test_whispers_position_table_stays_frozen(tmp_path):
    pytest.importorskip("transformers")
    config = {"vocab_size": 64, "num_mel_bins": 8, "d_model": 32, "encoder_layers": 2,
              "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
              "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_source_positions": 16,
              "max_target_positions": 32}
    root = importer.load_module("transformers.models.whisper.modeling_whisper:WhisperEncoder",
                                None, json.dumps(config))
    assert frozen_names(root) == {"embed_positions.weight"}
    generated, text, _ = reproduce(root, ["input_features=batch,8,32"], tmp_path)
    assert "embed_positions: {op: Embedding, args: [16, 32], requires_grad: false}" in text
    assert frozen_names(generated) == {"embed_positions.weight"}


class Stack(nn.Module):
    def __init__(self, frozen: tuple[int, ...]) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.stem.requires_grad_(False)
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
        for k in frozen:
            self.blocks[k].requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


@pytest.mark.parametrize("frozen", [(1,), (0, 1, 2)])
def test_torch_fx_too_and_copies_repeat_only_when_alike(tmp_path, frozen):
    root = Stack(frozen)
    specs = [importer.parse_input("x=batch,8")]
    text = importer.import_module(root, specs, "mpgen import", tracer="fx").text
    lines = [line.strip() for line in text.splitlines() if "op: Linear" in line]
    assert lines[0] == "stem: {op: Linear, args: [8, 16], requires_grad: false}"
    if frozen == (1,):  # the frozen copy breaks the run: no repeat
        assert "repeat" not in text
        assert [("requires_grad: false" in line) for line in lines] == [
            True, False, True, False, False]
    else:
        assert "blocks: {op: Linear, args: [16, 16], repeat: 3, requires_grad: false}" in lines
    path = tmp_path / "imported.yaml"
    path.write_text(text)
    result = build_to(path, tmp_path / "out", {"*": "cpu"})
    model = import_generated(tmp_path / "out" / file_names(result.graph)["model"])
    generated = getattr(model, result.graph.name)()
    trains = [p.requires_grad for p in generated.parameters()]
    assert trains == [p.requires_grad for p in root.parameters()]
