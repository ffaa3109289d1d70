"""What the log shows beside the loss: each output's loss, and the
evaluation's metrics (the spec's ``train: {metrics: [...]}``, or by default
the accuracy of each class output and the perplexity of each token loss).

``forward_loss`` (and the pipeline's stage loss) gives the loss and, for
each output with a loss, ``(its loss, the output, its target)``; a
:class:`Tally` sums what the evaluation's batches give in one float64
tensor, so the pipeline's ranks add theirs up in one all_reduce. The
results are named as ``log.csv``'s columns (``eval_loss``,
``eval_loss_cls_head``, ``eval_accuracy``, ...): what ``--monitor`` names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

#: The metrics the runtime computes itself (a user's is a function).
OPS = ("accuracy", "top_k_accuracy", "f1", "perplexity")


@dataclass(frozen=True)
class Metric:
    """One metric of the evaluation, of the output of the spec's loss
    ``loss`` (an index into ``Training.targets``): ``op`` one of
    :data:`OPS`, or ``"function"``: ``function(output, target) -> number``, a user's,
    averaged over the batches (the pipeline's micro-batches) it is called
    with. ``name``: its column, without ``eval_``."""

    name: str
    op: str
    loss: int = 0
    k: int = 1  # top_k_accuracy's k
    classes: int = 0  # f1's classes
    function: Optional[Callable] = None

    @property
    def size(self) -> int:
        """Its slots in a Tally: hits and counted targets; f1's true
        positives, predictions and targets per class; a user's sum and
        calls; perplexity none (the exponential of its output's loss)."""
        return {"f1": 3 * self.classes, "perplexity": 0}.get(self.op, 2)


def loss_columns(training) -> list[str]:
    """A step's loss of each output (``loss_cls_head``): where there are several."""
    outputs = training.loss_outputs
    return [f"loss_{name}" for name in outputs] if len(outputs) > 1 else []


def eval_columns(training) -> list[str]:
    """The evaluation's columns: ``eval_loss``, each output's, each metric's."""
    names = ["loss", *loss_columns(training)]
    return [f"eval_{name}" for name in names + [m.name for m in training.metrics]]


def maximised(column: str) -> bool:
    """Whether a larger value of ``column`` (an eval column) is better:
    not for a loss or a perplexity (a user's metric: larger is better)."""
    name = column.removeprefix("eval_")
    return not (name.startswith("loss") or name.startswith("perplexity"))


def parts_losses(parts) -> list[torch.Tensor]:
    """Each output's loss of ``forward_loss``'s parts, detached, on the CPU."""
    return [loss.detach().double().cpu() for loss, _, _ in parts]


def counted(target: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    """The targets a class loss counts: not ``ignore_index``, not negative."""
    keep = target >= 0
    return keep & target.ne(ignore_index) if ignore_index is not None else keep


def hits(output: torch.Tensor, target: torch.Tensor, class_dim: int, k: int = 1):
    """How many targets are among ``output``'s ``k`` largest on
    ``class_dim``, and how many count (targets >= 0)."""
    keep = counted(target, None)
    if k == 1:
        right = output.argmax(class_dim).eq(target)
    else:
        top = output.topk(k, dim=class_dim).indices
        right = top.eq(target.unsqueeze(class_dim)).any(class_dim)
    return (right & keep).sum(), keep.sum()


class Tally:
    """The sums of an evaluation: the loss, each output's, and each
    metric's counts, over batches (``add``); ``results`` names the means."""

    def __init__(self, training, device="cpu") -> None:
        self.training = training
        self.outputs = len(training.loss_outputs)
        self.starts, at = [], 1 + self.outputs
        for metric in training.metrics:
            self.starts.append(at)
            at += metric.size
        self.sums = torch.zeros(at, dtype=torch.float64, device=device)

    def add_losses(self, loss: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """One batch's (or micro-batch's share of) loss and each output's."""
        device = self.sums.device
        self.sums[0] += loss.detach().double().to(device)
        for k, part in enumerate(parts[: self.outputs]):
            self.sums[1 + k] += part.detach().double().to(device)

    def add_outputs(self, parts) -> None:
        """Each metric's counts of one (micro-)batch's outputs and targets."""
        training, sums = self.training, self.sums
        n = len(training.inputs)
        for metric, at in zip(training.metrics, self.starts):
            if metric.op == "perplexity":
                continue
            _, output, target = parts[metric.loss]
            target = target.to(output.device)
            if metric.function is not None:
                value = metric.function(output.detach(), target)
                sums[at] += float(value)
                sums[at + 1] += 1
                continue
            class_dim = training.class_dims[metric.loss]
            ranges = training.classes[n + metric.loss] if training.classes else None
            ignored = ranges[1] if ranges else None
            keep = counted(target, ignored)
            if metric.op == "f1":
                c = metric.classes
                predicted = output.argmax(class_dim)[keep]
                actual = target[keep]
                right = actual[predicted.eq(actual)]
                found = [right, predicted, actual]
                for j, values in enumerate(found):
                    counts = torch.bincount(values.flatten(), minlength=c)[:c]
                    sums[at + j * c : at + (j + 1) * c] += counts.double().to(
                        sums.device
                    )
                continue
            right, seen = hits(
                output, target.masked_fill(~keep, -1), class_dim, metric.k
            )
            sums[at] += right.double().to(sums.device)
            sums[at + 1] += seen.double().to(sums.device)

    def results(self, batches: int, replicas: int = 1) -> dict[str, float]:
        """``eval_<name>`` -> value: the losses' means over ``batches`` (each
        summed over ``replicas``), each metric's value."""
        sums = self.sums.cpu().tolist()
        means = [s / batches / replicas for s in sums[: 1 + self.outputs]]
        found = {"eval_loss": means[0]}
        if self.outputs > 1:  # each output's, beside the loss they sum to
            names = self.training.loss_outputs
            found |= {f"eval_loss_{name}": mean for name, mean in zip(names, means[1:])}
        for metric, at in zip(self.training.metrics, self.starts):
            found[f"eval_{metric.name}"] = self.value(metric, sums, at, means)
        return found

    def value(self, metric: Metric, sums: list, at: int, means: list) -> float:
        """``metric``'s value from its sums (from ``at``) and the losses' means."""
        if metric.op == "perplexity":
            loss = means[1 + metric.loss] if self.outputs > 1 else means[0]
            return math.exp(min(loss, 700.0))  # past e**700: inf in a float
        if metric.op == "f1":
            c = metric.classes
            right, predicted, actual = (
                sums[at + j * c : at + (j + 1) * c] for j in range(3)
            )
            scores = [
                2 * r / (p + a) for r, p, a in zip(right, predicted, actual) if p + a
            ]
            return sum(scores) / len(scores) if scores else 0.0
        return sums[at] / max(sums[at + 1], 1)
