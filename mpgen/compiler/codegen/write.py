"""Write generated files atomically, or compare them with what is on disk."""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path
from typing import Mapping

from mpgen.errors import MpgenError, Position


def write_files(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """Write every changed file: all to temporary files first, then each
    renamed over its target (``os.replace``), so a failure (a full disk, a
    read-only folder) leaves every old file as it was. Files whose content
    is unchanged are left untouched (their mtime too). OS errors become
    :class:`MpgenError`.
    """
    changed = {}
    for name, text in files.items():
        path = out_dir / name
        data = text.encode("utf-8")
        if not (path.is_file() and path.read_bytes() == data):
            changed[path] = data
    if not changed:
        return []
    temps: dict[Path, str] = {}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path, data in changed.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=out_dir)
            temps[path] = tmp
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    except OSError as exc:
        raise MpgenError(Position(str(out_dir)), f"cannot write the generated files: "
                         f"{exc.strerror or exc}: {exc.filename or out_dir}") from None
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
    return list(changed)


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
