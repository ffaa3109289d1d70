"""The evaluation's metrics (mpgen/runtime/metrics.py): each output's loss,
accuracy, top-k accuracy, macro F1, perplexity and a user's function,
summed over batches by a Tally and named as log.csv's columns."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mpgen.runtime import Metric
from mpgen.runtime.metrics import Tally, eval_columns, hits, loss_columns, maximised
from tiny import TRAINING


def two_heads(*metrics: Metric, ignore_index: int = -100):
    """Tiny's facts for a model with a 4-class head ``cls`` and a regression head ``reg``."""
    return dataclasses.replace(
        TRAINING,
        targets=("cls_target", "reg_target"),
        loss_outputs=("cls", "reg"),
        class_dims=(1, None),
        classes=(None, (4, ignore_index), None),
        metrics=metrics,
    )


def parts(logits, target, reg_loss=0.5):
    cls_loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
    reg = torch.zeros(len(target), 1)
    return cls_loss + reg_loss, (
        (cls_loss, logits, target),
        (torch.tensor(reg_loss), reg, reg),
    )


def test_the_columns_are_each_outputs_loss_then_each_metric():
    training = two_heads(Metric("accuracy", "accuracy"), Metric("f1", "f1", classes=4))
    assert loss_columns(training) == ["loss_cls", "loss_reg"]
    assert eval_columns(training) == training.eval_metrics
    assert training.eval_metrics == [
        "eval_loss",
        "eval_loss_cls",
        "eval_loss_reg",
        "eval_accuracy",
        "eval_f1",
    ]
    assert loss_columns(TRAINING) == []  # one loss: the loss is the output's
    assert eval_columns(TRAINING) == ["eval_loss", "eval_accuracy"]


def test_lower_is_better_for_losses_and_perplexity_only():
    assert not maximised("eval_loss") and not maximised("eval_loss_cls")
    assert not maximised("eval_perplexity_lm")
    assert maximised("eval_accuracy") and maximised("eval_f1") and maximised("eval_score")


def test_top_k_hits_count_a_target_among_the_k_largest():
    logits = torch.tensor([[0.1, 0.5, 0.4, 0.0], [0.9, 0.05, 0.04, 0.01]])
    target = torch.tensor([2, 3])
    assert [int(x) for x in hits(logits, target, 1)] == [0, 2]
    assert [int(x) for x in hits(logits, target, 1, k=2)] == [1, 2]
    assert [int(x) for x in hits(logits, target, 1, k=4)] == [2, 2]


def test_a_tally_gives_the_means_of_the_losses_and_the_metrics_over_batches():
    def score(output, target):  # a user's metric: the mean of the largest logit
        return output.max(1).values.mean()

    training = two_heads(
        Metric("accuracy", "accuracy"),
        Metric("top2_accuracy", "top_k_accuracy", k=2),
        Metric("f1", "f1", classes=4),
        Metric("score", "function", function=score),
    )
    first = torch.tensor([[5.0, 0, 0, 0], [0, 5, 0, 0], [0, 0, 5, 0], [1, 0, 5, 0]])
    second = torch.tensor([[0.0, 1, 0, 5], [1, 0, 0, 5]])
    batches = [(first, torch.tensor([0, 1, 2, 3])), (second, torch.tensor([3, 0]))]
    tally = Tally(training)
    expected_loss = []
    for logits, target in batches:
        loss, each = parts(logits, target)
        tally.add_losses(loss, [part for part, _, _ in each])
        tally.add_outputs(each)
        expected_loss.append(float(loss))
    found = tally.results(len(batches))
    assert list(found) == training.eval_metrics
    assert found["eval_loss"] == pytest.approx(sum(expected_loss) / 2)
    assert found["eval_loss_reg"] == pytest.approx(0.5)
    assert found["eval_accuracy"] == 4 / 6  # 3 of 4, then 1 of 2
    # the first batch's last (2 then 0, for 3) misses; the second's 0 is its second largest
    assert found["eval_top2_accuracy"] == 5 / 6
    # per class (predicted, actual, right): 0 (1, 2, 1), 1 (1, 1, 1), 2 (2, 1, 1), 3 (2, 2, 1)
    f1 = [2 * 1 / 3, 2 * 1 / 2, 2 * 1 / 3, 2 * 1 / 4]
    assert found["eval_f1"] == pytest.approx(sum(f1) / 4)
    assert found["eval_score"] == pytest.approx(5.0)


def test_ignored_targets_count_for_no_metric():
    training = two_heads(Metric("accuracy", "accuracy"), Metric("f1", "f1", classes=4))
    logits = torch.eye(4) * 5
    target = torch.tensor([0, 1, -100, -100])  # the last two are padding
    tally = Tally(training)
    tally.add_outputs(parts(logits, target)[1])
    found = tally.results(1)
    assert found["eval_accuracy"] == 1.0 and found["eval_f1"] == 1.0


def test_perplexity_is_the_exponential_of_its_outputs_mean_loss():
    training = dataclasses.replace(TRAINING, metrics=(Metric("perplexity", "perplexity"),))
    tally = Tally(training)
    for value in (1.0, 2.0):
        tally.add_losses(torch.tensor(value), [torch.tensor(value)])
    found = tally.results(2)
    assert found == {"eval_loss": 1.5, "eval_perplexity": pytest.approx(math.exp(1.5))}
