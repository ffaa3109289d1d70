"""User modules found next to the spec (issue 9, failure 4).

mpgen imports ``op: mylayers.gates.Gate`` from the spec's folder (or the
working directory) at build time; the generated code imports it too, but
from the output folder it is not on the path. The generated files stay
free of any folder (the same bytes wherever they are built), so
``mpgen build`` says, at the layer that uses it, exactly what to put on
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import mpgen, write_spec

#: Slow: builds that import a user module in a child interpreter, and the generated code run.
pytestmark = pytest.mark.slow

GATE = """\
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.sigmoid(self.proj(x)) * x
"""

SPEC = """
    mpgen: 1
    name: Gated
    inputs:
      x: [batch, 8]
    layers:
      gate: {op: mylayers.gates.Gate, args: [8]}
      out: {op: Linear, args: [8, 2]}
    train:
      loss: MSELoss
      optimizer: {op: SGD, lr: 0.01}
      steps: 1
"""


def make_project(root):
    specs = root / "specs"
    (specs / "mylayers").mkdir(parents=True)
    (specs / "mylayers" / "__init__.py").write_text("")
    (specs / "mylayers" / "gates.py").write_text(GATE)
    return write_spec(specs, SPEC, "gated.yaml")


def run_script(script, cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, script, "--steps", "1"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_build_says_what_to_put_on_the_path_and_that_works(tmp_path):
    make_project(tmp_path)
    built = mpgen("build", "specs/gated.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    specs = tmp_path.resolve() / "specs"
    assert built.stderr == (
        f"specs/gated.yaml:6:3: note: the generated code imports 'mylayers' (op "
        f"'mylayers.gates.Gate'), which mpgen found in {specs} at build time; it is not "
        f"importable from out, so run the generated code and tests with "
        f"PYTHONPATH={specs} (e.g. PYTHONPATH={specs} python out/train_gated.py, "
        f"PYTHONPATH={specs} pytest out/test_gated.py)\n")
    # No folder of this machine in what is generated.
    for path in (tmp_path / "out").rglob("*.*"):  # the runtime folder's files too
        assert str(tmp_path) not in path.read_text(), path.name
    # From the output folder: not importable without the path, then it runs.
    alone = run_script("train_gated.py", tmp_path / "out")
    assert alone.returncode == 1
    assert "ModuleNotFoundError: No module named 'mylayers'" in alone.stderr
    told = run_script("train_gated.py", tmp_path / "out", str(specs))
    assert told.returncode == 0, told.stderr
    assert "step 1/1  loss" in told.stdout


def test_no_note_where_the_generated_code_finds_the_module(tmp_path, monkeypatch):
    make_project(tmp_path)
    # Built into the folder that holds the package: python puts it on the path.
    # (The spec and the package are files no spec owns there: build notes
    # them, as check would report them; no note says what to put on the path.)
    built = mpgen("build", "gated.yaml", "-o", ".", cwd=tmp_path / "specs")
    assert built.returncode == 0, built.stderr
    assert "PYTHONPATH" not in built.stderr
    assert all("no spec built owns it: left in place" in line
               for line in built.stderr.splitlines())
    # The package is on every interpreter's path (installed, or PYTHONPATH).
    monkeypatch.syspath_prepend(str(tmp_path / "specs"))
    built = mpgen("build", "specs/gated.yaml", "-o", "out", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert built.stderr == ""
