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

    def __init__(self, folder, steps: int, done: int, every: int, size: int, devices):
        """``size``: samples per step; the peak memory of ``devices`` (CUDA ones) is shown."""
        self.steps, self.every, self.samples_per_step = steps, every, size
        self.cuda = [d for d in devices if d.startswith("cuda")]
        self.first, self.last_loss, self.last_eval = None, None, None
        self.start = self.tick = time.perf_counter()
        self.done = self.tick_step = done
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "log.csv"
        new = not self.path.exists() or done == 0
        self.file = self.path.open("w" if new else "a", newline="")
        self.csv = csv.writer(self.file)
        if new:
            self.csv.writerow(self.COLUMNS)
        self.board = SummaryWriter(str(folder)) if SummaryWriter is not None else None
        self.bar = (
            tqdm(total=steps, initial=done, unit="step", dynamic_ncols=True)
            if tqdm is not None and sys.stderr.isatty()
            else None
        )

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def step(self, step: int, epoch: int, loss: float, lr: float) -> None:
        self.done, self.last_loss = step, loss
        self.first = loss if self.first is None else self.first
        if self.bar is not None:
            self.bar.update(1)
        if step % self.every and step != self.steps:
            return
        now = time.perf_counter()
        seconds = (now - self.tick) / max(step - self.tick_step, 1)
        self.tick, self.tick_step = now, step
        rate = self.samples_per_step / seconds if seconds > 0 else math.inf
        memory = "".join(
            f"  {d} {torch.cuda.max_memory_allocated(d) / 2**30:.2f} GiB"
            for d in self.cuda
        )
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        else:
            self.say(
                f"step {step}/{self.steps}  loss {loss:.6f}  lr {lr:.3e}  {seconds:.3f} s/step  "
                f"{rate:,.0f} samples/s{memory}"
            )
        self.csv.writerow([step, epoch, loss, lr, seconds, rate, "", ""])
        self.file.flush()
        if self.board is not None:
            self.board.add_scalar("train/loss", loss, step)
            self.board.add_scalar("train/lr", lr, step)

    def evaluation(
        self, step: int, epoch: int, loss: float, accuracy: list[float]
    ) -> None:
        self.last_eval = (loss, accuracy)
        shown = "".join(f"  accuracy {a:.2%}" for a in accuracy)
        self.say(f"eval at step {step}: loss {loss:.6f}{shown}")
        self.csv.writerow(
            [step, epoch, "", "", "", "", loss, accuracy[0] if accuracy else ""]
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
            self.say(
                f"trained {steps} steps in {seconds:.1f} s ({self.samples_per_step * steps / seconds:,.0f} samples/s); "
                f"loss {self.first:.6f} -> {self.last_loss:.6f}"
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
