"""Generated files are named after the model's class name as its user writes
it: snake case at the camel-case word boundaries, with acronyms and the
mixed-case words of model names (ViT, RoBERTa, ConvNeXt) kept whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import build_to, write_spec
from mpgen.compiler.frontend.namespace import MIXED_CASE_WORDS, module_name, module_stems

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name, stem", [
    ("SimpleModel", "simple_model"),
    ("DigitViT", "digit_vit"),
    ("ViT", "vit"),
    ("ViTB16", "vit_b16"),
    ("ViTMAE", "vit_mae"),
    ("MaxViT", "max_vit"),
    ("CLIPViT", "clip_vit"),
    ("Conv_ViT", "conv_vit"),
    ("GPT2ViT", "gpt2_vit"),
    ("DeiT", "deit"),
    ("BEiT", "beit"),
    ("CaiT", "cait"),
    ("LeViT", "levit"),
    ("GPT2", "gpt2"),
    ("GPT2Small", "gpt2_small"),
    ("GPTNeoX", "gpt_neox"),
    ("NanoGPT", "nano_gpt"),
    ("BERT", "bert"),
    ("BertBase", "bert_base"),
    ("DistilBERT", "distil_bert"),
    ("RoBERTa", "roberta"),
    ("XLMRoBERTa", "xlm_roberta"),
    ("DeBERTaV2", "deberta_v2"),
    ("XLNet", "xl_net"),
    ("T5", "t5"),
    ("LSTM", "lstm"),
    ("LstmLM", "lstm_lm"),
    ("MLP", "mlp"),
    ("PipelinedMLP", "pipelined_mlp"),
    ("MLPBlock", "mlp_block"),
    ("CNN", "cnn"),
    ("SmallCNN", "small_cnn"),
    ("ConvNeXt", "conv_next"),
    ("ResNeXt50", "res_next50"),
    ("MobileNetV2", "mobile_net_v2"),
    ("GoogLeNet", "google_net"),
    ("TinyLlama", "tiny_llama"),
    ("TinyLLaMA", "tiny_llama"),
    ("LLaMA2", "llama2"),
    ("UNet", "u_net"),
    ("ResNet18", "res_net18"),
    ("YOLOv5", "yolov5"),
    ("LayoutLMv3", "layout_lmv3"),
    ("ModelA", "model_a"),
    ("my_model", "my_model"),
])
def test_a_class_name_gives_the_file_name_its_user_would_write(name, stem):
    assert module_name(name) == stem


def _example_names():
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            yield path.relative_to(ROOT), spec["name"]


def test_the_committed_examples_keep_their_file_names():
    names = list(_example_names())
    assert len(names) >= 10
    generated = ROOT / "generated"
    missing = [(str(path), name, f"{module_name(name)}.py") for path, name in names
               if not (generated / f"{module_name(name)}.py").is_file()]
    assert not missing  # the examples' files in generated/ keep their names


def test_a_build_writes_the_files_under_that_name(tmp_path):
    spec = write_spec(tmp_path, "mpgen: 1\nname: DigitViT\ninputs:\n  x: [batch, 4]\n"
                      "layers:\n  head: {op: Linear, args: [4, 2]}\noutputs: [head]\n")
    build_to(spec, tmp_path / "out", {"*": "cpu"})
    written = {p.name for p in (tmp_path / "out").glob("*.py")}
    assert {f"{stem}.py" for stem in module_stems("DigitViT")} <= written
    assert "digit_vit.py" in written and "train_digit_vit.py" in written


def test_the_spec_language_names_every_mixed_case_word():
    row = next(line for line in (ROOT / "docs" / "spec.md").read_text().splitlines()
               if line.startswith("| `name` |"))
    assert all(f"`{word}`" in row for word in MIXED_CASE_WORDS)
