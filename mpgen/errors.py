"""Errors that point at the spec.

Every user mistake found by any stage is an :class:`MpgenError` carrying a
:class:`Position`; stages collect them into an :class:`ErrorList` so that one
build reports everything it found, in file order.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True, order=True)
class Position:
    """A place in a spec file; ``line`` and ``col`` are 1-based."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        if self.line:
            return f"{self.file}:{self.line}:{self.col}"
        return self.file


class MpgenError(Exception):
    """A user-facing error: ``FILE:LINE:COL: message``."""

    def __init__(self, pos: Position | None, message: str):
        super().__init__(message)
        self.pos = pos
        self.message = message

    def __str__(self) -> str:
        return f"{self.pos}: {self.message}" if self.pos else self.message


class ErrorList(MpgenError):
    """Several errors reported together, sorted by position."""

    def __init__(self, errors: Sequence[MpgenError]):
        self.errors = sorted(
            errors, key=lambda e: (e.pos or Position(""), e.message)
        )
        super().__init__(None, "\n".join(str(e) for e in self.errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class Collector:
    """Gathers errors within a stage; ``raise_if_any`` ends the stage."""

    def __init__(self) -> None:
        self.errors: list[MpgenError] = []

    def add(self, pos: Position | None, message: str) -> None:
        self.errors.append(MpgenError(pos, message))

    def extend(self, error: MpgenError) -> None:
        self.errors.extend(error.errors if isinstance(error, ErrorList) else [error])

    def raise_if_any(self) -> None:
        if self.errors:
            raise ErrorList(self.errors) if len(self.errors) > 1 else self.errors[0]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``''``."""
    pool = list(dict.fromkeys(candidates))
    match = difflib.get_close_matches(word, pool, n=1, cutoff=0.6)
    if not match:
        lowered = {c.lower(): c for c in pool}
        if word.lower() in lowered:
            match = [lowered[word.lower()]]
    return f" (did you mean {match[0]!r}?)" if match else ""
