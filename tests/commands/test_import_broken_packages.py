"""``mpgen import`` of a model whose package, or a package it imports, fails
at import: one line naming that package and its version, its error's last
line and the likely fix, exit 2, no traceback (docs/import.md, "When a
package is broken").

The packages are real folders on ``sys.path`` (``PYTHONPATH`` for a fresh
interpreter) outside the project, whose module bodies raise as broken
installs do.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import mpgen, mpgen_process

MODEL = '''
import torch.nn as nn

{imports}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)
'''

#: A torch extension loaded beside a torch it was not built for: its module
#: body registers a kernel for an operator its C++ library would have made.
OPS_FOR_ANOTHER_TORCH = '''
import torch


@torch.library.register_fake("{name}::nms")
def _nms(dets, scores, iou_threshold):
    return dets
'''


def package(site: Path, name: str, body: str, version: str | None = None) -> None:
    """``site/name/__init__.py`` (and its dist-info, with ``version``)."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(textwrap.dedent(body), encoding="utf-8")
    if version:
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: "
                                       f"{version}\n", encoding="utf-8")


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder of installed packages, first on ``sys.path``; the project (the
    working directory) is beside it."""
    (tmp_path / "site").mkdir()
    (tmp_path / "project").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path / "site"


#: case -> (zoo's import line, zoo's version, what the line says after "zoo:Net:
#: cannot import 'zoo': "); visionops is a dependency built for another torch.
CASES = {
    "built for another torch": (
        "import visionops", "3.0",
        "the package visionops 1.2.0 fails to import: RuntimeError: operator visionops::nms "
        "does not exist; visionops 1.2.0 was built for another torch than "
        f"{torch.__version__}: install the visionops built for this torch"),
    "a dependency not installed": (
        "import einops_not_installed", None,
        "the package zoo fails to import: ModuleNotFoundError: No module named "
        "'einops_not_installed'; install einops_not_installed, which zoo imports"),
    "any other failure": (
        "raise ValueError('zoo: bad default dtype')", "3.0",
        "the package zoo 3.0 fails to import: ValueError: zoo: bad default dtype; reinstall "
        "zoo, or install the versions it needs (`pip check` lists conflicts)"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_package_that_fails_its_error_and_the_fix(case, site):
    imports, version, said = CASES[case]
    package(site, "visionops", OPS_FOR_ANOTHER_TORCH.format(name="visionops"), "1.2.0")
    package(site, "zoo", MODEL.format(imports=imports), version)
    ran = mpgen("import", "zoo:Net", "--input", "x=batch,4", cwd=site.parent / "project")
    assert (ran.returncode, ran.stdout) == (2, "")
    assert ran.stderr == f"zoo:Net: cannot import 'zoo': {said}\n"


def test_the_projects_own_module_shows_its_error_as_it_is(tmp_path):
    (tmp_path / "mine.py").write_text(MODEL.format(imports="raise ValueError('not yet')"))
    ran = mpgen("import", "mine:Net", "--input", "x=batch,4", cwd=tmp_path)
    assert ran.returncode == 2
    assert ran.stderr == "mine:Net: cannot import 'mine': ValueError: not yet\n"


@pytest.mark.slow
def test_transformers_beside_a_torchvision_built_for_another_torch(tmp_path):
    """transformers imports torchvision; a torchvision that fails as one built
    for another torch fails does (first on ``PYTHONPATH``, the installed
    one's metadata beside it) is named, where transformers says only that
    the class could not be imported. A fresh interpreter: this one may have
    imported the installed torchvision already."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    site, project = tmp_path / "site", tmp_path / "project"
    site.mkdir()
    project.mkdir()
    package(site, "torchvision", OPS_FOR_ANOTHER_TORCH.format(name="torchvision"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    config = {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    ran = mpgen_process("import", "transformers:GPT2LMHeadModel", "--config",
                        json.dumps(config), "--input", "input_ids=batch,16:int64",
                        cwd=project, env=env,
                        command=[str(Path(sys.executable).with_name("mpgen"))])
    assert (ran.returncode, ran.stdout) == (2, "")
    assert "Traceback" not in ran.stderr and ran.stderr.count("\n") == 1, ran.stderr
    assert ran.stderr.startswith(
        "transformers:GPT2LMHeadModel: cannot import 'GPT2LMHeadModel' from transformers: "
        "the package torchvision "), ran.stderr
    assert ("fails to import: RuntimeError: operator torchvision::nms does not exist; "
            "torchvision ") in ran.stderr
    assert (f"was built for another torch than {torch.__version__}: install the torchvision "
            "built for this torch (0.") in ran.stderr
