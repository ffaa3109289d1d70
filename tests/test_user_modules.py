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
import py_compile
import subprocess
import sys
from pathlib import Path

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


# -- issue 29: the vetted module is the one that runs ----------------------------------


def mpgen_test(root, *args):
    """``mpgen test`` as CI runs it: the console script, in a fresh process."""
    command = [str(Path(sys.executable).with_name("mpgen")), "test", *args]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)


def forge_cache(module, **options):
    """A bytecode cache of ``module`` where Python looks for one, compiled
    from other code (printing FORGED) and stamped with ``module``'s own
    modification time and size, so that Python would load it."""
    decoy = module.parent / "decoy_source.py"
    decoy.write_text("print('FORGED')\n" + "#" * (len(module.read_bytes()) - 17) + "\n")
    assert decoy.stat().st_size == module.stat().st_size
    stamp = module.stat().st_mtime_ns
    os.utime(decoy, ns=(stamp, stamp))
    cache = module.parent / "__pycache__" / f"{module.stem}.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(decoy), cfile=str(cache), **options)
    decoy.unlink()
    return cache


def git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_mpgen_test_imports_the_vetted_module_from_its_source(tmp_path):
    git(tmp_path, "init", "-q")
    make_project(tmp_path)
    built = mpgen("build", "specs/gated.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    # Found without PYTHONPATH (mpgen test serves the module the spec names) ...
    ran = mpgen_test(tmp_path, "out", "--", "-q")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "10 passed, 2 skipped" in ran.stdout
    # ... from the source, never a cache, even one Python's own import would load.
    gates = tmp_path / "specs" / "mylayers" / "gates.py"
    forge_cache(gates)
    ran = mpgen_test(tmp_path, "out", "--", "-q")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "FORGED" not in ran.stdout
    # No other module of the project is importable, and code that ends the
    # interpreter before pytest reports does not pass the step.
    (gates.parent / "__pycache__").rename(tmp_path / "caches")
    gates.write_text("import os\nos._exit(0)\n" + GATE)
    ran = mpgen_test(tmp_path, "out", "--", "-q")
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[-1] == (
        "mpgen test: out: the test run ended without its verdict (code it ran ended the "
        "interpreter); failing")


def test_a_committed_cache_of_a_user_module_is_refused(tmp_path):
    git(tmp_path, "init", "-q")
    spec = make_project(tmp_path)
    gates = tmp_path / "specs" / "mylayers" / "gates.py"
    cache = forge_cache(gates)
    # Python's own cache, outside the repository: every run of the generated code writes one.
    built = mpgen("build", "specs/gated.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    git(tmp_path, "add", "-f", str(cache))
    shown = f"mylayers/__pycache__/{cache.name}"
    for ran in (mpgen("check", "specs/gated.yaml", "-o", "out", "--device-map", "cpu",
                      cwd=tmp_path),
                mpgen_test(tmp_path, "out")):
        assert ran.returncode == 2, ran.stderr
        assert ran.stdout == ""
        assert len(ran.stderr.splitlines()) == 1
        assert (f"{shown} is committed to the repository, which Python "
                "would run instead of mylayers/gates.py, the source mpgen checked; remove it "
                "(git rm --cached), and keep __pycache__/ out of the repository (.gitignore)"
                ) in ran.stderr
    assert mpgen("check", "specs/gated.yaml", "-o", "out", "--device-map", "cpu",
                 cwd=tmp_path).stderr.startswith(f"{spec.relative_to(tmp_path)}:6:14: ")


def test_a_hash_based_cache_of_a_user_module_is_refused_outside_git(tmp_path):
    make_project(tmp_path)
    gates = tmp_path / "specs" / "mylayers" / "gates.py"
    forge_cache(gates, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    built = mpgen("build", "specs/gated.yaml", "-o", "out", cwd=tmp_path)
    assert built.returncode == 2
    assert "is a hash-based bytecode cache (Python writes none of its own)" in built.stderr
    assert not (tmp_path / "out").exists()


def test_a_namesake_of_a_user_module_elsewhere_in_the_project_is_refused(tmp_path):
    git(tmp_path, "init", "-q")
    make_project(tmp_path)
    # At the root, first on the path of `python -m pytest` run there.
    (tmp_path / "mylayers").mkdir()
    (tmp_path / "mylayers" / "__init__.py").write_text("import os\nos._exit(0)\n")
    built = mpgen("build", "specs/gated.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 2
    assert built.stderr == (
        f"specs/gated.yaml:6:14: layer 'gate': 'mylayers.gates.Gate': there are two modules "
        f"named 'mylayers' in the project, in {tmp_path.resolve() / 'specs'} and in "
        f"{tmp_path.resolve()}; the generated code imports whichever comes first on its path, "
        "not necessarily the one mpgen checked: rename or remove one\n")
