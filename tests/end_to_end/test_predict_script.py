"""predict_<name>.py and pp_<name>.py --predict on built specs: trained two
steps in one process and as a pipeline under torchrun, then run from each
checkpoint; every output written under its name equals the model run
directly on the same inputs with the checkpoint's weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from helpers import build_to, import_generated, write_spec
from test_pipeline_program import torchrun

pytestmark = pytest.mark.slow  # runs the generated scripts (and under torchrun)

CPU = {"*": "cpu"}

NET = """
mpgen: 1
name: TinyNet
inputs:
  x: [batch, 6]
layers:
  fc1: {op: Linear, args: [6, 16]}
  act: {op: ReLU}
  fc2: {op: Linear, args: [16, 3]}
  score: {op: torch.sum, in: fc1, dim: 1}
outputs: [fc2, score]
placement:
  fc1: cuda:0
  fc2: cuda:1
train:
  loss: {fc2: CrossEntropyLoss}
  optimizer: {op: SGD, lr: 0.5}
  batch_size: 4
"""


def script(folder: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, name, *args], cwd=folder, capture_output=True,
                          text=True, timeout=300)


def ok(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    """TinyNet built for the CPU (its two devices two pipeline stages), and 10 samples."""
    out = tmp_path_factory.mktemp("net")
    build_to(write_spec(out, NET), out, CPU)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 6, generator=g)
    torch.save({"x": x, "target": torch.randint(0, 3, (10,), generator=g)}, out / "data.pt")
    return out


def expected(folder: Path, state: dict) -> tuple[torch.Tensor, ...]:
    """The model with ``state`` on the data's inputs, all in one batch."""
    module = import_generated(folder / "tiny_net.py")
    model = module.TinyNet()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(torch.load(folder / "data.pt")["x"])


def written(path: Path) -> dict:
    return safetensors.torch.load_file(path)


def same(found: dict, outputs: tuple) -> None:
    assert list(found) == ["fc2", "score"]
    for name, value in zip(found, outputs):
        assert torch.allclose(found[name], value, atol=1e-6), name


def test_predict_from_the_single_process_checkpoint(net):
    ok(script(net, "train_tiny_net.py", "--steps", "2", "--checkpoint", "run",
              "--data", "data.pt"))
    printed = ok(script(net, "predict_tiny_net.py", "--checkpoint", "run", "--data", "data.pt",
                        "--out", "single.safetensors", "--batch-size", "3"))
    state = torch.load(net / "run" / "last.pt", weights_only=True)["model"]
    same(written(net / "single.safetensors"), expected(net, state))
    assert "loss " in printed and "fc2 accuracy " in printed
    assert printed.splitlines()[-1] == ("wrote single.safetensors: fc2 [10, 3] float32, "
                                        "score [10] float32")
    # By default the whole file is one forward: the model's outputs exactly.
    ok(script(net, "predict_tiny_net.py", "--checkpoint", "run", "--data", "data.pt",
              "--out", "whole.safetensors"))
    for found, value in zip(written(net / "whole.safetensors").values(), expected(net, state)):
        assert torch.equal(found, value)


def test_predict_from_a_pipeline_checkpoint_in_one_process_and_under_torchrun(net):
    ok(torchrun(2, net / "pp_tiny_net.py", "--steps", "2", "--checkpoint", "pp",
                "--data", "data.pt", timeout=300))
    ok(script(net, "pp_tiny_net.py", "--merge", "pp", "merged.pt"))
    outputs = expected(net, torch.load(net / "merged.pt", weights_only=True))
    ok(script(net, "predict_tiny_net.py", "--checkpoint", "pp", "--data", "data.pt",
              "--out", "from_pp.safetensors"))
    same(written(net / "from_pp.safetensors"), outputs)
    # Forward only under torchrun: 10 samples in batches of 4, each padded to 6 for 3
    # micro-batches (the last batch, of 2, too).
    ran = torchrun(2, net / "pp_tiny_net.py", "--predict", "--checkpoint", "pp",
                   "--data", "data.pt", "--out", "pp.safetensors", "--batch-size", "4",
                   "--microbatches", "3", timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    same(written(net / "pp.safetensors"), outputs)
    assert "fc2 accuracy " in ran.stdout
    # All 10 samples in one forward by default, in the stage's default micro-batches.
    ran = torchrun(2, net / "pp_tiny_net.py", "--predict", "--init", "merged.pt",
                   "--data", "data.pt", "--out", "whole.safetensors", timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    same(written(net / "whole.safetensors"), outputs)


WORD_LM = """
mpgen: 1
name: WordLM
inputs:
  tokens: {shape: [seq, batch], dtype: int64}
  h0: [2, batch, 8]
  c0: [2, batch, 8]
layers:
  encoder: {op: Embedding, args: [20, 8], in: tokens}
  rnn: {op: LSTM, args: [8, 8, 2], in: [encoder, [h0, c0]], outputs: [seq_out, [hn, cn]]}
  decoder: {op: Linear, args: [8, 20], in: seq_out}
  flat: {op: torch.reshape, shape: [-1, 20]}
  logp: {op: torch.log_softmax, dim: 1}
outputs: [logp, hn, cn]
placement:
  encoder: cuda:0
  decoder: cuda:1
train:
  loss: {logp: NLLLoss}
  batch_size: 4
  dims: {seq: 5}
"""


def test_sequence_first_outputs_and_a_product_are_joined_as_one_forward(tmp_path):
    """[seq*batch, vocab] with the batch its inner factor, [layers, batch, hidden]:
    batches of 3 in 2 micro-batches each, joined as the model's one forward gives them."""
    build_to(write_spec(tmp_path, WORD_LM), tmp_path, CPU)
    module = import_generated(tmp_path / "word_lm.py")
    torch.manual_seed(0)
    model = module.WordLM().eval()
    safetensors.torch.save_file(model.state_dict(), tmp_path / "w.safetensors")
    g = torch.Generator().manual_seed(1)
    tokens, h0, c0 = (torch.randint(0, 20, (7, 5), generator=g), torch.randn(7, 2, 8),
                      torch.randn(7, 2, 8))  # samples along dim 0, as a data file holds them
    torch.save({"tokens": tokens, "h0": h0, "c0": c0}, tmp_path / "x.pt")
    ok(script(tmp_path, "predict_word_lm.py", "--init", "w.safetensors", "--data", "x.pt",
              "--out", "out.pt", "--batch-size", "3", "--microbatches", "2"))
    found = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        whole = model(tokens.t(), h0.transpose(0, 1), c0.transpose(0, 1))
    assert list(found) == ["logp", "hn", "cn"]
    for name, value in zip(found, whole):
        assert torch.allclose(found[name], value, atol=1e-6), name


PIPELINED = """
mpgen: 1
name: PipedNet
inputs:
  x: [batch, 6]
layers:
  fc1: {op: Linear, args: [6, 16]}
  norm: {op: LayerNorm, args: [16]}
  fc2: {op: Linear, args: [16, 3]}
placement:
  fc1: cuda:0
  fc2: cuda:1
pipeline:
  microbatches: 2
  schedule: gpipe
"""


def test_a_pipelined_model_runs_its_own_micro_batches(tmp_path):
    build_to(write_spec(tmp_path, PIPELINED), tmp_path, CPU)
    module = import_generated(tmp_path / "piped_net.py")
    torch.manual_seed(0)
    model = module.PipedNet().eval()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    x = torch.randn(9, 6)
    safetensors.torch.save_file({"x": x}, tmp_path / "x.safetensors")
    ok(script(tmp_path, "predict_piped_net.py", "--init", "w.pt", "--data", "x.safetensors",
              "--out", "out.npz", "--microbatches", "3", "--batch-size", "9"))
    import numpy

    with numpy.load(tmp_path / "out.npz") as arrays:
        found = torch.from_numpy(arrays["fc2"])
    with torch.no_grad():
        assert torch.allclose(found, model(x), atol=1e-6)


def test_a_file_that_does_not_fit_is_refused_in_one_line(net):
    torch.save({"x": torch.randn(3, 7)}, net / "bad.pt")
    ran = script(net, "predict_tiny_net.py", "--init", "merged.pt", "--data", "bad.pt")
    assert ran.returncode == 1
    assert ran.stderr == ("bad.pt: x is [3, 7], 3 samples of [7]; the spec's input x is "
                          "[batch, 6], a sample [6]\n")
