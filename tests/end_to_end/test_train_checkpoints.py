"""The training script's checkpoints: ``--checkpoint DIR`` writes
``DIR/last.pt`` atomically, ``--resume`` continues from it bit for bit,
Ctrl-C saves, a NaN loss or a failed save keeps the last good checkpoint,
and the state dict loads into a build with another placement.

The scripts run as subprocesses, as users run them (signals, exit codes,
resource limits are the real ones)."""

from __future__ import annotations

import csv
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import build_to, import_generated, write_spec
from mpgen.testing import virtual_devices

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun) or builds many specs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def train(script: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent,
                          capture_output=True, text=True, timeout=300, **kwargs)


def written(folder: Path) -> list[str]:
    """The files in a checkpoint folder, but TensorBoard's (when it is installed)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("events.out."))


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def simple(tmp_path_factory) -> Path:
    """The seed example built for the CPU: its training script."""
    out = tmp_path_factory.mktemp("simple")
    build_to(EXAMPLES / "seed.yaml", out, {"*": "cpu"})
    return out / "train_simple_model.py"


def test_resnet18_three_steps_and_a_resume_to_six_equal_six_steps_bit_for_bit(tmp_path):
    build_to(EXAMPLES / "resnet18.yaml", tmp_path, {"*": "cpu"})
    assert "cuda" not in (tmp_path / "res_net18.py").read_text()
    script = tmp_path / "train_res_net18.py"
    same = ["--batch-size", "2", "--seed", "7"]
    runs = [train(script, "--steps", "6", *same, "--checkpoint", "A"),
            train(script, "--steps", "3", *same, "--checkpoint", "B"),
            train(script, "--steps", "6", *same, "--checkpoint", "B", "--resume")]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert runs[1].stdout.splitlines()[-1] == "saved B/last.pt at step 3"
    assert runs[2].stdout.splitlines()[2] == "resumed from B/last.pt at step 3"
    assert [l.split()[1] for l in runs[2].stdout.splitlines() if l.startswith("step ")] == [
        "4/6", "5/6", "6/6"]
    # The same losses at steps 4 to 6, printed alike.
    a_lines = [l.split()[:4] for l in runs[0].stdout.splitlines() if l.startswith("step ")]
    b_lines = [l.split()[:4] for l in runs[2].stdout.splitlines() if l.startswith("step ")]
    assert a_lines[3:] == b_lines
    a, b = load(tmp_path / "A" / "last.pt"), load(tmp_path / "B" / "last.pt")
    assert a["step"] == b["step"] == 6
    assert list(a["model"]) == list(b["model"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    # No temporary file left; the log has every step once, the resumed run appended.
    assert written(tmp_path / "B") == ["hparams.json", "last.pt", "log.csv"]
    with (tmp_path / "B" / "log.csv").open() as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["1", "2", "3", "4", "5", "6"]


def test_the_checkpoint_holds_model_optimizer_step_and_every_rng(simple, tmp_path):
    run = train(simple, "--steps", "2", "--checkpoint", str(tmp_path / "c"))
    assert run.returncode == 0, run.stderr
    state = load(tmp_path / "c" / "last.pt")
    assert sorted(state) == ["model", "monitor", "optimizer", "overrides", "rng", "scaler",
                             "scheduler", "settings", "step"]
    assert state["step"] == 2
    assert sorted(state["rng"]) == ["python", "torch"]  # no CUDA here
    assert sorted(state["optimizer"]) == ["param_groups", "state"]


def test_a_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(simple, tmp_path):
    # lr 1e30 blows the weights up in step 1's update (step 2's loss overflows to
    # inf or becomes nan); --save-every 1 saved step 1.
    folder = tmp_path / "c"
    run = train(simple, "--steps", "5", "--save-every", "1", "--lr", "1e30",
                "--checkpoint", str(folder))
    assert run.returncode == 1
    assert re.fullmatch(rf"step 2: the loss is (nan|inf); stopping \({re.escape(str(folder))}"
                        r"/last\.pt keeps step 1\)\n", run.stderr), run.stderr
    assert "step 2/" not in run.stdout
    state = load(folder / "last.pt")
    assert state["step"] == 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_a_nan_loss_without_a_checkpoint_stops_too(simple):
    run = train(simple, "--steps", "5", "--lr", "1e30")
    assert run.returncode == 1
    assert re.fullmatch(r"step 2: the loss is (nan|inf); stopping\n", run.stderr), run.stderr


def test_resume_without_a_checkpoint_file_names_it(simple, tmp_path):
    run = train(simple, "--steps", "2", "--checkpoint", str(tmp_path / "none"), "--resume")
    assert run.returncode == 1
    assert run.stderr == f"--resume: no checkpoint {tmp_path}/none/last.pt\n"
    assert not (tmp_path / "none").exists()


def test_resume_needs_a_checkpoint_folder(simple):
    run = train(simple, "--resume")
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == (
        "train_simple_model.py: error: --resume needs --checkpoint DIR")


def _file_limit(most: int):
    """In the child: files may not grow past ``most`` bytes (a write past it
    fails with EFBIG instead of killing the process)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (most, most))

    return limit


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(simple, tmp_path):
    folder = tmp_path / "c"
    first = train(simple, "--steps", "2", "--checkpoint", str(folder))
    assert first.returncode == 0, first.stderr
    before = (folder / "last.pt").read_bytes()
    hparams = (folder / "hparams.json").stat().st_size  # the log's, written at the start
    assert hparams < len(before) // 2
    # torch.save fails part way through the file: a real failing write.
    run = train(simple, "--steps", "4", "--checkpoint", str(folder), "--resume",
                preexec_fn=_file_limit(len(before) // 2))
    assert run.returncode == 1
    assert run.stderr == (f"step 4: cannot write {folder}/last.pt ([Errno 27] File too large); "
                          "the previous checkpoint is kept\n")
    assert (folder / "last.pt").read_bytes() == before
    assert load(folder / "last.pt")["step"] == 2
    # No temporary file left.
    assert written(folder) == ["hparams.json", "last.pt", "log.csv"]


def test_ctrl_c_finishes_the_step_saves_and_exits(simple, tmp_path):
    folder = tmp_path / "c"
    process = subprocess.Popen(
        [sys.executable, str(simple), "--steps", "1000000", "--checkpoint", str(folder)],
        cwd=simple.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("torch threads: ")
        assert process.stdout.readline() == "SimpleModel: 430 parameters; 1000000 steps of 5 samples\n"
        first = process.stdout.readline()
        assert first.startswith("step 1/1000000  loss ")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1
    # The summary still comes, with the steps done (step lines after the first
    # may sit in readline()'s buffer, which communicate() does not read).
    step = int(re.search(r"^trained (\d+) steps in ", out, re.MULTILINE).group(1))
    assert step >= 1
    assert err == f"interrupted after step {step}; saved {folder}/last.pt\n"
    assert load(folder / "last.pt")["step"] == step


def test_a_checkpoint_loads_into_a_build_with_another_placement(tmp_path):
    # State-dict keys are the module's attribute paths, whatever the layout:
    # one trained on the CPU loads, strict, into the two-GPU build.
    build_to(EXAMPLES / "seed.yaml", tmp_path / "cpu", {"*": "cpu"})
    build_to(EXAMPLES / "seed.yaml", tmp_path / "two")
    run = train(tmp_path / "cpu" / "train_simple_model.py", "--steps", "2",
                "--checkpoint", "c")
    assert run.returncode == 0, run.stderr
    state = load(tmp_path / "cpu" / "c" / "last.pt")
    placed = import_generated(tmp_path / "two" / "simple_model.py")
    with virtual_devices(cuda=2):
        model = placed.SimpleModel()
        assert model.load_state_dict(state["model"], strict=True).missing_keys == []
        devices = {str(p.device) for p in model.parameters()}
        assert devices == {"cuda:0", "cuda:1"}
        assert all(torch.equal(p.cpu(), state["model"][k])
                   for k, p in model.state_dict().items())


def test_layers_named_like_the_checkpoint_code_keep_their_names(tmp_path):
    # The scaffold claims its names first; the spec's are renamed, never shadowing them.
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: M
        inputs:
          path: [batch, 8]
        layers:
          state: {op: Linear, args: [8, 4]}
          done: {op: ReLU}
          checkpoint: {op: Linear, args: [4, 4]}
        """)
    build_to(spec, tmp_path / "out", {"*": "cpu"})
    script = tmp_path / "out" / "train_m.py"
    text = script.read_text()
    assert "    path = torch.randn((batch_size, 8))  # [batch, 8]" in text  # make_batch's own
    assert "    checkpoint = model(*inputs)" in text  # forward_loss's own
    run = train(script, "--steps", "2", "--checkpoint", "c")
    assert run.returncode == 0, run.stderr
    assert load(tmp_path / "out" / "c" / "last.pt")["step"] == 2


def test_a_model_without_parameters_checkpoints_and_resumes_without_an_optimizer(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: NoParams
        inputs:
          x: [batch, 8]
        layers:
          act: {op: ReLU}
        train:
          loss: MSELoss
        """)
    build_to(spec, tmp_path / "out", {"*": "cpu"})
    script = tmp_path / "out" / "train_no_params.py"
    first = train(script, "--steps", "1", "--checkpoint", "c")
    assert first.returncode == 0, first.stderr
    again = train(script, "--steps", "2", "--checkpoint", "c", "--resume")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[1:3] == ["NoParams: 0 parameters, nothing to train",
                                             "resumed from c/last.pt at step 1"]
    state = load(tmp_path / "out" / "c" / "last.pt")
    assert (state["step"], state["model"], state["optimizer"]) == (2, {}, None)


# Bad arguments: a message, never a traceback ------------------------------------


def usage_error(run: subprocess.CompletedProcess, script: str) -> str:
    """The message of a usage error: one line naming the script, as argparse
    ends its own, exit 2, no traceback."""
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith(f"{script}: error: "), run.stderr
    return run.stderr.removeprefix(f"{script}: error: ").removesuffix("\n")


@pytest.mark.parametrize("args, message", [
    # Each was a traceback (FileExistsError, ZeroDivisionError, TypeError, ValueError...).
    (["--checkpoint", "afile"], "--checkpoint afile: not a folder"),
    (["--log-dir", "afile"], "--log-dir afile: not a folder"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--steps", "-1"], "--steps must be at least 1, got -1"),
    (["--epochs", "-1"], "--epochs must be at least 1, got -1"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--accumulate", "0"], "--accumulate must be at least 1, got 0"),
    (["--log-every", "0"], "--log-every must be at least 1, got 0"),
    (["--samples", "-5"], "--samples must be at least 1, got -5"),
    (["--workers", "-1"], "--workers must be at least 0, got -1"),
    (["--save-every", "-1"], "--save-every must be at least 0, got -1"),
    (["--eval-every", "-1"], "--eval-every must be at least 0, got -1"),
    (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0, got nan"),
    (["--seed", "99999999999999999999999"],
     "--seed must be in [-2**63, 2**64), got 99999999999999999999999"),
    (["--resume"], "--resume needs --checkpoint DIR"),
    (["--eval-split", "1.5"], "--eval-split takes a fraction in [0, 1)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_argument_is_a_usage_error(simple, tmp_path, args, message):
    (tmp_path / "afile").write_text("")
    run = subprocess.run([sys.executable, str(simple), "--steps", "1", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert usage_error(run, "train_simple_model.py") == message
    assert "Traceback" not in run.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, files, message", [
    (["--data", "bad.npz"], {"bad.npz": b"not a zip"},
     "--data: cannot read bad.npz (ValueError: "),
    (["--data", "bad.pt"], {"bad.pt": b"x"}, "--data: cannot read bad.pt (UnpicklingError: "),
    (["--data", "bad.safetensors"], {"bad.safetensors": b"\xff" * 16},
     "--data: cannot read bad.safetensors ("),
    (["--eval-data", "bad.pt", "--eval-every", "1"], {"bad.pt": b"x"},
     "--eval-data: cannot read bad.pt (UnpicklingError: "),
    (["--checkpoint", "afile/sub"], {"afile": b""},
     "cannot write the log ([Errno 20] Not a directory: 'afile/sub')"),
    (["--checkpoint", "c", "--resume"], {"c/last.pt": b"junk"},
     "--resume: cannot resume from c/last.pt ("),
    (["--checkpoint", "c", "--resume"], {"c/last.pt": "a dict"},
     "--resume: cannot resume from c/last.pt (KeyError: 'model')"),
    (["--checkpoint", "c", "--resume"], {"c/last.pt": "another model"},
     "--resume: cannot resume from c/last.pt (RuntimeError: Error(s) in loading state_dict "
     "for SimpleModel: Missing key(s) in state_dict: "),
], ids=["npz", "pt", "safetensors", "eval-data", "log", "resume-junk", "resume-dict",
        "resume-another-model"])
def test_a_file_that_cannot_be_read_is_one_line(simple, tmp_path, args, files, message):
    """A damaged data file or checkpoint, or a log folder that cannot be
    made, stops the run with one line (exit 1, as a missing checkpoint
    does), not a traceback."""
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        if content == "a dict":
            torch.save({"step": 1}, path)
        elif content == "another model":
            torch.save({"model": {"w": torch.zeros(1)}}, path)
        else:
            path.write_bytes(content)
    run = subprocess.run([sys.executable, str(simple), "--steps", "1", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith(message), run.stderr
    assert len(run.stderr) < 400


class _RunsCode:
    """What a hostile file pickles: loading it with plain pickle runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("args, name, message", [
    (["--checkpoint", "c", "--resume"], "c/last.pt",
     "--resume: cannot resume from c/last.pt (UnpicklingError: Weights only load failed"),
    (["--init", "init.pt"], "init.pt",
     "--init init.pt: cannot read it (UnpicklingError: Weights only load failed"),
    (["--data", "data.pt"], "data.pt",
     "--data: cannot read data.pt (UnpicklingError: Weights only load failed"),
], ids=["resume", "init", "data"])
def test_a_file_that_would_run_code_is_refused_in_one_line(simple, tmp_path, args, name, message):
    marker = tmp_path / "ran"
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    torch.save({"model": _RunsCode(marker), "step": 1}, path)
    run = subprocess.run([sys.executable, str(simple), "--steps", "1", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith(message), run.stderr
    assert not marker.exists()
