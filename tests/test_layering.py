"""The package's layering, read from the imports of every module.

Stages import only earlier stages (``docs/architecture.md``): a stage that
imported a later one would make the chain of stages a web again. Every import
counts, including those inside functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpgen"

#: Layers, first to last. A module may import its own layer and earlier ones.
LAYERS = [
    ("mpgen.errors", "mpgen"),  # mpgen: the package's __init__ (its version)
    ("mpgen.spec_schema",),
    ("mpgen.compiler.ir",),
    ("mpgen.compiler.frontend",),
    ("mpgen.compiler.analysis",),
    ("mpgen.compiler.placement",),
    ("mpgen.compiler.codegen",),
    ("mpgen.compiler.driver",),
    ("mpgen.output",),  # the output folder: above the compiler, under the commands
    ("mpgen.commands",),
    ("mpgen.cli", "mpgen.__main__"),
]

#: Front-end types and libraries stop at the front end.
FRONT_END_ONLY = ("mpgen.spec_schema", "pydantic", "yaml")
AFTER_FRONT_END = ("mpgen.compiler.ir", "mpgen.compiler.analysis", "mpgen.compiler.placement",
                   "mpgen.compiler.codegen")


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> int:
    """The index of the most specific layer ``module`` belongs to."""
    best, length = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if _within(module, prefix) and len(prefix) > length:
                best, length = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports, absolute, anywhere in its code."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            # ``from mpgen.compiler import driver`` imports a submodule.
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return found


@pytest.mark.parametrize("module", [m for m in MODULES if not _within(m, "mpgen.testing")])
def test_stages_import_only_earlier_stages(module):
    mine = _layer(module)
    later = sorted(i for i in _imports(module)
                   if _within(i, "mpgen") and not _within(i, "mpgen.testing")
                   and i != "mpgen" and _layer(i) > mine)
    assert not later, f"{module} (layer {LAYERS[mine][0]}) imports later stages: {later}"


@pytest.mark.parametrize("module", [m for m in MODULES
                                    if any(_within(m, p) for p in AFTER_FRONT_END)])
def test_after_the_front_end_no_spec_types(module):
    leaks = sorted(i for i in _imports(module) if any(_within(i, p) for p in FRONT_END_ONLY))
    assert not leaks, f"{module} imports front-end types: {leaks}"


@pytest.mark.parametrize("module", [m for m in MODULES if _within(m, "mpgen.testing")])
def test_the_testing_runtime_stands_alone(module):
    # The generated tests import mpgen.testing; it must not pull in the compiler.
    others = sorted(i for i in _imports(module)
                    if _within(i, "mpgen") and not _within(i, "mpgen.testing"))
    assert not others, f"{module} imports {others}"


def test_the_compiler_has_no_module_outside_a_stage():
    loose = [m for m in MODULES if m.count(".") == 2 and m.startswith("mpgen.compiler.")
             and m not in ("mpgen.compiler.ir", "mpgen.compiler.driver")
             and MODULES[m].parent == PACKAGE / "compiler"]
    assert not loose, f"modules directly under mpgen/compiler: {loose}"


def test_the_checker_sees_a_violation():
    # The rule is not vacuous: a reversed import would be caught.
    assert _layer("mpgen.compiler.codegen.model") > _layer("mpgen.compiler.placement.auto")
    assert "mpgen.compiler.driver" in _imports("mpgen.commands.place")
    assert _layer("mpgen.compiler.driver") > _layer("mpgen.compiler.codegen.common")
    assert _layer("mpgen.output.write") > _layer("mpgen.compiler.driver")


@pytest.mark.parametrize("module", [m for m in MODULES if not _within(m, "mpgen.testing")])
def test_nothing_outside_the_runtime_imports_it(module):
    # The build manifest's generator hash leaves mpgen/testing out (NOTE [Build
    # manifest]): sound only while no code that generates files imports it.
    found = sorted(i for i in _imports(module) if _within(i, "mpgen.testing"))
    assert not found, f"{module} imports the generated tests' runtime: {found}"


#: The modules of ``mpgen import``, first to last: its passes and the spec they
#: build (docs/architecture.md); the package itself is the command.
IMPORTER = [*(f"mpgen.commands.importer.{m}" for m in
              ("trace", "inputs", "arguments", "layers", "nodes", "order", "fold", "capture",
               "scopes", "emit")),
            "mpgen.commands.importer"]


@pytest.mark.parametrize("module", IMPORTER)
def test_the_importer_passes_import_only_earlier_passes(module):
    later = sorted(_imports(module) & set(IMPORTER[IMPORTER.index(module) + 1:]))
    assert not later, f"{module} imports later passes: {later}"


def test_every_module_of_the_importer_is_in_its_order():
    assert sorted(m for m in MODULES if _within(m, "mpgen.commands.importer")) == sorted(IMPORTER)


#: What the training runtime may import: it is copied into output folders and
#: run where mpgen is not installed (NOTE [One runtime per output folder]).
RUNTIME_IMPORTS = ("torch", "numpy", "safetensors", "tqdm", "mpgen.runtime",
                   "transformers",  # transformers: generate.py's --tokenizer, imported then
                   "wandb", "mlflow")  # trackers.py's --logger wandb/mlflow, imported then


@pytest.mark.parametrize("module", [m for m in MODULES if _within(m, "mpgen.runtime")])
def test_the_training_runtime_stands_alone(module):
    others = sorted(i for i in _imports(module) if i.split(".")[0] not in sys.stdlib_module_names
                    and not any(_within(i, allowed) for allowed in RUNTIME_IMPORTS))
    assert not others, f"{module} imports {others}"


@pytest.mark.parametrize("module", [m for m in MODULES if not _within(m, "mpgen.runtime")])
def test_nothing_imports_the_training_runtime(module):
    # The build reads its files (output/runtime.py); importing it would pull torch into mpgen.
    found = sorted(i for i in _imports(module) if _within(i, "mpgen.runtime"))
    assert not found, f"{module} imports the training runtime: {found}"
