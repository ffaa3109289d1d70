"""``mpgen ci-summary`` against a pull request that tries to hide a layout change
(NOTE [Every change seen] in mpgen/commands/ci_summary.py): real git
repositories in temporary folders, each hostile case on its own.

The pull request controls its tree (``.gitattributes``, ``pyproject.toml``,
how a spec is written); the repository's config (a clean filter, textconv,
``core.fsmonitor``) stands for what a developer's or runner's config may
hold. In every case the summary must show the layer that moves.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import GATE, mpgen, write_spec
from mpgen.commands import ci_summary


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout


def spec_text(name: str, second_device: str = "cuda:1", key: str = "mpgen") -> str:
    return textwrap.dedent(f"""\
        {key}: 1
        name: {name}
        inputs:
          x: [batch, 10]
        layers:
          layer1: {{op: Linear, args: [10, 20]}}
          layer2: {{op: Linear, args: [20, 10]}}
        placement:
          layer1: cuda:0
          layer2: {second_device}
        """)


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture
def repo(tmp_path) -> Path:
    """``main`` holds ``model.yaml`` (layer2 on cuda:1); HEAD is branch ``pr``."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    write_spec(path, spec_text("Model"), "model.yaml")
    commit_all(path, "base")
    git(path, "checkout", "-q", "-b", "pr")
    return path


def summary(repo: Path, *specs: str) -> str:
    ran = mpgen("ci-summary", "--base", "main", *specs, cwd=repo)
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr
    return ran.stdout


def test_yaml_marked_binary_by_the_pull_request_is_still_read(repo):
    # -diff (binary) made `git grep -I` skip every spec: "No spec changed".
    (repo / ".gitattributes").write_text("*.yaml -diff\n*.yml binary\n")
    write_spec(repo, spec_text("Model", "cuda:0"), "model.yaml")
    commit_all(repo, "move layer2, specs binary")
    text = summary(repo)
    assert "| `model.yaml` | changed |" in text
    assert "  layer2: cuda:1 -> cuda:0" in text


def test_a_clean_filter_and_textconv_do_not_hide_a_change(repo):
    # A clean filter that turns the new text back into the old one makes
    # `git diff` against the working tree see nothing; a textconv can too.
    git(repo, "config", "filter.hide.clean", "sed s/layer2:.cuda:0/layer2:\\ cuda:1/")
    git(repo, "config", "filter.hide.smudge", "cat")
    git(repo, "config", "diff.hide.textconv", "true")
    (repo / ".gitattributes").write_text("*.yaml filter=hide diff=hide\n")
    commit_all(repo, "attributes")
    write_spec(repo, spec_text("Model", "cuda:0"), "model.yaml")  # not committed
    text = summary(repo)
    assert "  layer2: cuda:1 -> cuda:0" in text


def test_core_fsmonitor_of_the_repository_never_runs(repo, tmp_path):
    # An fsmonitor hook answers which files changed (here: none), and is a
    # program git runs; check's git calls turn it off, and so does the summary.
    marker = tmp_path / "fsmonitor-ran"
    hook = tmp_path / "fsmonitor.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\nprintf '/\\0'\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    git(repo, "config", "core.fsmonitor", str(hook))
    write_spec(repo, spec_text("Model", "cuda:0"), "model.yaml")
    git(repo, "status", "--porcelain")  # what git itself does with the hook
    assert marker.exists()
    marker.unlink()
    text = summary(repo)
    assert "  layer2: cuda:1 -> cuda:0" in text
    assert not marker.exists()


@pytest.mark.parametrize("key, layout", [
    ('"mpgen"', "block"), ("'mpgen'", "block"), ("mpgen", "flow"), ("mpgen", "comment")])
def test_a_new_spec_is_found_however_it_writes_its_version_key(repo, key, layout):
    text = spec_text("Added", "cpu", key=key)
    if layout == "flow":  # the same spec as one YAML flow mapping
        text = ('{mpgen: 1, name: Added, inputs: {x: [batch, 10]}, layers: {layer1: {op: Linear, '
                'args: [10, 20]}, layer2: {op: Linear, args: [20, 10]}}, placement: '
                '{layer1: cuda:0, layer2: cpu}}\n')
    elif layout == "comment":
        text = "# a spec\n---\n" + text
    write_spec(repo, text, "added.yaml")
    commit_all(repo, "a new spec")
    out = summary(repo)
    assert "| `added.yaml` | new |" in out, out
    assert "layer2" in out and "cpu" in out


def pyproject(specs: str = '["model.yaml"]', device_map: str | None = None) -> str:
    lines = ["[tool.mpgen]", f"specs = {specs}"]
    if device_map is not None:
        lines.append(f'device-map = "{device_map}"')
    return "\n".join(lines) + "\n"


def test_a_device_map_change_is_shown_as_the_moves_of_each_spec(repo):
    (repo / "pyproject.toml").write_text(pyproject(device_map="cuda:1=cuda:0"))
    git(repo, "checkout", "-q", "main")
    commit_all(repo, "main maps cuda:1 to cuda:0")
    git(repo, "checkout", "-q", "-B", "pr")
    (repo / "pyproject.toml").write_text(pyproject(device_map="cuda:0=cuda:2"))
    commit_all(repo, "the pull request moves everything through the device map")
    text = summary(repo)
    assert "`[tool.mpgen]` of `pyproject.toml` changed since" in text
    assert "- `device-map`: `'cuda:1=cuda:0'` -> `'cuda:0=cuda:2'`" in text
    assert "| `model.yaml` | moved by `[tool.mpgen]` |" in text
    assert "  layer1: cuda:0 -> cuda:2" in text and "  layer2: cuda:0 -> cuda:1" in text
    # A setting that moves nothing lists no spec.
    (repo / "pyproject.toml").write_text(pyproject(device_map="cuda:1=cuda:0") + "out = \"gen\"\n")
    text = summary(repo)
    assert "- `out`: unset -> `'gen'`" in text and "No spec changed since `main`" in text


def test_the_spec_list_of_the_project_counts_whatever_the_file_is_named(repo):
    # A file of [tool.mpgen] specs is a spec to build, whatever its name.
    (repo / "pyproject.toml").write_text(pyproject('["layouts/*.spec"]'))
    (repo / "layouts").mkdir()
    write_spec(repo, spec_text("Other"), "layouts/other.spec")
    git(repo, "checkout", "-q", "main")
    commit_all(repo, "a project")
    git(repo, "checkout", "-q", "-B", "pr")
    write_spec(repo, spec_text("Other", "cuda:3"), "layouts/other.spec")
    commit_all(repo, "move")
    text = summary(repo)
    assert "| `layouts/other.spec` | changed |" in text
    assert "  layer2: cuda:1 -> cuda:3" in text


def test_a_raised_time_limit_of_the_project_is_said_as_build_says_it(repo):
    (repo / "pyproject.toml").write_text(pyproject() + "time-limit = 60\n")
    ran = mpgen("ci-summary", "--base", "main", cwd=repo)
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == "pyproject.toml:3:14: note: time-limit raised to 60 s CPU (default 16 s)\n"
    ran = mpgen("ci-summary", "--base", "main", "--time-limit", "9", cwd=repo)
    assert (ran.returncode, ran.stderr) == (0, "")  # the command line's, not the file's


def test_a_broken_device_map_of_the_pull_request_is_one_line(repo):
    (repo / "pyproject.toml").write_text(pyproject(device_map="cuda:0=gpu0"))
    ran = mpgen("ci-summary", "--base", "main", cwd=repo)
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr.startswith("pyproject.toml:3:14: [tool.mpgen] device-map: ")
    assert ran.stderr.count("\n") == 1


def test_git_runs_with_what_a_tree_or_config_could_change_turned_off():
    assert {"core.fsmonitor=false", "core.attributesFile=/dev/null",
            "core.untrackedCache=false"} <= set(ci_summary.GIT)
    env = ci_summary.git_env({"GIT_EXTERNAL_DIFF": "x", "PATH": os.environ["PATH"]})
    assert env["GIT_ATTR_NOSYSTEM"] == "1" and "GIT_EXTERNAL_DIFF" not in env


def test_is_spec_reads_the_yaml_as_the_loader_does():
    assert ci_summary.is_spec(b'"mpgen": 1\nname: A\n', "a.yaml")
    assert ci_summary.is_spec(b"{mpgen: 1}\n", "a.yaml")
    assert not ci_summary.is_spec(b"settings:\n  mpgen: 1\n", "a.yaml")  # not top level
    assert not ci_summary.is_spec(b"lr: 1\n", "a.yaml")
    # YAML the loader refuses (an alias) is still a spec when it says so.
    assert ci_summary.is_spec(b"mpgen: 1\na: &x 1\nb: *x\n", "a.yaml")
    assert not ci_summary.is_spec("refused", "a.yaml")  # not read: a link out, too large


def test_the_base_follows_a_link_inside_its_tree_and_names_odd_files(repo):
    # A spec named like a message ("a b.yaml") is a spec; a link in the base
    # is read as what it points to, as the file system would.
    git(repo, "checkout", "-q", "main")
    write_spec(repo, spec_text("Odd"), "a spec.yaml")
    os.symlink("model.yaml", repo / "linked.yaml")
    commit_all(repo, "odd names")
    git(repo, "checkout", "-q", "-B", "pr")
    write_spec(repo, spec_text("Odd", "cuda:2"), "a spec.yaml")
    (repo / "linked.yaml").unlink()
    write_spec(repo, spec_text("Model", "cuda:3"), "linked.yaml")
    commit_all(repo, "move both")
    text = summary(repo)
    assert "| `a spec.yaml` | changed |" in text and "  layer2: cuda:1 -> cuda:2" in text
    assert "| `linked.yaml` | changed |" in text and "  layer2: cuda:1 -> cuda:3" in text


def test_a_batch_change_shows_each_device_s_memory_plan(repo):
    text = spec_text("Model") + "train:\n  batch_size: 4\n"
    write_spec(repo, text, "model.yaml")
    git(repo, "checkout", "-q", "main")
    commit_all(repo, "main trains at 4")
    git(repo, "checkout", "-q", "-B", "pr")
    write_spec(repo, text.replace("batch_size: 4", "batch_size: 256"), "model.yaml")
    shown = summary(repo)
    assert "| `model.yaml` | changed |" in shown
    assert "memory plan (peak per device, batch 4 -> 256):" in shown
    assert re.search(r"^  cuda:1 train peak .* -> .* \(\+\d+%\)$", shown, re.M)


@pytest.mark.slow  # compiles a spec that imports the project's own module, in a child
def test_the_project_s_tool_mpgen_gives_the_specs_the_device_map_and_the_root(repo):
    """ci-summary reads ``[tool.mpgen]`` as ``build`` does: ``specs`` (files
    of any name), ``device-map``, and ``root``, where a spec's own modules
    are found (docs/project.md)."""
    (repo / "pyproject.toml").write_text(
        pyproject('["layouts/*.spec"]', device_map="cuda:1=cuda:0") + 'root = "src"\n')
    (repo / "src").mkdir()
    (repo / "src" / "mylayers.py").write_text(GATE)
    gated = spec_text("Gated").replace("layer1: {op: Linear, args: [10, 20]}",
                                       "gate: {op: mylayers.Gate, args: [10]}\n"
                                       "  layer1: {op: Linear, args: [10, 20]}")
    (repo / "layouts").mkdir()
    write_spec(repo, gated, "layouts/gated.spec")
    git(repo, "checkout", "-q", "main")
    commit_all(repo, "a project")
    git(repo, "checkout", "-q", "-B", "pr")
    write_spec(repo, gated.replace("layer2: cuda:1", "layer2: cuda:3"), "layouts/gated.spec")
    commit_all(repo, "move")
    text = summary(repo)
    assert "| `layouts/gated.spec` | changed |" in text, text
    assert "  layer2: cuda:0 -> cuda:3" in text  # the base's cuda:1 is mapped to cuda:0
    (repo / "pyproject.toml").write_text(
        pyproject('["layouts/*.spec"]', device_map="cuda:1=cuda:0"))  # no root: not found
    ran = mpgen("ci-summary", "--base", "main", cwd=repo)
    assert ran.returncode == 2 and "mylayers" in ran.stdout
