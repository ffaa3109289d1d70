"""The pipeline mode of the loop (mpgen/runtime/pipeline.py): its parts in
process, and two ranks on gloo in spawned processes (forking after torch's
threads started can deadlock), against the single-process loop on the same
data and initial weights."""

from __future__ import annotations

import csv
import os
import socket
import time

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp

from mpgen.runtime import checkpoint, loop, pipeline
from tiny import STAGES, TRAINING, Tiny


def test_pick_takes_the_micro_batchs_samples_of_a_target():
    target = torch.arange(6) * 10
    assert pipeline.pick(target, 0, torch.tensor([2, 3])).tolist() == [20, 30]
    assert pipeline.pick(target, None, torch.tensor([0])) is target  # no batch dim: all of it


def test_a_placeholder_instance_refuses_to_run():
    with pytest.raises(RuntimeError, match="held by another stage"):
        pipeline.Elsewhere()(torch.zeros(1))


def test_interleaved_needs_a_layout_that_repeats_its_devices():
    assert pipeline.placement(STAGES, "1f1b") == [0, 1]
    with pytest.raises(SystemExit, match="--schedule interleaved needs a layout"):
        pipeline.placement(STAGES, "interleaved")


def test_merge_writes_one_state_dict_the_model_loads_strictly(tmp_path, capsys):
    front, back = STAGES.stages[0](), STAGES.stages[1]()
    for k, stage in enumerate((front, back)):
        checkpoint.save(checkpoint.state(stage, None, None, None, 3), tmp_path / f"stage_{k}.pt")
    pipeline.merge(STAGES, str(tmp_path), str(tmp_path / "model.pt"))
    assert "merged 2 stages" in capsys.readouterr().out
    Tiny().load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict


def _rank(rank: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pipeline.train(STAGES, argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(folder) -> list[float]:
    with open(folder / "log.csv", newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def test_two_ranks_train_as_the_single_process_loop_does(tmp_path):
    torch.manual_seed(0)
    init = Tiny().state_dict()
    torch.save(init, tmp_path / "init.pt")
    safetensors.torch.save_file(init, tmp_path / "init.safetensors")
    argv = ["--steps", "3", "--batch-size", "4", "--log-dir", str(tmp_path / "pp"),
            "--init", str(tmp_path / "init.safetensors"), "--checkpoint", str(tmp_path / "stages")]
    ranks = mp.start_processes(_rank, (_free_port(), argv), nprocs=2, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two ranks did not finish in 300 s")

    # The single-process loop from the same weights (a .pt file), on the same batches.
    one = str(tmp_path / "one")
    loop.train(TRAINING, ["--steps", "3", "--batch-size", "4", "--log-dir", one,
                          "--checkpoint", one, "--init", str(tmp_path / "init.pt")])
    assert _losses(tmp_path / "pp") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    pipeline.merge(STAGES, str(tmp_path / "stages"), str(tmp_path / "merged.pt"))
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    trained = torch.load(tmp_path / "one" / "last.pt", weights_only=True)["model"]
    for key, value in trained.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)
