"""Error fixtures: every bad spec in ``tests/errors`` gives exactly its ``.expected``.

Each case is ``tests/errors/<case>.yaml`` plus ``<case>.expected``, the full
stderr of ``mpgen build tests/errors/<case>.yaml -o OUT`` run from the repository
root (so paths in messages are relative and stable). An optional
``<case>.args`` holds extra command-line arguments (``--device-map ...`` or a
second spec). For every case the build must exit 2, print no traceback and
nothing on stdout, and leave the output directory exactly as it was, here one
that already holds the files of a good build.

The cases run in-process through ``mpgen.cli.main`` (see
:func:`helpers.mpgen`: an exception escaping ``main`` becomes a traceback on
stderr and exit 1, a warning is printed as a fresh interpreter would print
it), so the module takes seconds, not minutes. One case also runs through the
real ``python -m mpgen`` and the installed ``mpgen`` script, proving that the
command line is wired to the same code.

Regenerate the expected files after a deliberate change of wording with::

    MPGEN_UPDATE_EXPECTED=1 .venv/bin/python -m pytest tests/test_errors.py

and review the diff: each message must point at the right node and say what
to do. Cases listed in ``XFAIL`` document compiler bugs: their ``.expected``
holds the *intended* message, written by hand, and is never regenerated.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import mpgen, mpgen_process

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = ROOT / "tests" / "errors"
# A profile beside a case (<case>.profile.yaml, `mpgen profile`) is read by it, not a case.
CASES = sorted(p.stem for p in CASES_DIR.glob("*.yaml") if not p.name.endswith(".profile.yaml"))
UPDATE = os.environ.get("MPGEN_UPDATE_EXPECTED") == "1"
REGENERATE = "MPGEN_UPDATE_EXPECTED=1 .venv/bin/python -m pytest tests/test_errors.py"

#: Cases whose current output is a known compiler bug (reported, not fixed
#: here); their .expected files say what the message should be.
XFAIL: dict[str, str] = {}

#: One line of a report: a position in a fixture (or a CLI flag), a message.
_LINE = re.compile(
    r"^(tests/errors/[\w/.]+\.yaml(:\d+:\d+)?: |--device-map: |\.\.\. and \d+ more errors$"
    r"|\.\.\. too many errors; stopping$)"
)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    before: dict
    after: dict


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` (hidden ones too): bytes and mtime."""
    if not folder.exists():
        return {"<absent>": None}
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*")) if p.is_file()
    } | {str(p.relative_to(folder)) + "/": None for p in folder.rglob("*") if p.is_dir()}


def case_args(case: str) -> list[str]:
    extra = CASES_DIR / f"{case}.args"
    args = shlex.split(extra.read_text()) if extra.exists() else []
    return ["build", f"tests/errors/{case}.yaml", *args]


def run_case(case: str, out: Path, seed: Path | None, command: list[str] | None = None) -> Run:
    """``mpgen build`` one case from the repository root, in this process (see
    :func:`helpers.mpgen`), or in a fresh one with ``command`` (``python -m mpgen``)."""
    if seed is not None:
        shutil.copytree(seed, out)
    before = snapshot(out)
    if command is None:
        ran = mpgen(*case_args(case), "-o", str(out), cwd=ROOT)
    else:
        ran = mpgen_process(*case_args(case), "-o", str(out), cwd=ROOT, command=command,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return Run(ran.returncode, ran.stdout, ran.stderr, before, snapshot(out))


@pytest.fixture(scope="module")
def good_build(tmp_path_factory) -> Path:
    """An output folder holding a good build, plus a file of the user's."""
    out = tmp_path_factory.mktemp("good") / "out"
    ran = mpgen("build", "examples/seed.yaml", "-o", str(out), cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    (out / "NOTES.txt").write_text("the user's own file\n")
    return out


#: Cases whose spec names a user module: it is imported in a child interpreter.
SLOW = {"import_policy", "op_not_a_module"}


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(reason=XFAIL[case], strict=True)] if case in XFAIL else []
        marks += [pytest.mark.slow] if case in SLOW else []
        yield pytest.param(case, marks=marks, id=case)


def test_there_are_enough_cases():
    assert len(CASES) >= 35


def test_every_case_has_an_expected_file():
    missing = [c for c in CASES if not (CASES_DIR / f"{c}.expected").exists()]
    if UPDATE:
        missing = [c for c in missing if c in XFAIL]
    assert not missing, f"no .expected for {missing}; run: {REGENERATE}"
    orphans = [p.name for p in CASES_DIR.glob("*.expected") if p.stem not in CASES]
    orphans += [p.name for p in CASES_DIR.glob("*.args") if p.stem not in CASES]
    assert not orphans, f"files without a case: {orphans}"
    assert set(XFAIL) <= set(CASES)


@pytest.mark.parametrize("case", list(_params()))
def test_error_fixture(case: str, good_build: Path, tmp_path: Path):
    check_case(case, run_case(case, tmp_path / "out", good_build))


def check_case(case: str, run: Run) -> None:
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    assert run.after == run.before, "the output directory was changed"
    assert run.stderr.endswith("\n") and run.stderr.strip(), "no error message"
    bad = [line for line in run.stderr.splitlines() if not _LINE.match(line)]
    assert not bad, f"lines not of the form FILE:LINE:COL: message: {bad}"
    expected_file = CASES_DIR / f"{case}.expected"
    if UPDATE and case not in XFAIL:
        expected_file.write_text(run.stderr, encoding="utf-8")
        return
    expected = expected_file.read_text(encoding="utf-8")
    if run.stderr != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), run.stderr.splitlines(keepends=True),
            fromfile=f"{case}.expected", tofile="stderr",
        ))
        pytest.fail(f"stderr differs from {case}.expected:\n{diff}\n"
                    f"if the change is deliberate, run: {REGENERATE}", pytrace=False)


#: One case per stage that must not create a missing output directory.
_ONE_PER_STAGE = ["yaml_unclosed_bracket", "schema_unknown_keys", "op_unknown",
                  "shape_linear", "placement_unknown_key", "train_unknown_kwargs",
                  "cli_device_map"]


@pytest.mark.parametrize("case", _ONE_PER_STAGE)
def test_missing_output_directory_is_not_created(case: str, tmp_path: Path):
    out = tmp_path / "not" / "there"
    run = run_case(case, out, seed=None)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "not").exists()


#: The case that also runs through the real command line, in fresh interpreters.
WIRED_CASE = "cli_missing_spec"  # two specs from argv: a position in one, the other missing


# Slow: two fresh interpreters (python -m mpgen and the mpgen script)
@pytest.mark.slow
def test_the_real_command_line_gives_the_expected_report(tmp_path: Path, good_build: Path):
    """``python -m mpgen`` and the installed ``mpgen`` script: exit 2, exactly the
    ``.expected`` stderr (so no traceback), nothing on stdout, nothing written."""
    script = Path(sys.executable).with_name("mpgen")
    assert script.exists(), f"no console script {script}: pip install -e '.[test]'"
    commands = {"python -m mpgen": [sys.executable, "-m", "mpgen"], "mpgen": [str(script)]}
    with ThreadPoolExecutor(len(commands)) as pool:  # each run loads torch: overlap them
        runs = {how: pool.submit(run_case, WIRED_CASE, tmp_path / f"out{i}", good_build, command)
                for i, (how, command) in enumerate(commands.items())}
        for how, future in runs.items():
            run = future.result()
            try:
                check_case(WIRED_CASE, run)
            except BaseException as exc:
                raise AssertionError(f"through `{how}`") from exc
