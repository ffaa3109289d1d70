"""The log's files (mpgen/runtime/log.py, trackers.py): log.csv's columns
per output and per metric, a resumed run's rows, hparams.json and
TensorBoard's hparams, one TensorBoard curve after a resume, and the W&B
and MLflow trackers in their offline modes."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpgen.runtime import trackers
from mpgen.runtime.log import Log

COLUMNS = (["loss_cls", "loss_reg"], ["eval_loss", "eval_loss_cls", "eval_loss_reg", "eval_f1"])


def log(folder: Path, done: int = 0, **kwargs) -> Log:
    return Log(folder, 10, done, 1, 4, (), columns=COLUMNS, **kwargs)


def train(run: Log, steps: range, offset: float = 0.0) -> None:
    for step in steps:
        loss = 1.0 / step + offset
        run.step(step, 0, loss, 0.1, {"losses": [loss * 0.75, loss * 0.25]})
        if step % 2 == 0:
            row = {"eval_loss": loss, "eval_loss_cls": loss / 2, "eval_loss_reg": loss / 2}
            run.evaluation(step, 0, row | {"eval_f1": 0.5})


def rows(folder: Path) -> list[dict]:
    with (folder / "log.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_each_outputs_loss_and_each_metric_get_a_column(tmp_path, capsys):
    run = log(tmp_path)
    train(run, range(1, 3))
    run.close(0)
    found = rows(tmp_path)
    assert list(found[0])[:5] == ["step", "epoch", "loss", "loss_cls", "loss_reg"]
    assert float(found[0]["loss_cls"]) + float(found[0]["loss_reg"]) == float(found[0]["loss"])
    evaluation = found[-1]
    assert evaluation["step"] == "2" and evaluation["loss"] == ""
    assert float(evaluation["eval_loss_cls"]) == 0.25 and float(evaluation["eval_f1"]) == 0.5
    out = capsys.readouterr().out
    assert "loss 1.000000 (cls 0.750000 + reg 0.250000)" in out
    assert "eval at step 2: loss 0.500000  loss cls 0.250000  loss reg 0.250000  f1 50.00%" in out


def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint_in_step_order(tmp_path):
    killed = log(tmp_path)
    train(killed, range(1, 7))  # killed after step 6, its checkpoint at step 4
    killed.close(0)
    resumed = log(tmp_path, done=4)
    train(resumed, range(5, 9), offset=1.0)
    resumed.close(4)
    steps = [int(row["step"]) for row in rows(tmp_path) if row["loss"]]
    assert steps == list(range(1, 9))  # no step twice, none out of order
    evaluated = [row for row in rows(tmp_path) if row["eval_loss"]]
    assert [row["step"] for row in evaluated] == ["2", "4", "6", "8"]
    assert float(evaluated[2]["eval_loss"]) == pytest.approx(1 / 6 + 1.0)  # the new run's


def test_a_resumed_log_of_other_columns_keeps_the_columns_both_have(tmp_path):
    old = "step,epoch,loss,lr,eval_accuracy\n1,0,0.5,0.1,\n2,0,0.4,0.1,\n"
    (tmp_path / "log.csv").write_text(old)
    resumed = log(tmp_path, done=1)
    resumed.close(1)
    (kept,) = rows(tmp_path)
    assert {k: v for k, v in kept.items() if v} == {"step": "1", "epoch": "0", "loss": "0.5", "lr": "0.1"}


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_shows_one_curve_after_a_resume(tmp_path):
    killed = log(tmp_path)
    train(killed, range(1, 7))
    killed.close(0)
    resumed = log(tmp_path, done=4)
    train(resumed, range(5, 9), offset=1.0)
    resumed.close(4)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    curve = scalars(tmp_path, "train/loss")
    assert [step for step, _ in curve] == list(range(1, 9))
    assert curve[5][1] == pytest.approx(1 / 6 + 1.0)  # step 6: the resumed run's
    assert [step for step, _ in scalars(tmp_path, "train/loss_cls")] == list(range(1, 9))
    assert [step for step, _ in scalars(tmp_path, "eval/f1")] == [2, 4, 6, 8]


def test_the_runs_settings_go_to_hparams_json_and_tensorboard(tmp_path):
    settings = {"lr": 0.1, "overrides": ["optimizer.weight_decay=0.05"], "path": tmp_path}
    run = log(tmp_path, hparams=settings)
    run.close(0)
    written = json.loads((tmp_path / "hparams.json").read_text())
    assert written == settings | {"path": str(tmp_path)}
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "_hparams_/experiment" in events.PluginTagToContent("hparams")


def test_a_tracker_asked_for_and_missing_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    assert trackers.missing(["wandb"]) == (
        "--logger wandb: the wandb package is not installed (pip install wandb)"
    )
    assert trackers.missing(["neptune"]) == "--logger neptune: expected one of wandb, mlflow"
    monkeypatch.setenv("MPGEN_LOGGER", "mlflow, wandb,mlflow")
    assert trackers.chosen(type("Args", (), {"logger": None})()) == ["mlflow", "wandb"]


@pytest.mark.slow  # W&B starts a service process
def test_wandb_offline_and_mlflow_file_store_get_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    folder = tmp_path / "run"
    folder.mkdir()
    started = trackers.start(["wandb", "mlflow"], folder, "run", pytest.fail)
    run = log(folder, hparams={"lr": 0.1}, trackers=started)
    train(run, range(1, 3))
    run.close(0)
    import mlflow

    found = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    client = mlflow.tracking.MlflowClient()
    history = client.get_metric_history(found.info.run_id, "train/loss_cls")
    assert [(m.step, m.value) for m in history] == [(1, 0.75), (2, 0.375)]
    assert found.data.params["lr"] == "0.1"
    assert found.data.metrics["eval/f1"] == 0.5
    # W&B's offline run: its records (protobuf, no reader in the package) name every key
    written = next(folder.glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
    assert all(key in written for key in (b"train/loss_cls", b"eval/loss_reg", b"eval/f1"))
