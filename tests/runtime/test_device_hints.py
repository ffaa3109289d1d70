"""A script built for GPUs this machine lacks stops with how to run it here,
never by writing into the folder it was built into (docs/training.md, "A
missing device"): the training script's hint is ``mpgen train``, which
builds into a temporary folder; another script's is a build of its own
under build/. Followed as printed, both leave the committed folder as
``mpgen check`` wants it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import mpgen_process
from mpgen.runtime.loop import check_devices, gpus_here, run_elsewhere
from tiny import training

MPGEN = str(Path(sys.executable).with_name("mpgen"))
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() >= 2,
                              reason="this machine has both GPUs: the scripts run")


def test_the_training_scripts_hint_is_mpgen_train_with_its_arguments():
    hint = run_elsewhere(training(), "cpu", "train_tiny.py", ["--steps", "3", "--out", "my runs"])
    assert hint == ("Run it here with: mpgen train tiny.yaml --device-map cpu -- --steps 3 "
                    "--out 'my runs'")
    assert run_elsewhere(training(), "cpu", "train_tiny.py", []) == (
        "Run it here with: mpgen train tiny.yaml --device-map cpu")


def test_another_scripts_hint_is_a_build_under_build():
    hint = run_elsewhere(training(), "cuda:1=cuda:0", "predict_tiny.py", ["--checkpoint", "ck"])
    assert hint == ("Build a copy for this machine and run that one: mpgen build tiny.yaml "
                    "--device-map cuda:1=cuda:0 -o build/tiny-here, then python "
                    "build/tiny-here/predict_tiny.py --checkpoint ck")
    assert run_elsewhere(training(), "cpu", "pp_tiny.py", []).endswith(
        "-o build/tiny-cpu, then python build/tiny-cpu/pp_tiny.py")


def test_a_machine_without_gpus_says_so():
    assert gpus_here(0) == "no CUDA device"
    assert gpus_here(1) == "1 CUDA device(s)"


@TWO_GPUS
def test_check_devices_names_the_missing_ones_and_the_hint():
    count = torch.cuda.device_count()
    with pytest.raises(SystemExit) as stopped:
        check_devices(training(devices=("cuda:0", "cuda:1")), ["--steps", "2"])
    if count == 0:
        assert stopped.value.code == (
            "Tiny is placed on cuda:0, cuda:1, but this machine has no CUDA device. Run it "
            "here with: mpgen train tiny.yaml --device-map cpu -- --steps 2")
    else:
        assert stopped.value.code == (
            "Tiny is placed on cuda:1, but this machine has 1 CUDA device(s). Run it here "
            "with: mpgen train tiny.yaml --device-map cuda:1=cuda:0 -- --steps 2")


SPEC = """\
mpgen: 1
name: TwoGpus

inputs:
  x: [batch, 4]

layers:
  first: {op: Linear, args: [4, 8]}
  second: {op: Linear, args: [8, 1]}

placement:
  first: cuda:0
  second: cuda:1
"""


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed command as a user types it: ``mpgen`` this environment's."""
    argv = shlex.split(command)
    argv[0] = {"mpgen": MPGEN, "python": sys.executable}[argv[0]]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
@TWO_GPUS
def test_following_the_hints_leaves_the_committed_folder_current(tmp_path):
    """A project with its build committed in generated/: the training script
    and the pipeline program, run here, print their hints; each is run as
    printed, and generated/ is byte for byte what it was, and current."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "two_gpus.yaml").write_text(SPEC)
    built = mpgen_process("build", "two_gpus.yaml", "-o", "generated", cwd=tmp_path,
                          command=[MPGEN])
    assert built.returncode == 0, built.stderr
    before = snapshot(tmp_path / "generated")

    stopped = run("python generated/train_two_gpus.py --steps 2 --batch-size 4 --samples 8", tmp_path)
    assert stopped.returncode == 1
    line = stopped.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, stopped.stderr
    prefix, hint = line.split(". Run it here with: ")
    if torch.cuda.device_count() == 0:
        assert prefix == "TwoGpus is placed on cuda:0, cuda:1, but this machine has no CUDA device"
        assert hint == "mpgen train two_gpus.yaml --device-map cpu -- --steps 2 --batch-size 4 --samples 8"
    trained = run(hint, tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert "trained 2 steps" in trained.stdout

    stopped = run("python generated/pp_two_gpus.py --steps 1", tmp_path)
    assert stopped.returncode == 1
    build, then = stopped.stderr.strip().split(
        "Build a copy for this machine and run that one: ")[1].split(", then ")
    assert build.startswith("mpgen build two_gpus.yaml --device-map ")
    assert build.endswith(" -o build/two_gpus-cpu" if torch.cuda.device_count() == 0
                          else " -o build/two_gpus-here")
    assert run(build, tmp_path).returncode == 0
    program = run(then, tmp_path)  # not under torchrun: it says how to start it
    assert "run it under torchrun: torchrun --nproc-per-node 2" in program.stderr

    assert snapshot(tmp_path / "generated") == before
    check = mpgen_process("check", "two_gpus.yaml", "-o", "generated", cwd=tmp_path,
                          command=[MPGEN])
    assert check.returncode == 0, check.stdout + check.stderr
