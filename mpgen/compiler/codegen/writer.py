"""A writer of Python statements: indentation by blocks, nothing else.

The code generators emit statements through it (as torch.fx's codegen emits
its body) and black lays the result out; the only layout decision left to
the generators is a comment's place (``format.with_comment``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from mpgen.compiler.codegen.format import with_comment

INDENT = "    "


class PythonWriter:
    """Collects lines of Python at the current block depth."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._depth = 0

    def line(self, code: str = "", comment: Optional[str] = None) -> None:
        """One statement, with a trailing comment where it fits."""
        if not code:
            self._lines.append("")
            return
        for text in with_comment(code, comment or "", len(INDENT) * self._depth):
            self._lines.append(INDENT * self._depth + text)

    def comment(self, text: str) -> None:
        self._lines.append(f"{INDENT * self._depth}# {text}")

    def docstring(self, lines: Sequence[str]) -> None:
        """A docstring: one line as is; several end with the quotes alone."""
        pad = INDENT * self._depth
        if len(lines) == 1:
            self._lines.append(f'{pad}"""{lines[0]}"""')
            return
        self._lines.append(f'{pad}"""{lines[0]}')
        self._lines.extend(f"{pad}{line}" if line else "" for line in lines[1:])
        self._lines.append(f'{pad}"""')

    @contextlib.contextmanager
    def block(self, header: str) -> Iterator[None]:
        """``header:`` and an indented body."""
        self.line(f"{header}:")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
