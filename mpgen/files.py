"""Reading the files a command names: regular files only, never more than a limit.

# NOTE: [Bounded reads]
# A spec, a generated file or anything else mpgen reads may be a symbolic
# link (git stores them, so a pull request can commit one) to ``/dev/zero``,
# a named pipe that never ends, a device or a folder. Every read goes through
# :func:`read_regular`: the file is opened without blocking, must be a
# regular file once symbolic links are followed (a link to a regular file is
# fine), and at most ``limit + 1`` bytes are read, so a file that grows while
# it is read is refused too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind(mode: int) -> str:
    """What a file of ``mode`` is, for a message: ``a named pipe (FIFO)``."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


class NotRegularFile(OSError):
    """The path is a folder, a pipe, a device...: never read."""

    def __init__(self, path: str | Path, mode: int) -> None:
        through = (f" ({path} is a symbolic link to {os.path.realpath(path)})"
                   if os.path.islink(path) else "")
        super().__init__(f"it is {kind(mode)}, not a regular file{through}")
        self.what = kind(mode)


class FileTooLarge(OSError):
    """The file holds more than the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"it is larger than {limit} bytes")
        self.limit = limit


def _open(path: str | Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) \
        | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(path, mode)
    return fd


def _read(fd: int, count: int) -> bytes:
    chunks, left = [], count
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_regular(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (symbolic links followed).

    Raises :class:`NotRegularFile` for anything else, :class:`FileTooLarge`
    beyond ``limit`` bytes, and ``OSError`` as opening and reading do.
    """
    fd = _open(path)
    try:
        data = _read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileTooLarge(limit)
    return data


def read_head(path: str | Path, count: int) -> bytes:
    """At most the first ``count`` bytes of the regular file at ``path``."""
    fd = _open(path)
    try:
        return _read(fd, count)
    finally:
        os.close(fd)


def reason(exc: OSError) -> str:
    """An OSError in words, without Python's ``[Errno N]``: ``Permission denied``."""
    if isinstance(exc, (NotRegularFile, FileTooLarge)):
        return str(exc)
    return exc.strerror or str(exc)


def is_project_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a project (``.git`` or ``pyproject.toml``): the
    folder a generated header's spec path is shown relative to."""
    return (folder / ".git").exists() or (folder / "pyproject.toml").exists()


#: At most this many bytes of a ``.git`` file (``gitdir: PATH``) are read.
_GIT_FILE_BYTES = 4096


def work_tree(path: str | Path) -> Optional[Path]:
    """The top of the git work tree ``path`` is in (the nearest folder at or
    above its real path holding ``.git``, a folder or a worktree's or
    submodule's ``gitdir:`` file), or None outside any. ``path`` need not
    exist: the search starts at its real path as far as it exists."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        if os.path.lexists(folder / ".git"):
            return folder
    return None


def git_dir(top: Path) -> Optional[Path]:
    """The git folder of the work tree at ``top``: ``top/.git``, or the folder
    its ``.git`` file names (``gitdir: PATH``, relative to ``top``); None when
    neither is a folder."""
    dot_git = top / ".git"
    if dot_git.is_dir():  # a link to one too (git never checks out a path named .git)
        return Path(os.path.realpath(dot_git))
    try:
        text = read_regular(dot_git, _GIT_FILE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    first = text.split("\n", 1)[0].strip()
    if not first.startswith("gitdir:"):
        return None
    found = Path(os.path.realpath(top / first[len("gitdir:"):].strip()))
    return found if found.is_dir() else None


def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether the real path of ``path`` (links followed as far as it exists)
    is ``folder``'s real path or below it."""
    real, top = os.path.realpath(path), os.path.realpath(folder)
    try:
        return os.path.commonpath([real, top]) == top
    except ValueError:  # another drive
        return False
