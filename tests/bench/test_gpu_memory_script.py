"""bench/gpu_memory.py: prepared here, measured on virtual CUDA devices
(the GPU script's own code, torch.cuda's memory counters standing in)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from helpers import EXAMPLES, ROOT

pytestmark = pytest.mark.slow  # builds specs, runs their training steps

SCRIPT = ROOT / "bench" / "gpu_memory.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_prepared_plans_are_measured_per_device_and_without_a_gpu_it_says_so(tmp_path, capsys):
    script = load_script()
    assert script.main(["measure", "--out", str(tmp_path)]) == 0
    assert "no GPU is visible" in capsys.readouterr().out
    script.prepare(tmp_path, [str(EXAMPLES / "seed.yaml")])
    plans = json.loads((tmp_path / "plans.json").read_text())
    assert set(plans) == {"seed_one", "seed_split"}
    assert set(plans["seed_one"]["train"]) == {"cuda:0"}
    assert set(plans["seed_split"]["pipeline"]) == {"gpipe", "1f1b"}
    from mpgen.testing import virtual_devices

    with virtual_devices(cuda=2):
        assert script.measure(tmp_path) == 0
    table = (tmp_path / "gpu_memory.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| seed")]
    trained = {(r[0].strip("| "), r[2]): float(r[5]) for r in rows if r[1] == "train"}
    assert set(trained) == {("seed_one", "cuda:0"), ("seed_split", "cuda:0"),
                            ("seed_split", "cuda:1")}
    for ratio in trained.values():  # the bytes of live storages: the plan's own measure
        assert 0.9 <= ratio <= 1.1, table
