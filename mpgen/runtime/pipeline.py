"""The pipeline mode of the loop (``pp_<name>.py``): each rank builds only
its stages of the model and trains them with torch.distributed.pipelining
under torchrun (gloo on the CPU, NCCL on GPUs), --dp replicas of the
pipeline on a 2-D mesh (mesh.py), through loop.run like the single-process
script.

# NOTE: [Micro-batch losses]
# A step is --accumulate batches of --batch-size; each replica takes 1/dp of
# every batch and splits it into M equal micro-batches (a stage receives
# into buffers shaped by the first, so they must be equal). The schedules
# run with scale_grads=False and the stage loss is divided here, so that
# the gradients, summed over micro-batches and batches and averaged over
# the replicas by DDP or FSDP, are the single-process script's:
#   a mean loss        each micro-batch's mean / (M * K)
#   a summed loss      its sum * M * dp (the stage loss multiplies by its
#                      ``microbatches``, given M * dp) / (M * K)
#   a mean over        its sum / (N / (M * dp)) / (M * K), N the targets the
#   counted targets    loss counts in the whole batch (not ignore_index; by
#                      class weight), summed over the replicas before the
#                      batch runs (TokenMean): padding in one micro-batch
#                      weighs what it weighs in the whole batch.
# The log's loss is the sum of those values over the replicas, over dp:
# the mean of the K batches' losses, as the single-process script logs.
# A batch-coupled layer (BatchNorm) still sees micro-batches, and differs
# (NOTE [BatchNorm under data parallelism] in batchnorm.py).

# NOTE: [DDP and a split backward]
# The zero-bubble schedules (interleaved-zb, zbv, dualpipev) split a
# stage's backward into the input's gradient and the weights', computed by
# torch.autograd.grad and written into .grad by the stage, so DDP's
# reducer, which waits for autograd's AccumulateGrad hooks, never sees most
# of them (torch 2.13's stage still arms it for some full backwards: a
# reduction of part of the gradients). Under those schedules --dp-mode ddp
# leaves the stage modules unwrapped, and step() does DDP's reduction by
# hand after the last micro-batch: every gradient's mean over the dp group,
# once (average_gradients). The replicas start equal as under DDP (one
# seed, --init or the checkpoint, identical on every replica); buffers are
# not broadcast (a BatchNorm's running stats: NOTE [BatchNorm under data
# parallelism]).
"""

from __future__ import annotations

import inspect
import itertools
import json
import pathlib
import sys
import warnings
from datetime import timedelta
from os import environ

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from . import (
    batchnorm,
    checkpoint,
    flags,
    launch,
    mesh,
    normalise,
    settings,
    sharded,
    threads,
    timeline,
    trackers,
)
from .data import (
    batches,
    epoch_batches,
    no_evaluation,
    one_line,
    share,
    split_data,
    training_data,
)
from .loop import autocast, last_step, run, tokens_per_sample
from .metrics import Tally
from .mesh import stop
from .monitor import choose, decode, encode
from .spec import Stages

#: A checkpoint's optimizer state: flat, keyed by the parameters' state-dict
#: keys, so the stages' parts merge into one dict (NOTE [Coordinated checkpoints]).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Elsewhere(nn.Module):
    """An instance of a repeated layer that another stage holds: no parameters,
    so a stage's instances keep their indices (and state-dict keys)."""

    def forward(self, *args) -> None:
        raise RuntimeError("this instance is held by another stage")


def pick(target: torch.Tensor | None, dim: int | None, index: torch.Tensor):
    """The samples ``index`` of a step's target (no batch dim: all of it)."""
    if target is None or dim is None:
        return target
    return target.index_select(dim, index.to(target.device))


def sendable(dtypes: tuple) -> object:
    """A forward hook that makes a stage's outputs sendable: contiguous (as gloo
    and NCCL need), copied when passed on as received (its receive buffer takes
    the next micro-batch), in the dtypes the next stage receives (not autocast's);
    a view is copied too: the split backward of the zero-bubble schedules
    detaches a stage's outputs in place, which a view refuses (a Linear over
    [batch, seq, d] returns one)."""

    def hook(module: nn.Module, inputs: tuple, outputs: tuple) -> tuple:
        return tuple(
            (
                x.clone(memory_format=torch.contiguous_format)
                if any(x is i for i in inputs) or x._base is not None
                else x.contiguous()
            ).to(dtype)
            for x, dtype in zip(outputs, dtypes)
        )

    return hook


def examples(stages: Stages, shapes: list, microbatches: int) -> list[tuple]:
    """Each stage's inputs and outputs for one micro-batch, from the stages run
    on the meta device (no memory, no RNG): PipelineStage's inference from the
    first micro-batch loses its tensors that need no gradient (token ids)."""
    inputs = tuple(
        torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes
    )
    inputs = tuple(
        x if d is None else x.tensor_split(microbatches, d)[0]
        for x, d in zip(inputs, stages.input_dims)
    )
    found = []
    for k, stage in enumerate(stages.stages):
        with torch.device("meta"):
            module = stage()
        if (
            k
        ):  # received: a gradient goes back exactly for what needed one where it was sent from
            inputs = tuple(
                x.detach().contiguous().requires_grad_(x.requires_grad) for x in inputs
            )
        outputs = tuple(
            x.contiguous() for x in module(*inputs)
        )  # as sendable() sends them
        found.append((inputs, outputs))
        inputs = outputs
    return found


def tie_groups(stages: Stages, grid: mesh.Mesh) -> list[tuple]:
    """For each tie: the process group of this replica's ranks holding its
    copies (None: one rank holds them all), the owner's rank, this rank's copies."""
    groups = []
    for t, tie in enumerate(stages.ties):
        group, owner = grid.tie_groups[t, grid.replica], grid.of(grid.ranks[tie[0][0]])
        groups.append((group, owner, [(k, key) for k, key in tie if k in grid.mine]))
    return groups


def follow_owners(groups: list, modules: dict, optimizers: dict, device) -> None:
    """Put every tied copy in its owner's weight-decay group (no_decay's two
    groups). In the model the copies are one parameter, grouped by the layer
    that owns it (the first to hold it: an embedding's weight is exempt under
    no_decay [embeddings]); a copy grouped by its own layer (a Linear head)
    would decay apart from the others."""
    for group, owner, copies in groups:
        if not copies:
            continue
        k, key = copies[0]  # the owner, where this rank holds it (it comes first)
        param = modules[k].get_parameter(key)
        exempt = torch.tensor(
            float(any(p is param for p in optimizers[k].param_groups[1]["params"])),
            device=device,
        )
        if group is not None:
            dist.broadcast(exempt, src=owner, group=group)
        for k, key in copies:
            param = modules[k].get_parameter(key)
            for kept in optimizers[k].param_groups:
                kept["params"] = [p for p in kept["params"] if p is not param]
            optimizers[k].param_groups[int(exempt.item())]["params"].append(param)


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor, or this rank's shard of a DTensor (FSDP's parameters and gradients)."""
    return t.to_local() if hasattr(t, "to_local") else t


def sync_ties(groups: list[tuple], modules: dict, gradients: bool) -> None:
    """Keep each tied parameter's copies equal, as Megatron does: at the start,
    the owner's value; after a backward, every copy's gradient becomes their
    sum (FSDP shards the copies alike, so each rank sums its shards)."""
    for group, owner, copies in groups:
        if not copies:
            continue
        params = [modules[k].get_parameter(key) for k, key in copies]
        with torch.no_grad():
            if gradients and not params[0].requires_grad:
                continue  # frozen (requires_grad: false): no gradient to sum
            if gradients:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                total = sum(local(p.grad) for p in params)
                if group is not None:
                    dist.all_reduce(total, group=group)
                for p in params:
                    local(p.grad).copy_(total)
            else:
                value = (
                    params[0].detach().clone()
                )  # the owner's, where this rank holds it
                if group is not None:
                    dist.broadcast(value, src=owner, group=group)
                for p in params:
                    p.copy_(value)


def average_gradients(modules, group, dp: int) -> None:
    """DDP's reduction done by hand, for the schedules that split the backward
    (NOTE [DDP and a split backward]): each gradient becomes its mean over
    the ``dp`` replicas."""
    grads = [
        p.grad for module in modules for p in module.parameters() if p.grad is not None
    ]
    mesh.average(grads, group, dp)


def grad_norm(stages: Stages, modules: dict, group, device) -> torch.Tensor:
    """The norm of one replica's gradients (each tied parameter counted once),
    as clip_grad_norm_ computes it on one model; ``group``: the ranks whose
    gradients make up a replica's (its pipeline, and with FSDP its shards)."""
    copies = {(k, key) for tie in stages.ties for k, key in tie[1:]}
    squares = torch.zeros((), device=device)
    for k, module in modules.items():
        for key, p in module.named_parameters():
            if p.grad is not None and (k, key) not in copies:
                squares += local(p.grad).detach().float().pow(2).sum()
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


class Pipelined:
    """This rank's stages of the model: a step is --accumulate runs of the
    schedule (forward and backward of every micro-batch of this replica's
    part of a batch), the tied copies' gradients summed, the norm of every
    gradient of a replica (clipped by --grad-clip), then each stage's
    optimizer's step; the loss, from the last stages, and whether any rank
    was interrupted go to every rank in one all_reduce."""

    agent_sigterm = True  # torchrun's agent sends SIGTERM twice (loop.Single)

    def __init__(self, stages: Stages, args, grid: mesh.Mesh, device) -> None:
        self.stages, self.args, self.grid, self.device = stages, args, grid, device
        training, count = stages.training, len(stages.stages)
        self.training, self.script = training, stages.script
        # The step's loss of each output on this rank (its last stage's, else
        # zeros), and the evaluation's sums while it runs (metrics.Tally).
        self.parts = torch.zeros(len(training.loss_outputs), device=device)
        self.tally = None
        self.mine = mine = grid.mine
        self.first, self.last_stage = 0 in mine, count - 1 in mine
        self.logs = dist.get_rank() == grid.of(grid.ranks[-1], 0)
        self.where = f"{args.checkpoint}/step_N"
        self.folder = f"runs/pp_{training.run}"
        self.devices = (str(device),) if device.type == "cuda" else ()
        self.samples_per_step = args.accumulate * args.batch_size
        self.part = args.batch_size // args.dp  # a replica's samples of a batch
        self.stopping = False
        self.rates, self.norm = {}, None  # the log's (start() fills the rates)
        self.resumed = None  # the checkpoint's step --resume found (None: start fresh)
        if args.resume:
            self.resumed = self.agree_on_checkpoint()
        self.modules = modules = {}
        for k in mine:
            torch.manual_seed(args.seed * 1_000_003 + k)  # a stage's own initialisation
            modules[k] = stages.stages[k]().to(device)
        if (
            args.init and self.resumed is None
        ):  # a checkpoint holds the weights to resume
            self.initialise(args.init)
        if args.sync_bn and args.dp > 1:  # NOTE [BatchNorm under data parallelism]
            for k in mine:
                modules[k] = batchnorm.SyncedBatchNorm.convert(
                    modules[k], grid.dp_group
                )
        self.norms = batchnorm.batch_norms(modules.values())
        if (
            self.norms
            and grid.replica == 0
            and (args.microbatches > 1 or (args.dp > 1 and not args.sync_bn))
        ):  # the build's note, again where the run is read
            where = (
                "over every replica's"
                if args.sync_bn and args.dp > 1
                else "on its replica"
            )
            print(
                f"{grid.where()}: {len(self.norms)} BatchNorm layer(s) normalise each of "
                f"{args.microbatches} micro-batches by its own statistics {where}, where "
                f"{stages.training.name}'s single-process script uses the whole batch's "
                "(docs/pipelining.md, BatchNorm)"
            )
        self.groups = tie_groups(stages, grid)
        sync_ties(self.groups, modules, gradients=False)
        self.wrapped = {k: self.replicate(module) for k, module in modules.items()}

        # The data: the first stage's ranks feed the inputs, the last stage's read the targets.
        self.feeds = self.first or self.last_stage
        per_epoch, self.eval_data = [None], None
        if self.feeds:
            self.data = training_data(training, args)
            if args.eval_data or args.eval_split or args.eval_every:
                self.data, self.eval_data = split_data(
                    training, args, flags.parser(training, stages), self.data
                )
            per_epoch = [epoch_batches(self.data, args.batch_size) // args.accumulate]
        dist.broadcast_object_list(per_epoch, src=grid.of(0, 0))
        self.per_epoch = per_epoch[0]
        if self.per_epoch == 0:
            stop(
                f"one optimizer step needs {self.samples_per_step} samples, more than one pass over "
                "the data gives; lower --batch-size or --accumulate"
            )
        self.last = last_step(args, self.per_epoch)

        self.optimizers, self.schedulers = {}, {}
        # ReduceLROnPlateau would be stepped with a loss every rank would need.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        for k, module in modules.items():
            if not trains(module):  # a stage of activations only: nothing to step
                continue
            optimizer = training.optimizer(module, args)
            scheduler = None
            if training.scheduler is not None:
                scheduler = training.scheduler(optimizer, args, self.last)
            self.optimizers[k] = optimizer
            self.schedulers[k] = None if isinstance(scheduler, plateau) else scheduler
        # The lr the log shows, where this rank's stages have no parameters:
        # the schedule's, on an optimizer of its own.
        self.clock = None
        if not self.optimizers:
            dummy = [nn.Parameter(torch.zeros(()))]
            clock = torch.optim.SGD(dummy, lr=args.lr)
            made = (
                training.scheduler(clock, args, self.last)
                if training.scheduler
                else None
            )
            self.clock = (clock, None if isinstance(made, plateau) else made)
        counts = {len(o.param_groups) for o in self.optimizers.values()}
        if stages.ties and counts == {2}:  # no_decay's (optim.param_groups)
            follow_owners(self.groups, modules, self.optimizers, device)
        self.loss_fns = tuple(
            normalise.TokenMean(fn) if normalise.TokenMean.applies(fn) else fn
            for fn in training.losses(args.settings)
        )
        self.normalises = any(
            isinstance(fn, normalise.TokenMean) for fn in self.loss_fns
        )
        # The batch's targets, on this device: the stage loss picks each micro-batch's.
        self.current = [()]
        # The ranks whose gradients make up one replica's: its pipeline; FSDP shards them.
        self.norm_group = (
            None if args.dp_mode == "fsdp" and args.dp > 1 else grid.pp_group
        )

    def agree_on_checkpoint(self) -> int | None:
        """The step of the newest complete checkpoint, the same on every rank
        (None: none; --resume then starts fresh)."""
        args = self.args
        found = sharded.complete(args.checkpoint)
        newest = torch.tensor([found[-1] if found else -1], dtype=torch.float64)
        low, high = newest.clone(), newest.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low.item() != high.item():
            stop(
                f"--resume: the ranks see different checkpoints in {args.checkpoint} (steps "
                f"{int(low.item())} and {int(high.item())}; -1: none): --checkpoint needs a folder every node shares"
            )
        if high.item() < 0:
            if any(pathlib.Path(args.checkpoint).glob("stage_*.pt")):
                stop(
                    f"--resume: {args.checkpoint} holds stage_K.pt files of an older pp_<name>.py, "
                    "which this one does not read: write one state dict with that program's --merge, "
                    "then start from it with --init"
                )
            if dist.get_rank() == 0:
                print(
                    f"--resume: no complete checkpoint in {args.checkpoint}; starting at step 0"
                )
            return None
        return int(high.item())

    def replicate(self, module: nn.Module) -> nn.Module:
        """A stage's module as the schedule runs it: itself with one replica
        (or no parameters); else synchronising its gradients over its
        replicas (--dp-mode)."""
        if self.args.dp == 1 or not trains(module):
            return module
        if self.args.dp_mode == "ddp" and self.args.schedule in mesh.SPLIT_BACKWARD:
            return module  # its gradients are averaged by step() (NOTE [DDP and a split backward])
        if self.args.dp_mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device] if self.device.type == "cuda" else None
            # No buffer broadcast: BatchNorm's running stats are averaged after each step.
            return DistributedDataParallel(
                module,
                device_ids=ids,
                process_group=self.grid.dp_group,
                broadcast_buffers=False,
            )
        from torch.distributed.fsdp import fully_shard

        # A stage's outputs are sent (copied, sendable()) or go to the loss, never changed in place.
        warnings.filterwarnings(
            "ignore", "FSDP2-wrapped module .* returned a view tensor"
        )
        # The pipeline runs each micro-batch's forward apart: keep the
        # gathered parameters until the backward (torchtitan does the same).
        return fully_shard(
            module, mesh=self.grid.mesh["dp"], reshard_after_forward=False
        )

    def initialise(self, path: str) -> None:
        """--init: each stage's keys from a state dict of the whole model."""
        with torch.device("meta"):
            keys = [key for stage in self.stages.stages for key in stage().state_dict()]
        try:
            modules, training = list(self.modules.values()), self.stages.training
            checkpoint.initialise(modules, path, list(dict.fromkeys(keys)), training)
        except ValueError as error:
            stop(f"--init {path}: {error}")

    # -- checkpoints (NOTE [Coordinated checkpoints]) ---------------------------

    def state(self) -> tuple[dict, dict]:
        """What a checkpoint holds, keyed by the model's state-dict keys, and
        each stage's keys in it: of the model, of the optimizer's flattened
        state. One step counter for the whole checkpoint (written by every
        rank alike; DCP keeps one copy), whatever the stages."""
        model, optim, owned = {}, {}, {}
        for k in self.mine:
            if not self.modules[k].state_dict():  # activations only: nothing to save
                continue
            found = get_model_state_dict(self.wrapped[k])
            model.update(found)
            owned[k] = (list(found), [])
            if k not in self.optimizers:
                continue
            found = get_optimizer_state_dict(
                self.wrapped[k], self.optimizers[k], options=FLAT
            )
            optim.update(found)
            owned[k][1].extend(found)
        grid = self.grid
        layout = f"{len(self.stages.stages)} stages on pipeline ranks {grid.ranks} x {grid.dp} replicas"
        state = {"model": model, "optim": optim, "layout": layout, "step": 0}
        state["rng"] = {f"rank_{grid.rank}": checkpoint.rng_states()}
        return state, owned

    def resume(self) -> int:
        """Load the checkpoint agree_on_checkpoint found into this layout,
        whatever layout wrote it (NOTE [Coordinated checkpoints]): every rank
        reads the same metadata, checks it against its own keys, and enters
        the same collectives (one to agree on what differs, DCP's load)."""
        if self.resumed is None:
            return 0
        done, path = self.resumed, sharded.folder(self.args.checkpoint, self.resumed)
        # The schedule's lr at step done, before the optimizer's state (it keeps that lr).
        self.fast_forward(done)
        fresh = {k: settings.hyperparameters(o) for k, o in self.optimizers.items()}
        state, owned = self.state()
        try:  # the same file on every rank: every rank stops here, or none
            saved = sharded.keys(path)
            layout = self.layout_of(path) if "layout" in saved else ""
            record = self.monitored(path) if "monitor" in saved else None
            ran = self.ran_with(path) if "settings" in saved else None
        except Exception as error:  # a refused or damaged file
            stop(f"--resume: cannot read {path} ({one_line(error)})")
        # A tied copy's optimizer state, where the layout that wrote it held
        # the copy on its owner's stage (one parameter, one entry): the owner's.
        aliases = {}
        for key in state["optim"]:
            if f"optim.{key}" not in saved:
                found = [t for t in self.twins(key) if f"optim.{t}" in saved]
                if found:
                    aliases[key] = found[0]
        wrong = self.differences(saved, state, aliases)
        if wrong:
            stop(f"--resume: {path} does not match this model and optimizer: {wrong}")
        optim = state["optim"]
        state["optim"] = {k: v for k, v in optim.items() if k not in aliases}
        for key, twin in aliases.items():
            state["optim"].setdefault(twin, optim[key])
        # The RNG states go back only onto the layout that wrote them.
        same = layout == state["layout"] and f"rng.rank_{self.grid.rank}.torch" in saved
        if not same:
            del state["rng"]
        del state["layout"]
        if "step" not in saved:  # an older checkpoint: a step per stage, all alike
            state["step"] = {min(sharded.stage_steps(saved))[len("step.") :]: 0}
        try:
            sharded.load(path, state)
        except Exception as error:
            stop(f"--resume: cannot load {path} ({one_line(error)})")
        step = state["step"]
        step = step if isinstance(step, int) else next(iter(step.values()))
        if step != done:
            stop(f"--resume: {path} holds step {step}, not {done}; it is not whole")
        # DCP replaced the values that are not tensors, and filled the tensors in place.
        for key in optim:
            value = state["optim"][aliases.get(key, key)]
            if isinstance(optim[key], torch.Tensor) and optim[key] is not value:
                optim[key].copy_(value)
            else:
                optim[key] = value
        state["optim"] = optim
        for k, (model_keys, optim_keys) in owned.items():
            module = self.wrapped[k]
            set_model_state_dict(
                module, {key: state["model"][key] for key in model_keys}
            )
            if k in self.optimizers:
                mine = {key: state["optim"][key] for key in optim_keys}
                set_optimizer_state_dict(module, self.optimizers[k], mine, options=FLAT)
        if same:
            checkpoint.set_rng_states(state["rng"][f"rank_{self.grid.rank}"])
        for k, optimizer in self.optimizers.items():
            settings.reapply(optimizer, fresh[k], ran, self.args)
        afresh = self.monitor.restore(record)
        if self.logs:
            for line in settings.on_resume(ran, self.args):
                print(line)
            ignored = flags.NOT_INIT * bool(self.args.init)
            how = (
                ""
                if same
                else f" (resharded onto {self.grid.pp} x {self.grid.dp} ranks)"
            )
            print(f"resumed from {path} at step {done}{how}{ignored}{afresh}")
        return done

    def twins(self, key: str) -> list[str]:
        """A flattened optimizer key (``state.l4.weight.momentum_buffer``) for
        each other copy of its tied parameter (none where it is not tied)."""
        for names in self.stages.training.ties:  # the model's, whatever the stages
            for part in ("state.", "param_groups."):
                for name in names:
                    if key.startswith(f"{part}{name}."):
                        rest = key[len(f"{part}{name}") :]
                        return [f"{part}{n}{rest}" for n in names if n != name]
        return []

    def differences(self, saved: dict, state: dict, aliases: dict) -> str:
        """What keeps a checkpoint (``saved``: its keys' metadata) from
        loading into this layout, in one line ("" when nothing): keys it
        lacks (a tied copy's optimizer state may come from another copy's:
        ``aliases``), keys it holds that the model and optimizer do not,
        tensors of another shape, no step. A collective: every rank's keys
        and findings go to every rank, so all of them stop, or none."""
        missing, shapes = [], []
        for part in ("model", "optim"):
            for key, value in state[part].items():
                if part == "optim" and key in aliases:
                    key = aliases[key]
                meta = saved.get(f"{part}.{key}")
                if meta is None:
                    missing.append(f"{part}.{key}")
                elif isinstance(value, torch.Tensor) and hasattr(meta, "size"):
                    if tuple(meta.size) != tuple(value.shape):
                        there, here = (
                            "x".join(map(str, size)) or "scalar"
                            for size in (meta.size, value.shape)
                        )
                        shapes.append(f"{part}.{key} {there} there vs {here} here")
        if "step" not in saved and not sharded.stage_steps(saved):
            missing.append("step")
        mine = (missing, shapes, [f"optim.{key}" for key in state["optim"]])
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        missing = sorted({key for m, _, _ in found for key in m})
        shapes = sorted({s for _, s, _ in found for s in s})
        with torch.device("meta"):
            known = {
                f"model.{key}"
                for stage in self.stages.stages
                for key in stage().state_dict()
            }
        known.update(key for _, _, o in found for key in o)
        known.update(
            f"optim.{twin}"
            for _, _, o in found
            for key in o
            for twin in self.twins(key[6:])
        )
        unexpected = sorted(
            key
            for key in saved
            if key.startswith(("model.", "optim.")) and key not in known
        )
        wrong = [
            f"{len(keys)} {what} ({', '.join(keys[:4])}{', ...' * (len(keys) > 4)})"
            for what, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("of another shape", shapes),
            )
            if keys
        ]
        return "; ".join(wrong)

    def layout_of(self, path: pathlib.Path) -> str:
        """The layout that wrote a checkpoint (read by this rank alone: no
        collective, so a rank may call it whatever the others do)."""
        found = {"layout": ""}
        # no_dist: by this rank alone (load silences DCP's single-process warning)
        sharded.load(path, found, no_dist=True)
        return found["layout"]

    def fast_forward(self, done: int) -> None:
        """Step each learning-rate schedule ``done`` times (a schedule is a
        function of the step; its state is not in the checkpoint)."""
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # "lr_scheduler.step() before optimizer.step()"
            for scheduler in self.all_schedulers():
                for _ in range(done):
                    scheduler.step()

    def save(self, done: int, best: bool = False) -> None:
        """DIR/step_N, the --keep-last newest kept (and the best); ``best``:
        DIR/best links to it."""
        if not self.args.checkpoint:
            return
        self.check_ties(done)
        state, _ = self.state()
        state["step"] = done
        root, keep = self.args.checkpoint, self.args.keep_last
        record = self.monitor.state()
        earlier = [k for k in sharded.complete(root) if k < done]
        record["kept"] = [*earlier[len(earlier) - keep + 1 :], done]
        state["monitor"] = encode(record)
        state["settings"] = json.dumps(settings.record(self.args))  # and its --set
        try:
            sharded.save(root, done, state, keep=keep, best=best)
        except OSError as error:
            stop(f"step {done}: cannot write {self.args.checkpoint} ({error})")
        self.where = str(sharded.folder(self.args.checkpoint, done))

    best_is_step = True  # the best is a step_N folder DIR/best links to

    @property
    def best_where(self) -> str:
        step = self.monitor.best_step
        return f"{self.args.checkpoint}/{sharded.BEST} -> step_{step}"

    def agreed(self, results: dict) -> dict:
        """The evaluation's results as the logging rank has them, on every
        rank (a collective): each rank then elects the same best and stops
        at the same step."""
        found = [results]
        dist.broadcast_object_list(found, src=self.grid.of(self.grid.ranks[-1], 0))
        return found[0]

    def ran_with(self, path: pathlib.Path) -> dict | None:
        """The settings of the run that wrote a checkpoint, and its --set."""
        found = {"settings": ""}
        sharded.load(path, found, no_dist=True)
        return json.loads(found["settings"])

    def monitored(self, path: pathlib.Path) -> dict | None:
        """The monitor's record in a checkpoint (by this rank alone)."""
        found = {"monitor": ""}
        sharded.load(path, found, no_dist=True)
        return decode(found["monitor"])

    def check_ties(self, done: int) -> None:
        """Before a save: every tied copy equals its owner's, on every rank,
        and under DDP every replica's parameters are the same (else one line,
        and nothing saved; mesh.tied_apart at --merge)."""
        if self.args.dp > 1 and self.args.dp_mode == "ddp":
            self.check_replicas(done)
        ties = self.stages.ties
        if not ties:
            return
        apart = torch.zeros(len(ties), dtype=torch.float64, device=self.device)
        for t, (group, owner, copies) in enumerate(self.groups):
            if not copies:
                continue
            values = [
                local(self.modules[k].get_parameter(key)).detach() for k, key in copies
            ]
            first = values[0].clone()  # the owner's, where this rank holds it
            if group is not None:
                dist.broadcast(first, src=owner, group=group)
            for value in values:
                if value.numel():
                    gap = (value.double() - first.double()).abs().nan_to_num(0.0).max()
                    apart[t] = torch.maximum(apart[t], gap)
        dist.all_reduce(apart, op=dist.ReduceOp.MAX)
        for t, gap in enumerate(apart.tolist()):
            if gap > 0:
                keys = " and ".join(key for _, key in ties[t])
                stop(
                    f"step {done}: the tied copies {keys} differ (by up to {gap:.3g}); they are "
                    f"one parameter of {self.stages.training.name}, so nothing was saved"
                )

    def check_replicas(self, done: int) -> None:
        """Under DDP: each parameter's sum is the same on every replica (a
        reduction that missed some gradients lets replicas drift apart, and a
        checkpoint would keep one of them)."""
        keys = [
            (k, key) for k in self.mine for key, _ in self.modules[k].named_parameters()
        ]
        sums = torch.zeros(len(keys) + 1, dtype=torch.float64, device=self.device)
        for i, (k, key) in enumerate(keys, 1):
            sums[i] = self.modules[k].get_parameter(key).detach().double().sum()
        high, low = sums.clone(), sums
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.grid.dp_group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.grid.dp_group)
        gaps = (high - low).nan_to_num(0.0)
        first = next((i for i, gap in enumerate(gaps.tolist()) if gap > 0), None)
        found = [None] * dist.get_world_size()
        seen = None if first is None else (keys[first - 1][1], gaps[first].item())
        dist.all_gather_object(found, seen)
        seen = next((x for x in found if x is not None), None)
        if seen is not None:
            stop(
                f"step {done}: the --dp replicas' {seen[0]} differ (their sums by {seen[1]:.3g}); "
                "--dp-mode ddp did not keep them equal, so nothing was saved"
            )

    # -- the schedule -------------------------------------------------------------

    def start(self, done: int):
        """The batches from step ``done`` on (on the ranks that feed), and the schedule."""
        args, stages, grid = self.args, self.stages, self.grid
        training, n = stages.training, len(stages.training.inputs)
        shard = (grid.replica, grid.dp)
        first = done * args.accumulate
        stream = (
            batches(self.data, training, args, first, shard) if self.feeds else None
        )
        shapes = [None]  # the inputs' shapes, from the first batch, for every rank
        if dist.get_rank() == grid.of(0, 0):
            batch = next(stream)
            stream = itertools.chain([batch], stream)
            shapes = [[(tuple(x.shape), x.dtype) for x in batch[:n]]]
        dist.broadcast_object_list(shapes, src=grid.of(0, 0))
        m = args.microbatches
        found = examples(stages, shapes[0], m)
        self.outputs = found[-1][1]  # the last stage's, on the meta device
        count, pipeline = len(stages.stages), []
        for k in self.mine:
            given, made = found[k]
            if k < count - 1:
                self.modules[k].register_forward_hook(
                    sendable(tuple(x.dtype for x in made))
                )
            stage = PipelineStage(
                self.wrapped[k], k, count, self.device, given, made, group=grid.pp_group
            )
            pipeline.append(stage)
        schedule = getattr(pipelining, flags.SCHEDULES[args.schedule])
        chunks = [
            TensorChunkSpec(d) if d is not None else _Replicate()
            for d in stages.input_dims
        ]
        scale = m * args.accumulate

        def loss(outputs, index: torch.Tensor) -> torch.Tensor:
            given, parts = stages.loss(
                outputs, index, self.current[0], self.loss_fns, m * args.dp
            )
            each = [part.detach().float() for part, _, _ in parts]
            if self.tally is not None:  # evaluating: a batch's loss, each output's
                self.tally.add_losses(given.detach() / m, [x / m for x in each])
                self.tally.add_outputs(parts)
            elif each:
                self.parts += torch.stack(each) / scale
            return given / scale

        try:
            held = (
                pipeline
                if args.schedule in mesh.LOOPED + mesh.V_SHAPED
                else pipeline[0]
            )
            takes = inspect.signature(schedule).parameters
            split = (
                {"args_chunk_spec": tuple(chunks)} if "args_chunk_spec" in takes else {}
            )
            self.schedule = schedule(held, m, loss_fn=loss, scale_grads=False, **split)
            if not split:  # ScheduleLoopedBFS splits every input on dim 0 unless told
                self.schedule._args_chunk_spec = tuple(chunks)
        except (
            ValueError,
            AssertionError,
        ) as error:  # e.g. too few micro-batches for the layout
            stop(f"--schedule {args.schedule} --microbatches {m}: {one_line(error)}")
        self.busy = [0.0]  # this rank's seconds in its stages' forward and backward
        timeline.time_stages(pipeline, self.busy, self.device.type == "cuda")
        self.rates["flops"] = stages.flops
        peak = timeline.peak_flops(self.device)
        self.rates["peak"] = peak * dist.get_world_size() if peak else None
        example = [
            torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes[0]
        ]
        tokens = tokens_per_sample(training, example)
        self.rates["tokens"] = tokens
        predicted, why = timeline.prediction(
            args.schedule,
            getattr(self.schedule, "pipeline_order", None),
            grid.ranks,
            stages.costs,
            stages.transfers,
            self.part / m,
            m,
        )
        self.rates["schedule"] = f"--schedule {args.schedule} with {m} micro-batches"
        self.rates["source"] = timeline.source(stages.measured_on, self.device)
        self.rates["busy"] = timeline.predicted_busy(
            stages.costs, grid.ranks, self.part * args.accumulate
        )
        if predicted is not None:
            self.rates["predicted"] = predicted[1]
        else:
            self.rates["unpredicted"] = why
        if self.logs:
            replicas = f" x {args.dp} replicas ({args.dp_mode})" if args.dp > 1 else ""
            micro = f"{args.accumulate} batches of " if args.accumulate > 1 else ""
            print(
                f"{training.name}: {count} stages on {grid.pp} ranks{replicas}, --schedule {args.schedule}; "
                f"{self.last} steps of {micro}{args.batch_size} samples, {self.part} per replica "
                f"in {m} micro-batches"
                if args.dp > 1
                else f"{training.name}: {count} stages on {grid.pp} ranks, --schedule {args.schedule}; "
                f"{self.last} steps of {micro}{args.batch_size} samples in {m} micro-batches"
            )
            if args.overrides:
                print(f"overrides: {' '.join(args.overrides)}")
        return stream

    def normalise(self, targets: tuple) -> None:
        """Before a batch: each TokenMean's share of the whole batch's count."""
        group = self.grid.dp_group if self.args.dp > 1 else None
        normalise.shares(
            self.stages.loss,
            self.outputs,
            targets,
            self.loss_fns,
            self.part,
            self.args.microbatches,
            self.args.dp,
            group,
            self.device,
        )

    def run_batch(self, stream, losses: list, backward: bool = True) -> None:
        """One batch through the schedule (forward only: evaluation)."""
        args, device = self.args, self.device
        n = len(self.stages.training.inputs)
        batch = next(stream) if stream is not None else ()
        inputs = tuple(x.to(device) for x in batch[:n]) if self.first else ()
        target = None
        if self.last_stage:
            self.current[0] = tuple(x if x is None else x.to(device) for x in batch[n:])
            target = torch.arange(self.part, device=device)
            if self.normalises:
                self.normalise(self.current[0])
        with autocast(device.type, args.amp):
            run = self.schedule.step if backward else self.schedule.eval
            kwargs = {"return_outputs": False} if backward else {}
            run(*inputs, target=target, losses=losses, **kwargs)

    def step(self, stream) -> torch.Tensor:
        args, device = self.args, self.device
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        self.parts.zero_()
        total = torch.zeros((), device=device)
        for _ in range(args.accumulate):
            losses = []
            self.run_batch(stream, losses)
            if losses:
                total += torch.stack([x.detach().float() for x in losses]).sum()
        if (
            args.dp > 1
            and args.dp_mode == "ddp"
            and args.schedule in mesh.SPLIT_BACKWARD
        ):
            average_gradients(self.modules.values(), self.grid.dp_group, args.dp)
        sync_ties(self.groups, self.modules, gradients=True)
        self.norm = grad_norm(self.stages, self.modules, self.norm_group, device)
        if args.grad_clip:
            scale = (args.grad_clip / (self.norm + 1e-6)).clamp(max=1.0).item()
            for module in self.modules.values():
                for p in module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        for optimizer in self.optimizers.values():
            optimizer.step()
        if self.norms and args.dp > 1 and not args.sync_bn:
            batchnorm.average_running_stats(self.norms, self.grid.dp_group, args.dp)
        # The loss (the last stages' sum over the replicas) and the stop flag, in one all_reduce.
        word = torch.stack(
            [total / args.dp, torch.tensor(float(bool(self.signals)), device=device)]
        )
        dist.all_reduce(word)
        self.stopping = bool(word[1].item())
        return word[0]

    def evaluate(self, data) -> dict[str, float]:
        """The evaluation over the evaluation data's whole batches (each
        replica its part), forward only, by its log column (as loop.evaluate):
        the last stages sum the losses and the metrics' counts (a Tally),
        then every rank's sums add up in one all_reduce."""
        args = self.args
        count = [None]
        if self.feeds:
            full = [b for b in data if len(b) and self.whole(b)]
            count = [len(full)]
            stream = iter(
                share(b, self.stages.training, self.grid.replica, args.dp) for b in full
            )
        else:
            stream = None
        dist.broadcast_object_list(count, src=self.grid.of(0, 0))
        if not count[0]:
            stop(f"the evaluation data gives no whole batch of {args.batch_size}")
        self.tally = tally = Tally(self.training, self.device)
        for module in self.modules.values():
            module.eval()
        try:
            with torch.no_grad():
                for _ in range(count[0]):
                    self.run_batch(stream, [], backward=False)
        finally:
            self.tally = None
        for module in self.modules.values():
            module.train()
        dist.all_reduce(tally.sums)
        return tally.results(count[0], args.dp)

    def whole(self, batch) -> bool:
        """Whether an evaluation batch has --batch-size samples."""
        from .data import as_batch

        batch = as_batch(batch, self.stages.training.keys)
        dims = self.stages.training.batch_dims
        return all(
            x is None or d is None or x.shape[d] == self.args.batch_size
            for x, d in zip(batch, dims)
        )

    def interrupted(self, signals: list) -> bool:
        return self.stopping

    def metrics(self) -> dict:
        """The shown step's gradient norm, each pipeline rank's busy seconds
        since the last shown step (replica 0's) and each rank's peak memory
        on a GPU: one all_reduce, on every rank."""
        grid, cuda = self.grid, self.device.type == "cuda"
        world = dist.get_world_size()
        found = torch.zeros(grid.pp + world + len(self.parts), dtype=torch.float64)
        found[grid.pp + world :] = self.parts.double().cpu()
        busy = timeline.read(self.busy)
        if grid.replica == 0:
            found[grid.pp_rank] = busy
        if cuda:
            found[grid.pp + grid.rank] = (
                torch.cuda.max_memory_allocated(self.device) / 2**30
            )
        found = found.to(self.device)
        dist.all_reduce(found)
        found = found.tolist()
        return {
            "grad_norm": float(self.norm),
            "busy": found[: grid.pp],
            "memory": found[grid.pp : grid.pp + world] if cuda else None,
            "losses": [x / self.args.dp for x in found[grid.pp + world :]],
        }

    def lr(self) -> float:
        optimizer = next(iter(self.optimizers.values()), None) or self.clock[0]
        return optimizer.param_groups[0]["lr"]

    def stepped(self, loss: torch.Tensor, eval_loss: float | None) -> None:
        for scheduler in self.all_schedulers():
            scheduler.step()

    def all_schedulers(self) -> list:
        """The stages' learning-rate schedules, and the log's where it has one."""
        found = [s for s in self.schedulers.values() if s is not None]
        return found + ([self.clock[1]] if self.clock and self.clock[1] else [])

    def stop(self, message: str) -> None:
        stop(message)


def trains(module: nn.Module) -> bool:
    """Whether a stage has parameters to train."""
    return any(p.requires_grad for p in module.parameters())


def train(stages: Stages, argv: list[str] | None = None) -> None:
    """``pp_<name>.py``: parse the flags, start the process groups, train
    (``--predict ...``: predict.pipeline, forward only)."""
    given = argv if argv is not None else sys.argv[1:]
    if "--predict" in given:
        from .predict import pipeline as forward_only

        forward_only(stages, [a for a in given if a != "--predict"])
        return
    parser = flags.parser(stages.training, stages)
    args = parser.parse_args(argv)
    trackers.check(parser, args)
    if args.merge:
        sharded.merge(stages, *args.merge)
        return
    flags.check(parser, args)
    settings.apply(parser, args, stages.training, pipeline=True, argv=argv)
    note = no_evaluation(args, parser)  # the spec's eval_every with --data alone
    evaluates = bool(args.eval_data or args.eval_split or args.eval_every) and not note
    if note and environ.get("RANK") == "0":
        print(note)
    unwatched = choose(parser, args, stages.training, evaluates)
    if unwatched and environ.get("RANK") == "0":
        print(unwatched)
    ranks = mesh.stage_ranks(stages, args.schedule)
    pp = max(ranks) + 1
    world = pp * args.dp
    if args.batch_size % args.dp:
        parser.error(
            f"--batch-size {args.batch_size} must split into --dp {args.dp} equal parts"
        )
    part = args.batch_size // args.dp
    count = len(stages.stages)
    given = argv if argv is not None else sys.argv[1:]
    chosen = any(a == "--schedule" or a.startswith("--schedule=") for a in given)
    if (
        args.schedule == "1f1b"
        and args.microbatches is None
        and part < count
        and not chosen
    ):
        # 1F1B needs a micro-batch per stage; the spec's default batch may be smaller.
        if environ.get("RANK", "0") == "0":
            print(
                f"--schedule 1f1b needs at least {count} micro-batches, and a replica's part of "
                f"--batch-size {args.batch_size} is {part} samples: running gpipe "
                f"(--batch-size {count * args.dp} or more runs 1f1b)"
            )
        args.schedule = "gpipe"
    if args.microbatches is None:
        # the smallest divisor of a replica's part from the least on
        least = max(stages.microbatches, count if args.schedule == "1f1b" else 1)
        sizes = range(min(least, part), part + 1)
        args.microbatches = next((m for m in sizes if part % m == 0), part)
    if args.microbatches < 1 or part % args.microbatches:
        parser.error(
            f"--microbatches {args.microbatches} must divide a replica's {part} samples of --batch-size "
            f"{args.batch_size} (the stages exchange equal micro-batches)"
        )
    # Before torchrun: no GPUs here is the first thing to fix.
    device = launch.check_devices(stages)
    command = f"torchrun --nproc-per-node {world} {stages.script} ..."
    if "RANK" not in environ:
        stop(f"run it under torchrun: {command}")
    if int(environ["WORLD_SIZE"]) != world:
        replicas = f" x --dp {args.dp} replicas" if args.dp > 1 else ""
        stop(
            f"--schedule {args.schedule} runs {len(stages.stages)} stages on {pp} ranks{replicas} = {world}, "
            f"but torchrun started {environ['WORLD_SIZE']}: {command}"
        )
    threads.cap(args.threads, sys.stdout if environ["RANK"] == "0" else None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    wait = timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=wait, **launch.attempt_store(wait))
    try:
        grid = mesh.make(stages, ranks, args.dp, device.type, args.timeout)
        if args.checkpoint:
            launch.prepare(args.checkpoint)
        engine = Pipelined(stages, args, grid, device)
        with launch.holding_sigterm():
            try:
                run(
                    engine,
                    args,
                    engine.last,
                    engine.per_epoch,
                    engine.eval_data if engine.feeds else None,
                    evaluates=evaluates,
                )
            except (RuntimeError, dist.DistBackendError) as error:
                launch.lost(grid, error)
    finally:
        launch.stop_beating()
        if dist.is_initialized():
            dist.destroy_process_group()
