"""``mpgen test`` (issue 29): the generated tests run as the project cannot
change, in a tree a hostile pull request wrote (NOTE [A test step a pull
request cannot subvert] in mpgen/commands/test.py)."""

from __future__ import annotations

import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import EXAMPLES, ROOT, mpgen

#: Slow: each run starts pytest, and torch, in a child interpreter.
pytestmark = pytest.mark.slow

MPGEN = str(Path(sys.executable).with_name("mpgen"))

HOSTILE = {
    # `python -m pytest` runs this instead of pytest: exit 0, no test ran.
    "pytest.py": "import sys\nprint('FAKE PYTEST')\nsys.exit(0)\n",
    # ... and this instead of torch.
    "torch/__init__.py": "raise SystemExit('FAKE TORCH')\n",
    # Every test deselected, then skipped.
    "pyproject.toml": '[tool.mpgen]\nspecs = ["seed.yaml"]\nout = "out"\n\n'
                      '[tool.pytest.ini_options]\naddopts = "-k nothing_matches"\n',
    "pytest.ini": "[pytest]\naddopts = -k nothing_matches\n",
    "conftest.py": "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
                   "    for item in items:\n"
                   "        item.add_marker(pytest.mark.skip(reason='hostile'))\n",
}


def hostile_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTEST_ADDOPTS"] = "--collect-only"
    env["PYTEST_PLUGINS"] = "hostile_plugin"
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The seed example built on the CPU into out/ of a git repository."""
    root = tmp_path_factory.mktemp("built")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    shutil.copy(EXAMPLES / "seed.yaml", root / "seed.yaml")
    ran = mpgen("build", "seed.yaml", "-o", "out", "--device-map", "cpu", cwd=root)
    assert ran.returncode == 0, ran.stderr
    return root


@pytest.fixture
def project(built, tmp_path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(built, root, symlinks=True)
    return root


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def mpgen_test(root: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([MPGEN, "test", *args], cwd=root, capture_output=True, text=True,
                          timeout=300, env=env)


def test_runs_the_real_tests_in_a_hostile_tree(project):
    write(project, HOSTILE)
    # The step docs/ci.md recommended: the pull request's pytest.py runs, exit 0.
    naive = subprocess.run([sys.executable, "-m", "pytest", "-q", "out"], cwd=project,
                           capture_output=True, text=True, timeout=300, env=hostile_env())
    assert (naive.returncode, naive.stdout.strip()) == (0, "FAKE PYTEST")
    # The step docs/ci.md's workflow runs now (mpgen test: the out of [tool.mpgen]),
    # as the runner runs it: the real pytest and torch, every test run.
    step = yaml.safe_load((ROOT / "docs" / "examples" / "mpgen.yml").read_text())
    script = next(s["run"] for s in step["jobs"]["mpgen"]["steps"]
                  if s.get("name") == "Generated tests pass")
    assert script.startswith("mpgen test ")
    env = {**hostile_env(), "PATH": f"{Path(MPGEN).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                         cwd=project, capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "FAKE" not in ran.stdout + ran.stderr
    assert "10 passed, 2 skipped" in ran.stdout  # the skip: real GPUs this machine lacks
    assert ran.stderr == ""
    assert not (project / "out" / "__pycache__").exists()  # nothing written into out
    assert not (project / ".pytest_cache").exists()


def test_a_broken_generated_test_fails(project):
    test_file = project / "out" / "test_simple_model.py"
    text = test_file.read_text()
    assert "total_params = 430\n" in text
    test_file.write_text(text.replace("total_params = 430\n", "total_params = 431\n"))
    ran = mpgen_test(project, "out", "--", "-q")
    assert ran.returncode == 1
    assert "2 failed, 8 passed, 2 skipped" in ran.stdout  # on the CPU and on virtual devices


def test_no_test_run_is_a_failure(project):
    deselected = mpgen_test(project, "out", "--", "-q", "-k", "nothing_matches")
    assert deselected.returncode == 1
    assert deselected.stderr.splitlines()[-1] == (
        "mpgen test: no test ran (pytest: no tests collected); failing")
    some = mpgen_test(project, "out", "--", "-q", "-k", "parameters")
    assert some.returncode == 1
    assert some.stderr.splitlines()[-1].startswith("mpgen test: 10 generated tests were "
                                                   "deselected; mpgen test runs every one")
    collected = mpgen_test(project, "out", "--", "-q", "--collect-only")
    assert collected.returncode == 1
    assert collected.stderr.splitlines()[-1] == (
        "mpgen test: no test ran from test_simple_model.py; every generated test file has "
        "tests: failing")


def test_a_test_file_without_tests_fails(project):
    test_file = project / "out" / "test_simple_model.py"
    text = test_file.read_text()
    assert "class TestSimpleModel(" in text
    test_file.write_text(text.replace("class TestSimpleModel(", "class SimpleModelSuite("))
    ran = mpgen_test(project, "out", "--", "-q")
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[-1] == (
        "mpgen test: no test ran (pytest: no tests collected); failing")


@pytest.mark.parametrize("stranger", ["conftest.py", "torch/__init__.py", "json.py"])
def test_python_that_mpgen_did_not_generate_in_out_is_refused(project, stranger):
    write(project / "out", {stranger: "import os\nos._exit(0)\n"})
    ran = mpgen_test(project, "out")
    assert ran.returncode == 2
    assert ran.stdout == ""
    name = stranger.partition("/")[0]
    assert len(ran.stderr.splitlines()) == 1
    assert ran.stderr.startswith(f"out/{name}: ")
    assert "(mpgen check reports it)" in ran.stderr


def test_a_link_in_out_is_refused(project):
    out = project / "out"
    (out / "simple_model.py").rename(project / "elsewhere.py")
    (out / "simple_model.py").symlink_to(project / "elsewhere.py")
    ran = mpgen_test(project, "out")
    assert (ran.returncode, ran.stdout) == (2, "")
    assert ran.stderr == ("out/simple_model.py: a symbolic link, which mpgen never generates; "
                          "remove it (mpgen check reports it)\n")


def test_a_forged_bytecode_cache_in_out_is_never_read(project):
    # A test module with no tests, compiled under the real one's cache name,
    # hash-based and unchecked: plain Python would load it without a look at
    # the source.
    decoy = project / "decoy.py"
    decoy.write_text("print('FORGED')\n")
    for tag in ("cpython-311", f"cpython-311-pytest-{pytest.__version__}"):
        py_compile.compile(str(decoy), cfile=str(project / "out" / "__pycache__" /
                                                 f"test_simple_model.{tag}.pyc"),
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    ran = mpgen_test(project, "out", "--", "-q")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "FORGED" not in ran.stdout
    assert "10 passed, 2 skipped" in ran.stdout


def test_a_missing_folder_or_one_without_tests_is_one_line(project):
    (project / "empty").mkdir()
    for folder, why in (("nowhere", "no such folder"), ("empty", "no generated tests")):
        ran = mpgen_test(project, folder)
        assert ran.returncode == 2
        assert ran.stderr.startswith(f"{folder}: {why}")
        assert len(ran.stderr.splitlines()) == 1


def test_the_origins_of_pytest_torch_and_mpgen_testing_are_checked():
    import torch

    import mpgen
    from mpgen.commands.test import _origins

    package = str(Path(mpgen.__file__).resolve().parent)
    assert _origins(package, "/nonexistent", {}) is None
    # A folder of the project that holds torch (as a vetted module's folder would).
    torch_folder = str(Path(torch.__file__).resolve().parent)
    problem = _origins(package, "/nonexistent", {"torch": torch_folder})
    assert problem.startswith(f"torch comes from {Path(torch.__file__).resolve()}, not from "
                              "this interpreter's libraries")
    # mpgen.testing of another mpgen.
    problem = _origins("/elsewhere/mpgen", "/nonexistent", {})
    assert problem.startswith("mpgen.testing comes from ")
    assert problem.endswith("not from this mpgen (/elsewhere/mpgen)")


def test_pytests_arguments_go_after_the_double_dash(project):
    ran = mpgen("test", "out", "-k", "parameters", cwd=project)
    assert ran.returncode == 2
    assert ran.stderr.splitlines()[-1] == (
        "mpgen: error: unrecognized arguments: -k parameters (pytest's arguments go after "
        "'--': mpgen test -- -k parameters)")


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (absent, or a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_tests_that_run_past_the_timeout_are_stopped_with_every_process(project):
    marker = project / "grandchild.pid"
    model = project / "out" / "simple_model.py"
    text = model.read_text()
    model.write_text(text.replace(
        "import torch\n",
        "import subprocess, time\n"
        f"_p = subprocess.Popen(['sleep', '600'])\nopen({str(marker)!r}, 'w').write(str(_p.pid))\n"
        "while True:\n    pass\nimport torch\n", 1))
    # Past pytest's start and the module's import (the marker), on a loaded machine too.
    ran = mpgen_test(project, "out", "--timeout", "60")
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[-1] == (
        "mpgen test: out: the tests ran past --timeout 60 s; stopped them, failing")
    assert gone(int(marker.read_text()))


def test_tests_that_wait_without_using_the_cpu_are_stopped(project):
    marker = project / "grandchild.pid"
    model = project / "out" / "simple_model.py"
    model.write_text(model.read_text().replace(
        "import torch\n",
        "import subprocess, time\n"
        f"_p = subprocess.Popen(['sleep', '600'])\nopen({str(marker)!r}, 'w').write(str(_p.pid))\n"
        "time.sleep(600)\nimport torch\n", 1))
    ran = mpgen_test(project, "out")  # the default --timeout is an hour
    assert ran.returncode == 1
    assert ran.stderr.splitlines()[-1] == (
        "mpgen test: out: the tests used no CPU for 15 s (a test that sleeps or waits); "
        "stopped them, failing")
    assert gone(int(marker.read_text()))
