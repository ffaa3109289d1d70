"""One GPU, the naive split, micro-batched: PyTorch's model-parallel tutorial's experiment on GPUs.

PyTorch's "Single-Machine Model Parallel Best Practices" trains ResNet-50
(batch 120, 128 x 128 images) on one GPU, split naively over two (7% slower)
and pipelined with micro-batches (up to 1.54x faster). This script runs the
same experiment on the code mpgen generates: it builds ``--spec`` (default
``examples/resnet50.yaml``, the tutorial's split) with mpgen's library API
into a temporary folder, imports the generated model (it never imports
mpgen) and times a training step of each build:

* **one GPU**: the spec built with ``--device-map cuda:0`` (every device
  onto one);
* **naive split**: the spec's own layout;
* **micro-batched**: the spec plus ``pipeline: {microbatches: M}`` for each
  ``--microbatches`` M (the spec's YAML data edited and written next to the
  build).

A step is what the tutorial times: forward, an MSE loss against a fixed
random target (the tutorial's one-hot labels cost the same), backward and
an SGD step (lr 0.001), with the inputs already on the first device. After
``--warmup`` steps, ``--repeats`` steps are timed one by one between
``torch.cuda.synchronize`` calls; the table gives the median, the speedup
over one GPU, the peak of ``torch.cuda.max_memory_allocated`` on each device
(reset before each build's run) and the schedule simulator's prediction
(``mpgen.compiler.analysis.schedule``, GPipe, transfers on the sender as
the generated code copies on the default stream: docs/pipelining.md) with
the device's rate fitted to the measured one-GPU step and links at
``--gbps``.

With fewer GPUs than the layout needs (or ``--gpus 1``), everything runs
on cuda:0 and the table shows what one GPU can measure: the naive split's and
the micro-batched builds' own code runs under
``mpgen.testing.merged_devices("cuda:0")``, so every ``.to("cuda:N")`` is a
same-device no-op, beside a control row (the one-GPU build under the same
mode, which intercepts every torch call) that those rows are compared with:
the cost of the generated transfers and of micro-batching without the
parallelism. (A build with ``--device-map cuda:0`` has no transfer left to
measure: mpgen merges the sections of one device.)

``--device cpu`` is a smoke run of the same code on the CPU: virtual CUDA
devices (``mpgen.testing.virtual_devices``; memory is the bytes of live
tensors per device, times are CPU times), a batch of 8, 64 x 64 images, one
warmup step and two repeats unless given. The project's tests run it.

Exit status: 0 after measuring, and 0 with one line saying so where no GPU
is visible (nothing measured; ``--device cpu`` runs the smoke instead); 2
for a bad argument or a spec mpgen refuses (``FILE:LINE:COL: message``).

    python bench/gpu_pipeline.py [--spec examples/resnet50.yaml] [--batch 120]
        [--image-size 128] [--microbatches 2,4,6,8,12] [--warmup 3] [--repeats 10]
        [--gpus N] [--gbps 25] [--device {cuda,cpu}] [--out build/gpu_pipeline.md]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpgen.compiler.analysis import schedule  # noqa: E402
from mpgen.compiler.codegen.common import file_names  # noqa: E402
from mpgen.compiler.ir import Graph  # noqa: E402
from mpgen.compiler.driver import compile_spec, generate  # noqa: E402
from mpgen.errors import MpgenError  # noqa: E402
from mpgen.spec_schema.load import load_file  # noqa: E402
from mpgen.testing import merged_devices, virtual_devices  # noqa: E402

RESNET50 = ROOT / "examples" / "resnet50.yaml"
LR = 0.001  # the tutorial's SGD
NO_GPU = ("gpu_pipeline: no CUDA GPU visible, nothing measured "
          "(--device cpu runs a smoke test on the CPU)")
ONE_GPU = "one GPU"
CONTROL = "one GPU under merged_devices (control)"


@dataclass(frozen=True)
class Run:
    """One build to measure: ``microbatches`` None is the plain forward;
    ``device_map`` the build's --device-map; ``merged`` runs it under
    ``merged_devices("cuda:0")``; speedups are over the row ``reference``."""

    label: str
    microbatches: Optional[int]
    device_map: Optional[dict[str, str]]
    merged: bool = False
    reference: str = ONE_GPU


@dataclass
class Result:
    run: Run
    graph: Optional[Graph] = None
    seconds: Optional[float] = None  # median per batch
    peaks: dict[int, int] = field(default_factory=dict)  # device index -> bytes
    failed: str = ""


def plan_runs(split: int, microbatches: list[int]) -> list[Run]:
    """The builds to measure: over ``split`` GPUs as the layout asks, or, with
    ``split`` 0, everything on cuda:0 (fewer GPUs than the layout needs)."""
    one = Run(ONE_GPU, None, {"*": "cuda:0"})
    if split:
        return [one, Run(f"naive split over {split} GPUs", None, None),
                *(Run(f"micro-batched, M = {m}", m, None) for m in microbatches)]
    merged = dict(merged=True, reference=CONTROL)
    return [one, Run(CONTROL, None, {"*": "cuda:0"}, **merged),
            Run("naive split, all on cuda:0", None, None, **merged),
            *(Run(f"micro-batched, M = {m}, all on cuda:0", m, None, **merged)
              for m in microbatches)]


def layout_gpus(graph: Graph) -> tuple[tuple[str, ...], int]:
    """The devices of the spec's layout, and how many GPUs it needs (its
    highest cuda:N plus one)."""
    devices = tuple(dict.fromkeys(s.device for s in graph.spec_plan.sections))
    return devices, 1 + max((int(d.split(":")[1]) for d in devices if d.startswith("cuda:")),
                            default=0)


def variant(data: dict, batch: int, image_size: int, microbatches: Optional[int]) -> dict:
    """The spec's data at ``batch`` (and ``image_size`` for symbolic height and
    width), with ``pipeline: {microbatches: M}`` or without ``pipeline:``."""
    data = copy.deepcopy(data)
    train = data.setdefault("train", {})
    train["batch_size"] = batch
    for dim in ("height", "width"):
        if dim in train.get("dims", {}):
            train["dims"][dim] = image_size
    if microbatches is None:
        data.pop("pipeline", None)
    else:
        data["pipeline"] = {**data.get("pipeline", {}), "microbatches": microbatches}
    return data


def build(data: dict, run: Run, folder: Path):
    """Build ``data`` for ``run`` into ``folder``; the graph and the model class."""
    tag = f"m{run.microbatches or 1}_{'map' if run.device_map else 'spec'}"
    spec = folder / f"{tag}.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    result = generate(spec, run.device_map, time_limit=None)
    path = folder / tag / file_names(result.graph)["model"]
    path.parent.mkdir()
    path.write_text(result.files[path.name], encoding="utf-8")
    module_spec = importlib.util.spec_from_file_location(f"gpu_pipeline_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return result.graph, getattr(module, result.graph.name)


def make_inputs(graph: Graph, device: str) -> dict[str, torch.Tensor]:
    """Random inputs at the build's training sizes, by forward's argument names."""
    sizes = dict(graph.dims)
    inputs = {}
    for t in graph.inputs:
        shape = t.type.concrete(sizes)
        if t.type.dtype.startswith(("int", "uint")) or t.type.dtype == "bool":
            inputs[t.var] = torch.randint(0, t.high or 2, shape, device=device)
        else:
            inputs[t.var] = torch.randn(shape, dtype=getattr(torch, t.type.dtype), device=device)
    return inputs


def measure(model_class, graph: Graph, gpus: int, warmup: int, repeats: int):
    """Median seconds of a training step and each device's peak allocated bytes."""
    devices = range(gpus)
    torch.manual_seed(0)
    model = model_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs = make_inputs(graph, graph.plan.sections[0].device)
    targets = None

    def step() -> None:
        nonlocal targets
        outputs = model(**inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if targets is None:
            targets = [torch.randn_like(o).detach() for o in outputs]
        loss = sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(outputs, targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), {d: torch.cuda.max_memory_allocated(d) for d in devices}


def run_one(run: Run, model_class, graph: Graph, gpus: int, args):
    """Measure one build on fresh memory statistics: (seconds, peaks, failure)."""
    gc.collect()
    torch.cuda.empty_cache()
    for d in range(gpus):
        torch.cuda.reset_peak_memory_stats(d)
    mode = merged_devices("cuda:0") if run.merged else contextlib.nullcontext()
    try:
        with mode:
            seconds, peaks = measure(model_class, graph, gpus, args.warmup, args.repeats)
    except torch.cuda.OutOfMemoryError:
        return None, {}, "out of memory"
    except (RuntimeError, ValueError) as exc:  # the build ran and failed: a finding too
        return None, {}, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        gc.collect()
    return seconds, peaks, ""


# -- the table -------------------------------------------------------------------

def prediction(result: Result, one_gpu: Result, link: float) -> Optional[float]:
    """The simulator's speedup over one device for the spec's layout of this
    row's build (GPipe at its M; the plain split at M = 1), with the device's
    rate fitted to the measured one-GPU step; None without either."""
    if result.graph is None or one_gpu.seconds is None:
        return None
    if result.run.device_map:  # built onto one device: no transfer, nothing overlaps
        return 1.0
    flops = sum(u.flops for u in result.graph.costs.units) * (1 + schedule.BACKWARD_FACTOR)
    batch = schedule.stage_times(result.graph, flops / one_gpu.seconds, link)
    run = schedule.predict(batch, result.run.microbatches or 1, schedule.GPIPE)
    return run.speedup_over_single


def memory(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{value} B"


def table(results: list[Result], gpus: int, link: float) -> str:
    by_label = {r.run.label: r for r in results}
    one_gpu = by_label[ONE_GPU]
    header = ["run", "time per batch", "vs one GPU",
              *(f"peak cuda:{d}" for d in range(gpus)),
              "simulator: time per batch", "simulator: vs one GPU"]
    lines = ["| " + " | ".join(header) + " |",
             "|---|" + "---:|" * (len(header) - 1)]
    for r in results:
        reference = by_label[r.run.reference].seconds
        predicted = prediction(r, one_gpu, link)
        if r.seconds is None:
            cells = [r.failed or "not run", "", *([""] * gpus)]
        else:
            cells = [f"{1000 * r.seconds:.1f} ms",
                     f"{reference / r.seconds:.2f}x" if reference else "",
                     *(memory(r.peaks[d]) for d in range(gpus))]
        simulated = (["", ""] if predicted is None else
                     [f"{1000 * one_gpu.seconds / predicted:.1f} ms", f"{predicted:.2f}x"])
        lines.append("| " + " | ".join([r.run.label, *cells, *simulated]) + " |")
    return "\n".join(lines)


def summary(results: list[Result]) -> list[str]:
    """On one GPU: what the generated transfers and micro-batching cost."""
    by_label = {r.run.label: r for r in results}
    control = by_label[CONTROL].seconds if CONTROL in by_label else None
    lines = []
    for r in results:
        if r.run.merged and r.run.label != CONTROL and r.seconds and control:
            what = ("the generated transfers (same-device .to)" if r.run.microbatches is None
                    else f"{r.run.microbatches} micro-batches and the transfers")
            lines.append(f"- {what}: {1000 * (r.seconds - control):+.1f} ms per batch "
                         f"({r.seconds / control - 1:+.1%}) over the control")
    return lines


# -- main ----------------------------------------------------------------------------

def microbatch_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 2,4,6, got {text!r}")
    return values


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=RESNET50)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run on virtual CUDA devices (default cuda)")
    parser.add_argument("--batch", type=int, help="batch size (120; --device cpu: 8)")
    parser.add_argument("--image-size", type=int,
                        help="height and width where the spec leaves them symbolic "
                        "(128; --device cpu: 64)")
    parser.add_argument("--microbatches", type=microbatch_list, default=[2, 4, 6, 8, 12],
                        help="the values of M, comma-separated (default 2,4,6,8,12)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (3; --device cpu: 1)")
    parser.add_argument("--repeats", type=int, help="timed steps (10; --device cpu: 2)")
    parser.add_argument("--gpus", type=int,
                        help="GPUs to use (default: all; --device cpu: the spec's devices)")
    parser.add_argument("--gbps", type=float,
                        default=schedule.DEFAULT_LINK_BYTES_PER_SECOND / 1e9,
                        help="the simulator's link between two GPUs, GB/s (default %(default)g)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_pipeline.md")
    args = parser.parse_args(argv)
    smoke = args.device == "cpu"
    for name, gpu, cpu in (("batch", 120, 8), ("image_size", 128, 64), ("warmup", 3, 1),
                           ("repeats", 10, 2)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if smoke else gpu)
    for name in ("batch", "image_size", "repeats", "gpus"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def spec_error(args, exc: MpgenError) -> MpgenError:
    """The spec's own errors, at its own lines, when it has any; else ``exc``
    (an error of the edited variant: its batch, image size or pipeline)."""
    try:
        compile_spec(args.spec, time_limit=None)
    except MpgenError as own:
        return own
    return exc


def build_all(args, data: dict, folder: Path, gpus: Optional[int]):
    """Build every run: ([(result without measurements, model class)], notes,
    the layout's devices, the GPUs the runs use). ``gpus``: those present
    (None: virtual ones, as many as the layout needs)."""
    builds: dict = {}

    def built(run: Run):
        key = (run.microbatches, tuple(sorted((run.device_map or {}).items())))
        if key not in builds:
            spec = variant(data, args.batch, args.image_size, run.microbatches)
            builds[key] = build(spec, run, folder)
        return builds[key]

    try:
        split, _ = built(Run("naive split", None, None))
    except MpgenError as exc:
        raise spec_error(args, exc) from None
    devices, needed = layout_gpus(split)
    gpus = gpus or needed
    results, refused = [], {}
    for run in plan_runs(needed if gpus >= needed else 0, args.microbatches):
        try:
            graph, model_class = built(run)
        except MpgenError as exc:  # a micro-batched variant: its M or pipeline:
            # Its position is in the temporary variant: the message alone.
            message = "; ".join(e.message for e in getattr(exc, "errors", [exc]))
            refused.setdefault(message, []).append(run.microbatches)
            results.append((Result(run, failed="not built (see below)"), None))
            continue
        results.append((Result(run, graph), model_class))
    notes = [f"- not built: `pipeline: {{microbatches: M}}` for M = "
             f"{', '.join(map(str, dict.fromkeys(ms)))}, which mpgen refused: {message}"
             for message, ms in refused.items()]
    return results, notes, devices, needed if gpus >= needed else 1


def header(args, graph: Graph, devices: tuple[str, ...], used: int, smoke: bool) -> list[str]:
    sizes = dict(graph.dims)
    shapes = ", ".join(f"{t.name} {list(t.type.concrete(sizes))}" for t in graph.inputs)
    if smoke:
        machine = ("Virtual CUDA devices on the CPU (mpgen.testing.virtual_devices), a smoke "
                   "run: CPU times, memory is the bytes of live tensors")
    else:
        machine = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
                   f"torch {torch.__version__}")
    lines = [f"## {graph.name} ({args.spec.name}): one GPU, naive split, micro-batched", "",
             f"{machine}. The spec's layout: {', '.join(devices)}. Inputs {shapes}. Median "
             f"of {args.repeats} training steps (forward, MSE loss, backward, SGD step) after "
             f"{args.warmup} untimed; peak memory allocated per device. Simulator: GPipe, "
             f"the device's rate fitted to the one-GPU step, links at {args.gbps:g} GB/s.", ""]
    if used == 1 and len(devices) > 1:
        lines += ["Fewer GPUs than the layout needs: every row runs on cuda:0. The rows "
                  "'all on cuda:0' run the split builds' own code under merged_devices, "
                  "which makes each .to(\"cuda:N\") a same-device no-op and intercepts every "
                  "torch call; their speedups are over the control (the one-GPU build under "
                  "the same mode). The simulator predicts those builds on the layout's "
                  f"{len(devices)} devices, which this run could not use.", ""]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    smoke = args.device == "cpu"
    gpus = args.gpus
    if not smoke:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            print(NO_GPU)
            return 0
        gpus = min(gpus or count, count)
    try:
        data = load_file(args.spec).data
        with tempfile.TemporaryDirectory() as tmp:
            built, notes, devices, used = build_all(args, data, Path(tmp), gpus)
            results = []
            for result, model_class in built:
                if model_class is not None:
                    # Virtual devices check every index, merged or not: the layout's too.
                    where = (virtual_devices(cuda=max(gpus or 1, layout_gpus(result.graph)[1]))
                             if smoke else contextlib.nullcontext())
                    with where:
                        measured = run_one(result.run, model_class, result.graph, used, args)
                    result.seconds, result.peaks, result.failed = measured
                results.append(result)
    except MpgenError as exc:
        print(exc, file=sys.stderr)
        return 2
    link = args.gbps * 1e9
    lines = [*header(args, results[0].graph, devices, used, smoke),
             table(results, used, link), ""]
    extra = summary(results) + notes
    if extra:
        lines += [*extra, ""]
    report = "\n".join(lines)
    print(report, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report, encoding="utf-8")
    print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
