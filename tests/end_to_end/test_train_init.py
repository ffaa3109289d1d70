"""train_<name>.py --init FILE (and pp_<name>.py's) on built specs: a
reference state dict saved as safetensors, with the key of a tied parameter
left out as Hugging Face's save_pretrained leaves it out; and the examples of
docs/training.md, "Start from pretrained weights": a small GPT2LMHeadModel
and a small LlamaForCausalLM (examples/tiny_llama.yaml, split inside its
body) saved with save_pretrained, fine-tuned from their model.safetensors
in one process and as a pipeline.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from helpers import ROOT, build_to, import_generated, write_spec
from test_pipeline_program import losses, torchrun

pytestmark = pytest.mark.slow  # runs the generated scripts (and one under torchrun)

CPU = {"*": "cpu"}

LM = """
mpgen: 1
name: TiedLM
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  wte: {op: Embedding, args: [20, 8], in: idx}
  ln: {op: LayerNorm, args: [8]}
  lm_head: {op: Linear, args: [8, 20], bias: false, tie: {weight: wte.weight}}
train:
  loss: {op: CrossEntropyLoss, class_dim: -1}
  batch_size: 2
  dims: {seq: 5}
"""


class TiedLM(nn.Module):
    """The reference: the spec's layers, the head's weight the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.ln = nn.Embedding(20, 8), nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.lm_head.weight = self.wte.weight


def script(folder: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, name, *args], cwd=folder, capture_output=True,
                          text=True, timeout=180)


def test_the_script_starts_from_a_safetensors_file_without_the_tied_key(tmp_path):
    build_to(write_spec(tmp_path, LM), tmp_path, CPU)
    torch.manual_seed(3)
    reference = TiedLM().state_dict()
    saved = {k: v for k, v in reference.items() if k != "lm_head.weight"}  # as save_pretrained
    safetensors.torch.save_file(saved, tmp_path / "ref.safetensors")
    run = script(tmp_path, "train_tied_lm.py", "--init", "ref.safetensors", "--steps", "1",
                 "--lr", "0", "--checkpoint", "run")
    assert run.returncode == 0, run.stderr
    assert "started from ref.safetensors" in run.stdout and "step 1/1  loss" in run.stdout
    after = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    assert after.keys() == reference.keys()
    assert all(torch.equal(after[key], value) for key, value in reference.items())
    # Another model's file: one line naming the keys, no traceback.
    safetensors.torch.save_file({"wte.weight": saved["wte.weight"], "head.bias": torch.zeros(20)},
                                tmp_path / "other.safetensors")
    run = script(tmp_path, "train_tied_lm.py", "--init", "other.safetensors", "--steps", "1")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr == ("--init other.safetensors: not a state dict of TiedLM: 2 missing "
                          "(ln.weight, ln.bias); 1 unexpected (head.bias)\n")


# -- docs/training.md's Hugging Face example -------------------------------------------


def docs_blocks(kind: str) -> list[str]:
    """The ``kind`` code blocks of docs/training.md's "Start from pretrained weights"."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("\n## Start from pretrained weights\n")[1].split("\n## ")[0]
    return [block.split("```")[0] for block in section.split(f"```{kind}\n")[1:]]


def saved(tmp_path_factory, name: str, k: int) -> Path:
    """A folder holding what the docs' k-th Python block saves to ``name``/."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    exec(docs_blocks("python")[k].replace(f'"{name}"', repr(str(out / name))), {})
    return out


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """The docs' spec built for the CPU, beside gpt2-tiny/ as the docs' Python saves it."""
    out = saved(tmp_path_factory, "gpt2-tiny", 0)
    build_to(write_spec(out, docs_blocks("yaml")[0], "gpt2_tiny.yaml"), out, CPU)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """examples/tiny_llama.yaml built for the CPU, beside llama-tiny/."""
    out = saved(tmp_path_factory, "llama-tiny", 1)
    build_to(ROOT / "examples" / "tiny_llama.yaml", out, CPU)
    return out


def starts_from(folder: Path, script_name: str, init: str, expected: dict) -> dict:
    """The weights a run of ``script_name --init init`` starts from (one step at lr 0),
    checked equal to ``expected``, key for key."""
    run = script(folder, script_name, "--init", init, "--steps", "1", "--lr", "0",
                 "--checkpoint", "start")
    assert run.returncode == 0, run.stderr
    after = torch.load(folder / "start" / "last.pt", weights_only=True)["model"]
    assert after.keys() == expected.keys()
    assert all(torch.equal(after[key], value) for key, value in expected.items())
    return after


def alike(folder: Path, name: str, init: str) -> None:
    """Two steps from ``init`` give the same losses in train_NAME.py and pp_NAME.py."""
    single = script(folder, f"train_{name}.py", "--init", init, "--steps", "2",
                    "--log-dir", "single")
    assert single.returncode == 0, single.stderr
    pipeline = torchrun(2, folder / f"pp_{name}.py", "--init", init, "--steps", "2",
                        "--microbatches", "2", "--log-dir", "pipeline")
    assert pipeline.returncode == 0, pipeline.stderr[-3000:]
    expected = losses(folder / "single" / "log.csv")
    assert losses(folder / "pipeline" / "log.csv") == pytest.approx(expected, rel=1e-5)


def test_the_docs_gpt2_starts_from_hugging_faces_weights_and_logits(gpt2):
    import transformers

    reference = transformers.GPT2LMHeadModel.from_pretrained(gpt2 / "gpt2-tiny").eval()
    file = safetensors.torch.load_file(gpt2 / "gpt2-tiny" / "model.safetensors")
    assert "lm_head.weight" not in file  # tied to transformer.wte.weight
    after = starts_from(gpt2, "train_tiny_gpt2.py", "gpt2-tiny/model.safetensors",
                        reference.state_dict())
    model = import_generated(gpt2 / "tiny_gpt2.py").TinyGPT2().eval()
    model.load_state_dict(after, strict=True)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx).logits, atol=1e-5, rtol=1e-5)


def test_the_docs_gpt2_fine_tunes_alike_in_one_process_and_as_a_pipeline(gpt2):
    alike(gpt2, "tiny_gpt2", "gpt2-tiny/model.safetensors")


def test_the_docs_llama_split_inside_its_body_starts_from_hugging_faces_weights(llama):
    import transformers

    reference = transformers.LlamaForCausalLM.from_pretrained(llama / "llama-tiny")
    starts_from(llama, "train_tiny_llama.py", "llama-tiny/model.safetensors",
                reference.state_dict())
    alike(llama, "tiny_llama", "llama-tiny/model.safetensors")
