"""normalise.py: a loss over counted targets, split into micro-batches and
replicas, sums to the whole batch's mean (NOTE [Micro-batch losses])."""

from __future__ import annotations

import torch
from torch import nn

from mpgen.runtime import normalise


def stage_loss(outputs, index, targets, loss_fns, microbatches):
    return loss_fns[0](outputs[0].flatten(0, -2), targets[0][index].flatten())


def test_padding_weighs_in_a_micro_batch_what_it_weighs_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 5)
    target = torch.randint(0, 5, (4, 3))
    target[0, 1:] = -100  # sample 0: one token; the others: three
    target[1, :] = -100  # sample 1: none
    whole = nn.CrossEntropyLoss()(logits.flatten(0, -2), target.flatten())
    fn = normalise.TokenMean(nn.CrossEntropyLoss())
    meta = (torch.empty(2, 3, 5, device="meta"),)
    normalise.shares(stage_loss, meta, (target,), (fn,), 4, 2, 1, None, "cpu")
    assert fn.share.item() == 7 / 2  # 7 counted tokens over 2 micro-batches
    parts = [stage_loss((logits[i : i + 2],), torch.arange(i, i + 2), (target,), (fn,), 1)
             for i in (0, 2)]
    # the schedule averages the micro-batches (the runtime divides by M): the batch's mean
    torch.testing.assert_close(sum(parts) / 2, whole)
    # each micro-batch's own mean would weigh them otherwise
    own = [nn.CrossEntropyLoss()(logits[i : i + 2].flatten(0, -2), target[i : i + 2].flatten())
           for i in (0, 2)]
    assert not torch.allclose(sum(own) / 2, whole)


def test_class_weights_and_probability_targets():
    weight = torch.tensor([1.0, 2.0, 3.0])
    fn = normalise.TokenMean(nn.CrossEntropyLoss(weight=weight))
    target = torch.tensor([0, 2, -100, 1])
    assert fn.count(target).item() == 1 + 3 + 2
    soft = torch.softmax(torch.randn(4, 3), 1)
    assert fn.count(soft).item() == 0  # class probabilities: a plain mean, not counted
    logits = torch.randn(4, 3)
    torch.testing.assert_close(fn(logits, soft), nn.CrossEntropyLoss(weight=weight)(logits, soft))
    assert not normalise.TokenMean.applies(nn.MSELoss())
    assert not normalise.TokenMean.applies(nn.CrossEntropyLoss(reduction="sum"))
