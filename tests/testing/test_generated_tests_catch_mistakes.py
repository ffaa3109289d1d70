"""The generated tests run the committed multi-GPU code on this CPU-only
machine (mpgen.testing virtual devices) and catch sabotage: a deleted
transfer, an extra one, or a layer built on the wrong device.

They run in this process (``pytest.main`` on the generated file): starting
an interpreter and importing torch for each would cost more than the tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import EXAMPLES, build_to
from run_generated import run_pytest


@pytest.fixture
def seed(tmp_path) -> Path:
    build_to(EXAMPLES / "seed.yaml", tmp_path)
    return tmp_path


def test_generated_tests_pass_on_virtual_devices(seed):
    run = run_pytest(seed / "test_simple_model.py")
    assert run.exit_code == 0, run.text[-3000:]
    # Six checks pass on virtual devices; their real-GPU runs skip here,
    # saying why.
    assert (len(run.passed), len(run.skipped), run.failed) == (6, 6, [])
    assert all(id.endswith("[virtual]") for id in run.passed)
    assert all(id.endswith("[real]") for id in run.skipped)
    assert run.reasons.count(
        "Skipped: real-GPU run skipped: SimpleModel needs 2 CUDA devices (cuda:0, cuda:1) "
        "and this machine has 0; the virtual run checks the same code on the CPU"
    ) == 6


def test_deleting_a_transfer_in_forward_fails(seed):
    model = seed / "simple_model.py"
    text = model.read_text()
    line = '        layer1 = layer1.to("cuda:1")  # [batch, 20]\n'
    assert line in text
    model.write_text(text.replace(line, ""))
    run = run_pytest(seed / "test_simple_model.py", "-x")
    assert run.exit_code == 1
    assert (
        "Expected all tensors to be on the same device, but found at least two "
        "devices, cuda:0 and cuda:1"
    ) in run.text


def test_building_a_layer_on_the_wrong_device_fails(seed):
    model = seed / "simple_model.py"
    text = model.read_text()
    line = 'self.layer2 = nn.Linear(20, 10).to("cuda:1")'
    assert line in text
    model.write_text(text.replace(line, line.replace("cuda:1", "cuda:0")))
    run = run_pytest(seed / "test_simple_model.py")
    assert run.exit_code == 1
    assert "layer2.weight is on cuda:0, but the spec places it on cuda:1" in run.text
    assert "Expected all tensors to be on the same device" in run.text


def test_an_extra_transfer_fails(seed):
    model = seed / "simple_model.py"
    text = model.read_text()
    line = "        layer2 = self.layer2(layer1)  # [batch, 10]\n"
    extra = '        layer1 = layer1.to("cuda:0").to("cuda:1")\n'
    model.write_text(text.replace(line, extra + line))
    run = run_pytest(seed / "test_simple_model.py", "-x")
    assert run.exit_code == 1
    assert "but mpgen planned" in run.text


def test_generated_tests_of_a_three_device_two_output_model_pass(tmp_path):
    # Every example's generated tests run in CI from generated/ (scripts/test.sh);
    # this one, small, keeps `pytest tests` covering more than the seed.
    build_to(EXAMPLES / "multitask.yaml", tmp_path)
    run = run_pytest(tmp_path / "test_multi_task_net.py")
    assert run.exit_code == 0, run.text[-3000:]
    assert (len(run.passed), len(run.skipped), run.failed) == (6, 6, [])
