"""Measured time: ``balance: time`` against every contiguous split, measured.

For small unbalanced models (a language model with a large embedding and
head; a CNN whose early, high-resolution layers dominate; a residual MLP),
on this CPU with one torch thread (what torchrun gives each rank on the
CPU):

1. ``mpgen profile`` measures each unit (NOTE [Measured time] in
   ``mpgen/commands/profile.py``) and writes the profile beside the spec;
2. the spec is built with ``placement: {auto: {balance: time}}`` over 2 and
   3 devices, and with ``balance: flops`` (the cost model's choice);
3. every contiguous 2- and 3-way split of the units is built as a pipeline
   program (``pp_<name>.py``'s stage classes) and its stages timed as the
   pipeline runs them, the splits taking turns in each round; a split's
   time is its slowest stage's median forward + backward. The two choices
   and the three fastest splits are then timed again, taking turns over
   three times the rounds (the profile, too, takes three times the rounds):
   on a shared machine the same stage measures differently from one round
   to the next, and the ratio rests on these few.

The table gives ``balance: time``'s split over the best split measured (the
Done-when of issue 30: within 5%), ``balance: flops``'s beside it, and for
those splits each stage's predicted time (the profile's units summed, plus
one stage call) over its measured time. Times are the main thread's CPU
time (``time.thread_time``: with one thread, torch computes there, and
another process on this shared machine does not lengthen it).

    python bench/stage_times.py [--quick] [--rounds N] [--out build/stage_times.md]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpgen.commands import profile as measure  # noqa: E402
from mpgen.compiler.driver import compile_spec  # noqa: E402
from mpgen.compiler.frontend.profile import read_profile  # noqa: E402
from mpgen.spec_schema.load import load_file  # noqa: E402

LM = """\
mpgen: 1
name: UnbalancedLM
inputs:
  idx: {shape: [batch, seq], dtype: int64}
blocks:
  FFN:
    params: [dim, hidden]
    layers:
      fc: {op: Linear, args: [$dim, $hidden]}
      act: {op: GELU}
      proj: {op: Linear, args: [$hidden, $dim]}
layers:
  wte: {op: Embedding, args: [8192, 256]}
  h: {op: FFN, args: [256, 1024], repeat: 4}
  norm: {op: LayerNorm, args: [256]}
  head: {op: Linear, args: [256, 8192]}
PLACEMENT
train:
  loss: CrossEntropyLoss
  optimizer: {op: AdamW, lr: 1.0e-3}
  batch_size: 8
  dims: {seq: 32}
"""

CNN = """\
mpgen: 1
name: EarlyHeavyCNN
inputs:
  images: [batch, 3, 64, 64]
layers:
  conv1: {op: Conv2d, args: [3, 32, 3], padding: 1}
  relu1: {op: ReLU}
  conv2: {op: Conv2d, args: [32, 32, 3], padding: 1}
  relu2: {op: ReLU}
  pool1: {op: MaxPool2d, args: [2]}
  conv3: {op: Conv2d, args: [32, 64, 3], padding: 1}
  relu3: {op: ReLU}
  pool2: {op: MaxPool2d, args: [2]}
  conv4: {op: Conv2d, args: [64, 64, 3], padding: 1}
  pool3: {op: AdaptiveAvgPool2d, args: [[1, 1]]}
  flat: {op: torch.flatten, start_dim: 1}
  fc: {op: Linear, args: [64, 10]}
PLACEMENT
train:
  loss: CrossEntropyLoss
  optimizer: {op: SGD, lr: 0.05, momentum: 0.9}
  batch_size: 8
"""

MLP = """\
mpgen: 1
name: WideThenNarrowMLP
inputs:
  x: [batch, 512]
layers:
  wide: {op: Linear, args: [512, 2048]}
  act1: {op: GELU}
  mid: {op: Linear, args: [2048, 512]}
  act2: {op: GELU}
  h: {op: Linear, args: [512, 512], repeat: 3}
  head: {op: Linear, args: [512, 10]}
PLACEMENT
train:
  loss: CrossEntropyLoss
  optimizer: {op: Adam, lr: 1.0e-3}
  batch_size: 64
"""

MODELS = {"lm": ("language model, large embedding and head", LM),
          "cnn": ("CNN, early layers at full resolution", CNN),
          "mlp": ("MLP, a wide layer first", MLP)}


def spec_text(template: str, devices: int, balance: str) -> str:
    names = ", ".join(f"cuda:{k}" for k in range(devices))
    return template.replace("PLACEMENT", f"placement:\n  auto: {{devices: [{names}], "
                                         f"balance: {balance}}}")


def splits(units: int, stages: int) -> list[tuple[int, ...]]:
    """Every contiguous split of ``units`` into ``stages`` non-empty stages,
    as bounds (0, ..., units)."""
    return [(0, *cuts, units) for cuts in itertools.combinations(range(1, units), stages - 1)]


def load_splits(path: Path, bounds: list[tuple[int, ...]], labels: list[str],
                folder: Path) -> list:
    """Each split of the spec at ``path`` built as a pipeline program and
    loaded, ready to time on the CPU (its one thread's CPU time)."""
    loaded = load_file(path)
    programs = []
    for i, split in enumerate(bounds):
        graph = measure.compile_loaded(measure.split_spec(loaded, [labels[b] for b in split[:-1]]))
        where = folder / f"split{i}"
        where.mkdir(parents=True)
        module = measure.write_program(graph, where)
        programs.append(measure.load_program(where, module, "cpu", time.thread_time))
    return programs


def measure_splits(programs: list, keep: list[int], rounds: int) -> list:
    """Each split's per-stage median (forward, backward) ms, the splits
    taking turns in each round; then ``keep``'s (the choices) and the three
    fastest's again, taking turns over three times the rounds: the
    comparison that decides the ratio gets the most samples."""
    found = measure.medians(programs, 2, rounds)
    slowest = [max(f + b for f, b in stages) for stages in found]
    again = sorted(set(keep) | set(sorted(range(len(found)), key=slowest.__getitem__)[:3]))
    for i, times in zip(again, measure.medians([programs[i] for i in again], 1, 3 * rounds)):
        found[i] = times
    return found


def model_report(key: str, rounds: int, quick: bool) -> tuple[list[str], list[str]]:
    """The rows of the split table and of the predicted-vs-measured table."""
    import torch

    title, template = MODELS[key]
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="mpgen-stage-times-") as tmp:
        folder = Path(tmp)
        path = folder / f"{key}.yaml"
        path.write_text(spec_text(template, 2, "time"), encoding="utf-8")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            target, text = measure.profile(path, ["cpu"], repeats=3 * rounds, threads=1,
                                           clock=time.thread_time)
            measure.write_profile(target, text)
            profile = read_profile(path)
            unit_ms = [f + b for f, b in profile.unit_ms("cpu")]
            call = sum(next((f, b) for k, f, b in profile.call if k == "cpu"))
            labels = [u.unit for u in profile.units]
            for count in ((2,) if quick else (2, 3)):
                chosen = {}
                for balance in ("time", "flops"):
                    path.write_text(spec_text(template, count, balance), encoding="utf-8")
                    chosen[balance] = tuple(compile_spec(path).layout.auto.split.bounds)
                every = splits(len(labels), count)
                time_i, flops_i = every.index(chosen["time"]), every.index(chosen["flops"])
                programs = load_splits(path, every, labels, folder / f"k{count}")
                found = measure_splits(programs, [time_i, flops_i], rounds)
                slowest = [max(f + b for f, b in stages) for stages in found]
                best = min(range(len(every)), key=lambda i: slowest[i])
                rows.append(
                    f"| {key} ({title}) | {count} | {len(labels)} | {len(every)} | "
                    f"{_split(chosen['time'], labels)} | {_split(every[best], labels)} | "
                    f"{slowest[time_i] / slowest[best]:.3f} | "
                    f"{slowest[flops_i] / slowest[best]:.3f} ({_split(chosen['flops'], labels)}) |")
                for name, i in (("time", time_i), ("best", best), ("flops", flops_i)):
                    predicted = [call + sum(unit_ms[a:b]) for a, b in zip(every[i], every[i][1:])]
                    measured = [f + b for f, b in found[i]]
                    ratios.append(
                        f"| {key} | {count} | {name}: {_split(every[i], labels)} | "
                        + ", ".join(f"{p:.2f} / {m:.2f}" for p, m in zip(predicted, measured))
                        + " | " + ", ".join(f"{p / m:.2f}" for p, m in zip(predicted, measured))
                        + " |")
        finally:
            torch.set_num_threads(before)
    return rows, ratios


def _split(bounds: tuple[int, ...], labels: list[str]) -> str:
    """``wte-h.2 / h.3-head``: each stage's first and last unit."""
    return " / ".join(labels[a] if b - a == 1 else f"{labels[a]}-{labels[b - 1]}"
                      for a, b in zip(bounds, bounds[1:]))


def report(rounds: int, quick: bool) -> str:
    rows, ratios = [], []
    for key in (("lm",) if quick else tuple(MODELS)):
        found = model_report(key, rounds, quick)
        rows += found[0]
        ratios += found[1]
    worst = max(float(r.split("|")[7]) for r in rows)
    return "\n".join([
        "| model | stages | units | splits measured | `balance: time` chose | best measured "
        "| time's slowest / best | flops's slowest / best (its split) |",
        "|---|---:|---:|---:|---|---|---:|---|",
        *rows,
        "",
        f"`balance: time`'s split is at most {(worst - 1) * 100:.1f}% slower than the best "
        f"contiguous split measured ({'within' if worst <= 1.05 else 'NOT within'} 5%).",
        "",
        "Each stage's predicted time (the profile's units summed, plus one stage call) over "
        "its measured time, in ms of one training batch (forward + backward):",
        "",
        "| model | stages | split | predicted / measured ms per stage | ratio per stage |",
        "|---|---:|---|---|---|",
        *ratios,
        "",
    ])


def section(quick: bool, rounds: int, emit) -> None:
    """The stage-times section of docs/benchmarks.md."""
    emit("## Measured stage times and `balance: time`\n")
    emit("Reproduce: `python -m bench --only stages` (or `python bench/stage_times.py`). "
         "`mpgen profile` measures each unit on this CPU (one torch thread); the spec is "
         "placed by `balance: time`, and every contiguous 2- and 3-way split is built as a "
         "pipeline program and its stages timed (forward and backward, the splits taking "
         f"turns, median of {rounds} rounds, the choices and the three fastest again over "
         f"{3 * rounds}; CPU time of the one thread). A split's time is its slowest stage.\n")
    emit(report(rounds, quick))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one model, 2 stages")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "stage_times.md")
    args = parser.parse_args(argv)
    text = report(args.rounds, args.quick)
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
