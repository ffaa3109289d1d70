"""BatchNorm in a pipeline of replicas (``pp_<name>.py``): the statistics
synchronised over the replicas (--sync-bn), or the running statistics
made one again after each step.

# NOTE: [BatchNorm under data parallelism]
# A BatchNorm in training mode normalises by its input's statistics and
# updates its running statistics from them. In pp_<name>.py its input is
# one micro-batch of one replica: a replica's part of the batch, split M
# ways. So, per step and replica, the layer runs M times: it normalises
# each micro-batch by that micro-batch's statistics, its running stats
# move M times (num_batches_tracked counts micro-batches: M x --accumulate
# per step, where the single-process script counts --accumulate), and
# each replica would keep stats of its own samples only.
#   --sync-bn   (pipeline: {sync_bn: true}) every BatchNorm of the stages
#               becomes SyncedBatchNorm: the mean and variance of a
#               micro-batch are those of the same micro-batch of every
#               replica together (all_reduce over the dp group; their
#               gradient too), so with one micro-batch (--microbatches 1,
#               gpipe) the losses, weights and running stats are the
#               single-process script's. torch.nn.SyncBatchNorm would do
#               the same but refuses tensors on the CPU (and its
#               batch_norm_gather_stats kernels are the GPU's), so this one
#               runs wherever gloo or NCCL does, on both.
#   otherwise   each replica normalises by its own micro-batches, and after
#               every optimizer step each running mean and variance becomes
#               its mean over the replicas (one all_reduce; DDP's buffer
#               broadcast is off), so every replica and the checkpoint hold
#               the same running stats, whichever replica's copy DCP writes.
# Either way num_batches_tracked counts micro-batches, equal on every
# replica; the checkpoint holds that, and --merge writes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .mesh import average


def batch_norms(modules) -> list[_BatchNorm]:
    """Every BatchNorm (1d, 2d, 3d, synced) of ``modules``, in order."""
    return [
        m for module in modules for m in module.modules() if isinstance(m, _BatchNorm)
    ]


class SyncedBatchNorm(_BatchNorm):
    """A BatchNorm whose training statistics are those of its input on every
    rank of ``group`` together (NOTE [BatchNorm under data parallelism]);
    in eval mode, or alone in its group, it is the BatchNorm it replaced.
    Its parameters and buffers are the replaced layer's (same keys)."""

    group: dist.ProcessGroup | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        alone = self.group is None or dist.get_world_size(self.group) == 1
        if not self.training or alone:
            return super().forward(input)
        given = input.dtype  # half precision: statistics in float32, as cuDNN's
        if given in (torch.float16, torch.bfloat16):
            input = input.float()
        dims = [d for d in range(input.dim()) if d != 1]
        shape = [1, -1] + [1] * (input.dim() - 2)
        # every replica's values per channel (their micro-batches are equal)
        total = input.numel() // input.shape[1] * dist.get_world_size(self.group)
        # Two passes, as BatchNorm does: the mean, then the variance around it.
        mean = dist_fn.all_reduce(input.sum(dims), group=self.group) / total
        centred = input - mean.view(shape)
        squares = dist_fn.all_reduce(centred.square().sum(dims), group=self.group)
        var = squares / total
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (
                    1.0 / self.num_batches_tracked.item()
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * (total / max(total - 1, 1))
                self.running_mean.lerp_(mean.detach(), factor)
                self.running_var.lerp_(unbiased.detach(), factor)
        return out.to(given)

    @classmethod
    def convert(cls, module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        """``module`` with every BatchNorm in it replaced by one synced over
        ``group`` that holds the same parameters and buffers."""
        found = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            found = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
            )
            found.group = group
            own = [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]
            for name, tensor in own:
                setattr(found, name, tensor)
            found.train(module.training)
        for name, child in module.named_children():
            found.add_module(name, cls.convert(child, group))
        return found


def average_running_stats(norms: list[_BatchNorm], group, dp: int) -> None:
    """Each running mean and variance becomes its mean over the ``dp``
    replicas of ``group``."""
    stats = [
        s
        for norm in norms
        for s in (norm.running_mean, norm.running_var)
        if s is not None
    ]
    average(stats, group, dp)
