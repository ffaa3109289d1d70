"""codegen/generate.py: generate_<name>.py for decoders only, in black's
layout, the model's classes with the cache's layers swapped in (and the
model's state-dict keys), or the reason there is no cache; the build's note."""

from __future__ import annotations

import black
import pytest

from helpers import EXAMPLES, ROOT, build_to, import_generated, mpgen
from mpgen.compiler import driver
from mpgen.compiler.codegen import format
from mpgen.compiler.codegen.generate import render_generate, wanted

DECODERS = ["nano_gpt", "tiny_llama", "gpt2_small", "lstm_lm"]


@pytest.mark.slow  # 4 s: too long for the quick loop
@pytest.mark.parametrize("example", DECODERS)
def test_a_decoder_gets_a_black_clean_generate_script(example):
    graph = driver.compile_spec(EXAMPLES / f"{example}.yaml")
    if not wanted(graph):
        pytest.skip(f"{example} is not a decoder by the definition")
    text = render_generate(graph)
    assert black.format_str(text, mode=format.black_mode()) == text
    compile(text, "generate.py", "exec")


def test_other_specs_get_none():
    graph = driver.compile_spec(EXAMPLES / "seed.yaml", {"*": "cpu"})
    assert not wanted(graph)
    assert not [n for n in driver.generate(EXAMPLES / "seed.yaml", {"*": "cpu"}).files
                if n.startswith("generate_")]


def test_the_cached_classes_swap_the_layers_and_keep_the_keys(tmp_path):
    result = build_to(EXAMPLES / "nano_gpt.yaml", tmp_path, {"*": "cpu"})
    text = result.files["generate_nano_gpt.py"]
    assert "self.att = mpgen_runtime.generate.KVAttention()" in text
    assert "self.pos = mpgen_runtime.generate.Positions()" in text
    assert "att = self.att(qt, kt, vt, is_causal=True)" in text
    assert "pos = self.pos(idx.size(1))" in text
    module = import_generated(tmp_path / "generate_nano_gpt.py")
    cached = module.GENERATING.cached()
    plain = module.GENERATING.training.model()
    assert list(cached.state_dict()) == list(plain.state_dict())
    assert module.GENERATING.vocab == 65 and module.GENERATING.max_length == 32


def test_the_build_notes_a_decoder_it_cannot_cache(tmp_path):
    spec = tmp_path / "conv_lm.yaml"
    spec.write_text("""\
mpgen: 1
name: ConvLM
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  emb: {op: Embedding, args: [16, 8], in: idx}
  mix: {op: torch.cumsum, dim: 1}
  head: {op: Linear, args: [8, 16]}
""")
    ran = mpgen("build", str(spec), "-o", str(tmp_path / "out"), "--device-map", "cpu")
    assert ran.returncode == 0, ran.stderr
    notes = [line for line in (ran.stdout + ran.stderr).splitlines() if "KV cache" in line]
    assert notes == [f"{spec}:7:3: note: generate_conv_lm.py runs without a KV cache (the "
                     "whole window again for every token): torch.cumsum mixes the sequence's "
                     "positions"]
    assert (tmp_path / "out" / "generate_conv_lm.py").is_file()
