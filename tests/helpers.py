"""Shared helpers for the project's tests: build specs, import generated code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from mpgen.compiler import pipeline as build

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


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
    """Generate one spec and write its files to ``out``."""
    result = build.generate(spec, device_map)
    from mpgen.compiler.codegen.write import write_files

    write_files(out, result.files)
    return result


def mpgen(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "mpgen", *args], cwd=cwd, capture_output=True, text=True,
        timeout=300,
    )
