"""The oracle of the fuzz tests: what any spec, however broken, must give.

A build of any spec either exits 0 with generated files that compile and in
which no spec text became code (:func:`assert_safe_code`), or exits 2 with
nothing on stdout, every stderr line ``FILE:LINE:COL: message`` (or
``FILE: message`` for a problem of the whole file) and no output folder
written (:func:`assert_reported`); never a traceback (:func:`build_path`
fails the test with the spec), never a hang (``helpers.time_limit``).
``tests/test_hostile_input.py`` and ``tests/test_fuzz.py`` share it.
"""

from __future__ import annotations

import ast
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import mpgen

#: Names that generated code never needs; their appearance as code (not as a
#: string constant) means something from a spec became code.
FORBIDDEN_NAMES = {"__import__", "eval", "exec", "compile", "open", "os", "system",
                   "subprocess", "Popen", "builtins", "getattr", "globals", "breakpoint",
                   "input", "save", "load", "from_file"}
FORBIDDEN_ATTRIBUTES = {"system", "popen", "Popen", "__import__", "__builtins__", "__globals__",
                        "__subclasses__", "rmtree", "from_file", "loads"}


@dataclass
class Result:
    code: int
    out: str
    err: str
    out_dir: Path

    def files(self) -> dict[str, str]:
        if not self.out_dir.exists():
            return {}
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(self.out_dir.glob("*.py"))}


def build_text(tmp_path: Path, text: str | bytes, *args: str, name: str = "spec.yaml") -> Result:
    """Write ``text`` as a spec and run ``mpgen build`` on it in-process."""
    folder = tmp_path / uuid.uuid4().hex[:8]
    folder.mkdir()
    spec = folder / name
    spec.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return build_path(spec, folder / "out", *args)


def build_path(spec: Path, out: Path, *args: str, cwd: Path | None = None) -> Result:
    """``mpgen build SPEC -o OUT ARGS`` in-process; an escaping exception fails the test."""
    ran = mpgen("build", str(spec), "-o", str(out), *args, cwd=cwd)
    if ran.returncode == 1 and "Traceback (most recent call last)" in ran.stderr:
        pytest.fail(f"mpgen raised instead of reporting:\n{ran.stderr}\n"
                    f"spec:\n{((cwd or Path.cwd()) / spec).read_bytes()[:2000]!r}")
    return Result(ran.returncode, ran.stdout, ran.stderr, out)


def assert_reported(result: Result, spec_name: str = "spec.yaml", *,
                    whole_file: bool = False) -> None:
    """Exit 2, only ``FILE:LINE:COL: message`` lines (and ``FILE: message``
    with ``whole_file``), nothing written."""
    assert "Traceback" not in result.err + result.out
    assert result.code == 2, (result.code, result.err, result.out)
    assert result.out == ""
    lines = result.err.splitlines()
    assert lines, "no error message"
    where = r":\d+:\d+: \S" + (r"|: \S" if whole_file else "")
    # The summary lines of a long report (mpgen.errors).
    position = re.compile(rf"^.*{re.escape(spec_name)}(?:{where})"
                          r"|^\.\.\. and \d+ more errors$|^\.\.\. too many errors; stopping$")
    bad = [line for line in lines if not position.match(line)]
    assert not bad, f"not FILE:LINE:COL: message: {bad}"
    assert not result.out_dir.exists(), "an output directory was created"


def assert_safe_code(files: dict[str, str]) -> None:
    """Every generated file compiles, and no spec text became a name or call."""
    assert files
    for name, text in files.items():
        tree = ast.parse(text, name)
        compile(text, name, "exec", dont_inherit=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                assert node.id not in FORBIDDEN_NAMES, (name, ast.unparse(node))
            elif isinstance(node, ast.Attribute):
                assert node.attr not in FORBIDDEN_ATTRIBUTES, (name, ast.unparse(node))


def assert_built_or_reported(result: Result, where: str = "") -> None:
    """The oracle: exit 0 and safe code that compiles, or exit 2 and positions."""
    try:
        assert result.code in (0, 2), (result.code, result.err)
        if result.code == 2:
            assert_reported(result, whole_file=True)
        else:
            assert_safe_code(result.files())
    except (AssertionError, SyntaxError) as exc:
        raise AssertionError(f"{where}\nstderr:\n{result.err}") from exc


def paths(node, path=()):
    """Every path into a tree of dicts and lists, the root's ``()`` first."""
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, path + (i,))
