"""The memory plan against measured peaks: per device, per component, for
the single-process training script and for the pipeline program.

For each spec (CNNs with BatchNorm and SGD with momentum, a GPT with a tied
head and a Llama without, both with AdamW, a multi-output model with AdamW,
a residual MLP with Adam, a checkpointed pipeline), mpgen builds it into a temporary folder and the
generated code is measured, never the plan's own machinery:

* **train, cpu**: the ``--device-map cpu`` build's ``memory.train.cpu``
  against a steady-state step of ``train_<name>.py``'s batch, loss and
  optimizer on the plain CPU (``mpgen.testing.measure_training_step``: the
  bytes of live storages, as torch's MemTracker counts them);
* **train, per device**: the spec's own layout, measured the same way on
  virtual devices (``mpgen.testing.virtual_devices``), each device apart;
* **pipeline**: ``pp_<name>.py --memory`` under torchrun on the CPU (gloo,
  a rank per stage) for ``gpipe`` and ``1f1b`` with 4 micro-batches, each
  rank's peak against ``memory.pipeline`` at that schedule
  (``placement.memory.plan(graph, schedule=, microbatches=4)``); with and
  without ``pipeline: {checkpoint: [...]}``.

The tables give the measured peak over the planned (1.00: exact; the issue
asks for 0.90 to 1.10), and per component each part at its largest in the
step (weights, gradients, optimizer state, activations) measured over
planned. Each measurement runs in a fresh process (every output folder has
its own ``mpgen_runtime`` and model modules).

    python bench/memory_plan.py [--quick] [--no-pipeline] [--spec STEM ...]
    python -m bench --only memory
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from bench.common import PYTHON, ROOT, table  # noqa: E402

#: (spec, what it stands for, a checkpoint: variant's devices or None).
SPECS = (
    ("examples/small_cnn.yaml", "CNN, BatchNorm, SGD momentum", ["cuda:0"]),
    ("examples/resnet18.yaml", "ResNet-18, BatchNorm, SGD momentum and weight decay", None),
    ("examples/nano_gpt.yaml", "GPT, tied head, AdamW", None),
    ("examples/tiny_llama.yaml", "Llama, untied head, AdamW", None),
    ("examples/multitask.yaml", "multi-output, AdamW", None),
    ("examples/residual_mlp.yaml", "residual MLP, Adam", None),
    ("examples/pipelined_mlp.yaml", "pipeline, checkpointed, AdamW", None),
)
QUICK = SPECS[:1]
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = 4
COMPONENTS = ("weights", "gradients", "optimizer", "activations")

#: Run in a fresh process in an output folder: measure its test suite's
#: training step (virtual devices unless the build is on the CPU alone) and
#: print each device's peak as JSON.
_MEASURE = """
import importlib, json, sys, torch
from mpgen.testing import virtual_devices
module = importlib.import_module(sys.argv[1])
suite = getattr(module, sys.argv[2])()
suite.memory_batch = int(sys.argv[3])
if suite.cuda_count:
    with virtual_devices(cuda=suite.cuda_count):
        peaks = suite.measure_training_step()
else:
    peaks = suite.measure_training_step()
print(json.dumps({d: [p.peak, p.phase, p.at_peak, p.largest] for d, p in peaks.items()}))
"""

LINE = re.compile(r"memory rank \d+: (?P<device>\S+) \(on \S+\), step \d+: measured [\d.]+ MiB "
                  r"\((?P<bytes>\d+) bytes\)(?: in (?P<phase>[a-z ]+))?")


def _build(spec: Path, out: Path, device_map: Optional[str] = None) -> None:
    argv = [PYTHON, "-m", "mpgen", "build", str(spec), "-o", str(out)]
    if device_map:
        argv += ["--device-map", device_map]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"mpgen build {spec} failed:\n{done.stdout}{done.stderr}")


def _graph(spec: Path, device_map: Optional[str] = None):
    from mpgen.compiler.driver import compile_spec
    from mpgen.spec_schema.device_map import parse_device_map

    mapping = parse_device_map(device_map) if device_map else None
    return compile_spec(spec, mapping)


def _measure(out: Path, graph, batch: int) -> dict:
    """Each device's measured [peak, phase, at_peak, largest] of the
    generated suite's training step at ``batch``."""
    from mpgen.compiler.codegen.common import file_names

    module = file_names(graph)["test"][: -len(".py")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(out), str(ROOT)]))
    done = subprocess.run([PYTHON, "-c", _MEASURE, module, f"Test{graph.name}", str(batch)],
                          cwd=out, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"measuring {out} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pipeline_run(out: Path, graph, schedule: str, batch: int) -> dict[str, tuple[int, str]]:
    """``pp_<name>.py --memory`` under torchrun: each stage device's measured peak."""
    from mpgen.compiler.codegen.common import file_names
    from mpgen.compiler.placement.stages import stages

    count = len(stages(graph, graph.spec_plan or graph.plan))  # the spec's, not --device-map's
    logs = out / f"ranks_{schedule}"  # each rank's own output: lines never interleave
    argv = [PYTHON, "-m", "torch.distributed.run", "--log-dir", str(logs), "--redirects", "3",
            "--nproc-per-node", str(count), file_names(graph)["pp"], "--steps", "2", "--memory",
            "--schedule", schedule, "--microbatches", str(MICROBATCHES),
            "--batch-size", str(batch), "--log-dir", str(out / "runs")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, cwd=out, capture_output=True, text=True, env=env)
    printed = "".join(p.read_text() for p in sorted(logs.glob("**/stdout.log")))
    if done.returncode:
        errors = "".join(p.read_text() for p in sorted(logs.glob("**/stderr.log")))
        raise RuntimeError(f"{' '.join(argv)} failed:\n{(printed + errors)[-3000:]}")
    found = {}
    for line in printed.splitlines():
        match = LINE.match(line)
        if match:
            found[match["device"]] = (int(match["bytes"]), match["phase"] or "")
    return found


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}" if planned else "-"


def _variant(spec: Path, folder: Path, checkpoint: Optional[list[str]]) -> Path:
    """The spec with ``pipeline: {checkpoint: ...}`` set (a list) or removed (None)."""
    data = yaml.safe_load(spec.read_text())
    pipeline = dict(data.get("pipeline") or {})
    if checkpoint:
        pipeline["checkpoint"] = checkpoint
        pipeline.setdefault("microbatches", MICROBATCHES)
    else:
        pipeline.pop("checkpoint", None)
    if pipeline:
        data["pipeline"] = pipeline
    else:
        data.pop("pipeline", None)
    tag = "ckpt" if checkpoint else "plain"
    path = folder / f"{spec.stem}_{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def section(quick: bool, emit: Callable[[str], None], pipeline: bool = True,
            only: Optional[list[str]] = None) -> None:
    from mpgen.compiler.placement.memory import plan

    emit("## Memory: the plan against measured peaks\n")
    emit("`bench/memory_plan.py`: each spec built by mpgen, its generated training step "
         "measured (the bytes of live tensor storages per device, at its peak over a "
         "steady-state step: `mpgen.testing.measure_training_step`; the pipeline's, "
         "`pp_<name>.py --memory` under torchrun on the CPU), over the build's memory plan "
         "(`memory.train`, `memory.pipeline`). 1.00 is exact; the goal is 0.90-1.10. "
         "On GPUs, `bench/gpu_memory.py` compares the same plans with "
         "`torch.cuda.max_memory_allocated` (`prepare` here, `measure` where the GPUs are: "
         "its docstring).\n")
    peaks, parts, pipes = [], [], []
    with tempfile.TemporaryDirectory(prefix="mpgen-memory-") as tmp:
        folder = Path(tmp)
        chosen = [s for s in SPECS if only is None or Path(s[0]).stem in only]
        for spec_name, what, checkpoint in (QUICK if quick else chosen):
            spec = ROOT / spec_name
            stem = spec.stem
            for device_map in ("cpu", None):
                out = folder / f"{stem}_{device_map or 'split'}"
                _build(spec, out, device_map)
                graph = _graph(spec, device_map)
                memory = graph.memory
                measured = _measure(out, graph, memory.batch)
                for d in memory.train:
                    peak, phase, _, largest = measured.get(d.device, [0, "", {}, {}])
                    run = "train, cpu" if device_map else "train"
                    peaks.append([stem, run, d.device, _mib(d.peak), _mib(peak),
                                  _ratio(peak, d.peak), f"{d.phase} / {phase}"])
                    parts.append([stem, run, d.device]
                                 + [_ratio(largest.get(c, 0), getattr(d, c)) for c in COMPONENTS])
            if not pipeline:
                continue
            variants = [(spec, "")]
            if checkpoint is not None:
                variants.append((_variant(spec, folder, checkpoint), f" +ckpt {checkpoint}"))
            elif (yaml.safe_load(spec.read_text()).get("pipeline") or {}).get("checkpoint"):
                variants.append((_variant(spec, folder, None), " -ckpt"))
            for path, tag in variants:
                out = folder / f"{path.stem}_pp"
                _build(path, out, "cpu")
                # The plan of what runs: the --device-map cpu build's (each rank on
                # the CPU, with the CPU's optimizers), each stage named by its
                # spec device, as pp_<name>.py --memory names it.
                graph = _graph(path, "cpu")
                # The spec's batch, or the least multiple of the micro-batches above it.
                batch = -(-graph.memory.batch // MICROBATCHES) * MICROBATCHES
                for schedule in SCHEDULES:
                    planned = plan(graph, batch=batch, schedule=schedule,
                                   microbatches=MICROBATCHES)
                    try:
                        got = _pipeline_run(out, graph, schedule, batch)
                    except RuntimeError as error:  # a row saying so, not a stopped run
                        last = str(error).strip().splitlines()[-1]
                        pipes.append([f"{stem}{tag}", schedule, "-", "-", "-", "-", last[:80]])
                        continue
                    for d in planned.pipeline:
                        peak, phase = got.get(d.device, (0, ""))
                        pipes.append([f"{stem}{tag}", schedule, d.device, _mib(d.peak),
                                      _mib(peak), _ratio(peak, d.peak), f"{d.phase} / {phase}"])
    emit("Training step, each device's peak (MiB; phase planned / measured):\n")
    emit(table(["spec", "run", "device", "planned", "measured", "measured / planned",
                "phase"], peaks) + "\n")
    emit("Each component at its largest in the step, measured / planned:\n")
    emit(table(["spec", "run", "device", *COMPONENTS], parts) + "\n")
    if pipes:
        emit(f"Pipeline program, {MICROBATCHES} micro-batches, each stage's rank (MiB):\n")
        emit(table(["spec", "schedule", "stage", "planned", "measured", "measured / planned",
                    "phase"], pipes) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one spec: a smoke run")
    parser.add_argument("--no-pipeline", action="store_true", help="the training step only")
    parser.add_argument("--spec", action="append", metavar="STEM",
                        help="only this spec of SPECS (e.g. nano_gpt); repeatable")
    args = parser.parse_args(argv)
    section(args.quick, lambda text: print(text, flush=True), pipeline=not args.no_pipeline,
            only=args.spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
