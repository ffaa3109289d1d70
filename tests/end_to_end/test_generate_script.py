"""generate_<name>.py run: the KV cache's generation equals the whole
window's, token for token, for hand-written decoders (learned positions and
a tied head: nano_gpt; rotary positions: tiny_llama) on the CPU and on two
virtual devices; imported Hugging Face decoders generate what Hugging Face's
generate does."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from helpers import EXAMPLES, build_to, import_generated
from mpgen.testing import virtual_devices

pytestmark = pytest.mark.slow

GREEDY = types.SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new_tokens=12)
SAMPLED = types.SimpleNamespace(temperature=0.8, top_k=8, top_p=0.9, seed=3, max_new_tokens=12)


def _built(tmp_path, example: str, device_map):
    result = build_to(EXAMPLES / example, tmp_path, device_map)
    (name,) = [n for n in result.files if n.startswith("generate_")]
    return import_generated(tmp_path / name)


def _agree(generate_module, prompts, how) -> None:
    runtime = generate_module.mpgen_runtime.generate
    training = generate_module.GENERATING.training
    torch.manual_seed(0)
    plain = training.model().eval()
    cached = generate_module.GENERATING.cached()
    cached.load_state_dict(plain.state_dict())
    cached.eval()
    for batch in prompts:
        with_cache, _ = runtime.continue_prompts(cached, batch, how, set(), True)
        without, _ = runtime.continue_prompts(plain, batch, how, set(), False)
        assert with_cache == without
        assert all(len(o) == len(p) + how.max_new_tokens for o, p in zip(with_cache, batch))


@pytest.mark.parametrize("example", ["nano_gpt.yaml", "tiny_llama.yaml"])
def test_cached_and_uncached_agree_on_the_cpu(example, tmp_path):
    module = _built(tmp_path, example, {"*": "cpu"})
    _agree(module, [[[5, 17, 3]], [[1, 2, 3, 4], [9, 8, 7, 6]]], GREEDY)
    _agree(module, [[[5, 17, 3]]], SAMPLED)


@pytest.mark.parametrize("example", ["nano_gpt.yaml", "tiny_llama.yaml"])
def test_cached_and_uncached_agree_on_two_virtual_devices(example, tmp_path):
    module = _built(tmp_path, example, None)
    with virtual_devices(cuda=2):
        _agree(module, [[[5, 17, 3]], [[1, 2, 3, 4], [9, 8, 7, 6]]], GREEDY)


ENCODER_LAYERS = """\
mpgen: 1
name: EncLM
inputs:
  tokens: {shape: [batch, seq], dtype: int64}
layers:
  wte: {op: Embedding, args: [40, 16], in: tokens}
  pos: {op: torch.arange, in: [], args: ["=size(tokens, 1)"]}
  wpe: {op: Embedding, args: [64, 16], in: pos}
  embed: {op: torch.add, in: [wte, wpe]}
  mask: {op: torch.ones, in: [], args: ["=size(tokens, 1)", "=size(tokens, 1)"], dtype: bool}
  causal: {op: torch.triu, diagonal: 1}
  h: {op: TransformerEncoderLayer, d_model: 16, nhead: 2, dim_feedforward: 32,
      dropout: 0.0, activation: gelu, batch_first: true, norm_first: NORM_FIRST,
      in: [embed, {src_mask: causal}], call: {is_causal: true}, repeat: 3}
  ln_f: {op: LayerNorm, args: [16]}
  lm_head: {op: Linear, args: [16, 40], bias: false, tie: {weight: wte.weight}}
placement:
  h.2: cuda:1
train:
  dims: {seq: 64}
"""


@pytest.mark.parametrize("norm_first", ["true", "false"])
def test_transformer_encoder_layers_with_a_causal_mask(norm_first, tmp_path):
    """gpt2_small's form: nn.TransformerEncoderLayer with a causal src_mask,
    a tied head, on two virtual devices."""
    spec = tmp_path / "enc_lm.yaml"
    spec.write_text(ENCODER_LAYERS.replace("NORM_FIRST", norm_first))
    result = build_to(spec, tmp_path / "out")
    module = import_generated(tmp_path / "out" / "generate_enc_lm.py")
    assert "KVTransformerEncoderLayer(" in result.files["generate_enc_lm.py"]
    with virtual_devices(cuda=2):
        _agree(module, [[[5, 17, 3]], [[1, 2, 3, 4], [9, 8, 7, 6]]], GREEDY)


MULTIHEAD = """\
mpgen: 1
name: MhaLM
inputs:
  tokens: {shape: [batch, seq], dtype: int64}
blocks:
  AttnBlock:
    params: [dim, heads]
    inputs: [x, causal]
    layers:
      norm: {op: LayerNorm, args: [$dim], in: x}
      attn: {op: MultiheadAttention, args: [$dim, $heads], batch_first: true,
             in: [norm, norm, norm, {attn_mask: causal}], output: 0, call: {need_weights: false}}
      res: {op: torch.add, in: [x, attn]}
layers:
  wte: {op: Embedding, args: [40, 16], in: tokens}
  pos: {op: torch.arange, in: [], args: ["=size(tokens, 1)"]}
  wpe: {op: Embedding, args: [64, 16], in: pos}
  embed: {op: torch.add, in: [wte, wpe]}
  mask: {op: torch.ones, in: [], args: ["=size(tokens, 1)", "=size(tokens, 1)"], dtype: bool}
  causal: {op: torch.triu, diagonal: 1}
  blocks: {op: AttnBlock, args: [16, 2], in: [embed, causal], repeat: 2}
  head: {op: Linear, args: [16, 40]}
placement:
  blocks.1: cuda:1
train:
  dims: {seq: 64}
"""


def test_multihead_attention_with_a_causal_mask(tmp_path):
    spec = tmp_path / "mha_lm.yaml"
    spec.write_text(MULTIHEAD)
    result = build_to(spec, tmp_path / "out")
    assert "KVMultiheadAttention(" in result.files["generate_mha_lm.py"]
    module = import_generated(tmp_path / "out" / "generate_mha_lm.py")
    with virtual_devices(cuda=2):
        _agree(module, [[[5, 17, 3]], [[1, 2, 3, 4], [9, 8, 7, 6]]], GREEDY)


def test_padding_is_never_attended(tmp_path):
    """Left padding: a prompt's continuation in a batch is the same whatever
    the padding ids are (rotary positions: only differences count, so it is
    the prompt's alone too)."""
    module = _built(tmp_path, "tiny_llama.yaml", {"*": "cpu"})
    runtime = module.mpgen_runtime.generate
    torch.manual_seed(0)
    model = module.GENERATING.cached().eval()
    batch, _ = runtime.continue_prompts(model, [[5, 6], [1, 2, 3, 4, 5]], GREEDY, set(), True)
    alone, _ = runtime.continue_prompts(model, [[5, 6]], GREEDY, set(), True)
    assert batch[0] == alone[0]


HF = {
    "gpt2": ("transformers:GPT2LMHeadModel",
             {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
              "bos_token_id": 0, "eos_token_id": 0}, "input_ids=batch,16:int64"),
    "llama": ("transformers:LlamaForCausalLM",
              {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
              "input_ids=batch,seq:int64"),
}


@pytest.mark.parametrize("case", list(HF))
@pytest.mark.parametrize("devices", ["cpu", "two"])
def test_imported_hugging_face_decoders_generate_what_it_generates(case, devices, tmp_path):
    pytest.importorskip("transformers")
    from mpgen.commands import importer

    target, config, tokens = HF[case]
    root = importer.load_module(target, None, json.dumps(config))
    imported = importer.import_module(root, [importer.parse_input(tokens)],
                                      f"mpgen import {target}", 2 if devices == "two" else None,
                                      tracer="dynamo")
    spec = tmp_path / "imported.yaml"
    spec.write_text(imported.text)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in root.parameters():
            param.normal_(0, 0.3)
    root.eval()
    root.save_pretrained(tmp_path / "pretrained")
    prompt = [5, 17, 42, 3]
    expected = root.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                             do_sample=False, max_new_tokens=20)[0].tolist()
    if devices == "cpu":
        result = build_to(spec, tmp_path / "out", {"*": "cpu"})
        (name,) = [n for n in result.files if n.startswith("generate_")]
        weights = str(tmp_path / "pretrained" / "model.safetensors")
        for flag in ([], ["--no-cache"]):
            ran = subprocess.run(
                [sys.executable, name, "--init", weights, "--prompt", "5,17,42,3",
                 "--max-new-tokens", "20", "--temperature", "0", *flag],
                cwd=tmp_path / "out", capture_output=True, text=True)
            assert ran.returncode == 0, ran.stderr
            assert ran.stdout.splitlines()[-1] == ",".join(map(str, expected))
        return
    result = build_to(spec, tmp_path / "out")
    assert len(result.graph.devices) == 2
    (name,) = [n for n in result.files if n.startswith("generate_")]
    module = import_generated(tmp_path / "out" / name)
    runtime = module.mpgen_runtime.generate
    how = types.SimpleNamespace(**{**vars(GREEDY), "max_new_tokens": 20})
    with virtual_devices(cuda=2):
        for use_cache in (True, False):
            model = (module.GENERATING.cached if use_cache
                     else module.GENERATING.training.model)()
            state = {imported.original_key(k): k for k in model.state_dict()}
            model.load_state_dict({state.get(k, k): v for k, v in root.state_dict().items()
                                   if k in state or k in model.state_dict()}, strict=False)
            model.eval()
            out, _ = runtime.continue_prompts(model, [prompt], how, set(), use_cache)
            assert out[0] == expected


def _tokenizer(folder) -> None:
    """A word-level tokenizer of nano_gpt's 65 ids, saved as Hugging Face saves one."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = {"<eos>": 0, **{f"w{k}": k for k in range(1, 65)}}
    model = tokenizers.models.WordLevel(words, unk_token="<eos>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    raw.decoder = tokenizers.decoders.WordPiece(prefix="##")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    fast.save_pretrained(folder)


def test_text_prompts_through_a_tokenizer(tmp_path):
    _tokenizer(tmp_path / "tokenizer")
    build_to(EXAMPLES / "nano_gpt.yaml", tmp_path / "out", {"*": "cpu"})
    module = import_generated(tmp_path / "out" / "nano_gpt.py")
    torch.manual_seed(0)
    torch.save(module.NanoGPT().state_dict(), tmp_path / "w.pt")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w17 w3\nw9 w8\n")
    ran = subprocess.run(
        [sys.executable, "generate_nano_gpt.py", "--init", str(tmp_path / "w.pt"), "--prompts",
         str(prompts), "--tokenizer", str(tmp_path / "tokenizer"), "--max-new-tokens", "5"],
        cwd=tmp_path / "out", capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    *text, first, second = ran.stdout.splitlines()
    assert first.startswith("5,17,3,") and second.startswith("9,8,")
    assert text[0].split()[:3] == ["w5", "w17", "w3"] and len(text) == 2
