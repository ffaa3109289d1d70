"""Frozen parameters (``requires_grad: false``) under both training scripts:
``train_<name>.py`` and ``pp_<name>.py`` under torchrun (gloo, on the CPU,
with DDP and FSDP replicas). A frozen parameter leaves a run bit-identical,
has no optimizer state, is saved in every checkpoint and resumed; every
other parameter trains.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from helpers import build_to, import_generated, write_spec
from test_pipeline_program import losses, torchrun

pytestmark = pytest.mark.slow  # runs the generated scripts, under torchrun too

# pos (a Parameter) on the first stage; l2 (a Linear) frozen beside l3, which
# trains, on the second: one FSDP unit holds both kinds.
FROZEN = """
mpgen: 1
name: FrozenNet

inputs:
  x: [batch, 8]

layers:
  pos: {op: Parameter, shape: [8], init: {normal: {std: 0.5}}, requires_grad: false}
  add: {op: torch.add, in: [x, pos]}
  l1: {op: Linear, args: [8, 16]}
  a1: {op: Tanh}
  l2: {op: Linear, args: [16, 16], requires_grad: false}
  l3: {op: Linear, args: [16, 4]}

placement:
  pos: cuda:0
  l2: cuda:1

train:
  loss: MSELoss
  optimizer: {op: AdamW, lr: 0.05, weight_decay: 0.1}
  no_decay: [biases]
  batch_size: 8
  steps: 3
"""

FROZEN_KEYS = ("pos", "l2.weight", "l2.bias")


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script.name, *args], cwd=script.parent,
                          capture_output=True, text=True, timeout=150)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    """FrozenNet built for the CPU, its initial weights and a data file."""
    out = tmp_path_factory.mktemp("frozen")
    build_to(write_spec(out, FROZEN), out, {"*": "cpu"})
    generator = torch.Generator().manual_seed(1)
    torch.save({"x": torch.randn(32, 8, generator=generator),
                "target": torch.randn(32, 4, generator=generator)}, out / "data.pt")
    torch.manual_seed(0)
    torch.save(import_generated(out / "frozen_net.py").FrozenNet().state_dict(), out / "init.pt")
    return out


def assert_frozen_kept(state: dict, init: dict) -> None:
    """The frozen tensors are the initial ones bit for bit; the others moved."""
    assert set(state) == set(init)
    for key, value in init.items():
        if key in FROZEN_KEYS:
            assert torch.equal(state[key], value), key
        else:
            assert not torch.equal(state[key], value), key


def test_the_model_freezes_them_with_the_same_keys(frozen):
    model = import_generated(frozen / "frozen_net.py").FrozenNet()
    assert {k for k, p in model.named_parameters() if not p.requires_grad} == set(FROZEN_KEYS)
    model.load_state_dict(load(frozen / "init.pt"), strict=True)  # --init's keys, unchanged
    training = import_generated(frozen / "train_frozen_net.py").TRAINING
    optimizer = training.optimizer(model, type("Args", (), {"lr": 0.1, "settings": training.settings})())
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}


def test_train_script_keeps_them_and_resumes(frozen):
    script = frozen / "train_frozen_net.py"
    common = ["--data", "data.pt", "--init", "init.pt", "--batch-size", "8", "--grad-clip", "0.5"]
    straight = run(script, *common, "--steps", "4", "--checkpoint", "straight")
    assert straight.returncode == 0, straight.stderr
    assert ("FrozenNet: 492 parameters (212 train, the rest frozen); 4 steps of 8 samples\n"
            in straight.stdout)
    init = load(frozen / "init.pt")
    saved = load(frozen / "straight" / "last.pt")
    assert_frozen_kept(saved["model"], init)
    # The optimizer's state: the trained parameters only (l1's and l3's weight and bias).
    assert len(saved["optimizer"]["state"]) == 4
    held = [i for group in saved["optimizer"]["param_groups"] for i in group["params"]]
    assert sorted(held) == sorted(saved["optimizer"]["state"])
    # Two steps, then a resume to four: the straight run's weights.
    first = run(script, *common, "--steps", "2", "--checkpoint", "resumed")
    assert first.returncode == 0, first.stderr
    again = run(script, *common, "--steps", "4", "--checkpoint", "resumed", "--resume")
    assert again.returncode == 0, again.stderr
    resumed = load(frozen / "resumed" / "last.pt")["model"]
    for key, value in saved["model"].items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.parametrize("dp, mode", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_pipeline_script_keeps_them_and_resumes(frozen, dp, mode):
    name = f"pp_{dp}_{mode}"
    common = ["--data", "data.pt", "--init", "init.pt", "--batch-size", "8", "--grad-clip", "0.5",
              "--microbatches", "2", "--dp", str(dp), "--dp-mode", mode, "--schedule", "gpipe",
              "--checkpoint", name]
    ran = torchrun(2 * dp, frozen / "pp_frozen_net.py", *common, "--steps", "2")
    assert ran.returncode == 0, ran.stderr[-3000:]
    again = torchrun(2 * dp, frozen / "pp_frozen_net.py", *common, "--steps", "4", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    # The checkpoint holds every weight, and optimizer state for those that train only.
    saved = FileSystemReader(str(frozen / name / "step_4")).read_metadata().state_dict_metadata
    held = {key.split(".", 2)[2].rsplit(".", 1)[0] for key in saved
            if key.startswith("optim.state.")}
    assert held == {"l1.weight", "l1.bias", "l3.weight", "l3.bias"}
    assert {f"model.{key}" for key in FROZEN_KEYS} <= set(saved)
    merged = frozen / f"{name}.pt"
    done = run(frozen / "pp_frozen_net.py", "--merge", name, merged.name)
    assert done.returncode == 0, done.stderr
    state = load(merged)
    assert_frozen_kept(state, load(frozen / "init.pt"))
    # The single-process script's weights after the same four steps.
    single = frozen / f"single_{name}"
    ran = run(frozen / "train_frozen_net.py", "--data", "data.pt", "--init", "init.pt",
              "--batch-size", "8", "--grad-clip", "0.5", "--steps", "4", "--checkpoint",
              single.name)
    assert ran.returncode == 0, ran.stderr
    assert losses(frozen / name / "log.csv")[-2:] == pytest.approx(
        losses(single / "log.csv")[-2:], rel=1e-5, abs=1e-7)
    for key, value in load(single / "last.pt")["model"].items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
