"""The memory plan: every device's bytes for training, the pipeline program
and inference, simulated once after placement (``graph.memory``).

# NOTE: [Memory plan]
# The plan does not add per-unit numbers (analysis/costs.py does that, for
# balancing): it *runs* the step the generated code runs, on fake tensors
# (``FakeTensorMode`` over CPU tensors: no memory is allocated, and every
# operator takes the kernel the CPU takes, e.g. the CPU flash attention that
# saves its output and log-sum-exp, not the T x T matrix the meta device's
# math path saves), and counts the tensor storages alive at each operator,
# the way a dispatch-level tracker counts a real run
# (``torch.distributed._tools.mem_tracker``, ``mpgen.testing``):
#
# - what runs: the placed forward plan, section by section, each unit built
#   as the generated model builds it (analysis/meta.py's interpreter, ties
#   shared, a tied layer on another device fed a moved copy), a checkpointed
#   unit through ``torch.utils.checkpoint`` (so its recompute is simulated),
#   under autocast when ``train.amp`` is on (its casts are counted), in
#   training (``meta.training``: ``dropout_p`` and ``F.dropout``'s
#   ``training`` are the training values, as ``self.training`` gives them
#   in the generated code; SDPA with dropout takes the math path); then
#   each loss as the training script computes it, ``backward``, the gradient
#   clip, and the optimizer's ``step`` (the single-tensor loop for a CPU
#   build, ``foreach`` for CUDA, as torch picks). Two steps run; the second
#   (optimizer state present, gradients set to None before forward, as the
#   runtime's ``zero_grad(set_to_none=True)`` does) is the one measured;
#   the first is stood in for by one optimizer step over zero gradients,
#   which makes the same state.
# - where a storage lives: a factory operator's on the device of the unit
#   running; any other operator's on the device of its first tensor input
#   already placed; a transfer's copy on the reader's device (and its
#   gradient back on the source's). The batch is made on the host: on a CPU
#   build it counts on ``cpu``; on an accelerator only its copies count.
# - parts: parameters and buffers (and AMP's casts of them) are
#   ``weights``; a parameter's ``.grad`` ``gradients`` (from the moment it is
#   accumulated); the optimizer's state ``optimizer``; what forward makes
#   ``activations`` (the copies it moves between devices ``transfers``); what
#   backward and the optimizer step make ``transient``. ``peak`` is the most
#   bytes alive at once on the device; ``phase``, ``at_peak`` and
#   ``largest`` (the units whose storages hold the most then) say where.
# - pipeline: every micro-batch of a stage costs the same, so each stage
#   runs once at the micro-batch size (batch / dp / microbatches), its
#   gradients already there: F (its section, the last stage's loss) gives
#   what it holds until its B and its highest point; B (from a received
#   gradient, or the loss) gives its highest point and what it frees. The
#   first micro-batch's B, which makes the gradients instead of adding into
#   them, is derived from the same run (``_FirstBackward``). Then each rank
#   of the schedule (analysis/schedule.py's ``rank_orders``) replays its
#   order over these numbers: weights, optimizer state and, as
#   ``transfers``, ``PipelineStage``'s receive buffers (one per micro-batch
#   for the activations a stage takes and for the gradients of those it
#   gives) and, on the ranks that read the data (first and last stage), the
#   whole batch always; what each F holds until its B (a stage's inputs are
#   its receive buffers, no transfer copy; an output passed on as received,
#   a view or not contiguous is sent as a copy, as the runtime's
#   ``sendable`` hook makes it); the gradient a B sends for its inputs,
#   kept until the last B under GPipe (which waits for its sends then),
#   else gone with the send; the gradients from a stage's first B; and the
#   optimizer's step (measured over the rank's parameters, in the form torch
#   takes on the rank's device after --device-map, over the runtime's
#   ``no_decay`` param groups) last. Under a --device-map that merges
#   stage devices (``*=cpu``), each rank keeps its spec device as its key,
#   as pp_<name>.py --memory names it.
# - no garbage collection runs while the step is simulated: a storage dies
#   when reference counting frees it, as in the generated code, so the plan
#   is the same on every call (a reference cycle that holds tensors would
#   keep them: recursive closures over tensors are avoided for that).
#   A zero-bubble schedule's split backward (B then W) counts as one full
#   backward at B; FSDP (``--dp-mode fsdp``) is not modelled: the plan is
#   per replica. Keyed by the stage's device; a device holding several
#   stages (looped, V) is one rank. A tied parameter is counted on every
#   stage that uses it: each has its copy in the pipeline program.
# - inference: the forward at the batch under ``no_grad``, in eval mode.
#
# Where the simulation would not fit a build's budget (more than
# MAX_SIMULATED_LAYERS layer runs, or a recurrent layer) or cannot run (an
# operator without a fake kernel), analysis/costs.py's additive estimate
# stands in (phase "estimate"): chosen by the spec alone, so the plan is the
# same on every machine.
#
# Left out: the CUDA context and the caching allocator's rounding and
# fragmentation (the plan is what ``max_memory_allocated`` would see at best),
# workspaces kernels allocate outside the dispatcher (cuBLAS, cuDNN), the
# fp16 gradient scaler's few scalars, the data loader's prefetched batches,
# oneDNN's LSTM workspace on the CPU (its fake kernel returns none), and a
# user optimizer torch.optim does not know, or LBFGS (their state is
# costs.optimizer_state's parameter-sized copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpgen.compiler.analysis import meta
from mpgen.compiler.analysis.budget import Budget
from mpgen.compiler.analysis.costs import human_bytes, optimizer_state
from mpgen.compiler.analysis.schedule import BACKWARD, FORWARD, rank_orders, stage_ranks
from mpgen.compiler.frontend.eager_torch import import_dynamo
from mpgen.compiler.frontend.limits import OutOfBudget, active_budget
from mpgen.compiler.ir import MEMORY_PARTS, DeviceMemory, Graph, MemoryPlan, Node
from mpgen.compiler.placement.devices import map_device
from mpgen.compiler.placement.pipelining import checkpointed_units
from mpgen.compiler.placement.stages import stages as pipeline_stages
from mpgen.errors import MpgenError, Position

_META = torch.device("meta")
_aten = torch.ops.aten
_CASTS = {_aten._to_copy.default, _aten.clone.default, _aten.to.dtype}
_HOST = "host"  # where the batch is made when the model is not on the CPU


# -- counting storages -------------------------------------------------------

class _Tracker(TorchDispatchMode):
    """Counts the bytes of every tensor storage alive, by device, part and
    unit, and each device's peak (NOTE [Memory plan])."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # storage -> [device, part, unit, bytes]
        self.total: dict[str, int] = defaultdict(int)
        self.parts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.units: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.device = "cpu"  # the unit running: where a factory's tensor lands
        self.unit = ""
        self.phase = "forward"
        self.forced: Optional[str] = None  # a transfer's destination
        self.recording = False
        self.peak: dict[str, tuple] = {}  # device -> (bytes, phase, parts, units)
        self.highest: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.first: Optional[_FirstBackward] = None

    def reset(self) -> None:
        """Start measuring: peaks from what is alive now."""
        self.recording = True
        self.peak = {}
        self.highest = defaultdict(lambda: defaultdict(int))
        for device in list(self.total):
            self._note(device)
            for part, n in self.parts[device].items():
                self.highest[device][part] = n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is not None and torch.device(kwargs["device"]) == _META:
            kwargs = {**kwargs, "device": torch.device("cpu")}  # meta.build's device
        out = func(*args, **kwargs)
        found = None
        for a in args:  # aten's tensor arguments: positional, or lists of them
            if isinstance(a, torch.Tensor):
                found = self.live.get(a.untyped_storage()._cdata)
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                found = self.live.get(a[0].untyped_storage()._cdata)
            if found is not None:
                break
        if self.forced is not None:
            device, part = self.forced, "transfers"
        else:
            device = found[0] if found is not None else self.device
            part = "activations" if self.phase[:1] == "F" or self.phase == "forward" \
                else "transient"
            if found is not None and found[1] == "weights" and func in _CASTS:
                part = "weights"  # AMP's cast of a weight
        first = args[0] if args else None
        if isinstance(out, (list, tuple)) and isinstance(first, (list, tuple)) \
                and len(first) == len(out):  # a foreach op: each output beside its input
            for x, t in zip(first, out):
                entry = self.live.get(_key(x)) if isinstance(x, torch.Tensor) else None
                if isinstance(t, torch.Tensor):
                    self.add(t, entry[0] if entry and self.forced is None else device, part)
            return out
        if isinstance(out, torch.Tensor):
            self.add(out, device, part)
        elif isinstance(out, (list, tuple)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self.add(t, device, part)
        return out

    def add(self, t: torch.Tensor, device: str, part: str, unit: Optional[str] = None) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        n = storage.nbytes()
        unit = self.unit if unit is None else unit
        self.live[key] = [device, part, unit, n]
        weakref.finalize(storage, self._free, key)
        self.total[device] += n
        self.parts[device][part] += n
        self.units[device][unit] += n
        if self.recording:
            if self.parts[device][part] > self.highest[device][part]:
                self.highest[device][part] = self.parts[device][part]
            self._note(device)
        if self.first is not None:
            self.first.see(self.total[device])

    def _note(self, device: str) -> None:
        best = self.peak.get(device)
        if best is None or self.total[device] > best[0]:
            self.peak[device] = (self.total[device], self.phase, dict(self.parts[device]),
                                 self.units[device])
            self._units_stale = device

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        device, part, unit, n = entry
        best = self.peak.get(device)
        if best is not None and best[3] is self.units[device]:  # freeze the peak's units
            self.peak[device] = best[:3] + (dict(best[3]),)
        self.total[device] -= n
        self.parts[device][part] -= n
        self.units[device][unit] -= n

    def retag(self, t: Optional[torch.Tensor], part: str, unit: Optional[str] = None) -> None:
        """``t``'s storage is ``part`` (of ``unit``) from now on."""
        if t is None:
            return
        entry = self.live.get(_key(t))
        if entry is None or (entry[1] == part and unit in (None, entry[2])):
            return
        device, old, old_unit, n = entry
        best = self.peak.get(device)
        if best is not None and best[3] is self.units[device]:
            self.peak[device] = best[:3] + (dict(best[3]),)
        self.parts[device][old] -= n
        self.parts[device][part] += n
        entry[1] = part
        if unit is not None:
            self.units[device][old_unit] -= n
            self.units[device][unit] += n
            entry[2] = unit
        if self.recording and self.parts[device][part] > self.highest[device][part]:
            self.highest[device][part] = self.parts[device][part]

    def alive(self, device: str, parts: Sequence[str]) -> int:
        return sum(self.parts[device][p] for p in parts)

    @contextlib.contextmanager
    def on(self, device: str, unit: Optional[str] = None) -> Iterator[None]:
        saved = self.device, self.unit
        self.device = device
        if unit is not None:
            self.unit = unit
        try:
            yield
        finally:
            self.device, self.unit = saved

    @contextlib.contextmanager
    def moving(self, device: str) -> Iterator[None]:
        saved, self.forced = self.forced, device
        try:
            yield
        finally:
            self.forced = saved


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _FirstBackward:
    """A backward measured with every gradient already there (a later
    micro-batch's, which adds each new gradient into it) also gives the first
    micro-batch's, which keeps each new gradient as the gradient: at any
    moment, the bytes above its start are the later one's plus the gradients
    made so far, which the later one added in place (NOTE [Memory plan])."""

    def __init__(self, begin: int) -> None:
        self.begin, self.done, self.peak = begin, 0, 0

    def see(self, total: int) -> None:
        self.peak = max(self.peak, total - self.begin + self.done)


class _Move(torch.autograd.Function):
    """``x.to(device)``: a copy on the reader's device whose gradient goes
    back to the source's (the tracker files each on its device)."""

    @staticmethod
    def forward(ctx, x, tracker, src, dst):
        ctx.tracker, ctx.src = tracker, src
        with tracker.moving(dst):
            return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with ctx.tracker.moving(ctx.src):
            return grad.clone(), None, None, None


# -- the model, built once per graph ----------------------------------------

class _Model:
    """The graph's units built on fake CPU tensors (one per instance, ties
    shared), reused by every plan of the graph (``place --fit`` calls the
    plan many times: only the step depends on the batch)."""

    def __init__(self, graph: Graph, budget: Budget) -> None:
        self.graph = graph
        with budget.paused():  # once per process (~1 s CPU): not the spec's cost
            import_dynamo()  # FakeTensorMode needs it; os.environ stays the user's
        self.fake = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        self.fake.cache_enabled = False  # hashing each call costs more than it saves here
        self.nodes = {n.name: n for n in graph.nodes}
        self.blocks = {b.name: b for b in graph.blocks}
        self.hooks = meta.Hooks(budget)
        self.modules: dict[tuple[str, int], nn.Module] = {}
        self.devices: dict[tuple[str, int], str] = {}
        with self.fake, _Tracker():  # the tracker puts meta.build's tensors on the CPU
            for node in graph.nodes:
                if not node.op.has_module and node.op.kind is not meta.OpKind.TENSOR:
                    continue
                for k in range(node.instances):
                    module = meta.build(node, {}, self.blocks, self.hooks, index=k)
                    self.modules[node.name, k] = module
                    self.devices[node.name, k] = node.devices[k] if node.devices else "cpu"
            for node in graph.nodes:
                for tie in node.ties:
                    owner = self.modules.get((tie.owner, 0))
                    for k in range(node.instances):
                        module = self.modules.get((node.name, k))
                        if owner is not None and module is not None:
                            meta.share_parameter(module, tie.param,
                                                 owner.get_parameter(tie.owner_param))
        self.checkpointed = checkpointed_units(graph)
        self.training = False
        self.failed_at: Optional[Node] = None  # the layer whose run raised, if one did
        self.params: dict[int, tuple[nn.Parameter, str, str]] = {}  # id -> (p, device, unit)
        self.buffers: list[tuple[torch.Tensor, str, str]] = []
        for (name, k), module in self.modules.items():
            unit = str(self.nodes[name].unit(k))
            device = self.devices[name, k]
            tensors = [module] if isinstance(module, torch.Tensor) else []
            if isinstance(module, nn.Module):
                for p in module.parameters():
                    self.params.setdefault(id(p), (p, device, unit))
                self.buffers += [(b, device, unit) for b in module.buffers()]
            for t in tensors:
                self.buffers.append((t, device, unit))

    def register(self, tracker: _Tracker, devices: Optional[set[str]] = None) -> None:
        """The weights, on their devices (only those on ``devices``)."""
        for p, device, unit in self.params.values():
            if devices is None or device in devices:
                tracker.add(p, device, "weights", unit)
        for b, device, unit in self.buffers:
            if devices is None or device in devices:
                tracker.add(b, device, "weights", unit)

    def train(self, mode: bool) -> None:
        self.training = mode  # the layers' arguments that read it too (meta.training)
        for module in self.modules.values():
            if isinstance(module, nn.Module):
                module.train(mode)

    # -- forward ------------------------------------------------------------
    def run_sections(self, tracker: _Tracker, sections, env: dict[str, Any],
                     host: str, direct: frozenset = frozenset()) -> None:
        """Run ``sections`` of the forward plan over the variables in ``env``
        (a transfer of a variable in ``direct`` is no copy: the pipeline
        stage's inputs arrive on its device)."""
        graph = self.graph
        names = _Names(graph, env)
        for section in sections:
            for t in section.transfers:
                x = self._source(t.src_var, env)
                if x is None:
                    continue
                src = t.src or host
                if src == t.dst or t.src_var in direct:
                    env[t.dst_var] = x
                else:
                    env[t.dst_var] = _Move.apply(x, tracker, src, t.dst) \
                        if x.requires_grad else self._copy(tracker, x, t.dst)
            for step in section.steps:
                self.hooks.budget.check()
                node = self.nodes[step.node]
                x = [env.get(v) for v in step.reads]
                out = None
                for k in range(step.start, step.stop):
                    unit = node.unit(k)
                    with tracker.on(step.device, str(unit)):
                        out = self._run(node, k, x, dict(step.tied), env, names,
                                        unit in self.checkpointed)
                    if not node.pattern:
                        x = [out, *x[1:]]
                if node.pattern:
                    values = meta.unpack(node, out)
                    for e in node.elements:
                        env[e.var] = values.get(e.name)
                else:
                    env[step.out_var] = out

    def _copy(self, tracker: _Tracker, x: torch.Tensor, device: str) -> torch.Tensor:
        with tracker.moving(device):
            return x.clone()

    def _source(self, var: str, env: Mapping[str, Any]) -> Optional[torch.Tensor]:
        if var in env:
            return env[var]
        if var.startswith("self."):  # a tied parameter moved to its reader
            path = var[len("self."):]
            for (name, k), module in self.modules.items():
                if k == 0 and path.startswith(name + ".") and isinstance(module, nn.Module):
                    return module.get_parameter(path[len(name) + 1:])
        return None

    def _run(self, node: Node, k: int, x: list, tied: Mapping[str, str],
             env: Mapping[str, Any], names: Mapping[str, Any], checkpoint: bool) -> Any:
        module = self.modules.get((node.name, k))
        swaps = {param: env[var] for param, var in tied.items() if var in env}
        training = self.training

        def call(*tensors):
            # In training, dropout_p and F.dropout's training are the
            # generated code's training values (SDPA with dropout takes the
            # math path, saving its probabilities and mask), also when a
            # checkpointed unit recomputes in backward.
            try:
                with (torch.nn.utils.stateless._reparametrize_module(module, swaps)
                      if swaps else contextlib.nullcontext()), meta.training(training):
                    return meta.run(node, module, list(tensors), {}, self.hooks, env=names)
            except OutOfBudget:
                raise
            except Exception:
                self.failed_at = node  # the layer a build note names (_or_estimate)
                raise

        if checkpoint and node.op.has_module:
            # The recompute keeps ``call`` until backward: it must not keep
            # forward's values alive through ``names`` (the generated code's
            # module keeps none), only their sizes.
            names = {name: _Sizes(t.shape) for name, t in names.items()
                     if isinstance(t, torch.Tensor)}
            return torch.utils.checkpoint.checkpoint(call, *x, use_reentrant=False)
        return call(*x)

    def losses(self, tracker: _Tracker, outputs: Mapping[str, torch.Tensor],
               targets: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """The training script's loss over ``outputs`` (by name)."""
        train = self.graph.train
        devices = {v: n.devices[-1] for n in self.graph.nodes for v in n.value_names}
        devices |= {out: devices[v] for out, v in self.graph.aliases if v in devices}
        parts = []
        loss_device = devices.get(train.losses[0].output, "cpu") if train.losses else "cpu"
        for loss, target in zip(train.losses, targets):
            out = outputs.get(loss.output)
            if out is None or target is None:
                continue
            device = devices.get(loss.output, "cpu")
            with tracker.on(device, "loss"):
                target = self._copy(tracker, target, device) if device != _home(target,
                                                                                  tracker) \
                    else target
                fn = _loss_fn(loss)
                if loss.flatten:
                    value = fn(out.flatten(0, -2), target.flatten())
                elif loss.class_dim is not None and loss.class_dim != 1:
                    value = fn(out.movedim(loss.class_dim, 1), target)
                else:
                    value = fn(out, target)
                if device != loss_device:
                    value = _Move.apply(value, tracker, device, loss_device)
            parts.append(value)
        if not parts:
            return None
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total


def _home(t: torch.Tensor, tracker: _Tracker) -> Optional[str]:
    entry = tracker.live.get(_key(t))
    return entry[0] if entry else None


def _loss_fn(loss) -> Callable:
    cls = getattr(nn, loss.op, None)
    if isinstance(cls, type):
        try:
            return cls(**dict(loss.kwargs))
        except Exception:
            pass
    return lambda out, target: out.float().mean()  # a user's loss: one scalar


class _Sizes:
    """A tensor's sizes, as an expression like ``"=size(x, 1)"`` reads them."""

    def __init__(self, shape) -> None:
        self.shape = tuple(shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int) -> int:
        return self.shape[dim]


class _Names(Mapping):
    """Value name -> tensor, read from the forward's variables (sizes read them)."""

    def __init__(self, graph: Graph, env: Mapping[str, Any]) -> None:
        self.var = ({t.name: t.var for t in graph.inputs} | {n.name: n.var for n in graph.nodes}
                    | {e.name: e.var for n in graph.nodes for e in n.elements})
        self.env = env

    def __getitem__(self, name: str) -> Any:
        return self.env[self.var.get(name, name)]

    def __iter__(self):
        return (name for name, var in self.var.items() if var in self.env)

    def __len__(self) -> int:
        return len(self.var)


def _model(graph: Graph, budget: Budget) -> _Model:
    cached = _CACHE.get(id(graph))
    if cached is not None and cached[0]() is graph:
        return cached[1]
    model = _Model(graph, budget)
    _CACHE.clear()  # one graph at a time: its modules are the memory it costs
    _CACHE[id(graph)] = (_ref(graph), model)
    return model


_CACHE: dict[int, tuple[Callable[[], Any], _Model]] = {}


def _ref(graph: Graph) -> Callable[[], Any]:
    try:
        return weakref.ref(graph)
    except TypeError:
        return lambda: graph


# -- the plan ------------------------------------------------------------------

#: The ways of running the model a plan covers (MemoryPlan's fields).
MODES = ("train", "pipeline", "inference")


def plan(graph: Graph, *, batch: int | None = None, microbatches: int | None = None,
         schedule: str | None = None, dp: int | None = None, budget=None,
         modes: Sequence[str] = MODES) -> MemoryPlan:
    """Every device's memory for ``graph`` (placed: ``graph.plan`` set) at
    ``batch`` (default: the spec's ``train.batch_size``), and for its
    pipeline program under ``schedule``, ``microbatches`` and ``dp`` (default:
    the spec's ``pipeline:``, else the pipeline program's defaults: 1f1b,
    as many micro-batches as stages, one replica). Only ``modes`` are
    simulated (the others are empty): a caller that asks many times
    (``place --fit``) can skip what it does not read. NOTE [Memory plan]."""
    dims = dict(graph.dims)
    batch = batch or dims.get("batch") or (graph.train.batch_size if graph.train else 1)
    config = graph.pipeline
    stage_count = len((graph.spec_plan or graph.plan).sections)  # pp_<name>.py's stages
    schedule = schedule or (config.schedule if config else "1f1b")
    microbatches = microbatches or (config.microbatches if config else max(stage_count, 1))
    dp = dp or (config.dp if config else 1)
    if budget is None:
        running = active_budget()
        budget = running if isinstance(running, Budget) else Budget()
    mb = max(batch // max(dp, 1) // max(microbatches, 1), 1)
    if _too_large(graph):  # the estimate stands in, the same on every machine
        return MemoryPlan(batch, _estimate(graph, batch, False) if "train" in modes else (),
                          _estimate(graph, mb, False) if "pipeline" in modes else (),
                          _estimate(graph, batch, True) if "inference" in modes else (),
                          schedule, microbatches, dp)
    # The budget is checked between units and steps, never inside an operator:
    # an exception raised from inside a fake tensor's kernel can abort the process.
    unsimulated: list[tuple[str, str, Optional[Position]]] = []
    with warnings.catch_warnings(), _no_collection():
        warnings.simplefilter("ignore")
        built: Optional[str] = None  # why the layers could not be built, if they could not
        try:
            model = _model(graph, budget)
        except OutOfBudget:
            raise
        except Exception as problem:  # a layer the simulation cannot build: the estimate stands in
            model, built = None, _why(problem)
        train = inference = pipeline = ()
        if "train" in modes:
            train = _or_estimate(graph, batch, lambda: _train(model, {**dims, "batch": batch}),
                                 "train", model, built, unsimulated)
        if "inference" in modes:
            inference = _or_estimate(graph, batch, lambda: _inference(
                model, {**dims, "batch": batch}), "inference", model, built, unsimulated)
        if "pipeline" in modes:
            pipeline = _or_estimate(graph, mb, lambda: _pipeline(
                model, {**dims, "batch": mb}, schedule, microbatches, budget),
                "pipeline", model, built, unsimulated)
    return MemoryPlan(batch, train, pipeline, inference, schedule, microbatches, dp,
                      tuple(unsimulated))


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection while the step is simulated: a storage dies
    when reference counting frees it, as in the generated code, never when a
    collection happens to run (which made the plan differ from call to call
    when a reference cycle held a layer's inputs)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


#: The most layer runs (a layer in a block counting once per instance of
#: the block; torch.nn's composite layers by their parts:
#: :data:`COMPOSITE_RUNS`) whose step the plan simulates; beyond it, or with
#: a recurrent layer (the CPU's fake kernels loop over its steps in Python,
#: and oneDNN's LSTM workspace is not modelled), the additive estimate
#: stands in, the same on every machine: a build must stay inside its
#: budget (GPT-2 small, ~150 runs, takes ~3 s of simulation).
MAX_SIMULATED_LAYERS = 256
COMPOSITE_RUNS = {nn.TransformerEncoderLayer: 12, nn.TransformerDecoderLayer: 18,
                  nn.MultiheadAttention: 4, nn.TransformerEncoder: 72,
                  nn.TransformerDecoder: 108, nn.Transformer: 200}


def _too_large(graph: Graph) -> bool:
    blocks = {b.name: b for b in graph.blocks}
    recurrent = False

    def runs(nodes, depth: int = 0) -> int:
        nonlocal recurrent
        total = 0
        for node in nodes:
            target, inner = node.op.target, 1
            if node.op.kind is meta.OpKind.BLOCK and target in blocks and depth < 16:
                inner = runs(blocks[target].nodes, depth + 1)
            elif isinstance(target, type):
                recurrent = recurrent or issubclass(target, nn.RNNBase)
                inner = next((n for cls, n in COMPOSITE_RUNS.items()
                              if issubclass(target, cls)), 1)
            total += (node.repeat or 1) * max(inner, 1)
        return total

    return runs(graph.nodes) > MAX_SIMULATED_LAYERS or recurrent


def _or_estimate(graph: Graph, batch: int, simulate: Callable[[], tuple], mode: str,
                 model: Optional[_Model], built: Optional[str],
                 unsimulated: list[tuple[str, str, Optional[Position]]]
                 ) -> tuple[DeviceMemory, ...]:
    """``simulate()``, or where it cannot run (an operator without a fake
    kernel, a layout the schedule cannot run: check_pipeline says why), the
    additive estimate of analysis/costs.py at ``batch`` (phase "estimate"),
    with ``mode``, why and the layer that raised added to ``unsimulated``
    (codegen/report.py's ``memory_notes`` says so: never silently)."""
    if model is not None:
        model.failed_at = None
    try:
        return simulate()
    except OutOfBudget:
        raise
    except Exception as problem:
        at = model.failed_at if model is not None else None
        unsimulated.append((mode, built or _why(problem), at.pos if at is not None else None))
        return _estimate(graph, batch, mode == "inference")


def _why(problem: Exception) -> str:
    """An exception in a few words: its type and first line, at most 160 characters."""
    lines = str(problem).strip().splitlines()
    text = f"{type(problem).__name__}: {lines[0]}" if lines else type(problem).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _estimate(graph: Graph, batch: int, inference: bool) -> tuple[DeviceMemory, ...]:
    costs = graph.costs
    if costs is None:
        return ()
    scale = batch / max(dict(costs.dims).get("batch", batch), 1)
    sums: dict[str, list[int]] = {}
    for unit in costs.units:
        device = graph.nodes[unit.node].devices[unit.instance] if graph.nodes[
            unit.node].devices else "cpu"
        row = sums.setdefault(device, [0, 0, 0, 0])
        row[0] += unit.weight_bytes
        if not inference:
            row[1] += unit.grad_bytes
            row[2] += unit.optimizer_bytes
        row[3] += int(unit.activation_bytes * scale)
    return tuple(DeviceMemory(d, w, g, o, a, w + g + o + a, "estimate",
                              (("weights", w), ("gradients", g), ("optimizer", o),
                               ("activations", a)))
                 for d, (w, g, o, a) in sums.items())


def _devices(graph: Graph) -> list[str]:
    return list(dict.fromkeys(s.device for s in graph.plan.sections))


def _batch(graph: Graph, dims: Mapping[str, int]) -> tuple[list, list]:
    """Synthetic inputs and targets (fake, on the host) at ``dims``."""
    inputs = [_tensor(t.type, dims, t.high) for t in graph.inputs]
    targets = []
    for loss in graph.train.losses if graph.train else ():
        t = loss.target_type
        targets.append(_tensor(t, dims, loss.classes) if t is not None else None)
    return inputs, targets


def _tensor(t, dims: Mapping[str, int], high: Optional[int] = None) -> torch.Tensor:
    shape = [s if s is not None else 1 for s in t.concrete(dims)]
    dtype = meta.TORCH_DTYPES[t.dtype]
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    return torch.randint(0, max(high or 2, 1), shape, dtype=dtype)


def _host(graph: Graph) -> str:
    return "cpu" if "cpu" in _devices(graph) else _HOST


def _optimizer(model: _Model, params: list[nn.Parameter],
               cuda: Optional[bool] = None) -> Optional[torch.optim.Optimizer]:
    """The spec's optimizer over ``params``, in the form torch takes where it
    runs: ``foreach`` on CUDA (``cuda``; default: any device of the build)."""
    train = model.graph.train
    cls = getattr(torch.optim, train.optimizer, None)
    if not params or not isinstance(cls, type) or train.optimizer == "LBFGS":
        return None
    if cuda is None:
        cuda = any(d.startswith("cuda") for d in _devices(model.graph))
    kwargs = {"lr": train.lr, **dict(train.optimizer_kwargs)}
    groups = _param_groups(model, params, kwargs.get("weight_decay", 0.0))
    for extra in ({"foreach": cuda}, {}):
        try:
            return cls(groups, **kwargs, **extra)
        except (TypeError, ValueError):
            continue
    return None


_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.SyncBatchNorm, nn.BatchNorm1d,
          nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d,
          nn.InstanceNorm3d)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def _param_groups(model: _Model, params: list[nn.Parameter], weight_decay: float) -> list:
    """``params`` as the generated optimizer takes them: with ``train.no_decay``,
    the runtime's two groups (decayed weights, then the exempted biases, norms
    or embeddings), whose order the single-tensor step's temporaries follow
    (each parameter's are made while the previous one's last is alive)."""
    no_decay = tuple(model.graph.train.no_decay or ())
    if not no_decay:
        return params
    exempted: set[int] = set()
    for module in model.modules.values():
        if not isinstance(module, nn.Module):
            continue
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                if (("biases" in no_decay and name.endswith("bias"))
                        or ("norms" in no_decay and isinstance(sub, _NORMS))
                        or ("embeddings" in no_decay and isinstance(sub, _EMBEDDINGS))):
                    exempted.add(id(p))
    return [{"params": [p for p in params if id(p) not in exempted],
             "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in exempted], "weight_decay": 0.0}]


def _autocast(graph: Graph):
    amp = graph.train.amp if graph.train else "off"
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def _grad_hooks(model: _Model, tracker: _Tracker, params) -> list:
    """Each parameter's gradient is ``gradients`` from when it is accumulated."""
    units = {id(p): unit for p, _, unit in model.params.values()}
    return [p.register_post_accumulate_grad_hook(
        lambda p, unit=units.get(id(p)): tracker.retag(p.grad, "gradients", unit))
        for p in params]


def _state(tracker: _Tracker, model: _Model, optimizer) -> None:
    units = {id(p): unit for p, _, unit in model.params.values()}
    for p, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracker.retag(value, "optimizer", units.get(id(p)))


def _warm(tracker: _Tracker, model: _Model, optimizer, params) -> None:
    """The optimizer's state as after a first step (zero gradients, one
    ``step``): the measured step is then the steady state's."""
    if optimizer is not None:
        tracker.phase, tracker.unit = "optimizer step", "optimizer"
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        _state(tracker, model, optimizer)
    for p in params:
        p.grad = None


def _clip(graph: Graph, params) -> None:
    if graph.train and graph.train.grad_clip:
        nn.utils.clip_grad_norm_([p for p in params if p.grad is not None],
                                 graph.train.grad_clip)


def _train(model: _Model, dims: Mapping[str, int]) -> tuple[DeviceMemory, ...]:
    """Two steps of the single-process training script; the second measured."""
    graph = model.graph
    if graph.train is None:
        return ()
    tracker = _Tracker()
    host = _host(graph)
    ended: dict[str, int] = {}
    with model.fake, tracker:
        model.train(True)
        model.register(tracker)
        params = [p for p, _, _ in model.params.values() if p.requires_grad]
        for p in params:
            p.grad = None
        optimizer = _optimizer(model, params)
        hooks = _grad_hooks(model, tracker, params)
        try:
            _warm(tracker, model, optimizer, params)
            for step in (1,):
                tracker.reset()
                # the second micro-step holds the first's gradients; later ones repeat it
                for _ in range(min(max(graph.train.accumulate, 1), 2)):
                    tracker.phase, tracker.unit = "forward", ""
                    with tracker.on(host, "batch"):
                        inputs, targets = _batch(graph, dims)
                    env = {t.var: x for t, x in zip(graph.inputs, inputs)}
                    with _autocast(graph):
                        model.run_sections(tracker, graph.plan.sections, env, host)
                        outputs = dict(zip(graph.outputs, (env.get(v) for v in
                                                           graph.plan.returns)))
                        loss = model.losses(tracker, outputs, targets)
                    del env, inputs, outputs
                    if step == 1:
                        ended = {d: tracker.alive(d, ("activations", "transfers"))
                                 for d in tracker.total}
                    tracker.phase, tracker.unit = "backward", "backward"
                    if loss is not None and loss.requires_grad:
                        loss.backward()
                    del loss, targets
                tracker.phase, tracker.unit = "optimizer step", "optimizer"
                _clip(graph, params)
                if optimizer is not None:
                    optimizer.step()
                    _state(tracker, model, optimizer)
            extra = _unknown_state(model, optimizer, params)
        finally:
            for h in hooks:
                h.remove()
            for p in params:
                p.grad = None
    return _result(tracker, _devices(graph), ended, extra)


def _unknown_state(model: _Model, optimizer, params) -> dict[str, int]:
    """The state of an optimizer the plan cannot run, by the costs' table."""
    if optimizer is not None:
        return {}
    train = model.graph.train
    factor = optimizer_state(train.optimizer, dict(train.optimizer_kwargs))
    extra: dict[str, int] = defaultdict(int)
    for p, device, _ in model.params.values():
        if p.requires_grad:
            extra[device] += factor * p.numel() * p.element_size()
    return extra


def _result(tracker: _Tracker, devices: Sequence[str], ended: Mapping[str, int],
            extra: Mapping[str, int] = {}, inference: bool = False) -> tuple[DeviceMemory, ...]:
    result = []
    for device in devices:
        total, phase, parts, units = tracker.peak.get(device, (0, "", {}, {}))
        high = tracker.highest[device]
        state = extra.get(device, 0)
        at_peak = {part: parts.get(part, 0) for part in MEMORY_PARTS}
        at_peak["optimizer"] += state
        largest = sorted(((u, n) for u, n in units.items() if n > 0 and u),
                         key=lambda x: (-x[1], x[0]))[:3]
        weights = high.get("weights", 0)
        activations = ended.get(device, 0)
        if inference:
            activations = total - at_peak["weights"]
        elif not ended:  # the pipeline: its in-flight micro-batches at their most
            activations = high.get("activations", 0)
        result.append(DeviceMemory(
            device, weights, high.get("gradients", 0), high.get("optimizer", 0) + state,
            activations, total + state, phase, tuple(at_peak.items()), tuple(largest)))
    return tuple(result)


def _inference(model: _Model, dims: Mapping[str, int]) -> tuple[DeviceMemory, ...]:
    """The forward at the batch, without gradients, in eval mode."""
    graph = model.graph
    tracker = _Tracker()
    host = _host(graph)
    with model.fake, tracker, torch.no_grad():
        model.train(False)
        model.register(tracker)
        tracker.reset()
        with tracker.on(host, "batch"):
            inputs, _ = _batch(graph, dims)
        env = {t.var: x for t, x in zip(graph.inputs, inputs)}
        saved = model.checkpointed
        model.checkpointed = frozenset()
        try:
            with _autocast(graph):
                model.run_sections(tracker, graph.plan.sections, env, host)
        finally:
            model.checkpointed = saved
            model.train(True)
        del env, inputs
    return _result(tracker, _devices(graph), {}, inference=True)


# -- the pipeline program ------------------------------------------------------

def _pipeline(model: _Model, dims: Mapping[str, int], schedule: str,
              microbatches: int, budget: Budget) -> tuple[DeviceMemory, ...]:
    """Each rank's step under ``schedule`` at the micro-batch size ``dims``:
    each stage's forward and backward measured once, then its rank's order
    replayed over those numbers (NOTE [Memory plan])."""
    graph = model.graph
    if graph.train is None:
        return ()
    # pp_<name>.py's stages are the spec's layout's; --device-map moves them.
    stages = pipeline_stages(graph, graph.spec_plan or graph.plan)
    mapped = dict(graph.device_map)
    count = len(stages)
    devices = [s.device for s in stages]
    distinct = list(dict.fromkeys(devices))
    if schedule in ("gpipe", "1f1b"):
        placed, ranks = list(range(count)), None
    else:
        ranks = len(distinct) if schedule not in ("zbv", "dualpipev") else None
        placed = list(stage_ranks(schedule, count, ranks))
    orders = rank_orders(schedule, count, microbatches, ranks)
    shapes: dict[str, tuple] = {}
    profiles = []
    for stage in stages:  # in order: a stage's gives are the next one's takes
        budget.check()
        profiles.append(_profile(model, stage, shapes, dims, count))
    result: dict[str, DeviceMemory] = {}
    # Each rank's device after --device-map; where the map puts several of
    # the spec's devices on one (``*=cpu``), each rank is its own process
    # there and keeps its spec device's name (as pp_<name>.py's --memory
    # names it), else it is named by the device it runs on.
    named = {d: map_device(d, mapped) for d in distinct}
    if len(set(named.values())) < len(named):
        named = {d: d for d in distinct}
    for rank, order in enumerate(orders):
        budget.check()
        mine = [k for k in range(count) if placed[k] == rank]
        runs_on = map_device(stages[mine[0]].device, mapped) if mine else "cpu"
        memory = _replay(model, [stages[k] for k in mine], {k: profiles[k] for k in mine},
                         order, microbatches, runs_on.startswith("cuda"), schedule == "gpipe")
        memory = dataclasses.replace(memory, device=named[memory.device])
        if memory.device not in result or memory.peak > result[memory.device].peak:
            result[memory.device] = memory  # ranks on one device: each its own process
    order = dict.fromkeys(named[d] for d in distinct)
    return tuple(result[d] for d in order if d in result)


@dataclasses.dataclass
class _Profile:
    """One stage's forward and backward on one micro-batch, in bytes: what F
    holds until its B (``held``), F's and B's highest point above where they
    start, what B leaves (``after``: negative, it frees what F held), the
    receive buffers PipelineStage keeps, and the last stage's output kept
    until the step ends."""

    held: int
    forward_peak: int
    backward_peak: int  # a later micro-batch's: the gradients are there
    first_backward_peak: int  # the first micro-batch's: it makes them
    after: int
    buffers: int
    kept: int
    gradients: int
    sent: int = 0  # the gradient of its inputs B sends back


def _stage_units(model: _Model, stage) -> list[tuple[str, int]]:
    return [(step.node, k) for step in stage.section.steps for k in range(step.start, step.stop)]


def _stage_params(model: _Model, stages) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The parameters (tied ones too: each stage has its own copy) and
    buffers of ``stages``' units."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for stage in stages:
        for key in _stage_units(model, stage):
            module = model.modules.get(key)
            if isinstance(module, nn.Module):
                params.update((id(p), p) for p in module.parameters())
                buffers.update((id(b), b) for b in module.buffers())
            elif isinstance(module, torch.Tensor):
                buffers[id(module)] = module
    return list(params.values()), list(buffers.values())


def _profile(model: _Model, stage, shapes: dict, dims: Mapping[str, int],
             count: int) -> _Profile:
    graph = model.graph
    device = stage.device
    tracker = _Tracker()
    params, buffers = _stage_params(model, [stage])
    trained = [p for p in params if p.requires_grad]
    with model.fake, tracker:
        model.train(True)
        for t in [*params, *buffers]:
            tracker.add(t, device, "weights")
        for p in trained:  # as after an earlier micro-batch's backward
            p.grad = torch.zeros_like(p)
        tracker.phase, tracker.unit = "F", ""
        env: dict[str, Any] = {}
        with tracker.moving(device):
            for v in stage.takes:
                if v in shapes:
                    shape, dtype = shapes[v]
                    x = torch.empty(shape, dtype=dtype)
                    if dtype.is_floating_point:
                        x.requires_grad_(True)
                    env[v] = x
            # The ranks that read the data (the first and the last stage)
            # hold the whole batch, inputs and targets, through the schedule.
            fed = _batch(graph, dims) if stage.index in (0, count - 1) else ([], [])
            if stage.index == 0:  # the micro-batch itself
                env |= {t.var: x for t, x in zip(graph.inputs, fed[0])}
        takes = [env.get(v) for v in stage.takes]
        # Held for the whole step, as the runtime holds them: the received
        # activations (PipelineStage's buffers) and the batch.
        buffers_bytes = _bytes([*takes, *fed[0], *fed[1]])
        start = tracker.total[device]
        tracker.reset()
        with _autocast(graph):
            model.run_sections(tracker, [stage.section], env, device,
                               frozenset(stage.takes) | {t.var for t in graph.inputs})
            gives = [env.get(v) for v in stage.gives]
            if stage.index < count - 1:
                gives = _sendable(tracker, device, gives, takes)
            loss = None
            if stage.index == count - 1:
                with tracker.on(device, "loss"):
                    targets = _batch(graph, dims)[1]  # not its inputs: they would stay
                loss = model.losses(tracker, dict(zip(graph.outputs, gives)), targets)
                del targets
        del env
        shapes.update((v, (tuple(g.shape), g.dtype)) for v, g in zip(stage.gives, gives)
                      if isinstance(g, torch.Tensor))
        x = None
        kept = 0  # the last stage's outputs: pp_<name>.py trains with return_outputs=False
        grads_in = _bytes(gives) if stage.index < count - 1 else 0
        forward_peak = tracker.peak.get(device, (start,))[0] - start
        held = tracker.total[device] - start
        begin = tracker.total[device]
        tracker.phase, tracker.unit = "B", "backward"
        tracker.reset()
        first = tracker.first = _FirstBackward(begin)

        def made(p: torch.Tensor) -> None:
            first.done += p.grad.untyped_storage().nbytes()
            first.see(tracker.total[device])

        hooks = [p.register_post_accumulate_grad_hook(made) for p in trained]
        if loss is not None:
            if loss.requires_grad:
                loss.backward()
        else:
            outs = [g for g in gives if isinstance(g, torch.Tensor) and g.requires_grad]
            with tracker.moving(device):
                grads = [torch.ones_like(g) for g in outs]
            if outs:
                torch.autograd.backward(outs, grads)
            del grads, outs
        backward_peak = tracker.peak.get(device, (begin,))[0] - begin
        tracker.first = None
        for h in hooks:
            h.remove()
        del gives, loss
        sent = _bytes([t.grad for t in takes if isinstance(t, torch.Tensor)])
        for t in takes:  # its input's gradient, sent (_replay keeps it where it waits)
            if isinstance(t, torch.Tensor):
                t.grad = None
        after = tracker.total[device] - begin  # the buffers above stay
        del takes, fed
        for p in trained:
            p.grad = None
    return _Profile(held, forward_peak, backward_peak, first.peak, after,
                    buffers_bytes + grads_in, kept, _bytes(trained), sent)


def _sendable(tracker: _Tracker, device: str, gives: list, takes: list) -> list:
    """A stage's outputs as pp_<name>.py sends them (its ``sendable`` hook):
    one passed on as received, a view, or not contiguous is a copy, which the
    stage holds until its backward."""
    received = {id(t) for t in takes if isinstance(t, torch.Tensor)}
    with tracker.on(device, "send"):
        return [g.clone(memory_format=torch.contiguous_format)
                if isinstance(g, torch.Tensor) and (id(g) in received or g._base is not None
                                                    or not g.is_contiguous()) else g
                for g in gives]


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _replay(model: _Model, stages, profiles: Mapping[int, _Profile], order,
            microbatches: int, cuda: bool, waits: bool = False) -> DeviceMemory:
    """A rank's step: its stages' actions in ``order`` over their profiles,
    then the optimizer's step over its parameters (in the form torch takes
    on the rank's device: ``foreach`` on ``cuda``). With ``waits`` (GPipe),
    each gradient a B sends stays until every B is done (torch's
    ScheduleGPipe waits for its sends then); else it goes with the send."""
    device = stages[0].device
    params, buffers = _stage_params(model, stages)
    trained = [p for p in params if p.requires_grad]
    weights = _bytes([*params, *buffers])
    gradients = _bytes(trained)
    state, step_peak = _optimizer_step(model, trained, device, cuda)
    base = {"weights": weights, "optimizer": state,
            "transfers": sum(p.buffers for p in profiles.values()) * microbatches,
            "gradients": 0, "activations": 0}
    best = (sum(base.values()), "F0", dict(base), 0)
    highest_activations = 0
    graded: set[int] = set()  # the stages whose gradients exist
    waiting = 0  # the sent gradients GPipe keeps
    for kind, k, i in order:
        profile = profiles.get(k)
        if profile is None:
            continue
        now = sum(base.values())
        if kind == FORWARD:
            if now + profile.forward_peak > best[0]:
                best = (now + profile.forward_peak, f"F{i}", dict(base), profile.forward_peak)
            base["activations"] += profile.held
        elif kind == BACKWARD:
            rise = profile.backward_peak if k in graded else profile.first_backward_peak
            if now + rise > best[0]:
                best = (now + rise, f"B{i}", dict(base), rise)
            if k not in graded:
                graded.add(k)
                base["gradients"] += profile.gradients
            base["activations"] += profile.after + profile.kept
            if waits:
                base["activations"] += profile.sent
                waiting += profile.sent
        highest_activations = max(highest_activations, base["activations"])
    base["activations"] -= waiting
    base["gradients"] = gradients
    now = sum(base.values())
    if now + step_peak > best[0]:
        best = (now + step_peak, "optimizer step", dict(base), step_peak)
    total, phase, parts, transient = best
    at_peak = {part: parts.get(part, 0) for part in MEMORY_PARTS}
    at_peak["transient"] = transient
    units = []
    for stage in stages:
        for key in _stage_units(model, stage):
            module = model.modules.get(key)
            if isinstance(module, nn.Module):
                n = sum(p.numel() * p.element_size() for p in module.parameters())
                units.append((str(model.nodes[key[0]].unit(key[1])), n))
    largest = tuple(sorted((u for u in units if u[1]), key=lambda x: (-x[1], x[0]))[:3])
    return DeviceMemory(device, weights, gradients, state, max(highest_activations, 0), total,
                        phase, tuple(at_peak.items()), largest)


def _optimizer_step(model: _Model, params: list[nn.Parameter], device: str,
                    cuda: bool) -> tuple[int, int]:
    """(the optimizer's state, its step's highest point above the state) for
    ``params``, their gradients present."""
    tracker = _Tracker()
    with model.fake, tracker:
        optimizer = _optimizer(model, params, cuda)
        if optimizer is None:
            train = model.graph.train
            factor = optimizer_state(train.optimizer, dict(train.optimizer_kwargs))
            return factor * _bytes(params), 0
        for p in params:
            tracker.add(p, device, "weights")
        _warm(tracker, model, optimizer, params)
        for p in params:
            p.grad = torch.zeros_like(p)
        tracker.phase = "optimizer step"
        begin = tracker.total[device]
        state = tracker.parts[device]["optimizer"]
        tracker.reset()
        optimizer.step()
        peak = tracker.peak.get(device, (begin,))[0] - begin
        for p in params:
            p.grad = None
        optimizer.state.clear()
    return state, peak


# -- capacity ------------------------------------------------------------------

def capacities(graph: Graph) -> dict[str, tuple[int, Any]]:
    """Device (after --device-map) -> (bytes it holds, where that is written):
    the spec's ``capacity:`` and ``placement.auto.capacity``. A capacity of
    one of the layout's devices applies to the device --device-map maps it
    to, unless several map there (their capacities are not its own); one of
    another device (``cpu: 64GiB`` for a --device-map cpu build) to it."""
    request = graph.placement
    given = {c.device: (c.bytes, c.pos) for c in graph.capacity}
    for device, n in getattr(request, "capacity", ()) or ():
        given.setdefault(device, (n, request.pos))
    mapped = dict(graph.device_map)
    spec_devices = {s.device for s in (graph.spec_plan or graph.plan).sections}
    merged: dict[str, set[str]] = defaultdict(set)
    for device in spec_devices:
        merged[map_device(device, mapped)].add(device)
    limits = {}
    for device, limit in given.items():
        if device not in spec_devices:  # the device itself (cpu under --device-map cpu)
            limits[device] = limit
        elif len(merged[map_device(device, mapped)]) == 1:
            limits.setdefault(map_device(device, mapped), limit)
    return limits


def check_capacity(graph: Graph) -> list[MpgenError]:
    """One error per device whose planned peak (training, and the pipeline
    program when the spec has ``pipeline:``) exceeds its capacity, at the
    key that states the capacity."""
    memory = graph.memory
    limits = capacities(graph)
    if memory is None or not limits:
        return []
    errors = []
    modes = [("training", memory.train)] + ([("the pipeline program", memory.pipeline)]
                                           if graph.pipeline else [])
    for device, (limit, pos) in sorted(limits.items()):
        for mode, devices in modes:
            need = {d.device: d for d in devices}.get(device)
            if need is None or need.peak <= limit:
                continue
            parts = sorted(((p, n) for p, n in need.at_peak if n), key=lambda x: -x[1])[:3]
            largest = ", ".join(f"{u} {human_bytes(n)}" for u, n in need.largest)
            errors.append(MpgenError(pos, (
                f"{device} needs {human_bytes(need.peak)} for {mode} (its peak, in "
                f"{need.phase}) but its capacity is {human_bytes(limit)}: "
                + ", ".join(f"{p} {human_bytes(n)}" for p, n in parts)
                + (f"; the units holding the most: {largest}" if largest else "")
                + "; lower train.batch_size, add micro-batches or checkpoint, or place less "
                  "on it (docs/memory.md)")))
            break
    return errors
