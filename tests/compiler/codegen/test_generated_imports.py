"""What the generated files import, against the list of module names no
model may generate (``mpgen.templates``: IMPORTS and LOADED; a generated
``safetensors.py`` beside ``train_safetensors.py`` would be imported in
place of the real one). The list is read from the templates, every
generated file of the examples and what importing them loads, so that it
cannot drift from the code."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from mpgen import templates
from mpgen.compiler.frontend.namespace import module_stems

TEMPLATES = Path(templates.__file__).parent
GENERATED = ROOT / "generated"
STDLIB = frozenset(sys.stdlib_module_names)
#: An import statement of a template, at any indentation (one that names a
#: module from the spec, ``{{ module }}``, is the model's or the user's).
IMPORT_LINE = re.compile(r"^\s*(?:import\s+([A-Za-z_][\w.]*)(?: as \w+)?$"
                         r"|from\s+([A-Za-z_][\w.]*)\s+import\s)", re.M)


def top_level_imports(tree: ast.Module) -> set[str]:
    """The top-level module of every absolute import anywhere in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("template", sorted(TEMPLATES.glob("*.py.jinja")), ids=lambda p: p.name)
def test_every_import_of_a_template_is_listed(template):
    named = {(a or b).split(".")[0] for a, b in IMPORT_LINE.findall(template.read_text())}
    assert named, "no import found: the pattern is stale"
    assert named - STDLIB - templates.IMPORTS == set()


def test_every_import_of_the_generated_examples_is_listed():
    files = sorted(GENERATED.glob("*.py"))
    own = {stem for path in files for stem in module_stems(path.stem)} | {p.stem for p in files}
    assert files
    for path in files:
        imported = top_level_imports(ast.parse(path.read_text(encoding="utf-8")))
        assert imported - STDLIB - own - templates.IMPORTS == set(), path.name


@pytest.mark.slow
def test_importing_what_the_generated_files_import_loads_only_listed_modules():
    """Every public top-level module loaded by the generated files' imports
    (TensorBoard's and the lazily imported ones included) is refused as a
    model's module name."""
    code = (
        "import sys, tempfile\n"
        "import torch, torch.nn.functional, torch.utils.checkpoint, torch.distributed\n"
        "import torch.distributed.pipelining, torch.utils.data, numpy, safetensors.torch\n"
        "import pytest, mpgen.testing\n"
        "from tqdm import tqdm\n"
        "try:\n"
        "    from torch.utils.tensorboard import SummaryWriter\n"
        "    SummaryWriter(tempfile.mkdtemp()).close()\n"
        "except ImportError:\n"
        "    pass\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    loaded = {m for m in ran.stdout.split() if not m.startswith("_")}
    assert loaded - STDLIB - templates.IMPORTS - templates.LOADED == set()

