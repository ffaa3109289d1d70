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
import sys

from mpgen import templates

#: Names the generated modules import or use at top level.
GLOBALS = frozenset({"torch", "nn", "F", "math", "argparse", "time", "pytest", "sys"})


#: The longest model name: it names the generated files (``train_<name>.py``,
#: in snake case), which must stay within every file system's name limit.
MAX_MODEL_NAME = 100

#: Top-level modules the generated files import, directly or through torch,
#: pytest and TensorBoard (``mpgen.templates``, which keeps the list beside
#: the templates): a generated module of the same name, next to them, would
#: be imported instead. With the standard library and the spec's user
#: modules, no generated file may take one of these names.
IMPORTED_MODULES = templates.IMPORTS | templates.LOADED


#: Words that model names spell in mixed case, each kept whole in a file name
#: (``DigitViT`` -> ``digit_vit``, ``ConvNeXt`` -> ``conv_next``), longest first
#: where one holds another. Every other word boundary is the camel-case one.
MIXED_CASE_WORDS = ("LeViT", "ViT", "DeiT", "BEiT", "CaiT", "NeXt", "NeoX", "RoBERTa",
                    "DeBERTa", "LLaMA", "GoogLe")

#: A word boundary: lower case or a digit before a capital (``Simple|Model``,
#: ``GPT2|Small``), or an acronym's last capital that starts a word
#: (``MLP|Block``) unless it is a version (``YOLOv5``, ``LayoutLMv3``).
_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])(?![A-Z]v\d)")
_MIXED = re.compile("(?:%s)(?![a-z])" % "|".join(MIXED_CASE_WORDS))


def module_name(class_name: str) -> str:
    """The generated file's stem: the class name in snake case, split at the
    camel-case word boundaries (``SimpleModel`` -> ``simple_model``, ``ResNet18``
    -> ``res_net18``, ``GPT2Small`` -> ``gpt2_small``) and around a mixed-case
    word, never within one (``DigitViT`` -> ``digit_vit``, ``ViTB16`` -> ``vit_b16``)."""
    whole = [m.span() for m in _MIXED.finditer(class_name)]
    cuts = {m.start() for m in _BOUNDARY.finditer(class_name)
            if not any(start < m.start() < end for start, end in whole)}
    cuts |= {start for start, _ in whole if start and class_name[start - 1].isalnum()}
    cuts |= {end for _, end in whole if class_name[end:end + 1].isupper()}
    pieces = [class_name[i:j] for i, j in zip([0, *sorted(cuts)], [*sorted(cuts), None])]
    return "_".join(pieces).lower()


def module_stems(model: str) -> tuple[str, str, str, str]:
    """The generated modules of a model: ``simple_model``, ``train_simple_model``,
    ``test_simple_model``, ``pp_simple_model``."""
    stem = module_name(model)
    return stem, f"train_{stem}", f"test_{stem}", f"pp_{stem}"


def model_name_problem(name: str, user_modules: frozenset[str] | set[str] = frozenset()
                       ) -> str | None:
    """Why ``name`` (a valid identifier) cannot name a model, or None: too
    long for a file name, or its generated modules would shadow a module the
    generated code imports (the standard library, torch, ``user_modules``)."""
    if len(name) > MAX_MODEL_NAME:
        return (f"{len(name)} characters is too long for a model name (it names the "
                f"generated files); use at most {MAX_MODEL_NAME}")
    users = {m.lower() for m in user_modules}
    for stem in module_stems(name):
        if stem in users:
            what = f"the module {stem!r} this spec's ops import"
        elif stem in {m.lower() for m in IMPORTED_MODULES}:
            what = f"the module {stem!r} the generated code imports"
        elif stem in {m.lower() for m in sys.stdlib_module_names}:
            what = f"the standard library module {stem!r}"
        else:
            continue
        other = next((f"{name}{suffix}" for suffix in ("Model", "Net", "Network")
                      if model_name_problem(f"{name}{suffix}", user_modules) is None), None)
        return (f"{name!r} would generate {stem}.py, which shadows {what}; choose another "
                "name" + (f" (e.g. {other!r})" if other else ""))
    return None


def identifier_problem(name: str) -> str | None:
    """Why ``name`` cannot be a Python identifier in generated code, or None."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        return f"{name!r} is not a valid Python identifier"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"{name!r} is a Python keyword"
    if name.startswith("__"):
        return f"{name!r} must not start with '__'"
    return None


#: A layer name that is not an identifier: an ``nn.Sequential``'s or
#: ``nn.ModuleList``'s child (``0``, ``12``) or a module name torchvision
#: gives one (RegNet's ``block1-0``). NOTE [Layers named by position]
_POSITIONAL = re.compile(r"[A-Za-z0-9_]+(?:-[A-Za-z0-9_]+)*")


def positional_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a layer of an ``nn.Sequential`` block (a
    layer that is not an identifier), or None."""
    if not isinstance(name, str) or not _POSITIONAL.fullmatch(name) or not name.isascii():
        return (f"{name!r} is not a valid layer name: an identifier, or a child's name in "
                "an nn.Sequential (digits, letters, '_' and '-', as 0 or block1-0)")
    if re.fullmatch(r"0\d+", name):
        return f"{name!r}: a number names a layer without leading zeros ({int(name)})"
    if re.fullmatch(r"\d+-\d+", name):
        return (f"{name!r} reads as a range of instances (h.0-3) in placement keys; name the "
                "layer otherwise")
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
