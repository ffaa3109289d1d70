"""Expressions in spec values: ``"=3 * $dim"``, ``"=size(idx, 1)"``.

A string value that starts with ``=`` is an arithmetic expression: numbers,
``$params``, ``+ - * / // % **``, parentheses and ``size(NAME, DIM)``. It is
parsed here, by a small recursive-descent parser over its own tokens (nothing
is evaluated by Python), into IR nodes: :class:`~mpgen.compiler.ir.BinOp`,
:class:`~mpgen.compiler.ir.Neg`, :class:`~mpgen.compiler.ir.Param` and
:class:`~mpgen.compiler.ir.Size`. A part without ``$params`` or ``size()`` is
folded to a number.

# NOTE: [Expression grammar]
#   expr   := term (("+" | "-") term)*
#   term   := unary (("*" | "/" | "//" | "%") unary)*
#   unary  := ("-" | "+") unary | power
#   power  := atom ("**" unary)?
#   atom   := NUMBER | "$" NAME | "size" "(" NAME "," INT ")" | "(" expr ")"
# The precedence is Python's, so the generated code means what the spec says.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any, Union

from mpgen.compiler.ir import BinOp, Neg, Param, Size

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
                    r"|(?P<param>\$[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<op>\*\*|//|[-+*/%(),]))")

_FOLD = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
         "//": operator.floordiv, "%": operator.mod, "**": operator.pow}
#: The largest exponent folded at build time (a typo must not hang the build).
MAX_EXPONENT = 64
Number = Union[int, float]


class ExpressionError(ValueError):
    """The expression does not parse or cannot be folded (a user-facing message)."""


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("=")


def parse(text: str) -> Any:
    """The IR of ``text`` (which starts with ``=``); raises ExpressionError."""
    return _Parser(text[1:]).parse()


def fold(op: str, left: Any, right: Any) -> Any:
    """``left op right``, computed when both are numbers."""
    if not (_is_number(left) and _is_number(right)):
        return BinOp(op, left, right)
    if op in ("/", "//", "%") and right == 0:
        raise ExpressionError("division by zero")
    if op == "**" and (abs(right) > MAX_EXPONENT or (abs(left) > 1 and right > MAX_EXPONENT)):
        raise ExpressionError(f"exponent {right} is too large")
    result = _FOLD[op](left, right)
    if isinstance(result, complex) or (isinstance(result, float) and not math.isfinite(result)):
        raise ExpressionError(f"{left} {op} {right} is not a finite real number")
    return result


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = _TOKEN.match(text, pos)
            if not match or match.end() == pos:
                raise ExpressionError(f"unexpected {text[pos:].lstrip()[0]!r}")
            kind = match.lastgroup
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.i += 1
        return token

    def expect(self, text: str) -> None:
        kind, got = self.take()
        if got != text:
            raise ExpressionError(f"expected {text!r}, got {_shown(kind, got)}")

    def parse(self) -> Any:
        if not self.tokens:
            raise ExpressionError("empty expression after '='")
        result = self.expr()
        kind, got = self.peek()
        if kind != "end":
            raise ExpressionError(f"unexpected {_shown(kind, got)}")
        return result

    def expr(self) -> Any:
        left = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            left = fold(op, left, self.term())
        return left

    def term(self) -> Any:
        left = self.unary()
        while self.peek()[1] in ("*", "/", "//", "%"):
            op = self.take()[1]
            left = fold(op, left, self.unary())
        return left

    def unary(self) -> Any:
        if self.peek()[1] in ("-", "+"):
            op = self.take()[1]
            operand = self.unary()
            if op == "+":
                return operand
            return -operand if _is_number(operand) else Neg(operand)
        return self.power()

    def power(self) -> Any:
        base = self.atom()
        if self.peek()[1] == "**":
            self.take()
            return fold("**", base, self.unary())
        return base

    def atom(self) -> Any:
        kind, text = self.take()
        if kind == "num":
            return float(text) if any(c in text for c in ".eE") else int(text)
        if kind == "param":
            return Param(text[1:])
        if kind == "name" and text == "size":
            self.expect("(")
            kind, name = self.take()
            if kind != "name":
                raise ExpressionError(f"size() takes a tensor's name first, got "
                                      f"{_shown(kind, name)}")
            self.expect(",")
            sign = -1 if self.peek()[1] == "-" and self.take() else 1
            kind, dim = self.take()
            if kind != "num" or not dim.isdigit():
                raise ExpressionError(f"size({name}, DIM) needs an integer DIM, got "
                                      f"{_shown(kind, dim)}")
            self.expect(")")
            return Size(name, sign * int(dim))
        if kind == "name":
            raise ExpressionError(f"unknown name {text!r}: an expression reads block params "
                                  f"as ${text} and tensor sizes as size({text}, DIM)")
        if text == "(":
            inner = self.expr()
            self.expect(")")
            return inner
        raise ExpressionError(f"expected a number, $param, size(...) or '(', got "
                              f"{_shown(kind, text)}")


def _shown(kind: str, text: str) -> str:
    return "the end" if kind == "end" else repr(text)
