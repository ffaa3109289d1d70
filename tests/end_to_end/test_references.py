"""Generated models against public reference implementations, with the same
weights: Hugging Face's GPT2LMHeadModel, torchvision's resnet50, an LSTM
language model built from torch.nn, and the U-Net at odd input sizes.

Each reference is built from its config class at small sizes (no weights
are downloaded); its weights are copied into the generated model with a
strict ``load_state_dict``. The generated code is built from the committed
examples (the GPT-2 example at small sizes), never edited, and run either
on the CPU (``--device-map cpu``) or as written for two GPUs on virtual
devices, where the head tied across devices is exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpgen.testing import virtual_devices

from helpers import EXAMPLES, build_to, import_generated
from mpgen.compiler.codegen.common import file_names

#: Slow: torchvision's and Hugging Face's models, built and run beside the generated ones.
pytestmark = pytest.mark.slow

CPU = {"*": "cpu"}


def generated_model(spec: Path, out: Path, device_map=None):
    """Build ``spec`` into ``out`` and return the generated model class."""
    result = build_to(spec, out, device_map)
    path = out / file_names(result.graph)["model"]
    module = import_generated(path)
    return getattr(module, result.graph.name)


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- GPT-2 ---------------------------------------------------------------------

def hugging_face():
    """transformers, or a skip of the GPT-2 checks only."""
    return pytest.importorskip("transformers")


VOCAB, POSITIONS, WIDTH, HEADS, LAYERS = 65, 32, 64, 4, 4


def hf_gpt2(activation: str) -> nn.Module:
    transformers = hugging_face()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=WIDTH, n_layer=LAYERS,
        n_head=HEADS, activation_function=activation, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    # Non-trivial LayerNorm parameters and biases (GPT-2 starts them at 1 and 0).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def hf_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF GPT-2's weights with nn.Linear layout: no "transformer." prefix, the
    Conv1D weights (stored [in, out]) transposed, no attention-mask buffers."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
              "mlp.c_proj.weight")
    weights = {}
    for key, value in model.state_dict().items():
        key = key.removeprefix("transformer.")
        if key.split(".")[-2:] in (["attn", "bias"], ["attn", "masked_bias"]):
            continue
        weights[key] = value.t() if key.endswith(conv1d) else value
    return weights


def as_encoder_layers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights under nn.TransformerEncoderLayer's names (q, k and v
    are packed the same way in c_attn and in_proj)."""
    names = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn.weight": "self_attn.in_proj_weight",
             "attn.c_attn.bias": "self_attn.in_proj_bias", "attn.c_proj": "self_attn.out_proj",
             "mlp.c_fc": "linear1", "mlp.c_proj": "linear2"}
    renamed = {}
    for key, value in weights.items():
        if key.startswith("h."):
            for old, new in names.items():
                key = key.replace(f".{old}", f".{new}")
        renamed[key] = value
    return renamed


@pytest.fixture(scope="module")
def nano_gpt(tmp_path_factory):
    """The nanoGPT example as written for two GPUs (the head on cuda:1 tied to
    the embedding on cuda:0)."""
    return generated_model(EXAMPLES / "nano_gpt.yaml", tmp_path_factory.mktemp("nano"))


def small_gpt2_spec(tmp_path: Path) -> Path:
    """examples/gpt2_small.yaml, unchanged but for its sizes."""
    text = (EXAMPLES / "gpt2_small.yaml").read_text()
    sizes = [("50257", str(VOCAB)), ("[1024, 768]", f"[{POSITIONS}, 768]"),
             ("768", str(WIDTH)), ("nhead: 12", f"nhead: {HEADS}"),
             ("dim_feedforward: 3072", f"dim_feedforward: {4 * WIDTH}"),
             ("repeat: 12", f"repeat: {LAYERS}"), ("h.0-5", "h.0-1"), ("h.6-11", "h.2-3")]
    for old, new in sizes:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "gpt2_tiny.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def gpt2_encoder_layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    return generated_model(small_gpt2_spec(folder), folder / "out")


def run_on_virtual_gpus(model_class, reference, weights, idx, targets):
    """Load ``weights`` strictly into the model as generated for two GPUs (as
    many parameters as ``reference``), run forward and backward; the logits
    and the tied embedding's gradient, as plain CPU tensors."""
    with virtual_devices(cuda=2):
        model = model_class()
        assert count(model) == count(reference)
        model.load_state_dict(weights, strict=True)
        model.eval()
        assert model.lm_head.weight is model.wte.weight
        assert model.wte.weight.device == torch.device("cuda:0")
        assert model.lm_head.weight.device == torch.device("cuda:0")
        logits = model(idx)
        assert logits.device == torch.device("cuda:1")
        F.cross_entropy(logits.flatten(0, 1), targets.to(logits.device).flatten()).backward()
        return logits.detach().cpu(), model.wte.weight.grad.cpu()


def reference_run(reference, idx, targets):
    reference.zero_grad()
    logits = reference(idx).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach(), reference.transformer.wte.weight.grad


def tokens(seed: int, batch: int = 2, seq: int = POSITIONS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", ["nano_gpt", "gpt2_small"])
def test_gpt2_logits_and_tied_gradient_equal_hugging_face(form, nano_gpt, gpt2_encoder_layers):
    # The written-out decoder uses GPT-2's tanh GELU; nn.TransformerEncoderLayer's
    # "gelu" is the exact one, so that form is compared with HF's "gelu".
    if form == "nano_gpt":
        model_class, activation, rename = nano_gpt, "gelu_new", dict
    else:
        model_class, activation, rename = gpt2_encoder_layers, "gelu", as_encoder_layers
    reference = hf_gpt2(activation)
    weights = rename(hf_weights(reference))
    idx, targets = tokens(1), tokens(2)
    logits, grad = run_on_virtual_gpus(model_class, reference, weights, idx, targets)
    expected_logits, expected_grad = reference_run(reference, idx, targets)
    torch.testing.assert_close(logits, expected_logits, atol=1e-6, rtol=1e-6)
    # The embedding's gradient holds both uses: the lookup and the tied head.
    assert expected_grad.abs().max() > 0
    torch.testing.assert_close(grad, expected_grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("form", ["nano_gpt", "gpt2_small"])
def test_gpt2_positions_never_see_the_future(form, nano_gpt, gpt2_encoder_layers):
    model_class = nano_gpt if form == "nano_gpt" else gpt2_encoder_layers
    with virtual_devices(cuda=2), torch.no_grad():
        torch.manual_seed(0)
        model = model_class().eval()
        idx = tokens(3)
        changed = idx.clone()
        changed[:, 20:] = (changed[:, 20:] + 1) % VOCAB
        before, after = model(idx).cpu(), model(changed).cpu()
    torch.testing.assert_close(after[:, :20], before[:, :20], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, 20:], before[:, 20:])


def test_gpt2_small_example_is_the_published_size():
    from mpgen.compiler import driver

    graph = driver.compile_spec(EXAMPLES / "gpt2_small.yaml")
    assert graph.total_params == 124_439_808
    assert graph.node("h").devices == ("cuda:0",) * 6 + ("cuda:1",) * 6
    assert graph.node("lm_head").devices == ("cuda:1",)
    transformers = hugging_face()
    with torch.device("meta"):
        reference = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert count(reference) == 124_439_808


# -- ResNet-50 -----------------------------------------------------------------




def from_torchvision_resnet(key: str) -> str:
    """torchvision's ResNet keys as the example names them: layerN.0 is
    layerN_0 (its downsample.0/1 are down_conv/down_bn), layerN.K is
    layerN.(K-1)."""
    parts = key.split(".")
    if parts[0].startswith("layer"):
        stage, block, rest = parts[0], int(parts[1]), parts[2:]
        if block == 0:
            if rest[0] == "downsample":
                rest = [{"0": "down_conv", "1": "down_bn"}[rest[1]], *rest[2:]]
            return ".".join([f"{stage}_0", *rest])
        return ".".join([stage, str(block - 1), *rest])
    return key


def test_resnet50_with_symbolic_height_and_width_equals_torchvision(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    reference = torchvision.models.resnet50()
    # Non-trivial batch-norm statistics, so eval mode is really compared.
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
    reference.eval()
    model = generated_model(EXAMPLES / "resnet50.yaml", tmp_path, CPU)().eval()
    assert count(model) == count(reference) == 25_557_032
    weights = {from_torchvision_resnet(k): v for k, v in reference.state_dict().items()}
    assert len(weights) == len(reference.state_dict())
    model.load_state_dict(weights, strict=True)
    images = torch.randn(2, 3, 67, 45, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, expected = model(images), reference(images)
    assert out.shape == (2, 1000)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# -- LSTM language model -------------------------------------------------------


class RNNModel(nn.Module):
    """pytorch/examples' word_language_model RNNModel (LSTM), returning the
    decoder's logits and the final state."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, tokens, hidden):
        emb = self.drop(self.encoder(tokens))
        output, (hn, cn) = self.rnn(emb, hidden)
        return self.decoder(self.drop(output)), hn, cn


def test_lstm_lm_equals_torch_nn_lstm_with_state(tmp_path):
    torch.manual_seed(0)
    reference = RNNModel(50, 16, 32, 2, 0.2).eval()
    model = generated_model(EXAMPLES / "lstm_lm.yaml", tmp_path, CPU)().eval()
    assert count(model) == count(reference) == 17_298
    model.load_state_dict(reference.state_dict(), strict=True)
    g = torch.Generator().manual_seed(1)
    seq, batch = 9, 3
    tokens_ = torch.randint(0, 50, (seq, batch), generator=g)
    h0, c0 = torch.randn(2, batch, 32, generator=g), torch.randn(2, batch, 32, generator=g)
    with torch.no_grad():
        decoded, hn, cn = model(tokens_, h0, c0)
        expected = reference(tokens_, (h0, c0))
        from_zeros = model(tokens_, torch.zeros_like(h0), torch.zeros_like(c0))
    for got, want in zip((decoded, hn, cn), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert decoded.shape == (seq, batch, 50) and hn.shape == cn.shape == (2, batch, 32)
    # The initial state is really used, and the final state carries on: two
    # halves with the state passed along equal the whole sequence.
    assert not torch.allclose(from_zeros[1], hn)
    with torch.no_grad():
        first = model(tokens_[:4], h0, c0)
        second = model(tokens_[4:], first[1], first[2])
    torch.testing.assert_close(torch.cat([first[0], second[0]]), decoded, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(second[1], hn, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(second[2], cn, atol=1e-6, rtol=1e-6)


# -- U-Net ---------------------------------------------------------------------


def test_unet_output_has_the_input_size_at_odd_sizes(tmp_path):
    model_class = generated_model(EXAMPLES / "unet.yaml", tmp_path)
    with virtual_devices(cuda=2), torch.no_grad():
        model = model_class().eval()
        for height, width in [(37, 45), (29, 51)]:
            out = model(torch.randn(1, 3, height, width))
            assert out.device == torch.device("cuda:1")
            assert tuple(out.shape) == (1, 1, height, width)


# -- Llama: Hugging Face's hierarchy, split inside its body --------------------

def hf_llama() -> nn.Module:
    transformers = hugging_face()
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the RMSNorm weights start at 1: make every one matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("where", ["cpu", "two virtual GPUs"])
def test_tiny_llama_loads_hugging_faces_state_dict_with_no_mapping(tmp_path, where):
    """examples/tiny_llama.yaml mirrors LlamaForCausalLM's hierarchy (Parameter
    RMSNorm weights, a non-persistent inv_freq Buffer, GQA) and splits its
    body block over two devices: HF's state dict loads strictly as it is, and
    logits and every gradient are equal bit for bit."""
    reference = hf_llama()
    Model = generated_model(EXAMPLES / "tiny_llama.yaml", tmp_path,
                            CPU if where == "cpu" else None)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    want = reference(ids).logits
    want.sum().backward()
    with virtual_devices(2):
        model = Model().eval()
        model.load_state_dict(reference.state_dict(), strict=True)
        if where != "cpu":
            assert model.model.layers[3].mlp.up_proj.weight.device.index == 1
            assert model.model.embed_tokens.weight.device.index == 0
        out = model(ids)
        assert torch.equal(out.cpu(), want)
        out.sum().backward()
        ours = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            assert torch.equal(ours[name].grad.cpu(), p.grad), name
