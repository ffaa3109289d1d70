"""The build manifest (NOTE [Build manifest]): `check` and `build` of current
specs compile nothing and import no torch, and never call stale files current;
it lives where git never tracks it (the repository's git folder, else the
user's cache), so a manifest committed into the output folder is never read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES, files_in, mpgen, runtime_files, write_spec
from mpgen.commands import build as build_command
from mpgen.output import manifest, runtime

SEED = EXAMPLES / "seed.yaml"


@pytest.fixture
def compiles(monkeypatch) -> list[list[str]]:
    """The specs each compile of a build or check was asked for, in this
    process or a child (the real compiler still runs)."""
    calls: list[list[str]] = []
    # Each spec, compiled in this process or a child (NOTE [User code in a child]).
    real = build_command._compile

    def spy(paths, *args):
        calls.append([Path(p).name for p in paths])
        return real(paths, *args)

    monkeypatch.setattr(build_command, "_compile", spy)
    return calls


@pytest.fixture
def built(tmp_path) -> Path:
    """The seed spec built into out/; returns the spec's path."""
    spec = write_spec(tmp_path, SEED.read_text(), "seed.yaml")
    ran = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    return spec


def test_a_build_writes_the_manifest_with_its_files(built):
    out = built.parent / "out"
    data = json.loads(manifest.location(out).read_text())
    (entry,) = data["specs"]
    assert entry["spec"] == "seed.yaml"
    # Outside a git repository: the user's cache; nothing in the output folder.
    assert manifest.location(out).is_relative_to(os.environ["XDG_CACHE_HOME"])
    # The spec's own files; the runtime folder is the output folder's, no spec's
    # (check compares it every time).
    assert files_in(out) == sorted([*entry["files"], *runtime_files()])
    assert not any(name.startswith(f"{runtime.FOLDER}/") for name in entry["files"])
    for name, digest in entry["files"].items():
        assert manifest.sha256((out / name).read_bytes()) == digest
    assert entry["user_code"] is False
    assert entry["digest"] in (out / "simple_model.py").read_text()


def test_check_and_build_of_a_current_spec_compile_nothing(built, compiles):
    cwd = built.parent
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=cwd).returncode == 0
    again = mpgen("build", "seed.yaml", "-o", "out", cwd=cwd)
    assert again.returncode == 0
    # The summary line comes from the manifest, as the compile would print it.
    assert again.stdout.splitlines() == [
        "out: up to date",
        "seed.yaml: SimpleModel, 430 parameters on cuda:0 (220), cuda:1 (210); "
        "2 transfers in forward"]
    assert compiles == []


def test_a_check_of_current_specs_imports_no_torch(built):
    code = ("import sys; from mpgen.cli import main; code = main(['check', 'seed.yaml', '-o', "
            "'out']); heavy = sorted(m for m in ('torch', 'black', 'jinja2', 'pydantic') "
            "if m in sys.modules); print(code, heavy)")
    ran = subprocess.run([sys.executable, "-c", code], cwd=built.parent, capture_output=True,
                         text=True, timeout=300)
    assert ran.stdout.splitlines()[-1] == "0 []", ran.stdout + ran.stderr


def test_a_comment_edit_stays_current_without_a_compile(built, compiles):
    built.write_text("# a comment the digest does not see\n" + built.read_text())
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent).returncode == 0
    assert compiles == []


def test_a_change_of_meaning_compiles_and_check_reports_it(built, compiles):
    built.write_text(built.read_text().replace("layer2: cuda:1", "layer2: cuda:0"))
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent)
    assert check.returncode == 1
    assert '-        self.layer2 = nn.Linear(20, 10).to("cuda:1")' in check.stdout
    assert compiles == [["seed.yaml"]]


@pytest.mark.parametrize("damage", ["edit", "delete", "link"])
def test_a_generated_file_changed_on_disk_is_never_current(built, compiles, damage):
    out = built.parent / "out"
    model = out / "simple_model.py"
    original = model.read_text()
    if damage == "edit":
        model.write_text(original.replace('"cuda:1"', '"cuda:0"'))
    elif damage == "delete":
        model.unlink()
    else:  # the same bytes, behind a symbolic link
        (built.parent / "elsewhere.py").write_text(original)
        model.unlink()
        model.symlink_to(built.parent / "elsewhere.py")
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent)
    assert check.returncode == 1
    assert compiles == [["seed.yaml"]]
    assert mpgen("build", "seed.yaml", "-o", "out", "--force", cwd=built.parent).returncode == 0
    assert model.read_text() == original and not model.is_symlink()


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": 2, "specs": []}',
                                  '{"format": 1, "specs": [{"spec": "seed.yaml"}]}'])
def test_a_manifest_that_cannot_be_trusted_is_ignored(built, compiles, text):
    manifest.location(built.parent / "out").write_text(text)
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent).returncode == 0
    assert compiles == [["seed.yaml"]]  # compiled: the manifest said nothing


def test_a_manifest_naming_files_outside_the_folder_is_ignored(built, compiles):
    path = manifest.location(built.parent / "out")
    data = json.loads(path.read_text())
    data["specs"][0]["files"]["../seed.yaml"] = manifest.sha256(built.read_bytes())
    path.write_text(json.dumps(data))
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent).returncode == 0
    assert compiles == [["seed.yaml"]]


def test_another_device_map_is_another_key(built, compiles):
    check = mpgen("check", "seed.yaml", "-o", "out", "--device-map", "cpu", cwd=built.parent)
    assert check.returncode == 1
    assert compiles == [["seed.yaml"]]


def test_another_generator_is_another_key(built, compiles, monkeypatch):
    monkeypatch.setattr(manifest, "generator_fingerprint", lambda: "0.0.0+another")
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent).returncode == 0
    assert compiles == [["seed.yaml"]]


@pytest.mark.parametrize("where", ["op", "loss"])
@pytest.mark.slow
def test_a_spec_naming_its_own_code_is_compiled_every_time(tmp_path, compiles, where):
    (tmp_path / "mycode.py").write_text(
        "from torch import nn\n\n\nclass Gate(nn.Linear):\n    pass\n\n\n"
        "class MyLoss(nn.MSELoss):\n    pass\n")
    text = SEED.read_text()
    text = (text.replace("{op: Linear, args: [20, 10]}", "{op: mycode.Gate, args: [20, 10]}")
            if where == "op" else text.replace("loss: MSELoss", "loss: mycode.MyLoss"))
    assert "mycode." in text
    write_spec(tmp_path, text, "seed.yaml")
    (tmp_path / "pyproject.toml").write_text("")  # the project dotted names import from
    ran = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    entry, = manifest.read(tmp_path / "out").values()
    assert entry.user_code
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    assert compiles == [["seed.yaml"], ["seed.yaml"]]


def test_the_manifest_is_deterministic_and_keeps_the_entries_of_other_specs(tmp_path):
    write_spec(tmp_path, SEED.read_text(), "seed.yaml")
    write_spec(tmp_path, SEED.read_text().replace("name: SimpleModel", "name: Other"),
               "other.yaml")
    assert mpgen("build", "seed.yaml", "other.yaml", "-o", "a", cwd=tmp_path).returncode == 0
    assert mpgen("build", "other.yaml", "-o", "b", cwd=tmp_path).returncode == 0
    assert mpgen("build", "seed.yaml", "-o", "b", cwd=tmp_path).returncode == 0
    first = manifest.location(tmp_path / "a").read_bytes()
    assert manifest.location(tmp_path / "b").read_bytes() == first
    assert str(tmp_path).encode() not in first  # no absolute paths
    assert sorted(manifest.read(tmp_path / "a")) == ["other.yaml", "seed.yaml"]


def test_a_failed_build_leaves_the_manifest_as_it_was(built):
    path = manifest.location(built.parent / "out")
    before = path.read_bytes()
    built.write_text(built.read_text().replace("args: [20, 10]", "args: [30, 10]"))
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=built.parent).returncode == 2
    assert path.read_bytes() == before


def test_a_renamed_model_s_entry_goes_with_its_files(built):
    built.write_text(built.read_text().replace("name: SimpleModel", "name: Renamed"))
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=built.parent).returncode == 0
    (entry,) = manifest.read(built.parent / "out").values()
    assert sorted(entry.files) == sorted(
        ["renamed.py", "train_renamed.py", "test_renamed.py", "pp_renamed.py",
         "predict_renamed.py", "renamed.placement.md"])
    assert files_in(built.parent / "out") == sorted([*entry.files, *runtime_files()])


def test_the_runtime_folder_is_compared_even_when_every_spec_is_current(built, compiles):
    loop = built.parent / "out" / runtime.FOLDER / "loop.py"
    loop.write_text(loop.read_text() + "# an edit\n")
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=built.parent)
    assert check.returncode == 1
    assert check.stdout.startswith(f"--- out/{runtime.FOLDER}/loop.py (on disk)\n")
    build = mpgen("build", "seed.yaml", "-o", "out", cwd=built.parent)
    assert build.stdout.splitlines()[0] == f"wrote out/{runtime.FOLDER}/loop.py"
    assert compiles == []


def test_removing_an_older_runtime_s_file_keeps_the_entry_of_a_spec_s_namesake(tmp_path,
                                                                              compiles):
    """An older runtime's ``mpgen_runtime/other.py`` is not the spec Other's
    ``other.py``: the build that removes it keeps Other's entry current."""
    write_spec(tmp_path, SEED.read_text(), "seed.yaml")
    write_spec(tmp_path, SEED.read_text().replace("name: SimpleModel", "name: Other"),
               "other.yaml")
    assert mpgen("build", "seed.yaml", "other.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    older = runtime.HEADER.replace(f"mpgen {runtime.__version__}:", "mpgen 0.0.1:")
    (tmp_path / "out" / runtime.FOLDER / "other.py").write_text(f"{older}\nOLD = True\n")
    compiles.clear()
    build = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert build.stdout.splitlines()[0] == f"removed out/{runtime.FOLDER}/other.py"
    assert sorted(manifest.read(tmp_path / "out")) == ["other.yaml", "seed.yaml"]
    assert mpgen("check", "seed.yaml", "other.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    assert compiles == []


# -- where the manifest lives: never where a commit can put it ----------------------

def git(*args: str, cwd: Path) -> str:
    ran = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                          "-c", "init.defaultBranch=main", *args],
                         cwd=cwd, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def repository(folder: Path) -> Path:
    """A git repository with the seed spec under [tool.mpgen], built and
    committed (its generated code, never a manifest)."""
    folder.mkdir()
    (folder / "pyproject.toml").write_text(
        '[tool.mpgen]\nspecs = ["specs/*.yaml"]\nout = "generated"\n')
    (folder / "specs").mkdir()
    (folder / "specs" / "seed.yaml").write_text(SEED.read_text())
    git("init", "-q", cwd=folder)
    ran = mpgen("build", cwd=folder)
    assert ran.returncode == 0, ran.stderr
    git("add", ".", cwd=folder)
    git("commit", "-qm", "seed", cwd=folder)
    return folder


def test_in_a_repository_the_manifest_is_in_its_git_folder(tmp_path, compiles):
    repo = repository(tmp_path / "repo")
    compiles.clear()
    where = manifest.location(repo / "generated")
    assert where.parent == repo / ".git" / "mpgen" / "manifests"
    assert where.name == manifest.sha256(b"generated") + ".json"
    assert json.loads(where.read_text())["specs"][0]["spec"] == "specs/seed.yaml"
    assert not (repo / "generated" / manifest.FILE_NAME).exists()
    assert git("status", "--porcelain", cwd=repo) == ""  # nothing for git to see
    # The second check is the quick one: from the manifest, no compile.
    check = mpgen("check", cwd=repo)
    assert (check.returncode, check.stdout) == (0, "generated: up to date\n")
    assert compiles == []


def test_a_worktree_keeps_its_manifest_in_its_own_git_folder(tmp_path, compiles):
    repo = repository(tmp_path / "repo")
    compiles.clear()
    git("worktree", "add", "-q", str(tmp_path / "wt"), cwd=repo)
    where = manifest.location(tmp_path / "wt" / "generated")
    assert where.parent == repo / ".git" / "worktrees" / "wt" / "mpgen" / "manifests"
    assert mpgen("check", cwd=tmp_path / "wt").returncode == 0
    assert compiles == [["seed.yaml"]]  # a fresh worktree: no manifest yet
    assert mpgen("build", cwd=tmp_path / "wt").returncode == 0  # check writes no manifest
    assert where.is_file()
    assert mpgen("check", cwd=tmp_path / "wt").returncode == 0
    assert compiles == [["seed.yaml"], ["seed.yaml"]]


PAYLOAD = 'import os\nos.system("touch pwned")\n'


@pytest.mark.parametrize("forgery", ["file-sha", "source", "no-files"])
def test_a_committed_manifest_is_never_trusted(tmp_path, compiles, forgery):
    """A pull request hand-edits a generated file (or the spec) and commits a
    manifest that calls it current: CI's check, on a fresh clone or where a
    build ran before, compiles and fails."""
    repo = repository(tmp_path / "repo")
    compiles.clear()
    forged = json.loads(manifest.location(repo / "generated").read_text())
    entry = forged["specs"][0]
    model = repo / "generated" / "simple_model.py"
    spec = repo / "specs" / "seed.yaml"
    if forgery == "source":  # the spec moves a layer; its text's hash is the recorded one
        spec.write_text(spec.read_text().replace("layer2: cuda:1", "layer2: cuda:0"))
        entry["source"] = manifest.sha256(spec.read_bytes())
    else:
        model.write_text(model.read_text() + PAYLOAD)
        entry["files"]["simple_model.py"] = manifest.sha256(model.read_bytes())
        if forgery == "no-files":
            entry["files"] = {}
    (repo / "generated" / manifest.FILE_NAME).write_text(json.dumps(forged))
    git("add", "-f", ".", cwd=repo)
    git("commit", "-qm", "a hostile pull request", cwd=repo)
    git("clone", "-q", str(repo), str(tmp_path / "clone"), cwd=tmp_path)
    for where in (tmp_path / "clone", repo):
        check = mpgen("check", cwd=where)
        assert check.returncode == 1, check.stdout + check.stderr
        edit = ('-        self.layer2 = nn.Linear(20, 10).to("cuda:1")' if forgery == "source"
                else '-os.system("touch pwned")')
        assert edit in check.stdout
    assert compiles == [["seed.yaml"], ["seed.yaml"]]


def test_a_committed_manifest_does_not_let_an_invalid_spec_pass(tmp_path, compiles):
    repo = repository(tmp_path / "repo")
    compiles.clear()
    forged = json.loads(manifest.location(repo / "generated").read_text())
    spec = repo / "specs" / "seed.yaml"
    spec.write_text("mpgen: 1\nname: [unclosed\n")
    forged["specs"][0]["source"] = manifest.sha256(spec.read_bytes())
    (repo / "generated" / manifest.FILE_NAME).write_text(json.dumps(forged))
    git("add", "-f", ".", cwd=repo)
    git("commit", "-qm", "a hostile pull request", cwd=repo)
    git("clone", "-q", str(repo), str(tmp_path / "clone"), cwd=tmp_path)
    check = mpgen("check", cwd=tmp_path / "clone")
    assert check.returncode == 2
    assert check.stderr.startswith("specs/seed.yaml:2:")
    assert compiles == [["seed.yaml"]]
