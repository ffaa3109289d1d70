"""Error fixtures: every bad spec in ``tests/errors`` gives exactly its ``.expected``.

Each case is ``tests/errors/<case>.yaml`` plus ``<case>.expected``, the full
stderr of ``mpgen build tests/errors/<case>.yaml -o OUT`` run from the repository
root (so paths in messages are relative and stable). An optional
``<case>.args`` holds extra command-line arguments (``--device-map ...`` or a
second spec). For every case the build must exit 2, print no traceback and
nothing on stdout, and leave the output directory exactly as it was, here one
that already holds the files of a good build.

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
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = ROOT / "tests" / "errors"
CASES = sorted(p.stem for p in CASES_DIR.glob("*.yaml"))
UPDATE = os.environ.get("MPGEN_UPDATE_EXPECTED") == "1"
REGENERATE = "MPGEN_UPDATE_EXPECTED=1 .venv/bin/python -m pytest tests/test_errors.py"

#: Cases whose current output is a known compiler bug (reported, not fixed
#: here); their .expected files say what the message should be.
XFAIL: dict[str, str] = {}

#: One line of a report: a position in a fixture (or a CLI flag), a message.
_LINE = re.compile(
    r"^(tests/errors/[\w/]+\.yaml(:\d+:\d+)?: |--device-map: |\.\.\. and \d+ more errors$)"
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


def mpgen_build(case: str, out: Path) -> subprocess.CompletedProcess:
    extra = (CASES_DIR / f"{case}.args")
    args = shlex.split(extra.read_text()) if extra.exists() else []
    return subprocess.run(
        [sys.executable, "-m", "mpgen", "build", f"tests/errors/{case}.yaml", *args,
         "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


def run_case(case: str, out: Path, seed: Path | None) -> Run:
    if seed is not None:
        shutil.copytree(seed, out)
    before = snapshot(out)
    proc = mpgen_build(case, out)
    return Run(proc.returncode, proc.stdout, proc.stderr, before, snapshot(out))


@pytest.fixture(scope="module")
def good_build(tmp_path_factory) -> Path:
    """An output folder holding a good build, plus a file of the user's."""
    out = tmp_path_factory.mktemp("good") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mpgen", "build", "examples/seed.yaml", "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (out / "NOTES.txt").write_text("the user's own file\n")
    return out


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, good_build) -> dict[str, Run]:
    """Run every selected case once, in parallel (each run is a fresh interpreter)."""
    selected = sorted({
        item.callspec.params["case"] for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
        and "case" in item.callspec.params
    })
    base = tmp_path_factory.mktemp("runs")
    workers = max(2, min(8, os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:
        futures = {c: pool.submit(run_case, c, base / c, good_build) for c in selected}
        return {c: f.result() for c, f in futures.items()}


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(reason=XFAIL[case], strict=True)] if case in XFAIL else []
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
def test_error_fixture(case: str, runs: dict[str, Run]):
    run = runs[case]
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
