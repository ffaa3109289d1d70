"""Issue 22's repro: pytorch/examples' LSTM language model returns (logits,
hn, cn) and trains on the logits alone (``examples/lstm_lm.yaml``: ``loss:
{decoder: CrossEntropyLoss}``; hn and cn are returned, with no target).

Built for the CPU; the generated loss is compared with the reference's
cross entropy on the same weights, then the training script, its --data
form, the generated tests and the pipeline program run for real.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import EXAMPLES, build_to, import_generated, write_spec
from run_generated import run_suite_on_virtual_devices, train_one_step
from test_pipeline_program import torchrun
from test_references import RNNModel

pytestmark = pytest.mark.slow  # runs the generated scripts, one under torchrun


@pytest.fixture(scope="module")
def lstm(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lstm")
    build_to(EXAMPLES / "lstm_lm.yaml", out, {"*": "cpu"})
    return out


def test_only_the_logits_get_a_target(lstm):
    training = import_generated(lstm / "train_lstm_lm.py").TRAINING
    assert training.inputs == ("tokens", "h0", "c0") and training.targets == ("target",)
    inputs, targets = training.make_batch(3, seq=5)
    assert [tuple(t.shape) for t in targets] == [(5, 3)]  # [seq, batch]: the logits' classes


def test_the_loss_is_the_references_cross_entropy_of_the_logits(lstm):
    torch.manual_seed(0)
    reference = RNNModel(50, 16, 32, 2, 0.2).eval()
    training = import_generated(lstm / "train_lstm_lm.py").TRAINING
    model = training.model().eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    (tokens, h0, c0), targets = training.make_batch(3, seq=5)
    loss, _ = training.forward_loss(model, training.losses(training.settings), (tokens, h0, c0), targets)
    logits, hn, cn = reference(tokens, (h0, c0))
    expected = F.cross_entropy(logits.flatten(0, -2), targets[0].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    expected.backward()  # no term of hn or cn
    got = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, param.grad, rtol=1e-5, atol=1e-6)


def test_a_training_step_runs(lstm):
    assert "step 1/1  loss" in train_one_step(lstm / "train_lstm_lm.py")


def test_a_data_file_holds_the_logits_target_only(lstm):
    generator = torch.Generator().manual_seed(0)
    samples, seq = 8, 6
    torch.save({"tokens": torch.randint(0, 50, (samples, seq), generator=generator),
                "h0": torch.randn(samples, 2, 32, generator=generator),
                "c0": torch.randn(samples, 2, 32, generator=generator),
                "target": torch.randint(0, 50, (samples, seq), generator=generator)},
               lstm / "data.pt")
    ran = subprocess.run([sys.executable, "train_lstm_lm.py", "--data", "data.pt", "--steps", "2",
                          "--batch-size", "4", "--log-dir", "with_data"],
                         cwd=lstm, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "step 2/2  loss" in ran.stdout


def test_the_generated_tests_pass(lstm):
    assert len(run_suite_on_virtual_devices(lstm / "test_lstm_lm.py")) >= 5


def test_the_pipeline_program_trains_on_the_logits(lstm):
    """Three stages; the last returns hn and cn with the logits, its loss reads
    the logits only, so no gradient goes back for hn, cn."""
    run = torchrun(3, lstm / "pp_lstm_lm.py", "--steps", "2", "--batch-size", "4",
                   "--microbatches", "4", "--log-dir", "pp")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2/2  loss" in run.stdout


AUX = """
mpgen: 1
name: AuxNet
inputs:
  x: [batch, 8]
layers:
  l1: {op: Linear, args: [8, 16], in: x}
  aux: {op: Linear, args: [8, 3], in: x}
  l2: {op: Linear, args: [16, 4], in: l1}
outputs: [l2, aux]
placement:
  l1: cuda:0
  aux: cuda:0
  l2: cuda:1
train:
  loss: {l2: MSELoss}
  batch_size: 4
"""


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_head_only_an_output_without_a_loss_reads_is_left_as_it_is(tmp_path, pipeline):
    """aux's layer is built, returned, passed from stage 0 to stage 1 with no
    gradient coming back, and never updated; l1 and l2 train."""
    build_to(write_spec(tmp_path, AUX), tmp_path, {"*": "cpu"})
    torch.manual_seed(0)
    before = import_generated(tmp_path / "aux_net.py").AuxNet().state_dict()
    torch.save(before, tmp_path / "init.pt")
    if pipeline:
        run = torchrun(2, tmp_path / "pp_aux_net.py", "--steps", "2", "--init", "init.pt",
                       "--checkpoint", "pp")
        merged = subprocess.run([sys.executable, "pp_aux_net.py", "--merge", "pp", "after.pt"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert run.returncode == merged.returncode == 0, run.stderr[-3000:] + merged.stderr
        after = torch.load(tmp_path / "after.pt", weights_only=True)
    else:
        run = subprocess.run([sys.executable, "train_aux_net.py", "--steps", "2", "--checkpoint",
                              "single"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        after = torch.load(tmp_path / "single" / "last.pt", weights_only=True)["model"]
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert changed == {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}
