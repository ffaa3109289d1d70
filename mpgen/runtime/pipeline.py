"""The pipeline mode of the loop (``pp_<name>.py``): each rank builds only
its stages of the model and trains them with torch.distributed.pipelining
under torchrun (gloo on the CPU, NCCL on GPUs), through loop.run like the
single-process script.

# NOTE: [Micro-batch losses]
# The schedules average the micro-batches' losses (their gradients are
# divided by M), and the log shows that mean. M divides the batch (a stage
# receives into buffers shaped by the first micro-batch, so they must be
# equal), so for a mean loss that mean is the single-process script's loss
# of the whole batch; a summed loss is multiplied by M (the stage loss does).
# A batch-coupled layer (BatchNorm) still sees micro-batches, and differs.
"""

from __future__ import annotations

import itertools
import pathlib
import sys
from os import environ

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from . import checkpoint, flags
from .data import batches, epoch_batches, one_line, training_data
from .loop import autocast, last_step, run
from .spec import Stages


class Elsewhere(nn.Module):
    """An instance of a repeated layer that another stage holds: no parameters,
    so a stage's instances keep their indices (and state-dict keys)."""

    def forward(self, *args) -> None:
        raise RuntimeError("this instance is held by another stage")


def stop(message: str) -> None:
    """Exit with ``message``, printed once (by rank 0) however many ranks stop."""
    sys.exit(message if environ.get("RANK", "0") == "0" else 1)


def pick(target: torch.Tensor | None, dim: int | None, index: torch.Tensor):
    """The samples ``index`` of a step's target (no batch dim: all of it)."""
    if target is None or dim is None:
        return target
    return target.index_select(dim, index.to(target.device))


def sendable(dtypes: tuple) -> object:
    """A forward hook that makes a stage's outputs sendable: contiguous (as gloo
    and NCCL need), copied when passed on as received (its receive buffer takes
    the next micro-batch), in the dtypes the next stage receives (not autocast's)."""

    def hook(module: nn.Module, inputs: tuple, outputs: tuple) -> tuple:
        return tuple(
            (
                x.clone(memory_format=torch.contiguous_format)
                if any(x is i for i in inputs)
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


def placement(stages: Stages, schedule: str) -> list[int]:
    """The rank of each stage: stage k on rank k; for the interleaved schedule,
    the ranks take turns along a layout that visits its devices in a repeating order."""
    if schedule != "interleaved":
        return list(range(len(stages.stages)))
    devices = tuple(dict.fromkeys(stages.devices))
    turns = len(stages.devices) // len(devices)
    if turns < 2 or stages.devices != devices * turns:
        stop(
            f"--schedule interleaved needs a layout that visits its devices in a repeating order at least twice "
            f"(cuda:0, cuda:1, cuda:0, cuda:1), so that each rank holds two stages or more; {stages.training.name}'s "
            f"stages are on {', '.join(stages.devices)}: use --schedule gpipe or 1f1b"
        )
    return [k % len(devices) for k in range(len(stages.stages))]


def merge(stages: Stages, folder: str, out: str) -> None:
    """Write one state dict of the model from FOLDER/stage_K.pt (it loads with strict=True)."""
    if pathlib.Path(out).is_dir():
        sys.exit(f"--merge: {out} is a folder; give the file to write")
    state = {}
    for k in range(len(stages.stages)):
        path = pathlib.Path(folder, f"stage_{k}.pt")
        if not path.is_file():
            sys.exit(f"--merge: no checkpoint {path}")
        try:
            state.update(checkpoint.load(path)["model"])
        except Exception as error:  # not a stage checkpoint of this program
            sys.exit(f"--merge: cannot read {path} ({one_line(error)})")
    try:
        checkpoint.save(state, pathlib.Path(out))
    except OSError as error:
        sys.exit(f"--merge: cannot write {out} ({error})")
    print(f"merged {len(stages.stages)} stages into {out} ({len(state)} tensors)")


def tie_groups(stages: Stages, ranks: list[int], mine: list[int]) -> list[tuple]:
    """For each tie: the process group of the ranks holding its copies (None:
    one rank holds them all), the owner's rank, this rank's copies."""
    groups = []
    for tie in stages.ties:
        holders = sorted({ranks[k] for k, _ in tie})
        # every rank calls new_group, in one order
        group = dist.new_group(holders) if len(holders) > 1 else None
        groups.append(
            (group, ranks[tie[0][0]], [(k, key) for k, key in tie if k in mine])
        )
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


def sync_ties(groups: list[tuple], modules: dict, gradients: bool) -> None:
    """Keep each tied parameter's copies equal, as Megatron does: at the start,
    the owner's value; after a backward, every copy's gradient becomes their sum."""
    for group, owner, copies in groups:
        if not copies:
            continue
        params = [modules[k].get_parameter(key) for k, key in copies]
        with torch.no_grad():
            if gradients:
                total = sum(
                    p.grad if p.grad is not None else torch.zeros_like(p)
                    for p in params
                )
                if group is not None:
                    dist.all_reduce(total, group=group)
                for p in params:
                    p.grad = total.clone()
            else:
                value = (
                    params[0].detach().clone()
                )  # the owner's, where this rank holds it
                if group is not None:
                    dist.broadcast(value, src=owner, group=group)
                for p in params:
                    p.copy_(value)


def clip_gradients(stages: Stages, modules: dict, max_norm: float, device) -> None:
    """Scale every rank's gradients by one factor, from the norm of all of them
    (each tied parameter counted once), as clip_grad_norm_ does on one model."""
    copies = {(k, key) for tie in stages.ties for k, key in tie[1:]}
    squares = torch.zeros((), device=device)
    for k, module in modules.items():
        for key, p in module.named_parameters():
            if p.grad is not None and (k, key) not in copies:
                squares += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(squares)
    scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    for module in modules.values():
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)


class Pipelined:
    """This rank's stages of the model: a step is the schedule's forward and
    backward of every micro-batch, the tied copies' gradients summed, the
    gradients clipped over every rank, then each stage's optimizer's step;
    the loss (the micro-batches' mean) goes from the last stage to every rank."""

    interruptible = False  # a rank interrupted alone would leave the others waiting

    def __init__(self, stages: Stages, args, ranks: list[int], device) -> None:
        self.stages, self.args, self.ranks, self.device = stages, args, ranks, device
        training, count = stages.training, len(stages.stages)
        rank = dist.get_rank()
        self.mine = mine = [k for k, r in enumerate(ranks) if r == rank]
        self.first, self.last_stage = 0 in mine, count - 1 in mine
        self.logs = rank == ranks[-1]
        self.where = f"{args.checkpoint}/stage_*.pt"
        self.folder = f"runs/pp_{training.run}"
        self.devices = (str(device),) if device.type == "cuda" else ()
        self.samples_per_step = args.batch_size
        self.modules = modules = {}
        for k in mine:
            torch.manual_seed(args.seed * 1_000_003 + k)  # a stage's own initialisation
            modules[k] = stages.stages[k]().to(device)
        if args.init and not args.resume:  # a checkpoint holds the weights to resume
            self.initialise(args.init)
        self.groups = tie_groups(stages, ranks, mine)
        sync_ties(self.groups, modules, gradients=False)

        # The data: the first stage's rank feeds the inputs, the last stage's reads the targets.
        self.feeds = self.first or self.last_stage
        per_epoch = [None]
        if self.feeds:
            self.data = training_data(training, args)
            per_epoch = [epoch_batches(self.data, args.batch_size)]
        dist.broadcast_object_list(per_epoch, src=ranks[0])
        self.per_epoch = per_epoch[0]
        if self.per_epoch == 0:
            stop(f"the data gives no batch of {args.batch_size}; lower --batch-size")
        self.last = last_step(args, self.per_epoch)

        self.optimizers, self.schedulers = {}, {}
        # ReduceLROnPlateau would be stepped with a loss every rank would need.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        for k, module in modules.items():
            optimizer = training.optimizer(module, args)
            scheduler = None
            if training.scheduler is not None:
                scheduler = training.scheduler(optimizer, args, self.last)
            self.optimizers[k] = optimizer
            self.schedulers[k] = None if isinstance(scheduler, plateau) else scheduler
        counts = {len(o.param_groups) for o in self.optimizers.values()}
        if stages.ties and counts == {2}:  # no_decay's (optim.param_groups)
            follow_owners(self.groups, modules, self.optimizers, device)
        self.loss_fns = training.losses()
        # The step's targets, on this device: the stage loss picks each micro-batch's.
        self.current = [()]

    def initialise(self, path: str) -> None:
        """--init: each stage's keys from a state dict of the whole model."""
        with torch.device("meta"):
            keys = [key for stage in self.stages.stages for key in stage().state_dict()]
        try:
            modules, training = list(self.modules.values()), self.stages.training
            checkpoint.initialise(modules, path, list(dict.fromkeys(keys)), training)
        except ValueError as error:
            stop(f"--init {path}: {error}")

    def stage_path(self, k: int) -> pathlib.Path:
        return pathlib.Path(self.args.checkpoint, f"stage_{k}.pt")

    def resume(self) -> int:
        for k in self.mine:
            path = self.stage_path(k)
            if not path.is_file():
                stop(f"--resume: no checkpoint {path}")
            try:
                parts = (self.modules[k], self.optimizers[k], self.schedulers[k], None)
                done = checkpoint.restore(checkpoint.load(path), *parts)
            except Exception as error:  # not this stage's checkpoint
                stop(f"--resume: cannot resume from {path} ({one_line(error)})")
        if self.logs:
            ignored = flags.NOT_INIT * bool(self.args.init)
            print(f"resumed from {self.args.checkpoint} at step {done}{ignored}")
        return done

    def save(self, done: int) -> None:
        if not self.args.checkpoint:
            return
        for k in self.mine:
            parts = (self.modules[k], self.optimizers[k], self.schedulers[k], None)
            try:
                checkpoint.save(checkpoint.state(*parts, done), self.stage_path(k))
            except OSError as error:
                stop(f"step {done}: cannot write {self.stage_path(k)} ({error})")

    def start(self, done: int):
        """The batches from step ``done`` on (on the ranks that feed), and the schedule."""
        args, stages, ranks = self.args, self.stages, self.ranks
        training, n = stages.training, len(stages.training.inputs)
        stream = batches(self.data, training, args, done) if self.feeds else None
        shapes = [None]  # the inputs' shapes, from the first batch, for every rank
        if dist.get_rank() == ranks[0]:
            batch = next(stream)
            stream = itertools.chain([batch], stream)
            shapes = [[(tuple(x.shape), x.dtype) for x in batch[:n]]]
        dist.broadcast_object_list(shapes, src=ranks[0])
        found = examples(stages, shapes[0], args.microbatches)
        count, pipeline = len(stages.stages), []
        for k in self.mine:
            given, made = found[k]
            if k < count - 1:
                self.modules[k].register_forward_hook(
                    sendable(tuple(x.dtype for x in made))
                )
            stage = PipelineStage(self.modules[k], k, count, self.device, given, made)
            pipeline.append(stage)
        m, schedule = args.microbatches, getattr(
            pipelining, flags.SCHEDULES[args.schedule]
        )
        chunks = [
            TensorChunkSpec(d) if d is not None else _Replicate()
            for d in stages.input_dims
        ]

        def loss(outputs, index: torch.Tensor) -> torch.Tensor:
            return stages.loss(outputs, index, self.current[0], self.loss_fns, m)

        try:
            held = pipeline if args.schedule == "interleaved" else pipeline[0]
            self.schedule = schedule(
                held, m, loss_fn=loss, args_chunk_spec=tuple(chunks)
            )
        except (
            ValueError
        ) as error:  # e.g. interleaved micro-batches not a multiple of its rounds
            stop(f"--schedule {args.schedule} --microbatches {m}: {error}")
        if self.logs:
            print(
                f"{training.name}: {count} stages on {dist.get_world_size()} ranks, --schedule {args.schedule}; "
                f"{self.last} steps of {args.batch_size} samples in {args.microbatches} micro-batches"
            )
        return stream

    def step(self, stream) -> torch.Tensor:
        args, device = self.args, self.device
        n = len(self.stages.training.inputs)
        batch = next(stream) if stream is not None else ()
        inputs = tuple(x.to(device) for x in batch[:n]) if self.first else ()
        target = None
        if self.last_stage:
            self.current[0] = tuple(x if x is None else x.to(device) for x in batch[n:])
            target = torch.arange(args.batch_size, device=device)
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        losses = []
        with autocast(device.type, args.amp):
            self.schedule.step(
                *inputs, target=target, losses=losses, return_outputs=False
            )
        sync_ties(self.groups, self.modules, gradients=True)
        if args.grad_clip:
            clip_gradients(self.stages, self.modules, args.grad_clip, device)
        for optimizer in self.optimizers.values():
            optimizer.step()
        # The mean of the micro-batches' losses, from the last stage to every rank.
        loss = (
            torch.stack(losses).mean().detach().float()
            if losses
            else torch.zeros((), device=device)
        )
        dist.broadcast(loss, src=self.ranks[-1])
        return loss

    def lr(self) -> float:
        return next(iter(self.optimizers.values())).param_groups[0]["lr"]

    def stepped(self, loss: torch.Tensor, eval_loss: float | None) -> None:
        for scheduler in self.schedulers.values():
            if scheduler is not None:
                scheduler.step()

    def stop(self, message: str) -> None:
        stop(message)


def train(stages: Stages, argv: list[str] | None = None) -> None:
    """``pp_<name>.py``: parse the flags, start the process group, train."""
    parser = flags.parser(stages.training, stages)
    args = parser.parse_args(argv)
    if args.merge:
        merge(stages, *args.merge)
        return
    flags.check(parser, args)
    size = args.batch_size
    if (
        args.microbatches is None
    ):  # the smallest divisor of the batch from the default on
        sizes = range(stages.microbatches, size + 1)
        args.microbatches = next((m for m in sizes if size % m == 0), size)
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        parser.error(
            f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size} (the stages exchange equal micro-batches)"
        )
    ranks = placement(stages, args.schedule)
    world = max(ranks) + 1
    if "RANK" not in environ:
        stop(
            f"run it under torchrun: torchrun --nproc-per-node {world} {stages.script} ..."
        )
    if int(environ["WORLD_SIZE"]) != world:
        stop(
            f"--schedule {args.schedule} runs {len(stages.stages)} stages on {world} ranks, "
            f"but torchrun started {environ['WORLD_SIZE']}: torchrun --nproc-per-node {world} {stages.script} ..."
        )
    if stages.training.device_type == "cuda":
        device = torch.device("cuda", int(environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        engine = Pipelined(stages, args, ranks, device)
        run(engine, args, engine.last, engine.per_epoch)
    finally:
        dist.destroy_process_group()
