"""The generated scripts' torch threads (mpgen/runtime/threads.py, NOTE
[Torch threads]): the CPUs this process may use (affinity, and the cgroup
quotas read from real files in a folder laid out as /sys/fs/cgroup is)
over the local ranks, unless ``--threads`` or OMP_NUM_THREADS says
otherwise, and the one line that says so."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import build_to, write_spec
from mpgen.runtime.threads import choose, local_ranks, quota_cpus, thread_count, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup hierarchy of ``files`` (path: text) and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


def test_v2_the_least_quota_along_the_cgroups_path(tmp_path):
    root, membership = cgroup(tmp_path, "0::/jobs/mine\n", {
        "cpu.max": "max 100000\n",
        "jobs/cpu.max": "400000 100000\n",
        "jobs/mine/cpu.max": "150000 100000\n",
        "other/cpu.max": "50000 100000\n",  # a sibling's: not this process's
    })
    assert quota_cpus(root, membership) == 1.5


def test_v2_no_quota(tmp_path):
    root, membership = cgroup(tmp_path, "0::/jobs\n", {"cpu.max": "max 100000\n",
                                                      "jobs/cpu.max": "max 100000\n"})
    assert quota_cpus(root, membership) is None
    assert usable_cpus(root, membership) == (AFFINITY, False)


def test_v2_in_a_cgroup_namespace_reads_the_root(tmp_path):
    """A container's /proc/self/cgroup names its host's path, absent here."""
    root, membership = cgroup(tmp_path, "0::/kubepods/pod1/abc\n",
                              {"cpu.max": "200000 100000\n"})
    assert quota_cpus(root, membership) == 2.0


def test_v1_the_cpu_controllers_cfs_quota(tmp_path):
    root, membership = cgroup(tmp_path, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
                                        "1:name=systemd:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "memory/docker/abc/cpu.cfs_quota_us": "10000\n",  # not the cpu controller's
        "memory/docker/abc/cpu.cfs_period_us": "100000\n",
    })
    assert quota_cpus(root, membership) == 2.5


def test_nothing_to_read_is_no_quota(tmp_path):
    assert quota_cpus(tmp_path / "none", tmp_path / "none.txt") is None
    root, membership = cgroup(tmp_path, "0::/\n", {"cpu.max": "garbled\n"})
    assert quota_cpus(root, membership) is None


def test_a_quota_below_the_affinity_bounds_the_cpus_at_least_one(tmp_path):
    root, membership = cgroup(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    assert usable_cpus(root, membership) == (1, True)


def test_the_count_and_its_line():
    more = "; --threads N to change)"
    assert choose(None, {}, (2, False), 2) == (2, "torch threads: 2 (2 CPUs" + more)
    assert choose(None, {"LOCAL_WORLD_SIZE": "2"}, (2, False), 2) == (
        1, "torch threads: 1 (2 CPUs / 2 local ranks" + more)
    assert choose(None, {"LOCAL_WORLD_SIZE": "4"}, (2, False), 2)[0] == 1  # never 0
    assert choose(None, {}, (1, False), 2) == (1, "torch threads: 1 (1 CPU" + more)
    assert choose(None, {}, (4, True), 64) == (
        4, "torch threads: 4 (4 CPUs by the cgroup's CPU quota" + more)
    assert choose(None, {}, (32, False), 16) == (
        16, "torch threads: 16 (torch's default, within 32 CPUs" + more)


def test_told_otherwise():
    assert choose(3, {"OMP_NUM_THREADS": "8"}, (2, False), 2) == (3, "torch threads: 3 (--threads)")
    assert choose(None, {"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "2"}, (8, False), 4) == (
        None, "torch threads: 4 (OMP_NUM_THREADS=4; --threads N to change)")
    assert choose(None, {"MKL_NUM_THREADS": "1"}, (8, False), 1) == (
        None, "torch threads: 1 (MKL_NUM_THREADS=1; --threads N to change)")


def test_local_ranks_and_the_flags_type():
    assert [local_ranks(e) for e in ({}, {"LOCAL_WORLD_SIZE": "3"},
                                     {"LOCAL_WORLD_SIZE": "x"})] == [1, 3, 1]
    assert thread_count("2") == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number >= 1"):
            thread_count(bad)


SPEC = """
    mpgen: 1
    name: ThreadsNet

    inputs:
      x: [batch, 4]

    layers:
      fc: {op: Linear, args: [4, 1]}
"""


@pytest.mark.slow
def test_the_training_script_says_its_threads_first(tmp_path):
    """The first line of its log, before the model's."""
    build_to(write_spec(tmp_path, SPEC), tmp_path / "out", {"*": "cpu"})
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | {"LOCAL_WORLD_SIZE": "2"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "out/train_threads_net.py", "--steps", "1",
                               *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    ran = run()
    assert ran.returncode == 0, ran.stderr
    cpus = usable_cpus()[0]
    line, header = ran.stdout.splitlines()[:2]
    shown = re.fullmatch(rf"torch threads: (\d+) \((torch's default, within )?{cpus} CPUs?"
                         r"( by the cgroup's CPU quota)? / 2 local ranks; --threads N to "
                         r"change\)", line)
    assert shown, line
    assert int(shown[1]) == max(1, cpus // 2) or shown[2]  # torch's default: fewer
    assert header.startswith("ThreadsNet: 5 parameters")
    told = run("--threads", "1")
    assert told.stdout.splitlines()[0] == "torch threads: 1 (--threads)"
    bad = run("--threads", "0")
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1] == ("train_threads_net.py: error: argument --threads: "
                                           "expected a whole number >= 1, got '0'")
