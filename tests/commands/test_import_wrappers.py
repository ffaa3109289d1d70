"""A model held in the user's own class (a head added, a different forward)
imports like the library's model itself (docs/import.md, "Which tracer").

Each wrapper is a module of the project (written into ``tmp_path``, the
working directory), imported with the real command line and no ``--trace``;
the spec is built for the CPU, the wrapper's own ``state_dict()`` loads into
the generated model strictly by name, and outputs and every gradient agree
within 1e-5, in eval and train mode. Ties inside a block (``GPT2LMHeadModel``'s head, held in a
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

from helpers import build_to, import_generated, mpgen, write_spec
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError

pytestmark = pytest.mark.slow  # each imports, builds or runs a model: seconds

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


SHARED_EMBEDDING = """
mpgen: 1
name: Shared
inputs:
  idx: {shape: [batch, 8], dtype: int64}
blocks:
  Embed:
    inputs: [idx]
    layers:
      wte: {op: Embedding, args: [50, 16]}
      ln: {op: LayerNorm, args: [16]}
  EncoderDecoder:
    inputs: [idx]
    layers:
      encoder: {op: Embed}
      decoder: {op: Embed, in: idx, tie: {wte.weight: encoder.wte.weight}}
      both: {op: torch.add, in: [encoder, decoder]}
layers:
  model: {op: EncoderDecoder}
"""


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, idx):
        return self.ln(self.wte(idx))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Embed()
        self.decoder = Embed()
        self.decoder.wte.weight = self.encoder.wte.weight

    def forward(self, idx):
        return self.encoder(idx) + self.decoder(idx)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = EncoderDecoder()

    def forward(self, idx):
        return self.model(idx)


def test_a_tie_into_a_block_instance_inside_a_block(tmp_path):
    """BART's two embeddings, one parameter: the tie names a parameter inside
    the layer's block instance (``wte.weight`` of ``decoder``)."""
    result, generated = _built(tmp_path, SHARED_EMBEDDING)
    assert generated.model.decoder.wte.weight is generated.model.encoder.wte.weight
    reference = Shared()
    assert result.graph.total_params == sum(p.numel() for p in reference.parameters())
    generated.load_state_dict(reference.state_dict(), strict=True)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    expected, got = reference(idx), generated(idx)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    expected.sum().backward()
    got.sum().backward()
    theirs = dict(reference.named_parameters())
    for name, param in generated.named_parameters():
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


# -- wrappers around libraries' models, imported with the command line ---------------

#: The wrappers of Hugging Face models (tiny configurations), as a user writes them.
HUGGING_FACE = '''
import torch
from torch import nn
from transformers import (BartConfig, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel,
                          GPT2Model, LlamaConfig, LlamaModel)
from transformers.models.bart.modeling_bart import BartEncoder

GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, use_cache=False)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
BERT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64)
BART = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64)


class TiedHead(nn.Module):
    """A head of the user's, tied to the embedding inside the library's model."""

    def __init__(self):
        super().__init__()
        self.body = GPT2Model(GPT2Config(**GPT2))
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.body.wte.weight

    def forward(self, input_ids):
        return self.head(self.body(input_ids).last_hidden_state)


class WrappedLM(nn.Module):
    """The library's model whole (its own lm_head tie inside), another output."""

    def __init__(self):
        super().__init__()
        self.lm = GPT2LMHeadModel(GPT2Config(**GPT2))

    def forward(self, input_ids):
        return torch.log_softmax(self.lm(input_ids).logits, dim=-1)


class LlamaScorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.llama = LlamaModel(LlamaConfig(**LLAMA))
        self.score = nn.Linear(32, 3)

    def forward(self, input_ids):
        return self.score(self.llama(input_ids).last_hidden_state)


class BertClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.bert = BertModel(BertConfig(**BERT))
        self.classifier = nn.Linear(32, 5)

    def forward(self, input_ids):
        return self.classifier(self.bert(input_ids).pooler_output)


class BertTagger(nn.Module):
    """A head on the hidden states: the pooler runs, its result dropped."""

    def __init__(self):
        super().__init__()
        self.bert = BertModel(BertConfig(**BERT))
        self.tags = nn.Linear(32, 5)

    def forward(self, input_ids):
        return self.tags(self.bert(input_ids).last_hidden_state)


class BartEncoderHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = BartEncoder(BartConfig(**BART))
        self.head = nn.Linear(32, 2)

    def forward(self, input_ids):
        return self.head(self.encoder(input_ids).last_hidden_state)
'''

#: The wrappers of torchvision's and timm's models.
IMAGES = '''
import timm
import torch
from torch import nn
from torchvision.models import convnext_tiny, efficientnet_b0, resnet18
from torchvision.models.vision_transformer import VisionTransformer


class ResNetFeatures(nn.Module):
    """The library's classifier as a feature extractor, a head of the user's."""

    def __init__(self):
        super().__init__()
        self.backbone = resnet18(num_classes=10)
        self.backbone.fc = nn.Identity()
        self.head = nn.Linear(512, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit = VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2,
                                     hidden_dim=16, mlp_dim=32, num_classes=4)

    def forward(self, x):
        return torch.log_softmax(self.vit(x), dim=-1)


class EfficientNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = efficientnet_b0(num_classes=3)

    def forward(self, x):
        return self.net(x) * 2.0


class ConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = convnext_tiny(num_classes=3)

    def forward(self, x):
        return self.net(x)


class TimmResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = timm.create_model("resnet10t", num_classes=3)

    def forward(self, x):
        return self.net(x)
'''

TOKENS = "input_ids=batch,16:int64"
PICTURES = "x=batch,3,32,32"


def _samples(inputs: list[str]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for text in inputs:
        dims, _, dtype = text.partition("=")[2].partition(":")
        shape = [2 if d == "batch" else int(d) for d in dims.split(",")]
        samples.append(torch.randint(0, 64, shape, generator=generator) if dtype == "int64"
                       else torch.randn(shape, generator=generator))
    return samples


def _import_and_compare(tmp_path, monkeypatch, source: str, module: str, cls: str,
                        inputs: list[str]):
    """``mpgen import MODULE:CLS`` run in ``tmp_path`` (no --trace); the spec
    built for the CPU loads the wrapper's own state_dict() strictly by name
    and gives its outputs and every gradient within 1e-5, in eval and train
    mode. Returns the CLI's run, the wrapper and the generated model."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    args = [a for text in inputs for a in ("--input", text)]
    ran = mpgen("import", f"{module}:{cls}", *args, "-o", "wrapped.yaml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "traced with TorchDynamo" in (tmp_path / "wrapped.yaml").read_text()
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    original = getattr(importlib.import_module(module), cls)()
    with torch.no_grad():  # weights that make every output depend on them
        for param in original.parameters():
            param.normal_(0, 0.1)
    _, generated = _built(tmp_path, (tmp_path / "wrapped.yaml").read_text())
    generated.load_state_dict(original.state_dict(), strict=True)
    samples = _samples(inputs)
    theirs = dict(original.named_parameters(remove_duplicate=False))
    assert len(list(generated.parameters())) == len(list(original.parameters()))
    for train in (False, True):  # in train mode, the same dropout masks from the same seed
        original.train(train)
        generated.train(train)
        original.zero_grad()
        generated.zero_grad()
        torch.manual_seed(7)
        expected = original(*samples)
        torch.manual_seed(7)
        got = generated(*samples)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"train={train}")
        expected.sum().backward()
        got.sum().backward()
        for name, param in generated.named_parameters():
            assert (param.grad is None) == (theirs[name].grad is None), name
            if param.grad is not None:
                torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5,
                                           atol=1e-5, msg=f"{name} (train={train})")
    return ran, original, generated


@pytest.mark.parametrize("cls", ["TiedHead", "WrappedLM", "LlamaScorer", "BertClassifier",
                                 "BertTagger", "BartEncoderHead"])
def test_a_wrapped_hugging_face_model(cls, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    _, original, generated = _import_and_compare(tmp_path, monkeypatch, HUGGING_FACE,
                                                 f"hf_{cls.lower()}", cls, [TOKENS])
    if cls == "TiedHead":  # the tie from a layer of the wrapper into the library's model
        assert generated.head.weight is generated.body.wte.weight
    if cls == "WrappedLM":  # the library's own tie, inside the block of its class
        assert generated.lm.lm_head.weight is generated.lm.transformer.wte.weight
        assert {"lm.lm_head.weight", "lm.transformer.wte.weight"} <= set(
            generated.state_dict())
    if cls == "BertTagger":  # kept, its keys the original's; no gradient reaches it
        assert "bert.pooler.dense.weight" in generated.state_dict()
        assert not any(p.requires_grad for p in generated.bert.pooler.parameters())


@pytest.mark.parametrize("cls", ["ResNetFeatures", "ViT", "EfficientNet", "ConvNeXt",
                                 "TimmResNet"])
def test_a_wrapped_image_model(cls, tmp_path, monkeypatch):
    pytest.importorskip("torchvision")
    pytest.importorskip("timm")
    _import_and_compare(tmp_path, monkeypatch, IMAGES, f"images_{cls.lower()}", cls,
                        [PICTURES])


# -- which tracer, and what a failed trace says ------------------------------------

USERS = '''
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y
        return -y


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.gate(x) * 2


class ByRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.dim() == 2:
            y = torch.relu(y)
        return y
'''


def _line(source: str, text: str) -> tuple[int, int]:
    """The line of ``text`` in ``source`` and its statement's column, 1-based."""
    lines = textwrap.dedent(source).splitlines()
    number = next(i for i, line in enumerate(lines) if text in line)
    return number + 1, len(lines[number]) - len(lines[number].lstrip()) + 1


def test_where_torch_fx_fails_torchdynamo_is_next_and_says_so(tmp_path):
    (tmp_path / "users.py").write_text(textwrap.dedent(USERS), encoding="utf-8")
    ran = mpgen("import", "users:ByRank", "--input", "x=batch,4", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    line, _ = _line(USERS, "if y.dim() == 2")
    assert ran.stderr.count("\n") == 1, ran.stderr  # one line
    assert ran.stderr.startswith(f"mpgen import: note: users.py:{line}:")
    assert "torch.fx cannot trace ByRank.forward: TraceError:" in ran.stderr
    assert ran.stderr.endswith("; traced with TorchDynamo instead (--trace dynamo)\n")
    assert "users.ByRank traced with TorchDynamo" in ran.stdout
    assert "torch.relu" in ran.stdout


@pytest.mark.parametrize("trace", [None, "fx", "dynamo"])
def test_a_failed_trace_names_the_line_and_the_flag_to_try(tmp_path, trace):
    (tmp_path / "users.py").write_text(textwrap.dedent(USERS), encoding="utf-8")
    flags = ("--trace", trace) if trace else ()
    ran = mpgen("import", "users:Gated", "--input", "x=batch,4", *flags, cwd=tmp_path)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.count("\n") == 1, ran.stderr
    line, indent = _line(USERS, "if y.sum() > 0")
    fx = f"users.py:{line}:{indent + 3}: torch.fx cannot trace Gated.forward: TraceError: "
    dynamo = (f"users.py:{line}:{indent}: TorchDynamo cannot trace Gated.forward: "
              "Unsupported: Data-dependent branching")
    if trace == "fx":
        assert ran.stderr.startswith(fx), ran.stderr
        assert ran.stderr.endswith("; try --trace dynamo (TorchDynamo runs forward's Python: "
                                   "control flow, library code)\n")
    elif trace == "dynamo":
        assert ran.stderr.startswith(dynamo), ran.stderr
        assert ran.stderr.endswith("; try --trace fx (torch.fx traces forward symbolically, "
                                   "your modules through)\n")
    else:  # both tried: both reasons, no flag left to try
        assert ran.stderr.startswith(fx), ran.stderr
        assert f"; --trace dynamo, tried next, fails too: {dynamo}" in ran.stderr
        assert "try --trace" not in ran.stderr


def test_a_failed_trace_in_a_librarys_code_names_its_line_and_the_callers(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "hf_wrappers.py").write_text(textwrap.dedent(HUGGING_FACE), encoding="utf-8")
    ran = mpgen("import", "hf_wrappers:TiedHead", "--input", TOKENS, "--trace", "fx",
                cwd=tmp_path)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    where, message = ran.stderr.split(": torch.fx cannot trace TiedHead.forward: ", 1)
    file, line, col = where.rsplit(":", 2)
    assert file.endswith(".py") and "transformers" in file and line.isdigit() and col.isdigit()
    line, _ = _line(HUGGING_FACE, "return self.head(self.body(input_ids)")
    assert f"(called from hf_wrappers.py:{line}:" in message
    assert message.endswith("; try --trace dynamo (TorchDynamo runs forward's Python: "
                            "control flow, library code)\n")


def test_a_wrapped_model_splits_over_two_devices_inside_the_librarys(tmp_path):
    """With --devices 2, the library's model held whole (``lm``) and its body
    inside (``lm.transformer``) are split: both devices hold parameters,
    and the head's tie follows its owner, inside the split instance."""
    pytest.importorskip("transformers")
    (tmp_path / "hf_split.py").write_text(textwrap.dedent(HUGGING_FACE), encoding="utf-8")
    ran = mpgen("import", "hf_split:WrappedLM", "--input", TOKENS, "--devices", "2", "-o",
                "wrapped.yaml", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    text = (tmp_path / "wrapped.yaml").read_text()
    assert "split: [lm, lm.transformer]" in text
    result = build_to(tmp_path / "wrapped.yaml", tmp_path / "out")  # for two GPUs, none needed
    by_device = result.graph.params_by_device()
    assert set(by_device) == {"cuda:0", "cuda:1"} and all(by_device.values()), by_device
    ties = {(n.name, t.param): t.source for n in result.graph.nodes for t in n.ties}
    assert ties == {("lm.lm_head", "weight"): "lm.transformer.wte.weight"}


def test_the_default_tracer_follows_the_modules_a_class_holds(tmp_path, monkeypatch):
    """fx for a class of the project made of torch.nn layers; TorchDynamo for a
    library's model and for a class of the project holding one's modules,
    a library installed inside the project's folder (its .venv) included."""
    from mpgen.commands.importer import default_tracer, library_modules, load_module

    installed = tmp_path / ".venv" / "lib" / "site-packages"
    installed.mkdir(parents=True)
    (installed / "libnet.py").write_text(
        "from torch import nn\n\n\nclass Block(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n"
        "\n    def forward(self, x):\n        return self.fc(x)\n", encoding="utf-8")
    (tmp_path / "mine.py").write_text(
        "from torch import nn\nfrom libnet import Block\n\n\nclass Plain(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n"
        "\n    def forward(self, x):\n        return self.fc(x)\n\n\nclass Holder(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.inner = Plain()\n"
        "        self.lib = Block()\n\n    def forward(self, x):\n"
        "        return self.lib(self.inner(x))\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.chdir(tmp_path)
    for module in ("mine", "libnet"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    plain, holder = load_module("mine:Plain"), load_module("mine:Holder")
    assert library_modules(plain) == [] and library_modules(holder) == ["lib"]
    assert default_tracer("mine:Plain", plain) == "fx"
    assert default_tracer("mine:Holder", holder) == "dynamo"
    assert default_tracer("libnet:Block", load_module("libnet:Block")) == "dynamo"
