"""--memory (mpgen/runtime/memory.py): a step's peak, measured, beside the plan's."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from mpgen.runtime import loop, memory, pipeline
from mpgen.testing import measure_training_step
from test_pipeline import _free_port
from tiny import STAGES, TRAINING

LINE = re.compile(r"memory (?P<where>.*), step (?P<step>\d+): measured [\d.]+ MiB "
                  r"\((?P<bytes>\d+) bytes\)(?: in (?P<phase>[a-z ]+))?, (?P<versus>[^\[]*)")


def test_live_bytes_count_as_mpgen_testings_tracker():
    # The runtime's copy of the tracker: the same peak and parts on the same step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    ours = measure_training_step(step, model, optimizer, extra=(x, y))["cpu"]
    optimizer.zero_grad(set_to_none=True)
    live = memory.LiveBytes()
    live.track([model], [optimizer])
    with live:
        step()
    peak, phase, parts = live.peaks["cpu"]
    assert (peak, phase) == (ours.peak, ours.phase)
    assert parts == {p: b for p, b in ours.at_peak.items() if p != "transfers"}


def test_memory_prints_the_second_steps_peak_beside_the_plan(tmp_path, capsys):
    planned = dataclasses.replace(TRAINING, memory={"cpu": 10_000})
    loop.train(planned, ["--steps", "3", "--memory", "--log-dir", str(tmp_path)])
    lines = [LINE.match(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("memory ")]
    assert len(lines) == 1 and lines[0] is not None
    found = lines[0]
    assert found["where"] == "cpu" and found["step"] == "2"
    measured = int(found["bytes"])
    weights = sum(p.numel() * 4 for p in TRAINING.model().parameters())
    # Weights, gradients and SGD's momentum at least; the batch is 4 samples.
    assert 3 * weights <= measured < 3 * weights + 4096
    assert found["versus"].startswith(f"planned 0.01 MiB ({measured / 10_000:.2f}x)")


def test_a_run_of_one_step_measures_it_and_no_plan_says_so(tmp_path, capsys):
    loop.train(TRAINING, ["--steps", "1", "--memory", "--log-dir", str(tmp_path)])
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory ")]
    assert len(out) == 1 and ", step 1: " in out[0] and "no plan" in out[0]


def _rank(rank: int, world: int, port: int, plan: dict, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pipeline.train(dataclasses.replace(STAGES, memory=plan), argv)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_pipeline_rank_prints_its_stages_peak(tmp_path, capfd, schedule):
    plan = {"cuda:0": 1_000, "cuda:1": 2_000}
    argv = ["--steps", "2", "--batch-size", "8", "--microbatches", "4", "--memory",
            "--schedule", schedule, "--log-dir", str(tmp_path)]
    ranks = mp.start_processes(_rank, (2, _free_port(), plan, argv), nprocs=2,
                               start_method="spawn")
    assert ranks is None or ranks.join()
    out = capfd.readouterr().out
    found = {m["where"]: m for m in map(LINE.match, out.splitlines()) if m}
    assert set(found) == {"rank 0: cuda:0 (on cpu)", "rank 1: cuda:1 (on cpu)"}
    for where, plan in (("rank 0: cuda:0 (on cpu)", 1_000), ("rank 1: cuda:1 (on cpu)", 2_000)):
        assert found[where]["step"] == "2"
        assert f"({int(found[where]['bytes']) / plan:.2f}x)" in found[where]["versus"]


class _TwoDevices(nn.Module):
    """Tiny split over cuda:0 and cuda:1 (virtual devices here)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 64).to("cuda:0")
        self.head = nn.Linear(64, 3).to("cuda:1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(x.to("cuda:0"))).to("cuda:1"))


def _split_loss(model, loss_fns, inputs, targets, count=False):
    out = model(*inputs)
    return loss_fns[0](out, targets[0].to("cuda:1")), []


def test_on_cuda_memory_reads_max_memory_allocated_per_device(tmp_path, capsys):
    from mpgen.testing import virtual_devices

    planned = dataclasses.replace(TRAINING, model=_TwoDevices, devices=("cuda:0", "cuda:1"),
                                  forward_loss=_split_loss,
                                  memory={"cuda:0": 4_000, "cuda:1": 3_000})
    with virtual_devices(cuda=2) as vd:  # torch.cuda's memory counters: the virtual devices'
        loop.train(planned, ["--steps", "2", "--memory", "--log-dir", str(tmp_path)])
        peaks = vd.peak_bytes
    lines = {m["where"]: m for m in map(LINE.match, capsys.readouterr().out.splitlines()) if m}
    assert set(lines) == {"cuda:0", "cuda:1"}
    for device, plan in (("cuda:0", 4_000), ("cuda:1", 3_000)):
        measured = int(lines[device]["bytes"])
        assert 0 < measured <= peaks[device]  # the step's own peak, within the run's
        assert lines[device]["phase"] is None  # max_memory_allocated says no phase
        assert lines[device]["versus"].startswith(f"planned 0.00 MiB ({measured / plan:.2f}x)")
