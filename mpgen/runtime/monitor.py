"""Checkpoints worth keeping, in both scripts: the monitored evaluation
metric (--monitor, its best step kept as DIR/best.pt or the pipeline's
DIR/best), the newest --keep-last saves, and --early-stop.

# NOTE: [The monitored metric]
# --monitor names a column of log.csv's evaluation rows (eval_loss by
# default, where the run has evaluation data; a run without any monitors
# nothing: its training loss is one batch's, too noisy to elect a best).
# Whether lower or higher is better follows from the name (a loss,
# perplexity or error: lower; an accuracy, F1, precision...: higher), or
# --monitor-mode where the name does not say. Each evaluation either
# improves on the best (strictly) and the run saves that step as the best,
# or counts towards --early-stop's patience. The record (the metric, its
# mode, the best value and step, the evaluations since) is saved in every
# checkpoint, so a resumed run neither forgets its best nor elects a worse
# one; and a best.pt written after the checkpoint it resumes from (a run
# killed between the two) is read too, as the best so far.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import pathlib
import re
import shutil

from .checkpoint import load

#: Words in a metric's name that say lower is better, then higher: the first
#: found decides (``eval_top5_error``: lower).
LOWER = ("loss", "perplexity", "ppl", "error", "mse", "mae", "rmse", "wer", "cer")
HIGHER = ("accuracy", "acc", "top", "f1", "precision", "recall", "auc", "iou")
HIGHER += ("dice", "bleu", "rouge", "r2", "map", "score", "correct")

#: The file names of train_<name>.py's kept saves (--keep-last past 1).
STEP_FILE = re.compile(r"step_(\d+)\.pt")


def mode_of(metric: str) -> str | None:
    """ "min" or "max" as ``metric``'s name says, None when it does not."""
    words = re.split(r"[^a-z0-9]+", metric.lower())
    for mode, known in (("min", LOWER), ("max", HIGHER)):
        if any(word.startswith(known) for word in words if word):
            return mode
    return None


def choose(parser, args, training, evaluates: bool) -> str | None:
    """Settle --monitor (eval_loss by default where the run evaluates, else
    none) and --monitor-mode (by the name where not given); stop in one
    line, as argparse's usage errors end, where the run cannot monitor what
    the flags ask. The line to print where the spec's ``monitor`` or
    ``early_stop`` goes unwatched (a run without evaluation data)."""

    def refuse(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    known = list(training.eval_metrics)  # the columns of the evaluation's rows
    # The spec's train.monitor and early_stop are for runs that evaluate: a
    # run without evaluation data says it keeps no best, and goes on.
    spec_monitor = training.default("monitor")
    if not evaluates and (spec_monitor or training.default("early_stop")):
        if args.monitor == spec_monitor and args.early_stop == training.default(
            "early_stop"
        ):
            args.monitor, args.early_stop = None, 0
            return (
                f"monitor: the spec's {spec_monitor or 'eval_loss'} is not watched: this run "
                "has no evaluation data (give --eval-data or --eval-split)"
            )
    if args.monitor is None:
        args.monitor = "eval_loss" if evaluates else None
    elif not evaluates:
        refuse(
            f"--monitor {args.monitor}: this run has no evaluation data to monitor "
            "(give --eval-data or --eval-split)"
        )
    elif args.monitor not in known:
        close = difflib.get_close_matches(args.monitor, known, n=1)
        mean = f" (did you mean {close[0]}?)" if close else ""
        refuse(
            f"--monitor {args.monitor}: not a metric of this run's evaluation{mean}; "
            f"it has {', '.join(known)}"
        )
    if args.early_stop and args.monitor is None:
        refuse(
            "--early-stop needs evaluation data to monitor (give --eval-data or --eval-split)"
        )
    if args.monitor is not None and args.monitor_mode is None:
        args.monitor_mode = mode_of(args.monitor)
        if args.monitor_mode is None:
            refuse(
                f"--monitor {args.monitor}: its name does not say whether lower or higher is "
                "better; add --monitor-mode min or --monitor-mode max"
            )


class Monitor:
    """The monitored metric's best value and step, and the evaluations since
    it improved (NOTE [The monitored metric])."""

    def __init__(self, metric: str | None, mode: str | None, patience: int) -> None:
        self.metric, self.mode, self.patience = metric, mode, patience
        self.best: float | None = None
        self.best_step: int | None = None
        self.since = 0  # evaluations since the best

    def better(self, value: float, than: float | None) -> bool:
        if not math.isfinite(value):
            return False
        return than is None or (value < than if self.mode == "min" else value > than)

    def update(self, step: int, metrics: dict) -> bool:
        """Whether ``metrics`` (an evaluation's, by column name) improve on
        the best: then ``step`` is the best, else one more evaluation counts
        towards the patience."""
        if self.metric is None or metrics.get(self.metric) is None:
            return False
        value = float(metrics[self.metric])
        if self.better(value, self.best):
            self.best, self.best_step, self.since = value, step, 0
            return True
        self.since += 1
        return False

    @property
    def stopping(self) -> bool:
        """Whether --early-stop's patience ran out."""
        return bool(self.patience) and self.since >= self.patience

    def state(self) -> dict:
        """The record a checkpoint holds (numbers and strings only)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best": self.best,
            "best_step": self.best_step,
            "since": self.since,
        }

    def restore(self, saved: dict | None, since: bool = True) -> str:
        """Take a checkpoint's record where it monitored the same metric the
        same way: its best, where better than the one held, and (``since``:
        the checkpoint resumed from) its evaluations since. What to say of
        it ("" when nothing)."""
        if not saved or saved.get("best") is None or self.metric is None:
            return ""
        if (saved.get("metric"), saved.get("mode")) != (self.metric, self.mode):
            return (
                f"; it monitored {saved.get('metric')} ({saved.get('mode')}), so the best "
                f"{self.metric} ({self.mode}) starts afresh"
            )
        if since:
            self.since = int(saved.get("since") or 0)
        if self.better(float(saved["best"]), self.best):
            self.best, self.best_step = float(saved["best"]), int(saved["best_step"])
        return ""

    def summary(self, where: str | None) -> str | None:
        """The end's line: the best value, its step and where it is kept."""
        if self.best_step is None:
            return None
        kept = f": {where}" if where else ""
        return f"best {self.named} {self.best:.6g} at step {self.best_step}{kept}"

    @property
    def named(self) -> str:
        """The metric as a sentence says it (eval_loss: eval loss)."""
        return self.metric.replace("_", " ")

    def stopped(self, step: int) -> str:
        """--early-stop's line."""
        return (
            f"early stop after step {step}: {self.named} has not improved for "
            f"{self.since} evaluations (best {self.best:.6g} at step {self.best_step})"
        )


def encode(record: dict) -> str:
    """A record as the pipeline's checkpoint holds it: one string."""
    return json.dumps(record, sort_keys=True)


def decode(text: str) -> dict | None:
    try:
        found = json.loads(text) if text else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def best_record(path: pathlib.Path) -> dict | None:
    """The monitor's record in a best.pt, as of its own step (None: no
    readable one)."""
    if not path.is_file():
        return None
    try:
        saved = load(path)
    except Exception:  # a damaged file: the run's next best replaces it
        return None
    record = saved.get("monitor") if isinstance(saved, dict) else None
    return record if isinstance(record, dict) else None


# -- train_<name>.py's kept saves (--keep-last) ------------------------------------


def step_files(folder: pathlib.Path) -> list[int]:
    """The steps of the DIR/step_K.pt files in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [STEP_FILE.fullmatch(entry.name) for entry in folder.iterdir()]
    return sorted(int(match.group(1)) for match in found if match)


def link(source: pathlib.Path, path: pathlib.Path) -> None:
    """``path`` the same file as ``source`` (a hard link; a copy where the
    filesystem has none), replacing it atomically."""
    tmp = path.with_name(f".{path.stem}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, path)


def prune_files(folder: pathlib.Path, kept: list[int]) -> None:
    """Remove the DIR/step_N.pt files of the steps not ``kept``."""
    for step in step_files(folder):
        if step not in kept:
            (folder / f"step_{step}.pt").unlink(missing_ok=True)
