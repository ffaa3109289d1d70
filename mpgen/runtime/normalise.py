"""The pipeline's stage loss over the whole batch: a mean over the targets a
loss counts (CrossEntropyLoss, NLLLoss) normalised by the whole batch's
count, every replica's, not each micro-batch's own (NOTE [Micro-batch
losses] in pipeline.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn


class TokenMean(nn.Module):
    """A loss that is a mean over the targets it counts (CrossEntropyLoss,
    NLLLoss: those not ``ignore_index``, by class weight), as its sum over a
    micro-batch divided by ``share``: the whole batch's count over the
    micro-batches of every replica (NOTE [Micro-batch losses])."""

    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.mean, self.sum = fn, copy.copy(fn)
        self.sum.reduction = "sum"
        self.share = torch.ones(())

    @staticmethod
    def applies(fn) -> bool:
        return getattr(fn, "reduction", None) == "mean" and hasattr(fn, "ignore_index")

    def count(self, target: torch.Tensor) -> torch.Tensor:
        if target.is_floating_point():  # class probabilities: a plain mean
            return torch.zeros((), dtype=torch.float64)
        counted = target != self.mean.ignore_index
        weight = getattr(self.mean, "weight", None)
        if weight is not None:
            return weight.to(target.device)[target[counted]].double().sum()
        return counted.sum().double()

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.is_floating_point():
            return self.mean(input, target)
        return self.sum(input, target) / self.share.to(input.device)


class Counting:
    """Stands in for a stage's loss function to count its targets: the stage
    loss run on the meta device's outputs with a micro-batch's real targets."""

    def __init__(self, fn, totals: list, k: int) -> None:
        self.fn, self.totals, self.k = fn, totals, k

    def __call__(self, input, target, *rest, **kwargs) -> torch.Tensor:
        if isinstance(self.fn, TokenMean):
            self.totals[self.k] += self.fn.count(target).cpu()
        return torch.zeros(())


def shares(
    stage_loss, outputs, targets, loss_fns, part, microbatches, dp, group, device
):
    """Set each TokenMean's share before a batch: the whole batch's count of
    its targets over the micro-batches of every replica. The last stages
    count theirs by running the stage loss with Counting stand-ins on
    ``outputs`` (one micro-batch's, on the meta device) and each
    micro-batch's real targets, then sum over ``group`` (the replicas)."""
    totals = [torch.zeros((), dtype=torch.float64) for _ in loss_fns]
    counting = tuple(Counting(fn, totals, k) for k, fn in enumerate(loss_fns))
    chunk = part // microbatches
    for j in range(microbatches):
        stage_loss(
            outputs, torch.arange(j * chunk, (j + 1) * chunk), targets, counting, 1
        )
    total = torch.stack(totals).to(device)
    if group is not None:
        dist.all_reduce(total, group=group)
    for fn, count in zip(loss_fns, total):
        if isinstance(fn, TokenMean):
            fn.share = (count / (microbatches * dp)).float()
