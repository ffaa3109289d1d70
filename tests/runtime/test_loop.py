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
    assert out.startswith("torch threads: ")  # then the model's line
    assert out.splitlines()[1] == "Tiny: 67 parameters; 40 steps of 4 samples"
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
    results = loop.evaluate(TRAINING, model, (nn.CrossEntropyLoss(),), batches, autocast)
    assert list(results) == TRAINING.eval_metrics == ["eval_loss", "eval_accuracy"]
    assert results["eval_accuracy"] == 1.0 and results["eval_loss"] < 0.5
    wrong = [(batches[0][0], (batches[0][1] + 1) % 3), batches[1]]
    found = loop.evaluate(TRAINING, model, (nn.CrossEntropyLoss(),), wrong, autocast)
    assert found["eval_accuracy"] == 0.5


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


# Batches checked against the spec (mpgen/runtime/data.py) ----------------------

from mpgen.runtime import data  # noqa: E402

#: tokens [seq, batch], a mask [batch, seq] and targets flattened seq-first.
CHECKED = training(inputs=("tokens", "mask"), targets=("target",),
                   batch_dims=(1, 0, (0, 1)),
                   shapes=(("seq", "batch"), ("batch", "seq"), ("seq*batch",)),
                   dtypes=("int64", "float32", "int64"), classes=(None, None, (5, -100)))


def checked(*batch):
    return data.check_batch(batch, CHECKED, "data.pt")


def test_named_dims_bind_across_the_keys_and_products_follow():
    ids, mask = torch.zeros(6, 4, dtype=torch.int64), torch.ones(4, 6)
    checked(ids, mask, torch.zeros(24, dtype=torch.int64))
    with pytest.raises(SystemExit) as stop:
        checked(ids, torch.ones(4, 7), torch.zeros(24, dtype=torch.int64))
    assert stop.value.code == ("data.pt: mask is [4, 7]; the spec's input mask is [batch, seq] "
                               "(with seq = 6, batch = 4 from the other keys)")
    with pytest.raises(SystemExit) as stop:
        checked(ids, mask, torch.zeros(25, dtype=torch.int64))
    assert stop.value.code == ("data.pt: target is [25]; the spec's target is [seq*batch] "
                               "(with seq = 6, batch = 4 from the other keys)")


def test_a_dtype_of_the_same_kind_is_converted_another_refused():
    ids, mask = torch.zeros(6, 4, dtype=torch.int32), torch.ones(4, 6, dtype=torch.float64)
    tokens, mask, target = checked(ids, mask, torch.zeros(24, dtype=torch.int16))
    assert (tokens.dtype, mask.dtype, target.dtype) == (torch.int64, torch.float32, torch.int64)
    with pytest.raises(SystemExit, match=r"^data.pt: target is float32; the spec's target is "
                                         r"int64 \(integer values\)$"):
        checked(ids, mask, torch.zeros(24))


def test_class_indices_are_in_range_or_ignored():
    ids, mask = torch.zeros(6, 4, dtype=torch.int64), torch.ones(4, 6)
    target = torch.full((24,), -100)
    target[:5] = torch.arange(5)
    checked(ids, mask, target)
    target[7] = 5
    with pytest.raises(SystemExit, match="^data.pt: target holds class 5; the spec's target "
                                         "takes classes 0 to 4 or the ignore_index -100$"):
        checked(ids, mask, target)


def test_a_flattened_target_stacks_and_splits_like_its_output():
    # Sample b's targets [seq] sit at s*batch + b, as [seq, batch, C].view(-1, C) orders them.
    samples = [torch.arange(3) * 10 + b for b in range(4)]
    stacked = data.stack(samples, (0, 1))
    assert stacked.tolist() == torch.stack(samples, 1).reshape(-1).tolist()
    assert data.narrow(stacked, (0, 1), 4, 2, 2).tolist() == (
        torch.stack(samples[2:], 1).reshape(-1).tolist())
    first = data.stack(samples, (0, 0))  # batch outermost: flatten(0, 1) of [batch, seq]
    assert first.tolist() == torch.cat(samples).tolist()
    assert data.narrow(first, (0, 0), 4, 1, 2).tolist() == torch.cat(samples[1:3]).tolist()


#: token ids an Embedding of 50 rows reads, their positions a table of 8 rows.
POSITIONS = training(inputs=("idx",), targets=(), batch_dims=(0,), shapes=(("batch", "seq"),),
                     dtypes=("int64",), classes=((50, None),),
                     dim_limits=(("seq", 8, "layer 'wpe' (Embedding(8, 4)) has 8 rows"),))


def test_token_ids_and_positions_past_their_tables_are_refused():
    data.check_batch((torch.full((2, 8), 49),), POSITIONS, "data.pt")
    with pytest.raises(SystemExit) as stop:
        data.check_batch((torch.zeros(2, 9, dtype=torch.int64),), POSITIONS, "data.pt")
    assert stop.value.code == ("data.pt: seq is 9; the model takes seq up to 8: layer 'wpe' "
                               "(Embedding(8, 4)) has 8 rows")
    with pytest.raises(SystemExit) as stop:
        data.check_batch((torch.full((2, 8), 50),), POSITIONS, "data.pt")
    assert stop.value.code == ("data.pt: idx holds 50; the spec's input idx indexes an "
                               "Embedding of 50 rows, so it takes 0 to 49")
