"""bench/generation.py and bench/gpu_generation.py run: the CPU table's
cached and uncached runs make the same ids; the GPU script builds, says so
and stops without a GPU, and its measurement smokes on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import generation
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_the_cpu_table_compares_runs_that_agree():
    lines = []
    generation.section(quick=True, rounds=1, emit=lines.append)
    rows = [line for line in lines[-1].splitlines() if line.startswith(("| nano_gpt", "| tiny"))]
    assert len(rows) == 2
    assert all(row.rstrip(" |").endswith("yes") for row in rows), lines[-1]


def test_the_gpu_script_prepares_says_so_and_smokes_on_the_cpu(tmp_path):
    script = ROOT / "bench" / "gpu_generation.py"
    out = tmp_path / "gg"
    run = [sys.executable, str(script)]
    prepared = subprocess.run([*run, "prepare", "--out", str(out), "tiny_llama"], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
    assert prepared.returncode == 0, prepared.stderr
    measured = subprocess.run([*run, "measure", "--out", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
    assert measured.returncode == 0, measured.stderr
    assert measured.stdout.startswith("no CUDA device visible: nothing measured")
    smoke = subprocess.run([*run, "measure", "--out", str(out), "--cpu", "--prompt", "4",
                            "--new", "4"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert smoke.returncode == 0, smoke.stderr
    assert "differ" not in smoke.stdout
    rows = [line for line in (out / "gpu_generation.md").read_text().splitlines()
            if line.startswith("| tiny_llama")]
    assert len(rows) == 4  # one GPU and two, each with the cache and without
