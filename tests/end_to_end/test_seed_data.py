"""The main command's data (examples/data/smoothing.py) and the run that
scripts/run-seed.sh makes on it: the seed example learns to smooth signals,
so its loss falls, on held-out signals too."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np

import pytest

from helpers import ROOT, build_to

#: Slow: the data script and a training run, in subprocesses.
pytestmark = pytest.mark.slow



def test_the_targets_are_the_signals_3_point_moving_averages(tmp_path):
    out = tmp_path / "s.npz"
    subprocess.run([sys.executable, str(ROOT / "examples" / "data" / "smoothing.py"), str(out),
                    "--samples", "64", "--seed", "3"], check=True, capture_output=True)
    with np.load(out) as data:
        x, target = data["x"], data["target"]
    assert x.shape == target.shape == (64, 10) and x.dtype == np.float32
    assert np.allclose(target[:, 4], (x[:, 3] + x[:, 4] + x[:, 5]) / 3, atol=1e-6)
    assert np.allclose(target[:, 0], (x[:, 9] + x[:, 0] + x[:, 1]) / 3, atol=1e-6)  # wraps
    assert x.std() > 0.5  # signals, not noise around 0


def test_the_seed_example_learns_it_and_the_held_out_loss_falls(tmp_path):
    build_to(ROOT / "examples" / "seed.yaml", tmp_path, {"*": "cpu"})
    subprocess.run([sys.executable, str(ROOT / "examples" / "data" / "smoothing.py"),
                    str(tmp_path / "s.npz"), "--samples", "1024"], check=True,
                   capture_output=True)
    run = subprocess.run(
        [sys.executable, "train_simple_model.py", "--data", "s.npz", "--steps", "200",
         "--batch-size", "32", "--lr", "0.1", "--eval-split", "0.1", "--eval-every", "100",
         "--log-every", "50"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    losses = [float(m) for m in re.findall(r"^step \d+/200  loss (\S+)", run.stdout, re.M)]
    evals = [float(m) for m in re.findall(r"^eval at step \d+: loss (\S+)", run.stdout, re.M)]
    first = float(re.search(r"loss (\S+) -> ", run.stdout).group(1))
    assert len(losses) == 4 and len(evals) == 2
    assert losses[-1] < first / 20
    assert evals[-1] < evals[0] and evals[-1] < first / 20
