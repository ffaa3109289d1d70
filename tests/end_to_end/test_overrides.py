"""``--set KEY=VALUE`` in both generated scripts, built for the CPU:
train_<name>.py in a subprocess and pp_<name>.py under torchrun (gloo).
What is checked from outside: an override trains without a rebuild, and is
in the output, the log folder and the checkpoint; a misspelled key is one
usage line with the did-you-mean, exit 2, and nothing written; --resume
says a changed override and trains with this run's value."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import build_to, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun)

SPEC = """
mpgen: 1
name: SetNet

inputs:
  x: [batch, 8]

layers:
  l1: {op: Linear, args: [8, 16], in: x}
  a1: {op: Tanh}
  l2: {op: Linear, args: [16, 4]}

placement:
  l1: cuda:0
  l2: cuda:1

train:
  loss: {op: CrossEntropyLoss}
  optimizer: {op: AdamW, lr: 0.01, weight_decay: 0.01}
  scheduler: {op: cosine, warmup: 1}
  batch_size: 8
  steps: 2
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("overrides")
    build_to(write_spec(out, SPEC), out, {"*": "cpu"})
    return out


def run(folder: Path, *argv: str, torchrun: int = 0, status: int = 0):
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(torchrun)] if torchrun else [sys.executable])
    done = subprocess.run([*head, *argv], cwd=folder, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == status, done.stderr[-3000:]
    return done


def test_an_override_trains_and_is_in_the_log_and_the_checkpoint(built):
    done = run(built, "train_set_net.py", "--set", "optimizer.weight_decay=0.05",
               "--set", "loss.label_smoothing=0.1", "--checkpoint", "single")
    assert "overrides: optimizer.weight_decay=0.05 loss.label_smoothing=0.1" in done.stdout
    saved = torch.load(built / "single" / "last.pt", weights_only=True)
    assert saved["overrides"] == ["optimizer.weight_decay=0.05", "loss.label_smoothing=0.1"]
    assert saved["settings"]["optimizer"]["weight_decay"] == 0.05
    assert saved["settings"]["loss"]["label_smoothing"] == 0.1
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == 0.05  # what trained
    hparams = json.loads((built / "single" / "hparams.json").read_text())
    assert hparams["overrides"] == saved["overrides"]
    assert hparams["settings"]["optimizer"]["weight_decay"] == 0.05


def test_a_misspelled_key_is_one_line_with_the_did_you_mean_and_nothing_written(built):
    done = run(built, "train_set_net.py", "--set", "optimizer.wieght_decay=0.05",
               "--checkpoint", "typo", status=2)
    assert done.stderr == (
        "train_set_net.py: error: --set optimizer.wieght_decay=0.05: train.optimizer: unknown "
        "keyword argument 'wieght_decay' for AdamW (did you mean 'weight_decay'?)\n")
    assert not (built / "typo").exists() and done.stdout == ""


def test_a_change_that_needs_code_names_a_rebuild_outside_the_output_folder(built):
    done = run(built, "train_set_net.py", "--set", "optimizer=SGD", status=2)
    assert done.stderr.count("\n") == 1
    assert "mpgen train spec.yaml -- ARGS" in done.stderr
    assert "mpgen build spec.yaml -o build/set_net" in done.stderr


def test_resume_says_a_changed_override_and_trains_with_this_runs(built):
    run(built, "train_set_net.py", "--set", "optimizer.weight_decay=0.05", "--checkpoint",
        "again")
    done = run(built, "train_set_net.py", "--set", "optimizer.weight_decay=0.2", "--checkpoint",
               "again", "--resume", "--steps", "3")
    assert ("--resume: optimizer.weight_decay is 0.2 in this run, 0.05 in the checkpoint's"
            in done.stdout)
    saved = torch.load(built / "again" / "last.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == 0.2


def test_the_pipeline_program_takes_an_override_and_records_it(built):
    done = run(built, "pp_set_net.py", "--set", "optimizer.weight_decay=0.05",
               "--checkpoint", "pp", torchrun=2)
    assert "overrides: optimizer.weight_decay=0.05" in done.stdout
    resumed = run(built, "pp_set_net.py", "--set", "optimizer.weight_decay=0.2",
                  "--checkpoint", "pp", "--resume", "--steps", "3", torchrun=2)
    assert ("--resume: optimizer.weight_decay is 0.2 in this run, 0.05 in the checkpoint's"
            in resumed.stdout)
    typo = run(built, "pp_set_net.py", "--set", "optimizer.wieght_decay=0.05", status=2)
    assert typo.stderr.startswith("pp_set_net.py: error: --set optimizer.wieght_decay=0.05: ")
    assert typo.stderr.endswith("(did you mean 'weight_decay'?)\n")
