"""A two-output spec's metrics, built for real and run for real: both
scripts log each output's loss (``loss_cls_head``, ``loss_reg_head``) beside
the loss, and the evaluation's (``eval_loss_<output>``) with the spec's
metrics, a user's function among them; a run resumed after a kill keeps
log.csv and TensorBoard free of duplicate or out-of-order steps."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import build_to, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun)

SPEC = """
mpgen: 1
name: TwoHeads
inputs:
  x: [batch, 8]
layers:
  trunk: {op: Linear, args: [8, 16], in: x}
  act: {op: ReLU}
  cls_head: {op: Linear, args: [16, 4], in: act}
  reg_head: {op: Linear, args: [16, 1], in: act}
outputs: [cls_head, reg_head]
placement:
  trunk: cuda:0
  cls_head: cuda:1
train:
  loss: {cls_head: CrossEntropyLoss, reg_head: MSELoss}
  optimizer: {op: SGD, lr: 0.1}
  batch_size: 8
  steps: 4
  samples: 64
  eval_split: 0.25
  eval_every: 2
  metrics: [accuracy, top2_accuracy, f1, {op: 'twometrics:agreement', output: cls_head}]
"""

METRIC = """
def agreement(output, target):
    return (output.argmax(1) == target).float().mean()
"""

EVAL = ["eval_loss", "eval_loss_cls_head", "eval_loss_reg_head", "eval_accuracy",
        "eval_top2_accuracy", "eval_f1", "eval_agreement"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("two_heads")
    (folder / "twometrics.py").write_text(METRIC)
    out = folder / "out"
    build_to(write_spec(folder, SPEC), out, {"*": "cpu"})
    shutil.copy(folder / "twometrics.py", out)  # where the scripts import it from
    return out


def run(out: Path, *args: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    script = ["pp_two_heads.py"] if torchrun else ["train_two_heads.py"]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(torchrun)] if torchrun else [sys.executable])
    env = dict(os.environ, MPGEN_LOGGER="")
    done = subprocess.run([*launch, *script, *args], cwd=out, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def rows(folder: Path) -> list[dict]:
    with (folder / "log.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def check_columns(folder: Path) -> None:
    found = rows(folder)
    assert list(found[0])[:6] == ["step", "epoch", "loss", "loss_cls_head", "loss_reg_head", "lr"]
    assert [name for name in found[0] if name.startswith("eval_")] == EVAL
    steps = [row for row in found if row["loss"]]
    assert [row["step"] for row in steps] == ["1", "2", "3", "4"]
    for row in steps:  # the loss is the sum of the outputs' losses
        parts = float(row["loss_cls_head"]) + float(row["loss_reg_head"])
        assert parts == pytest.approx(float(row["loss"]), rel=1e-5)
    evaluated = [row for row in found if row["eval_loss"]]
    assert [row["step"] for row in evaluated] == ["2", "4"]
    for row in evaluated:
        values = {name: float(row[name]) for name in EVAL}
        assert values["eval_loss"] == pytest.approx(
            values["eval_loss_cls_head"] + values["eval_loss_reg_head"], rel=1e-5)
        assert values["eval_accuracy"] <= values["eval_top2_accuracy"] <= 1
        assert 0 <= values["eval_f1"] <= 1
        assert values["eval_agreement"] == pytest.approx(values["eval_accuracy"])


def test_the_training_script_logs_each_outputs_loss_and_the_specs_metrics(built):
    done = run(built, "--log-dir", "single")
    check_columns(built / "single")
    assert "eval at step 4: loss " in done.stdout and " agreement " in done.stdout
    settings = json.loads((built / "single" / "hparams.json").read_text())
    assert settings["model"] == "TwoHeads" and settings["steps"] == 4
    assert settings["script"] == "train_two_heads.py"


def test_the_pipeline_program_logs_the_same_columns(built):
    run(built, "--log-dir", "pp", torchrun=2)
    check_columns(built / "pp")


def test_a_run_resumed_after_a_kill_logs_each_step_once(built):
    ck = built / "ck"
    run(built, "--checkpoint", str(ck), "--steps", "4")
    shutil.copy(ck / "last.pt", built / "step4.pt")
    run(built, "--checkpoint", str(ck), "--steps", "6", "--resume")
    # killed after logging step 6 and before saving it: its checkpoint is step 4's
    shutil.copy(built / "step4.pt", ck / "last.pt")
    run(built, "--checkpoint", str(ck), "--steps", "8", "--resume")
    steps = [int(row["step"]) for row in rows(ck) if row["loss"]]
    assert steps == list(range(1, 9))
    evaluations = [int(row["step"]) for row in rows(ck) if row["eval_loss"]]
    assert evaluations == [2, 4, 6, 8]
    events = EventAccumulator(str(ck))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss_cls_head")] == list(range(1, 9))
    assert [e.step for e in events.Scalars("eval/f1")] == [2, 4, 6, 8]
