"""The best step of a run with evaluation, in both generated scripts: built
for the CPU, train_<name>.py in a subprocess and pp_<name>.py under
torchrun (gloo). What is checked from outside: the step the run keeps as
its best (DIR/best.pt, the pipeline's DIR/best) is the one with the lowest
eval_loss in log.csv, with that step's weights."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import build_to, import_generated, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun)

SPEC = """
mpgen: 1
name: BestNet

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
  loss: MSELoss
  optimizer: {op: SGD, lr: 0.1}
  batch_size: 8
  steps: 3
"""

#: lr 0.9 on MSE: the evaluation loss falls, then swings, so the best is not the last step.
#: Both scripts start from init.pt (the pipeline seeds each stage its own way).
ARGS = ("--data", "data.pt", "--eval-data", "eval.pt", "--eval-every", "1", "--lr", "0.9",
        "--init", "init.pt", "--steps", "10", "--seed", "0")


def write_data(out: Path) -> None:
    """``data.pt`` (64 samples) and ``eval.pt`` (16) in ``out``: targets near x[:, :4]."""
    generator = torch.Generator().manual_seed(2)
    for name, size in (("data.pt", 64), ("eval.pt", 16)):
        x = torch.randn(size, 8, generator=generator)
        torch.save({"x": x, "target": torch.randn(size, 4, generator=generator) + x[:, :4]},
                   out / name)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("best")
    build_to(write_spec(out, SPEC), out, {"*": "cpu"})
    write_data(out)
    torch.manual_seed(0)
    torch.save(import_generated(out / "best_net.py").BestNet().state_dict(), out / "init.pt")
    return out


def run(folder: Path, *argv: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(torchrun)] if torchrun else [sys.executable])
    done = subprocess.run([*head, *argv], cwd=folder, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def lowest(log: Path) -> tuple[int, float]:
    with log.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["eval_loss"]]
    best = min(rows, key=lambda row: float(row["eval_loss"]))
    return int(best["step"]), float(best["eval_loss"])


def test_best_pt_is_the_step_of_the_lowest_eval_loss(built):
    done = run(built, "train_best_net.py", *ARGS, "--checkpoint", "single")
    step, loss = lowest(built / "single" / "log.csv")
    best = torch.load(built / "single" / "best.pt", weights_only=True)
    assert best["step"] == step and best["monitor"]["best"] == pytest.approx(loss)
    assert f"best eval loss {loss:.6g} at step {step}: single/best.pt" in done.stdout
    assert step < 10  # the test shows something only when the best is not the end
    # that step's weights: a run stopped there ends with them
    run(built, "train_best_net.py", *ARGS[:-4], "--steps", str(step), "--seed", "0",
        "--checkpoint", "short")
    short = torch.load(built / "short" / "last.pt", weights_only=True)["model"]
    for key, value in short.items():
        assert torch.equal(best["model"][key], value), key


def test_the_pipelines_best_is_the_step_of_the_lowest_eval_loss(built):
    done = run(built, "pp_best_net.py", *ARGS, "--checkpoint", "pp", "--keep-last", "1",
               torchrun=2)
    step, loss = lowest(built / "pp" / "log.csv")
    assert (built / "pp" / "best").resolve().name == f"step_{step}"
    assert sorted(p.name for p in (built / "pp").glob("step_*")) == sorted(
        {f"step_{step}", "step_10"})  # the newest and the best: nothing else kept
    assert f"best eval loss {loss:.6g} at step {step}: pp/best -> step_{step}" in done.stdout
    merged = run(built, "pp_best_net.py", "--merge", "pp/best", "best.pt")
    assert f"(step {step}) into best.pt" in merged.stdout
    # the single-process script from the same weights: the same best, step and weights
    single = run(built, "train_best_net.py", *ARGS, "--checkpoint", "single_pp")
    expected = torch.load(built / "single_pp" / "best.pt", weights_only=True)
    assert expected["step"] == step, single.stdout
    weights = torch.load(built / "best.pt", weights_only=True)
    for key, value in expected["model"].items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
    run(built, "predict_best_net.py", "--checkpoint", "pp/best", "--data", "eval.pt",
        "--out", "out.pt")
    assert (built / "out.pt").is_file()


def test_a_resumed_pipeline_keeps_its_best_and_prunes_on(built):
    first = [*ARGS[:-4], "--seed", "0", "--checkpoint", "resumed", "--save-every", "2",
             "--keep-last", "2"]
    run(built, "pp_best_net.py", *first, "--steps", "5", torchrun=2)
    run(built, "pp_best_net.py", *first, "--steps", "10", "--resume", torchrun=2)
    step, _ = lowest(built / "resumed" / "log.csv")  # the earlier run's rows, then the resumed
    assert (built / "resumed" / "best").resolve().name == f"step_{step}"
    kept = sorted(int(p.name[5:]) for p in (built / "resumed").glob("step_*"))
    assert kept[-1] == 10 and step in kept and len(kept) <= 3  # the newest 2 and the best
    if (built / "pp" / "best").exists():  # the straight run's best (the test above)
        assert (built / "pp" / "best").resolve().name == f"step_{step}"


def test_the_pipeline_stops_early_on_every_rank(built):
    done = run(built, "pp_best_net.py", *ARGS, "--lr", "0", "--early-stop", "2",
               "--checkpoint", "still", torchrun=2)
    assert "early stop after step 3: eval loss has not improved for 2 evaluations" in done.stdout
    assert (built / "still" / "best").resolve().name == "step_1"
    assert sorted(p.name for p in (built / "still").glob("step_*")) == ["step_1", "step_3"]
