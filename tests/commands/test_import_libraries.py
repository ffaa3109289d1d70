"""``mpgen import`` of the models people already use: Hugging Face
transformers' classes (tiny configurations) and torchvision's classification
models, traced with TorchDynamo and their module hierarchy kept as blocks.

Each case imports the model as ``mpgen import`` does, builds the spec for the
CPU, loads the original's ``state_dict()`` into the generated model strictly,
by name (its keys are the original's: docs/import.md, "State-dict keys"), and
compares the eval outputs exactly and the gradients of a backward pass; then an
automatic split over two devices builds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import build_to, import_generated, mpgen, mpgen_process
from mpgen.compiler.codegen.common import file_names

pytestmark = pytest.mark.slow

CPU = {"*": "cpu"}

#: name -> (MODULE:NAME, --config or --args, inputs, HF?)
LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
BERT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "num_labels": 3}
BART = {"vocab_size": 64, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64, "max_position_embeddings": 64}
GPT2 = {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
TOKENS = ["input_ids=batch,16:int64"]
#: Traced, transformers builds Llama's causal mask as a tensor (it passes
#: ``is_causal=True`` and no mask only when not traced): the same outputs,
#: gradients that differ by float rounding (SDPA's backward with a mask).
ROUNDED_GRADIENTS = {"llama"}
IMAGES = ["x=batch,3,32,32"]

HUGGING_FACE = {
    "llama": ("transformers:LlamaForCausalLM", LLAMA, TOKENS),
    "bert": ("transformers:BertForSequenceClassification", BERT, TOKENS),
    "bart": ("transformers:BartForConditionalGeneration", BART,
             [*TOKENS, "decoder_input_ids=batch,16:int64"]),
    "gpt2": ("transformers:GPT2LMHeadModel", GPT2, TOKENS),
}
TORCHVISION = {
    "vit_b_16": ("torchvision.models:vit_b_16", {"image_size": 32}, IMAGES),
    "convnext_tiny": ("torchvision.models:convnext_tiny", {}, IMAGES),
    "efficientnet_b0": ("torchvision.models:efficientnet_b0", {}, IMAGES),
    "resnet50": ("torchvision.models:resnet50", {}, IMAGES),
    "mobilenet_v3_small": ("torchvision.models:mobilenet_v3_small", {}, IMAGES),
}


def _import(target: str, arguments: dict, inputs: list, hf: bool, devices=None):
    from mpgen.commands import importer

    root = importer.load_module(target, None if hf else json.dumps(arguments),
                                json.dumps(arguments) if hf else None)
    specs = [importer.parse_input(text) for text in inputs]
    imported = importer.import_module(root, specs, f"mpgen import {target}", devices,
                                      tracer="dynamo")
    return root, specs, imported


def _generated(imported, tmp_path, device_map=CPU):
    spec = tmp_path / "imported.yaml"
    spec.write_text(imported.text)
    result = build_to(spec, tmp_path / "out", device_map)
    path = tmp_path / "out" / file_names(result.graph)["model"]
    if device_map is None:
        return path.read_text()
    return getattr(import_generated(path), result.graph.name)()


def _samples(specs) -> list:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for spec in specs:
        shape = [2 if d == "batch" else d for d in spec.dims]
        if spec.dtype == "int64":
            samples.append(torch.randint(0, 64, shape, generator=generator))
        else:
            samples.append(torch.randn(shape, generator=generator))
    return samples


def _first(output):
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]


def _check(case: str, table: dict, hf: bool, tmp_path) -> None:
    target, arguments, inputs = table[case]
    root, specs, imported = _import(target, arguments, inputs, hf)
    torch.manual_seed(0)
    with torch.no_grad():  # weights that make every output depend on them
        for param in root.parameters():
            param.normal_(0, 0.1)
    generated = _generated(imported, tmp_path)
    assert not imported.renamed
    generated.load_state_dict(root.state_dict(), strict=True)
    root.eval()
    generated.eval()
    samples = _samples(specs)
    expected = _first(root(**{s.name: x for s, x in zip(specs, samples)}))
    got = _first(generated(*samples))
    assert torch.equal(expected, got)
    expected.sum().backward()
    got.sum().backward()
    theirs = dict(root.named_parameters())
    for name, param in generated.named_parameters():
        original = theirs[name]
        if case in ROUNDED_GRADIENTS:
            torch.testing.assert_close(param.grad, original.grad, rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(param.grad, original.grad), name
    return imported


# BART's model.shared, which forward never calls (its encoder's and decoder's
# embed_tokens tie to it), is a layer with call: false (docs/spec.md, "Layers")
@pytest.mark.parametrize("case", HUGGING_FACE)
def test_hugging_face(case, tmp_path):
    pytest.importorskip("transformers")
    _check(case, HUGGING_FACE, True, tmp_path)


@pytest.mark.parametrize("case", TORCHVISION)
def test_torchvision(case, tmp_path):
    pytest.importorskip("torchvision")
    imported = _check(case, TORCHVISION, False, tmp_path)
    if case == "efficientnet_b0":  # blocks alike but for numbers: one block with params
        assert "params: [in_channels, out_channels, kernel_size" in imported.text
        assert imported.text.count("\n  MBConv") < 8


@pytest.mark.parametrize("case", [*HUGGING_FACE, *TORCHVISION])
def test_split_over_two_devices_builds(case, tmp_path):
    hf = case in HUGGING_FACE
    target, arguments, inputs = (HUGGING_FACE if hf else TORCHVISION)[case]
    _, _, imported = _import(target, arguments, inputs, hf, devices=2)
    assert "devices: [cuda:0, cuda:1]" in imported.text
    model = _generated(imported, tmp_path, None)  # for two GPUs (none needed to build)
    per_device = model[model.index("Parameters per device:"):].split("total:")[0]
    assert "cuda:0:" in per_device and "cuda:1:" in per_device, per_device


def test_command_line(tmp_path):
    """A Hugging Face class with --config, a torchvision function with --args."""
    spec = tmp_path / "gpt2.yaml"
    ran = mpgen("import", "transformers:GPT2LMHeadModel", "--config", json.dumps(GPT2),
                "--input", TOKENS[0], "-o", str(spec), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "traced with TorchDynamo" in spec.read_text()
    ran = mpgen("import", "torchvision.models:resnet18", "--input", IMAGES[0], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "BasicBlock" in ran.stdout


def test_the_environments_mpgen_imports_and_builds_torchvision_resnet18(tmp_path):
    """The console script of the environment scripts/setup.sh makes, as a
    user runs it: torchvision imports (its C++ operators load beside this
    torch), ``mpgen import torchvision.models:resnet18`` writes a spec,
    ``mpgen build`` builds it, and the generated model loads torchvision's
    weights by name and computes what torchvision's computes."""
    console = [str(Path(sys.executable).with_name("mpgen"))]
    # No --input: torchvision's builder says what it takes (224x224 images).
    imported = mpgen_process("import", "torchvision.models:resnet18",
                             "-o", "resnet18.yaml", cwd=tmp_path, command=console)
    assert imported.returncode == 0, imported.stderr
    assert imported.stderr.splitlines() == [
        "mpgen import: note: --input x=batch,3,224,224 (torchvision's resnet18 weights take "
        "224x224 images); give --input to change it",
        "wrote resnet18.yaml (ResNet, 11 layers)",
    ]
    built = mpgen_process("build", "resnet18.yaml", "-o", "out", "--device-map", "cpu",
                          cwd=tmp_path, command=console)
    assert built.returncode == 0, built.stderr
    assert "resnet18.yaml: ResNet, 11,689,512 parameters on cpu" in built.stdout
    import torchvision

    torch.manual_seed(0)
    original = torchvision.models.resnet18().eval()
    generated = import_generated(tmp_path / "out" / "res_net.py").ResNet().eval()
    generated.load_state_dict(original.state_dict(), strict=True)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(generated(images), original(images))


def test_an_error_names_the_line_of_the_traced_code(tmp_path):
    """What a spec cannot write stops the import at the library's (here the
    project's) line, not at mpgen's or torch's."""
    (tmp_path / "halves.py").write_text(
        "import torch.nn as nn\n"
        "\n"
        "\n"
        "class Halves(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n"
        "\n"
        "    def forward(self, x):\n"
        "        return self.fc(x).double()\n")
    ran = mpgen("import", "halves:Halves", "--input", "x=batch,4", "--trace", "dynamo",
                cwd=tmp_path)
    assert ran.returncode == 2
    assert ran.stderr.startswith("halves.py:10:9: "), ran.stderr
    assert "casts float32 to float64, a dtype a spec does not have" in ran.stderr


def test_a_table_read_along_a_symbolic_dim_is_named(tmp_path):
    """BERT slices its position ids (64 of them) to the sequence's length: a
    symbolic ``seq`` fails the build's check at large sizes, and the error
    says to give it a size."""
    target, arguments, _ = HUGGING_FACE["bert"]
    ran = mpgen("import", target, "--config", json.dumps(arguments), "--input",
                "input_ids=batch,seq:int64", cwd=tmp_path)
    assert ran.returncode == 2
    assert "layer 'bert.embeddings.position_ids_1': torch.narrow" in ran.stderr
    assert "hint: the build checks symbolic dims (input_ids: seq)" in ran.stderr
