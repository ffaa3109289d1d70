"""The memory plan against torch.cuda.max_memory_allocated on real GPUs.

Two steps, because the GPU machine may lack mpgen's build dependencies
(pydantic, black, jinja2): the builds and their plans are made here, the
measurement there needs only python3, torch with CUDA and the files.

1. Here (mpgen installed), build the specs and write their plans::

       python bench/gpu_memory.py prepare [--out build/gpu_memory] [SPEC ...]

   For each spec (default: the CNN with BatchNorm, the GPT with a tied head,
   the multi-output model, the residual MLP, the checkpointed pipeline):
   ``--device-map cuda:0`` (one GPU) and the spec's own layout, each a
   plain output folder under ``--out``, and ``plans.json``: each build's
   ``memory.train`` per device and, for the layout, ``memory.pipeline`` per
   stage for ``gpipe`` and ``1f1b`` with 4 micro-batches.

2. There (the folder copied beside this script, or the repository with the
   folder in it), measure::

       python3 bench/gpu_memory.py measure [--out build/gpu_memory]

   Each build's training step (``train_<name>.py``'s batch, loss and
   optimizer: the step mpgen plans) runs twice; before the second, each
   device's ``torch.cuda.reset_peak_memory_stats``, after it
   ``torch.cuda.max_memory_allocated``: the steady-state step's peak. A
   layout needing more GPUs than visible is skipped with a line saying so.
   With as many GPUs as stages, ``pp_<name>.py --memory`` under torchrun
   (one rank per stage) gives each stage's peak the same way. Before any
   model, a matmul on each device makes cuBLAS's workspace, which the
   caching allocator counts and the plan leaves out: the table gives the
   ratio with and without it (``base``). The table goes to stdout and to
   ``<out>/gpu_memory.md``.

Without a GPU, ``measure`` says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPECS = ("examples/small_cnn.yaml", "examples/nano_gpt.yaml", "examples/multitask.yaml",
         "examples/residual_mlp.yaml", "examples/pipelined_mlp.yaml")
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = 4
LINE = re.compile(r"memory rank \d+: (?P<device>\S+?)(?: \(on \S+\))?, step \d+: measured "
                  r"[\d.]+ MiB \((?P<bytes>\d+) bytes\)")


# ---- here: the builds and their plans (needs mpgen) ----

def prepare(out: Path, specs: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from mpgen.compiler.driver import compile_spec
    from mpgen.compiler.placement.memory import plan
    from mpgen.spec_schema.device_map import parse_device_map

    out.mkdir(parents=True, exist_ok=True)
    plans = {}
    for spec in specs:
        path = (ROOT / spec) if not Path(spec).is_absolute() else Path(spec)
        for layout, device_map in (("one", "cuda:0"), ("split", None)):
            folder = out / f"{path.stem}_{layout}"
            shutil.rmtree(folder, ignore_errors=True)
            argv = [sys.executable, "-m", "mpgen", "build", str(path), "-o", str(folder)]
            if device_map:
                argv += ["--device-map", device_map]
            subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
            graph = compile_spec(path, parse_device_map(device_map) if device_map else None)
            entry = {"name": graph.name, "batch": graph.memory.batch,
                     "train": {d.device: d.peak for d in graph.memory.train}}
            if layout == "split":
                entry["pipeline"] = {}
                for schedule in SCHEDULES:
                    planned = plan(graph, schedule=schedule, microbatches=MICROBATCHES)
                    entry["pipeline"][schedule] = {d.device: d.peak for d in planned.pipeline}
                entry["stages"] = len(entry["pipeline"][SCHEDULES[0]])
            plans[folder.name] = entry
            print(f"built {folder}", flush=True)
    (out / "plans.json").write_text(json.dumps(plans, indent=1, sort_keys=True))
    print(f"wrote {out / 'plans.json'}")


# ---- there: the measurement (python3, torch with CUDA) ----

class _Defaults:
    """The training script's flags at their defaults (``args.lr``)."""

    def __init__(self, training) -> None:
        self._training = training

    def __getattr__(self, flag: str):
        if flag == "settings":  # the spec's train: settings, as args.settings holds them
            return self._training.settings
        return self._training.default(flag)


def _step_peaks(folder: Path, entry: dict) -> dict[str, int]:
    """Each device's max_memory_allocated over the second of two steps."""
    import torch

    sys.path.insert(0, str(folder))
    try:
        module = next(p.stem for p in folder.glob("train_*.py"))
        training = importlib.import_module(module).TRAINING
        torch.manual_seed(0)
        model = training.model().train()
        optimizer = training.optimizer(model, _Defaults(training))
        loss_fns = training.losses(training.settings)
        inputs, targets = training.make_batch(entry["batch"])

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = training.forward_loss(model, loss_fns, inputs, targets)[0]  # parts dropped, as the loop does
            loss.backward()
            optimizer.step()

        step()
        optimizer.zero_grad(set_to_none=True)
        devices = list(entry["train"])
        for device in devices:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        step()
        peaks = {}
        for device in devices:
            torch.cuda.synchronize(device)
            peaks[device] = torch.cuda.max_memory_allocated(device)
        del model, optimizer, inputs, targets
        return peaks
    finally:
        sys.path.remove(str(folder))
        for name, loaded in list(sys.modules.items()):  # the next folder has its own
            if str(getattr(loaded, "__file__", None) or "").startswith(str(folder)):
                del sys.modules[name]
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _pipeline_peaks(folder: Path, entry: dict, schedule: str) -> dict[str, int]:
    script = next(p.name for p in folder.glob("pp_*.py"))
    logs = folder / f"ranks_{schedule}"  # each rank's own output: lines never interleave
    shutil.rmtree(logs, ignore_errors=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(logs),
            "--redirects", "3", "--nproc-per-node", str(entry["stages"]), script, "--steps", "2",
            "--memory", "--schedule", schedule, "--microbatches", str(MICROBATCHES),
            "--log-dir", "runs"]
    done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=600)
    printed = "".join(p.read_text() for p in sorted(logs.glob("**/stdout.log")))
    if done.returncode:
        errors = "".join(p.read_text() for p in sorted(logs.glob("**/stderr.log")))
        raise RuntimeError((printed + errors)[-2000:])
    # On CUDA the rank's device is cuda:LOCAL_RANK, the stage's device in the spec.
    return {m["device"]: int(m["bytes"]) for m in map(LINE.match, printed.splitlines()) if m}


def measure(out: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no GPU is visible: nothing measured (bench/gpu_memory.py measure runs where one is)")
        return 0
    count = torch.cuda.device_count()
    base = {}
    for k in range(count):  # cuBLAS's workspace, which the caching allocator counts
        a = torch.ones(64, 64, device=f"cuda:{k}")
        (a @ a).sum().item()
        del a
        base[f"cuda:{k}"] = torch.cuda.memory_allocated(k)
    plans = json.loads((out / "plans.json").read_text())
    rows, notes = [], []
    for name, entry in sorted(plans.items()):
        needed = len(entry["train"])
        if needed > count:
            notes.append(f"{name}: needs {needed} GPUs, {count} visible: not measured")
            continue
        try:
            peaks = _step_peaks(out / name, entry)
        except Exception as error:  # a row saying so, not a stopped run
            notes.append(f"{name}: {type(error).__name__}: {error}"[:300])
            continue
        for device, planned in entry["train"].items():
            got = peaks[device]
            rows.append([name, "train", device, _mib(planned), _mib(got), _r(got, planned),
                         _r(got - base[device], planned)])
        if "pipeline" in entry and entry["stages"] <= count:
            for schedule, planned_peaks in entry["pipeline"].items():
                try:
                    got = _pipeline_peaks(out / name, entry, schedule)
                except Exception as error:
                    notes.append(f"{name} {schedule}: {error}"[:300])
                    continue
                for k, (device, planned) in enumerate(planned_peaks.items()):
                    measured = got.get(device, 0)
                    rows.append([name, schedule, device, _mib(planned), _mib(measured),
                                 _r(measured, planned), _r(measured - base[f"cuda:{k}"], planned)])
        elif "pipeline" in entry:
            notes.append(f"{name}: the pipeline needs {entry['stages']} GPUs, {count} visible")
    header = ["build", "run", "device", "planned MiB", "measured MiB", "measured / planned",
              "(measured - base) / planned"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = "\n".join([f"{torch.cuda.get_device_name(0)} x {count}, torch {torch.__version__}",
                      "", *lines, "", *notes])
    print(text)
    (out / "gpu_memory.md").write_text(text + "\n")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _r(measured: float, planned: float) -> str:
    return f"{measured / planned:.3f}" if planned else "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("prepare", "measure"))
    parser.add_argument("specs", nargs="*", default=list(SPECS))
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_memory")
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare(args.out, args.specs)
        return 0
    return measure(args.out)


if __name__ == "__main__":
    sys.exit(main())
