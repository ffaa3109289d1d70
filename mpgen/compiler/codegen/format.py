"""Format generated source with black, in memory, and prove it compiles.

Black owns the layout of generated code. The one layout choice it cannot
make is where a shape comment goes: black never moves a comment, and splits
a call over several lines to make room for a trailing one. So a statement's
comment trails it when the line fits black's width, and stands on its own
line above it otherwise (:func:`with_comment`), by the same width black
formats to.
"""

from __future__ import annotations

import black

LINE_LENGTH = 88
_MODE = black.Mode(target_versions={black.TargetVersion.PY310}, line_length=LINE_LENGTH)


class GeneratedCodeError(Exception):
    """The compiler produced invalid Python: a bug in mpgen, not in the spec."""


def format_source(source: str, filename: str) -> str:
    """Black-formatted ``source``; raises GeneratedCodeError if it is not Python."""
    try:
        compile(source, filename, "exec", dont_inherit=True)
        return black.format_str(source, mode=_MODE)
    except (SyntaxError, black.InvalidInput) as exc:
        raise GeneratedCodeError(f"mpgen generated invalid Python for {filename}: {exc}") from exc


def with_comment(code: str, comment: str, indent: int) -> list[str]:
    """``code  # comment`` when black keeps it on one line at ``indent``
    columns, else the comment on its own line above ``code``."""
    if not comment:
        return [code]
    line = f"{code}  # {comment}"
    if indent + len(line) <= LINE_LENGTH:
        return [line]
    return [f"# {comment}", code]
