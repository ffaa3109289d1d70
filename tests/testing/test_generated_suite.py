"""The generated test files are short manifests over mpgen.testing.ModelSuite,
and they fail -- never skip -- where mpgen.testing cannot be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from helpers import EXAMPLES, ROOT, build_to


def test_the_seed_examples_test_file_is_a_short_manifest(tmp_path):
    build_to(EXAMPLES / "seed.yaml", tmp_path)
    text = (tmp_path / "test_simple_model.py").read_text()
    assert len(text.splitlines()) < 70
    tree = ast.parse(text)
    (suite,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert suite.name == "TestSimpleModel"
    assert [ast.unparse(b) for b in suite.bases] == ["ModelSuite"]
    facts = {t.id for n in suite.body if isinstance(n, ast.Assign) for t in n.targets}
    assert facts == {
        "model", "devices", "placement", "total_params", "output_shapes", "transfers",
        "memory_batch", "memory_plan", "training",
    }
    methods = [n.name for n in suite.body if isinstance(n, ast.FunctionDef)]
    assert methods == ["make_inputs", "make_optimizer"]
    docstring = ast.get_docstring(tree)
    assert "pytest test_simple_model.py" in docstring
    assert "pip install mpgen" in docstring


def test_every_committed_test_file_states_facts_and_leaves_checks_to_mpgen_testing():
    files = sorted((ROOT / "generated").glob("test_*.py"))
    assert len(files) == len(list(EXAMPLES.glob("*.yaml")))
    for path in files:
        tree = ast.parse(path.read_text())
        tests = [n.name for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
        assert tests == [], f"{path.name} defines its own checks: {tests}"
        assert "from mpgen.testing import ModelSuite" in path.read_text(), path.name


# Makes every import of mpgen fail, as if it were not installed, however it
# is installed here (editable, a .pth file, PYTHONPATH).
NO_MPGEN = textwrap.dedent("""
    import sys

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name == "mpgen" or name.startswith("mpgen."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    import pytest

    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "test_simple_model.py"]))
""")


@pytest.mark.slow
def test_without_mpgen_the_generated_suite_fails_and_says_how_to_install_it(tmp_path):
    build_to(EXAMPLES / "seed.yaml", tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", NO_MPGEN], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode not in (0, 5), output  # 5: nothing collected
    assert "these tests need mpgen.testing: install mpgen (pip install mpgen" in output
    assert "No module named 'mpgen'" in output
    assert "skipped" not in output and "passed" not in output
