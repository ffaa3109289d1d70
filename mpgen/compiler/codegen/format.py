"""Generated source in black's layout, and the proof that it compiles.

Black owns the layout of generated code. The model module and the tests
are formatted by black whole (:func:`format_source`). The training script
and the pipeline program are written in black's layout directly (NOTE
[Written in black's layout]), and only proved to compile
(:func:`check_source`).

The one layout choice black cannot make is where a shape comment goes:
black never moves a comment, and splits a call over several lines to make
room for a trailing one. So a statement's comment trails it when the line
fits black's width, and stands on its own line above it otherwise
(:func:`with_comment`), by the same width black formats to.

# NOTE: [Written in black's layout]
# The static text of templates/train.py.jinja and pp.py.jinja is black's
# output (black 26, 88 columns: ``_MODE``) whatever the spec: what the spec
# writes into it (the model's name, file names) stands where black moves no
# line break for its length (a docstring, a comment, a string alone on its
# line in a call black splits anyway). Every other statement the spec
# decides is laid out where it is made, by :func:`layout` (in the templates
# ``{% filter layout %}``): written in black's spelling (``common.literal``:
# double quotes, black's numbers), each statement on one line or split one
# item a line with a trailing comma, it is black's layout as it is when
# every line fits, and otherwise black formats the fragment alone, at the
# width its indentation leaves. Black formats each statement on its own, so
# the pieces together are what black makes of the whole file. The static
# text holds the scaffold's names as they are: where a spec takes one, its
# suffix can move a line break, so that file goes through black whole
# (``common.laid_out``). tests/test_black_clean.py proves it for the
# examples and for specs that make black wrap; run it after editing a template.
"""

from __future__ import annotations

import dataclasses
import textwrap

import black

LINE_LENGTH = 88
_MODE = black.Mode(target_versions={black.TargetVersion.PY310}, line_length=LINE_LENGTH)


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
    try:
        return black.format_str(source, mode=_MODE)
    except black.InvalidInput as exc:
        raise GeneratedCodeError(f"mpgen generated invalid Python for {filename}: {exc}") from exc


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
    if not all(fits(line, indent) for line in code.splitlines()):
        mode = dataclasses.replace(_MODE, line_length=LINE_LENGTH - indent)
        try:
            code = black.format_str(code, mode=mode)
        except black.InvalidInput as exc:
            raise GeneratedCodeError(f"mpgen generated invalid Python: {exc}\n{code}") from exc
    return textwrap.indent(code, " " * indent)


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
