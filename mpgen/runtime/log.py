"""The training log: progress on the terminal, log.csv, TensorBoard (and
W&B or MLflow, asked for: trackers.py), hparams.json, the summary."""

from __future__ import annotations

import csv
import json
import math
import sys
import time

import torch

try:  # a progress bar on a terminal, when tqdm is installed
    from tqdm import tqdm
except ImportError:
    tqdm = None
try:  # TensorBoard logs, when tensorboard is installed
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams as hparams_summary
except ImportError:
    SummaryWriter = None

#: The columns of the throughput, after the evaluation's.
RATES = ("tokens_per_second", "grad_norm", "idle", "mfu")


class Log:
    """Progress on the terminal (a tqdm bar on a TTY, else a line every
    --log-every steps), a CSV file, TensorBoard when installed, and the summary."""

    def __init__(
        self,
        folder,
        steps: int,
        done: int,
        every: int,
        size: int,
        devices,
        rates=None,
        columns=((), ("eval_loss",)),
        hparams=None,
        trackers=(),
    ):
        """``size``: samples per step; the peak memory of ``devices`` (CUDA ones)
        is shown. ``rates``: what the throughput columns need, where known:
        ``tokens`` per sample, training ``flops`` per sample, the job's
        ``peak`` FLOP/s, the ``predicted`` bubble and its ``schedule``.
        ``columns``: each output's loss column of a step (``loss_cls_head``;
        none for one loss), and the evaluation's (metrics.eval_columns).
        ``hparams``: the run's settings, written to hparams.json and
        TensorBoard's hparams; ``trackers``: W&B or MLflow runs (trackers.py),
        given the same rows."""
        self.steps, self.every, self.samples_per_step = steps, every, size
        self.rates = rates if rates is not None else {}
        # the ranks' busy seconds over the seconds timed, and each pipeline rank's
        self.busy_total, self.timed = None, 0.0
        self.busy_ranks, self.busy_steps = None, 0
        self.cuda = [d for d in devices if d.startswith("cuda")]
        self.first, self.last_loss, self.last_eval = None, None, None
        self.start = self.tick = time.perf_counter()
        self.done = self.tick_step = done
        self.losses, self.evals = list(columns[0]), list(columns[1])
        self.trackers = list(trackers)
        self.columns = ["step", "epoch", "loss", *self.losses, "lr"]
        self.columns += ["seconds_per_step", "samples_per_second", *self.evals, *RATES]
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "log.csv"
        kept = [] if done == 0 else self.rows_until(done)
        self.file = self.path.open("w", newline="")
        self.csv = csv.DictWriter(self.file, self.columns, restval="")
        self.csv.writeheader()
        self.csv.writerows(kept)
        # purge_step: TensorBoard drops what earlier event files in the
        # folder hold from this step on (a killed run's steps past the
        # checkpoint, a run before this fresh one), so one curve shows.
        self.board = (
            SummaryWriter(str(folder), purge_step=done + 1)
            if SummaryWriter is not None
            else None
        )
        if hparams is not None:
            self.write_hparams(folder, hparams)
        self.bar = (
            tqdm(total=steps, initial=done, unit="step", dynamic_ncols=True)
            if tqdm is not None and sys.stderr.isatty()
            else None
        )

    def rows_until(self, done: int) -> list[dict]:
        """The rows of an earlier run up to step ``done`` (a resumed run's
        checkpoint), under this run's columns, in step order: the steps a
        killed run logged after it are run again."""
        if not self.path.exists():
            return []
        with self.path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        kept = [
            {k: v for k, v in row.items() if k in self.columns}
            for row in rows
            if (row.get("step") or "").isdigit() and int(row["step"]) <= done
        ]
        return sorted(
            kept, key=lambda row: int(row["step"])
        )  # stable: eval after its step

    def write_hparams(self, folder, hparams: dict) -> None:
        """The run's settings: hparams.json, TensorBoard's hparams (tied to
        the evaluation's metrics) and the trackers' config."""
        plain = {k: plain_value(v) for k, v in hparams.items()}
        text = json.dumps(plain, indent=2, sort_keys=True)
        (folder / "hparams.json").write_text(text + "\n")
        if self.board is not None:
            shown = {
                k: v if isinstance(v, (int, float, str, bool)) else str(v)
                for k, v in plain.items()
            }
            metrics = {f"eval/{c.removeprefix('eval_')}": 0.0 for c in self.evals}
            for summary in hparams_summary(shown, metrics):
                self.board.file_writer.add_summary(summary)
        for tracker in self.trackers:
            tracker.config(plain)

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def step(
        self, step: int, epoch: int, loss: float, lr: float, extra: dict | None = None
    ) -> None:
        """One step's row; ``extra`` (at shown steps): its ``grad_norm``, each
        rank's ``busy`` seconds since the last shown step and ``memory`` (GiB)."""
        self.done, self.last_loss = step, loss
        self.first = loss if self.first is None else self.first
        if self.bar is not None:
            self.bar.update(1)
        if step % self.every and step != self.steps:
            return
        extra = extra or {}
        now = time.perf_counter()
        steps = max(step - self.tick_step, 1)
        seconds = (now - self.tick) / steps
        self.tick, self.tick_step = now, step
        rate = self.samples_per_step / seconds if seconds > 0 else math.inf
        tokens = rate * self.rates["tokens"] if self.rates.get("tokens") else None
        mfu = (
            rate * self.rates["flops"] / self.rates["peak"]
            if self.rates.get("flops") and self.rates.get("peak")
            else None
        )
        idle = None
        if extra.get("busy") and seconds > 0:
            busy = sum(extra["busy"]) / len(extra["busy"])
            idle = max(0.0, 1 - busy / (seconds * steps))
            self.busy_total = (self.busy_total or 0.0) + busy
            self.timed += seconds * steps
            ranks = self.busy_ranks or [0.0] * len(extra["busy"])
            self.busy_ranks = [a + b for a, b in zip(ranks, extra["busy"])]
            self.busy_steps += steps
        norm = extra.get("grad_norm")
        parts = dict(zip(self.losses, extra.get("losses") or ()))  # each output's loss
        memory = "".join(
            f"  {d} {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB"
            for d in self.cuda
        )
        if extra.get("memory"):
            memory = "  peak " + "/".join(f"{m:.2f}" for m in extra["memory"]) + " GiB"
        # cls_head 1.603496 + reg_head 0.355939: the loss's parts
        each = " + ".join(
            f"{k.removeprefix('loss_')} {v:.6f}" for k, v in parts.items()
        )
        each = f" ({each})" if each else ""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        else:
            shown = f"  {tokens:,.0f} tokens/s" if tokens is not None else ""
            shown += f"  grad norm {norm:.4g}" if norm is not None else ""
            shown += f"  idle {idle:.0%}" if idle is not None else ""
            shown += f"  MFU {mfu:.1%}" if mfu is not None else ""
            self.say(
                f"step {step}/{self.steps}  loss {loss:.6f}{each}  lr {lr:.3e}  {seconds:.3f} s/step  "
                f"{rate:,.0f} samples/s{shown}{memory}"
            )
        optional = dict(zip(RATES, [tokens, norm, idle, mfu]))
        row = {"step": step, "epoch": epoch, "loss": loss, **parts, "lr": lr}
        row |= {"seconds_per_step": seconds, "samples_per_second": rate}
        row |= {k: v for k, v in optional.items() if v is not None}
        self.csv.writerow(row)
        self.file.flush()
        scalars = {"loss": loss, **parts, "lr": lr}
        scalars |= {k: v for k, v in optional.items() if v is not None}
        self.scalars("train", scalars, step)

    def scalars(self, group: str, values: dict, step: int) -> None:
        """``values`` to TensorBoard as ``group/name`` and to the trackers."""
        named = {f"{group}/{k.removeprefix('eval_')}": v for k, v in values.items()}
        if self.board is not None:
            for tag, value in named.items():
                self.board.add_scalar(tag, value, step)
        for tracker in self.trackers:
            tracker.log(named, step)

    def evaluation(self, step: int, epoch: int, results: dict[str, float]) -> None:
        """An evaluation's row: ``results`` by column (``eval_loss``, ...)."""
        self.last_eval = results
        self.say(f"eval at step {step}: {shown(results)}")
        self.csv.writerow({"step": step, "epoch": epoch, **results})
        self.file.flush()
        self.scalars("eval", results, step)

    def close(self, started: int) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.board is not None:
            self.board.close()
        for tracker in self.trackers:
            tracker.close()
        steps, seconds = self.done - started, time.perf_counter() - self.start
        if steps:
            rate = self.samples_per_step * steps / seconds
            tokens = (
                f", {rate * self.rates['tokens']:,.0f} tokens/s"
                if self.rates.get("tokens")
                else ""
            )
            self.say(
                f"trained {steps} steps in {seconds:.1f} s ({rate:,.0f} samples/s{tokens}); "
                f"loss {self.first:.6f} -> {self.last_loss:.6f}"
            )
        if self.busy_total is not None and self.timed > 0:
            idle = max(0.0, 1 - self.busy_total / self.timed)
            predicted = self.rates.get("predicted")
            said = (
                f"; {self.rates.get('source', 'the cost model')} predicts a bubble of "
                f"{predicted:.0%} for {self.rates['schedule']}"
                if predicted is not None
                else (
                    f"; no predicted bubble for {self.rates['schedule']}: {self.rates['unpredicted']}"
                    if self.rates.get("unpredicted")
                    else ""
                )
            )
            each = ", ".join(f"{b / self.busy_steps:.4f}" for b in self.busy_ranks)
            if self.rates.get("busy"):  # predicted beside measured, rank by rank
                each = ", ".join(
                    f"{b / self.busy_steps:.4f} (predicted {p:.4f})"
                    for b, p in zip(self.busy_ranks, self.rates["busy"])
                )
            self.say(
                f"idle: {idle:.0%} of a step outside the stages' forward and backward "
                f"(the bubble, gradient synchronisation, optimizer, data){said}; "
                f"busy s/step per pipeline rank: {each}"
            )
        if self.last_eval is not None:
            self.say(f"eval {shown(self.last_eval, ', ')}")
        for d in self.cuda:
            self.say(
                f"peak memory {d}: {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB"
            )
        self.say(f"log: {self.path}")


def shown(results: dict[str, float], between: str = "  ") -> str:
    """``loss 0.123456  accuracy 91.20%``: an evaluation on the terminal
    (a loss to 6 places, an accuracy or F1 in percent)."""
    said = []
    for column, value in results.items():
        name = column.removeprefix("eval_")
        if name.startswith("loss"):
            text = f"{value:.6f}"
        elif "accuracy" in name or name.startswith("f1"):
            text = f"{value:.2%}"
        else:
            text = f"{value:.6g}"
        said.append(
            f"{name.replace('_', ' ', 1) if name.startswith('loss_') else name} {text}"
        )
    return between.join(said)


def plain_value(value):
    """A setting as JSON holds it: numbers, text, lists and mappings as
    they are, anything else as its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    return str(value)
