"""``train.metrics`` resolves into ``TrainConfig.metrics`` and each metric's
columns (``TrainConfig.metric_columns``): by default the accuracy of each
class output and the perplexity of each token loss; a spec's list in its
order, a metric on every output it applies to (named with the output where
several), a user's function under the import policy. Refusals are the
fixtures ``tests/errors/train_metrics*.yaml``."""

from __future__ import annotations

import pytest

from helpers import build_to, write_spec
from mpgen.compiler import driver
from mpgen.compiler.ir import Metric
from mpgen.errors import MpgenError

TWO_HEADS = """
mpgen: 1
name: TwoHeads
inputs:
  x: [batch, 8]
layers:
  trunk: {op: Linear, args: [8, 16], in: x}
  a_head: {op: Linear, args: [16, 5], in: trunk}
  b_head: {op: Linear, args: [16, 3], in: trunk}
  reg_head: {op: Linear, args: [16, 1], in: trunk}
outputs: [a_head, b_head, reg_head]
train:
  loss: {a_head: CrossEntropyLoss, b_head: CrossEntropyLoss, reg_head: MSELoss}
"""

LM = """
mpgen: 1
name: TinyLM
inputs:
  ids: {shape: [batch, seq], dtype: int64}
layers:
  emb: {op: Embedding, args: [11, 8], in: ids}
  head: {op: Linear, args: [8, 11]}
train:
  loss: CrossEntropyLoss
  dims: {seq: 4}
"""


def columns(tmp_path, text: str) -> list[tuple[str, str, str]]:
    train = driver.compile_spec(write_spec(tmp_path, text)).train
    return [(c.name, c.metric.op, train.losses[c.loss].output) for c in train.metric_columns()]


def test_by_default_each_class_output_has_its_accuracy(tmp_path):
    assert columns(tmp_path, TWO_HEADS) == [
        ("accuracy_a_head", "accuracy", "a_head"),
        ("accuracy_b_head", "accuracy", "b_head"),
    ]


def test_by_default_a_token_loss_has_its_perplexity(tmp_path):
    assert columns(tmp_path, LM) == [
        ("accuracy", "accuracy", "head"),
        ("perplexity", "perplexity", "head"),
    ]


def test_a_specs_metrics_in_its_order_each_on_the_outputs_it_names_or_fits(tmp_path):
    text = TWO_HEADS + "  metrics: [f1, {op: top_k_accuracy, k: 4, output: a_head}, accuracy]\n"
    assert columns(tmp_path, text) == [
        ("f1_a_head", "f1", "a_head"),
        ("f1_b_head", "f1", "b_head"),
        ("top4_accuracy", "top_k_accuracy", "a_head"),
        ("accuracy_a_head", "accuracy", "a_head"),
        ("accuracy_b_head", "accuracy", "b_head"),
    ]


def test_an_empty_list_asks_for_no_metric(tmp_path):
    assert columns(tmp_path, TWO_HEADS + "  metrics: []\n") == []


def test_a_users_function_is_imported_by_the_script_and_named_by_its_function(tmp_path):
    (tmp_path / "mymetrics.py").write_text(
        "def agreement(output, target):\n    return (output.argmax(1) == target).float().mean()\n"
    )
    text = TWO_HEADS + "  metrics: [{op: 'mymetrics:agreement', output: b_head}]\n"
    spec = write_spec(tmp_path, text)
    train = driver.compile_spec(spec).train
    assert train.metrics == (Metric("mymetrics:agreement", "b_head", 1, "mymetrics:agreement",
                                    train.metrics[0].pos),)
    assert train.modules == ("mymetrics",)
    build_to(spec, tmp_path / "out", {"*": "cpu"})
    script = (tmp_path / "out" / "train_two_heads.py").read_text()
    assert "import mymetrics\n" in script
    assert '"agreement", "function", loss=1, function=mymetrics.agreement' in script


@pytest.mark.parametrize("metric", ["accuracy", "f1", "top2_accuracy", "perplexity"])
def test_a_metric_no_output_can_give_is_refused_at_it(tmp_path, metric):
    text = TWO_HEADS.replace(
        "loss: {a_head: CrossEntropyLoss, b_head: CrossEntropyLoss, reg_head: MSELoss}",
        "loss: {reg_head: MSELoss}",
    ) + f"  metrics: [{metric}]\n"
    with pytest.raises(MpgenError, match=f"train.metrics: {metric} needs .*; the spec has none"):
        driver.compile_spec(write_spec(tmp_path, text))
