"""``mpgen profile SPEC``: every placement unit's forward and backward time,
measured on this machine's devices, written beside the spec.

# NOTE: [Measured time]
# ``balance: time`` must predict the busy time of a stage, the time its rank
# spends in the stage's forward and backward (runtime/timeline.py measures
# exactly that around torch's forward_one_chunk and backward_one_chunk). So
# a unit is timed as the pipeline program runs a stage: the spec is built
# (into a temporary folder, never the output folder) with each unit a stage
# of its own (``pp_<name>.py``, one micro-batch, the whole training batch),
# and each stage module is called on the outputs of the one before it, its
# inputs detached and needing gradients as a received tensor does; the
# backward is autograd's over the stage's outputs with the gradients the
# next stage gave back (the last: its loss). A warm-up, then the median of
# repeats, each unit timed alone (a synchronised device on a GPU). What a
# call costs whatever it computes (entering autograd's engine, the module
# call) is measured once per device kind on a stage that does nothing, and
# taken out of each unit: a stage of n units pays it once, not n times.
# Every stage pays it, so it moves no split; the profile keeps it
# (``call``) for the stage times it predicts. The threads are torch's
# default in this process (``--threads``: torchrun sets OMP_NUM_THREADS=1
# for each rank on the CPU, and a profile for pipeline runs on the CPU
# should be measured so). Devices of one kind (the same GPU model, the
# CPU at the same threads) are timed once. Transfers: the bytes per ms of a
# 4 MiB copy between every two devices it can reach.
#
# The file is a small YAML text in a fixed layout (units in spec order,
# milliseconds at 4 decimals), reviewable and committed beside the spec;
# each unit keeps its parameters and FLOPs, so a later build knows a stale
# profile (the model or its sizes changed: ``frontend.profile.stale``) and
# refuses it for ``balance: time``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT
from mpgen.compiler.frontend.profile import FORMAT, profile_path
from mpgen.compiler.ir import Graph
from mpgen.errors import MpgenError, Position
from mpgen.spec_schema.digest import display_path
from mpgen.spec_schema.load import LoadedSpec, load_file, load_text

#: Bytes copied to time a transfer between two devices.
TRANSFER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Measured:
    """One device kind's times: each stage's median (forward, backward) ms."""

    kind: str  # the kind's name in the file (its first device)
    name: str  # the hardware
    devices: tuple[str, ...]
    stages: tuple[tuple[float, float], ...]
    call: tuple[float, float]  # a stage that does nothing (NOTE [Measured time])


def compile_loaded(loaded: LoadedSpec, root: str | Path | None = None,
                   time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
                   place: bool = True) -> Graph:
    """``driver.compile_spec`` of an already loaded spec, without reading
    its profile (a stale or broken one must not stop its own remeasuring);
    ``place``: placed too (else the units and their costs only)."""
    from mpgen.compiler import frontend, placement
    from mpgen.compiler.analysis import costs, shapes, targets
    from mpgen.compiler.analysis.budget import Budget
    from mpgen.compiler.frontend.eager_torch import eager_torch
    from mpgen.spec_schema.validate import validate

    budget = Budget(time_limit)
    with eager_torch(), budget.active():
        graph = frontend.lower(validate(loaded), loaded, root, profile=False)
        graph = shapes.infer(graph, budget)
        graph = targets.infer_targets(graph)
        graph = costs.measure_graph(graph, budget)
        if not place:
            return graph
        with budget.task(graph.pos, f"placement of model {graph.name!r}",
                         "the spec asks for too much work to build in that time"):
            placed = placement.place(graph, None)
    return placed


def split_spec(loaded: LoadedSpec, starts: Sequence[str]) -> LoadedSpec:
    """The spec with each of ``starts`` (unit labels, in order, the first
    unit first) beginning a stage of its own on ``cuda:K``, as one
    micro-batch of the whole batch: the stages a profile or a benchmark
    times. The path stays the spec's (its modules and data resolve as
    there); its capacities go (they name the spec's devices, not these)."""
    import yaml

    data = dict(loaded.data)
    data.pop("capacity", None)
    data["placement"] = {label: f"cuda:{k}" for k, label in enumerate(starts)}
    data["pipeline"] = {"microbatches": 1, "schedule": "gpipe"}
    return load_text(yaml.safe_dump(data, sort_keys=False), loaded.path)


def write_program(graph: Graph, folder: Path) -> str:
    """The model, training and pipeline files of ``graph`` and the runtime
    folder, written into ``folder``; the pipeline module's name."""
    from mpgen.compiler.analysis.budget import Budget
    from mpgen.compiler.codegen import common, model, pp, train
    from mpgen.output import runtime

    names = common.file_names(graph)
    renders = {names["model"]: model.render_model, names["train"]: train.render_train,
               names["pp"]: pp.render_pp}
    with Budget(None).active():
        files = {name: render(graph) for name, render in renders.items()}
    files.update(runtime.files())
    for name, text in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return Path(names["pp"]).stem


@contextlib.contextmanager
def imported(folder: Path, module: str) -> Iterator[object]:
    """``module`` imported from ``folder``, and every module of that folder
    forgotten afterwards (the next program has the same names)."""
    mine = {p.stem for p in folder.glob("*.py")} | {"mpgen_runtime"}

    def forget() -> None:
        for name in [n for n in sys.modules if n.split(".")[0] in mine]:
            del sys.modules[name]

    forget()
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(module)
    finally:
        sys.path.remove(str(folder))
        forget()


@dataclass
class Program:
    """A pipeline program's stage modules on one device with a training
    batch, ready to time (:func:`load_program`)."""

    modules: list
    inputs: tuple
    loss_of: Callable
    autocast: Callable
    sync: Callable
    #: What times it: wall time, as the pipeline's busy time is measured
    #: (a benchmark on one CPU thread may take the thread's CPU time).
    clock: Callable[[], float] = time.perf_counter

    def run(self) -> list[tuple[float, float]]:
        """One forward and backward of every stage, chained as the pipeline
        runs them (NOTE [Measured time]): each stage's seconds."""
        import torch

        count = len(self.modules)
        given, made, x, times = [], [], self.inputs, []
        for k, module in enumerate(self.modules):
            if k:  # received: a leaf that needs a gradient where the sent tensor did
                x = tuple(t.detach().contiguous().requires_grad_(t.requires_grad) for t in x)
            self.sync()
            began = self.clock()
            with self.autocast():
                out = module(*x)
            out = tuple(t.contiguous() for t in (out if isinstance(out, tuple) else (out,)))
            self.sync()
            times.append([self.clock() - began, 0.0])
            given.append(x)
            made.append(out)
            x = out
        grads: list = []
        for k in reversed(range(count)):
            self.sync()
            began = self.clock()
            if k == count - 1:
                with self.autocast():
                    loss = self.loss_of(made[k])
                loss.backward()
            else:
                pairs = [(o, g) for o, g in zip(made[k], grads)
                         if o.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            self.sync()
            times[k][1] = self.clock() - began
            grads = [t.grad if t.requires_grad else None for t in given[k]]
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        return [(f, b) for f, b in times]


def load_program(folder: Path, module: str, device: str,
                 clock: Callable[[], float] = time.perf_counter) -> Program:
    """The pipeline program ``module`` of ``folder``: its stages built on
    ``device`` (seeded), and its first synthetic training batch there. It
    keeps working after its modules are forgotten (:func:`imported`)."""
    import torch

    with imported(folder, module) as program:
        stages = program.STAGES
        training = stages.training
        data = sys.modules["mpgen_runtime.data"]
        loop = importlib.import_module("mpgen_runtime.loop")
        flags = importlib.import_module("mpgen_runtime.flags")
        args = flags.parser(training, stages).parse_args([])
        batch = next(data.batches(data.training_data(training, args), training, args, 0))
        target = torch.device(device)
        n = len(training.inputs)
        inputs = tuple(x.to(target) for x in batch[:n])
        targets = tuple(x if x is None else x.to(target) for x in batch[n:])
        torch.manual_seed(0)
        modules = [stage().to(target) for stage in stages.stages]
        loss_fns = training.losses(training.settings)
    index = torch.arange(args.batch_size)

    def sync() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    return Program(modules, inputs,
                   lambda outputs: stages.loss(outputs, index, targets, loss_fns, 1)[0],
                   lambda: loop.autocast(target.type, args.amp), sync, clock)


def nothing_program(device: str, like: Program) -> Program:
    """A one-stage program that does nothing but pass a tensor on: what
    calling a stage costs (NOTE [Measured time])."""
    import torch
    from torch import nn

    class Nothing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return (x * self.scale,)

    target = torch.device(device)
    return Program([Nothing().to(target)], (torch.ones(8, device=target),),
                   lambda outputs: outputs[0].sum(), like.autocast, like.sync, like.clock)


def medians(programs: Sequence[Program], warmup: int, repeats: int
            ) -> list[list[tuple[float, float]]]:
    """Each program's per-stage median (forward, backward) ms, the programs
    taking turns in every repeat (a drift of the machine's speed meets
    them all alike)."""
    runs: list[list] = [[] for _ in programs]
    for repeat in range(warmup + repeats):
        for found, program in zip(runs, programs):
            times = program.run()
            if repeat >= warmup:
                found.append(times)
    return [[(statistics.median(r[k][0] for r in found) * 1000,
              statistics.median(r[k][1] for r in found) * 1000)
             for k in range(len(program.modules))]
            for found, program in zip(runs, programs)]


def machine_devices() -> list[str]:
    """This machine's devices: the CPU and every GPU torch sees."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return found


def device_name(device: str) -> str:
    """The hardware of ``device``: a GPU's name, the CPU's model and threads."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    threads = torch.get_num_threads()
    return f"{cpu_model()} ({threads} thread{'s' if threads != 1 else ''})"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the platform's word."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    return platform.processor() or platform.machine() or "cpu"


def transfer_rates(devices: Sequence[str], repeats: int) -> list[tuple[str, str, float]]:
    """Bytes per ms of a :data:`TRANSFER_BYTES` copy between every two devices."""
    import torch

    found = []
    for source in devices:
        for target in devices:
            if source == target or "cuda" not in source + target:
                continue
            x = torch.ones(TRANSFER_BYTES // 4, device=source)
            took = []
            for i in range(repeats + 1):
                for d in (source, target):
                    if d.startswith("cuda"):
                        torch.cuda.synchronize(d)
                began = time.perf_counter()
                x.to(target)
                for d in (source, target):
                    if d.startswith("cuda"):
                        torch.cuda.synchronize(d)
                if i:
                    took.append(time.perf_counter() - began)
            found.append((source, target, TRANSFER_BYTES / (statistics.median(took) * 1000)))
    return found


def profile(path: str | Path, devices: Optional[Sequence[str]] = None,
            root: str | Path | None = None, warmup: int = 2, repeats: int = 7,
            threads: Optional[int] = None,
            time_limit: Optional[float] = DEFAULT_TIME_LIMIT,
            clock: Callable[[], float] = time.perf_counter) -> tuple[Path, str]:
    """Measure the spec's units on ``devices`` (default: every device of
    this machine) with ``threads`` CPU threads (default: torch's) and
    return the profile's path and text (not written)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(path, devices, root, warmup, repeats, time_limit, clock)
    finally:
        torch.set_num_threads(before)


def _profile(path, devices, root, warmup, repeats, time_limit, clock) -> tuple[Path, str]:
    import torch

    devices = list(devices or machine_devices())
    known = machine_devices()
    for device in devices:
        if device not in known:
            raise MpgenError(Position(str(path)), f"profile: no device {device!r} on this "
                                                  f"machine ({', '.join(known)})")
    loaded = load_file(path)
    graph = compile_loaded(loaded, root, time_limit, place=False)
    units = graph.costs.units
    kinds: dict[str, list[str]] = {}
    for device in devices:
        kinds.setdefault(device_name(device), []).append(device)
    split = compile_loaded(split_spec(loaded, [u.name for u in units]), root, time_limit)
    measured = []
    with tempfile.TemporaryDirectory(prefix="mpgen-profile-") as tmp:
        module = write_program(split, Path(tmp))
        for name, members in kinds.items():
            program = load_program(Path(tmp), module, members[0], clock)
            stages, call = medians([program, nothing_program(members[0], program)],
                                   warmup, repeats)
            measured.append(Measured(members[0], name, tuple(members), tuple(stages),
                                     call[0]))
    batch = dict(graph.costs.dims).get("batch", 0)
    moves = transfer_rates(devices, repeats) if len(devices) > 1 else []
    text = format_profile(display_path(path), graph, measured, moves, batch,
                          torch.get_num_threads(), warmup, repeats)
    return profile_path(path), text


def format_profile(spec: str, graph: Graph, measured: Sequence[Measured],
                   moves: Sequence[tuple[str, str, float]], batch: int, threads: int,
                   warmup: int, repeats: int) -> str:
    """The profile's text: a fixed layout, so that the same numbers give the
    same bytes (NOTE [Measured time])."""
    def q(text: str) -> str:  # a YAML double-quoted string
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def ms(value: float) -> str:
        return f"{max(value, 0.0):.4f}"

    lines = [
        f"# Measured by `mpgen profile {spec}`: each placement unit's forward and backward",
        "# milliseconds over one training batch, per device kind, less what calling a stage",
        "# costs (call). `placement: {auto: {balance: time}}` places by it; rerun after",
        "# changing the model, its sizes or the machine (docs/partition.md).",
        f"mpgen_profile: {FORMAT}",
        f"spec: {q(spec)}",
        f"batch: {batch}",
        f"threads: {threads}",
        f"warmup: {warmup}",
        f"repeats: {repeats}",
        "kinds:",
        *(f"  {q(m.kind)}: {q(m.name)}" for m in measured),
        "devices:",
        *(f"  {q(d)}: {q(m.kind)}" for m in measured for d in m.devices),
        "call:",
        *(f"  {q(m.kind)}: [{ms(m.call[0])}, {ms(m.call[1])}]" for m in measured),
        "units:",
    ]
    for i, unit in enumerate(graph.costs.units):
        times = ", ".join(
            f"{q(m.kind)}: [{ms(m.stages[i][0] - m.call[0])}, {ms(m.stages[i][1] - m.call[1])}]"
            for m in measured)
        lines.append(f"  - {{unit: {q(unit.name)}, params: {unit.params}, "
                     f"flops: {unit.flops}, {times}}}")
    lines.append("transfers:" + ("" if moves else " []"))
    lines += [f"  - {{from: {q(a)}, to: {q(b)}, bytes_per_ms: {rate:.1f}}}"
              for a, b, rate in moves]
    return "\n".join(lines) + "\n"


def write_profile(target: Path, text: str) -> None:
    """Write the profile beside its spec: a new file renamed over the old."""
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)
