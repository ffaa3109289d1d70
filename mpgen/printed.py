"""Text mpgen prints, made inert: for a terminal, a CI log and Markdown.

A spec's file name, a layer's name, a message quoting either, a line of a
hand-edited generated file: whatever a pull request can choose reaches a
terminal, a CI log or a pull-request comment only through this module
(NOTE [Printed text is inert]).
"""

from __future__ import annotations

import re

# NOTE: [Printed text is inert]
# A pull request chooses its specs' file names (which may hold a newline, an
# escape sequence or a carriage return), the names inside them and the bytes of
# any file it hand-edits, and CI prints them. Three readers act on what they
# are shown:
#
# - a terminal runs escape sequences (ESC ] 0 ; title BEL sets the window
#   title, others move the cursor or rewrite the line a reader trusts);
# - GitHub Actions runs a workflow command from a log line that starts with
#   ``::`` after any white space (``::error::``, ``::add-mask::``,
#   ``::stop-commands::``), and one in the legacy spelling ``##[error]``
#   from *anywhere* in a line; its runner splits lines at ``\r`` as well as
#   ``\n``;
# - Markdown (a step summary, a comment) renders HTML, links, @mentions and
#   line breaks.
#
# So every control character (C0, DEL, C1), the Unicode line and paragraph
# separators and the bidirectional overrides are written as Python writes
# them in a string literal (``\n``, ``\x1b``, ``\u202e``): visible, and
# never acted on. ``log_text`` keeps the line breaks mpgen itself puts
# between lines (and tabs), escapes ``[`` in ``##[`` and the first ``:`` of a
# line that would start a workflow command (``\x3a:error::...``).
# ``code_span`` and ``fenced`` put a name or a block in Markdown code, where
# HTML, links and mentions are text. The CLI prints every line through
# ``log_text``; ``Position`` shows its file name ``escaped``.

#: What is never printed raw: C0 controls, DEL, C1 controls, the line and
#: paragraph separators, and the bidirectional formatting characters.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f"
                      "\u202a-\u202e\u2066-\u2069]")
#: The same, but a tab: kept in a line of output.
_CONTROL_IN_LINE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e"
                              "\u200f\u202a-\u202e\u2066-\u2069]")
#: The legacy spelling of a workflow command, acted on anywhere in a line.
LEGACY_COMMAND = "##["


def _escape(match: re.Match) -> str:
    return repr(match.group())[1:-1]  # '\x1b' -> \x1b, '\n' -> \n, '\u2028' -> \u2028


def escaped(text: str) -> str:
    """``text`` with every control character written as a Python escape: one
    line, and nothing in it a terminal acts on."""
    return _CONTROL.sub(_escape, text)


def log_line(line: str) -> str:
    """One line of output, safe for a terminal and a CI log: controls
    escaped (tabs kept), no workflow command in it."""
    line = _CONTROL_IN_LINE.sub(_escape, line).replace(LEGACY_COMMAND, "##\\x5b")
    stripped = line.lstrip()
    if stripped.startswith("::"):
        indent = len(line) - len(stripped)
        line = f"{line[:indent]}\\x3a{line[indent + 1:]}"
    return line


def log_text(text: str) -> str:
    """Lines of output (separated by ``\\n``), each made a :func:`log_line`."""
    return "\n".join(log_line(line) for line in text.split("\n"))


def _longest_backticks(text: str) -> int:
    return max((len(run) for run in re.findall("`+", text)), default=0)


def code_span(text: str, cell: bool = False) -> str:
    """``text`` as Markdown inline code, shown as it is (controls escaped):
    delimited by a run of backticks longer than any inside, padded with a
    space where CommonMark would otherwise read or strip one. In a table
    ``cell``, a ``|`` is escaped as GitHub reads it there (also inside code)."""
    text = escaped(text)
    ticks = "`" * (_longest_backticks(text) + 1)
    pad = (text.startswith("`") or text.endswith("`")
           or (text.startswith(" ") and text.endswith(" ") and text.strip(" ") != ""))
    if cell:
        text = text.replace("|", "\\|")
    space = " " if pad else ""
    return f"{ticks}{space}{text}{space}{ticks}"


def fenced(text: str, info: str = "text") -> list[str]:
    """``text`` as the lines of a fenced Markdown block, each a
    :func:`log_line`; the fence is longer than any run of backticks inside."""
    body = log_text(text.rstrip("\n"))
    fence = "`" * max(3, _longest_backticks(body) + 1)
    return [f"{fence}{info}", body, fence]
