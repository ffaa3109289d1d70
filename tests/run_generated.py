"""Run generated code in this process: a training script's main, and the
checks of a generated test file on virtual devices (what its ``[virtual]``
runs check, without a pytest process per file: torch loads once)."""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
from pathlib import Path

from helpers import import_generated
from mpgen.testing import virtual_devices


def train_one_step(script: Path) -> str:
    """Run ``script``'s ``main(["--steps", "1"])``; what it printed."""
    _forget_model(script.name.removeprefix("train_"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        import_generated(script).main(["--steps", "1"])
    return out.getvalue()


def run_suite_on_virtual_devices(test_file: Path) -> list[str]:
    """Every check of the ``Test*`` class in ``test_file``, each in a fresh
    ``virtual_devices`` context as its ``[virtual]`` run; the names run.
    A failing check raises its AssertionError."""
    _forget_model(test_file.name.removeprefix("test_"))
    module = import_generated(test_file)
    [suite_class] = [c for name, c in vars(module).items()
                     if name.startswith("Test") and inspect.isclass(c)]
    ran = []
    for name in sorted(n for n in dir(suite_class) if n.startswith("test_")):
        suite = suite_class()
        with virtual_devices(cuda=max(suite.cuda_count, 1)) as devices:
            getattr(suite, name)(devices)
        ran.append(name)
    return ran


def _forget_model(file_name: str) -> None:
    """Drop an earlier import of the model module (another build of the same
    spec, e.g. for the CPU), so that the script imports the one next to it."""
    sys.modules.pop(file_name.removesuffix(".py"), None)
