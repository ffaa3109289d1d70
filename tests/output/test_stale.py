"""`mpgen check` catches everything stale, and nothing that is not.

The header records the digest of the spec's meaning (an edit of comments or
layout leaves every generated file current); a renamed model's or a deleted
spec's files are orphans that `check` lists and `build` (`--prune` for a
deleted spec's) removes; files mpgen did not write are never touched.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, files_in, mpgen, runtime_files
from test_manifest import git  # a git command in a test repository
from mpgen.spec_schema.digest import canonical, file_digest, spec_digest
from mpgen.spec_schema.load import load_text
from mpgen.spec_schema.validate import validate

SEED = EXAMPLES / "seed.yaml"


def files_of(stem: str) -> list[str]:
    return sorted([f"{stem}.py", f"train_{stem}.py", f"test_{stem}.py", f"pp_{stem}.py",
                   f"predict_{stem}.py", f"{stem}.placement.md"])


def digest(text: str) -> str:
    return spec_digest(validate(load_text(textwrap.dedent(text).lstrip(), "spec.yaml")))


def project(tmp_path: Path) -> Path:
    """A project with two specs and ``[tool.mpgen]``, built."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.mpgen]\nspecs = ["specs/*.yaml"]\nout = "out"\n')
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "seed.yaml").write_text(SEED.read_text())
    (tmp_path / "specs" / "other.yaml").write_text(
        SEED.read_text().replace("name: SimpleModel", "name: Other"))
    built = mpgen("build", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    return tmp_path


# -- the digest: meaning, not bytes ------------------------------------------------

BLOCK = """\
    mpgen: 1
    name: SimpleModel
    inputs:
      x: [batch, 10]
    layers:
      layer1: {op: Linear, args: [10, 20]}
      layer2: {op: Linear, args: [20, 10], bias: true}
    outputs: [layer2]
    placement:
      layer1: cuda:0
      layer2: cuda:1
    train:
      loss: MSELoss
      optimizer: {op: SGD, lr: 0.01}
      batch_size: 5
"""

# The same spec: comments, quoting, flow/block style, the order of a model's
# own keys, short forms, a number's spelling, a default written out.
SAME = """\
    # the seed, reformatted
    name: 'SimpleModel'   # quoted
    mpgen: 1
    layers:
      layer1:
        args:
          - 10
          - 20
        op: "Linear"
      layer2: {bias: yes, args: [20, 10], op: Linear}
    inputs: {x: {shape: [batch, 10], dtype: float32}}
    outputs: layer2
    train:
      batch_size: 5
      optimizer: {lr: 1.0e-2, op: SGD}
      loss: {op: MSELoss}
    placement: {layer1: "cuda:0", layer2: cuda:1}
"""


def test_a_spec_s_layout_does_not_change_its_digest():
    assert digest(SAME) == digest(BLOCK)
    assert digest(BLOCK).startswith("sha256:") and len(digest(BLOCK)) == 7 + 64


@pytest.mark.parametrize("old, new", [
    ("lr: 0.01", "lr: 0.02"),                              # a value
    ("args: [20, 10], bias: true", "args: [20, 10], bias: 1"),  # true is not 1
    ("lr: 0.01", "lr: 1"),                                 # an int is not a float
    ("args: [10, 20]}", "args: [10, 20], bias: false}"),   # a keyword argument added
    ("layer2: cuda:1", "layer2: cuda:0"),                  # placement
    ("name: SimpleModel", "name: Simple"),
], ids=["value", "bool-int", "int-float", "kwarg", "device", "name"])
def test_every_change_of_meaning_changes_the_digest(old, new):
    assert old in BLOCK
    assert digest(BLOCK.replace(old, new)) != digest(BLOCK)


def test_the_order_of_layers_and_keyword_arguments_is_meaning():
    """Layers run in spec order and keyword arguments are written in spec
    order: those mappings are not sorted."""
    swapped = BLOCK.replace(
        "  layer1: {op: Linear, args: [10, 20]}\n      layer2: {op: Linear, args: [20, 10], "
        "bias: true}\n",
        "  layer2: {op: Linear, args: [20, 10], bias: true}\n      layer1: {op: Linear, "
        "args: [10, 20]}\n")
    assert swapped != BLOCK
    assert digest(swapped) != digest(BLOCK)
    kwargs = BLOCK.replace("bias: true}", "bias: true, dtype: float32}")
    reordered = BLOCK.replace("bias: true}", "dtype: float32, bias: true}")
    assert digest(kwargs) != digest(reordered)


def test_infinity_and_null_differ():
    """pydantic's JSON mode writes inf as null; the digest keeps them apart."""
    infinite = BLOCK.replace("bias: true", "bias: true, eps: .inf")
    assert digest(infinite) != digest(BLOCK.replace("bias: true", "bias: true, eps: null"))
    spec = validate(load_text(textwrap.dedent(infinite), "spec.yaml"))
    assert b'"eps":Infinity' in canonical(spec)


def test_the_digest_needs_neither_torch_nor_the_compiler():
    code = ("import sys; from mpgen.spec_schema.digest import file_digest; "
            f"print(file_digest({str(SEED)!r})); "
            "print(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith('mpgen.compiler')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [file_digest(SEED), "[]"]


# -- check: a layout edit is current, a meaning edit is not ----------------------

def test_a_comment_or_layout_edit_keeps_check_green(tmp_path):
    root = project(tmp_path)
    spec = root / "specs" / "seed.yaml"
    spec.write_text("# reviewed\n" + spec.read_text().replace(
        "layer1: {op: Linear, args: [10, 20]}",
        "layer1:  # the first layer\n    op: Linear\n    args:\n      - 10\n      - 20"))
    check = mpgen("check", cwd=root)
    assert (check.returncode, check.stdout) == (0, "out: up to date\n"), check.stderr
    build = mpgen("build", cwd=root)
    assert build.stdout.splitlines()[0] == "out: up to date"


def test_a_meaning_edit_makes_check_fail_on_the_digest_too(tmp_path):
    root = project(tmp_path)
    spec = root / "specs" / "seed.yaml"
    before = file_digest(spec)
    spec.write_text(spec.read_text().replace("lr: 0.01", "lr: 0.02"))
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert f"-# spec digest: {before}" in check.stdout.splitlines()
    assert f"+# spec digest: {file_digest(spec)}" in check.stdout.splitlines()
    assert check.stderr.endswith("run: mpgen build\n")
    assert mpgen("build", cwd=root).returncode == 0
    assert mpgen("check", cwd=root).returncode == 0


# -- orphans -------------------------------------------------------------------

def test_a_renamed_model_s_files_are_listed_and_removed_by_build(tmp_path):
    root = project(tmp_path)
    spec = root / "specs" / "seed.yaml"
    spec.write_text(spec.read_text().replace("name: SimpleModel", "name: Renamed"))
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert [line for line in check.stdout.splitlines() if "no longer" in line] == [
        f"out/{name}: generated from specs/seed.yaml, which no longer generates it; build "
        "would remove it" for name in files_of("simple_model")]
    assert check.stderr.endswith("run: mpgen build\n")  # no --prune needed
    build = mpgen("build", cwd=root)
    assert [line for line in build.stdout.splitlines() if line.startswith("removed")] == [
        f"removed out/{name}" for name in files_of("simple_model")]
    assert files_in(root / "out") == sorted(files_of("renamed") + files_of("other")
                                            + runtime_files())
    assert mpgen("check", cwd=root).returncode == 0


def test_a_deleted_spec_s_files_take_prune(tmp_path):
    root = project(tmp_path)
    (root / "specs" / "other.yaml").unlink()
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout.splitlines() == [
        f"out/{name}: generated from specs/other.yaml, which no longer exists; build --prune "
        "would remove it" for name in files_of("other")]
    assert check.stderr.endswith("run: mpgen build --prune\n")
    build = mpgen("build", cwd=root)
    assert build.returncode == 0
    assert "up to date" not in build.stdout
    assert build.stderr.splitlines() == [
        f"out/{name}: note: generated from specs/other.yaml, which no longer exists; left in "
        "place (mpgen build --prune removes it)" for name in files_of("other")]
    assert mpgen("check", cwd=root).returncode == 1  # build and check agree
    pruned = mpgen("build", "--prune", cwd=root)
    assert pruned.stdout.splitlines()[:6] == [f"removed out/{name}" for name in files_of("other")]
    assert files_in(root / "out") == sorted(files_of("simple_model") + runtime_files())
    assert mpgen("check", cwd=root).returncode == 0


def test_prune_keeps_foreign_files_and_the_files_of_specs_that_exist(tmp_path):
    root = project(tmp_path)
    out = root / "out"
    (out / "notes.md").write_text("# my notes\n")
    (out / "helper.py").write_text("# Code generated by hand\n")
    (out / "other.py").write_text("# my own, in the way\n")  # not mpgen's: foreign
    (root / "specs" / "other.yaml").unlink()
    pruned = mpgen("build", "specs/seed.yaml", "--prune", cwd=root)
    assert pruned.returncode == 0, pruned.stderr
    assert [line for line in pruned.stdout.splitlines() if line.startswith("removed")] == [
        f"removed out/{name}" for name in files_of("other") if name != "other.py"]
    assert files_in(out) == sorted(
        files_of("simple_model") + ["notes.md", "helper.py", "other.py"] + runtime_files())
    assert (out / "other.py").read_text() == "# my own, in the way\n"


def test_files_of_a_spec_not_built_are_left_alone(tmp_path):
    """`build SPEC` touches only SPEC's files and the orphans of deleted specs."""
    root = project(tmp_path)
    spec = root / "specs" / "other.yaml"
    spec.write_text(spec.read_text().replace("name: Other", "name: Another"))
    build = mpgen("build", "specs/seed.yaml", "--prune", cwd=root)
    assert (build.returncode, build.stdout.splitlines()[0]) == (0, "out: up to date")
    assert files_in(root / "out") == sorted(files_of("simple_model") + files_of("other")
                                            + runtime_files())


# -- every file of the output folder accounted for ------------------------------------
# (NOTE [Every file of the output folder accounted for])

def committed(tmp_path: Path) -> Path:
    """:func:`project`, in a git repository, its specs and generated code committed."""
    root = project(tmp_path)
    git("init", "-q", cwd=root)
    (root / ".gitignore").write_text("__pycache__/\n.pytest_cache/\n")
    git("add", ".", cwd=root)
    git("commit", "-qm", "base", cwd=root)
    return root


def pull_request(root: Path, files: dict[str, str]) -> None:
    """Commit ``files`` (path -> text), as a pull request would."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git("add", "-f", *files, cwd=root)
    git("commit", "-qm", "a pull request", cwd=root)


FORGED = "# Code generated by mpgen from {spec}. DO NOT EDIT.\nimport os\nos.system('touch x')\n"


@pytest.mark.parametrize("name", ["conftest.py", "pytest.ini", "evil.pth", "setup.cfg",
                                  "pyproject.toml", "tox.ini", ".hidden.py", "sub/conftest.py",
                                  "__pycache__/simple_model.cpython-311.pyc",
                                  "mpgen_runtime/conftest.py", "mpgen_runtime/sub/loop.py"])
@pytest.mark.slow
def test_check_reports_a_file_a_pull_request_adds_to_the_output_folder(tmp_path, name):
    root = committed(tmp_path)
    pull_request(root, {f"out/{name}": "import os\nos.system('touch pwned')\n"})
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout.startswith(f"out/{name}: "), check.stdout
    assert "no spec checked owns it, and build leaves it: remove it" in check.stdout
    assert check.stderr == ("\nmpgen check: out holds 1 file that no spec checked owns; "
                            "remove it (build leaves it)\n")
    # build leaves it, and says so
    build = mpgen("build", "--prune", cwd=root)
    assert build.returncode == 0 and (root / "out" / name).exists()
    assert f"out/{name}: note: " in build.stderr


@pytest.mark.parametrize("spec, why", [
    ("../elsewhere/spec.yaml", "generated from ../elsewhere/spec.yaml, a spec outside the project"),
    ("/etc/spec.yaml", "generated from /etc/spec.yaml, a spec outside the project"),
])
def test_check_reports_a_forged_header_naming_a_spec_outside_the_project(tmp_path, spec, why):
    root = committed(tmp_path)
    pull_request(root, {"out/evil.py": FORGED.format(spec=spec)})
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout == f"out/evil.py: {why}; no spec checked owns it, and build leaves it: " \
                           "remove it\n"
    pruned = mpgen("build", "--prune", cwd=root)  # never evidence that a spec is gone
    assert pruned.returncode == 0 and (root / "out" / "evil.py").exists()


def test_check_reports_a_forged_header_naming_a_spec_of_the_project_that_is_gone(tmp_path):
    root = committed(tmp_path)
    pull_request(root, {"out/evil.py": FORGED.format(spec="specs/never.yaml")})
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout == ("out/evil.py: generated from specs/never.yaml, which no longer "
                            "exists; build --prune would remove it\n")


def test_a_narrowed_specs_list_does_not_hide_a_hand_edited_file(tmp_path):
    """A pull request hand-edits other.yaml's generated code and takes it out
    of `[tool.mpgen] specs`: its files are still reported."""
    root = committed(tmp_path)
    edited = (root / "out" / "other.py").read_text() + "import os\nos.system('touch x')\n"
    pull_request(root, {"out/other.py": edited, "pyproject.toml":
                        '[tool.mpgen]\nspecs = ["specs/seed.yaml"]\nout = "out"\n'})
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert ("out/other.py: generated from specs/other.yaml, another spec of the project; not "
            "checked here, so not compared") in check.stdout.splitlines()
    assert len(check.stdout.splitlines()) == len(files_of("other"))
    assert check.stderr == (f"\nmpgen check: out also holds {len(files_of('other'))} files of "
                            "specs/other.yaml, not checked here; list it in [tool.mpgen] specs\n")


def test_a_check_of_one_spec_of_a_shared_folder_leaves_the_others_files_to_theirs(tmp_path):
    """Another spec's files are neither orphans nor to be removed: they are
    said to be not compared, and the check that compares them is named; a
    file no spec owns is still one to remove, and the whole folder's check
    is green."""
    root = committed(tmp_path)
    (root / "out" / "conftest.py").write_text("")
    check = mpgen("check", "specs/seed.yaml", "-o", "out", cwd=root)
    assert check.returncode == 1
    assert "orphan" not in check.stdout + check.stderr
    other = [line for line in check.stdout.splitlines() if "other.yaml" in line]
    assert other == [f"out/{name}: generated from specs/other.yaml, another spec of the project; "
                     "not checked here, so not compared" for name in files_of("other")]
    assert "remove" not in "".join(other)
    assert check.stderr == (
        "\nmpgen check: out holds 1 file that no spec checked owns; remove it (build leaves it)"
        f"\nmpgen check: out also holds {len(files_of('other'))} files of specs/other.yaml, not "
        "checked here; check them with the others: mpgen check specs/seed.yaml "
        "specs/other.yaml -o out\n")
    (root / "out" / "conftest.py").unlink()
    whole = mpgen("check", "specs/seed.yaml", "specs/other.yaml", "-o", "out", cwd=root)
    assert (whole.returncode, whole.stdout, whole.stderr) == (0, "out: up to date\n", "")
    (root / "sub").mkdir()  # from a sub-folder, the specs as the command line takes them
    check = mpgen("check", "../specs/seed.yaml", "-o", "../out", cwd=root / "sub")
    assert check.stderr.endswith("check them with the others: mpgen check ../specs/seed.yaml "
                                 "../specs/other.yaml -o ../out\n")
    build = mpgen("build", "specs/seed.yaml", "-o", "out", cwd=root)
    assert build.returncode == 0
    assert [line for line in build.stderr.splitlines() if "other" in line] == [
        f"out/{name}: note: generated from specs/other.yaml, another spec of the project; not "
        "built here: left in place" for name in files_of("other")]


def test_a_committed_old_manifest_is_reported_an_ignored_one_is_not(tmp_path):
    root = committed(tmp_path)
    (root / "out" / ".mpgen-manifest.json").write_text("{}")
    assert mpgen("check", cwd=root).returncode == 1  # not ignored: git would add it
    with (root / ".gitignore").open("a") as f:
        f.write(".mpgen-manifest.json\n")
    assert mpgen("check", cwd=root).returncode == 0  # ignored, untracked: never in a commit
    git("add", "-f", "out/.mpgen-manifest.json", cwd=root)
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout.startswith("out/.mpgen-manifest.json: the build manifest of an older "
                                   "mpgen, never read now")


def test_caches_of_running_the_generated_tests_are_not_reported(tmp_path):
    root = committed(tmp_path)
    for folder in ("out/__pycache__", "out/.pytest_cache/v"):
        (root / folder).mkdir(parents=True)
        (root / folder / "x.pyc").write_bytes(b"\0")
    (root / ".gitignore").unlink()  # untracked and not ignored: still Python's own
    git("add", ".gitignore", cwd=root)
    git("commit", "-qm", "no .gitignore", cwd=root)
    assert mpgen("check", cwd=root).returncode == 0
    git("add", "-f", "out/__pycache__/x.pyc", cwd=root)  # committed: reported
    check = mpgen("check", cwd=root)
    assert check.returncode == 1 and check.stdout.startswith("out/__pycache__/x.pyc: ")


def test_outside_git_every_file_but_the_caches_is_looked_at(tmp_path):
    import py_compile

    root = project(tmp_path)
    model = root / "out" / "simple_model.py"
    cache = root / "out" / "__pycache__"
    py_compile.compile(str(model), cfile=str(cache / "simple_model.cpython-311.pyc"))
    py_compile.compile(str(model), cfile=str(cache / "pp_simple_model.cpython-311.pyc"),
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    (root / "out" / ".pytest_cache" / "v").mkdir(parents=True)
    (root / "out" / ".pytest_cache" / "v" / "lastfailed").write_text("{}")
    assert mpgen("check", cwd=root).returncode == 0  # what Python checks against its source
    # An unchecked-hash .pyc runs without its source: a stranger.
    py_compile.compile(str(model), cfile=str(cache / "train_simple_model.cpython-311.pyc"),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout == ("out/__pycache__/train_simple_model.cpython-311.pyc: in a sub-folder "
                            "other than mpgen_runtime/, where mpgen writes nothing; no spec "
                            "checked owns it, and build leaves it: remove it\n")
    (cache / "train_simple_model.cpython-311.pyc").unlink()
    (root / "out" / "conftest.py").write_text("")
    (root / "out" / "link.py").symlink_to(root / "specs" / "seed.yaml")
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout.splitlines() == [
        "out/conftest.py: not generated by mpgen (no mpgen header); no spec checked owns it, "
        "and build leaves it: remove it",
        "out/link.py: a symbolic link, not a file mpgen wrote; no spec checked owns it, and "
        "build leaves it: remove it"]


def test_prune_in_another_project_s_folder_deletes_nothing(tmp_path):
    """The files of another project's specs name specs this project lacks:
    no evidence that they are gone, so `--prune` leaves them."""
    (tmp_path / "other").mkdir()
    other = project(tmp_path / "other")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "pyproject.toml").write_text("")
    (mine / "seed.yaml").write_text(SEED.read_text().replace("name: SimpleModel", "name: Mine"))
    before = files_in(other / "out")
    build = mpgen("build", "seed.yaml", "-o", str(other / "out"), "--prune", cwd=mine)
    assert build.returncode == 0, build.stderr
    assert [n for n in files_in(other / "out") if n not in files_of("mine")] == before
    assert "which is not among the specs checked" in build.stderr


def test_without_git_a_committed_unchecked_pyc_is_still_reported(tmp_path, monkeypatch):
    """Where git cannot answer (not installed, a repository of another
    owner), the walk reports a .pyc that Python would run without its source."""
    import py_compile

    root = committed(tmp_path)
    model = root / "out" / "simple_model.py"
    pyc = root / "out" / "__pycache__" / "simple_model.cpython-311.pyc"
    py_compile.compile(str(model), cfile=str(pyc),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    git("add", "-f", str(pyc), cwd=root)
    git("commit", "-qm", "a pull request", cwd=root)
    assert mpgen("check", cwd=root).stdout.startswith("out/__pycache__/simple_model.")
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout.startswith("out/__pycache__/simple_model.cpython-311.pyc: ")


def test_an_output_folder_too_large_to_look_at_is_reported(tmp_path, monkeypatch):
    from mpgen.output import write

    root = project(tmp_path)
    monkeypatch.setattr(write, "MAX_LISTED", 8)
    for i in range(5):
        (root / "out" / "__pycache__").mkdir(exist_ok=True)
        (root / "out" / "__pycache__" / f"m{i}.pyc").write_bytes(b"")
    check = mpgen("check", cwd=root)
    assert check.returncode == 1
    assert check.stdout == ("out: holds more than 8 files and folders, more than mpgen looks at "
                            "for files it does not own\n")
