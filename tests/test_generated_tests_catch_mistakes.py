"""The generated tests run the committed multi-GPU code on this CPU-only
machine (mpgen.testing virtual devices) and catch sabotage: a deleted
transfer, or a layer built on the wrong device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES, build_to


def run_pytest(test_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(test_file)],
        capture_output=True, text=True, timeout=600, cwd=test_file.parent,
    )


@pytest.fixture
def seed(tmp_path) -> Path:
    build_to(EXAMPLES / "seed.yaml", tmp_path)
    return tmp_path


def test_generated_tests_pass_on_virtual_devices(seed):
    run = run_pytest(seed / "test_simple_model.py")
    assert run.returncode == 0, run.stdout[-3000:]
    # Virtual runs pass; the real-GPU runs skip on this machine.
    assert "5 passed, 4 skipped" in run.stdout, run.stdout[-1000:]


def test_deleting_a_transfer_in_forward_fails(seed):
    model = seed / "simple_model.py"
    text = model.read_text()
    line = '        layer1 = layer1.to("cuda:1")  # [batch, 20]\n'
    assert line in text
    model.write_text(text.replace(line, ""))
    run = run_pytest(seed / "test_simple_model.py")
    assert run.returncode == 1
    assert ("Expected all tensors to be on the same device, but found at least two "
            "devices, cuda:0 and cuda:1") in run.stdout


def test_building_a_layer_on_the_wrong_device_fails(seed):
    model = seed / "simple_model.py"
    text = model.read_text()
    line = 'self.layer2 = nn.Linear(20, 10).to("cuda:1")'
    assert line in text
    model.write_text(text.replace(line, line.replace("cuda:1", "cuda:0")))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(seed / "test_simple_model.py")],
        capture_output=True, text=True, timeout=600, cwd=seed,
    )
    assert run.returncode == 1
    assert "layer2.weight is on cuda:0, but the spec places it on cuda:1" in run.stdout
    assert "Expected all tensors to be on the same device" in run.stdout


def test_an_extra_transfer_fails(seed):
    model = seed / "simple_model.py"
    text = model.read_text()
    line = "        layer2 = self.layer2(layer1)  # [batch, 10]\n"
    model.write_text(text.replace(line, '        layer1 = layer1.to("cuda:0").to("cuda:1")\n'
                                  + line))
    run = run_pytest(seed / "test_simple_model.py")
    assert run.returncode == 1
    assert "but mpgen planned" in run.stdout


@pytest.mark.parametrize("name", ["multitask", "resnet18"])
def test_generated_tests_of_larger_examples_pass(tmp_path, name):
    result = build_to(EXAMPLES / f"{name}.yaml", tmp_path)
    stem = result.graph.name
    from mpgen.compiler.codegen.common import file_names

    run = run_pytest(tmp_path / file_names(result.graph)["test"])
    assert run.returncode == 0, f"{stem}: " + run.stdout[-3000:]
