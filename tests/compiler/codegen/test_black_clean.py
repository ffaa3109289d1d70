"""The generated Python files (the model module, its tests, the training
script and the pipeline program) are written in black's layout (NOTE
[Written in black's layout], codegen/format.py): black leaves them as they
are, for every example and for specs that make black wrap what the spec
decides (long names, many inputs, many keyword arguments, long values,
quotes in strings) or keep on one line what short names leave short; and a
statement laid out on its own is what black makes of it in place.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import black
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import EXAMPLES, write_factory, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen import common, format, model as model_module, pp, predict, tests, train
from mpgen.compiler.frontend.namespace import model_name_problem

LONG = "Very" + "Long" * 24  # 100 characters: the longest model name


def assert_black_clean(graph) -> None:
    """Black leaves every generated Python file unchanged."""
    names = common.file_names(graph)
    for role, render in (("model", model_module.render_model), ("test", tests.render_test),
                         ("train", train.render_train), ("pp", pp.render_pp),
                         ("predict", predict.render_predict)):
        text = render(graph)
        assert black.format_str(text, mode=format.black_mode()) == text, names[role]


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.slow
def test_the_examples_are_black_clean(example):
    assert_black_clean(driver.compile_spec(example))


def model(name: str = "M", inputs: int = 1, width: int = 8, output: str = "fc") -> str:
    """A spec of ``inputs`` inputs concatenated into one Linear layer, on two devices."""
    names = [f"x{k}" if inputs > 1 else "x" for k in range(inputs)]
    lines = [f"mpgen: 1\nname: {name}\ninputs:"]
    lines += [f"  {v}: [batch, {width}]" for v in names]
    lines.append("layers:")
    if inputs > 1:
        lines.append(f"  joined: {{op: torch.cat, in: [{', '.join(names)}], dim: 1}}")
    lines.append(f"  {output}: {{op: Linear, args: [{width * inputs}, 4]}}")
    lines.append(f"  act: {{op: ReLU, in: {output}}}")
    lines.append("  out: {op: Linear, args: [4, 3]}")
    lines.append("placement:\n  act: cuda:1")
    return "\n".join(lines) + "\n"


TRAINING = {
    "every_key": """\
train:
  optimizer: {op: AdamW, lr: 3.0e-4, weight_decay: 0.1}
  steps: 50
  epochs: 3
  scheduler: {op: cosine, warmup: 100, min_lr: 6.0e-5}
  grad_clip: 1
  accumulate: 4
  amp: bf16
  no_decay: [biases, norms, embeddings]
  data: {factory: "mydata.text:make", split: train, root: data, sizes: [1, 2]}
  eval_data: {factory: "mydata.text:make", split: test, root: data}
  eval_every: 100
  samples: 64
  workers: 2
""",
    "torch_scheduler_with_warmup": """\
train:
  optimizer: {op: SGD, lr: 0.1, momentum: 0.9, nesterov: true}
  scheduler: {op: MultiStepLR, milestones: [100, 200, 300, 400, 500, 600], gamma: 0.5, warmup: 7}
  steps: 1000000000000
""",
    "plateau": """\
train:
  optimizer: AdamW
  scheduler: {op: ReduceLROnPlateau, mode: max, min_lr: [1.0e-5]}
  eval_split: 0.25
  eval_every: 10
  data: d.pt
""",
    "linear_schedule_and_fp16": """\
train:
  optimizer: {op: SGD, lr: 1.0e30}
  scheduler: {op: linear, min_lr: 1.0e-30}
  amp: fp16
""",
    "constant_schedule_with_warmup": """\
train:
  scheduler: {op: constant, warmup: 1000000}
  accumulate: 1000000
""",
    "closure": """\
train:
  optimizer: LBFGS
  loss: MSELoss
""",
    "plateau_of_the_training_loss": """\
train:
  scheduler: {op: ReduceLROnPlateau, mode: max}
  optimizer: AdamW
""",
    "quotes_in_strings": """\
train:
  data: {factory: "mydata:make", root: "it's \\"here\\"", name: 'say "hi"', both: "a'b\\"c"}
  eval_data: "data/it's.npz"
""",
    "long_values": """\
train:
  data: {factory: "a_rather_long_package_name.with_a_module:and_a_factory_function", root: "/a/very/long/path/to/the/data/folder/of/this/project", limit: 1000000}
  eval_data: /a/very/long/path/to/the/evaluation/data/of/this/project/with/a/long/name.npz
  loss: {op: CrossEntropyLoss, label_smoothing: 0.1, ignore_index: -100, reduction: sum}
""",
}


@pytest.mark.parametrize("training", TRAINING, ids=str)
def test_training_options_are_black_clean(tmp_path, training):
    spec = model() + TRAINING[training]
    assert_black_clean(driver.compile_spec(with_factories(tmp_path, spec)))


def with_factories(folder, spec: str, name: str = "spec.yaml"):
    """The spec, written beside the modules of the data factories it names."""
    for factory in set(re.findall(r"factory: [\"']?([\w.]+:\w+)", spec)):
        write_factory(folder, factory)
    return write_spec(folder, spec, name)


@pytest.mark.parametrize("name, inputs", [("A", 1), ("Ab", 2), (LONG, 1), (LONG[:60], 12),
                                          ("M", 30)])
@pytest.mark.parametrize("output", ["fc", "a_long_output_name_that_names_its_loss_too" * 2])
def test_long_and_short_names_are_black_clean(tmp_path, name, inputs, output):
    spec = model(name, inputs, output=output) + TRAINING["every_key"]
    assert_black_clean(driver.compile_spec(with_factories(tmp_path, spec)))


def test_a_long_spec_path_is_black_clean(tmp_path):
    folder = tmp_path / ("a_folder_with_a_rather_long_name_" * 3) / ("and_another_one_" * 4)
    folder.mkdir(parents=True)
    path = with_factories(folder, model(LONG) + TRAINING["long_values"], "s" * 100 + ".yaml")
    assert_black_clean(driver.compile_spec(path))


MULTITASK = """\
mpgen: 1
name: {name}
inputs:
  image_embedding_of_a_sample: [batch, 64]
  tabular_features_of_a_sample: [batch, 8]
  token_ids_of_a_sample: {{shape: [batch, seq], dtype: int64}}
layers:
  image_projection: {{op: Linear, args: [64, 32], in: image_embedding_of_a_sample}}
  feature_projection: {{op: Linear, args: [8, 32], in: tabular_features_of_a_sample}}
  embedding: {{op: Embedding, args: [100, 32], in: token_ids_of_a_sample}}
  pooled: {{op: torch.mean, in: embedding, dim: 1}}
  joined: {{op: torch.cat, in: [image_projection, feature_projection, pooled], dim: 1}}
  norm: {{op: LayerNorm, args: [96]}}
  classification_head_of_the_model: {{op: Linear, args: [96, 5], in: norm}}
  regression_head_of_the_model: {{op: Linear, args: [96, 1], in: norm}}
  token_head: {{op: Linear, args: [32, 100], in: embedding}}
outputs: [classification_head_of_the_model, regression_head_of_the_model, token_head]
placement:
  image_projection: cuda:0
  norm: cuda:1
  regression_head_of_the_model: cuda:2
  token_head: cuda:3
train:
  loss:
    classification_head_of_the_model: {{op: CrossEntropyLoss, label_smoothing: 0.1}}
    regression_head_of_the_model: {{op: HuberLoss, delta: 0.5, reduction: sum}}
    token_head: {{op: CrossEntropyLoss, class_dim: -1}}
  optimizer: {{op: AdamW, lr: 1.0e-3, weight_decay: 0.01, betas: [0.9, 0.95]}}
  no_decay: [norms, embeddings]
  dims: {{seq: 16}}
pipeline: {{microbatches: 4, schedule: gpipe}}
"""


@pytest.mark.parametrize("name", ["MultiTask", LONG])
def test_several_inputs_outputs_and_losses_are_black_clean(tmp_path, name):
    graph = driver.compile_spec(write_spec(tmp_path, MULTITASK.format(name=name)))
    assert len(graph.train.losses) == 3
    assert_black_clean(graph)


AN_INPUT_WITHOUT_A_BATCH_DIM = """\
mpgen: 1
name: Shifted
inputs:
  x: [batch, 8]
  shift_added_to_every_sample_of_the_batch: [4]
layers:
  fc: {op: Linear, args: [8, 4], in: x}
  moved: {op: torch.add, in: [fc, shift_added_to_every_sample_of_the_batch]}
  out: {op: Linear, args: [4, 3]}
placement:
  out: cuda:1
"""


def test_an_input_without_a_batch_dim_is_black_clean(tmp_path):
    """Each micro-batch of the pipeline gets it whole (the runtime replicates an
    input whose batch dim is None)."""
    graph = driver.compile_spec(write_spec(tmp_path, AN_INPUT_WITHOUT_A_BATCH_DIM))
    assert "    batch_dims=(0, None, 0)," in train.render_train(graph).splitlines()
    assert_black_clean(graph)


ZOO = {
    "every_conv_keyword_init_and_long_layer_names": """\
mpgen: 1
name: {name}
inputs:
  image_batch_of_the_model_with_a_rather_long_name: [batch, 3, 16, 16]
layers:
  the_first_convolution_of_the_network_with_a_long_name_too:
    op: Conv2d
    args: [3, 8, 3]
    stride: 1
    padding: 1
    dilation: 1
    groups: 1
    bias: true
    padding_mode: zeros
    init: {{weight: {{kaiming_normal: {{mode: fan_out, nonlinearity: relu}}}}}}
  act: {{op: ReLU}}
  pool_of_the_network_with_a_name_as_long_as_the_rest_of_them: {{op: AdaptiveAvgPool2d, args: [1]}}
  flat: {{op: torch.flatten, start_dim: 1}}
  the_classification_head_of_the_network_with_a_long_name: {{op: Linear, args: [8, 10]}}
placement:
  act: cuda:1
init:
  Conv2d: {{weight: {{kaiming_normal: {{mode: fan_out, nonlinearity: relu}}}}, bias: zeros}}
  Linear: {{weight: {{normal: {{std: 0.02}}}}, bias: zeros}}
  BatchNorm2d: {{weight: ones, bias: zeros}}
""",
    "deep_blocks_repeated_over_devices_and_checkpointed": """\
mpgen: 1
name: {name}
inputs: {{features_of_every_sample_in_the_batch_with_a_long_name: [batch, 32]}}
blocks:
  MultiLayerPerceptronBlockWithAVeryLongNameIndeedForTesting:
    params: [dimension_of_the_hidden_layer, dropout_probability_of_it]
    layers:
      up_projection_of_the_block: {{op: Linear, args: [$dimension_of_the_hidden_layer, "=4 * $dimension_of_the_hidden_layer"]}}
      act: {{op: GELU}}
      drop: {{op: Dropout, args: [$dropout_probability_of_it]}}
      down_projection_of_the_block: {{op: Linear, args: ["=4 * $dimension_of_the_hidden_layer", $dimension_of_the_hidden_layer]}}
      residual_connection_of_the_block: {{op: torch.add, in: [down_projection_of_the_block, x]}}
  OuterBlockThatHoldsTwoOfTheInnerOnes:
    params: [dim]
    layers:
      first_inner_block_of_the_outer_one: {{op: MultiLayerPerceptronBlockWithAVeryLongNameIndeedForTesting, args: [$dim, 0.1]}}
      second_inner_block_of_the_outer_one: {{op: MultiLayerPerceptronBlockWithAVeryLongNameIndeedForTesting, args: [$dim, 0.1], repeat: 2}}
layers:
  stem: {{op: Linear, args: [32, 32]}}
  mlp: {{op: MultiLayerPerceptronBlockWithAVeryLongNameIndeedForTesting, args: [32, 0.1], checkpoint: true}}
  the_repeated_hidden_layers_of_the_model: {{op: MultiLayerPerceptronBlockWithAVeryLongNameIndeedForTesting, args: [32, 0.0], repeat: 6}}
  outer: {{op: OuterBlockThatHoldsTwoOfTheInnerOnes, args: [32]}}
  head: {{op: Linear, args: [32, 4]}}
placement: {{stem: cuda:0, mlp: cuda:0, the_repeated_hidden_layers_of_the_model.0-1: cuda:0, the_repeated_hidden_layers_of_the_model.2-3: cuda:1, the_repeated_hidden_layers_of_the_model.4-5: cuda:2, head: cuda:2}}
train: {{batch_size: 16}}
pipeline: {{microbatches: 2, checkpoint: [cuda:1]}}
""",
    "tuple_outputs_seq_first_and_micro_batches": """\
mpgen: 1
name: {name}
inputs:
  the_token_embeddings_of_the_sequence_first_input: [seq, batch, 6]
  initial_hidden_state_of_the_recurrent_layer: [1, batch, 8]
  initial_cell_state_of_the_recurrent_layer: [1, batch, 8]
layers:
  the_recurrent_layer_with_a_long_name:
    op: LSTM
    args: [6, 8]
    in: [the_token_embeddings_of_the_sequence_first_input, [initial_hidden_state_of_the_recurrent_layer, initial_cell_state_of_the_recurrent_layer]]
    outputs: [the_sequence_of_outputs_of_the_recurrent_layer, [final_hidden_state_of_it, final_cell_state_of_it]]
  attention_over_the_outputs: {{op: MultiheadAttention, args: [8, 2], in: [the_sequence_of_outputs_of_the_recurrent_layer, the_sequence_of_outputs_of_the_recurrent_layer, the_sequence_of_outputs_of_the_recurrent_layer], outputs: [attended_outputs_of_the_attention_layer, _]}}
  the_output_head_of_the_model_with_a_long_name: {{op: Linear, args: [8, 3], in: attended_outputs_of_the_attention_layer}}
outputs: [the_output_head_of_the_model_with_a_long_name, final_hidden_state_of_it, final_cell_state_of_it]
placement: {{the_recurrent_layer_with_a_long_name: cuda:0, attention_over_the_outputs: cuda:1, the_output_head_of_the_model_with_a_long_name: cuda:2}}
train: {{batch_size: 12, dims: {{seq: 5}}, loss: MSELoss}}
pipeline: {{microbatches: 3}}
""",
    "ties_across_devices": """\
mpgen: 1
name: {name}
inputs:
  the_token_ids_of_the_input_with_a_rather_long_name: {{shape: [batch, seq], dtype: int64}}
layers:
  the_token_embedding_table_of_the_model: {{op: Embedding, args: [11, 4], in: the_token_ids_of_the_input_with_a_rather_long_name}}
  ln: {{op: LayerNorm, args: [4], eps: 1.0e-5, elementwise_affine: true}}
  the_language_modelling_head_of_the_model: {{op: Linear, args: [4, 11], bias: false, tie: {{weight: the_token_embedding_table_of_the_model.weight}}}}
placement:
  the_token_embedding_table_of_the_model: cuda:0
  ln: cuda:1
train: {{dims: {{seq: 7}}}}
""",
    "names_longer_than_a_line": """\
mpgen: 1
name: {name}
inputs:
  {long}_input: [batch, 8]
layers:
  {long}_first: {{op: Linear, args: [8, 8]}}
  {long}_second: {{op: Linear, args: [8, 8]}}
  out: {{op: Linear, args: [8, 2]}}
placement:
  {long}_second: cuda:1
""",
}


@pytest.mark.parametrize("name", ["M", LONG])
@pytest.mark.parametrize("spec", ZOO, ids=str)
def test_layers_blocks_and_forwards_of_every_kind_are_black_clean(tmp_path, spec, name):
    """Long layer and block names, every keyword of a Conv2d, blocks of
    blocks, repeated layers over devices, tuple outputs, ties, init:,
    checkpoint:, pipeline: (the micro-batched forward) and sequence-first
    inputs, in the model module as in the scripts."""
    text = ZOO[spec].format(name=name, long="a_layer_name_longer_than_a_line_" * 3)
    assert_black_clean(driver.compile_spec(write_spec(tmp_path, text)))


def identifiers(prefix: str, alphabet: str, longest: int) -> st.SearchStrategy[str]:
    """``prefix`` and up to ``longest`` characters of ``alphabet``, every length as likely."""
    return st.integers(0, longest).flatmap(
        lambda n: st.text(alphabet, min_size=n, max_size=n)).map(prefix.__add__)


LOWER = "abcdefghijklmnopqrstuvwxyz0123456789_"
#: Strings with quotes of both kinds, backslashes, control and non-ASCII characters.
STRINGS = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_categories=["Cs"]),
                  max_size=60)


@st.composite
def drawn_specs(draw) -> str:
    """A spec with drawn names (model, inputs, output), widths, numbers and
    the string arguments of a data factory."""
    name = draw(identifiers("M", LOWER.upper() + LOWER[:-1], 99)
                .filter(lambda name: model_name_problem(name) is None))
    inputs = draw(st.lists(identifiers("in_", LOWER, 60), min_size=1, max_size=16, unique=True))
    output = draw(identifiers("out_", LOWER, 80))
    width = draw(st.integers(1, 4096))
    layers = {}
    if len(inputs) > 1:
        layers["joined"] = {"op": "torch.cat", "in": inputs, "dim": 1}
    layers[output] = {"op": "Linear", "args": [width * len(inputs), 4]}
    layers["act"] = {"op": "ReLU"}
    layers["last"] = {"op": "Linear", "args": [4, 3]}
    factory = {"factory": "some_package.data:make"} | draw(
        st.dictionaries(identifiers("k_", LOWER, 30), STRINGS, max_size=4))
    spec = {
        "mpgen": 1, "name": name,
        "inputs": {v: ["batch", width] for v in inputs},
        "layers": layers,
        "placement": {"act": "cuda:1"},
        "train": {
            "optimizer": {"op": "AdamW", "lr": draw(st.sampled_from([3e-4, 1e-30, 1e30, 0.1]))},
            "steps": draw(st.integers(1, 2**31 - 1)), "batch_size": draw(st.integers(1, 10**6)),
            "samples": draw(st.integers(1, 2**31 - 1)), "workers": draw(st.integers(0, 256)),
            "data": factory, "eval_data": draw(STRINGS.map(lambda s: f"{s}.npz")),
        },
    }
    return yaml.safe_dump(spec, allow_unicode=True, sort_keys=False, width=1000)


@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(drawn_specs())
@pytest.mark.slow
def test_drawn_names_and_values_are_black_clean(tmp_path, spec):
    assert_black_clean(driver.compile_spec(with_factories(tmp_path, spec)))


USER_CLASSES = """\
import torch
from torch import nn


class FocalLossWithAVeryLongNameIndeed(nn.Module):
    def __init__(self, gamma=2.0, label="it's"):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, target):
        return nn.functional.cross_entropy(logits, target)


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01, tag="x"):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
"""


def test_a_users_loss_and_optimizer_classes_are_black_clean(tmp_path):
    (tmp_path / ".git").mkdir()
    package = tmp_path / "my_training_package_with_a_long_name" / "losses_and_optimizers"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(USER_CLASSES)
    dotted = "my_training_package_with_a_long_name.losses_and_optimizers"
    spec = model(LONG) + textwrap.dedent(f"""\
        train:
          loss: {{op: {dotted}.FocalLossWithAVeryLongNameIndeed, gamma: 1.5, label: "it's", class_dim: 1}}
          optimizer: {{op: {dotted}.SignSGD, lr: 0.001, tag: 'say "hi"'}}
        """)
    graph = driver.compile_spec(write_spec(tmp_path, spec))
    assert graph.train.modules == (dotted,)
    assert_black_clean(graph)


NO_PARAMETERS = f"""\
mpgen: 1
name: {LONG}
inputs:
  x: [batch, 8]
layers:
  act: {{op: ReLU}}
  soft: {{op: F.softmax, dim: -1}}
placement:
  soft: cuda:1
train: {{loss: MSELoss}}
"""


@pytest.mark.parametrize("spec", [NO_PARAMETERS, model(LONG) + TRAINING["closure"]],
                         ids=["no_parameters", "closure"])
def test_a_model_that_cannot_be_a_pipeline_is_black_clean(tmp_path, spec):
    """Its pipeline program is the one that says why."""
    graph = driver.compile_spec(write_spec(tmp_path, spec))
    assert pp.pipeline_problem(graph, pp.stages(graph, graph.spec_plan))
    assert_black_clean(graph)


A_BLOCK_NAMED_STAGES = """\
mpgen: 1
name: M
inputs:
  x: [batch, 8]
blocks:
  STAGES:
    layers:
      lin: {op: Linear, args: [8, 8]}
layers:
  deep: {op: STAGES, repeat: 4}
  out: {op: Linear, args: [8, 3]}
placement:
  deep.0-1: cuda:0
  deep.2-3: cuda:1
"""


@pytest.mark.parametrize("spec, renamed", [
    (model("TRAINING"), ("train", "TRAINING_1 = mpgen_runtime.Training(")),
    (A_BLOCK_NAMED_STAGES, ("pp", "STAGES_1 = mpgen_runtime.Stages(")),
], ids=["model_named_TRAINING", "block_named_STAGES"])
def test_a_spec_that_takes_a_name_of_the_file_is_black_clean(tmp_path, spec, renamed):
    """The spec's class keeps the name; the file's own gets a suffix."""
    graph = driver.compile_spec(with_factories(tmp_path, spec + TRAINING["every_key"]))
    role, line = renamed
    render = {"train": train.render_train, "pp": pp.render_pp}[role]
    assert line in render(graph).splitlines()
    assert_black_clean(graph)


@pytest.mark.slow  # 4 s: too long for the quick loop
def test_every_name_of_the_files_with_a_suffix_is_black_clean(monkeypatch):
    """Suffixes on all the files' own names move black's line breaks; the
    files still come out in black's layout."""
    imported, reserved = train._imported, pp._reserved
    monkeypatch.setattr(train, "_imported", lambda graph: imported(graph) | set(train.OWN_NAMES))
    monkeypatch.setattr(pp, "_reserved", lambda graph: reserved(graph) | set(pp.OWN_NAMES))
    graph = driver.compile_spec(EXAMPLES / "gpt2_small.yaml")
    assert "def make_batch_1(batch_size: int, seq: int = 32) -> tuple[tuple, tuple]:" in (
        train.render_train(graph).splitlines())
    assert "def stage_loss_1(outputs, index, targets, loss_fns, microbatches):" in (
        pp.render_pp(graph).splitlines())
    assert_black_clean(graph)


STATEMENTS = [
    'x = f("a", "b")\n',
    'parser.add_argument("--steps", type=int, default=' + "1" * 40 + ', help="optimizer steps")\n',
    "value = some_function(first_argument, second_argument) + another_function(third_one)  # why\n",
    "optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=[0.9, 0.95], eps=1e-08)\n",
    'log = Log(pathlib.Path(args.log_dir or args.checkpoint or "runs/' + "x" * 60 + '"), last, done)\n',
]
FUNCTION = (
    "def f(batch_size: int, seq: int = 1024) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:\n"
    "    x = torch.randn((batch_size, seq, 768))  # [batch, seq, 768]\n"
    "    return (x,), ()\n"
)


@pytest.mark.parametrize("code, indent", [(code, indent) for code in STATEMENTS
                                          for indent in (0, 4, 8, 12)] + [(FUNCTION, 0)])
def test_a_fragment_laid_out_alone_is_blacks_layout_in_place(code, indent):
    """:func:`format.layout` at ``indent`` columns gives what black gives the
    fragment where it stands, inside that many blocks."""
    depth = indent // 4
    opening = "".join(f"{'    ' * k}if x{k}:\n" for k in range(depth))
    whole = opening + format.layout(code, indent)
    assert black.format_str(whole, mode=format.black_mode()) == whole


def test_literals_are_spelled_as_black_spells_them():
    for value in ["plain", "it's", 'say "hi"', "both ' and \"", "'\"'\"", "back\\slash'\"",
                  "tab\tnew\nline", "é", 1e30, 1e-05, 0.1, float("inf"), -3, None, True]:
        code = f"x = {common.literal(value)}\n"
        assert black.format_str(code, mode=format.black_mode()) == code
        assert eval(common.literal(value)) == value or value != value


def test_generate_proves_the_files_compile_without_black(tmp_path, monkeypatch):
    """Black formats no generated file whole, only statements that do not
    fit; an invalid file is still refused."""
    spec = with_factories(tmp_path, model() + TRAINING["every_key"])
    formatted, format_str = [], black.format_str
    monkeypatch.setattr(black, "format_str",
                        lambda text, mode: formatted.append(text) or format_str(text, mode=mode))
    files = driver.generate(spec).files
    assert not any(marker in text for text in formatted
                   for marker in ("class M(nn.Module)", "class TestM(", "def main("))
    for name in ("m.py", "test_m.py", "train_m.py", "pp_m.py", "predict_m.py"):
        assert black.format_str(files[name], mode=format.black_mode()) == files[name], name
    for role, render in (("test", "render_test"), ("model", "render_model"),
                         ("train", "render_train")):
        with monkeypatch.context() as patch:
            patch.setattr({"test": tests, "model": model_module, "train": train}[role], render,
                          lambda graph: "def broken(:\n")
            with pytest.raises(format.GeneratedCodeError, match=common.file_names(
                    driver.compile_spec(spec))[role]):
                driver.generate(spec)


@pytest.mark.slow
def test_the_model_and_its_tests_are_written_without_importing_black():
    """Black is imported when a statement does not fit, not before: the
    model module and the tests of a spec whose statements fit never import it."""
    code = textwrap.dedent(f"""\
        import sys
        from mpgen.compiler import driver
        from mpgen.compiler.codegen import format, model, tests
        graph = driver.compile_spec({str(EXAMPLES / "seed.yaml")!r})
        model.render_model(graph), tests.render_test(graph)
        assert "black" not in sys.modules, sorted(m for m in sys.modules if "black" in m)
        format.layout("x = " + "1 + " * 30 + "1\\n")
        assert "black" in sys.modules
        """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_training_runtime_is_black_clean():
    """Copied verbatim into every output folder (mpgen/output/runtime.py)."""
    from mpgen.output import runtime

    for name, text in runtime.files().items():
        assert black.format_str(text, mode=format.black_mode()) == text, name
