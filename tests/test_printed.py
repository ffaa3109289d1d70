"""Printed text is inert (``mpgen/printed.py``, NOTE [Printed text is inert]).

A pull request chooses its specs' file names and the bytes of any generated
file it hand-edits; CI prints them. Through the real command line (a fresh
interpreter, its output compared byte for byte): no control character
reaches the terminal, no line is a GitHub workflow command (``::error::``,
``::add-mask::`` at a line's start, ``##[error]`` anywhere), and a name with
a newline stays on its line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES
from mpgen.printed import code_span, escaped, fenced, log_line, log_text

# -- the functions ---------------------------------------------------------------


def test_escaped_writes_every_control_character_as_python_does():
    assert escaped("a\nb\rc\x1b[31md\x07\x00\x7f\x85\t") == r"a\nb\rc\x1b[31md\x07\x00\x7f\x85\t"
    assert escaped("\u2028\u2029\u202e\u2066") == r"\u2028\u2029\u202e\u2066"  # lines, bidi
    assert escaped("spec.yaml") == "spec.yaml"
    assert escaped("café ✓ 模型.yaml") == "café ✓ 模型.yaml"  # printable text stays


def test_a_log_line_is_never_a_workflow_command():
    assert log_line("::error::x") == r"\x3a:error::x"
    assert log_line("  \t::add-mask::secret") == r"  " + "\t" + r"\x3a:add-mask::secret"
    assert log_line("\u3000::warning::x") == "\u3000\\x3a:warning::x"  # any white space
    assert log_line("text ##[error]x ###[group]") == r"text ##\x5berror]x ###\x5bgroup]"
    assert log_line("a::b") == "a::b" and log_line(": :x") == ": :x"
    assert log_line("col\there") == "col\there"  # a tab is kept
    # Lines are mpgen's; a line break inside one (a \r too) is not.
    assert log_text("one\n::error::two\rthree") == "one\n\\x3a:error::two\\rthree"


@pytest.mark.parametrize("name, span", [
    ("spec.yaml", "`spec.yaml`"),
    ("a`b", "``a`b``"),
    ("a`b``c", "```a`b``c```"),
    ("`x", "`` `x ``"),
    ("x`", "`` x` ``"),
    (" x ", "`  x  `"),  # CommonMark strips one space each side: the padding
    (" x", "` x`"),
    ("a\nb", r"`a\nb`"),
    ("<img src=x onerror=alert(1)>", "`<img src=x onerror=alert(1)>`"),
])
def test_code_span(name, span):
    assert code_span(name) == span


def test_code_span_in_a_table_cell_escapes_pipes():
    assert code_span("a|b", cell=True) == r"`a\|b`"
    assert code_span("a|b") == "`a|b`"


def test_fenced_block_outlasts_any_backticks_inside():
    assert fenced("x ```` y\n::error::z") == ["`````text", "x ```` y\n\\x3a:error::z", "`````"]
    assert fenced("plain\n") == ["```text", "plain", "```"]


# -- through the command line ----------------------------------------------------

BAD = "mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\nlayers:\n  l0: {op: Lineer, args: [10, 10]}\n"
GOOD = BAD.replace("Lineer", "Linear")
UNKNOWN = b":6:12: layer 'l0': unknown op 'Lineer' (did you mean 'Linear'?)\n"

#: Hostile file names, and how mpgen prints each.
NAMES = {
    "a\n::error::forged.yaml": rb"a\n::error::forged.yaml",
    "::add-mask::hidden.yaml": rb"\x3a:add-mask::hidden.yaml",
    "t\x1b]0;title\x07\x1b[2J.yaml": rb"t\x1b]0;title\x07\x1b[2J.yaml",
    "r\rfake ok.yaml": rb"r\rfake ok.yaml",
    "x ##[error]y.yaml": rb"x ##\x5berror]y.yaml",
}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m mpgen ARGS``, as CI runs it; stdout and stderr as bytes."""
    return subprocess.run([sys.executable, "-m", "mpgen", *args], cwd=cwd,
                          capture_output=True, timeout=300)


@pytest.mark.slow
def test_check_prints_hostile_file_names_inert(tmp_path):
    for name in NAMES:
        (tmp_path / name).write_text(BAD)
    done = run("check", "-o", "out", *NAMES, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == b""
    assert sorted(done.stderr.splitlines(keepends=True)) == sorted(
        shown + UNKNOWN for shown in NAMES.values())
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_build_show_place_and_diff_print_a_hostile_file_name_inert(tmp_path):
    name = "g\n::error::ok.yaml"
    (tmp_path / name).write_text(GOOD)
    done = run("build", "-o", "out", name, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(
        b"g\\n::error::ok.yaml: M, 110 parameters on cuda:0 (110); 1 transfer in forward\n")
    assert b"\ng\n" not in done.stdout and b"\n::" not in done.stdout
    done = run("place", name, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith(b"# g\\n::error::ok.yaml: ")
    done = run("diff", name, name, cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith(b"--- g\\n::error::ok.yaml\n+++ g\\n::error::ok.yaml\n\n")
    (tmp_path / name).write_text(BAD)
    for command in (["show", name], ["place", name], ["diff", name, name]):
        done = run(*command, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr == b"g\\n::error::ok.yaml" + UNKNOWN, command


@pytest.mark.slow
def test_checks_diff_escapes_what_a_hand_edit_put_in_a_generated_file(tmp_path):
    spec = tmp_path / "seed.yaml"
    spec.write_text((EXAMPLES / "seed.yaml").read_text())
    assert run("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    model = tmp_path / "out" / "simple_model.py"
    model.write_bytes(model.read_bytes() + b"# \x1b]0;pwned\x07 title\n"
                      b"x = 1\rprint('hidden')\n::error::forged\n# ##[add-mask]x\n")
    done = run("check", "seed.yaml", "-o", "out", cwd=tmp_path)
    assert done.returncode == 1
    assert b"\x1b" not in done.stdout and b"\r" not in done.stdout and b"\x07" not in done.stdout
    lines = done.stdout.split(b"\n")
    assert b"-# \\x1b]0;pwned\\x07 title" in lines
    assert b"-x = 1\\r-print('hidden')" in lines  # difflib ends a line at \r; mpgen does not
    assert b"-::error::forged" in lines  # after the diff's "-": no command
    assert b"-# ##\\x5badd-mask]x" in lines
    assert not any(line.lstrip().startswith(b"::") or b"##[" in line
                   for line in done.stdout.split(b"\n") + done.stderr.split(b"\n"))


@pytest.mark.slow
def test_check_and_build_print_a_hostile_file_in_the_output_folder_on_one_line(tmp_path):
    """A file a pull request adds to the output folder, named to start a
    workflow command on a line of its own, is reported on one line."""
    (tmp_path / "seed.yaml").write_text((EXAMPLES / "seed.yaml").read_text())
    assert run("build", "seed.yaml", "-o", "out", cwd=tmp_path).returncode == 0
    (tmp_path / "out" / "a\n::error::b.py").write_text("x = 1\n")
    for command in ("check", "build"):
        done = run(command, "seed.yaml", "-o", "out", cwd=tmp_path)
        assert done.returncode == (1 if command == "check" else 0), done.stderr
        text = done.stdout + done.stderr
        said = b": note: not" if command == "build" else b": not"
        assert b"out/a\\n::error::b.py" + said + b" generated by mpgen" in text, command
        assert not any(line.lstrip().startswith(b"::") for line in text.split(b"\n"))


@pytest.mark.slow
def test_plain_names_print_as_they_are(tmp_path):
    (tmp_path / "plain.yaml").write_text(BAD)
    done = run("check", "plain.yaml", "-o", "out", cwd=tmp_path)
    assert done.stderr == b"plain.yaml" + UNKNOWN


def test_the_error_list_escapes_each_position():
    from mpgen.errors import ErrorList, MpgenError, Position

    errors = ErrorList([MpgenError(Position("b\n::error::x.yaml", 2, 1), "two"),
                        MpgenError(Position("a\x1b[2J.yaml", 1, 1), "one")])
    assert str(errors) == "a\\x1b[2J.yaml:1:1: one\nb\\n::error::x.yaml:2:1: two"


def test_usage_errors_quote_arguments_inert(tmp_path):
    done = run("check", "--nope=a\n::error::x##[error]y", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.endswith(
        b"\nmpgen: error: unrecognized arguments: --nope=a\\n::error::x##\\x5berror]y\n")
