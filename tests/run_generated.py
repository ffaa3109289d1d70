"""Run generated code in this process: a training script's main, the checks
of a generated test file on virtual devices (what its ``[virtual]`` runs
check), and a test file under pytest -- without a process per file: torch
loads once."""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import import_generated
from mpgen.testing import virtual_devices


def train_one_step(script: Path) -> str:
    """Run ``script``'s training (``python script --steps 1``) in this
    process, on the runtime of its folder; what it printed."""
    model = script.stem.removeprefix("train_")
    before, path = sys.modules.get(model), list(sys.path)
    _forget_model(script.name.removeprefix("train_"))
    try:
        module = import_generated(script)
        import mpgen_runtime  # the copy in the script's folder, now on sys.path

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            mpgen_runtime.train(module.TRAINING, ["--steps", "1"])
        return out.getvalue()
    finally:  # a test module of the same name (tests/runtime/tiny.py) is left as it was
        sys.modules.pop(model, None)
        if before is not None:
            sys.modules[model] = before
        sys.path[:] = path


def run_suite_on_virtual_devices(test_file: Path) -> list[str]:
    """Every check of the ``Test*`` class in ``test_file``, each in a fresh
    ``virtual_devices`` context as its ``[virtual]`` run; the names run.
    A failing check raises its AssertionError."""
    _forget_model(test_file.name.removeprefix("test_"))
    module = import_generated(test_file)
    [suite_class] = [c for name, c in vars(module).items()
                     if name.startswith("Test") and inspect.isclass(c)]
    ran = []
    for name in sorted(n for n in dir(suite_class)
                       if n.startswith("test_") and callable(getattr(suite_class, n))):
        suite = suite_class()
        with virtual_devices(cuda=max(suite.cuda_count, 1)) as devices:
            getattr(suite, name)(devices)
        ran.append(name)
    return ran


def _forget_model(file_name: str) -> None:
    """Drop an earlier import of the model module (another build of the same
    spec, e.g. for the CPU), so that the script imports the one next to it."""
    sys.modules.pop(file_name.removesuffix(".py"), None)


@dataclass
class Outcome:
    exit_code: int
    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why each skipped
    text: str = ""  # the failures' reports

    def pytest_runtest_logreport(self, report) -> None:
        if report.passed and report.when == "call":
            self.passed.append(report.nodeid)
        elif report.skipped:
            self.skipped.append(report.nodeid)
            self.reasons.append(report.longrepr[2])
        elif report.failed:
            self.failed.append(report.nodeid)
            self.text += report.longreprtext + "\n"

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.failed.append(report.nodeid)
            self.text += report.longreprtext + "\n"


def run_pytest(test_file: Path, *args: str) -> Outcome:
    """Run a generated test file with pytest, in this process."""
    folder = test_file.parent
    own = {p.stem for p in folder.glob("*.py")}
    path = list(sys.path)

    def forget() -> None:  # each build has its own modules of the same names
        for name in own & set(sys.modules):
            del sys.modules[name]

    forget()
    outcome = Outcome(exit_code=-1)
    try:
        outcome.exit_code = int(
            pytest.main(
                ["-q", "-p", "no:cacheprovider", "--rootdir", str(folder), *args, str(test_file)],
                plugins=[outcome],
            )
        )
    finally:
        forget()
        sys.path[:] = path
    return outcome
