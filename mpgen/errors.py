"""Errors that point at the spec.

Every user mistake found by any stage is an :class:`MpgenError` carrying a
:class:`Position`; stages collect them into an :class:`ErrorList` so that one
build reports everything it found, in file order.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence

from mpgen.printed import escaped


@dataclass(frozen=True, order=True)
class Position:
    """A place in a spec file; ``line`` and ``col`` are 1-based."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        file = escaped(self.file)  # a file name may hold a newline (NOTE [Printed text is inert])
        return f"{file}:{self.line}:{self.col}" if self.line else file


class MpgenError(Exception):
    """A user-facing error: ``FILE:LINE:COL: message``."""

    def __init__(self, pos: Position | None, message: str):
        super().__init__(message)
        self.pos = pos
        self.message = message

    def __str__(self) -> str:
        return f"{self.pos}: {self.message}" if self.pos else self.message


#: At most this many errors are printed; the rest are counted.
MAX_SHOWN = 100
#: A stage stops looking for more errors once it has found this many (a
#: spec with thousands of mistakes answers as fast as one with a hundred).
MAX_ERRORS = 100
#: The last line of a report cut short at :data:`MAX_ERRORS`.
STOPPED = "... too many errors; stopping"


class ErrorList(MpgenError):
    """Several errors reported together, sorted by position.

    Exact duplicates (same position and message) are reported once; beyond
    :data:`MAX_SHOWN` errors, the report ends with how many were left out,
    and a list cut short at :data:`MAX_ERRORS` (``stopped``) says so last.
    """

    def __init__(self, errors: Sequence[MpgenError], stopped: bool = False):
        unique = {(e.pos, e.message): e for e in errors}
        self.errors = sorted(
            unique.values(), key=lambda e: (e.pos or Position(""), e.message)
        )
        self.stopped = stopped
        super().__init__(None, str(self))

    def __str__(self) -> str:
        lines = [str(e) for e in self.errors[:MAX_SHOWN]]
        if len(self.errors) > MAX_SHOWN:
            lines.append(f"... and {len(self.errors) - MAX_SHOWN} more errors")
        if self.stopped:
            lines.append(STOPPED)
        return "\n".join(lines)


class Collector:
    """Gathers errors within a stage; ``raise_if_any`` ends the stage.

    At :data:`MAX_ERRORS` errors (or on taking in a list that was itself cut
    short) it stops the stage at once, raising what it has.
    """

    def __init__(self) -> None:
        self.errors: list[MpgenError] = []

    def add(self, pos: Position | None, message: str) -> None:
        self.errors.append(MpgenError(pos, message))
        self._stop_if_full()

    def extend(self, error: MpgenError) -> None:
        self.errors.extend(error.errors if isinstance(error, ErrorList) else [error])
        self._stop_if_full(isinstance(error, ErrorList) and error.stopped)

    def _stop_if_full(self, stopped: bool = False) -> None:
        if stopped or len(self.errors) >= MAX_ERRORS:
            raise ErrorList(self.errors, stopped=True)

    def raise_if_any(self) -> None:
        if self.errors:
            raise ErrorList(self.errors) if len(self.errors) > 1 else self.errors[0]


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 4]}...{text[-1]}"


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``''``.

    A candidate that differs only in case wins (``Relu`` -> ``ReLU``, not
    ``F.elu``); otherwise the closest by ``difflib`` above a similarity cutoff.
    """
    pool = [c for c in dict.fromkeys(candidates) if c != word]
    lowered = {c.lower(): c for c in pool}
    if word.lower() in lowered:
        return f" (did you mean {lowered[word.lower()]!r}?)"
    match = difflib.get_close_matches(word, pool, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
