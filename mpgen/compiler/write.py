"""Write generated files atomically, or compare them with what is on disk."""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path
from typing import Mapping


def write_files(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """Write every file via a temporary file and ``os.replace``.

    Files whose content is unchanged are left untouched (their mtime too).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out_dir / name
        data = text.encode("utf-8")
        if path.is_file() and path.read_bytes() == data:
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        written.append(path)
    return written


def diff_files(out_dir: Path, files: Mapping[str, str]) -> list[str]:
    """Unified diffs for each file that is missing or differs from ``files``."""
    diffs = []
    for name, text in files.items():
        path = out_dir / name
        try:
            current = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            diffs.append(f"missing: {path}\n")
            continue
        except (OSError, UnicodeDecodeError) as exc:
            diffs.append(f"unreadable: {path}: {exc}\n")
            continue
        if current != text:
            diffs.append("".join(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (on disk)", tofile=f"{path} (generated)",
            )))
    return diffs
