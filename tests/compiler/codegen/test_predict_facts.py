"""codegen/predict.py: predict_<name>.py states the model's outputs, where
each holds its samples, the losses that score classes and the attribute of
the model's own micro-batched forward; the rest is train_<name>.py's."""

from __future__ import annotations

import pytest

from helpers import EXAMPLES, build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.compiler.codegen import common, predict

CPU = {"*": "cpu"}


def facts(text: str) -> str:
    """The PREDICTING statement of a rendered predict_<name>.py."""
    return text[text.index("PREDICTING = "):text.index('if __name__ == "__main__"')].strip()


def test_the_seed_s_file_names_its_output_and_imports_only_the_runtime_and_train_script():
    graph = driver.compile_spec(EXAMPLES / "seed.yaml")
    text = predict.render_predict(graph)
    assert common.file_names(graph)["predict"] == "predict_simple_model.py"
    assert "\nimport mpgen_runtime.predict\nimport train_simple_model\n" in text
    assert facts(text) == (
        "PREDICTING = mpgen_runtime.predict.Predicting(\n"
        "    training=train_simple_model.TRAINING,\n"
        '    outputs=("layer2",),\n'
        "    output_dims=(0,),\n"
        ")")
    assert text.endswith('if __name__ == "__main__":\n'
                         "    mpgen_runtime.predict.predict(PREDICTING)\n")


def test_sequence_first_outputs_and_class_scores_are_stated():
    graph = driver.compile_spec(EXAMPLES / "lstm_lm.yaml")
    text = facts(predict.render_predict(graph))
    assert 'outputs=("decoder", "hn", "cn"),' in text
    assert "output_dims=(1, 1, 1)," in text  # [seq, batch, vocab], [layers, batch, hidden]
    assert "scored=((0, 2),)," in text  # the decoder's classes: its last dim


def test_a_pipelined_model_names_its_micro_batch_attribute():
    graph = driver.compile_spec(EXAMPLES / "pipelined_mlp.yaml")
    assert 'microbatches="microbatches",' in facts(predict.render_predict(graph))


PIPELINED = """
mpgen: 1
name: Crowded
inputs:
  x: [batch, 4]
layers:
  microbatches: {op: Linear, args: [4, 8]}
  head: {op: Linear, args: [8, 2]}
placement:
  head: cuda:1
pipeline:
  microbatches: 2
"""


def test_the_micro_batch_attribute_is_the_model_s_whatever_its_layers_are_named(tmp_path):
    result = build_to(write_spec(tmp_path, PIPELINED), tmp_path, CPU)
    attribute = predict.microbatch_attribute(result.graph)
    assert attribute != "microbatches"  # a layer holds that name
    model = import_generated(tmp_path / "crowded.py")
    assert getattr(model.Crowded, attribute) == 2
    assert f"microbatches={attribute!r}".replace("'", '"') in result.files["predict_crowded.py"]


FLATTENED = """
mpgen: 1
name: Flat
inputs:
  tokens: {shape: [seq, batch], dtype: int64}
layers:
  emb: {op: Embedding, args: [10, 8]}
  head: {op: Linear, args: [8, 10]}
  flat: {op: torch.reshape, shape: [-1, 10]}
  bare: {op: torch.mean, in: head}
outputs: [flat, bare]
train:
  loss: {flat: CrossEntropyLoss}
  dims: {seq: 3}
"""


def test_an_output_whose_samples_sit_inside_a_product_takes_its_loss_s_layout(tmp_path):
    graph = driver.compile_spec(write_spec(tmp_path, FLATTENED))
    text = facts(predict.render_predict(graph))
    assert "output_dims=((0, 1), None)," in text  # s * batch + b; a mean has no samples
    assert "scored=((0, 1),)," in text


@pytest.mark.parametrize("example", ["seed", "multitask", "unet"])
def test_the_file_compiles_and_states_what_the_model_returns(tmp_path, example):
    result = build_to(EXAMPLES / f"{example}.yaml", tmp_path, CPU)
    name = common.file_names(result.graph)["predict"]
    script = import_generated(tmp_path / name)
    assert script.PREDICTING.outputs == tuple(result.graph.outputs)
    assert len(script.PREDICTING.output_dims) == len(result.graph.outputs)
    assert script.PREDICTING.training.inputs == tuple(t.var for t in result.graph.inputs)
