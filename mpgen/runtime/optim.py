"""The parameter groups and the learning-rate schedules a spec's
``train:`` names (``no_decay:``, ``schedule:``)."""

from __future__ import annotations

import math

from torch import nn

#: ``no_decay: [norms]``: every normalization layer with parameters.
NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.SyncBatchNorm)
NORMS += (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
NORMS += (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def exempt(name: str, module: nn.Module, no_decay: tuple[str, ...]) -> bool:
    """Whether ``no_decay`` (of biases, norms, embeddings) exempts a parameter."""
    return (
        ("biases" in no_decay and name.endswith("bias"))
        or ("norms" in no_decay and isinstance(module, NORMS))
        or ("embeddings" in no_decay and isinstance(module, EMBEDDINGS))
    )


def param_groups(
    model: nn.Module, weight_decay: float, no_decay: tuple[str, ...]
) -> list[dict]:
    """The parameters in two groups, as nanoGPT does: weight decay on
    weights; none on those ``no_decay`` names (biases, norms, embeddings)."""
    decay, exempted, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue  # a tied parameter is in one group
            seen.add(id(param))
            (exempted if exempt(name, module, no_decay) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": exempted, "weight_decay": 0.0},
    ]


def lr_factor(step: int, steps: int, warmup: int, floor: float, decay: str) -> float:
    """The learning rate after ``step`` optimizer steps, as a fraction of
    --lr: linear warmup over ``warmup`` steps, then ``decay`` (cosine or
    linear to ``floor`` at ``steps``, or constant)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "constant":
        return 1.0
    progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
    if decay == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
