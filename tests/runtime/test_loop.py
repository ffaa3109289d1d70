"""The training loop in process (mpgen/runtime/loop.py), on a small model:
what every generated train_<name>.py runs."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from torch import nn

from mpgen.runtime import loop
from tiny import TRAINING, Tiny, training


def train(*argv: str, spec=TRAINING) -> None:
    loop.train(spec, list(argv))


def losses(folder) -> list[float]:
    with open(folder / "log.csv", newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row["loss"]]


def test_training_lowers_the_loss_and_logs_every_step(tmp_path, capsys):
    train("--steps", "40", "--log-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("Tiny: 67 parameters; 40 steps of 4 samples\n")
    logged = losses(tmp_path)
    assert len(logged) == 40 and logged[-1] < logged[0] / 2


def test_resume_is_bit_exact(tmp_path):
    train("--steps", "6", "--checkpoint", str(tmp_path / "straight"))
    train("--steps", "3", "--checkpoint", str(tmp_path / "resumed"))
    train("--steps", "6", "--checkpoint", str(tmp_path / "resumed"), "--resume")
    straight = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)
    assert resumed["step"] == straight["step"] == 6
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] * 2


def test_a_model_without_parameters_runs_forward_and_the_loss_only(tmp_path, capsys):
    train("--steps", "2", "--log-dir", str(tmp_path), spec=training(model=NoParams, optimizer=None))
    assert "NoParams: 0 parameters, nothing to train" in capsys.readouterr().out
    assert len(losses(tmp_path)) == 2


def test_an_optimizer_with_a_closure_recomputes_the_loss(tmp_path):
    lbfgs = training(optimizer=lambda model, args: torch.optim.LBFGS(model.parameters(),
                                                                      lr=args.lr),
                     closure=True)
    train("--steps", "5", "--lr", "0.5", "--log-dir", str(tmp_path), spec=lbfgs)
    logged = losses(tmp_path)
    assert all(math.isfinite(x) for x in logged) and logged[-1] < logged[0]


def test_a_loss_that_is_not_finite_stops_the_run(tmp_path):
    def nan_loss(model, loss_fns, inputs, targets, count=False):
        return model(*inputs).sum() * float("nan"), []

    with pytest.raises(SystemExit, match=r"step 1: the loss is nan; stopping \(.*last.pt keeps step 0\)"):
        train("--steps", "3", "--checkpoint", str(tmp_path), spec=training(forward_loss=nan_loss))


def test_evaluate_gives_the_mean_loss_and_the_accuracy():
    model = Tiny()
    with torch.no_grad():  # the class is the argmax of x[:, :3]
        model.hidden.weight.copy_(torch.cat([torch.eye(4), -torch.eye(4)]))
        model.hidden.bias.zero_()
        model.head.weight.copy_(torch.cat([torch.eye(3, 4), -torch.eye(3, 4)], 1) * 10)
        model.head.bias.zero_()
    x = torch.randn(8, 4)
    batches = [(x[:4], x[:4, :3].argmax(1)), (x[4:], x[4:, :3].argmax(1))]
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    loss, accuracy = loop.evaluate(TRAINING, model, (nn.CrossEntropyLoss(),), batches, autocast)
    assert accuracy == [1.0] and loss < 0.5
    wrong = [(batches[0][0], (batches[0][1] + 1) % 3), batches[1]]
    assert loop.evaluate(TRAINING, model, (nn.CrossEntropyLoss(),), wrong, autocast)[1] == [0.5]


def test_eval_every_logs_an_evaluation_row(tmp_path, capsys):
    train("--steps", "4", "--eval-every", "2", "--log-dir", str(tmp_path))
    out = capsys.readouterr().out
    assert "eval at step 2: loss" in out and "eval at step 4: loss" in out
    with open(tmp_path / "log.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["eval_loss"]]
    assert [row["step"] for row in rows] == ["2", "4"]


def test_a_scheduler_steps_after_each_logged_step(tmp_path):
    halving = training(scheduler=lambda optimizer, args, steps: torch.optim.lr_scheduler.StepLR(
        optimizer, step_size=1, gamma=0.5))
    train("--steps", "3", "--log-dir", str(tmp_path), spec=halving)
    with open(tmp_path / "log.csv", newline="") as f:
        assert [float(row["lr"]) for row in csv.DictReader(f)] == [0.1, 0.05, 0.025]
