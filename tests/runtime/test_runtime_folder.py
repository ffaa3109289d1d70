"""The runtime folder of an output folder (mpgen/output/runtime.py, NOTE [One
runtime per output folder]): written once for every spec, compared by
``check``, and the only thing a change to the loop changes."""

from __future__ import annotations

import pytest

from helpers import EXAMPLES
from mpgen.commands import build
from mpgen.errors import MpgenError
from mpgen.output import runtime

SPECS = [EXAMPLES / "seed.yaml", EXAMPLES / "residual_mlp.yaml"]


@pytest.fixture
def built(tmp_path):
    out = tmp_path / "out"
    build.build(SPECS, out)
    return out


def test_one_runtime_folder_serves_every_spec(built):
    copies = sorted(p.relative_to(built).as_posix() for p in built.rglob("*.py")
                    if "mpgen_runtime" in p.parts)
    assert copies == sorted(runtime.files())
    loop = (built / "mpgen_runtime" / "loop.py").read_text()
    assert loop.splitlines()[0] == runtime.HEADER
    source = (build.__file__.rsplit("/commands/", 1)[0] + "/runtime/loop.py")
    assert loop.split("\n", 1)[1] == open(source).read()  # verbatim below the header
    assert "import mpgen_runtime" in (built / "train_simple_model.py").read_text()


def test_a_change_to_the_loop_changes_the_runtime_folder_and_no_per_spec_file(
        built, monkeypatch):
    files = dict(runtime.files())
    key = "mpgen_runtime/log.py"
    files[key] = files[key].replace('self.say(f"log: {self.path}")',
                                    'self.say(f"the log: {self.path}")')
    monkeypatch.setattr(runtime, "files", lambda: files)
    differences = build.check(SPECS, built)
    assert len(differences.texts) == 1 and key in differences.texts[0]
    _, changes = build.build(SPECS, built)
    assert [p.relative_to(built).as_posix() for p in changes.written] == [key]


def test_check_names_the_mpgen_a_runtime_file_comes_from(built):
    loop = built / "mpgen_runtime" / "loop.py"
    text = loop.read_text().replace(runtime.__version__, "0.0.1", 1)
    loop.write_text(text.replace("def run(", "def run_old(", 1))
    [report] = build.check(SPECS, built).texts
    assert f"{loop}: from mpgen 0.0.1's runtime; this is mpgen {runtime.__version__}" in report


def test_an_older_runtimes_extra_file_is_removed_and_a_stranger_reported(built):
    (built / "mpgen_runtime" / "retired.py").write_text(
        runtime.HEADER.replace(runtime.__version__, "0.0.1") + "\n")
    (built / "mpgen_runtime" / "mine.py").write_text("# no header\n")
    report = "".join(build.check(SPECS, built).texts)
    assert "retired.py: generated from the runtime of mpgen 0.0.1, which no longer " \
           "generates it; build would remove it" in report
    assert f"mine.py: not a file of mpgen {runtime.__version__}'s runtime" in report
    _, changes = build.build(SPECS, built)
    assert not (built / "mpgen_runtime" / "retired.py").exists()
    assert (built / "mpgen_runtime" / "mine.py").exists()  # a stranger is left, and reported


def test_a_runtime_folder_that_is_a_link_is_refused_even_with_force(built, tmp_path):
    # A pull request can commit generated/mpgen_runtime as a link: a build
    # would write the runtime through it, outside the output folder.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = built / "mpgen_runtime"
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    folder.symlink_to(elsewhere)
    for force in (False, True):
        with pytest.raises(MpgenError, match="a symbolic link, not the folder mpgen writes "
                                             "mpgen_runtime/ in; remove it and build again"):
            build.build(SPECS, built, force=force)
    assert list(elsewhere.iterdir()) == []
