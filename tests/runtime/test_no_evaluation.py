"""A spec's ``eval_every`` with a plain ``--data`` (no --eval-data, no
--eval-split): the run trains, evaluates nothing and says so once, in both
programs; ``--eval-every`` given so on the command line is a usage error."""

from __future__ import annotations

import csv
import dataclasses
import os
import time

import pytest
import torch

from mpgen.runtime import loop, pipeline
from test_pipeline import _free_port
from tiny import STAGES, TRAINING, training

#: The spec's train: {eval_every: 2}.
EVALUATING = training(defaults={**TRAINING.defaults, "eval_every": 2})
EVALUATING_STAGES = dataclasses.replace(STAGES, training=EVALUATING)
NOTE = ("no evaluation data: the spec's eval_every 2 evaluates nothing with --data alone "
        "(give --eval-data or --eval-split)")


def _data(folder) -> str:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    torch.save({"x": x, "target": x[:, :3].argmax(1)}, folder / "data.pt")
    return str(folder / "data.pt")


def _rows(folder) -> list[dict]:
    with open(folder / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_spec_s_eval_every_with_data_alone_trains_and_says_so_once(tmp_path, capsys):
    data = _data(tmp_path)
    loop.train(EVALUATING, ["--data", data, "--steps", "4", "--log-dir", str(tmp_path / "log")])
    out = capsys.readouterr().out
    assert out.count("no evaluation data") == 1 and NOTE in out.splitlines()
    assert "eval at" not in out
    rows = _rows(tmp_path / "log")
    assert [row["step"] for row in rows if row["loss"]] == ["1", "2", "3", "4"]
    assert not any(row.get("eval_loss") for row in rows)
    # with evaluation data, no note, and the evaluations at 2 and 4
    loop.train(EVALUATING, ["--data", data, "--eval-split", "0.25", "--steps", "4"])
    out = capsys.readouterr().out
    assert "no evaluation data" not in out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("eval at")] == [
        "eval at step 2", "eval at step 4"]


def test_eval_every_given_with_data_alone_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        loop.train(EVALUATING, ["--data", _data(tmp_path), "--steps", "2", "--eval-every", "3"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(": error: --eval-every needs --eval-data or --eval-split")


def _rank(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pipeline.train(EVALUATING_STAGES, argv)


@pytest.mark.slow  # two ranks on gloo
def test_the_pipeline_program_trains_without_evaluation_and_says_so_once(tmp_path, capfd):
    import torch.multiprocessing as mp

    argv = ["--data", _data(tmp_path), "--steps", "2", "--batch-size", "8",
            "--log-dir", str(tmp_path / "log")]
    ranks = mp.start_processes(_rank, (2, _free_port(), argv), nprocs=2, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + 300  # a hang fails the test, never a slow machine
    while not ranks.join(timeout=5):  # a rank that fails raises here
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the 2 ranks did not finish in 300 s")
    out = capfd.readouterr().out
    assert out.count("no evaluation data") == 1 and NOTE in out.splitlines()
    rows = _rows(tmp_path / "log")
    assert [row["step"] for row in rows if row["loss"]] == ["1", "2"]
    assert not any(row.get("eval_loss") for row in rows)
