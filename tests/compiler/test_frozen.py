"""``requires_grad: false``: parameters that do not train, on a Parameter
layer, a module layer, a block instance (every parameter inside), a repeated
layer and a layer inside a block; the generated model, its pipeline stages
and training script, the memory plan and the counts; and each mistake at its
line."""

from __future__ import annotations

import re

import black
import pytest
import torch

from helpers import build_to, import_generated, mpgen, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen import format
from mpgen.errors import MpgenError
from mpgen.spec_schema.digest import canonical, spec_digest
from mpgen.spec_schema.load import load_text
from mpgen.spec_schema.validate import validate

SPEC = """
mpgen: 1
name: Frozen
inputs:
  x: [batch, 8]
blocks:
  Scaled:
    params: [dim]
    layers:
      fc: {op: Linear, args: [$dim, $dim]}
      gamma: {op: Parameter, shape: [$dim], init: {constant: 0.5}, requires_grad: false}
      scaled: {op: torch.mul, in: [fc, gamma]}
layers:
  pos: {op: Parameter, shape: [8], init: {constant: 0.25}, requires_grad: false}
  add: {op: torch.add, in: [x, pos]}
  fc1: {op: Linear, args: [8, 16], requires_grad: false}
  act: {op: ReLU}
  body: {op: Scaled, args: [16], repeat: 2}
  still: {op: Scaled, args: [16], requires_grad: false}
  deep: {op: Linear, args: [16, 16], repeat: 2, requires_grad: false}
  head: {op: Linear, args: [16, 4], requires_grad: true}
placement:
  pos: cuda:0
  still: cuda:1
init:
  Linear: {bias: {constant: 0.125}}
train:
  loss: MSELoss
  optimizer: {op: AdamW, lr: 0.01}
  batch_size: 4
"""

FROZEN = {"pos", "fc1.weight", "fc1.bias", "body.0.gamma", "body.1.gamma", "still.fc.weight",
          "still.fc.bias", "still.gamma", "deep.0.weight", "deep.0.bias", "deep.1.weight",
          "deep.1.bias"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen")
    result = build_to(write_spec(out, SPEC), out, {"*": "cpu"})
    return out, result


def frozen_names(module: torch.nn.Module) -> set[str]:
    return {k for k, p in module.named_parameters() if not p.requires_grad}


def test_the_model_freezes_what_the_spec_says_with_the_same_keys(built):
    out, _ = built
    model = import_generated(out / "frozen.py").Frozen()
    assert frozen_names(model) == FROZEN
    trainable = SPEC.replace("requires_grad: false", "requires_grad: true")
    plain = build_to(write_spec(out, trainable, "plain.yaml"), out / "plain", {"*": "cpu"})
    assert plain.graph.frozen_params == 0
    reference = import_generated(out / "plain" / "frozen.py").Frozen()
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict(), strict=True)  # --init loads them
    assert frozen_names(model) == FROZEN
    # init: applies to frozen parameters as to the others.
    fresh = import_generated(out / "frozen.py").Frozen()
    assert torch.equal(fresh.pos, torch.full((8,), 0.25))
    assert torch.equal(fresh.still.gamma, torch.full((16,), 0.5))
    assert torch.equal(fresh.fc1.bias, torch.full((16,), 0.125))


def test_the_generated_code_says_it_in_init(built):
    out, _ = built
    text = (out / "frozen.py").read_text()
    assert 'self.pos = nn.Parameter(torch.empty(8, device="cpu"), requires_grad=False)' in text
    assert "self.gamma = nn.Parameter(torch.empty(dim), requires_grad=False)" in text
    for layer in ("fc1", "still", "deep"):
        assert f"self.{layer}.requires_grad_(False)  # frozen (requires_grad: false)" in text
    assert "self.body.requires_grad_" not in text and "self.head.requires_grad_" not in text
    assert "trainable: 612 (the rest requires_grad: false)" in text


def test_every_generated_file_is_in_blacks_layout(built):
    _, result = built
    for name, text in result.files.items():
        if name.endswith(".py"):
            assert black.format_str(text, mode=format.black_mode()) == text, name


def test_the_pipeline_stages_freeze_them_too(built):
    out, _ = built
    pp = import_generated(out / "pp_frozen.py")
    frozen = set().union(*(frozen_names(stage()) for stage in pp.STAGES.stages))
    assert frozen == FROZEN


def test_the_optimizer_gets_only_what_trains(built):
    out, _ = built
    model = import_generated(out / "frozen.py").Frozen()
    training = import_generated(out / "train_frozen.py").TRAINING
    optimizer = training.optimizer(model, type("Args", (), {"lr": 0.1, "settings": training.settings})())
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}


def test_counts_and_the_memory_plan_leave_frozen_ones_untrained(built):
    _, result = built
    graph = result.graph
    assert graph.total_params == 1_628 and graph.frozen_params == 1_016
    assert graph.trainable_params == 612  # body's two fc (2 x 272) and head (68)
    costs = graph.costs.units
    assert sum(u.grad_bytes for u in costs) == 612 * 4
    train = {d.device: d for d in graph.memory.train}
    assert train["cpu"].gradients == 612 * 4  # simulated: none for a frozen parameter
    # AdamW's two moments and a step count for each of the 6 tensors that train.
    assert train["cpu"].optimizer == 2 * 612 * 4 + 6 * 4


def test_the_report_show_and_the_build_line_say_what_trains(built, tmp_path):
    out, _ = built
    report = (out / "frozen.placement.md").read_text()
    assert "612 of the 1,628 parameters train; the others are frozen" in report
    spec = write_spec(tmp_path, SPEC)
    shown = mpgen("show", str(spec), "--device-map", "cpu")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^total +1,628$", shown.stdout, re.M)
    assert re.search(r"^trainable +612$", shown.stdout, re.M)
    ran = mpgen("build", str(spec), "-o", str(tmp_path / "out"), "--device-map", "cpu")
    assert "Frozen, 1,628 parameters (612 trainable) on cpu" in ran.stdout + ran.stderr


def test_a_model_whose_parameters_are_all_frozen_has_nothing_to_step(tmp_path):
    text = SPEC.replace("requires_grad: true", "requires_grad: false").replace(
        "body: {op: Scaled, args: [16], repeat: 2}",
        "body: {op: Scaled, args: [16], repeat: 2, requires_grad: false}")
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    assert result.graph.trainable_params == 0
    training = import_generated(tmp_path / "out" / "train_frozen.py").TRAINING
    assert training.optimizer is None
    assert "Frozen has no parameters that train" in result.files["pp_frozen.py"]


def test_a_split_block_instance_freezes_every_layer_inside(tmp_path):
    text = SPEC.replace("  still: cuda:1", "  still.gamma: cuda:1")
    result = build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    assert {n.name for n in result.graph.nodes if n.frozen} >= {"still.fc", "still.gamma"}
    model = import_generated(tmp_path / "out" / "frozen.py").Frozen()
    assert frozen_names(model) == FROZEN


def test_a_torch_function_keeps_its_own_keyword(tmp_path):
    text = ("mpgen: 1\nname: M\ninputs:\n  x: [batch, 2]\nlayers:\n"
            "  z: {op: torch.zeros, in: [], args: [2], requires_grad: true}\n"
            "  y: {op: torch.add, in: [x, z]}\n")
    build_to(write_spec(tmp_path, text), tmp_path / "out", {"*": "cpu"})
    assert 'torch.zeros(2, device="cpu", requires_grad=True)' in (tmp_path / "out" / "m.py").read_text()


@pytest.mark.parametrize("layer, where, message", [
    ("{op: Linear, args: [2, 2], requires_grad: 0}", "6:48", "requires_grad: "),
    ("{op: Parameter, shape: [2], requires_grad: maybe}", "6:49", "requires_grad: "),
    ("{op: Buffer, shape: [2], requires_grad: false}", "6:31",
     "a Buffer takes no requires_grad: (it never trains"),
    ("{op: Linear, args: [2, 2], require_grad: false}", "6:33",
     "unknown keyword argument 'require_grad' for Linear (did you mean 'requires_grad'?)"),
    ("{op: Parameter, shape: [2], requires_gard: false}", "6:34",
     "unknown key 'requires_gard' for a Parameter (did you mean 'requires_grad'?)"),
    ("{op: torch.sin, requires_grad: false}", "6:22",
     "unknown keyword argument 'requires_grad' for torch.sin"),
])
def test_mistakes_are_reported_at_their_line(tmp_path, layer, where, message):
    text = f"mpgen: 1\nname: M\ninputs:\n  x: [batch, 2]\nlayers:\n  p: {layer}\n" \
           "  y: {op: torch.add, in: [x, p]}\n"
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    assert f"spec.yaml:{where}: " in str(info.value)
    assert message in str(info.value)


TIED = """
mpgen: 1
name: Tied
inputs:
  idx: {shape: [batch, 8], dtype: int64}
layers:
  wte: {op: Embedding, args: [32, 16], requires_grad: false}
  fc: {op: Linear, args: [16, 16]}
  lm_head: {op: Linear, args: [16, 32], tie: {weight: wte.weight}}
  proj: {op: Linear, args: [32, 16], requires_grad: false}
  back: {op: Linear, args: [16, 16], tie: {weight: fc.weight}, requires_grad: false}
placement:
  wte: cuda:0
  lm_head: cuda:1
train:
  loss: MSELoss
  optimizer: {op: SGD, lr: 0.1}
  batch_size: 4
"""


def test_a_tied_parameter_trains_as_its_owner_on_every_stage(tmp_path):
    build_to(write_spec(tmp_path, TIED), tmp_path / "out", {"*": "cpu"})
    model = import_generated(tmp_path / "out" / "tied.py").Tied()
    # wte's weight (lm_head's too) is frozen; fc's (back's too) trains, back's bias not.
    assert frozen_names(model) == {"wte.weight", "proj.weight", "proj.bias", "back.bias"}
    assert model.back.weight.requires_grad and not model.lm_head.weight.requires_grad
    pp = import_generated(tmp_path / "out" / "pp_tied.py")
    stages = [stage() for stage in pp.STAGES.stages]
    frozen = set().union(*(frozen_names(stage) for stage in stages))
    # The second stage's copies of wte.weight and fc.weight follow their owners.
    assert frozen == {"wte.weight", "lm_head.weight", "proj.weight", "proj.bias", "back.bias"}


def test_the_digest_of_a_spec_without_the_key_is_unchanged():
    def digest(layer: str) -> str:
        text = f"mpgen: 1\nname: M\ninputs:\n  x: [batch, 2]\nlayers:\n  fc: {layer}\n"
        return spec_digest(validate(load_text(text, "spec.yaml")))

    plain = digest("{op: Linear, args: [2, 2]}")
    assert b"requires_grad" not in canonical(
        validate(load_text("mpgen: 1\nname: M\ninputs:\n  x: [batch, 2]\nlayers:\n"
                           "  fc: {op: Linear, args: [2, 2]}\n", "spec.yaml")))
    assert digest("{op: Linear, args: [2, 2], requires_grad: false}") != plain
    # true stays in: on a torch function it is a keyword of the call (torch.zeros).
    assert digest("{op: Linear, args: [2, 2], requires_grad: true}") != plain
