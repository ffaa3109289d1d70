"""What would pipelining buy? The schedule simulator on ResNet-50 and ResNet-101.

``mpgen.compiler.analysis.schedule`` predicts the step time of GPipe and 1F1B
from the cost model (NOTE [Schedule model]). This benchmark compiles two
models and prints, for K stages and M micro-batches, the predicted speedup
over one device and over the plain split (the generated model, M = 1), the
bubble, and how many micro-batches' activations stage 0 holds:

* **ResNet-50** as ``examples/resnet50.yaml`` places it (stem, layer1 and
  layer2 on cuda:0; layer3, layer4 and the head on cuda:1: the split of
  PyTorch's model-parallel tutorial), at the tutorial's sizes (batch 120,
  128 x 128 images). Twice: on the default hardware (100 TFLOP/s per device,
  25 GB/s between devices) and on a link calibrated so that the plain split
  is 7% slower than one device, as the tutorial measured; the tutorial's
  own pipelined times stand beside.
* **ResNet-101** (``examples/resnet50.yaml`` with 22 repeated blocks in
  layer3: torchvision's [3, 4, 23, 3]) at 224 x 224, split by
  ``placement: {auto: ...}`` balancing FLOPs over 2, 4 and 8 devices, with
  torchgpipe's published speedups beside. torchgpipe recomputes each
  partition's forward in backward (checkpointing), so a column gives the
  prediction with the backward at 3x the forward instead of 2x.

Every quantity is linear in the batch, so the ratios depend on the batch
size only through M. The markdown goes to stdout and to ``--out``.

    python bench/pipeline_sim.py [--tflops 100] [--gbps 25] [--out build/pipeline_sim.md]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpgen.compiler.analysis import schedule  # noqa: E402
from mpgen.compiler.analysis.schedule import GPIPE, ONE_F_ONE_B, Pipeline  # noqa: E402
from mpgen.compiler.driver import compile_spec  # noqa: E402

RESNET50 = ROOT / "examples" / "resnet50.yaml"

#: PyTorch's "Single-Machine Model Parallel Best Practices": seconds for 3
#: batches of 120 images (128 x 128), ResNet-50 over two GPUs.
TUTORIAL = {"single": 3.75, "plain": 4.02, 6: 2.51, 10: 2.43}  # M: split 20, split 12
#: torchgpipe's ResNet-101 speed benchmark (docs/benchmarks.rst, Tesla P40):
#: partitions -> (micro-batches, speedup over one GPU). Its baseline trains a
#: batch of 118 on one GPU at 95.862 samples/s; the pipelines batches of
#: 25000, 5632 and 5400 (micro-batches of 15, 22 and 36).
TORCHGPIPE = {2: (1667, 1.414), 4: (256, 2.774), 8: (150, 4.294)}
TORCHGPIPE_SAMPLES_PER_SECOND = 95.862
#: Between P40s: PCIe 3.0 x16 (15.75 GB/s in theory), about 12 GB/s in practice.
TORCHGPIPE_LINK = 12e9

MICROBATCHES_50 = (1, 2, 4, 6, 10, 20, 60, 120)
MICROBATCHES_101 = (1, 4, 8, 32)


def sized(text: str, batch: int, side: int, devices: int = 0) -> str:
    """The spec at batch ``batch`` and ``side`` x ``side`` images; with
    ``devices``, placed by ``auto`` over that many balancing FLOPs."""
    text = re.sub(r"batch_size: \d+", f"batch_size: {batch}", text)
    text = re.sub(r"dims: \{[^}]*\}", f"dims: {{height: {side}, width: {side}}}", text)
    if devices:
        names = ", ".join(f"cuda:{i}" for i in range(devices))
        text = re.sub(r"(?ms)^placement:.*?(?=^\S|\Z)",
                      f"placement:\n  auto: {{devices: [{names}], balance: flops}}\n\n", text)
    return text


def resnet101(text: str) -> str:
    return text.replace("name: ResNet50", "name: ResNet101").replace(
        "layer3: {op: Bottleneck, args: [1024, 256], repeat: 5}",
        "layer3: {op: Bottleneck, args: [1024, 256], repeat: 22}")


def compile_text(text: str, folder: Path, name: str):
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return compile_spec(path, time_limit=None)


def with_link(batch: Pipeline, plain_over_single: float) -> Pipeline:
    """``batch`` with its transfers scaled so that plain / single device is
    ``plain_over_single``."""
    scale = (plain_over_single - 1) * batch.single_device / (2 * sum(batch.transfers))
    return Pipeline(batch.forward, batch.backward, tuple(t * scale for t in batch.transfers),
                    batch.devices)


def x(value: float) -> str:
    return f"{value:.2f}x"


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def rows_for(batch: Pipeline, microbatches, measured=None,
             overlap: bool = False) -> list[list[str]]:
    """One row per M: speedups over one device and the plain split, bubbles,
    stage 0's activations relative to the plain split. ``measured``: M ->
    a published figure for the last column."""
    rows = []
    for m in microbatches:
        gpipe = schedule.predict(batch, m, GPIPE, overlap)
        one = schedule.predict(batch, m, ONE_F_ONE_B, overlap)
        row = [str(m), x(gpipe.speedup_over_single), x(gpipe.speedup_over_plain),
               x(one.speedup_over_single), pct(gpipe.bubble), pct(one.bubble),
               f"{one.peak_in_flight[0]}/{m}"]
        if measured is not None:
            row.append(measured.get(m, ""))
        rows.append(row)
    return rows


COLUMNS = ["M", "GPipe vs 1 device", "GPipe vs plain", "1F1B vs 1 device", "bubble GPipe",
           "bubble 1F1B", "stage 0 activations, 1F1B (GPipe: M/M)"]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def stages_line(batch: Pipeline) -> str:
    total = sum(batch.forward)
    shares = ", ".join(f"{f / total:.0%}" for f in batch.forward)
    return (f"{batch.stages} stages ({', '.join(batch.devices)}), forward FLOPs {shares}; "
            f"plain split / one device = {batch.plain / batch.single_device:.3f}")


def resnet50_section(text: str, folder: Path, flops: float, link: float) -> list[str]:
    graph = compile_text(sized(text, 120, 128), folder, "resnet50.yaml")
    batch = schedule.stage_times(graph, flops, link)
    calibrated = with_link(batch, TUTORIAL["plain"] / TUTORIAL["single"])
    measured = {m: f"{TUTORIAL['single'] / TUTORIAL[m]:.2f}x / {TUTORIAL['plain'] / TUTORIAL[m]:.2f}x"
                for m in (6, 10)}
    measured[1] = f"{TUTORIAL['single'] / TUTORIAL['plain']:.2f}x / 1.00x"
    header = [*COLUMNS, "tutorial measured (vs 1 GPU / vs plain)"]
    return [
        "### ResNet-50 over 2 devices (the tutorial's split), batch 120, 128 x 128",
        "",
        f"Default hardware: {stages_line(batch)}.",
        "",
        table(COLUMNS, rows_for(batch, MICROBATCHES_50)),
        "",
        f"Link calibrated to the tutorial (plain 7% slower than one GPU): "
        f"{stages_line(calibrated)}.",
        "",
        table(header, rows_for(calibrated, MICROBATCHES_50, measured)),
    ]


def resnet101_section(text: str, folder: Path) -> list[str]:
    header = ["K", *COLUMNS, "GPipe vs 1 device, recompute", "torchgpipe measured"]
    rows = []
    notes = []
    for k, (chunks, speedup) in TORCHGPIPE.items():
        graph = compile_text(sized(resnet101(text), 128, 224, k), folder, f"resnet101_{k}.yaml")
        # One P40 as torchgpipe's baseline measured it: its samples/s times
        # the training FLOPs of one sample (forward, and backward at 2x).
        flops = sum(u.flops for u in graph.costs.units) / 128
        rate = TORCHGPIPE_SAMPLES_PER_SECOND * (1 + schedule.BACKWARD_FACTOR) * flops
        batch = schedule.stage_times(graph, rate, TORCHGPIPE_LINK)
        recompute = schedule.stage_times(graph, rate, TORCHGPIPE_LINK, backward_factor=3)
        notes.append(f"- K = {k}: {stages_line(batch)}.")
        for m, row in zip((*MICROBATCHES_101, chunks),
                          rows_for(batch, (*MICROBATCHES_101, chunks), overlap=True)):
            again = schedule.predict(recompute, m, GPIPE, overlap=True)
            rows.append([str(k), *row, x(batch.single_device / again.makespan),
                         x(speedup) if m == chunks else ""])
    return [
        "### ResNet-101, 224 x 224, auto placement balancing FLOPs",
        "",
        f"torchgpipe's hardware: a device at the rate its one-GPU baseline measured "
        f"({TORCHGPIPE_SAMPLES_PER_SECOND} samples/s), links at {TORCHGPIPE_LINK / 1e9:g} GB/s, "
        "transfers on their own streams (torchgpipe copies on separate CUDA streams).",
        "",
        *notes,
        "",
        table(header, rows),
    ]


def report(tflops: float, gbps: float) -> str:
    """The simulator's tables (markdown) at ``tflops`` TFLOP/s per device and
    ``gbps`` GB/s between devices."""
    flops, link = tflops * 1e12, gbps * 1e9
    text = RESNET50.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lines = [f"Backward = {schedule.BACKWARD_FACTOR} x forward. Default hardware: devices at "
                 f"{tflops:g} TFLOP/s, links at {gbps:g} GB/s, transfers occupy "
                 "the sender.", "",
                 *resnet50_section(text, folder, flops, link), "",
                 *resnet101_section(text, folder)]
    return "\n".join(lines) + "\n"


def section(emit) -> None:
    """The pipeline-simulator section of docs/benchmarks.md."""
    emit("## The pipeline schedule simulator\n")
    emit("Reproduce: `python -m bench --only pipeline` (or `python bench/pipeline_sim.py`). "
         "`mpgen.compiler.analysis.schedule` predicts a training step's time for GPipe and "
         "1F1B from the cost model's per-layer FLOPs and cut bytes (docs/pipelining.md), "
         "for K stages and M micro-batches; no time is measured here. Beside the "
         "predictions: the times PyTorch's model-parallel tutorial measured for ResNet-50 "
         "on two GPUs, and torchgpipe's published ResNet-101 speedups.\n")
    emit(report(schedule.DEFAULT_FLOPS_PER_SECOND / 1e12,
                schedule.DEFAULT_LINK_BYTES_PER_SECOND / 1e9))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tflops", type=float, default=schedule.DEFAULT_FLOPS_PER_SECOND / 1e12,
                        help="FLOP/s of one device, in TFLOP/s (default %(default)s)")
    parser.add_argument("--gbps", type=float,
                        default=schedule.DEFAULT_LINK_BYTES_PER_SECOND / 1e9,
                        help="bytes/s between two devices, in GB/s (default %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "pipeline_sim.md")
    args = parser.parse_args(argv)
    text = report(args.tflops, args.gbps)
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
