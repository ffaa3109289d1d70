"""A model without parameters (issue 9, failure 5).

Its generated test built an optimizer over an empty parameter list
(``ValueError: optimizer got an empty parameter list``), and so did its
training script. Now the suite checks that backward reaches the inputs
through every transfer, and the script runs forward and the loss only.
"""

from __future__ import annotations

import pytest
import torch

from helpers import build_to, write_spec
from mpgen.testing import virtual_devices
from run_generated import run_suite_on_virtual_devices, train_one_step

SPEC = """
    mpgen: 1
    name: NoParams
    inputs:
      x: [batch, 8]
    layers:
      act: {op: ReLU}
      soft: {op: F.softmax, dim: -1}
    placement:
      act: cuda:0
      soft: cuda:1
    train:
      loss: MSELoss
      optimizer: {op: SGD, lr: 0.01}
      steps: 2
"""


def test_a_model_without_parameters_passes_its_generated_tests(tmp_path):
    result = build_to(write_spec(tmp_path, SPEC), tmp_path / "out")
    assert result.graph.total_params == 0
    ran = run_suite_on_virtual_devices(tmp_path / "out" / "test_no_params.py")
    assert "test_backward_and_an_optimizer_step_keep_every_tensor_in_place" in ran


def test_the_backward_check_of_a_model_without_parameters_still_checks(tmp_path):
    build_to(write_spec(tmp_path, SPEC), tmp_path / "out")
    from helpers import import_generated

    module = import_generated(tmp_path / "out" / "test_no_params.py")
    suite = module.TestNoParams()
    # The optimizer is never asked for: an empty parameter list is refused.
    suite.make_optimizer = lambda model: pytest.fail("make_optimizer called")
    with virtual_devices(cuda=2) as devices:
        suite.test_backward_and_an_optimizer_step_keep_every_tensor_in_place(devices)

    class Detached(torch.nn.Module):  # backward cannot reach the input
        def forward(self, x):
            return torch.relu(x.detach().to("cuda:1")).requires_grad_()

    suite.model = Detached
    with virtual_devices(cuda=2) as devices, pytest.raises(AssertionError,
                                                           match="input 0 got no gradient"):
        suite.test_backward_and_an_optimizer_step_keep_every_tensor_in_place(devices)


def test_the_training_script_of_a_model_without_parameters_runs(tmp_path):
    result = build_to(write_spec(tmp_path, SPEC), tmp_path / "cpu", {"*": "cpu"})
    script = result.files["train_no_params.py"]
    assert "torch.optim" not in script and ".backward()" not in script
    printed = train_one_step(tmp_path / "cpu" / "train_no_params.py")
    assert printed.splitlines()[0].startswith("torch threads: ")  # runtime/threads.py
    assert printed.splitlines()[1] == "NoParams: 0 parameters, nothing to train"
    assert "step 1/1  loss" in printed
