"""Files: reads that are bounded, writes that cannot lose work, a `check` that
misses nothing, generated module names that shadow nothing, exit codes.

Each failure these tests reproduce was seen before the fix: a spec linked to
/dev/zero grew to GBs, a FIFO hung the build, a failure between renames left
half a build, `check` passed a CRLF edit and missed orphans, `build`
overwrote hand-written files, a model named Torch shadowed torch.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (EXAMPLES, GATE, GATED, ROOT, files_in, mpgen, runtime_files, time_limit,
                     write_factory, write_spec)
from mpgen.output import manifest, runtime, write
from mpgen.spec_schema.load import MAX_BYTES

SEED = EXAMPLES / "seed.yaml"
SEED_FILES = ["simple_model.py", "train_simple_model.py", "test_simple_model.py",
              "pp_simple_model.py", "predict_simple_model.py", "simple_model.placement.md"]
NEEDS_POSIX = pytest.mark.skipif(os.name != "posix", reason="FIFOs and /dev/zero are POSIX")


def contents(folder: Path) -> dict[str, bytes | None]:
    """Every file under ``folder`` by its path there (staging files and the
    runtime folder's too) but the manifest, and every folder (None): a build
    that fails leaves no folder it made either."""
    return {p.relative_to(folder).as_posix(): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.name != manifest.FILE_NAME}


def spec_in(folder: Path, text: str, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_spec(folder, text, name)


def seed_spec(folder: Path, name: str = "seed.yaml", model: str = "SimpleModel") -> Path:
    return spec_in(folder, SEED.read_text().replace("name: SimpleModel", f"name: {model}"), name)


# -- only regular files are read, never more than the limit ----------------------

@NEEDS_POSIX
def test_a_spec_linked_to_dev_zero_is_refused_without_reading_it(tmp_path):
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    with time_limit(20):
        result = mpgen("build", "zero.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("zero.yaml: cannot read spec: it is a character device, not a "
                             "regular file (zero.yaml is a symbolic link to /dev/zero)\n")
    assert not (tmp_path / "out").exists()


@NEEDS_POSIX
def test_a_fifo_spec_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.yaml")
    with time_limit(20):
        result = mpgen("check", "pipe.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("pipe.yaml: cannot read spec: it is a named pipe (FIFO), not a "
                             "regular file\n")


def test_a_folder_spec_is_a_clean_error(tmp_path):
    (tmp_path / "folder.yaml").mkdir()
    result = mpgen("show", "folder.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("folder.yaml: cannot read spec: it is a directory, not a regular "
                             "file\n")


def test_a_spec_linked_to_a_regular_file_is_read(tmp_path):
    seed_spec(tmp_path / "real")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real" / "seed.yaml")
    result = mpgen("build", "link.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert files_in(tmp_path / "out") == sorted(SEED_FILES + runtime_files())


def test_a_spec_that_grows_past_the_limit_is_refused(tmp_path):
    spec = seed_spec(tmp_path)
    with open(spec, "a") as f:
        f.write("#" * MAX_BYTES)
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"seed.yaml:1:1: spec is larger than {MAX_BYTES} bytes\n"


@NEEDS_POSIX
def test_a_generated_file_linked_to_dev_zero_is_neither_read_nor_replaced(tmp_path):
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    model = tmp_path / "out" / "simple_model.py"
    model.unlink()
    model.symlink_to("/dev/zero")
    with time_limit(20):
        check = mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path)
        build = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout == ("out/simple_model.py: a symbolic link, not a file mpgen wrote; "
                            "build would refuse to overwrite it (move it away, or build with "
                            "--force)\n")
    assert build.returncode == 2
    assert build.stderr == ("out/simple_model.py: a symbolic link, not a file mpgen wrote; "
                            "refusing to overwrite it; move it away or pass --force\n")
    assert model.is_symlink()


@NEEDS_POSIX
def test_a_fifo_in_place_of_a_generated_file_does_not_hang_check(tmp_path):
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    (tmp_path / "out" / "test_simple_model.py").unlink()
    os.mkfifo(tmp_path / "out" / "test_simple_model.py")
    with time_limit(20):
        check = mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout.startswith("out/test_simple_model.py: a named pipe (FIFO), not a file "
                                   "mpgen wrote; build would refuse")


def test_a_huge_edited_generated_file_is_read_only_up_to_a_bound(tmp_path):
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    model = tmp_path / "out" / "simple_model.py"
    size = model.stat().st_size
    with open(model, "a") as f:
        f.write("#" * (write.MAX_EXTRA_BYTES + 1))
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout == (f"out/simple_model.py: it is larger than "
                            f"{size + write.MAX_EXTRA_BYTES} bytes; it differs from the "
                            "generated file\n")
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    assert model.stat().st_size == size


# -- mpgen diff: revisions are never ranges or options; git's output is bounded --

def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    seed_spec(tmp_path, "spec.yaml")
    (tmp_path / "big.yaml").write_text("#" * (MAX_BYTES + 10))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.yaml").write_text("a: 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


@pytest.mark.parametrize("side", [
    "HEAD..HEAD:spec.yaml", "HEAD...HEAD:spec.yaml", "HEAD~1..:spec.yaml", ":spec.yaml",
    "HEAD^{/first message}:spec.yaml", "HEAD@{1..2}:spec.yaml", "HEAD:",
])
def test_diff_refuses_ranges_and_odd_revision_syntax(repo, side):
    result = mpgen("diff", side, "spec.yaml", cwd=repo)
    assert result.returncode == 2
    assert result.stderr == (f"{side}:1:1: {side!r} is not a revision:path (such as "
                             "HEAD~1:spec.yaml); ranges (a..b), options and other revision "
                             "syntax are not accepted\n")


def test_diff_reports_git_errors_cleanly(repo):
    result = mpgen("diff", "HEAD:folder", "spec.yaml", cwd=repo)
    assert result.returncode == 2
    assert result.stderr == ("HEAD:folder:1:1: cannot read 'HEAD:folder' from git: fatal: git "
                             "cat-file HEAD:folder: bad file\n")
    result = mpgen("diff", "a..b", "spec.yaml", cwd=repo)  # no ':': a path
    assert result.returncode == 2
    assert result.stderr == "a..b: cannot read spec: No such file or directory\n"


def test_diff_reads_at_most_the_limit_from_git(repo):
    with time_limit(20):
        result = mpgen("diff", "HEAD:big.yaml", "spec.yaml", cwd=repo)
    assert result.returncode == 2
    assert result.stderr == f"HEAD:big.yaml:1:1: spec is larger than {MAX_BYTES} bytes\n"


# -- generated module names -------------------------------------------------------

MODEL = """\
mpgen: 1
name: {name}
inputs:
  x: [batch, 8]
layers:
  a: {{op: Linear, args: [8, 8]}}
outputs: [a]
"""


@pytest.mark.parametrize("name, module, what", [
    ("Torch", "torch", "the module 'torch' the generated code imports"),
    ("Mpgen", "mpgen", "the module 'mpgen' the generated code imports"),
    ("Pytest", "pytest", "the module 'pytest' the generated code imports"),
    ("Numpy", "numpy", "the module 'numpy' the generated code imports"),
    ("Conftest", "conftest", "the module 'conftest' the generated code imports"),
    # What the training script imports (tests/compiler/codegen/test_generated_imports.py keeps the list).
    ("Safetensors", "safetensors", "the module 'safetensors' the generated code imports"),
    ("Tqdm", "tqdm", "the module 'tqdm' the generated code imports"),
    ("Tensorboard", "tensorboard", "the module 'tensorboard' the generated code imports"),
    ("Google", "google", "the module 'google' the generated code imports"),
    ("Pil", "pil", "the module 'pil' the generated code imports"),
    ("Os", "os", "the standard library module 'os'"),
    ("Typing", "typing", "the standard library module 'typing'"),
    ("Argparse", "argparse", "the standard library module 'argparse'"),
    ("JSON", "json", "the standard library module 'json'"),
])
def test_model_names_that_would_shadow_a_module_are_refused(tmp_path, name, module, what):
    write_spec(tmp_path, MODEL.format(name=name))
    result = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"spec.yaml:2:7: name: {name!r} would generate {module}.py, which "
                             f"shadows {what}; choose another name (e.g. '{name}Model')\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("factory, stem", [
    ("mydata:make", "mydata"),  # the model module
    ("train_mydata:make", "train_mydata"),  # the training script
    ("test_mydata.sets:make", "test_mydata"),  # the tests
    ("pp_mydata:make", "pp_mydata"),  # the pipeline program
])
def test_no_generated_file_shadows_the_data_factorys_module(tmp_path, factory, stem):
    """The training script imports the spec's data factory: none of the
    generated files (model, script, tests, pipeline program) may take its
    module's name."""
    write_factory(tmp_path, factory)
    write_spec(tmp_path, MODEL.format(name="Mydata") + f"train: {{data: '{factory}'}}\n")
    result = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"spec.yaml:2:7: name: 'Mydata' would generate {stem}.py, which "
                             f"shadows the module {stem!r} this spec's ops import; choose "
                             "another name (e.g. 'MydataModel')\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_named_like_its_loss_module_is_refused(tmp_path):
    """The training script imports a loss class of the spec's: its module
    counts as the spec's own, as an op's does."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "mylosses.py").write_text(
        "from torch import nn\n\n\nclass Focal(nn.Module):\n"
        "    def forward(self, x, t):\n        return nn.functional.mse_loss(x, t)\n")
    write_spec(tmp_path, MODEL.format(name="Mylosses") + "train: {loss: mylosses.Focal}\n")
    result = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("spec.yaml:2:7: name: 'Mylosses' would generate mylosses.py, "
                             "which shadows the module 'mylosses' this spec's ops import; "
                             "choose another name (e.g. 'MylossesModel')\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_named_like_its_user_module_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "mylayers.py").write_text(GATE)
    write_spec(tmp_path, GATED.format(name="Mylayers"))
    result = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert ("spec.yaml:2:7: name: 'Mylayers' would generate mylayers.py, which shadows the "
            "module 'mylayers' this spec's ops import; choose another name (e.g. "
            "'MylayersModel')") in result.stderr.splitlines()
    assert not (tmp_path / "out").exists()


def test_a_model_name_too_long_for_a_file_name_is_refused_at_name(tmp_path):
    write_spec(tmp_path, MODEL.format(name="M" * 300))
    result = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("spec.yaml:2:7: name: 300 characters is too long for a model name "
                             "(it names the generated files); use at most 100\n")
    longest = "Ab" * 50  # 100 characters, snake case a_b_..._ab: the longest file names
    write_spec(tmp_path, MODEL.format(name=longest))
    result = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


# -- ownership: build never overwrites a file mpgen did not write -----------------

def test_build_refuses_to_overwrite_a_hand_written_file(tmp_path):
    seed_spec(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "simple_model.py").write_text("# my own model\n")
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("out/simple_model.py: not generated by mpgen (no mpgen header); "
                             "refusing to overwrite it; move it away or pass --force\n")
    assert contents(tmp_path / "out") == {"simple_model.py": b"# my own model\n"}
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout.startswith("out/simple_model.py: not generated by mpgen (no mpgen "
                                   "header); build would refuse to overwrite it (move it "
                                   "away, or build with --force)\n")
    forced = mpgen("build", "seed.yaml", "-o", "out", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert "wrote out/simple_model.py" in forced.stdout.splitlines()
    assert (tmp_path / "out" / "simple_model.py").read_text().startswith(
        "# Code generated by mpgen from seed.yaml. DO NOT EDIT.\n")


def test_a_report_keeps_its_own_header_form_and_is_owned(tmp_path):
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    report = tmp_path / "out" / "simple_model.placement.md"
    assert report.read_text().startswith("<!-- Generated by mpgen from seed.yaml. DO NOT EDIT. -->")
    report.write_text(report.read_text() + "an edit\n")
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.stdout.splitlines()[0] == "wrote out/simple_model.placement.md"


# -- check misses nothing ----------------------------------------------------------

def test_check_sees_a_one_byte_line_ending_edit_and_build_undoes_it(tmp_path):
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    model = tmp_path / "out" / "simple_model.py"
    good = model.read_bytes()
    model.write_bytes(good.replace(b"\n", b"\r\n", 1))
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout == ("out/simple_model.py: line endings differ (\\r\\n on disk; mpgen "
                            "writes \\n)\n")
    build = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert build.stdout.splitlines()[0] == "wrote out/simple_model.py"
    assert model.read_bytes() == good
    assert mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0


def test_a_renamed_model_leaves_orphans_that_check_lists_and_build_removes(tmp_path):
    spec = seed_spec(tmp_path)
    other = seed_spec(tmp_path, "other.yaml", model="OtherModel")
    assert mpgen("build", "seed.yaml", "other.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    (tmp_path / "out" / "notes.md").write_text("# my notes\n")
    spec.write_text(spec.read_text().replace("name: SimpleModel", "name: Renamed"))
    check = mpgen("check", "seed.yaml", "other.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout.splitlines()[len(SEED_FILES):] == [  # after a "missing" line each
        *(f"out/{name}: generated from seed.yaml, which no longer generates it; build would "
          "remove it" for name in sorted(SEED_FILES)),
        "out/notes.md: not generated by mpgen (no mpgen header); no spec checked owns it, and "
        "build leaves it: remove it"]
    build = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    assert [line for line in build.stdout.splitlines() if line.startswith("removed")] == [
        f"removed out/{name}" for name in sorted(SEED_FILES)]
    # The other spec's files exist and were not passed: untouched, as are the
    # notes and the runtime folder both specs share.
    assert files_in(tmp_path / "out") == sorted(
        ["notes.md", "renamed.py", "train_renamed.py", "test_renamed.py", "pp_renamed.py",
         "predict_renamed.py", "renamed.placement.md", "other_model.py", "train_other_model.py",
         "test_other_model.py", "pp_other_model.py", "predict_other_model.py",
         "other_model.placement.md",
         *runtime_files()])
    # check reports what no spec it checks owns: the notes, the other spec's files.
    check = mpgen("check", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert "out/other_model.py: generated from other.yaml, which is not among the specs " \
        "checked" in check.stdout
    (tmp_path / "out" / "notes.md").unlink()
    assert mpgen("check", "seed.yaml", "other.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    assert other.exists()


def test_files_of_a_deleted_spec_in_the_project_are_orphans(tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    seed_spec(tmp_path / "specs")
    gone = seed_spec(tmp_path / "specs", "gone.yaml", model="GoneModel")
    assert mpgen("build", "specs/seed.yaml", "specs/gone.yaml", "-o", "out",
                 cwd=tmp_path).returncode == 0
    gone.unlink()
    gone_files = ["gone_model.placement.md", "gone_model.py", "pp_gone_model.py",
                  "predict_gone_model.py", "test_gone_model.py", "train_gone_model.py"]
    check = mpgen("check", "specs/seed.yaml", "-o", "out", cwd=tmp_path)
    assert check.returncode == 1
    assert check.stdout.splitlines() == [
        f"out/{name}: generated from specs/gone.yaml, which no longer exists; build --prune "
        "would remove it" for name in gone_files]
    assert check.stderr.endswith("run: mpgen build specs/seed.yaml -o out --prune\n")
    # Without --prune they stay, and build says so.
    kept = mpgen("build", "specs/seed.yaml", "-o", "out", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert kept.stderr.splitlines() == [
        f"out/{name}: note: generated from specs/gone.yaml, which no longer exists; left in "
        "place (mpgen build --prune removes it)" for name in gone_files]
    assert files_in(tmp_path / "out") == sorted(SEED_FILES + gone_files + runtime_files())
    pruned = mpgen("build", "specs/seed.yaml", "-o", "out", "--prune", cwd=tmp_path)
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines()[: len(gone_files)] == [f"removed out/{name}" for name in gone_files]
    assert files_in(tmp_path / "out") == sorted(SEED_FILES + runtime_files())


# -- writes as one unit --------------------------------------------------------------

def failing_on(monkeypatch, *calls: int):
    """``os.replace`` fails on the given calls (1-based): a full disk mid-build."""
    real, seen = os.replace, []

    def replace(src, dst, *args, **kwargs):
        seen.append((src, dst))
        if len(seen) in calls:
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return seen


def test_a_failure_between_renames_changes_nothing(tmp_path, monkeypatch):
    spec = seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    before = contents(tmp_path / "out")
    spec.write_text(spec.read_text().replace("args: [20, 10]", "args: [20, 12]"))
    seen = failing_on(monkeypatch, 3)
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("out: cannot write the generated files: No space left on device: "
                             "out/test_simple_model.py; nothing was changed\n")
    assert len(seen) == 5  # 2 done, the 3rd failed, 2 undone
    assert contents(tmp_path / "out") == before


def test_a_failure_while_removing_orphans_changes_nothing(tmp_path, monkeypatch):
    spec = seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    before = contents(tmp_path / "out")
    spec.write_text(spec.read_text().replace("name: SimpleModel", "name: Renamed"))
    failing_on(monkeypatch, 6)  # 4 new files, then the second orphan
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.endswith("; nothing was changed\n")
    assert contents(tmp_path / "out") == before


def test_a_failed_first_build_leaves_no_file(tmp_path, monkeypatch):
    seed_spec(tmp_path)
    failing_on(monkeypatch, 4)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 2
    assert contents(tmp_path / "out") == {}  # nor the runtime folder it made


def test_a_failure_in_the_runtime_folder_leaves_neither_its_files_nor_it(tmp_path, monkeypatch):
    """The runtime's files are renamed after the spec's: a failure among them
    undoes the spec's files too, and removes the folder the build made."""
    seed_spec(tmp_path)
    seen = failing_on(monkeypatch, len(SEED_FILES) + 3)
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("out: cannot write the generated files: No space left on device: "
                             f"out/{runtime_files()[2]}; nothing was changed\n")
    assert [Path(dst) for _, dst in seen[:len(SEED_FILES) + 3]] == [
        Path("out", name) for name in [*SEED_FILES, *runtime_files()[:3]]]
    assert contents(tmp_path / "out") == {}


def test_a_failure_after_an_older_runtime_s_file_is_removed_restores_it(tmp_path, monkeypatch):
    """A file of an older runtime is an orphan every build removes; a build
    that fails after removing it puts it back, and the runtime files it
    rewrote too."""
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    folder = tmp_path / "out" / runtime.FOLDER
    older = runtime.HEADER.replace(f"mpgen {runtime.__version__}:", "mpgen 0.0.1:")
    loop = folder / "loop.py"
    loop.write_text(loop.read_text().replace(runtime.HEADER, older, 1))
    (folder / "gone.py").write_text(f"{older}\nOLD = True\n")
    before = contents(tmp_path / "out")
    seen = failing_on(monkeypatch, 2)  # loop.py rewritten, then gone.py's removal fails
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("out: cannot write the generated files: No space left on device: "
                             "out; nothing was changed\n")  # into the staging folder
    assert (Path(seen[0][1]), Path(seen[1][0])) == (Path("out", runtime.FOLDER, "loop.py"),
                                                    Path("out", runtime.FOLDER, "gone.py"))
    assert contents(tmp_path / "out") == before
    monkeypatch.undo()
    build = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert build.stdout.splitlines()[:2] == ["wrote out/mpgen_runtime/loop.py",
                                             "removed out/mpgen_runtime/gone.py"]
    assert files_in(tmp_path / "out") == sorted(SEED_FILES + runtime_files())


def test_when_the_undo_fails_too_the_previous_files_are_kept(tmp_path, monkeypatch):
    spec = seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    before = contents(tmp_path / "out")
    spec.write_text(spec.read_text().replace("args: [20, 10]", "args: [20, 12]"))
    failing_on(monkeypatch, 3, 4)  # the third rename, then the first undo
    result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    staging = [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".mpgen-staging-")]
    assert len(staging) == 1
    kept = staging[0] / "old" / "1"  # by number (two folders may share a name): the 2nd file
    assert result.stderr == ("out: cannot write the generated files: No space left on device: "
                             "out/test_simple_model.py; could not restore "
                             f"out/train_simple_model.py (its previous content is in "
                             f"{kept.relative_to(tmp_path)})\n")
    assert kept.read_bytes() == before["train_simple_model.py"]


SIGNALLED = """\
import os, signal, sys
# Ctrl-C as in a terminal, even where this process was started with SIGINT
# ignored (a background job of a shell without job control), which Python keeps
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from helpers import mpgen
real, calls = os.replace, []
def replace(src, dst):
    calls.append(dst)
    if len(calls) == {at}:
        os.kill(os.getpid(), signal.{signal})
    return real(src, dst)
os.replace = replace
from mpgen.cli import main
sys.exit(main(["build", "seed.yaml", "-o", "out"]))
"""


@NEEDS_POSIX
@pytest.mark.parametrize("sig, code, stderr", [
    ("SIGINT", 2, "mpgen: interrupted\n"),
    ("SIGTERM", -signal.SIGTERM, ""),
])
@pytest.mark.slow
def test_a_signal_between_renames_waits_for_the_whole_unit(tmp_path, sig, code, stderr):
    spec = seed_spec(tmp_path / "signalled")
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=spec.parent).returncode == 0
    spec.write_text(spec.read_text().replace("args: [20, 10]", "args: [20, 12]"))
    expected = whole_build(spec, tmp_path / "whole")
    script = SIGNALLED.format(tests=str(ROOT / "tests"), signal=sig, at=2)
    done = subprocess.run([sys.executable, "-c", script], cwd=spec.parent, capture_output=True,
                          text=True, timeout=600)
    assert (done.returncode, done.stderr) == (code, stderr)
    # No staging left, and the runtime as a whole build leaves it (untouched).
    assert contents(spec.parent / "out") == expected


def whole_build(spec: Path, folder: Path) -> dict[str, bytes | None]:
    """What a whole build of ``spec`` writes (``contents``), built in ``folder``
    by a process like the signalled one: not by this one, whose state the
    tests before it may have changed."""
    seed_spec(folder).write_text(spec.read_text())
    whole = subprocess.run([sys.executable, "-m", "mpgen", "build", "seed.yaml", "-o", "out"],
                           cwd=folder, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    return contents(folder / "out")


@NEEDS_POSIX
@pytest.mark.slow
def test_a_signal_in_the_runtime_folder_of_a_first_build_waits_for_the_whole_unit(tmp_path):
    spec = seed_spec(tmp_path / "signalled")
    expected = whole_build(spec, tmp_path / "whole")
    script = SIGNALLED.format(tests=str(ROOT / "tests"), signal="SIGTERM",
                              at=len(SEED_FILES) + 2)
    done = subprocess.run([sys.executable, "-c", script], cwd=spec.parent, capture_output=True,
                          text=True, timeout=600)
    assert (done.returncode, done.stderr) == (-signal.SIGTERM, "")
    assert contents(spec.parent / "out") == expected


# -- place --write -------------------------------------------------------------------

AUTO = """\
mpgen: 1
name: Auto
inputs:
  x: [batch, 8]
layers:
  a: {op: Linear, args: [8, 8]}
  b: {op: Linear, args: [8, 8]}
outputs: [b]
placement:
  auto: {devices: [cuda:0, cuda:1]}
"""


def test_place_write_writes_through_a_symlink_and_keeps_the_mode(tmp_path):
    real = spec_in(tmp_path / "specs", AUTO, "auto.yaml")
    os.chmod(real, 0o640)
    link = tmp_path / "link.yaml"
    link.symlink_to("specs/auto.yaml")
    result = mpgen("place", "link.yaml", "--write", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == "specs/auto.yaml"
    assert "# mpgen place --write: auto (" in real.read_text()
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path / "specs")) == ["auto.yaml"]


def test_place_write_refuses_a_read_only_spec(tmp_path):
    spec = write_spec(tmp_path, AUTO, "auto.yaml")
    os.chmod(spec, 0o444)
    result = mpgen("place", "auto.yaml", "--write", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("auto.yaml: cannot rewrite the spec: it is read-only (mode 0444); "
                             "make it writable first\n")
    assert spec.read_text() == AUTO


@contextlib.contextmanager
def read_only_folder(folder: Path):
    """A folder no one may write in: its mode for a user; for root, who
    ignores modes, the immutable attribute where the file system has it."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        try:
            yield "Permission denied"
        finally:
            os.chmod(folder, 0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and no immutable attribute here: nothing is read-only")
    try:
        yield "Operation not permitted"
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@NEEDS_POSIX
def test_place_write_in_a_read_only_folder_is_a_clean_error(tmp_path):
    spec = spec_in(tmp_path / "specs", AUTO, "auto.yaml")
    with read_only_folder(tmp_path / "specs") as why:
        result = mpgen("place", "specs/auto.yaml", "--write", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"specs/auto.yaml: cannot rewrite the spec: {why} (writing in "
                             f"{tmp_path / 'specs'}); the spec was not changed\n")
    assert spec.read_text() == AUTO


@NEEDS_POSIX
def test_build_into_a_read_only_folder_is_a_clean_error(tmp_path):
    seed_spec(tmp_path)
    (tmp_path / "out").mkdir()
    with read_only_folder(tmp_path / "out") as why:
        result = mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"out: cannot write the generated files: {why}: out; nothing was "
                             "changed\n")
    assert contents(tmp_path / "out") == {}


# -- exit codes: 0, 1, 2 and nothing else ---------------------------------------------

@pytest.mark.parametrize("args, code", [
    (["build", "seed.yaml", "-o", "out"], 0),
    (["check", "seed.yaml", "-o", "out"], 0),
    (["check", "seed.yaml", "-o", "elsewhere"], 1),
    (["build", "missing.yaml"], 2),
    (["build", "seed.yaml", "--no-such-flag"], 2),
    (["build"], 2),
    (["frobnicate"], 2),
    ([], 2),
    (["show", "seed.yaml", "--format", "yaml"], 2),
    (["build", "seed.yaml", "-o", "seed.yaml"], 2),  # the output folder is a file
    (["--version"], 0),
])
def test_exit_codes(tmp_path, args, code):
    seed_spec(tmp_path)
    assert mpgen("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    result = mpgen(*args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr


def test_an_output_folder_that_is_a_file_is_a_clean_error(tmp_path):
    seed_spec(tmp_path)
    result = mpgen("build", "seed.yaml", "-o", "seed.yaml", cwd=tmp_path)
    assert result.stderr == "seed.yaml: the output folder (-o) is a file, not a folder\n"


@NEEDS_POSIX
@pytest.mark.slow
def test_a_reader_that_goes_away_does_not_change_the_exit_code(tmp_path):
    seed_spec(tmp_path)
    # ``true`` exits long before mpgen (torch loads first) prints: every write fails.
    command = f"{shlex.quote(sys.executable)} -m mpgen show seed.yaml | true; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout == "0\n"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


# -- --root: the project a spec's dotted ops may import from -----------------------


@pytest.mark.slow
def test_root_names_the_project_for_every_command(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "mylayers.py").write_text(GATE)
    spec_in(tmp_path / "proj" / "specs", GATED.format(name="Gated"), "spec.yaml")
    (tmp_path / "elsewhere").mkdir()
    spec = "../proj/specs/spec.yaml"
    alone = mpgen("show", spec, cwd=tmp_path / "elsewhere")
    assert alone.returncode == 2
    assert alone.stderr.startswith("../proj/specs/spec.yaml:6:11: layer 'a': unknown op "
                                   "'mylayers.Gate': no module 'mylayers' in the spec's project")
    for args in (["build", spec, "-o", "out"], ["check", spec, "-o", "out"], ["show", spec],
                 ["place", spec], ["diff", spec, spec]):
        result = mpgen(*args, "--root", "../proj", cwd=tmp_path / "elsewhere")
        assert result.returncode == 0, (args, result.stderr)
        # build only notes where the generated code finds mylayers
        assert all(": note: " in line for line in result.stderr.splitlines()), args


@pytest.mark.slow
def test_diff_compiles_a_git_side_in_the_working_directory_s_project(repo):
    (repo / "mylayers.py").write_text(GATE)
    (repo / "gated.yaml").write_text(GATED.format(name="Gated"))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "gated")
    result = mpgen("diff", "HEAD:gated.yaml", "gated.yaml", cwd=repo)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("--- HEAD:gated.yaml\n+++ gated.yaml\n\nmoved: nothing\n")


# -- --time-limit: the CPU budget of each spec's build --------------------------

def test_time_limit_reaches_the_analysis(tmp_path):
    spec = str(EXAMPLES / "bert_base.yaml")
    for args in (["build", spec, "-o", "out"], ["check", spec, "-o", "out"], ["show", spec],
                 ["place", spec], ["diff", spec, spec]):
        result = mpgen(*args, "--time-limit", "0.01", cwd=tmp_path)
        assert result.returncode == 2, args
        assert result.stderr.startswith(f"{spec}:"), args
        assert " ran past the 0.01 s CPU budget of a build; " in result.stderr, args
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon", "0", "none", "601"])
def test_a_time_limit_that_is_not_a_number_of_seconds_is_a_usage_error(tmp_path, value):
    """0 (once: no limit) is refused too: a limit can be raised, never removed."""
    result = mpgen("show", "spec.yaml", "--time-limit", value, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.endswith(f"mpgen show: error: argument --time-limit: {value!r} is not "
                                  "a number of CPU seconds above 0 and at most 600 (a limit can "
                                  "be raised, never removed)\n")


def test_the_fix_repeats_a_raised_time_limit(tmp_path):
    seed_spec(tmp_path)
    result = mpgen("check", "seed.yaml", "-o", "out", "--time-limit", "30", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.endswith("run: mpgen build seed.yaml -o out --time-limit 30\n")
