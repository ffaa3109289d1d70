"""``mpgen import`` without ``--input``: a torchvision, Hugging Face or timm
model takes what its library says (docs/import.md, "Inputs the library
knows"), said in a note and recorded in the spec's header as if given; any
other model's import stops in one line naming ``forward``'s arguments."""

from __future__ import annotations

import json
import textwrap

import pytest

from helpers import mpgen
from mpgen.commands.importer import known_inputs, no_inputs

GPT2 = {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
VIT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
       "intermediate_size": 64, "image_size": 32, "patch_size": 8}


@pytest.mark.slow
def test_torchvision_resnet18_imports_and_builds_without_input(tmp_path):
    pytest.importorskip("torchvision")
    ran = mpgen("import", "torchvision.models:resnet18", "-o", "resnet18.yaml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == (
        "mpgen import: note: --input x=batch,3,224,224 (torchvision's resnet18 weights take "
        "224x224 images); give --input to change it\n"
        "wrote resnet18.yaml (ResNet, 11 layers)\n")
    text = (tmp_path / "resnet18.yaml").read_text()
    assert text.startswith("# Made by `mpgen import torchvision.models:resnet18 --input "
                           "x=batch,3,224,224`:\n")
    assert "  x: [batch, 3, 224, 224]\n" in text
    built = mpgen("build", "resnet18.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert "resnet18.yaml: ResNet, 11,689,512 parameters on cpu" in built.stdout


@pytest.mark.slow
@pytest.mark.parametrize("target, config, given", [
    # GPT-2's learned position table (64 rows): a fixed length, the table's
    ("transformers:GPT2LMHeadModel", GPT2, "input_ids=batch,64:int64"),
    # Llama's rotary positions read no table: a symbolic length
    ("transformers:LlamaForCausalLM", LLAMA, "input_ids=batch,seq:int64"),
    ("transformers:ViTForImageClassification", VIT, "pixel_values=batch,3,32,32"),
])
def test_a_hugging_face_model_takes_its_main_input(target, config, given, tmp_path):
    pytest.importorskip("transformers")
    ran = mpgen("import", target, "--config", json.dumps(config), "-o", "model.yaml",
                cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.startswith(f"mpgen import: note: --input {given} ("), ran.stderr
    header = (tmp_path / "model.yaml").read_text().splitlines()[0]
    assert header.endswith(f" --input {given}`:"), header


def test_a_model_no_library_describes_names_forwards_arguments(tmp_path):
    (tmp_path / "mine.py").write_text(textwrap.dedent("""\
        import torch.nn as nn


        class Pair(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x, mask, scale=1.0):
                return self.fc(x) * mask * scale
        """))
    ran = mpgen("import", "mine:Pair", "-o", "pair.yaml", cwd=tmp_path)
    assert ran.returncode == 2
    assert ran.stderr == (
        "mine:Pair: no --input, and Pair is none of the models whose inputs mpgen knows "
        "(torchvision classification, timm, Hugging Face of input_ids or pixel_values): give "
        "Pair.forward's x, mask the shape of each, once per argument, with --input "
        "x=D0,D1,... (each dim a size or a name such as batch)\n")
    assert ran.stdout == ""
    assert not (tmp_path / "pair.yaml").exists()


def test_a_torchvision_class_without_weights_takes_224(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    known = known_inputs("torchvision.models:SqueezeNet", torchvision.models.SqueezeNet())
    assert known.texts == ("x=batch,3,224,224",)
    assert "224x224, ImageNet's usual crop" in known.why
    inception = known_inputs("torchvision.models:inception_v3",
                             torchvision.models.inception_v3(init_weights=False))
    assert inception.texts == ("x=batch,3,299,299",)


def test_a_timm_model_takes_its_configured_size():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1)
    assert known_inputs("timm:create_model", model).texts == ("x=batch,3,32,32",)
    model = timm.create_model("resnet10t")  # pretrained_cfg: input_size (3, 176, 176)
    assert known_inputs("timm:create_model", model).texts == ("x=batch,3,176,176",)


def test_a_hugging_face_model_of_other_inputs_needs_input():
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(d_model=32, encoder_layers=1, encoder_attention_heads=4,
                                        encoder_ffn_dim=64, num_mel_bins=8,
                                        max_source_positions=16)
    encoder = transformers.models.whisper.modeling_whisper.WhisperEncoder(config)
    target = "transformers.models.whisper.modeling_whisper:WhisperEncoder"
    assert known_inputs(target, encoder) is None  # its main input: input_features
    assert "give WhisperEncoder.forward's input_features its shape with --input " \
           "input_features=D0,D1,..." in no_inputs(target, encoder).message
