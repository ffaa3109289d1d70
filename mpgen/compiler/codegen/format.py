"""Generated source in black's layout, and the proof that it compiles.

Black owns the layout of generated code, but a build does not run it over
the files: every generated Python file is written in black's layout
directly (NOTE [Written in black's layout]) and only proved to compile
(:func:`check_source`). Black is imported lazily, by the first statement
that does not fit its line (:func:`layout`) or the one file that goes
through it whole (:func:`format_source`, ``common.laid_out``).

The one layout choice black cannot make is where a shape comment goes:
black never moves a comment, and splits a call over several lines to make
room for a trailing one. So a statement's comment trails it when the line
fits black's width, and stands on its own line above it otherwise
(:func:`with_comment`), by the same width black formats to.

# NOTE: [Written in black's layout]
# The static text of the templates (test.py.jinja) is black's output (black 26, 88 columns: ``black_mode()``)
# whatever the spec: what the spec writes into it (the model's name, file
# names) stands where black moves no line break for its length (a
# docstring, a comment, a string alone on its line in a call black splits
# anyway). Every other statement the spec decides is laid out where it is
# made, by :func:`layout` (in the templates ``{% filter layout %}``; in the
# model module ``PythonWriter.line``, and ``PythonWriter.block`` for a
# compound statement's header through :func:`layout_header`): written in
# black's spelling (``common.literal``: double quotes, black's numbers),
# each statement on one line or split one item a line with a trailing comma,
# it is black's layout as it is when every line fits, and otherwise black
# formats the fragment alone, at the width its indentation leaves. Black
# formats each statement on its own, so the pieces together are what black
# makes of the whole file; the writer puts black's blank lines between them
# (two around a top-level class, one between methods and after a class
# docstring). The static text holds the scaffold's names as they are: where
# a spec takes one, its suffix can move a line break, so that file goes
# through black whole (``common.laid_out``). tests/compiler/codegen/test_black_clean.py
# proves it for the examples and for specs that make black wrap; run it
# after editing a template or a generator.
"""

from __future__ import annotations

import functools
import textwrap
from typing import TYPE_CHECKING, Optional

from mpgen.compiler.frontend.limits import tick

if TYPE_CHECKING:
    import black

LINE_LENGTH = 88


@functools.cache
def black_mode(line_length: int = LINE_LENGTH) -> "black.Mode":
    """Black's mode for generated code (black 26, Python 3.10, ``line_length``
    columns). Imports black: call it only where black runs."""
    import black

    return black.Mode(target_versions={black.TargetVersion.PY310}, line_length=line_length)


def _format_str(source: str, line_length: int, filename: Optional[str] = None) -> str:
    """``black.format_str`` at ``line_length``: black is imported here, on
    the first call, so that a build whose code all fits never imports it."""
    import black

    try:
        return black.format_str(source, mode=black_mode(line_length))
    except black.InvalidInput as exc:
        if filename is not None:
            raise GeneratedCodeError(
                f"mpgen generated invalid Python for {filename}: {exc}") from exc
        raise GeneratedCodeError(f"mpgen generated invalid Python: {exc}\n{source}") from exc


class GeneratedCodeError(Exception):
    """The compiler produced invalid Python: a bug in mpgen, not in the spec."""


def check_source(source: str, filename: str) -> str:
    """``source``, once proved to compile; raises GeneratedCodeError if it is not Python."""
    try:
        compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise GeneratedCodeError(f"mpgen generated invalid Python for {filename}: {exc}") from exc
    return source


def format_source(source: str, filename: str) -> str:
    """Black-formatted ``source``; raises GeneratedCodeError if it is not Python."""
    check_source(source, filename)
    return _format_str(source, LINE_LENGTH, filename)


def fits(line: str, indent: int = 0) -> bool:
    """Whether black keeps ``line`` on one line at ``indent`` columns (ASCII
    only: black measures other characters by their display width)."""
    return line.isascii() and indent + len(line) <= LINE_LENGTH


def layout(code: str, indent: int = 0) -> str:
    """Black's layout of ``code`` at ``indent`` columns (NOTE [Written in
    black's layout]), indented by ``indent``. ``code`` is statements at
    column 0 in black's spelling, each on one line or split one item a line
    with a trailing comma (which black keeps), and no multi-line string but
    docstrings; it is black's layout as it is where every line fits, else
    black formats it at the width left."""
    tick()  # every statement generated: the build's CPU budget (NOTE [A budget of CPU time])
    if not all(fits(line, indent) or _comment_line(line) for line in code.splitlines()):
        code = _format_str(code, LINE_LENGTH - indent)
    return textwrap.indent(code, " " * indent)


def _comment_line(line: str) -> bool:
    """A comment alone on its line: black never splits or moves one, however long."""
    return line.lstrip(" ").startswith("# ") and not line.endswith(" ")


def layout_header(header: str, indent: int = 0) -> list[str]:
    """The lines of ``header:`` (a compound statement's first clause, or an
    ``elif``/``else``/``except`` one) in black's layout at ``indent``
    columns, unindented: as it is when it fits, else black's split of it
    over a stand-in body (black lays out a header apart from its body)."""
    if fits(f"{header}:", indent):
        return [f"{header}:"]
    opening = ("try:\n    pass\n" if header.startswith(("except", "finally")) else
               "if _:\n    pass\n" if header.startswith(("elif ", "else")) else "")
    lines = _format_str(f"{opening}{header}:\n    pass\n", LINE_LENGTH - indent).splitlines()
    return lines[2 if opening else 0:-1]


def layout_block(text: str) -> str:
    """The templates' ``layout`` filter: the statements of a ``{% filter
    layout %}`` block, at the indentation of its first line, through :func:`layout`."""
    indent = len(text) - len(text.lstrip(" "))
    return layout(textwrap.dedent(text), indent)


def with_comment(code: str, comment: str, indent: int) -> list[str]:
    """``code  # comment`` when black keeps it on one line at ``indent``
    columns, else the comment on its own line above ``code``."""
    if not comment:
        return [code]
    line = f"{code}  # {comment}"
    if indent + len(line) <= LINE_LENGTH:
        return [line]
    return [f"# {comment}", code]
