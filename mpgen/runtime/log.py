"""The training log: progress on the terminal, log.csv, TensorBoard, the summary."""

from __future__ import annotations

import csv
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
except ImportError:
    SummaryWriter = None


class Log:
    """Progress on the terminal (a tqdm bar on a TTY, else a line every
    --log-every steps), a CSV file, TensorBoard when installed, and the summary."""

    COLUMNS = ("step", "epoch", "loss", "lr", "seconds_per_step", "samples_per_second")
    COLUMNS += ("eval_loss", "eval_accuracy")
    COLUMNS += ("tokens_per_second", "grad_norm", "idle", "mfu")

    def __init__(
        self, folder, steps: int, done: int, every: int, size: int, devices, rates=None
    ):
        """``size``: samples per step; the peak memory of ``devices`` (CUDA ones)
        is shown. ``rates``: what the throughput columns need, where known:
        ``tokens`` per sample, training ``flops`` per sample, the job's
        ``peak`` FLOP/s, the ``predicted`` bubble and its ``schedule``."""
        self.steps, self.every, self.samples_per_step = steps, every, size
        self.rates = rates if rates is not None else {}
        # the ranks' busy seconds over the seconds timed, and each pipeline rank's
        self.busy_total, self.timed = None, 0.0
        self.busy_ranks, self.busy_steps = None, 0
        self.cuda = [d for d in devices if d.startswith("cuda")]
        self.first, self.last_loss, self.last_eval = None, None, None
        self.start = self.tick = time.perf_counter()
        self.done = self.tick_step = done
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "log.csv"
        kept = [] if done == 0 else self.rows_until(done)
        self.file = self.path.open("w", newline="")
        self.csv = csv.writer(self.file)
        self.csv.writerow(self.COLUMNS)
        self.csv.writerows(kept)
        self.board = SummaryWriter(str(folder)) if SummaryWriter is not None else None
        self.bar = (
            tqdm(total=steps, initial=done, unit="step", dynamic_ncols=True)
            if tqdm is not None and sys.stderr.isatty()
            else None
        )

    def rows_until(self, done: int) -> list[list[str]]:
        """The rows of an earlier run up to step ``done`` (a resumed run's
        checkpoint): the steps a killed run logged after it are run again."""
        if not self.path.exists():
            return []
        with self.path.open(newline="") as f:
            rows = list(csv.reader(f))[1:]
        return [row for row in rows if row and row[0].isdigit() and int(row[0]) <= done]

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
        memory = "".join(
            f"  {d} {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB"
            for d in self.cuda
        )
        if extra.get("memory"):
            memory = "  peak " + "/".join(f"{m:.2f}" for m in extra["memory"]) + " GiB"
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        else:
            shown = f"  {tokens:,.0f} tokens/s" if tokens is not None else ""
            shown += f"  grad norm {norm:.4g}" if norm is not None else ""
            shown += f"  idle {idle:.0%}" if idle is not None else ""
            shown += f"  MFU {mfu:.1%}" if mfu is not None else ""
            self.say(
                f"step {step}/{self.steps}  loss {loss:.6f}  lr {lr:.3e}  {seconds:.3f} s/step  "
                f"{rate:,.0f} samples/s{shown}{memory}"
            )
        optional = [tokens, norm, idle, mfu]
        self.csv.writerow(
            [step, epoch, loss, lr, seconds, rate, "", ""]
            + ["" if x is None else x for x in optional]
        )
        self.file.flush()
        if self.board is not None:
            self.board.add_scalar("train/loss", loss, step)
            self.board.add_scalar("train/lr", lr, step)
            for name, value in zip(
                ("tokens_per_second", "grad_norm", "idle", "mfu"), optional
            ):
                if value is not None:
                    self.board.add_scalar(f"train/{name}", value, step)

    def evaluation(
        self, step: int, epoch: int, loss: float, accuracy: list[float]
    ) -> None:
        self.last_eval = (loss, accuracy)
        shown = "".join(f"  accuracy {a:.2%}" for a in accuracy)
        self.say(f"eval at step {step}: loss {loss:.6f}{shown}")
        self.csv.writerow(
            [step, epoch, "", "", "", "", loss, accuracy[0] if accuracy else ""]
            + [""] * 4
        )
        self.file.flush()
        if self.board is not None:
            self.board.add_scalar("eval/loss", loss, step)
            for k, a in enumerate(accuracy):
                self.board.add_scalar(f"eval/accuracy{k or ''}", a, step)

    def close(self, started: int) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.board is not None:
            self.board.close()
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
            loss, accuracy = self.last_eval
            self.say(
                f"eval loss {loss:.6f}"
                + "".join(f", accuracy {a:.2%}" for a in accuracy)
            )
        for d in self.cuda:
            self.say(
                f"peak memory {d}: {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB"
            )
        self.say(f"log: {self.path}")
