"""mpgen in a project's tooling: the pre-commit hooks, the CI workflow and its
pull-request summary (``mpgen ci-summary``), ``.gitattributes``, completion.

pre-commit runs for real (the test extra installs it): a hook defined by
``.pre-commit-hooks.yaml`` runs as a ``repo: local`` hook with
``language: system``, i.e. the installed mpgen; what ``language: python``
adds, a virtualenv with mpgen installed from its repository, needs the
network and torch's download, and is not exercised here.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import yaml

from helpers import EXAMPLES, ROOT, mpgen, write_spec

BIN = Path(sys.executable).parent  # the environment's mpgen, pre-commit


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout


def new_repo(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    return path


def spec_text(name: str, second_device: str = "cuda:1", width: int = 20) -> str:
    return textwrap.dedent(f"""\
        mpgen: 1
        name: {name}
        inputs:
          x: [batch, 10]
        layers:
          layer1: {{op: Linear, args: [10, {width}]}}
          layer2: {{op: Linear, args: [{width}, 10]}}
        placement:
          layer1: cuda:0
          layer2: {second_device}
        """)


def hooks() -> dict[str, dict]:
    loaded = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    return {hook["id"]: hook for hook in loaded}


# -- pre-commit ------------------------------------------------------------

def test_the_hooks_file_declares_check_and_a_manual_build():
    found = hooks()
    check, build = found["mpgen-check"], found["mpgen-build"]
    assert check["entry"] == "mpgen check" and build["entry"] == "mpgen build"
    for hook in (check, build):
        assert hook["language"] == "python"
        assert hook["pass_filenames"] is False  # every spec, or those of [tool.mpgen]
        files = re.compile(hook["files"])
        for name in ("model.yaml", "specs/gpt.yml", "generated/model.py", "pyproject.toml",
                     "sub/pyproject.toml"):
            assert files.search(name), name
        for name in ("README.md", "model.yaml.bak", "notpyproject.toml"):
            assert not files.search(name), name
    assert "stages" not in check and build["stages"] == ["manual"]


@pytest.mark.parametrize("hook", ["mpgen-check", "mpgen-build"])
def test_each_hook_entry_runs(hook):
    entry = hooks()[hook]["entry"].split()
    done = subprocess.run([str(BIN / entry[0]), *entry[1:], "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: mpgen {entry[1]}")


def pre_commit(repo: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")}
    return subprocess.run([str(BIN / "pre-commit"), "run", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)


def local_config(repo: Path, hook_id: str, args: list[str] | None = None) -> None:
    """``.pre-commit-config.yaml`` running our hook as installed: its definition,
    with ``language: system`` (no virtualenv to build) and ``args``."""
    hook = {**hooks()[hook_id], "language": "system", **({"args": args} if args else {})}
    config = {"repos": [{"repo": "local", "hooks": [hook]}]}
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.slow
def test_pre_commit_runs_the_check_hook_with_specs_as_args(tmp_path):
    repo = new_repo(tmp_path / "repo")
    write_spec(repo, spec_text("SimpleModel"), "model.yaml")
    assert mpgen("build", "model.yaml", cwd=repo).returncode == 0
    local_config(repo, "mpgen-check", ["model.yaml"])
    git(repo, "add", ".")

    done = pre_commit(repo, tmp_path, "--all-files")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"mpgen check\.+Passed", done.stdout)

    # A hand edit of the generated code fails the hook, with the diff and the fix.
    model = repo / "generated" / "simple_model.py"
    model.write_text(model.read_text().replace("nn.Linear(10, 20)", "nn.Linear(10, 21)"))
    done = pre_commit(repo, tmp_path, "--all-files")
    assert done.returncode == 1
    assert re.search(r"mpgen check\.+Failed", done.stdout)
    assert "+        self.layer1 = nn.Linear(10, 20)" in done.stdout
    assert "run: mpgen build model.yaml" in done.stdout

    # Only a staged spec, generated file or pyproject.toml starts it.
    (repo / "notes.md").write_text("notes\n")
    git(repo, "add", "notes.md")
    done = pre_commit(repo, tmp_path, "--files", "notes.md")
    assert done.returncode == 0 and re.search(r"mpgen check\.+\(no files to check\)Skipped",
                                              done.stdout), done.stdout


@pytest.mark.slow
def test_pre_commit_hooks_with_the_project_configuration(tmp_path):
    # [tool.mpgen] names the specs: neither hook needs arguments.
    repo = new_repo(tmp_path / "repo")
    (repo / "specs").mkdir()
    write_spec(repo / "specs", spec_text("SimpleModel"), "model.yaml")
    (repo / "pyproject.toml").write_text('[tool.mpgen]\nspecs = ["specs/*.yaml"]\n'
                                         'out = "src/generated"\n')
    local_config(repo, "mpgen-build")
    git(repo, "add", ".")
    done = pre_commit(repo, tmp_path, "--hook-stage", "manual", "mpgen-build", "--all-files")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / "src" / "generated" / "simple_model.py").is_file()

    local_config(repo, "mpgen-check")
    git(repo, "add", ".")
    done = pre_commit(repo, tmp_path, "--all-files")
    assert done.returncode == 0, done.stdout + done.stderr
    (repo / "specs" / "model.yaml").write_text(spec_text("SimpleModel", "cuda:0"))
    done = pre_commit(repo, tmp_path, "--all-files")
    assert done.returncode == 1 and "src/generated/simple_model.py" in done.stdout


# -- mpgen ci-summary ----------------------------------------------------------

@pytest.fixture
def pull_request(tmp_path) -> Path:
    """A repository whose branch ``pr`` moves a layer of one spec, adds a spec,
    deletes another and edits a YAML file that is no spec, after ``main``."""
    repo = new_repo(tmp_path / "repo")
    write_spec(repo, spec_text("Moved"), "moved.yaml")
    (repo / "models").mkdir()
    write_spec(repo / "models", spec_text("Gone", width=30), "gone.yml")
    (repo / "settings.yaml").write_text("lr: 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    git(repo, "checkout", "-q", "-b", "pr")
    write_spec(repo, spec_text("Moved", "cuda:0"), "moved.yaml")
    git(repo, "rm", "-q", "models/gone.yml")  # and its folder
    (repo / "models").mkdir()
    write_spec(repo / "models", spec_text("Added", "cpu", width=7), "added.yaml")
    (repo / "settings.yaml").write_text("lr: 2\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "the pull request")
    return repo


def test_ci_summary_of_a_pull_request(pull_request):
    base = git(pull_request, "rev-parse", "--short=12", "main").strip()
    ran = mpgen("ci-summary", "--base", "main", cwd=pull_request)
    assert ran.returncode == 0, ran.stderr
    text = ran.stdout
    assert text.startswith("## mpgen: layout changes\n\n"
                           f"3 specs changed since `main` (merge base `{base}`):\n\n"
                           "| spec | change |\n|---|---|\n"
                           "| `models/added.yaml` | new |\n"
                           "| `models/gone.yml` | deleted |\n"
                           "| `moved.yaml` | changed |\n")
    assert "settings.yaml" not in text  # no top-level mpgen: key on either side
    sections = dict(re.findall(r"^### ([^\n]+)\n\n```text\n(.*?)\n```$", text, re.S | re.M))
    assert set(sections) == {"`models/added.yaml` (new)", "`moved.yaml` (changed)"}
    moved = sections["`moved.yaml` (changed)"]
    assert moved.startswith(f"--- {base}:moved.yaml\n+++ moved.yaml\n")
    assert "  layer2: cuda:1 -> cuda:0" in moved
    assert "  - layer1 [batch, 20]: cuda:0 -> cuda:1 (2,560 bytes)" in moved  # 32 x 20 x 4
    added = sections["`models/added.yaml` (new)"]
    assert re.search(r"^layer1 +Linear +cuda:0 +\[batch, 7\] +77$", added, re.M)
    assert re.search(r"^layer2 +Linear +cpu +\[batch, 10\] +80$", added, re.M)


def test_ci_summary_of_named_specs_and_uncommitted_changes(pull_request):
    # The working tree is the new side, from a subfolder too; SPECs choose.
    write_spec(pull_request, spec_text("Moved", "cuda:2"), "moved.yaml")
    ran = mpgen("ci-summary", "--base", "main", "../moved.yaml", cwd=pull_request / "models")
    assert ran.returncode == 0, ran.stderr
    assert "1 spec changed" in ran.stdout and "added.yaml" not in ran.stdout
    assert "  layer2: cuda:1 -> cuda:2" in ran.stdout
    ran = mpgen("ci-summary", "--base", "pr", cwd=pull_request)
    assert "  layer2: cuda:0 -> cuda:2" in ran.stdout


def test_ci_summary_of_a_renamed_spec(pull_request):
    git(pull_request, "mv", "moved.yaml", "renamed.yaml")
    ran = mpgen("ci-summary", "--base", "main", "renamed.yaml", cwd=pull_request)
    assert "| `renamed.yaml` | renamed from `moved.yaml` |" in ran.stdout
    assert "+++ renamed.yaml" in ran.stdout and "  layer2: cuda:1 -> cuda:0" in ran.stdout


def test_ci_summary_when_nothing_changed(pull_request):
    ran = mpgen("ci-summary", "--base", "HEAD", cwd=pull_request)
    assert ran.returncode == 0
    head = git(pull_request, "rev-parse", "--short=12", "HEAD").strip()
    assert ran.stdout == ("## mpgen: layout changes\n\n"
                          f"No spec changed since `HEAD` (merge base `{head}`).\n")


def test_ci_summary_shows_a_spec_that_does_not_compile_and_exits_2(pull_request):
    text = spec_text("Moved").replace("layer2: cuda:1", "layer2: cuda1")
    write_spec(pull_request, text, "moved.yaml")
    ran = mpgen("ci-summary", "--base", "main", cwd=pull_request)
    assert ran.returncode == 2
    assert ("### `moved.yaml` (changed)\n\n```text\ndoes not compile:\n"
            "moved.yaml:10:11: placement of 'layer2': invalid device 'cuda1'") in ran.stdout
    assert "### `models/added.yaml` (new)" in ran.stdout  # the others still shown
    assert ran.stderr == "mpgen ci-summary: does not compile: moved.yaml\n"


def test_ci_summary_refuses_a_base_it_cannot_find(pull_request, tmp_path):
    ran = mpgen("ci-summary", "--base", "origin/main", cwd=pull_request)
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr.startswith("mpgen ci-summary: git merge-base failed: ")
    assert "fetch-depth: 0" in ran.stderr
    ran = mpgen("ci-summary", "--base=--output=x", cwd=pull_request)
    assert ran.returncode == 2
    assert "'--output=x' is not a revision" in ran.stderr and not (pull_request / "x").exists()
    outside = tmp_path / "outside"
    outside.mkdir()
    ran = mpgen("ci-summary", "--base", "main", cwd=outside)
    assert ran.returncode == 2 and "git rev-parse failed" in ran.stderr


def test_ci_summary_reads_the_base_from_git_not_from_a_file_named_like_it(pull_request):
    # The pull request commits files named as the merge base's REV:path holding
    # its new layout: the summary still compares with the spec in git.
    full = git(pull_request, "rev-parse", "main").strip()
    for commit in (full, full[:12], full[:7]):
        write_spec(pull_request, spec_text("Moved", "cuda:0"), f"{commit}:moved.yaml")
    git(pull_request, "add", ".")
    git(pull_request, "commit", "-q", "-m", "forged base sides")
    ran = mpgen("ci-summary", "--base", "main", "moved.yaml", cwd=pull_request)
    assert ran.returncode == 0, ran.stderr
    assert f"--- {full[:12]}:moved.yaml\n+++ moved.yaml\n\nmoved:\n  layer2: cuda:1 -> cuda:0\n" \
        in ran.stdout
    assert "moved: nothing" not in ran.stdout
    # Unnamed, the forged files are new specs of the pull request: shown as such.
    ran = mpgen("ci-summary", "--base", "main", cwd=pull_request)
    assert f"| `{full[:12]}:moved.yaml` | new |" in ran.stdout
    assert "| `moved.yaml` | changed |" in ran.stdout and "  layer2: cuda:1 -> cuda:0" in ran.stdout


def test_ci_summary_does_not_read_a_spec_linked_out_of_the_repository(pull_request, tmp_path):
    # Its errors would quote the file (a key of a credentials file) in a comment.
    secret = tmp_path / "credentials.yml"
    secret.write_text("ghs_secret_value: 1\n")
    (pull_request / "moved.yaml").unlink()
    (pull_request / "moved.yaml").symlink_to(secret)
    for named in ([], ["moved.yaml"]):
        ran = mpgen("ci-summary", "--base", "main", *named, cwd=pull_request)
        assert ran.returncode == 2, named
        assert ("### `moved.yaml` (changed)\n\n```text\ndoes not compile:\nmoved.yaml: a symbolic "
                "link to a file outside the repository; not read\n```") in ran.stdout
        assert "ghs_secret" not in ran.stdout + ran.stderr


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed ``mpgen ARGS`` in a fresh process; output as bytes."""
    return subprocess.run([str(BIN / "mpgen"), *args], cwd=cwd, env=env, capture_output=True,
                          timeout=600)


@pytest.mark.slow
def test_ci_summary_markdown_keeps_hostile_names_inert(tmp_path):
    repo = new_repo(tmp_path / "repo")
    write_spec(repo, spec_text("Base"), "base.yaml")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    names = ["a`b``c.yaml", "<img src=x onerror=alert(1)>.yaml", "@org/team.yaml",
             "[l](javascript:alert(1)) | x.yaml", "n\n::error::x\r\x1b[31m.yaml", " `sp` .yaml"]
    for name in names:
        (repo / name).parent.mkdir(exist_ok=True)
        write_spec(repo, spec_text("Added"), name)
    git(repo, "checkout", "-q", "-b", "pr")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "hostile names")
    done = run_cli("ci-summary", "--base", "main", cwd=repo)
    assert done.returncode == 0, done.stderr
    table = done.stdout.split(b"\n\n")[2]
    assert table == (b"| spec | change |\n|---|---|\n"
                     b"| `` `sp` .yaml`` | new |\n"
                     b"| `<img src=x onerror=alert(1)>.yaml` | new |\n"
                     b"| `@org/team.yaml` | new |\n"
                     b"| `[l](javascript:alert(1)) \\| x.yaml` | new |\n"
                     b"| ```a`b``c.yaml``` | new |\n"
                     b"| `n\\n::error::x\\r\\x1b[31m.yaml` | new |")
    headings = [line for line in done.stdout.split(b"\n") if line.startswith(b"###")]
    assert headings == [b"### `` `sp` .yaml`` (new)",
                        b"### `<img src=x onerror=alert(1)>.yaml` (new)",
                        b"### `@org/team.yaml` (new)",
                        b"### `[l](javascript:alert(1)) | x.yaml` (new)",
                        b"### ```a`b``c.yaml``` (new)",
                        b"### `n\\n::error::x\\r\\x1b[31m.yaml` (new)"]
    assert b"\r" not in done.stdout and b"\x1b" not in done.stdout
    # As CommonMark with GitHub's tables reads it: every name is code, nothing else.
    markdown_it = pytest.importorskip("markdown_it")
    rendered = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(
        done.stdout.decode())
    assert "<img" not in rendered and "<a " not in rendered
    for name in names:
        shown = name.encode("unicode_escape").decode()  # as Python writes it: n\\n...
        assert f"<code>{html.escape(shown, quote=False)}</code>" in rendered


# -- the GitHub Actions workflow -----------------------------------------------

WORKFLOW = ROOT / "docs" / "examples" / "mpgen.yml"
COMMENT_WORKFLOW = ROOT / "docs" / "examples" / "mpgen-comment.yml"


def workflow_steps(path: Path = WORKFLOW, job: str = "mpgen") -> dict[str, dict]:
    workflow = yaml.safe_load(path.read_text())
    return {step.get("name", step.get("uses")): step for step in workflow["jobs"][job]["steps"]}


def test_the_workflows_are_the_ones_docs_ci_shows():
    shown = (ROOT / "docs" / "ci.md").read_text()
    for path in (WORKFLOW, COMMENT_WORKFLOW):
        assert f"```yaml\n{path.read_text()}```" in shown
    steps = workflow_steps()
    assert steps["actions/checkout@v4"]["with"]["fetch-depth"] == 0  # the merge base
    assert steps["Generated code is current"]["run"].startswith("mpgen check")


def test_the_job_running_the_pull_requests_code_holds_no_token_that_writes():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow["permissions"] == {"contents": "read"}
    assert "permissions" not in workflow["jobs"]["mpgen"]
    assert workflow_steps()["actions/checkout@v4"]["with"]["persist-credentials"] is False
    text = yaml.safe_dump(workflow)  # what runs, without the comments
    assert "secrets." not in text and "token" not in text.lower()
    assert set(workflow[True]) == {"push", "pull_request"}  # on: (YAML 1.1 reads True)


def test_the_job_holding_a_token_never_runs_the_pull_requests_code():
    workflow = yaml.safe_load(COMMENT_WORKFLOW.read_text())
    assert workflow[True] == {"workflow_run": {"workflows": ["mpgen"], "types": ["completed"]}}
    assert workflow["permissions"] == {}
    job = workflow["jobs"]["comment"]
    assert job["permissions"] == {"actions": "read", "pull-requests": "write"}
    steps = list(workflow_steps(COMMENT_WORKFLOW, "comment").values())
    assert [step.get("uses") for step in steps] == ["actions/download-artifact@v4", None]
    script = steps[1]["run"]
    assert not re.search(r"\b(mpgen|python3?|pip|git|checkout)\b|\$\{\{", script)


@pytest.fixture
def runner_env(tmp_path) -> dict[str, str]:
    """What a runner gives a step, and no token: PATH, HOME, a RUNNER_TEMP."""
    (tmp_path / "runner-temp").mkdir()
    return {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
            "LANG": "C.UTF-8", "RUNNER_TEMP": str(tmp_path / "runner-temp")}


def run_step(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A ``run:`` step as the runner runs it (``shell: bash``)."""
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                          cwd=cwd, env=env, capture_output=True, timeout=600)


@pytest.mark.slow
def test_the_summary_step_runs_without_a_token(pull_request, tmp_path, runner_env):
    # The unprivileged half, as the runner gives it: origin/$BASE fetched,
    # $GITHUB_STEP_SUMMARY a file it appends to, no token in the environment.
    step = workflow_steps()["Layout changes"]
    assert step["env"] == {"BASE": "${{ github.base_ref }}",
                           "PR": "${{ github.event.pull_request.number }}",
                           "SUMMARY": "${{ runner.temp }}/mpgen-summary"}
    upload = workflow_steps()["Keep the summary for the comment"]
    assert upload["with"]["path"] == "${{ runner.temp }}/mpgen-summary/"
    git(pull_request, "update-ref", "refs/remotes/origin/main", "main")
    step_summary = tmp_path / "step_summary.md"
    step_summary.write_text("earlier step\n")
    artifact = Path(runner_env["RUNNER_TEMP"]) / "mpgen-summary"
    env = {**runner_env, "BASE": "main", "PR": "7", "SUMMARY": str(artifact),
           "GITHUB_STEP_SUMMARY": str(step_summary)}
    assert not set(env) & {"GITHUB_TOKEN", "GH_TOKEN", "ACTIONS_RUNTIME_TOKEN"}
    done = run_step(step["run"], pull_request, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"" and done.stderr == b""  # no warning: no token
    assert sorted(os.listdir(artifact)) == ["pr-number", "summary.md"]
    assert (artifact / "pr-number").read_text() == "7\n"
    text = (artifact / "summary.md").read_text()
    assert text.startswith("## mpgen: layout changes\n\n3 specs changed since `origin/main`")
    assert "  layer2: cuda:1 -> cuda:0" in text
    assert step_summary.read_text() == "earlier step\n" + text
    # A spec that does not compile: the summary is kept all the same, the step fails.
    write_spec(pull_request, spec_text("Moved").replace("cuda:1", "cuda1"), "moved.yaml")
    done = run_step(step["run"], pull_request, env)
    assert done.returncode == 2
    assert done.stderr == b"mpgen ci-summary: does not compile: moved.yaml\n"
    assert "does not compile:\nmoved.yaml:10:11: " in (artifact / "summary.md").read_text()


@pytest.mark.slow
def test_ci_summary_warns_when_a_token_is_in_its_environment(pull_request, runner_env):
    env = {**runner_env, "GH_TOKEN": "ghs_secret", "GITHUB_TOKEN": ""}  # empty: not a token
    done = run_cli("ci-summary", "--base", "main", "-o", "summary.md", cwd=pull_request, env=env)
    assert done.returncode == 0 and done.stdout == b""
    assert done.stderr == (b"mpgen ci-summary: warning: GH_TOKEN is set: the pull request's "
                           b"specs are compiled, and the code they name runs, with it in the "
                           b"environment; compute the summary in a job without tokens "
                           b"(docs/ci.md)\n")
    assert b"ghs_secret" not in done.stderr
    assert "  layer2: cuda:1 -> cuda:0" in (pull_request / "summary.md").read_text()


FAKE_GH = """#!/bin/bash
# gh, as the comment step calls it: pr view prints the head FAKE_HEAD; pr
# comment records its arguments and body (--edit-last: no comment yet).
case "$1 $2" in
  "pr view") echo "$FAKE_HEAD" ;;
  "pr comment")
    echo "$@" >> "$FAKE_POSTED/calls"
    [[ " $* " == *" --edit-last "* ]] && exit 1
    cp "$5" "$FAKE_POSTED/body-$3.md" ;;
  *) exit 3 ;;
esac
"""


def test_the_comment_step_posts_the_artifact_as_untrusted_text(tmp_path, runner_env):
    # The privileged half, with gh stood in for: the number must name the pull
    # request the run tested, the text is cut, cleaned and its mentions disarmed.
    step = workflow_steps(COMMENT_WORKFLOW, "comment")["Comment the layout changes"]
    bin_dir, posted = tmp_path / "bin", tmp_path / "posted"
    bin_dir.mkdir(), posted.mkdir()
    (bin_dir / "gh").write_text(FAKE_GH)
    (bin_dir / "gh").chmod(0o755)
    artifact = Path(runner_env["RUNNER_TEMP"]) / "mpgen-summary"
    artifact.mkdir()
    env = {**runner_env, "PATH": f"{bin_dir}{os.pathsep}{runner_env['PATH']}",
           "SUMMARY": str(artifact), "HEAD_SHA": "abc123", "FAKE_HEAD": "abc123",
           "FAKE_POSTED": str(posted)}
    body = "## mpgen\n@org/team and @someone, `@x`.\n" + "é" * 40_000  # cut inside an é
    (artifact / "summary.md").write_text(body)
    (artifact / "pr-number").write_text("12\n")
    done = run_step(step["run"], tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert (posted / "calls").read_text().splitlines() == [
        f"pr comment 12 --body-file {runner_env['RUNNER_TEMP']}/comment.md --edit-last",
        f"pr comment 12 --body-file {runner_env['RUNNER_TEMP']}/comment.md"]
    sent = (posted / "body-12.md").read_bytes()
    assert len(sent) <= 60_000 + 3 * 3 and sent.decode("utf-8")  # cut (+3 ZWSP), still UTF-8
    assert sent.startswith("## mpgen\n@\u200borg/team and @\u200bsomeone, `@\u200bx`.\n"
                           .encode())
    # A number that is no number, a pull request that moved on, a link: nothing posted.
    for number, head, link, code in (("12; touch pwned", "abc123", False, 1),
                                     ("12", "def456", False, 0), ("12", "abc123", True, 1)):
        (posted / "calls").unlink(missing_ok=True)
        (artifact / "pr-number").unlink()
        if link:
            (artifact / "pr-number").symlink_to(tmp_path / "elsewhere")
            (tmp_path / "elsewhere").write_text("12\n")
        else:
            (artifact / "pr-number").write_text(number + "\n")
        done = run_step(step["run"], tmp_path, {**env, "FAKE_HEAD": head})
        assert done.returncode == code, done.stderr
        assert not (posted / "calls").exists() and not (tmp_path / "pwned").exists()
        assert b"touch" not in done.stdout + done.stderr  # the artifact's text is not logged


# -- installing mpgen elsewhere -------------------------------------------------

@pytest.mark.slow
def test_a_wheel_holds_the_templates_and_the_command(tmp_path):
    # README, "Installing mpgen in your project": a wheel built from the
    # sources (a copy, so that no build folder lands in the tree).
    source = tmp_path / "mpgen-src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "mpgen", source / "mpgen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("mpgen-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {f"mpgen/templates/{t.name}"
                 for t in (ROOT / "mpgen" / "templates").glob("*.jinja")}
    assert "mpgen/templates/starter.yaml.jinja" in templates and templates <= names
    assert "mpgen/commands/ci_summary.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mpgen = mpgen.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


# -- .gitattributes, version, completion ---------------------------------------

def test_generated_code_is_marked_generated_but_not_the_reports():
    out = git(ROOT, "check-attr", "linguist-generated", "generated/simple_model.py",
              "generated/train_simple_model.py", "generated/simple_model.placement.md")
    assert out.splitlines() == [
        "generated/simple_model.py: linguist-generated: true",
        "generated/train_simple_model.py: linguist-generated: true",
        "generated/simple_model.placement.md: linguist-generated: unset",
    ]


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag):
    from mpgen import __version__

    ran = mpgen(flag)
    assert (ran.returncode, ran.stdout) == (0, f"mpgen {__version__}\n")


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_completes_commands_and_files(shell, tmp_path):
    ran = mpgen("completion", shell)
    assert ran.returncode == 0, ran.stderr
    for command in ("build", "check", "ci-summary", "init", "place", "diff", "train"):
        assert command in ran.stdout
    if shell == "bash":  # sourced, it completes a command and a spec file
        (tmp_path / "seed.yaml").write_text((EXAMPLES / "seed.yaml").read_text())
        script = tmp_path / "mpgen.bash"
        script.write_text(ran.stdout)
        probe = (f"source {script}; COMP_WORDS=(mpgen ci-s); COMP_CWORD=1; _shtab_mpgen; "
                 "echo ${COMPREPLY[@]}; COMP_WORDS=(mpgen build se); COMP_CWORD=2; "
                 "_shtab_mpgen; echo ${COMPREPLY[@]}")
        done = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        assert done.stdout.split("\n")[:2] == ["ci-summary", "seed.yaml"], done.stderr


def test_the_documented_local_hooks_are_the_hooks_on_the_installed_mpgen():
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "ci.md").read_text(), re.S)
    configs = [yaml.safe_load(b) for b in blocks if b.startswith("repos:")]
    documented = next(c for c in configs if c["repos"][0]["repo"] == "local")["repos"][0]["hooks"]
    installed = hooks()
    assert [h["id"] for h in documented] == ["mpgen-check", "mpgen-build"]
    for local in documented:
        hook = installed[local["id"]]
        assert local == {**{k: hook[k] for k in local}, "language": "system"}
        assert set(hook) - set(local) == {"description"}
    remote = next(c for c in configs if c["repos"][0]["repo"] != "local")["repos"][0]
    assert remote["hooks"] == [{"id": "mpgen-check"}, {"id": "mpgen-build"}]
