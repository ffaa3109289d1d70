"""bench/: the command that writes docs/benchmarks.md, run here on its cheap
sections, and the GPU script in its CPU smoke mode (the timed sections are
the bench's own business: no timing is asserted here)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT))

from bench import __main__ as bench_main  # noqa: E402
from bench import placement_bench  # noqa: E402
from mpgen.compiler.placement import partition  # noqa: E402

#: Slow: the bench's own sections and its GPU script, run for real.
pytestmark = pytest.mark.slow


def test_the_page_holds_exactly_what_the_run_printed(tmp_path):
    out = tmp_path / "page.md"
    ran = subprocess.run([sys.executable, "-m", "bench", "--only", "pipeline,gpu", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr
    page = out.read_text()
    assert page == ran.stdout
    assert page.startswith("# Benchmarks\n")
    assert "Written by `python -m bench --only pipeline,gpu`" in page
    assert "## The pipeline schedule simulator" in page and "| 8 | 150 |" in page
    assert "## On a GPU" in page
    assert "## Build cost" not in page  # only the sections asked for


def test_a_partial_or_quick_run_never_overwrites_the_published_page():
    assert bench_main.parse_args([]).out == bench_main.PAGE
    for argv in (["--quick"], ["--only", "build"], ["--only", "build,overhead,placement,"
                                                    "pipeline,gpu", "--quick"]):
        assert bench_main.parse_args(argv).out == bench_main.PARTIAL


def test_unknown_sections_and_rounds_are_usage_errors(capsys):
    for argv in (["--only", "buld"], ["--only", ""], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench_main.parse_args(argv)
        assert exc.value.code == 2
    assert "choose from build, overhead, placement, pipeline, stages, memory, generation, gpu" in capsys.readouterr().err


def test_the_optimum_the_placement_table_divides_by_is_the_exact_one():
    # The bench's own dynamic program, against exhaustive search and mpgen's
    # partitioner: the "/ optimum" columns divide by the true optimum.
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.randint(0, 50) for _ in range(rng.randint(1, 8))]
        devices = rng.randint(1, 4)
        brute = min(max(sum(values[a:b]) for a, b in zip((0, *cuts), (*cuts, len(values))))
                    for cuts in _cut_sets(len(values), devices))
        assert placement_bench.optimum(values, devices) == brute
        assert partition.partition(values, devices).bottleneck == brute


def _cut_sets(n: int, devices: int):
    from itertools import combinations

    for parts in range(1, min(devices, n) + 1):
        yield from combinations(range(1, n), parts - 1)


def test_the_gpu_script_says_so_and_stops_without_a_gpu_and_smokes_on_the_cpu(tmp_path):
    script = ROOT / "bench" / "gpu_models.py"
    plain = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip().startswith("gpu_models: no CUDA GPU visible, nothing measured")
    out = tmp_path / "gpu.md"
    smoke = subprocess.run([sys.executable, str(script), "--device", "cpu", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert smoke.returncode == 0, smoke.stderr
    table = out.read_text()
    assert "CPU smoke run" in table
    assert "unavailable" not in table, table  # both references built and ran
    rows = [line for line in table.splitlines() if line.startswith(("| ResNet-18", "| nanoGPT"))]
    assert [row.split(" | ")[1] for row in rows] == ["fp32", "bf16 autocast"] * 2, table
