"""A writer of Python statements in black's layout, by blocks.

The code generators emit statements through it (as torch.fx's codegen emits
its body), each on one line in black's spelling (``common.literal``), and
the blank lines black puts between them. The writer lays out each statement
where it stands (``format.layout``: as it is when it fits, else black
formats that statement alone), and a comment where black would keep it
(``format.with_comment``), so the text is black's layout of the whole
(NOTE [Written in black's layout] in format.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from mpgen.compiler.codegen.format import layout, layout_header, with_comment

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
        indent = len(INDENT) * self._depth
        for text in with_comment(code, comment or "", indent):
            self._lines.extend(layout(text + "\n", indent).splitlines())

    def comment(self, text: str) -> None:
        """A comment on its own line (black never moves or splits one)."""
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
        """``header:`` (``format.layout_header``) and an indented body."""
        pad = INDENT * self._depth
        self._lines.extend(pad + line for line in layout_header(header, len(pad)))
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
