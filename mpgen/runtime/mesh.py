"""The ranks of a pipeline run: R ranks per replica of the pipeline times
--dp replicas, as a 2-D DeviceMesh with dimensions ``pp`` and ``dp``.

# NOTE: [Pipeline mesh]
# Global rank = p * dp + r for pipeline rank p (which stages it holds) and
# replica r, as torchtitan orders its mesh (pp outermost): a stage's
# replicas are neighbouring ranks, on one node when dp divides the GPUs per
# node, so the gradient reduction of data parallelism stays inside a node
# and only the pipeline's point-to-point sends cross nodes. Every group is
# made here with --timeout, in one order on every rank (new_group's rule):
# the dp groups, the pp groups, then the tie groups (one per tie and
# replica). The schedule's sends use the replica's pp group, the gradient
# reduction (DDP or FSDP2's fully_shard) the stage's dp group, the loss and
# the stop flag one all_reduce over the world.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta
from os import environ

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .spec import Stages

#: Schedules whose ranks each hold several stages, in a loop (stage k on
#: rank k % R) or in a V (stages r and 2R - 1 - r on rank r).
LOOPED = ("interleaved", "looped-bfs", "interleaved-zb")
V_SHAPED = ("zbv", "dualpipev")
#: Schedules that split a stage's backward into its input's and its weights'
#: gradients (torch.autograd.grad; NOTE [DDP and a split backward]).
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")


def stop(message: str) -> None:
    """Exit with ``message``, printed once (by rank 0) however many ranks stop."""
    sys.exit(message if environ.get("RANK", "0") == "0" else 1)


def stage_ranks(stages: Stages, schedule: str) -> list[int]:
    """The pipeline rank of each stage: stage k on rank k; for a looped
    schedule, the ranks take turns along a layout that visits its devices in
    a repeating order; for a V schedule, rank r holds stages r and 2R - 1 - r."""
    count, name = len(stages.stages), stages.training.name
    if schedule in V_SHAPED:
        if count % 2:
            stop(
                f"--schedule {schedule} holds two stages per rank in a V (stages r and {count} - 1 - r "
                f"on rank r), so it needs an even number of stages; {name} has {count}: use --schedule gpipe or 1f1b"
            )
        return [min(k, count - 1 - k) for k in range(count)]
    if schedule not in LOOPED:
        return list(range(count))
    devices = tuple(dict.fromkeys(stages.devices))
    turns = len(stages.devices) // len(devices)
    if turns < 2 or stages.devices != devices * turns:
        stop(
            f"--schedule {schedule} needs a layout that visits its devices in a repeating order at least twice "
            f"(cuda:0, cuda:1, cuda:0, cuda:1), so that each rank holds two stages or more; {name}'s "
            f"stages are on {', '.join(stages.devices)}: use --schedule gpipe or 1f1b"
        )
    return [k % len(devices) for k in range(count)]


@dataclass
class Mesh:
    """This rank's place: its replica and pipeline rank, the groups it uses,
    and the stages it holds (NOTE [Pipeline mesh])."""

    ranks: list[int]  # the pipeline rank of each stage
    dp: int
    rank: int
    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tie_groups: dict  # (tie index, replica) -> group (None: one rank holds the copies)

    @property
    def pp(self) -> int:
        """Ranks per replica."""
        return max(self.ranks) + 1

    @property
    def replica(self) -> int:
        return self.rank % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def mine(self) -> list[int]:
        """The stages this rank holds, in order."""
        return [k for k, p in enumerate(self.ranks) if p == self.pp_rank]

    def of(self, pp_rank: int, replica: int | None = None) -> int:
        """The global rank of ``pp_rank`` in ``replica`` (default: this one)."""
        return pp_rank * self.dp + (self.replica if replica is None else replica)

    def where(self) -> str:
        """This rank, as messages name it."""
        stages = ", ".join(map(str, self.mine))
        return f"rank {self.rank} (stage{'s' * (len(self.mine) > 1)} {stages}, replica {self.replica})"


def average(tensors, group, dp: int) -> None:
    """Each of ``tensors`` becomes, in place, its mean over the ``dp``
    replicas of ``group``: one all_reduce per dtype, of them all flattened."""
    kinds: dict = {}
    for t in tensors:
        kinds.setdefault(t.dtype, []).append(t)
    for same in kinds.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        flat /= dp
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))


def make(
    stages: Stages, ranks: list[int], dp: int, device_type: str, timeout: float
) -> Mesh:
    """The groups of every dimension, made in one order on every rank."""
    pp, rank = max(ranks) + 1, dist.get_rank()
    wait = timedelta(seconds=timeout)
    grid = torch.arange(pp * dp).view(pp, dp)
    groups = {}
    for p in range(pp):  # the replicas of each pipeline rank
        groups["dp", p] = dist.new_group(grid[p].tolist(), timeout=wait)
    for r in range(dp):  # each replica's pipeline
        groups["pp", r] = dist.new_group(grid[:, r].tolist(), timeout=wait)
    p, r = divmod(rank, dp)
    pp_group, dp_group = groups["pp", r], groups["dp", p]
    mesh = DeviceMesh.from_group(
        [pp_group, dp_group], device_type, mesh=grid, mesh_dim_names=("pp", "dp")
    )
    ties = {}
    for t, tie in enumerate(stages.ties):
        for replica in range(dp):
            holders = sorted({ranks[k] * dp + replica for k, _ in tie})
            ties[t, replica] = (
                dist.new_group(holders, timeout=wait) if len(holders) > 1 else None
            )
    return Mesh(ranks, dp, rank, mesh, pp_group, dp_group, ties)


def tied_apart(state: dict, ties: tuple) -> str | None:
    """Why the tied copies in a state dict of the whole model are not one
    parameter: the first whose tensors differ, by their keys and the largest
    difference (None: every copy equals its owner)."""
    for tie in ties:
        (_, owner), *copies = tie
        for _, key in copies:
            a, b = state.get(owner), state.get(key)
            if a is None or b is None:
                continue  # not there: the keys' own check names it
            if a.shape != b.shape:
                return f"the tied copies {owner} {list(a.shape)} and {key} {list(b.shape)} differ in shape"
            if not torch.equal(a, b):
                gap = (a.double() - b.double()).abs().nan_to_num(0.0).max().item()
                if gap > 0 or not torch.equal(a.isnan(), b.isnan()):
                    return (
                        f"the tied copies {owner} and {key} differ (by up to {gap:.3g})"
                    )
    return None
