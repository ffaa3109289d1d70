"""The training loop, one for both scripts: :func:`run` drives an engine
that takes one optimizer step at a time, :class:`Single` (the whole model in
this process, ``train_<name>.py``) or ``pipeline.Pipelined`` (this rank's
stages, ``pp_<name>.py``), through the same resume, log, evaluation,
Ctrl-C and checkpoints."""

from __future__ import annotations

import argparse
import math
import pathlib
import shlex
import signal
import sys

import torch
from torch import nn

from . import checkpoint, flags, memory, settings, threads, trackers
from .data import (
    as_batch,
    batches,
    epoch_batches,
    no_evaluation,
    one_line,
    split_data,
    training_data,
)
from .log import Log
from .monitor import Monitor, best_record, choose, link, prune_files, step_files
from .metrics import Tally, eval_columns, hits, loss_columns, parts_losses
from .spec import Training

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device_type: str, amp: str) -> torch.autocast:
    """--amp's autocast on ``device_type`` (off: none)."""
    return torch.autocast(device_type, dtype=AMP_DTYPES[amp], enabled=amp != "off")


def tokens_per_sample(training: Training, batch: tuple) -> int | None:
    """Tokens in one sample: the positions of the first integer input with
    more than its batch dim (token ids [batch, seq]); None: no such input."""
    for x, d in zip(batch[: len(training.inputs)], training.batch_dims):
        if (
            x is not None
            and d is not None
            and x.dim() > 1
            and not x.is_floating_point()
        ):
            return x.numel() // x.shape[d]
    return None


def device_map(devices: list, count: int) -> str:
    """The --device-map of the rebuild hint: ``devices`` onto this machine's
    ``count`` GPUs in turn, or all onto the CPU where it has none."""
    if not count:
        return "cpu"
    return ",".join(f"{d}=cuda:{k % count}" for k, d in enumerate(devices))


def gpus_here(count: int) -> str:
    """What this machine has, for the rebuild hint."""
    return f"{count} CUDA device(s)" if count else "no CUDA device"


def run_elsewhere(
    training: Training, mapping: str, script: str, argv: list[str] | None
) -> str:
    """How to run ``script ARGV`` on this machine with ``--device-map
    MAPPING``, never writing into the folder it was built into (a committed
    one, which ``mpgen check`` compares with the spec): ``mpgen train``
    builds into a temporary folder; another script runs from a build of its
    own under build/."""
    args = shlex.join(sys.argv[1:] if argv is None else argv)
    spec = shlex.quote(training.spec)
    if script == f"train_{training.run}.py":
        rest = f" -- {args}" if args else ""
        return f"Run it here with: mpgen train {spec} --device-map {mapping}{rest}"
    out = f"build/{training.run}-{'cpu' if mapping == 'cpu' else 'here'}"
    then = shlex.join(["python", f"{out}/{script}"]) + (f" {args}" if args else "")
    return (
        f"Build a copy for this machine and run that one: mpgen build {spec} "
        f"--device-map {mapping} -o {out}, then {then}"
    )


def check_devices(
    training: Training, argv: list[str] | None = None, script: str | None = None
) -> None:
    """Stop, naming it, when a device the model is placed on is missing here,
    with how to run ``script`` (the training script's by default) here."""
    count = torch.cuda.device_count()
    missing = [
        d
        for d in training.devices
        if d.startswith("cuda") and torch.device(d).index >= count
    ]
    if missing:
        mapping = device_map(missing, count)
        script = script or f"train_{training.run}.py"
        sys.exit(
            f"{training.name} is placed on {', '.join(missing)}, but this machine has "
            f"{gpus_here(count)}. {run_elsewhere(training, mapping, script, argv)}"
        )


class Single:
    """The whole model in this process: a step is --accumulate micro-batches'
    forward and backward (under autocast and the fp16 gradient scaler), the
    gradients clipped, then the optimizer's step; or, for an optimizer that
    recomputes the loss (LBFGS), its step with a closure."""

    logs = True
    evaluates = False  # whether the run has evaluation data (run() says)
    #: Whether SIGTERM comes from torchrun's agent, which sends it to every
    #: worker once one ends, again as it shuts down, and SIGKILL 30 s later:
    #: then a second SIGTERM does not end the rank at once (it would, before
    #: the rank named the lost ones; NOTE [A lost rank]).
    agent_sigterm = False

    def __init__(self, training: Training, args, data, last: int) -> None:
        self.training, self.args, self.data = training, args, data
        self.path = (
            pathlib.Path(args.checkpoint, "last.pt") if args.checkpoint else None
        )
        self.where, self.folder = str(self.path), f"runs/{training.run}"
        self.devices, self.samples_per_step = (
            training.devices,
            args.accumulate * args.batch_size,
        )
        torch.manual_seed(args.seed)
        self.model = training.model()
        if args.init and not args.resume:  # a checkpoint holds the weights to resume
            try:
                keys = list(self.model.state_dict())
                checkpoint.initialise([self.model], args.init, keys, training)
            except ValueError as error:
                sys.exit(f"--init {args.init}: {error}")
            print(f"started from {args.init}")
        self.loss_fns = training.losses(args.settings)
        self.optimizer = self.scheduler = None
        if (
            training.optimizer is not None
        ):  # else no parameters: forward and the loss only
            self.optimizer = training.optimizer(self.model, args)
            if training.scheduler is not None:
                self.scheduler = training.scheduler(self.optimizer, args, last)
        self.scaler = torch.amp.GradScaler(
            training.device_type, enabled=args.amp == "fp16"
        )
        self.rates, self.norm = (
            {},
            None,
        )  # the log's: tokens per sample, from the first batch
        self.parts = []  # the step's loss of each output (the log's, where several)

    def autocast(self) -> torch.autocast:
        return autocast(self.training.device_type, self.args.amp)

    def stop(self, message: str) -> None:
        sys.exit(message)

    def interrupted(self, signals: list) -> bool:
        return bool(signals)

    def metrics(self) -> dict:
        """The shown step's gradient norm and each output's loss."""
        return {
            "grad_norm": None if self.norm is None else float(self.norm),
            "losses": [float(part) for part in self.parts],
        }

    def resume(self) -> int:
        if not self.path.exists():
            sys.exit(f"--resume: no checkpoint {self.path}")
        try:
            saved = checkpoint.load(self.path)
            parts = (self.model, self.optimizer, self.scheduler, self.scaler)
            fresh = settings.hyperparameters(self.optimizer)
            schedule = settings.schedule_state(self.scheduler)
            done = checkpoint.restore(saved, *parts)
        except Exception as error:  # not a checkpoint of this script's model
            sys.exit(f"--resume: cannot resume from {self.path} ({one_line(error)})")
        ignored = flags.NOT_INIT * bool(self.args.init)
        record = saved if "settings" in saved else None  # (older checkpoints: none)
        settings.reapply(self.optimizer, fresh, record, self.args)
        settings.reapply_schedule(self.scheduler, schedule, record, self.args)
        for line in settings.on_resume(record, self.args):
            print(line)
        afresh = self.monitor.restore(saved.get("monitor"))
        # a best.pt written after this checkpoint (a run killed between) stays the best
        self.monitor.restore(best_record(self.best_path), since=False)
        print(f"resumed from {self.path} at step {done}{ignored}{afresh}")
        return done

    @property
    def best_path(self) -> pathlib.Path:
        return self.path.with_name("best.pt")

    best_is_step = False  # best.pt is a file of its own, beside last.pt

    @property
    def best_where(self) -> str:
        return str(self.best_path)

    def agreed(self, results: dict) -> dict:
        """The evaluation's results every rank monitors: this process's."""
        return results

    def save(self, done: int, best: bool = False) -> None:
        """DIR/last.pt (with --keep-last past 1, DIR/step_N.pt and last.pt a
        link to it, the older ones pruned), or (``best``) DIR/best.pt."""
        if self.path is None:
            return
        parts = (self.model, self.optimizer, self.scheduler, self.scaler)
        state = checkpoint.state(*parts, done)
        state["monitor"] = self.monitor.state()
        state |= settings.record(self.args)  # the run's train: settings and its --set
        keep, folder = self.args.keep_last, self.path.parent
        path = self.best_path if best else self.path
        try:
            if best:
                checkpoint.save(state, path)
            elif keep > 1:
                earlier = [k for k in step_files(folder) if k < done]
                state["monitor"]["kept"] = kept = [*earlier[-(keep - 1) :], done]
                checkpoint.save(state, folder / f"step_{done}.pt")
                link(folder / f"step_{done}.pt", path)
                prune_files(folder, kept)
            else:
                checkpoint.save(state, path)
        except OSError as error:
            sys.exit(
                f"step {done}: cannot write {path} ({error}); the previous checkpoint is kept"
            )

    def start(self, done: int):
        """The batches from step ``done`` on."""
        self.model.train()
        return batches(self.data, self.training, self.args, done * self.args.accumulate)

    def step(self, stream) -> torch.Tensor:
        model, optimizer, args = self.model, self.optimizer, self.args
        forward_loss, n = self.training.forward_loss, len(self.training.inputs)
        if optimizer is not None and self.training.closure:
            batch = next(stream)

            first = []

            def closure() -> torch.Tensor:
                """Forward, the loss and its gradients: the optimizer evaluates them several times a step."""
                optimizer.zero_grad(set_to_none=True)
                loss, parts = forward_loss(model, self.loss_fns, batch[:n], batch[n:])
                first.append(parts_losses(parts))
                del parts  # outputs and targets: not held through backward
                loss.backward()
                if args.grad_clip:
                    nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                return loss

            loss = optimizer.step(closure).detach()  # the loss before the step
            self.parts = first[0]
            return loss
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        loss, self.parts = 0.0, []
        for _ in range(args.accumulate):  # gradients add up over the micro-batches
            batch = next(stream)
            if "tokens" not in self.rates:
                self.rates["tokens"] = tokens_per_sample(self.training, batch)
            with self.autocast():
                micro, parts = forward_loss(model, self.loss_fns, batch[:n], batch[n:])
            each = [part / args.accumulate for part in parts_losses(parts)]
            del parts  # outputs and targets: not held through backward (the plan's step)
            if optimizer is not None:
                self.scaler.scale(micro / args.accumulate).backward()
            loss = loss + micro.detach() / args.accumulate
            self.parts = [a + b for a, b in zip(self.parts, each)] or each
        if optimizer is not None:
            if args.grad_clip:
                self.scaler.unscale_(optimizer)  # clip the true gradients
                self.norm = nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            self.scaler.step(optimizer)  # skipped when fp16 gradients overflowed
            self.scaler.update()
        return loss

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    def stepped(self, loss: torch.Tensor, eval_loss: float | None) -> None:
        """The learning-rate schedule's step, after the log (which shows the
        lr this step used); ReduceLROnPlateau on the evaluation loss when
        there is evaluation data, else on the training loss."""
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        if self.scheduler is None:
            return
        if not isinstance(self.scheduler, plateau):
            self.scheduler.step()
        elif eval_loss is not None:
            self.scheduler.step(eval_loss)
        elif not self.evaluates:
            self.scheduler.step(loss.item())

    def evaluate(self, data) -> dict[str, float]:
        return evaluate(self.training, self.model, self.loss_fns, data, self.autocast)


def evaluate(training: Training, model, loss_fns, data, autocast) -> dict[str, float]:
    """The evaluation over ``data``'s batches, in eval mode, by its log
    column: ``eval_loss`` (the mean over the batches), each output's loss
    (``eval_loss_<output>``, where several) and each metric's value
    (``eval_accuracy``, ...; metrics.py)."""
    n, keys = len(training.inputs), training.keys
    model.eval()
    tally, count = Tally(training), 0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for batch in data:
            batch = as_batch(batch, keys)
            with autocast():
                loss, parts = training.forward_loss(
                    model, loss_fns, batch[:n], batch[n:]
                )
            tally.add_losses(loss, parts_losses(parts))
            tally.add_outputs(parts)
            count += 1
    model.train()
    if not count:
        sys.exit("the evaluation data gives no batch")
    return tally.results(count)


def hparams(training: Training, args: argparse.Namespace, engine) -> dict:
    """The run's settings, as hparams.json records them: the model, its
    spec and script, and every flag's value (--set's overrides among them,
    as the flags hold them)."""
    script = getattr(engine, "script", f"train_{training.run}.py")
    found = {"model": training.name, "spec": training.spec, "script": script}
    return found | {k: v for k, v in vars(args).items() if not k.startswith("_")}


def last_step(args: argparse.Namespace, per_epoch: int) -> int:
    """The step the run ends at: --steps or --epochs, whichever comes first."""
    return min(args.steps or math.inf, (args.epochs or math.inf) * per_epoch)


def run(
    engine,
    args: argparse.Namespace,
    last: int,
    per_epoch: int,
    eval_data=None,
    evaluates: bool | None = None,
):
    """Train from the checkpoint (--resume) or the start to step ``last``:
    log each step, evaluate every --eval-every steps and at the end
    (``evaluates``: whether there is evaluation data, where this rank holds
    none of it), save every --save-every steps, at the end and on Ctrl-C or
    SIGTERM (after the step, on every rank; a second one stops at once);
    keep the --monitor's best step, stop early after --early-stop
    evaluations without a better one."""
    evaluates = eval_data is not None if evaluates is None else evaluates
    engine.evaluates = evaluates
    engine.monitor = Monitor(args.monitor, args.monitor_mode, args.early_stop)
    done = engine.resume() if args.resume else 0
    saved = None  # the step of the newest save, where this run made it
    started = done
    stream = engine.start(done)
    log = None
    if engine.logs:
        try:
            folder = pathlib.Path(args.log_dir or args.checkpoint or engine.folder)
            every, size = args.log_every, engine.samples_per_step
            training = engine.training
            columns = (loss_columns(training), eval_columns(training))
            folder.mkdir(parents=True, exist_ok=True)
            chosen = trackers.chosen(args)
            runs = trackers.start(chosen, folder, folder.name, engine.stop)
            log = Log(
                folder,
                last,
                done,
                every,
                size,
                engine.devices,
                engine.rates,
                columns=columns,
                hparams=hparams(training, args, engine),
                trackers=runs,
            )
        except OSError as error:  # a folder that cannot be made or written
            engine.stop(f"cannot write the log ({error})")
    interrupted = engine.signals = []
    handled = (signal.SIGINT, signal.SIGTERM)
    defaults = {
        signal.SIGINT: signal.default_int_handler,
        signal.SIGTERM: signal.SIG_DFL,
    }

    def on_signal(signum, frame) -> None:
        interrupted.append(signum)
        if signum == signal.SIGINT or not engine.agent_sigterm:
            signal.signal(signum, defaults[signum])  # a second one stops at once

    previous = {s: signal.signal(s, on_signal) for s in handled}
    probe = memory.probe(engine, done, last) if args.memory else None
    try:
        for step in range(done + 1, last + 1):
            measured = probe is not None and probe.measured(step)
            if measured:
                probe.start()
            loss = engine.step(stream)
            if measured:
                sys.stdout.write("".join(f"{line}\n" for line in probe.stop()))
                sys.stdout.flush()  # one write: the ranks share the terminal
            if not torch.isfinite(loss):
                kept = f" ({engine.where} keeps step {done})" if args.checkpoint else ""
                engine.stop(f"step {step}: the loss is {loss.item()}; stopping{kept}")
            done, epoch = step, (step - 1) // per_epoch
            shown = step % args.log_every == 0 or step == last
            extra = engine.metrics() if shown else None  # (every rank: a collective)
            if log is not None:
                log.step(step, epoch, loss.item(), engine.lr(), extra)
            results = None  # the evaluation's, by column (eval_loss, ...)
            if evaluates and (
                step == last or args.eval_every and step % args.eval_every == 0
            ):
                results = engine.evaluate(eval_data)
                if log is not None:
                    log.evaluation(step, epoch, results)
            engine.stepped(loss, results["eval_loss"] if results else None)
            if results is not None and engine.monitor.update(
                step, engine.agreed(results)
            ):
                engine.save(done, best=True)
                saved = done if engine.best_is_step else saved
            if engine.monitor.stopping:
                if engine.logs:
                    print(engine.monitor.stopped(step), flush=True)
                break
            if engine.interrupted(interrupted):
                if saved != done:
                    engine.save(done)
                saving = f"; saved {engine.where}" if args.checkpoint else ""
                engine.stop(f"interrupted after step {step}{saving}")
            if args.save_every and step % args.save_every == 0 and step < last:
                if saved != done:
                    engine.save(done)
                saved = done
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if log is not None:
            log.close(started)
    if saved != done:
        engine.save(done)
    if args.checkpoint and engine.logs:
        print(f"saved {engine.where} at step {done}")
    best = engine.monitor.summary(engine.best_where if args.checkpoint else None)
    if best and engine.logs:
        print(best)


def train(training: Training, argv: list[str] | None = None) -> None:
    """``train_<name>.py``: parse the flags, make the data and the model, train."""
    parser = flags.parser(training)
    args = parser.parse_args(argv)
    flags.check(parser, args)
    settings.apply(parser, args, training, argv=argv)
    trackers.check(parser, args)
    check_devices(training, argv)
    data, eval_data = split_data(training, args, parser, training_data(training, args))
    unwatched = choose(parser, args, training, evaluates=eval_data is not None)
    per_epoch = (
        epoch_batches(data, args.batch_size) // args.accumulate
    )  # optimizer steps
    if per_epoch == 0:
        sys.exit(
            f"one optimizer step needs {args.accumulate * args.batch_size} samples, more than one pass over the data gives; lower --batch-size or --accumulate"
        )
    last = last_step(args, per_epoch)
    threads.cap(args.threads, sys.stdout)  # the data read: a bad file is its line alone
    engine = Single(training, args, data, last)
    size = sum(p.numel() for p in engine.model.parameters())
    trains = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    if engine.optimizer is None:
        print(f"{training.name}: {size:,} parameters, nothing to train")
    else:
        micro = f"{args.accumulate} micro-batches of " if args.accumulate > 1 else ""
        frozen = f" ({trains:,} train, the rest frozen)" if trains < size else ""
        print(
            f"{training.name}: {size:,} parameters{frozen}; {last} steps of {micro}{args.batch_size} samples"
        )
    if args.overrides:
        print(f"overrides: {' '.join(args.overrides)}")
    note = no_evaluation(args, parser)  # the spec's eval_every with --data alone
    for line in (note, unwatched):
        if line:
            print(line)
    run(engine, args, last, per_epoch, eval_data)
