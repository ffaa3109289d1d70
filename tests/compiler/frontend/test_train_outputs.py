"""Outputs without a loss (issue 22): when ``train.loss`` maps output names
to losses, the outputs it does not name are returned and not trained on; a
single loss still applies to every output.

The spec is compiled (``driver.compile_spec``) and its losses compared; the
generated scripts' loss code is read from a real build; refusals run the CLI.
"""

from __future__ import annotations

from helpers import write_spec
from mpgen.compiler import driver
from test_training_specs import build, refused

#: Two heads on one trunk, and a third head that only ``aux`` reads.
HEADS = """\
mpgen: 1
name: Heads
inputs:
  x: [batch, 8]
layers:
  trunk: {op: Linear, args: [8, 8], in: x}
  cls: {op: Linear, args: [8, 5], in: trunk}
  state: {op: Tanh, in: trunk}
  aux: {op: Linear, args: [8, 3], in: x}
outputs: [cls, state, aux]
"""


def losses(tmp_path, loss: str) -> list[tuple[str, str]]:
    text = HEADS + f"train: {{loss: {loss}}}\n"
    train = driver.compile_spec(write_spec(tmp_path, text)).train
    return [(loss.output, loss.op) for loss in train.losses]


def test_a_mapping_trains_only_the_outputs_it_names(tmp_path):
    assert losses(tmp_path, "{cls: CrossEntropyLoss}") == [("cls", "CrossEntropyLoss")]
    assert losses(tmp_path, "{aux: MSELoss, cls: CrossEntropyLoss}") == [
        ("cls", "CrossEntropyLoss"), ("aux", "MSELoss")]  # in the order of outputs


def test_a_single_loss_still_applies_to_every_output(tmp_path):
    assert losses(tmp_path, "MSELoss") == [("cls", "MSELoss"), ("state", "MSELoss"),
                                           ("aux", "MSELoss")]


def test_the_scripts_target_and_sum_only_the_trained_outputs(tmp_path):
    code, err = build(tmp_path, HEADS + "train: {loss: {cls: CrossEntropyLoss, aux: MSELoss}}\n",
                      "--device-map", "cpu")
    assert code == 0, err
    train = (tmp_path / "out" / "train_heads.py").read_text()
    assert "    cls, state, aux = model(*inputs)  # state: no loss\n" in train
    assert "    return (x,), (cls_target, aux_target)\n" in train
    assert '    targets=("cls_target", "aux_target"),\n' in train
    assert "    loss = cls_loss + aux_loss  # on cpu\n" in train
    assert "state_target" not in train
    pp = (tmp_path / "out" / "pp_heads.py").read_text()
    assert "    cls, state, aux = outputs  # state: no loss\n" in pp
    assert "    loss = cls_loss + aux_loss\n" in pp


def test_a_layer_only_an_output_without_a_loss_reads_builds(tmp_path):
    """``aux`` is returned, so its layer is kept; training leaves it as it is."""
    code, err = build(tmp_path, HEADS + "train: {loss: {cls: CrossEntropyLoss}}\n",
                      "--device-map", "cpu")
    assert code == 0, err


def test_an_empty_mapping_is_refused(tmp_path):
    assert refused(tmp_path, HEADS + "train: {loss: {}}\n") == (
        "spec.yaml:11:15: train.loss: an empty mapping gives no output a loss; name at least "
        "one of 'cls', 'state', 'aux'")


def test_a_mapping_whose_outputs_reach_no_parameter_is_still_refused(tmp_path):
    text = HEADS.replace("outputs: [cls, state, aux]", "  act: {op: ReLU, in: x}\n"
                         "outputs: [cls, aux, act]") + "train: {loss: {act: MSELoss}}\n"
    assert refused(tmp_path, text) == (
        "spec.yaml:10:3: train.loss: backward from the loss reaches no parameter, so the "
        "training script cannot train: output 'act' is computed without any parameter")
