"""Sequence-first inputs work wherever batch-first ones do (issue 9, failure 3).

``[seq, batch]`` is the default layout of ``nn.LSTM`` and ``nn.Transformer``.
The training script's ``make_batch`` used to take the dims in the order of
the inputs, giving ``seq`` a default before ``batch_size`` without one:
black refused the script (``non-default argument follows default
argument``) and the build ended in a traceback with exit status 1.
"""

from __future__ import annotations

import ast

from helpers import build_to, mpgen, write_spec
from run_generated import run_suite_on_virtual_devices, train_one_step

LSTM = """
    mpgen: 1
    name: SeqFirstLSTM
    inputs:
      tokens: {shape: [seq, batch], dtype: int64}
    layers:
      embed: {op: Embedding, args: [100, 16]}
      lstm: {op: LSTM, args: [16, 32], output: 0}
      head: {op: Linear, args: [32, 100]}
    placement:
      embed: cuda:0
      head: cuda:1
    train:
      loss: CrossEntropyLoss
      optimizer: {op: Adam, lr: 0.001}
      batch_size: 4
      steps: 1
      dims: {seq: 5}
"""

TRANSFORMER = """
    mpgen: 1
    name: SeqFirstEncoder
    inputs:
      x: [seq, batch, 16]
      extra: [seq, batch, 16]
    layers:
      mix: {op: torch.add, in: [x, extra]}
      encoder: {op: TransformerEncoderLayer, args: [16, 2, 32], dropout: 0.0, repeat: 2}
      head: {op: Linear, args: [16, 3]}
    placement:
      mix: cuda:0
      encoder.1: cuda:1
    train:
      loss: MSELoss
      optimizer: {op: SGD, lr: 0.01}
      batch_size: 3
      steps: 1
      dims: {seq: 7}
"""


def make_batch_signature(script_text: str) -> str:
    tree = ast.parse(script_text)
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "make_batch"]
    return ast.unparse(fn.args)


def test_a_sequence_first_lstm_builds_trains_and_passes_its_tests(tmp_path):
    spec = write_spec(tmp_path, LSTM)
    built = mpgen("build", str(spec), "-o", str(tmp_path / "out"))
    assert built.returncode == 0, built.stderr
    # Only the note that generation runs without a KV cache (an LSTM: docs/inference.md).
    assert [line for line in built.stderr.splitlines() if "KV cache" not in line] == []
    script = (tmp_path / "out" / "train_seq_first_lstm.py").read_text()
    # The batch size first (the loop passes it), the other dims after it.
    assert make_batch_signature(script) == "batch_size: int, seq: int=5"
    assert "tokens = torch.randint(0, 100, (seq, batch_size))  # [seq, batch]" in script
    assert "target = torch.randint(0, 100, (seq, batch_size))  # [seq, batch]" in script
    test = (tmp_path / "out" / "test_seq_first_lstm.py").read_text()
    assert "output_shapes = [(5, 2, 100)]" in test
    assert "tokens = torch.randint(0, 100, (5, 2))  # [seq, batch]" in test
    assert len(run_suite_on_virtual_devices(tmp_path / "out" / "test_seq_first_lstm.py")) == 5
    build_to(spec, tmp_path / "cpu", {"*": "cpu"})
    assert "step 1/1  loss" in train_one_step(tmp_path / "cpu" / "train_seq_first_lstm.py")


def test_sequence_first_float_inputs_of_a_transformer(tmp_path):
    spec = write_spec(tmp_path, TRANSFORMER)
    result = build_to(spec, tmp_path / "out")
    script = result.files["train_seq_first_encoder.py"]
    assert make_batch_signature(script) == "batch_size: int, seq: int=7"
    assert "x = torch.randn((seq, batch_size, 16))  # [seq, batch, 16]" in script
    assert str(result.graph.node("head").out) == "[seq, batch, 3]"
    assert len(run_suite_on_virtual_devices(tmp_path / "out" / "test_seq_first_encoder.py")) == 6
    build_to(spec, tmp_path / "cpu", {"*": "cpu"})
    assert "step 1/1  loss" in train_one_step(tmp_path / "cpu" / "train_seq_first_encoder.py")
