"""What a spec may import (issue 10): the policy of ``frontend/imports.py``.

A dotted op ``a.b.C`` names a class in a ``.py`` file of the spec's project
(or of a package the spec lists under ``imports:``), checked on disk before
anything is imported. Every refused module here writes a marker file when it
is imported, and each test asserts the marker never appears; the first test
shows the marker does appear when a module is allowed, so its absence means
something. Builds run in-process (:func:`helpers.mpgen`), from a project
folder that has a ``.git`` (the project root), with the spec in ``specs/``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import py_compile
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, mpgen, mpgen_process
from test_user_modules import GATE  # a small nn.Module class
from mpgen.commands import isolate
from mpgen.compiler import driver
from mpgen.compiler.frontend import imports, ops
from mpgen.errors import MpgenError

#: Slow: most builds here run a user module, in a child interpreter of its own.
pytestmark = pytest.mark.slow


HOW = "put the module in the project, pass --root, or list its package under 'imports:'"
SO = importlib.machinery.EXTENSION_SUFFIXES[0]


@dataclass
class Project:
    root: Path  # has a .git: the project root
    marker: Path  # written by every module below that is imported

    @property
    def specs(self) -> Path:
        return self.root / "specs"

    def module(self, relative: str, text: str = GATE, marked: bool = True) -> Path:
        """A module under ``specs/`` that writes the marker when imported."""
        path = self.specs / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        mark = f"open({str(self.marker)!r}, 'w').write('ran')\n" if marked else ""
        path.write_text(mark + text)
        return path

    def spec(self, op: str, imports_: list[str] | None = None) -> Path:
        text = ("mpgen: 1\nname: Policy\ninputs:\n  x: [batch, 8]\nlayers:\n"
                f"  a: {{op: {op}, args: [8]}}\n")
        if imports_ is not None:
            text += f"imports: [{', '.join(imports_)}]\n"
        path = self.specs / "s.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def build(self, op: str, imports_: list[str] | None = None, command: str = "build"):
        self.spec(op, imports_)
        return mpgen(command, "specs/s.yaml", "-o", "out", cwd=self.root)

    def refused(self, ran, message: str, spec: str = "specs/s.yaml") -> None:
        """Exit 2, exactly this message at the op, nothing run or written."""
        assert "Traceback" not in ran.stderr, ran.stderr
        assert (ran.returncode, ran.stdout) == (2, ""), ran.stderr
        assert ran.stderr == f"{spec}:6:11: layer 'a': {message}\n"
        assert not self.marker.exists(), "a refused module ran"
        assert not (self.root / "out").exists()


@pytest.fixture
def project(tmp_path, monkeypatch) -> Project:
    # The policy is what is tested here, so the child runs uncontained by
    # namespaces: contained, its tree is read-only and no module could write
    # the marker, so the marker's absence would prove nothing (containment
    # has its own tests: tests/commands/test_user_code_in_a_child.py).
    monkeypatch.setattr(isolate, "USE_NAMESPACES", False)
    root = tmp_path / "proj"
    (root / ".git").mkdir(parents=True)
    return Project(root.resolve(), tmp_path / "marker")


def test_a_class_of_the_project_is_imported_and_the_marker_shows_it(project):
    project.module("mylayers/__init__.py", "")
    project.module("mylayers/gates.py")
    ran = project.build("mylayers.gates.Gate")
    assert ran.returncode == 0, ran.stderr
    assert project.marker.exists()
    assert not list(project.specs.rglob("__pycache__")), "bytecode was written"


# -- what the op names ---------------------------------------------------------


@pytest.mark.parametrize("op, package", [
    ("pip.__main__.X", "pip"),
    ("black.__main__.X", "black"),
    ("numpy.f2py.__main__.X", "numpy"),
    ("pygments.__main__.X", "pygments"),
])
def test_a_main_module_is_never_imported_even_from_a_listed_package(project, op, package):
    ran = project.build(op, imports_=[package])
    project.refused(ran, f"{op!r} names a '__main__' module, a program's entry point, which "
                    "mpgen never imports; a dotted op names a class of your own module, e.g. "
                    "'mypkg.layers.Gate'")
    assert op.rpartition(".")[0] not in sys.modules
    assert "usage" not in (ran.stdout + ran.stderr).lower()


def test_a_main_module_of_the_project_is_not_imported(project):
    project.module("tool/__init__.py", "")
    project.module("tool/__main__.py")
    project.refused(project.build("tool.__main__.Gate"),
                    "'tool.__main__.Gate' names a '__main__' module, a program's entry point, "
                    "which mpgen never imports; a dotted op names a class of your own module, "
                    "e.g. 'mypkg.layers.Gate'")


@pytest.mark.parametrize("op, what, part", [
    ("_evil.Gate", "module", "_evil"),
    ("pkg._impl.Gate", "module", "_impl"),
    ("evil._Gate", "class", "_Gate"),
])
def test_private_modules_and_classes_are_refused(project, op, what, part):
    project.module("_evil.py")
    project.module("pkg/__init__.py")
    project.module("pkg/_impl.py")
    project.module("evil.py", GATE + "\n_Gate = Gate\n")
    project.refused(project.build(op), f"{op!r} names a private {what} ({part!r}); a dotted "
                    "op names a public class of a public module (no part starting with '_')")


def test_the_standard_library_is_refused(project):
    project.refused(project.build("json.JSONDecoder"),
                    "'json.JSONDecoder' is in the standard library, not an nn.Module class; a "
                    "dotted op names your own class, e.g. 'mypkg.layers.Gate'")


@pytest.mark.parametrize("source, name", [
    ("def run():\n    pass\n", "run"),
    ("from torch import nn\nAlias = nn.Linear\n", "Alias"),
    ("from torch.nn import Linear\n", "Linear"),
    ("def make():\n    class Hidden:\n        pass\n    return Hidden\n", "Hidden"),
    ("from .other import Gate\n", "Gate"),  # evil.py is not in a package
])
def test_a_name_that_is_not_a_class_defined_in_the_module_is_refused(project, source, name):
    project.module("evil.py", source)
    project.module("other.py")
    project.refused(project.build(f"evil.{name}"),
                    f"'evil.{name}' is not a class defined in evil.py: a dotted op names a "
                    f"class its module defines with 'class {name}' or imports with "
                    f"'from .module import {name}'")


@pytest.mark.parametrize("files, op", [
    ({"pkg/__init__.py": "from .gates import Gate\n", "pkg/gates.py": GATE}, "pkg.Gate"),
    ({"pkg/__init__.py": "from pkg.a import Gate\n", "pkg/a/__init__.py":
      "from .. import b\nfrom ..b import Gate\n", "pkg/b.py": GATE}, "pkg.Gate"),
    ({"pkg/__init__.py": "", "pkg/_impl.py": GATE, "pkg/api.py": "from ._impl import Gate as G\n"},
     "pkg.api.G"),
    ({"ns/deeper/gates.py": GATE}, "ns.deeper.gates.Gate"),  # namespace packages
    ({"cond.py": "import sys\nif sys.version_info >= (3,):\n" + textwrap.indent(GATE, "    ")},
     "cond.Gate"),
    ({"tried.py": "try:\n    import not_installed_anywhere\nexcept ImportError:\n"
      + textwrap.indent(GATE, "    ")}, "tried.Gate"),
])
def test_classes_defined_under_if_try_or_reexported_within_the_package(project, files, op):
    for relative, text in files.items():
        project.module(relative, text, marked=False)
    ran = project.build(op)
    assert ran.returncode == 0, ran.stderr


def test_a_class_that_is_not_an_nn_module_is_refused_after_import(project):
    project.module("evil.py", "class Gate:\n    pass\n")
    ran = project.build("evil.Gate")
    assert ran.returncode == 2
    assert ran.stderr == "specs/s.yaml:6:11: layer 'a': 'evil.Gate' is not an nn.Module class\n"


def test_a_missing_submodule_is_named(project):
    project.module("pkg/__init__.py", "")
    project.module("evil.py")
    project.refused(project.build("pkg.nothing.Gate"),
                    "'pkg.nothing.Gate': no module 'nothing' in pkg/")
    project.refused(project.build("evil.sub.Gate"),
                    "'evil.sub.Gate': evil.py is a module, not a package: it has no module 'sub'")


# -- where the module comes from -----------------------------------------------


def test_a_module_nowhere_is_unknown_with_a_did_you_mean(project):
    project.refused(project.build("torh.add"),
                    f"unknown op 'torh.add': no module 'torh' in the spec's project "
                    f"({project.root}); {HOW} (did you mean 'torch.add'?)")


def test_an_installed_package_needs_imports(project):
    pip_dir = Path(importlib.util.find_spec("pip").submodule_search_locations[0])
    project.refused(project.build("pip.X"),
                    f"'pip.X': 'pip' is an installed package ({pip_dir}), outside the spec's "
                    f"project ({project.root}); mpgen imports it only if the spec lists 'pip' "
                    "under 'imports:'")


def test_imports_allows_a_package_found_on_the_python_path(project, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "extlayers").mkdir(parents=True)
    (site / "extlayers" / "__init__.py").write_text("")
    (site / "extlayers" / "gates.py").write_text(
        f"open({str(project.marker)!r}, 'w').write('ran')\n" + GATE)
    monkeypatch.syspath_prepend(str(site))
    project.refused(project.build("extlayers.gates.Gate"),
                    f"'extlayers.gates.Gate': 'extlayers' is an installed package "
                    f"({site.resolve() / 'extlayers'}), outside the spec's project "
                    f"({project.root}); mpgen imports it only if the spec lists 'extlayers' "
                    "under 'imports:'")
    ran = project.build("extlayers.gates.Gate", imports_=["extlayers"])
    assert ran.returncode == 0, ran.stderr
    assert project.marker.exists()


def test_a_listed_package_that_is_not_installed(project):
    project.refused(project.build("notinstalled.Gate", imports_=["notinstalled"]),
                    f"'notinstalled.Gate': no module 'notinstalled' in the spec's project "
                    f"({project.root}) or on Python's path, which 'imports:' lists; install "
                    "it, or put it in the project")


def test_a_link_out_of_the_project_is_refused_unless_root_includes_it(project, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text(f"open({str(project.marker)!r}, 'w').write('ran')\n" + GATE)
    project.specs.mkdir(parents=True)
    (project.specs / "evil.py").symlink_to(outside / "evil.py")
    project.refused(project.build("evil.Gate"),
                    f"'evil.Gate': evil.py is a link to {outside.resolve() / 'evil.py'}, "
                    f"outside the spec's project ({project.root}); {HOW}")
    # The same with the package folder as the link.
    (outside / "pkg").mkdir()
    (outside / "pkg" / "__init__.py").write_text("")
    (project.specs / "pkg").symlink_to(outside / "pkg")
    project.refused(project.build("pkg.Gate"),
                    f"'pkg.Gate': pkg/ is a link to {outside.resolve() / 'pkg'}, outside the "
                    f"spec's project ({project.root}); {HOW}")
    # A root that holds both is the user's say-so.
    graph = driver.compile_spec(project.spec("evil.Gate"), root=tmp_path)
    assert graph.nodes[0].op.module == "evil"
    assert project.marker.exists()


def test_a_module_in_a_working_directory_outside_the_project_is_refused(project, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "evil.py").write_text(f"open({str(project.marker)!r}, 'w').write('ran')\n" + GATE)
    spec = project.spec("evil.Gate")
    ran = mpgen("build", str(spec), "-o", str(project.root / "out"), cwd=elsewhere)
    project.refused(ran, f"'evil.Gate': module 'evil' is in {elsewhere.resolve()}, outside the "
                    f"spec's project ({project.root}); {HOW}", spec=str(spec))


def test_a_module_in_the_spec_folder_and_at_the_project_root_is_refused(project):
    # The generated code would import whichever comes first on its path (the
    # root under `python -m pytest` run there), not necessarily the one vetted.
    project.module("probe.py", GATE + "\nWHERE = 'specs'\n", marked=False)
    (project.root / "probe.py").write_text(GATE + "\nWHERE = 'root'\n")
    with pytest.raises(MpgenError, match="there are two modules named 'probe' in the project, "
                                         "in .*specs and in .*; the generated code imports "
                                         "whichever comes first on its path"):
        driver.compile_spec(project.spec("probe.Gate"))
    assert "probe" not in sys.modules
    (project.specs / "probe.py").unlink()
    driver.compile_spec(project.spec("probe.Gate"))
    assert sys.modules["probe"].WHERE == "root"


def test_the_project_root(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    spec = repo / "a" / "b" / "s.yaml"
    spec.parent.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cwd = Path.cwd()
    # No repository: the working directory holds the spec.
    assert imports.Project.of(spec).root == cwd
    # Outside the working directory: the spec's folder.
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    assert imports.Project.of(spec).root == spec.parent.resolve()
    # The nearest folder with a .git, a folder or a file (a worktree).
    (repo / ".git").write_text("gitdir: elsewhere\n")
    assert imports.Project.of(spec).root == repo.resolve()
    (repo / "a" / ".git").mkdir()
    project = imports.Project.of(spec)
    assert project.root == (repo / "a").resolve()
    assert project.search == (spec.parent.resolve(), (repo / "a").resolve())
    # The caller's root wins; folders outside it are not searched.
    project = imports.Project.of(spec, root=spec.parent, imports=["extlayers"])
    assert (project.root, project.search) == (spec.parent.resolve(), (spec.parent.resolve(),))
    assert project.outside == ((tmp_path / "other").resolve(),)
    assert project.imports == {"extlayers"}


def test_a_name_loaded_from_another_file_is_refused(project):
    project.module("yaml/__init__.py", "class Gate:\n    pass\n")
    project.refused(project.build("yaml.Gate"),
                    f"'yaml.Gate': a module named 'yaml' is already loaded (from "
                    f"{Path(yaml.__file__).resolve()}), not from yaml/__init__.py; rename your "
                    "module")


# -- compiled files --------------------------------------------------------------


def test_a_sourceless_pyc_is_refused(project):
    source = project.module("evil.py")
    py_compile.compile(str(source), cfile=str(project.specs / "evil.pyc"), doraise=True)
    source.unlink()
    # Python would run it ...
    subprocess.run([sys.executable, "-c", "import evil"], cwd=project.specs, check=True,
                   capture_output=True, timeout=120)
    assert project.marker.exists()
    project.marker.unlink()
    # ... mpgen does not.
    project.refused(project.build("evil.Gate"), "'evil.Gate': evil.pyc is a compiled module "
                    "without its source; mpgen imports only Python source (.py) files")


@pytest.mark.parametrize("compiled, module, op", [
    ("evil.pyc", "evil.py", "evil.Gate"),
    (f"evil{SO}", "evil.py", "evil.Gate"),
    ("evil.so", "evil.py", "evil.Gate"),
    ("pkg/__init__.so", "pkg/__init__.py", "pkg.Gate"),
    (f"pkg/gates{SO}", "pkg/gates.py", "pkg.gates.Gate"),
])
def test_a_compiled_module_beside_the_source_is_refused(project, compiled, module, op):
    project.module("pkg/__init__.py", "from .gates import Gate\n")
    project.module("pkg/gates.py")
    project.module("evil.py")
    (project.specs / compiled).write_bytes(b"\x7fELF not really")
    project.refused(project.build(op), f"{op!r}: {Path(compiled).name} beside {module} is a "
                    "compiled module Python may load instead of the source; remove it (mpgen "
                    "imports only Python source)")


def test_a_forged_bytecode_cache_is_refused_and_never_read(project, tmp_path):
    """An unchecked-hash .pyc in __pycache__ is what a plain import (the
    generated code's) runs, whatever the source says: refused, and never
    read by mpgen, which runs the source it checked."""
    project.module("evil.py", GATE, marked=False)
    forged = tmp_path / "forged" / "evil.py"
    forged.parent.mkdir()
    forged.write_text(f"open({str(project.marker)!r}, 'w').write('ran')\n" + GATE)
    cache = importlib.util.cache_from_source(str(project.specs / "evil.py"))
    py_compile.compile(str(forged), cfile=cache, doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    subprocess.run([sys.executable, "-c", "import evil"], cwd=project.specs, check=True,
                   capture_output=True, timeout=120)
    assert project.marker.exists(), "the forged cache is not what a plain import runs"
    project.marker.unlink()
    ran = project.build("evil.Gate")
    assert (ran.returncode, ran.stdout) == (2, "")
    assert ran.stderr == (
        f"specs/s.yaml:6:11: layer 'a': 'evil.Gate': __pycache__/{Path(cache).name} is a "
        "hash-based bytecode cache (Python writes none of its own), which Python would run "
        "instead of evil.py, the source mpgen checked; remove it (git rm --cached), and keep "
        "__pycache__/ out of the repository (.gitignore)\n")
    assert not project.marker.exists()


# -- what importing raises --------------------------------------------------------


@pytest.mark.parametrize("ending, described", [
    ("import sys\nsys.exit(0)\n", "SystemExit: 0"),
    ("raise SystemExit\n", "SystemExit"),
    ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    ("raise BaseException('line one\\nline two')\n", "BaseException: line one line two"),
    ("raise ImportError('no such thing')\n", "ImportError: no such thing"),
])
def test_anything_raised_while_importing_is_the_ops_error(project, ending, described):
    project.module("evil.py", GATE + ending, marked=False)
    ran = project.build("evil.Gate", command="check")
    assert (ran.returncode, ran.stdout) == (2, "")
    assert ran.stderr == ("specs/s.yaml:6:11: layer 'a': cannot import 'evil' for op "
                          f"'evil.Gate': {described}\n")
    assert "evil" not in sys.modules


def test_check_cannot_be_made_to_exit_0_by_a_module_that_exits(project):
    """The reported attack, through the real command line: a spec whose
    module calls sys.exit(0) while ``check`` runs with the examples."""
    project.module("evil.py", GATE + "import sys\nsys.exit(0)\n", marked=False)
    spec = project.spec("evil.Gate")
    ran = mpgen_process("check", str(spec), str(ROOT / "examples" / "seed.yaml"), "-o",
                        str(ROOT / "generated"), cwd=project.root)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr == (f"{spec}:6:11: layer 'a': cannot import 'evil' for op 'evil.Gate': "
                          "SystemExit: 0\n")


EXITS_WHEN_RUN = """\
import sys
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, dim):
        super().__init__()
        if dim == 8:
            sys.exit(0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        raise KeyboardInterrupt  # its own, not a Ctrl-C
"""


@pytest.mark.parametrize("dim, blamed", [
    (8, "mylayers.gates.Gate(8) cannot be built: SystemExit: 0"),
    (4, "mylayers.gates.Gate(4) fails on x [batch, 4]: KeyboardInterrupt"),
])
def test_a_class_that_exits_while_analysed_is_the_layers_error(project, dim, blamed):
    """Code a project may hold runs at build time (the class is built and run
    on meta); what it raises is the layer's error, and ``check`` never exits 0."""
    project.module("mylayers/__init__.py", "", marked=False)
    project.module("mylayers/gates.py", EXITS_WHEN_RUN, marked=False)
    spec = project.spec("mylayers.gates.Gate")
    spec.write_text(spec.read_text().replace("[batch, 8]", f"[batch, {dim}]")
                    .replace("args: [8]", f"args: [{dim}]"))
    ran = mpgen("check", str(spec), "-o", str(project.root / "out"), cwd=project.root)
    assert (ran.returncode, ran.stdout) == (2, "")
    assert ran.stderr == f"{spec}:6:3: layer 'a': {blamed}\n"


def test_a_real_interrupt_while_importing_is_not_swallowed(project):
    # The module waits for the interrupt it sent itself, however late it comes
    # (a loaded machine): only a swallowed one reaches the bound, a last resort.
    project.module("slow.py", "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                   "end = time.monotonic() + 60\n"
                   "while time.monotonic() < end:\n    time.sleep(0.01)\n" + GATE, marked=False)
    # Python's own handler, whatever an earlier test left.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            imports.user_class("slow.Gate", imports.Project.of(project.spec("slow.Gate")))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# -- function ops: an allowlist ---------------------------------------------------


def test_function_ops_come_from_an_allowlist():
    torch_names, f_names = ops.function_names("torch"), ops.function_names("F")
    assert {"add", "cat", "split", "einsum", "flatten", "where"} <= torch_names
    assert ops.FACTORIES <= torch_names
    assert {"relu", "gelu", "scaled_dot_product_attention", "pad", "softmax"} <= f_names
    for name in ("save", "load", "manual_seed", "set_default_dtype", "compile", "from_numpy",
                 "set_grad_enabled", "use_deterministic_algorithms", "Tensor", "hub"):
        assert name not in torch_names, name
    assert "has_torch_function" not in f_names


def test_every_function_op_of_the_examples_is_allowed():
    used = set()
    for path in (ROOT / "examples").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        for layers in [spec["layers"], *(b["layers"] for b in spec.get("blocks", {}).values())]:
            used |= {layer["op"] for layer in layers.values()
                     if isinstance(layer, dict) and layer["op"].startswith(("torch.", "F."))}
    assert used
    for op in sorted(used):
        prefix, name = op.split(".")
        assert name in ops.function_names(prefix), op
