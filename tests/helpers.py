"""Shared helpers for the project's tests: build specs, run the CLI, import generated code."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import signal
import subprocess
import sys
import textwrap
import traceback
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from mpgen import cli
from mpgen.compiler import driver as build

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


#: A one-layer spec whose layer is a user module, ``mylayers.Gate`` (:data:`GATE`).
GATED = """\
mpgen: 1
name: {name}
inputs:
  x: [batch, 8]
layers:
  a: {{op: mylayers.Gate, args: [8]}}
outputs: [a]
"""
GATE = """\
from torch import nn


class Gate(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return self.fc(x)
"""


def listing(folder: Path) -> list[str]:
    """The names in an output folder, sorted (the build manifest is kept
    elsewhere: NOTE [Build manifest])."""
    return sorted(os.listdir(folder))


def files_in(folder: Path) -> list[str]:
    """Every file under an output folder as a path relative to it, sorted:
    the specs' files and those of the runtime folder (``mpgen_runtime/loop.py``)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if not p.is_dir() or p.is_symlink())


def runtime_files() -> list[str]:
    """The files a build writes in the runtime folder (``mpgen_runtime/...``),
    sorted: any build of at least one spec writes them (NOTE [One runtime per
    output folder])."""
    from mpgen.output import runtime

    return sorted(runtime.files())


def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def write_factory(folder: Path, factory: str) -> None:
    """The project module of a data factory ``package.module:function`` in
    ``folder``, defining the function (a build reads it under the import
    policy; the function is never called)."""
    module, _, function = factory.partition(":")
    *packages, last = module.split(".")
    folder.joinpath(*packages).mkdir(parents=True, exist_ok=True)
    for k in range(len(packages)):
        folder.joinpath(*packages[:k + 1], "__init__.py").touch()
    folder.joinpath(*packages, f"{last}.py").write_text(
        f"def {function}(**kwargs):\n    raise NotImplementedError\n", encoding="utf-8")


def import_generated(path: Path):
    """Import a generated file as a fresh module (its folder on sys.path)."""
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = f"{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_to(spec: Path, out: Path, device_map: dict | None = None) -> build.Generated:
    """Generate one spec and write its files to ``out``, with the runtime
    folder its scripts import (as ``mpgen build`` writes it)."""
    result = build.generate(spec, device_map)
    from mpgen.output import runtime
    from mpgen.output.write import write_files

    write_files(out, {**runtime.files(), **result.files})
    return result


@dataclass
class Ran:
    """What a run of the CLI left: exit status and everything it printed."""

    returncode: int
    stdout: str
    stderr: str


def mpgen(*args: str, cwd: Path | None = None) -> Ran:
    """Run ``mpgen ARGS`` in this process, seen as ``python -m mpgen ARGS`` in a
    fresh one would be: the exit status (1 and a traceback on stderr when an
    exception escapes ``main``, the code of a ``SystemExit``), stdout, and
    stderr with any warning printed the way a fresh interpreter's default
    filters would print it (pytest's capture of warnings does not hide them).
    The working directory is ``cwd`` for the run only.
    """
    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    home = os.getcwd()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        # The filters of `python` started without -W or PYTHONWARNINGS.
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                         ResourceWarning):
            warnings.filterwarnings("ignore", category=category, append=True)
        warnings.showwarning = show
        try:
            if cwd is not None:
                os.chdir(cwd)
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print
            traceback.print_exc()
            code = 1
        finally:
            os.chdir(home)
    return Ran(int(code or 0), out.getvalue(), err.getvalue())


def mpgen_process(*args: str, cwd: Path | None = None, env: dict | None = None,
                  command: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as a user would (slow: torch loads
    each time); ``command`` replaces ``python -m mpgen`` (the console script)."""
    return subprocess.run(
        [*(command or [sys.executable, "-m", "mpgen"]), *args], cwd=cwd, capture_output=True,
        text=True, timeout=300, env=env,
    )


class Hang(BaseException):
    """Code ran past its :func:`time_limit` (a BaseException, as
    KeyboardInterrupt: no ``except Exception`` in mpgen turns it into a spec
    error)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`Hang` in the block after ``seconds``, to fail instead of
    hanging (SIGALRM: the main thread, where pytest runs tests; it also
    interrupts a blocking read)."""
    def interrupt(signum, frame):
        raise Hang(f"still running after {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

