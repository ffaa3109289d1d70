"""``train:`` settings that used to build into a training script that crashed.

Each was reproduced by building the spec and running the script (issue 10):
an optimizer whose step needs a closure (``LBFGS``) now gets the closure form
of the step; keyword values torch refuses (``reduction: bogus``, ``lr: -1``),
a loss per element, ``BCELoss`` on an unbounded output, a loss that reaches
no parameter, a layer no output depends on and an out-of-range seed are
refused at build time, at the offending key, with exit 2 and nothing written.
(A model without parameters trains forward and the loss only: see
``tests/compiler/codegen/test_no_params.py``.)
"""

from __future__ import annotations

import textwrap

import pytest

from helpers import mpgen, time_limit, write_spec
from run_generated import run_suite_on_virtual_devices, train_one_step

MODEL = """\
mpgen: 1
name: M
inputs:
  x: [batch, 8]
layers:
  fc: {op: Linear, args: [8, 4]}
"""


def build(tmp_path, text: str, *args: str):
    """``mpgen build`` of ``text`` into ``tmp_path/out``: (exit status, stderr)."""
    spec = write_spec(tmp_path, text)
    ran = mpgen("build", spec.name, "-o", "out", *args, cwd=tmp_path)
    assert "Traceback" not in ran.stderr, ran.stderr
    return ran.returncode, ran.stderr


def refused(tmp_path, text: str, *args: str) -> str:
    """The messages of a refused build (exit 2, nothing written)."""
    code, err = build(tmp_path, text, *args)
    assert code == 2, err
    assert not (tmp_path / "out").exists()
    return err.rstrip("\n")


@pytest.mark.parametrize("train, message", [
    ("loss: {op: CrossEntropyLoss, reduction: bogus}",
     "spec.yaml:7:49: train.loss: CrossEntropyLoss cannot be computed with reduction='bogus': "
     "bogus is not a valid value for reduction"),
    ("loss: {op: CrossEntropyLoss, label_smoothing: 2.0}",
     "spec.yaml:7:55: train.loss: CrossEntropyLoss cannot be computed with label_smoothing=2.0: "
     "label_smoothing must be between 0.0 and 1.0. Got: 2"),
    ('loss: {op: CrossEntropyLoss, ignore_index: "x"}',
     "spec.yaml:7:52: train.loss: CrossEntropyLoss cannot be computed with ignore_index='x': "
     "cross_entropy_loss(): argument 'ignore_index' (position 5) must be int, not str"),
    ("loss: {op: HuberLoss, delta: -1}",
     "spec.yaml:7:38: train.loss: HuberLoss cannot be computed with delta=-1: huber_loss does "
     "not support non-positive values for delta."),
    ("loss: {op: MultiMarginLoss, p: 3}",
     "spec.yaml:7:40: train.loss: MultiMarginLoss cannot be built with p=3: only p == 1 and "
     "p == 2 supported"),
    ("loss: {op: CrossEntropyLoss, weight: [1, 2, 3, 4]}",
     "spec.yaml:7:46: train.loss: CrossEntropyLoss cannot be built with weight=[1, 2, 3, 4]: "
     "cannot assign 'list' object to buffer 'weight' (torch Tensor or None required)"),
    ("loss: {op: MSELoss, reduction: none}",
     "spec.yaml:7:40: train.loss: MSELoss(reduction='none') gives a loss per element, not the "
     "one number the training script minimises; use reduction 'mean' or 'sum'"),
    ("loss: LinearCrossEntropyLoss",
     "spec.yaml:7:15: train.loss: LinearCrossEntropyLoss has weights of its own, which the "
     "training script's optimizer (over the model's parameters) would never train; end the "
     "model with a Linear layer and use CrossEntropyLoss"),
    ("loss: BCELoss",
     "spec.yaml:7:15: train.loss: BCELoss needs probabilities in [0, 1], but output 'fc' is the "
     "unbounded output of a Linear layer; use BCEWithLogitsLoss (it applies the sigmoid "
     "itself) or end the model with Sigmoid"),
    ("optimizer: {op: SGD, lr: -1}",
     "spec.yaml:7:34: train.optimizer: SGD cannot be built with lr=-1: Invalid learning rate: "
     "-1"),
    ("optimizer: {op: Adam, lr: 0.1, betas: [0.9, 2]}",
     "spec.yaml:7:47: train.optimizer: Adam cannot be built with betas=[0.9, 2]: Invalid beta "
     "parameter at index 1: 2"),
    ("optimizer: {op: Adam, betas: 3}",
     "spec.yaml:7:38: train.optimizer: Adam cannot be built with betas=3: 'int' object is not "
     "subscriptable"),
    ("optimizer: {op: SGD, nesterov: true}",
     "spec.yaml:7:40: train.optimizer: SGD cannot be built with nesterov=True: Nesterov "
     "momentum requires a momentum and zero dampening"),
    ("optimizer: SparseAdam",
     "spec.yaml:7:20: train.optimizer: SparseAdam cannot take a step: SparseAdam does not "
     "support dense gradients, please consider Adam instead"),
    ("optimizer: {op: Adam, differentiable: true}",
     "spec.yaml:7:47: train.optimizer: Adam cannot take a step with differentiable=True: a leaf "
     "Variable that requires grad is being used in an in-place operation."),
    ("optimizer: {op: SGD, lr: .nan}",
     "spec.yaml:7:34: train.optimizer.lr: expected a finite number, got nan"),
    ("optimizer: {op: SGD, lr: -.inf}",
     "spec.yaml:7:34: train.optimizer.lr: expected a finite number, got -inf"),
    ("optimizer: {op: SGD, lr: 1" + "0" * 400 + "}",
     "spec.yaml:7:34: train.optimizer.lr: expected a finite number, got 1" + "0" * 55 + "...0"),
    ("seed: 18446744073709551616",
     "spec.yaml:7:15: train.seed: 18446744073709551616 is outside the range torch.manual_seed "
     "takes, [-9223372036854775808, 18446744073709551615]"),
])
def test_a_value_the_training_script_would_crash_on_is_refused_at_its_key(tmp_path, train,
                                                                          message):
    assert refused(tmp_path, MODEL + f"train: {{{train}}}\n") == message


def test_bce_on_a_sigmoid_output_builds_and_trains(tmp_path):
    code, err = build(tmp_path, MODEL + "  prob: {op: Sigmoid}\ntrain: {loss: BCELoss}\n",
                      "--device-map", "cpu")
    assert code == 0, err
    assert "step 1/1  loss" in train_one_step(tmp_path / "out" / "train_m.py")


def test_the_seed_range_is_torchs(tmp_path):
    code, err = build(tmp_path, MODEL + "train: {seed: -9223372036854775808}\n",
                      "--device-map", "cpu")
    assert code == 0, err
    assert "step 1/1  loss" in train_one_step(tmp_path / "out" / "train_m.py")


def test_lbfgs_gets_the_closure_form_of_the_step_and_trains(tmp_path):
    code, err = build(tmp_path, MODEL + "train: {optimizer: {op: LBFGS, lr: 0.5}}\n",
                      "--device-map", "cpu")
    assert code == 0, err
    script = (tmp_path / "out" / "train_m.py").read_text()
    # The spec says the optimizer's step takes a closure; the runtime's loop
    # (loop.Single.step, tests/runtime/test_loop.py) recomputes the loss in it.
    assert "    return torch.optim.LBFGS(model.parameters(), lr=args.lr, **kwargs)" in script
    assert "    closure=True," in script.splitlines()
    printed = train_one_step(tmp_path / "out" / "train_m.py")
    assert printed.splitlines()[2].startswith("step 1/1  loss ")  # after threads, the summary


def test_lbfgs_passes_the_generated_tests_on_one_device(tmp_path):
    code, err = build(tmp_path, MODEL + "train: {optimizer: LBFGS}\n")
    assert code == 0, err
    ran = run_suite_on_virtual_devices(tmp_path / "out" / "test_m.py")
    assert "test_backward_and_an_optimizer_step_keep_every_tensor_in_place" in ran


def test_a_spec_named_closure_keeps_its_names(tmp_path):
    """The step's closure is the runtime's; the layer's variable lives in
    forward_loss and keeps its name."""
    text = MODEL.replace("fc:", "closure:") + "train: {optimizer: LBFGS}\n"
    code, err = build(tmp_path, text, "--device-map", "cpu")
    assert code == 0, err
    script = (tmp_path / "out" / "train_m.py").read_text()
    assert "    closure = model(*inputs)" in script
    assert "step 1/1  loss" in train_one_step(tmp_path / "out" / "train_m.py")


TWO_DEVICES = MODEL + """\
  act: {op: ReLU}
  out: {op: Linear, args: [4, 4]}
placement:
  fc: cuda:0
  out: cuda:1
train:
  optimizer: {op: LBFGS, lr: 0.5}
"""


def test_lbfgs_across_devices_is_refused(tmp_path):
    assert refused(tmp_path, TWO_DEVICES) == (
        "spec.yaml:13:19: train.optimizer: LBFGS treats all parameters as one vector, so it "
        "needs them on one device, but they are on cuda:0, cuda:1; use another optimizer, or "
        "place every layer with parameters on one device")


def test_lbfgs_across_devices_mapped_onto_one_builds(tmp_path):
    code, err = build(tmp_path, TWO_DEVICES, "--device-map", "cpu")
    assert code == 0, err
    assert "step 1/1  loss" in train_one_step(tmp_path / "out" / "train_m.py")


@pytest.mark.parametrize("layers, message", [
    ("  fc: {op: Linear, args: [8, 4]}\n  pick: {op: torch.argmax, dim: -1}\n",
     "spec.yaml:7:3: train.loss: backward from the loss reaches no parameter, so the training "
     "script cannot train: output 'pick' is int64, which carries no gradient"),
    ("  fc: {op: Linear, args: [8, 4]}\n  act: {op: ReLU, in: x}\n",
     "spec.yaml:6:3: layer 'fc': no output depends on it, so training would never update its "
     "parameters; read it in a later layer, list it in outputs, or remove it\n"
     "spec.yaml:7:3: train.loss: backward from the loss reaches no parameter, so the training "
     "script cannot train: output 'act' is computed without any parameter"),
    ("  fc: {op: Linear, args: [8, 4]}\n  act: {op: ReLU, in: x}\n"
     "  out: {op: Linear, args: [8, 2]}\n",
     "spec.yaml:6:3: layer 'fc': no output depends on it, so training would never update its "
     "parameters; read it in a later layer, list it in outputs, or remove it"),
])
def test_a_loss_or_layer_that_training_cannot_reach_is_refused(tmp_path, layers, message):
    text = "mpgen: 1\nname: M\ninputs:\n  x: [batch, 8]\nlayers:\n" + layers
    assert refused(tmp_path, text) == message


def test_an_output_without_parameters_beside_a_trained_one_trains(tmp_path):
    text = MODEL + "  act: {op: ReLU, in: x}\noutputs: [fc, act]\n"
    code, err = build(tmp_path, text, "--device-map", "cpu")
    assert code == 0, err
    assert "step 1/1  loss" in train_one_step(tmp_path / "out" / "train_m.py")


def test_capturable_builds_for_gpus(tmp_path):
    """``capturable=True`` keeps the step on the GPU: the build steps without it."""
    code, err = build(tmp_path, MODEL + "train: {optimizer: {op: Adam, capturable: true}}\n")
    assert code == 0, err
    script = (tmp_path / "out" / "train_m.py").read_text()
    assert "    return torch.optim.Adam(model.parameters(), lr=args.lr, **kwargs)" in script
    assert '"optimizer": {"op": "Adam", "lr": 0.001, "capturable": True}' in script


def test_capturable_on_the_cpu_is_refused(tmp_path):
    text = MODEL + "train: {optimizer: {op: Adam, capturable: true}}\n"
    assert refused(tmp_path, text, "--device-map", "cpu") == (
        "spec.yaml:7:25: train.optimizer: Adam with capturable keeps its step on a GPU, but "
        "parameters are on cpu; drop capturable, or place every layer with parameters on a GPU")


def test_capturable_does_not_hide_other_values_from_the_step(tmp_path):
    text = MODEL + "train: {optimizer: {op: RAdam, capturable: true, differentiable: true}}\n"
    assert refused(tmp_path, text) == (
        "spec.yaml:7:66: train.optimizer: RAdam cannot take a step with differentiable=True: a "
        "leaf Variable that requires grad is being used in an in-place operation.")


def test_the_build_takes_a_bounded_sample_step(tmp_path):
    """LBFGS evaluates the closure in a loop up to ``max_iter`` times a step:
    the build's sample step stops after a few evaluations (it hung)."""
    text = MODEL + ("train: {optimizer: {op: LBFGS, max_iter: 1000000000, tolerance_change: -1, "
                    "tolerance_grad: -1}}\n")
    with time_limit(20):
        code, err = build(tmp_path, text)
    assert code == 0, err
