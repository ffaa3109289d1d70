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

# NOTE: [Bounded folding]
# Python's integers have no size limit, so ``((64**64)**64)**64`` (every
# exponent at most 64) would fold to a number of gigabytes, and a number of
# more than 4,300 digits cannot even be printed (``int`` to ``str`` raises
# ``ValueError``). So an integer result's bit length is estimated from its
# operands' before it is computed (``a * b`` has at most ``bits(a) +
# bits(b)`` bits, ``a ** n`` at most ``bits(a) * n``) and one beyond
# MAX_BITS is refused unbuilt; the exact length is then checked. Float
# results are bounded by their type: an overflow (``OverflowError``) or a
# result that is not finite is refused.
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
#: The largest integer an expression holds or folds to, in bits (about 308
#: digits; Python prints at most 4,300).
MAX_BITS = 1024
#: How deeply an expression nests: parentheses, signs and ``**`` while it is
#: parsed, and operators over unfolded parts in the tree it becomes.
MAX_DEPTH = 64
Number = Union[int, float]


class ExpressionError(ValueError):
    """The expression does not parse or cannot be folded (a user-facing message)."""


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("=")


def parse(text: str) -> Any:
    """The IR of ``text`` (which starts with ``=``); raises ExpressionError."""
    return _Parser(text[1:]).parse()


def fold(op: str, left: Any, right: Any) -> Any:
    """``left op right``, computed when both are numbers (bounded first:
    NOTE [Bounded folding])."""
    if not (_is_number(left) and _is_number(right)):
        return BinOp(op, left, right)
    if op in ("/", "//", "%") and right == 0:
        raise ExpressionError("division by zero")
    if op == "**" and (abs(right) > MAX_EXPONENT or (abs(left) > 1 and right > MAX_EXPONENT)):
        raise ExpressionError(f"exponent {_number(right)} is too large")
    if op == "**" and left == 0 and right < 0:
        raise ExpressionError(f"{_number(left)} cannot be raised to a negative power "
                              f"({_number(right)})")
    shown = f"{_operand(left)} {op} {_operand(right)}"
    if isinstance(left, int) and isinstance(right, int) and _bits(op, left, right) > MAX_BITS:
        raise ExpressionError(f"{shown} is too large: more than {MAX_BITS} bits")
    try:
        result = _FOLD[op](left, right)
    except OverflowError:  # a float result, or an integer operand, beyond a float's range
        raise ExpressionError(f"{shown} is beyond the range of a float") from None
    if isinstance(result, complex) or (isinstance(result, float) and not math.isfinite(result)):
        raise ExpressionError(f"{shown} is not a finite real number")
    if isinstance(result, int) and result.bit_length() > MAX_BITS:
        raise ExpressionError(f"{shown} is too large: more than {MAX_BITS} bits")
    return result


def _bits(op: str, left: int, right: int) -> int:
    """A lower bound on the bit length of ``left op right`` (integers),
    known before it is built. Above MAX_BITS it is refused unbuilt; below,
    what is built is small: operands have at most MAX_BITS bits, so a sum
    has at most one more, a product at most twice as many, and a power at
    most ``right - 1`` bits more than this bound."""
    a, b = left.bit_length(), right.bit_length()
    if op == "*" and a and b:
        return a + b - 1
    if op == "**" and right > 0 and a:
        return (a - 1) * right + 1
    return 0


def _operand(value: Number) -> str:
    """A number as an operand in a message: negative ones in parentheses."""
    return f"({_number(value)})" if value < 0 else _number(value)


def _number(value: Number) -> str:
    """A number for a message: short (a 300-digit integer by its length)."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"


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
        result, _ = self.expr(0)
        kind, got = self.peek()
        if kind != "end":
            raise ExpressionError(f"unexpected {_shown(kind, got)}")
        return result

    # Each method takes how deeply the parser is nested (parentheses, signs,
    # exponents) and returns a value with the depth of its tree: operators
    # over parts that are not numbers (folded parts are leaves).

    def expr(self, level: int) -> tuple[Any, int]:
        left = self.term(level)
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            left = self.fold(op, left, self.term(level))
        return left

    def term(self, level: int) -> tuple[Any, int]:
        left = self.unary(level)
        while self.peek()[1] in ("*", "/", "//", "%"):
            op = self.take()[1]
            left = self.fold(op, left, self.unary(level))
        return left

    def unary(self, level: int) -> tuple[Any, int]:
        if self.peek()[1] in ("-", "+"):
            op = self.take()[1]
            operand, depth = self.unary(_deeper(level))
            if op == "+" or _is_number(operand):
                return (-operand if op == "-" else operand), depth
            return Neg(operand), _deeper(depth)
        return self.power(level)

    def power(self, level: int) -> tuple[Any, int]:
        base = self.atom(level)
        if self.peek()[1] == "**":
            self.take()
            return self.fold("**", base, self.unary(_deeper(level)))
        return base

    @staticmethod
    def fold(op: str, left: tuple[Any, int], right: tuple[Any, int]) -> tuple[Any, int]:
        result = fold(op, left[0], right[0])
        return result, (_deeper(max(left[1], right[1])) if isinstance(result, BinOp) else 0)

    def atom(self, level: int) -> tuple[Any, int]:
        kind, text = self.take()
        if kind == "num":
            return _literal(text), 0
        if kind == "param":
            return Param(text[1:]), 0
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
            return Size(name, sign * _literal(dim)), 0
        if kind == "name":
            raise ExpressionError(f"unknown name {text!r}: an expression reads block params "
                                  f"as ${text} and tensor sizes as size({text}, DIM)")
        if text == "(":
            inner = self.expr(_deeper(level))
            self.expect(")")
            return inner
        raise ExpressionError(f"expected a number, $param, size(...) or '(', got "
                              f"{_shown(kind, text)}")


def _deeper(depth: int) -> int:
    """``depth + 1``, refused beyond MAX_DEPTH."""
    if depth >= MAX_DEPTH:
        raise ExpressionError(f"nested more than {MAX_DEPTH} levels deep (parentheses, signs, "
                              "powers and operators over $params and size()); write it simpler")
    return depth + 1


def _literal(text: str) -> Number:
    """A number token's value; an integer beyond MAX_BITS (refused before
    Python converts it: NOTE [Bounded folding]) or a float beyond its range
    is an error."""
    if any(c in text for c in ".eE"):
        value = float(text)
        if not math.isfinite(value):
            raise ExpressionError(f"{_number_text(text)} is too large for a float")
        return value
    if len(text) > MAX_BITS // 3 + 1 or int(text).bit_length() > MAX_BITS:  # 10**k > 2**(3k)
        raise ExpressionError(f"{_number_text(text)} is too large: more than {MAX_BITS} bits")
    return int(text)


def _number_text(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} characters)"


def _shown(kind: str, text: str) -> str:
    return "the end" if kind == "end" else repr(text)
