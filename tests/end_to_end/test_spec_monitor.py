"""A spec's ``train: {monitor, monitor_mode, keep_last, early_stop}``: the
build checks them, and the generated script keeps the best by them with no
flag given (the flags, and --set, override them)."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import build_to, mpgen, write_spec
from test_best_checkpoint import SPEC, write_data
from test_best_checkpoint import run as run_script

pytestmark = pytest.mark.slow  # runs a generated script (subprocesses)

#: test_best_checkpoint's two-layer net, and the spec's own: the highest eval
#: loss is "best" (max), so the kept step is the one a default monitor would
#: never choose, and two saves are kept.
WATCHED = SPEC.replace("BestNet", "Watched") + (
    "  monitor: eval_loss\n  monitor_mode: max\n  keep_last: 2\n")
#: lr 0.9 on MSE: the evaluation loss falls, then swings (test_best_checkpoint's).
EVALUATED = ("--data", "data.pt", "--eval-data", "eval.pt", "--eval-every", "1", "--lr", "0.9",
             "--steps", "10")


def run(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    return run_script(folder, "train_watched.py", *argv)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("watched")
    build_to(write_spec(out, WATCHED), out, {"*": "cpu"})
    write_data(out)
    return out


def test_the_spec_s_monitor_and_mode_choose_the_best_without_a_flag(built):
    done = run(built, *EVALUATED, "--checkpoint", "run", "--save-every", "3")
    with (built / "run" / "log.csv").open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["eval_loss"]]
    highest = max(rows, key=lambda row: float(row["eval_loss"]))
    best = torch.load(built / "run" / "best.pt", weights_only=True)
    assert best["step"] == int(highest["step"])
    assert best["monitor"]["best"] == pytest.approx(float(highest["eval_loss"]))
    assert f"best eval loss {float(highest['eval_loss']):.6g} at step {best['step']}" in done.stdout
    # keep_last: 2 -- the two newest saves (step 9's file beside last.pt at 10) and the best
    kept = sorted(int(p.stem[5:]) for p in (built / "run").glob("step_*.pt"))
    assert kept[-1] == 10 and len(set(kept) - {best["step"]}) <= 2
    # a flag overrides the spec's: the lowest is best again
    run(built, *EVALUATED, "--checkpoint", "low", "--monitor-mode", "min")
    lowest = min(rows, key=lambda row: float(row["eval_loss"]))
    assert torch.load(built / "low" / "best.pt", weights_only=True)["step"] == int(lowest["step"])


def test_a_run_without_evaluation_says_the_spec_s_monitor_is_not_watched(built):
    done = run(built, "--steps", "2", "--checkpoint", "plain")
    assert ("monitor: the spec's eval_loss is not watched: this run has no evaluation data "
            "(give --eval-data or --eval-split)") in done.stdout.splitlines()
    assert not (built / "plain" / "best.pt").exists()
    helped = " ".join(run(built, "--help").stdout.split())
    assert "(default: eval_loss where the run has" in helped
    assert "better (default: max)" in helped and "besides) (default: 2)" in helped


@pytest.mark.parametrize("extra, said", [
    ("  monitor: eval_los\n", "spec.yaml:21:12: train.monitor: 'eval_los' is not a column of "
     "the evaluation (did you mean 'eval_loss'?); it has eval_loss"),
    ("  metrics: ['scores:agreement']\n  monitor: eval_agreement\n",
     "train.monitor: the name 'eval_agreement' does not say whether lower or higher is "
     "better; add monitor_mode: min or monitor_mode: max"),
    ("  keep_last: 0\n", "train.keep_last: must be greater than or equal to 1, got 0"),
    ("  early_stop: -1\n", "train.early_stop: must be greater than or equal to 0, got -1"),
])
def test_the_build_checks_the_monitor_keys(tmp_path, extra, said):
    (tmp_path / "scores.py").write_text("def agreement(output, target):\n    return 1.0\n")
    spec = write_spec(tmp_path, SPEC.replace("BestNet", "Watched") + extra)
    ran = mpgen("show", str(spec))
    assert ran.returncode == 2 and said in ran.stderr and ran.stderr.count("\n") == 1, ran.stderr
