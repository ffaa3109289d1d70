"""Checkpoints worth keeping (mpgen/runtime/monitor.py): the monitored
metric's best step as DIR/best.pt, --keep-last, --early-stop and resume,
in the single-process loop every train_<name>.py runs."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from mpgen.runtime import flags, loop, monitor
from mpgen.runtime.metrics import Metric
from tiny import TRAINING, training

#: Tiny with its class output's accuracy among the evaluation's metrics.
ACCURATE = training(loss_outputs=("out",), class_dims=(1,),
                    metrics=(Metric(name="accuracy", op="accuracy"),))


def train(*argv: str, spec=ACCURATE) -> None:
    loop.train(spec, list(argv))


def evaluations(folder) -> list[dict]:
    with open(folder / "log.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row["eval_loss"]]


def saved(path) -> dict:
    return torch.load(path, weights_only=True)


def test_the_mode_follows_the_metrics_name():
    assert monitor.mode_of("eval_loss") == "min"
    assert monitor.mode_of("eval_loss_cls_head") == "min"
    assert monitor.mode_of("eval_perplexity") == "min"
    assert monitor.mode_of("eval_top5_error") == "min"
    assert monitor.mode_of("eval_accuracy") == "max"
    assert monitor.mode_of("eval_top_5_accuracy") == "max"
    assert monitor.mode_of("eval_f1") == "max"
    assert monitor.mode_of("eval_my_metric") is None


def test_a_monitor_elects_only_a_strictly_better_value_and_counts_the_rest():
    watch = monitor.Monitor("eval_loss", "min", patience=2)
    assert watch.update(2, {"eval_loss": 0.5})
    assert not watch.update(4, {"eval_loss": 0.5})  # equal: not better
    assert not watch.update(6, {"eval_loss": float("nan")})
    assert (watch.best, watch.best_step, watch.since, watch.stopping) == (0.5, 2, 2, True)
    higher = monitor.Monitor("eval_accuracy", "max", patience=0)
    assert higher.update(2, {"eval_accuracy": 0.5}) and higher.update(4, {"eval_accuracy": 0.75})
    assert not higher.update(6, {"eval_accuracy": 0.7}) and not higher.stopping


def test_a_restored_record_never_gives_way_to_a_worse_best():
    watch = monitor.Monitor("eval_loss", "min", patience=0)
    watch.restore({"metric": "eval_loss", "mode": "min", "best": 0.5, "best_step": 4, "since": 1})
    watch.restore({"metric": "eval_loss", "mode": "min", "best": 0.25, "best_step": 6, "since": 0},
                  since=False)  # a best.pt newer than the checkpoint
    watch.restore({"metric": "eval_loss", "mode": "min", "best": 0.75, "best_step": 2}, since=False)
    assert (watch.best, watch.best_step, watch.since) == (0.25, 6, 1)
    other = {"metric": "eval_accuracy", "mode": "max", "best": 0.9, "best_step": 2}
    assert "starts afresh" in watch.restore(other) and watch.best == 0.25


def refused(capsys, *argv: str, spec=ACCURATE) -> str:
    with pytest.raises(SystemExit) as stop:
        train(*argv, spec=spec)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage
    return err


def test_an_unknown_metric_is_one_line_naming_the_runs_metrics(capsys):
    err = refused(capsys, "--eval-every", "2", "--monitor", "accuracy")
    assert err.endswith("error: --monitor accuracy: not a metric of this run's evaluation "
                        "(did you mean eval_accuracy?); it has eval_loss, eval_accuracy\n")
    err = refused(capsys, "--monitor", "eval_loss")
    assert "--monitor eval_loss: this run has no evaluation data to monitor" in err
    err = refused(capsys, "--early-stop", "3")
    assert "--early-stop needs evaluation data to monitor" in err
    err = refused(capsys, "--eval-every", "2", "--keep-last", "0")
    assert "--keep-last must be at least 1, got 0" in err


def test_a_metric_whose_name_says_no_mode_needs_monitor_mode(capsys):
    mine = training(loss_outputs=("out",), class_dims=(1,),
                    metrics=(Metric(name="agreement", op="accuracy"),))
    err = refused(capsys, "--eval-every", "2", "--monitor", "eval_agreement", spec=mine)
    assert "add --monitor-mode min or --monitor-mode max" in err
    args = SimpleNamespace(monitor="eval_agreement", monitor_mode="max", early_stop=0)
    monitor.choose(flags.parser(mine), args, mine, evaluates=True)
    assert args.monitor_mode == "max"


def test_best_pt_holds_the_step_of_the_lowest_eval_loss_and_its_weights(tmp_path, capsys):
    # lr 0.5: the loss falls, then rises and falls again, so the best is not the last step
    argv = ["--eval-every", "1", "--lr", "0.5", "--samples", "32", "--seed", "3"]
    train("--steps", "12", "--checkpoint", str(tmp_path / "run"), *argv)
    rows = evaluations(tmp_path / "run")
    lowest = min(rows, key=lambda row: float(row["eval_loss"]))
    best = saved(tmp_path / "run" / "best.pt")
    assert best["step"] == int(lowest["step"])
    assert best["monitor"]["best"] == pytest.approx(float(lowest["eval_loss"]))
    line = f"best eval loss {float(lowest['eval_loss']):.6g} at step {best['step']}: "
    assert line + str(tmp_path / "run" / "best.pt") in capsys.readouterr().out
    # the weights of that step: a run that stops there ends with them
    train("--steps", str(best["step"]), "--checkpoint", str(tmp_path / "short"), *argv)
    for key, value in saved(tmp_path / "short" / "last.pt")["model"].items():
        assert torch.equal(best["model"][key], value), key


def test_a_higher_is_better_metric_keeps_its_highest(tmp_path, capsys):
    argv = ["--eval-every", "1", "--lr", "0.5", "--samples", "32", "--seed", "3"]
    train("--steps", "12", "--checkpoint", str(tmp_path), "--monitor", "eval_accuracy", *argv)
    rows = evaluations(tmp_path)
    accuracies = [float(row["eval_accuracy"]) for row in rows]
    first_highest = rows[accuracies.index(max(accuracies))]
    best = saved(tmp_path / "best.pt")
    assert best["step"] == int(first_highest["step"])
    assert best["monitor"]["mode"] == "max"
    assert f"best eval accuracy {max(accuracies):.6g} at step" in capsys.readouterr().out


def test_keep_last_keeps_the_newest_saves_and_a_resumed_run_prunes_on(tmp_path):
    argv = ["--save-every", "2", "--keep-last", "2", "--checkpoint", str(tmp_path)]
    train("--steps", "8", *argv)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["last.pt", "step_6.pt", "step_8.pt"]
    assert saved(tmp_path / "last.pt")["monitor"]["kept"] == [6, 8]
    train("--steps", "12", "--resume", *argv)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["last.pt", "step_10.pt",
                                                            "step_12.pt"]
    assert saved(tmp_path / "last.pt")["step"] == saved(tmp_path / "step_12.pt")["step"] == 12
    assert saved(tmp_path / "step_10.pt")["step"] == 10


def test_early_stop_ends_after_its_patience_and_saves_as_at_the_end(tmp_path, capsys):
    # lr 0: the evaluation never improves on its first
    train("--steps", "20", "--lr", "0", "--eval-every", "2", "--early-stop", "2",
          "--checkpoint", str(tmp_path))
    out = capsys.readouterr().out
    assert "early stop after step 6: eval loss has not improved for 2 evaluations (best " in out
    assert "at step 2)" in out
    assert saved(tmp_path / "last.pt")["step"] == 6 and saved(tmp_path / "best.pt")["step"] == 2
    assert [row["step"] for row in evaluations(tmp_path)] == ["2", "4", "6"]


def test_a_resumed_run_keeps_its_best_and_its_patience(tmp_path, capsys):
    argv = ["--lr", "0", "--eval-every", "2", "--early-stop", "3", "--checkpoint", str(tmp_path)]
    train("--steps", "4", *argv)
    assert saved(tmp_path / "best.pt")["step"] == 2
    # the resumed run's evaluations equal the best: none is elected, and the
    # patience counted before the resume runs out at step 8 (not 12)
    train("--steps", "20", "--resume", *argv)
    out = capsys.readouterr().out
    assert "early stop after step 8" in out and "at step 2: " in out
    assert saved(tmp_path / "best.pt")["step"] == 2
    assert saved(tmp_path / "last.pt")["monitor"]["since"] == 3


def test_a_best_pt_newer_than_the_checkpoint_resumed_stays_the_best(tmp_path):
    argv = ["--eval-every", "1", "--lr", "0.5", "--samples", "32", "--seed", "3",
            "--checkpoint", str(tmp_path)]
    train("--steps", "3", *argv)
    early = saved(tmp_path / "last.pt")
    train("--steps", "12", *argv)  # a later run wrote best.pt ...
    best = saved(tmp_path / "best.pt")
    torch.save(early, tmp_path / "last.pt")  # ... and was killed before its last save
    train("--steps", "12", "--resume", *argv)
    assert saved(tmp_path / "best.pt")["step"] == best["step"]


def test_without_evaluation_nothing_is_monitored(tmp_path, capsys):
    train("--steps", "3", "--checkpoint", str(tmp_path), spec=TRAINING)
    assert not (tmp_path / "best.pt").exists()
    assert "best " not in capsys.readouterr().out


# The pipeline program's folders (mpgen/runtime/sharded.py) --------------------

from mpgen.runtime import sharded  # noqa: E402


def steps_in(folder, *steps: int) -> None:
    for step in steps:
        (folder / f"step_{step}").mkdir()
        (folder / f"step_{step}" / sharded.MARKER).write_text(f"step {step}\n")


def test_pruning_keeps_the_newest_and_the_step_best_links_to(tmp_path):
    steps_in(tmp_path, 2, 4, 6, 8)
    sharded.point(str(tmp_path), 4)
    sharded.prune(str(tmp_path), keep=2)
    assert sharded.complete(str(tmp_path)) == [4, 6, 8]
    assert sharded.best_step(str(tmp_path)) == 4
    sharded.point(str(tmp_path), 8)  # a new best: the old one goes at the next prune
    sharded.prune(str(tmp_path), keep=1)
    assert sharded.complete(str(tmp_path)) == [8]


def test_a_step_folder_is_read_as_itself_and_a_dangling_best_is_none(tmp_path):
    steps_in(tmp_path, 3, 5)
    sharded.point(str(tmp_path), 3)
    assert sharded.resolve(str(tmp_path / "best")) == (tmp_path / "best", 3)
    assert sharded.resolve(str(tmp_path)) == (tmp_path / "step_5", 5)
    assert sharded.resolve(str(tmp_path / "nothing")) is None
    sharded.remove(tmp_path / "step_3")
    assert sharded.best_step(str(tmp_path)) is None
    sharded.remove(tmp_path / "best")  # the link, not its target
    assert not (tmp_path / "best").is_symlink() and (tmp_path / "step_5").is_dir()


def test_the_build_reads_a_metric_s_direction_as_the_runtime_does():
    # the front end checks a spec's train.monitor (it cannot import the runtime)
    from mpgen.compiler.frontend import training as frontend

    assert (frontend._LOWER, frontend._HIGHER) == (monitor.LOWER, monitor.HIGHER)
    for name in ("eval_loss", "eval_top5_error", "eval_accuracy_cls", "eval_f1", "eval_agreement",
                 "eval_perplexity", "eval_bleu_score"):
        assert frontend.monitor_mode(name) == monitor.mode_of(name), name


def test_the_spec_s_monitor_is_the_default_and_unwatched_without_evaluation(capsys):
    made = training(defaults={"monitor": "eval_loss", "monitor_mode": "max", "early_stop": 2})
    args = SimpleNamespace(monitor="eval_loss", monitor_mode="max", early_stop=2)
    said = monitor.choose(None, args, made, evaluates=False)
    assert said == ("monitor: the spec's eval_loss is not watched: this run has no evaluation "
                    "data (give --eval-data or --eval-split)")
    assert (args.monitor, args.early_stop) == (None, 0)
    args = SimpleNamespace(monitor="eval_loss", monitor_mode="max", early_stop=2)
    assert monitor.choose(None, args, made, evaluates=True) is None
    assert (args.monitor, args.monitor_mode, args.early_stop) == ("eval_loss", "max", 2)
