"""The docs' examples run as written (README.md, docs/*.md, docs/examples/*).

Every fenced block of the docs is one of:

- a shell block (```` ```sh ````, ``bash``, ``shell``, ``console``): run,
  block after block of one page in one temporary copy of the project (the
  working tree's files, with this environment's ``.venv``; ``scripts/setup.sh``,
  the install, is the environment itself), each with ``bash -euo pipefail``,
  the ``.venv``'s ``mpgen`` and ``python`` first on ``PATH``; in a block
  written as a transcript only the ``$ `` lines run. A block that cannot run
  here (GPUs, the network, the whole suite, a file only the reader has) is
  marked on the line before its fence, with why::

      <!-- example: illustrative (needs 4 GPUs) -->

- a YAML block: a spec (a top-level ``mpgen`` key) is validated as the spec
  loader does and compiled, unless marked illustrative (then validated only);
  a pre-commit config names hooks of ``.pre-commit-hooks.yaml`` and every
  hook its page tells to run (the ``repo: local`` form runs under pre-commit:
  :func:`test_the_pre_commit_example_runs_the_hooks_its_page_runs`); a
  workflow is ``docs/examples``'s file (``tests/commands/test_integrations.py``
  runs its steps); anything else (a fragment of a spec, a profile) parses.
  A YAML block whose first line is a comment naming a file (``# spec.yaml``)
  is written to that file of the page's copy before the blocks after it run.
- a TOML block: parses, and its ``[tool.mpgen]`` is one ``mpgen.config`` reads.
- a Python block: parses (it shows generated code or a user's module).
- any other block (``text``, none) shows what a command prints: not run.

A runnable block that breaks fails its page's test, naming the block.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import yaml

from helpers import ROOT

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                              for p in (ROOT / "docs").glob("*.md"))]
SHELL = ("sh", "bash", "shell", "console")
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                   re.M | re.S)
MARK = re.compile(r"<!-- example: illustrative \((?P<why>[^)]+)\) -->\n\Z")
NAMED = re.compile(r"#\s*(?P<name>[\w./-]+\.ya?ml)\s*$")
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    body: str
    illustrative: Optional[str]  # why, where marked

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'no language'})"

    @property
    def named(self) -> Optional[str]:
        """The file a YAML block names on its first line (``# gpt2_tiny.yaml``)."""
        found = NAMED.fullmatch(self.body.split("\n", 1)[0])
        return found["name"] if found and self.lang == "yaml" else None


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()]
        mark = MARK.search(before[-300:])
        found.append(Block(page, before.count("\n") + 1, m["lang"].strip().lower(), m["body"],
                           mark["why"] if mark else None))
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def _yaml(block: Block):
    return yaml.safe_load(block.body)


def test_the_docs_have_examples_and_every_mark_says_why():
    assert len(ALL) > 100 and sum(b.lang in SHELL for b in ALL) > 15
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        marks = len(re.findall(r"^<!-- example:", text, re.M))
        # each mark is well formed and stands right before a block's fence
        assert marks == sum(b.illustrative is not None for b in blocks(page)), page


# -- shell blocks ----------------------------------------------------------------

def commands(block: Block) -> str:
    """The script a shell block runs: its lines, or a transcript's ``$ `` lines."""
    lines = block.body.splitlines()
    if any(line.startswith("$ ") for line in lines):
        return "\n".join(line[2:] for line in lines if line.startswith("$ ")) + "\n"
    return block.body


RUNNABLE = {page: [b for b in blocks(page) if b.lang in SHELL and b.illustrative is None]
            for page in PAGES}


def copy_of_the_project(folder: Path) -> Path:
    """The working tree's files (tracked, or untracked and not ignored), with
    this environment's ``.venv``; ``scripts/setup.sh`` is that environment."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (os.fsdecode(n) for n in listed)):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    (folder / ".venv").symlink_to(BIN.parent)
    setup = folder / "scripts" / "setup.sh"
    setup.write_text("#!/usr/bin/env bash\n# the test's environment is installed already\n"
                     "test -x \"$(dirname \"$0\")/../.venv/bin/python\"\n")
    return folder


@pytest.mark.slow  # each page's examples train and build for real
@pytest.mark.parametrize("page", [p for p in PAGES if RUNNABLE[p]])
def test_the_shell_examples_of_a_page_run_as_written(page, tmp_path):
    project = copy_of_the_project(tmp_path / "project")
    env = {**os.environ, "PATH": f"{project / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)
    for block in blocks(page):
        if block.named is not None:
            (project / block.named).write_text(block.body, encoding="utf-8")
        if block not in RUNNABLE[page]:
            continue
        done = subprocess.run(["bash", "--noprofile", "--norc", "-euo", "pipefail", "-c",
                               commands(block)], cwd=project, env=env, capture_output=True,
                              text=True, timeout=1200)
        assert done.returncode == 0, (f"{block} exits {done.returncode}:\n{commands(block)}\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


# -- YAML, TOML and Python blocks -----------------------------------------------

def _id(block: Block) -> str:
    return f"{block.page}:{block.line}"


SPECS = [b for b in ALL if b.lang == "yaml" and isinstance(_yaml(b), dict) and "mpgen" in _yaml(b)]


@pytest.mark.parametrize("block", SPECS, ids=_id)
def test_a_spec_in_the_docs_is_valid_and_compiles(block, tmp_path):
    from mpgen.compiler import driver
    from mpgen.spec_schema.load import load_text
    from mpgen.spec_schema.validate import validate

    name = block.named or "spec.yaml"
    validate(load_text(block.body, name))
    if block.illustrative is None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(block.body, encoding="utf-8")
        driver.compile_spec(tmp_path / name)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("yaml", "yml")], ids=_id)
def test_a_yaml_block_parses(block):
    assert _yaml(block) is not None


def hook_ids() -> set[str]:
    return {hook["id"] for hook in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}


def pre_commit_configs(page: str = "docs/ci.md") -> list[Block]:
    return [b for b in blocks(page) if b.lang == "yaml" and isinstance(_yaml(b), dict)
            and "repos" in _yaml(b)]


def test_the_pre_commit_examples_declare_every_hook_their_page_runs():
    text = (ROOT / "docs" / "ci.md").read_text()
    ran = set(re.findall(r"pre-commit run [^`\n]*?\b(mpgen-[a-z]+)", text))
    assert ran >= {"mpgen-build"}
    configs = pre_commit_configs()
    assert len(configs) == 2
    for block in configs:
        declared = {hook["id"] for repo in _yaml(block)["repos"] for hook in repo["hooks"]}
        assert declared <= hook_ids(), block
        assert ran <= declared, f"{block} lacks {ran - declared}, which docs/ci.md runs"


@pytest.mark.slow  # pre-commit, then mpgen build and check
def test_the_pre_commit_example_runs_the_hooks_its_page_runs(tmp_path):
    """The ``repo: local`` form of docs/ci.md in a project with docs/ci.md's
    ``[tool.mpgen]``: the manual build hook, then the check."""
    local = next(b for b in pre_commit_configs() if _yaml(b)["repos"][0]["repo"] == "local")
    table = next(b for b in blocks("docs/ci.md") if b.lang == "toml")
    repo = tmp_path / "repo"
    (repo / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "seed.yaml", repo / "specs" / "seed.yaml")
    (repo / "pyproject.toml").write_text(table.body + 'device-map = "cpu"\n')
    (repo / ".pre-commit-config.yaml").write_text(local.body)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")}
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    for args in (["--hook-stage", "manual", "mpgen-build", "--all-files"], ["--all-files"]):
        done = subprocess.run([str(BIN / "pre-commit"), "run", *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"pre-commit run {' '.join(args)}:\n{done.stdout}{done.stderr}"
        subprocess.run([*git, "add", "."], cwd=repo, check=True)
    assert (repo / "generated" / "simple_model.py").is_file()


def test_the_workflow_blocks_are_the_files_in_docs_examples():
    shown = [b.body for b in blocks("docs/ci.md") if b.lang == "yaml" and "jobs" in _yaml(b)]
    files = sorted((ROOT / "docs" / "examples").glob("*.yml"))
    assert sorted(shown) == sorted(p.read_text() for p in files)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "toml"], ids=_id)
def test_a_toml_block_is_a_project_config_mpgen_reads(block, tmp_path):
    from mpgen import config

    assert "tool" in tomllib.loads(block.body)
    (tmp_path / "pyproject.toml").write_text(block.body)
    assert config.load(tmp_path) is not None


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python" and not b.illustrative],
                         ids=_id)
def test_a_python_block_parses(block):
    ast.parse(textwrap.dedent(block.body))  # an excerpt of a class's body, too
