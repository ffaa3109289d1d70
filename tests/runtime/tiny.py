"""A small model and its Training, as a generated train_<name>.py states one,
for the runtime's tests in process (no spec, no build)."""

from __future__ import annotations

import torch
from torch import nn

from mpgen.runtime import Metric, Stages, Training
from mpgen.runtime.pipeline import pick


class Tiny(nn.Module):
    """x [batch, 4] -> a Linear to 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(x)))


def make_batch(batch_size: int) -> tuple[tuple, tuple]:
    x = torch.randn((batch_size, 4))
    return (x,), ((x[:, :3].argmax(1)),)  # the class is the largest of the first 3


def forward_loss(model, loss_fns, inputs, targets):
    out = model(*inputs)
    loss = loss_fns[0](out, targets[0])
    return loss, ((loss, out, targets[0]),)


def optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def training(**changes) -> Training:
    fields = dict(
        model=Tiny,
        spec="tiny.yaml",
        devices=("cpu",),
        inputs=("x",),
        targets=("target",),
        batch_dims=(0, 0),
        make_batch=make_batch,
        losses=lambda *settings: (nn.CrossEntropyLoss(),),
        forward_loss=forward_loss,
        loss_outputs=("head",),
        class_dims=(1,),
        metrics=(Metric("accuracy", "accuracy"),),
        optimizer=optimizer,
        defaults={"steps": 6, "batch_size": 4, "lr": 0.1, "samples": 64},
    )
    return Training(**(fields | changes))


TRAINING = training()


class Front(nn.Module):
    """Stage 0 of Tiny: hidden (its keys are Tiny's)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.relu(self.hidden(x)),)


class Back(nn.Module):
    """Stage 1 of Tiny: head."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.head(h),)


def stage_loss(outputs, index, targets, loss_fns, microbatches):
    out = outputs[0] if isinstance(outputs, tuple) else outputs
    target = pick(targets[0], 0, index)
    loss = loss_fns[0](out, target)
    return loss, ((loss, out, target),)


STAGES = Stages(training=TRAINING, stages=(Front, Back), devices=("cuda:0", "cuda:1"),
                loss=stage_loss)
