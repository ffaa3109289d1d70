"""Format generated source with black, in memory, and prove it compiles."""

from __future__ import annotations

import black

_MODE = black.Mode(target_versions={black.TargetVersion.PY310}, line_length=88)


class GeneratedCodeError(Exception):
    """The compiler produced invalid Python: a bug in mpgen, not in the spec."""


def format_source(source: str, filename: str) -> str:
    """Black-formatted ``source``; raises GeneratedCodeError if it is not Python."""
    try:
        compile(source, filename, "exec", dont_inherit=True)
        return black.format_str(source, mode=_MODE)
    except (SyntaxError, black.InvalidInput) as exc:
        raise GeneratedCodeError(f"mpgen generated invalid Python for {filename}: {exc}") from exc
