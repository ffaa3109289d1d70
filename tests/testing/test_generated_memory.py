"""The generated memory test: test_<name>.py states the plan's training
peaks and ModelSuite measures train_<name>.py's step on virtual devices
against them (within 10%), failing -- never skipping -- where they differ."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from helpers import EXAMPLES, build_to

TEST = "test_a_training_step_peaks_as_planned"


def _pytest(folder, *args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=folder, capture_output=True, text=True, timeout=600,
    )
    return run.stdout + run.stderr


def _plan(path) -> dict:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["memory_plan"]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} states no memory_plan")


@pytest.mark.slow
def test_a_generated_suite_measures_each_devices_peak_against_the_plan(tmp_path):
    result = build_to(EXAMPLES / "small_cnn.yaml", tmp_path)
    plan = _plan(tmp_path / "test_small_cnn.py")
    graph = result.graph
    assert plan == {d.device: (d.peak, {p: b for p, b in d.at_peak if b})
                    for d in graph.memory.train}
    assert set(plan) == {"cuda:0", "cuda:1"}
    output = _pytest(tmp_path, "test_small_cnn.py", "-k", TEST)
    assert "1 passed" in output, output
    # The real-GPU arm skips here, saying where GPUs are measured.
    assert "bench/gpu_memory.py" in output or "real-GPU run skipped" in output, output


@pytest.mark.slow
def test_a_plan_off_by_more_than_ten_percent_fails_naming_the_device(tmp_path):
    build_to(EXAMPLES / "small_cnn.yaml", tmp_path)
    path = tmp_path / "test_small_cnn.py"
    plan = _plan(path)
    peak = plan["cuda:1"][0]
    text = path.read_text()
    assert text.count(f"{peak},") == 1
    path.write_text(text.replace(f"{peak},", f"{int(peak * 0.8)},"))
    output = _pytest(tmp_path, "test_small_cnn.py", "-k", TEST)
    assert "1 failed" in output, output
    assert re.search(r"cuda:1: measured [\d.]+ MiB in \w+ \[.*\], planned [\d.]+ MiB \[.*\]: "
                     r"1\.2\dx", output), output
    assert "cuda:0: measured" not in output  # within the plan
