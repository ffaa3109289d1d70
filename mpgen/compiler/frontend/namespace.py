"""One namespace hands out every identifier in generated code.

# NOTE: [Identifiers are data]
# Names from the spec reach the generated code only through a Namespace:
# ``claim`` accepts a name verbatim or rejects it (attributes and class names,
# which users see in state dicts and imports, must never be renamed), and
# ``fresh`` derives a new, unique identifier from a base (local variables,
# transfer copies), escaping clashes with keywords, builtins, imported module
# names and each other by a suffix. Nothing else creates identifiers.
"""

from __future__ import annotations

import builtins
import keyword
import re

#: Names the generated modules import or use at top level.
GLOBALS = frozenset({"torch", "nn", "F", "math", "argparse", "time", "pytest", "sys"})


def identifier_problem(name: str) -> str | None:
    """Why ``name`` cannot be a Python identifier in generated code, or None."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        return f"{name!r} is not a valid Python identifier"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"{name!r} is a Python keyword"
    if name.startswith("__"):
        return f"{name!r} must not start with '__'"
    return None


class Namespace:
    """A set of taken identifiers; hands out new ones without clashes."""

    def __init__(self, reserved: frozenset[str] | set[str] = frozenset()) -> None:
        self._taken: set[str] = set(reserved)

    def taken(self, name: str) -> bool:
        return name in self._taken

    def claim(self, name: str) -> str:
        """Take ``name`` verbatim; raises ValueError if unsafe or taken."""
        problem = identifier_problem(name)
        if problem:
            raise ValueError(problem)
        if name in self._taken:
            raise ValueError(f"{name!r} is already used")
        self._taken.add(name)
        return name

    def fresh(self, base: str) -> str:
        """A new identifier derived from ``base`` (``base``, ``base_1``, ...)."""
        candidate = re.sub(r"\W", "_", base) or "v"
        if not candidate.isascii():
            candidate = "v"
        if candidate[0].isdigit():
            candidate = "v_" + candidate
        if (
            keyword.iskeyword(candidate)
            or keyword.issoftkeyword(candidate)
            or hasattr(builtins, candidate)
        ):
            candidate += "_"
        name, i = candidate, 1
        while name in self._taken:
            name = f"{candidate}_{i}"
            i += 1
        self._taken.add(name)
        return name

    def child(self) -> "Namespace":
        """A namespace that starts with everything taken here."""
        return Namespace(set(self._taken))
