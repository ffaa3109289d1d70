"""The command line of both scripts: one set of flags, each default the
spec's (Training.default), and the checks argparse cannot make."""

from __future__ import annotations

import argparse
import math
import pathlib

from . import threads
from .data import DATA_HELP
from .spec import Stages, Training

#: The pipeline program's schedules (names of torch.distributed.pipelining classes).
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}

#: The flags that become a tensor's size or a number of processes, and the
#: most each may be (a dim's most, as a spec's); the other counts (steps,
#: epochs, intervals) are int64 in a checkpoint. Past them: one usage line,
#: never an overflow inside torch.
SIZES = ("batch_size", "microbatches", "accumulate", "samples", "dp", "workers")
MOST_SIZE, MOST_COUNT = 2**31 - 1, 2**63 - 1
#: The longest --timeout, in seconds (a year; longer overflows a timedelta).
MOST_TIMEOUT = 365 * 24 * 3600.0

#: What --resume says of an --init it does not read.
NOT_INIT = " (its weights, not --init's)"

#: Each flag's help, where it says more than the flag's name.
HELP = {
    "steps": "optimizer steps",
    "epochs": "passes over the data (with --steps: whichever ends first)",
    "microbatches": "micro-batches per step, a divisor of --batch-size (default: the smallest from {} on)",
    "schedule": "the pipeline schedule; interleaved, looped-bfs and interleaved-zb where the layout repeats "
    "its devices (a rank per device), zbv and dualpipev for an even number of stages (two per rank, in a V)",
    "dp": "replicas of the pipeline (data parallel): torchrun starts ranks per replica x N processes",
    "dp_mode": "how replicas synchronise gradients: FSDP2's fully_shard (parameters, gradients and "
    "optimizer state sharded over the replicas) or DDP (replicated; under interleaved-zb, zbv and "
    "dualpipev the runtime averages the gradients itself after the last micro-batch)",
    "timeout": "seconds a collective or a send may wait for another rank before every rank stops",
    "sync_bn": "normalise each BatchNorm's micro-batch by the statistics of that micro-batch on every "
    "--dp replica together (without: each replica's own; the running stats are averaged over the "
    "replicas after each step either way)",
    "decay_steps": "the schedule's length in steps, whatever --steps stops at (default: the spec's train.steps, else the run's steps)",
    "log_dir": "where log.csv goes (default: --checkpoint's DIR, else runs/{})",
    "save_every": "also save every K steps (0: only at the end)",
    "init": "start from this state dict of {} (.pt or .safetensors); with --resume, the checkpoint's weights win",
    "amp": "autocast to bf16, or fp16 with a gradient scaler",
    "pp_amp": "autocast to bf16 (fp16 would need a gradient scaler spanning the ranks)",
    "accumulate": "micro-batches of --batch-size per optimizer step",
    "eval_split": "hold out this fraction of a Dataset for evaluation",
    "eval_every": "evaluate every K steps (0: at the end only, if there is evaluation data)",
    "samples": "size of the synthetic dataset (one epoch)",
    "merge": "write one state dict of {} from DIR's newest complete checkpoint to OUT and exit (no torchrun)",
    "memory": "measure the peak memory of the run's second step (its first of one step) on each "
    "device of this process and print it beside the build's plan",
    "lr": "the optimizer's base learning rate (the schedule scales it)",
    "seed": "seeds the model's initialisation, the data order and every RNG",
    "log_every": "a progress line every K steps and at the last",
    "set": "change a train: setting of the spec for this run, VALUE read as YAML: "
    "optimizer.weight_decay=0.05, optimizer.betas=[0.9,0.95], loss.label_smoothing=0.1, "
    "scheduler.warmup=100 (repeatable; checked as the spec is; docs/training.md)",
    "pp_resume": "continue from DIR's newest complete checkpoint, on any --dp or layout; none yet: start "
    "at step 0 (one command line for the first launch and torchrun --max-restarts)",
    "monitor": "the evaluation metric (a column of log.csv's evaluation rows) whose best step is kept "
    "as {} (default: {} where the run has evaluation data, else none)",
    "monitor_mode": "whether lower or higher --monitor is better (default: as its name says: a loss, "
    "perplexity or error min; an accuracy, F1... max)",
    "keep_last": "keep the N newest saves: {} (the best kept besides)",
    "early_stop": "stop after P evaluations without a better --monitor, saving as at the end (0: never)",
}


def parser(
    training: Training, pipeline: Stages | None = None
) -> argparse.ArgumentParser:
    """The flags of ``train_<name>.py`` or, with ``pipeline``, of ``pp_<name>.py``."""
    d, name = training.default, training.name
    run = f"pp_{training.run}" if pipeline else training.run
    saved = "DIR/step_N (every rank's shards)" if pipeline else "DIR/last.pt"
    how = " as a pipeline of processes under torchrun" if pipeline else ""
    p = argparse.ArgumentParser(description=f"Train {name}{how}.")
    add = p.add_argument
    add("--steps", type=int, default=d("steps"), help=HELP["steps"])
    add("--epochs", type=int, default=d("epochs"), help=HELP["epochs"])
    split = (
        " (a batch with --accumulate), split over --dp replicas, then into --microbatches"
        if pipeline
        else " (each micro-batch with --accumulate)"
    )
    add(
        "--batch-size",
        type=int,
        default=d("batch_size"),
        help=f"samples per step{split}",
    )
    if pipeline:
        least, schedules = pipeline.microbatches, tuple(SCHEDULES)
        text = HELP["microbatches"].format(least)
        add("--microbatches", type=int, metavar="M", help=text)
        add(
            "--schedule",
            choices=schedules,
            default=pipeline.schedule,
            help=HELP["schedule"],
        )
        add("--dp", type=int, default=pipeline.dp, metavar="N", help=HELP["dp"])
        add("--dp-mode", choices=("fsdp", "ddp"), default="fsdp", help=HELP["dp_mode"])
        add(
            "--sync-bn",
            action=argparse.BooleanOptionalAction,
            default=pipeline.sync_bn,
            help=HELP["sync_bn"],
        )
        add(
            "--timeout",
            type=float,
            default=120.0,
            metavar="SECONDS",
            help=HELP["timeout"],
        )
    add("--lr", type=float, default=d("lr"), help=HELP["lr"])
    if pipeline or "decay_steps" in training.defaults:  # a built-in schedule reads it
        steps, text = (
            training.defaults.get("decay_steps", d("steps")),
            HELP["decay_steps"],
        )
        add("--decay-steps", type=int, default=steps, metavar="N", help=text)
    add("--seed", type=int, default=d("seed"), help=HELP["seed"])
    text = HELP["log_every"]
    add("--log-every", type=int, default=d("log_every"), metavar="K", help=text)
    add("--log-dir", metavar="DIR", help=HELP["log_dir"].format(run))
    text = "also log to W&B or MLflow, installed (repeatable; default: $MPGEN_LOGGER)"
    add("--logger", action="append", choices=("wandb", "mlflow"), help=text)
    text = (
        f"write {saved} at the end, every --save-every steps and on Ctrl-C or SIGTERM"
    )
    add("--checkpoint", metavar="DIR", help=text)
    add("--save-every", type=int, default=0, metavar="K", help=HELP["save_every"])
    text = HELP["pp_resume"] if pipeline else f"continue from {saved}"
    add("--resume", action="store_true", help=text)
    add("--init", metavar="FILE", help=HELP["init"].format(name))
    best = "DIR/best (a link to its step_N)" if pipeline else "DIR/best.pt"
    add(
        "--monitor",
        default=d("monitor"),
        metavar="METRIC",
        help=HELP["monitor"].format(best, d("monitor") or "eval_loss"),
    )
    text = HELP["monitor_mode"]
    if d("monitor_mode"):  # the spec's, shown as (default: max)
        text = text.split(" (default")[0]
    add("--monitor-mode", choices=("min", "max"), default=d("monitor_mode"), help=text)
    kept = (
        "DIR/step_N folders" if pipeline else "last.pt and, past 1, DIR/step_N.pt files"
    )
    text = HELP["keep_last"].format(kept)
    add("--keep-last", type=int, default=d("keep_last"), metavar="N", help=text)
    text = HELP["early_stop"]
    add("--early-stop", type=int, default=d("early_stop"), metavar="P", help=text)
    if pipeline:
        amp = d("amp") if d("amp") != "fp16" else "off"
        add("--amp", choices=("off", "bf16"), default=amp, help=HELP["pp_amp"])
    else:
        add(
            "--amp", choices=("off", "bf16", "fp16"), default=d("amp"), help=HELP["amp"]
        )
    whose = "all stages' " if pipeline else "the "
    text = f"clip the norm of {whose}gradients (0: no clipping)"
    add("--grad-clip", type=float, default=d("grad_clip"), metavar="NORM", help=text)
    text = HELP["accumulate"]
    add("--accumulate", type=int, default=d("accumulate"), metavar="K", help=text)
    text = f"{DATA_HELP} (default: {d('data') or 'synthetic data'})".replace("%", "%%")
    add("--data", default=d("data"), metavar="SPEC", help=text)
    text = "as --data, for evaluation"
    add("--eval-data", default=d("eval_data"), metavar="SPEC", help=text)
    text = HELP["eval_split"]
    add("--eval-split", type=float, default=d("eval_split"), metavar="F", help=text)
    text = HELP["eval_every"]
    add("--eval-every", type=int, default=d("eval_every"), metavar="K", help=text)
    add("--samples", type=int, default=d("samples"), help=HELP["samples"])
    add("--workers", type=int, default=d("workers"), help="DataLoader worker processes")
    add("--memory", action="store_true", help=HELP["memory"])
    add("--set", action="append", metavar="KEY=VALUE", help=HELP["set"])
    if pipeline:
        text, names = HELP["merge"].format(name), ("DIR", "OUT")
        add("--merge", nargs=2, metavar=names, help=text)
    threads.add_flag(p)
    show_defaults(p)
    return p


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Each flag's help ends with its default (the spec's, where it sets
    one), a flag without help text too; not where the text says it, nor for
    a switch that is off or a flag with no default."""
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, argparse.SUPPRESS):
            continue
        if default is False or default == [] or "default" in (action.help or ""):
            continue
        text = "(default: %(default)s)"
        action.help = f"{action.help} {text}" if action.help else text


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop on arguments the run cannot use, in one line as argparse's usage
    errors end (``PROG: error: ...``, exit 2): --resume without --checkpoint,
    no length, a count below its least, a learning rate or clip norm that is
    negative or not finite, a seed torch cannot take, a file where a folder
    goes, a file to read that is not there."""

    def refuse(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    given = vars(args)
    if given["resume"] and not given["checkpoint"]:
        refuse("--resume needs --checkpoint DIR")
    if given["steps"] is None and given["epochs"] is None:
        refuse("give --steps or --epochs")
    if not 0 <= given.get("eval_split", 0) < 1:
        refuse("--eval-split takes a fraction in [0, 1)")
    least = dict.fromkeys(
        "steps epochs batch_size accumulate microbatches dp".split(), 1
    )
    least |= dict.fromkeys(("decay_steps", "log_every", "samples", "keep_last"), 1)
    least |= dict.fromkeys(("workers", "save_every", "eval_every", "early_stop"), 0)
    for name, low in least.items():
        value = given.get(name)
        if value is not None and value < low:
            refuse(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
        most = MOST_SIZE if name in SIZES else MOST_COUNT
        if value is not None and value > most:
            refuse(
                f"--{name.replace('_', '-')} must be at most {most:,}, got {value:,}"
            )
    if given.get("timeout") is not None and not 0 < given["timeout"] <= MOST_TIMEOUT:
        refuse(
            f"--timeout must be a positive number of seconds, at most {MOST_TIMEOUT:.0f}, "
            f"got {given['timeout']}"
        )
    for name in ("lr", "grad_clip"):
        if not 0 <= given[name] < math.inf:
            refuse(
                f"--{name.replace('_', '-')} must be a finite number >= 0, got {given[name]}"
            )
    if not -(2**63) <= args.seed < 2**64:
        refuse(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    for name in ("checkpoint", "log_dir"):
        folder = pathlib.Path(given[name] or ".")  # "." for none
        if folder.exists() and not folder.is_dir():
            refuse(f"--{name.replace('_', '-')} {folder}: not a folder")
    init = None if args.resume else args.init  # --resume's checkpoint wins
    if init is not None and not pathlib.Path(init).is_file():
        refuse(f"--init: no file {init}")
