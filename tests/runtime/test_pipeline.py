"""The pipeline mode of the loop (mpgen/runtime/pipeline.py): its parts in
process, and two ranks on gloo in spawned processes (forking after torch's
threads started can deadlock), against the single-process loop on the same
data and initial weights."""

from __future__ import annotations

import csv
import dataclasses
import os
import pickle
import socket
import threading
import time

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from mpgen.runtime import launch, loop, mesh, pipeline, sharded
from tiny import STAGES, TRAINING, Tiny


def test_pick_takes_the_micro_batchs_samples_of_a_target():
    target = torch.arange(6) * 10
    assert pipeline.pick(target, 0, torch.tensor([2, 3])).tolist() == [20, 30]
    assert pipeline.pick(target, None, torch.tensor([0])) is target  # no batch dim: all of it


def test_a_placeholder_instance_refuses_to_run():
    with pytest.raises(RuntimeError, match="held by another stage"):
        pipeline.Elsewhere()(torch.zeros(1))


def test_each_schedule_places_the_stages_on_its_ranks():
    assert mesh.stage_ranks(STAGES, "1f1b") == [0, 1]
    assert mesh.stage_ranks(STAGES, "zbv") == [0, 0]  # a V: stages r and K - 1 - r on rank r
    four = dataclasses.replace(STAGES, stages=STAGES.stages * 2,
                               devices=("cuda:0", "cuda:1", "cuda:0", "cuda:1"))
    assert mesh.stage_ranks(four, "interleaved") == [0, 1, 0, 1]
    assert mesh.stage_ranks(four, "looped-bfs") == [0, 1, 0, 1]
    assert mesh.stage_ranks(four, "dualpipev") == [0, 1, 1, 0]
    with pytest.raises(SystemExit, match="--schedule interleaved needs a layout"):
        mesh.stage_ranks(STAGES, "interleaved")
    three = dataclasses.replace(STAGES, stages=STAGES.stages + STAGES.stages[:1],
                                devices=("cuda:0", "cuda:1", "cuda:2"))
    with pytest.raises(SystemExit, match="needs an even number of stages"):
        mesh.stage_ranks(three, "zbv")


def test_merge_writes_one_state_dict_the_model_loads_strictly(tmp_path, capsys):
    model = {**STAGES.stages[0]().state_dict(), **STAGES.stages[1]().state_dict()}
    dcp.save({"model": model}, checkpoint_id=tmp_path / "step_3")
    with pytest.raises(SystemExit, match="no complete checkpoint"):  # no marker: incomplete
        sharded.merge(STAGES, str(tmp_path), str(tmp_path / "model.pt"))
    (tmp_path / "step_3" / sharded.MARKER).write_text("step 3\n")
    sharded.merge(STAGES, str(tmp_path), str(tmp_path / "model.pt"))
    assert "(step 3) into" in capsys.readouterr().out
    Tiny().load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict


def test_leftovers_of_a_killed_save_are_found_and_never_resumed(tmp_path):
    (tmp_path / ".step_4.partial").mkdir()
    (tmp_path / "step_3").mkdir()  # no marker
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / sharded.MARKER).write_text("step 2\n")
    (tmp_path / ".stage_1.abc.tmp").write_bytes(b"partial")
    assert sharded.complete(str(tmp_path)) == [2]
    assert [p.name for p in sharded.leftovers(str(tmp_path))] == [
        ".stage_1.abc.tmp", ".step_4.partial", "step_3"]


def _rank(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pipeline.train(STAGES, argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(folder) -> list[float]:
    with open(folder / "log.csv", newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row["loss"]]


def _spawn(world: int, argv: list[str], seconds: int = 300) -> None:
    ranks = mp.start_processes(_rank, (world, _free_port(), argv), nprocs=world, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + seconds
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish in {seconds} s")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process loop's run: 4 steps of 8 samples from init.pt."""
    folder = tmp_path_factory.mktemp("single")
    torch.manual_seed(0)
    init = Tiny().state_dict()
    torch.save(init, folder / "init.pt")
    safetensors.torch.save_file(init, folder / "init.safetensors")
    loop.train(TRAINING, ["--steps", "4", "--batch-size", "8", "--log-dir", str(folder),
                          "--checkpoint", str(folder), "--init", str(folder / "init.pt")])
    return folder


@pytest.mark.slow  # two ranks, each a process of its own
def test_two_ranks_train_as_the_single_process_loop_does(single, tmp_path):
    argv = ["--steps", "4", "--batch-size", "8", "--log-dir", str(tmp_path / "pp"),
            "--init", str(single / "init.safetensors"), "--checkpoint", str(tmp_path / "stages")]
    _spawn(2, argv)
    assert _losses(tmp_path / "pp") == pytest.approx(_losses(single), rel=1e-5)
    sharded.merge(STAGES, str(tmp_path / "stages"), str(tmp_path / "merged.pt"))
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    trained = torch.load(single / "last.pt", weights_only=True)["model"]
    for key, value in trained.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # four ranks, then two
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_replicas_of_two_stages_train_as_one_process(single, tmp_path, mode):
    # 2 stages x 2 replicas: each replica takes half of every batch; a
    # checkpoint written by the 2-D mesh resumes on one replica (resharded).
    argv = ["--batch-size", "8", "--init", str(single / "init.pt"), "--dp-mode", mode,
            "--checkpoint", str(tmp_path / "ck")]
    _spawn(4, ["--steps", "2", "--dp", "2", "--log-dir", str(tmp_path / "a"), *argv])
    assert sharded.complete(str(tmp_path / "ck")) == [2]
    _spawn(2, ["--steps", "4", "--dp", "1", "--resume", "--log-dir", str(tmp_path / "b"),
               *argv])
    expected = _losses(single)
    assert _losses(tmp_path / "a") == pytest.approx(expected[:2], rel=1e-5)
    assert _losses(tmp_path / "b") == pytest.approx(expected[2:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_a_checkpoint_of_one_replica_resumes_onto_two(single, tmp_path, mode):
    # The new replica's ranks find no RNG state of theirs in the checkpoint;
    # every rank still enters the same collectives (it hung until --timeout).
    argv = ["--batch-size", "8", "--init", str(single / "init.pt"), "--dp-mode", mode,
            "--checkpoint", str(tmp_path / "ck"), "--timeout", "60"]
    _spawn(2, ["--steps", "2", "--dp", "1", "--log-dir", str(tmp_path / "a"), *argv])
    _spawn(4, ["--steps", "4", "--dp", "2", "--resume", "--log-dir", str(tmp_path / "b"),
               *argv], seconds=120)
    expected = _losses(single)
    assert _losses(tmp_path / "a") == pytest.approx(expected[:2], rel=1e-5)
    assert _losses(tmp_path / "b") == pytest.approx(expected[2:], rel=1e-5)
    sharded.merge(STAGES, str(tmp_path / "ck"), str(tmp_path / "merged.pt"))
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    trained = torch.load(single / "last.pt", weights_only=True)["model"]
    for key, value in trained.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)


class _Half(torch.nn.Module):
    """A stage of a model whose a.weight and b.weight are one tied parameter."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.add_module(name, torch.nn.Linear(4, 4, bias=False))


def _tied_stages():
    class A(_Half):
        def __init__(self) -> None:
            super().__init__("a")

    class B(_Half):
        def __init__(self) -> None:
            super().__init__("b")

    return dataclasses.replace(STAGES, stages=(A, B), ties=(((0, "a.weight"), (1, "b.weight")),))


def test_merge_refuses_tied_copies_that_differ(tmp_path):
    stages = _tied_stages()
    weight = torch.randn(4, 4)
    model = {"a.weight": weight, "b.weight": weight + 0.25}
    dcp.save({"model": model}, checkpoint_id=tmp_path / "step_3")
    (tmp_path / "step_3" / sharded.MARKER).write_text("step 3\n")
    with pytest.raises(SystemExit) as stopped:
        sharded.merge(stages, str(tmp_path), str(tmp_path / "model.pt"))
    assert str(stopped.value) == (
        f"--merge: {tmp_path / 'step_3'}: the tied copies a.weight and b.weight differ (by up to "
        "0.25); they are one parameter of the model, so nothing was written")
    assert not (tmp_path / "model.pt").exists()
    model["b.weight"] = weight.clone()  # equal: merged
    dcp.save({"model": model}, checkpoint_id=tmp_path / "step_4")
    (tmp_path / "step_4" / sharded.MARKER).write_text("step 4\n")
    sharded.merge(stages, str(tmp_path), str(tmp_path / "model.pt"))
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["b.weight"], weight)


def test_a_save_refuses_tied_copies_on_one_rank_that_differ(tmp_path):
    # zbv's V puts both copies on one rank; they drifted apart under DDP and were saved.
    stages = _tied_stages()
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        modules = {0: stages.stages[0](), 1: stages.stages[1]()}
        copies = [(0, "a.weight"), (1, "b.weight")]
        engine = type("Engine", (), {})()  # the parts of a Pipelined that check_ties reads
        engine.stages, engine.modules, engine.device = stages, modules, torch.device("cpu")
        engine.groups = [(None, 0, copies)]
        engine.args = type("Args", (), {"dp": 1, "dp_mode": "ddp"})()  # one replica
        pipeline.sync_ties(engine.groups, modules, gradients=False)
        pipeline.Pipelined.check_ties(engine, 5)  # equal: nothing to say
        with torch.no_grad():
            modules[1].b.weight[0, 0] += 0.5
        with pytest.raises(SystemExit) as stopped:
            pipeline.Pipelined.check_ties(engine, 5)
        assert str(stopped.value) == (
            "step 5: the tied copies a.weight and b.weight differ (by up to 0.5); they are one "
            "parameter of Tiny, so nothing was saved")
    finally:
        torch.distributed.destroy_process_group()


class _RunsCode:
    """What a hostile checkpoint pickles: unpickling it runs a command."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_metadata_runs_code_is_refused_unread(tmp_path):
    model = {**STAGES.stages[0]().state_dict(), **STAGES.stages[1]().state_dict()}
    dcp.save({"model": model, "step": 3}, checkpoint_id=tmp_path / "step_3", no_dist=True)
    (tmp_path / "step_3" / sharded.MARKER).write_text("step 3\n")
    marker = tmp_path / "ran"
    (tmp_path / "step_3" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(SystemExit) as stopped:
        sharded.merge(STAGES, str(tmp_path), str(tmp_path / "model.pt"))
    assert str(stopped.value) == (
        f"--merge: cannot read {tmp_path}/step_3 (Refused: its .metadata names posix.system, "
        "which a checkpoint's metadata never holds: refused (not unpickled))")
    with pytest.raises(sharded.Refused):
        sharded.load(tmp_path / "step_3", {"step": 0}, no_dist=True)
    assert not marker.exists() and not (tmp_path / "model.pt").exists()


def test_a_checkpoint_value_that_runs_code_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"step": _RunsCode(marker)}, checkpoint_id=tmp_path / "step_3", no_dist=True)
    assert set(sharded.keys(tmp_path / "step_3")) == {"step"}  # the metadata is DCP's own
    with pytest.raises(sharded.Refused, match="step: UnpicklingError: Weights only load failed"):
        sharded.load(tmp_path / "step_3", {"step": 0}, no_dist=True)
    assert not marker.exists()


@pytest.mark.slow
def test_a_lost_rank_is_named_only_when_its_heartbeat_stopped():
    # Rank 1 is alive (its heartbeat thread beats) but never says it is
    # running, as a rank slow to notice the failure; rank 2 beats no more.
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = torch.distributed.PrefixStore("mpgen/attempt_1", server)
    store.add("mpgen/beat/2", 5)  # it beat, then died
    threading.Thread(target=launch.beat, args=(store, 1), daemon=True).start()
    launch.ATTEMPT[0] = store
    try:
        assert launch.silent(0, 3, wait=1.0) == [2]
    finally:
        launch.ATTEMPT[0] = None
