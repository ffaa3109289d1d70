"""How many threads torch's intra-op pool runs in a generated script: what
this process may use, unless told.

# NOTE: [Torch threads]
# torch starts as many intra-op threads as the machine has cores, whatever
# share of them this process may use: a container's CPU quota, a taskset, or
# the other ranks torchrun starts on the same machine. More threads than
# CPUs make every matrix product wait for descheduled threads (a step 15x
# slower than with one thread, seen on a shared machine). So each script
# caps the pool at the CPUs it may use (its affinity, and the cgroup's
# quota along its cgroup's path, the least of them) divided by the local
# ranks (LOCAL_WORLD_SIZE under torchrun), never above torch's own default,
# and says so in one line at start-up (the first of the log on stdout;
# stderr for generate_, whose stdout is the sequences). ``--threads N`` sets N;
# OMP_NUM_THREADS or MKL_NUM_THREADS, which torch reads at start, is left
# as it is (torchrun sets OMP_NUM_THREADS to 1 when it starts several
# processes and the user has not).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Mapping, Optional, TextIO

import torch

#: cgroup v2's hierarchy (v1's controllers are folders in it), and the file
#: naming this process's cgroup in it.
CGROUP = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")
#: torch's intra-op threads before any script set them.
TORCH_DEFAULT = torch.get_num_threads()


def thread_count(text: str) -> int:
    """``--threads``' type: a whole number, at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=thread_count,
        metavar="N",
        help="torch's intra-op threads (default: the CPUs this process may use over "
        "the local ranks, or OMP_NUM_THREADS or MKL_NUM_THREADS when set)",
    )


def _quota(folder: Path) -> Optional[float]:
    """The CPUs ``folder``'s own quota allows: cgroup v2's ``cpu.max`` ("max
    PERIOD" or "QUOTA PERIOD"), or v1's cfs files (-1: none)."""
    try:
        if (folder / "cpu.max").is_file():
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        elif (folder / "cpu.cfs_quota_us").is_file():
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        else:
            return None
        if quota == "max" or int(quota) <= 0 or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def quota_cpus(root: Path = CGROUP, membership: Path = MEMBERSHIP) -> Optional[float]:
    """The CPUs the cgroup quotas allow this process: the least along the
    path from its cgroup up to the hierarchy's root (v2 ``0::PATH``, or the
    v1 line of the ``cpu`` controller); None where none is set or readable."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    found: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers and "cpu" not in names:
            continue
        base = root / controllers if controllers else root
        if not base.is_dir():  # v1 mounts cpu and cpuacct together under either name
            base = next(
                (root / n for n in ("cpu,cpuacct", "cpu") if (root / n).is_dir()), base
            )
        folder = base / path.strip("/")
        if (
            not folder.is_dir()
        ):  # another cgroup namespace's path: only the root is ours
            folder = base
        while True:
            quota = _quota(folder)
            if quota is not None:
                found.append(quota)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(found) if found else None


def usable_cpus(root: Path = CGROUP, membership: Path = MEMBERSHIP) -> tuple[int, bool]:
    """The CPUs this process may use, and whether the cgroup quota is what
    bounds them (a quota of 1.5 CPUs is 1: a second thread would wait)."""
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    else:  # macOS, Windows: no affinity to read
        affinity = os.cpu_count() or 1
    quota = quota_cpus(root, membership)
    if quota is not None and quota < affinity:
        return max(1, int(quota)), True
    return affinity, False


def local_ranks(environ: Mapping[str, str]) -> int:
    """The processes torchrun started on this machine (1 without it)."""
    text = environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, int(text)) if text.isdigit() else 1


def choose(
    threads: Optional[int],
    environ: Mapping[str, str],
    cpus: tuple[int, bool],
    default: int,
) -> tuple[Optional[int], str]:
    """The threads to set (None: leave torch's) and the line that says why
    (NOTE [Torch threads]): ``threads`` is ``--threads``; ``cpus`` is
    :func:`usable_cpus`; ``default`` torch's own count."""
    if threads is not None:
        return threads, f"torch threads: {threads} (--threads)"
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch read them at start
        if environ.get(name):
            told = f"{name}={environ[name]}"
            return None, f"torch threads: {default} ({told}; --threads N to change)"
    usable, by_quota = cpus
    ranks = local_ranks(environ)
    share = max(1, usable // ranks)
    why = f"{usable} CPU{'s' if usable > 1 else ''}"
    why += " by the cgroup's CPU quota" if by_quota else ""
    why += f" / {ranks} local ranks" if ranks > 1 else ""
    if default < share:
        why = f"torch's default, within {why}"
    return (
        min(share, default),
        f"torch threads: {min(share, default)} ({why}; --threads N to change)",
    )


def cap(threads: Optional[int], out: Optional[TextIO]) -> int:
    """Set torch's intra-op threads for this script (:func:`choose`) and say
    so on ``out`` (None: silent; the log's stdout, or stderr where stdout
    is the script's result); the count in effect."""
    count, line = choose(threads, os.environ, usable_cpus(), TORCH_DEFAULT)
    if count is not None and count != torch.get_num_threads():
        torch.set_num_threads(count)
    if out is not None:
        print(line, file=out, flush=True)
    return torch.get_num_threads()
