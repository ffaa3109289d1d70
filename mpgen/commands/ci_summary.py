"""``mpgen ci-summary --base REV [SPEC...]``: a pull request's layout changes, in Markdown.

For CI (``docs/ci.md``): the specs that differ between the merge base of
REV and HEAD and the working tree, each compared as ``mpgen diff
BASE:path path`` does (a new spec shown as ``mpgen show`` shows it, a deleted
one listed), written as Markdown for ``$GITHUB_STEP_SUMMARY`` or a pull
request comment. Without SPECs, the changed ``*.yaml``/``*.yml`` files with a
top-level ``mpgen:`` key on either side are the specs; with them, only those.
Paths are the repository's, relative to its root.

The base side is read from git's objects only (``git cat-file blob
COMMIT:path`` of the merge base's full id: ``diff.GitBlob``), never from a
file of the working tree, whatever its name; every name is put in Markdown
code (``printed.code_span``). The new side is the pull request's code,
compiled: run this where no token is (NOTE [A summary without a token]).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from mpgen.commands import diff as layout_diff
from mpgen.commands import show
from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.errors import MpgenError, Position
from mpgen.files import reason
from mpgen.printed import code_span, fenced

#: Git pathspecs of the files that may be specs.
SPEC_FILES = ("*.yaml", "*.yml")
#: A spec's first key, at the top level (``git grep -E``).
SPEC_MARK = r"^mpgen[[:space:]]*:"

# NOTE: [A summary without a token]
# ci-summary compiles the pull request's specs, and compiling a spec imports
# the modules it names (docs/spec.md, "User modules"): the pull request's code
# runs. Run with a token that can write (GH_TOKEN for `gh pr comment`), that
# code could use it: the "pwn request". Taking the variable out of
# os.environ would not help (the code can read /proc/self/environ, or its
# parent's), and mpgen cannot tell before compiling a spec whether it names
# code. So docs/ci.md computes the summary in a job with no secret and a
# read-only token, and posts it from another job that never runs the pull
# request's code; ci-summary itself warns when it sees one of these
# variables, and otherwise runs as it would (a developer's shell often has
# GH_TOKEN set).

#: The variables that hold a token a CI job can act with.
TOKEN_VARIABLES = ("GITHUB_TOKEN", "GH_TOKEN", "GH_ENTERPRISE_TOKEN", "ACTIONS_RUNTIME_TOKEN",
                   "ACTIONS_ID_TOKEN_REQUEST_TOKEN")


def tokens(environ: Mapping[str, str]) -> list[str]:
    """The token variables set (not empty) in ``environ``."""
    return [name for name in TOKEN_VARIABLES if environ.get(name)]


@dataclass(frozen=True)
class Change:
    """One spec that differs: its path at the merge base and in the working tree."""

    old: Optional[str]  # None: new
    new: Optional[str]  # None: deleted

    def kind(self, cell: bool = False) -> str:
        """In Markdown (in a table ``cell`` or not)."""
        if self.old is None:
            return "new"
        if self.new is None:
            return "deleted"
        return "changed" if self.old == self.new else f"renamed from {code_span(self.old, cell)}"


@dataclass(frozen=True)
class Summary:
    markdown: str
    failed: tuple[str, ...]  # the specs a side of which did not compile


def _git(root: str | Path, *args: str) -> str:
    """Run git in ``root``; its stdout, or an :class:`MpgenError` with git's reason."""
    try:
        done = subprocess.run(["git", *args], cwd=root, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = reason(exc) if isinstance(exc, OSError) else "it took longer than 120 s"
        raise MpgenError(None, f"mpgen ci-summary: cannot run git {args[0]}: {why}") from None
    if done.returncode not in (0, 1) or (done.returncode == 1 and args[0] != "grep"):
        message = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise MpgenError(None, f"mpgen ci-summary: git {args[0]} failed: "
                               f"{message[0] if message else f'exit status {done.returncode}'}")
    return done.stdout.decode("utf-8", "surrogateescape")


def repository() -> Path:
    """The root of the working directory's repository."""
    return Path(_git(os.getcwd(), "rev-parse", "--show-toplevel").strip())


def merge_base(root: Path, base: str) -> str:
    """The full id of the commit HEAD branched from ``base`` at."""
    if base.startswith("-") or not base.strip():
        raise MpgenError(None, f"mpgen ci-summary: --base {base!r} is not a revision")
    try:
        commit = _git(root, "merge-base", base, "HEAD").strip()
    except MpgenError as exc:
        raise MpgenError(None, f"{exc.message} (is {base!r} fetched? GitHub's checkout "
                               "needs fetch-depth: 0)") from None
    return _git(root, "rev-parse", "--verify", "--end-of-options", f"{commit}^{{commit}}").strip()


def changes(root: Path, commit: str, specs: Optional[Iterable[str]] = None) -> list[Change]:
    """The specs that differ between ``commit`` and the working tree (renames
    followed); ``specs`` (paths relative to the working directory): only those."""
    fields = _git(root, "diff", "--name-status", "-z", "-M", "--no-ext-diff", commit,
                  "--", *SPEC_FILES).split("\0")
    found: list[Change] = []
    i = 0
    while i < len(fields) - 1:
        status = fields[i][:1]
        if status in ("R", "C"):
            old, new = fields[i + 1], fields[i + 2]
            i += 3
        else:
            old = new = fields[i + 1]
            i += 2
        found.append(Change(None if status == "A" else old,
                            None if status == "D" else new))
    if specs is not None:
        # The folder's links followed, not the file's: a spec that is a link is itself.
        wanted = {Path(os.path.relpath(Path(s).absolute().parent.resolve() / Path(s).name,
                                       root.resolve())).as_posix() for s in specs}
        return [c for c in found if c.old in wanted or c.new in wanted]
    old_specs = _grep(root, commit)
    new_specs = _grep(root, None)
    return [c for c in found if c.old in old_specs or c.new in new_specs]


def _inside(repo: Path, path: str) -> str:
    """``path`` of the working tree, relative to the working directory, when it
    is a file inside ``repo`` once links are followed: a spec the pull request
    links to a file outside (``/proc/self/environ``, a credentials file) is
    not read, since its errors would quote it in the summary."""
    here = repo / path
    if not here.resolve().is_relative_to(repo.resolve()):
        raise MpgenError(Position(path), "a symbolic link to a file outside the repository; "
                                         "not read")
    return os.path.relpath(here)


def _grep(root: Path, commit: Optional[str]) -> set[str]:
    """The spec files of ``commit`` (None: the working tree): those with the mark."""
    names = _git(root, "grep", "-z", "-l", "-I", "-E", SPEC_MARK,
                 *([commit] if commit else []), "--", *SPEC_FILES).split("\0")
    prefix = f"{commit}:" if commit else ""
    return {n[len(prefix):] for n in names if n}


def summarize(base: str, specs: Optional[Iterable[str]] = None,
              root: str | Path | None = None,
              time_limit: Optional[float] = DEFAULT_TIME_LIMIT) -> Summary:
    """The Markdown summary of the specs changed since ``base``. A side that does
    not compile is shown with its errors (and named in ``failed``).
    ``root``, ``time_limit``: as for ``compile_spec``."""
    repo = repository()
    commit = merge_base(repo, base)
    short = _git(repo, "rev-parse", "--short=12", commit).strip()
    found = changes(repo, commit, specs)
    lines = ["## mpgen: layout changes", ""]
    if not found:
        lines.append(f"No spec changed since {code_span(base)} (merge base {code_span(short)}).")
        return Summary("\n".join(lines) + "\n", ())
    lines += [f"{len(found)} spec{'s' if len(found) != 1 else ''} changed since "
              f"{code_span(base)} (merge base {code_span(short)}):", "",
              "| spec | change |", "|---|---|"]
    lines += [f"| {code_span(c.new or c.old, cell=True)} | {c.kind(cell=True)} |"
              for c in found]
    failed = []
    for change in found:
        if change.new is None:
            continue
        try:
            new = layout_diff.load_file(_inside(repo, change.new), None, root, time_limit)
            if change.old is None:
                body = show.to_table(new.graph)
            else:
                blob = layout_diff.GitBlob(commit, change.old, f"{short}:{change.old}")
                old = layout_diff.load_blob(blob, None, root, time_limit, repository=repo)
                body = layout_diff.format_diff(layout_diff.diff(old, new))
        except MpgenError as exc:
            failed.append(change.new)
            body = f"does not compile:\n{exc}"
        lines += ["", f"### {code_span(change.new)} ({change.kind()})", "", *fenced(body)]
    return Summary("\n".join(lines) + "\n", tuple(failed))
