"""What each placement unit costs: parameters, memory, FLOPs, and cut bytes.

A *unit* is what placement never splits: a layer, one instance of a repeated
layer (``h.3``), or one block instance. :func:`measure` runs the model once on
the meta device at the training sizes (``train.batch_size`` and
``train.dims``; no memory is allocated) and returns a :class:`Costs`: one
:class:`~mpgen.compiler.ir.UnitCost` per unit in ``layers`` order, and the cut bytes between
neighbouring units. Automatic placement balances one of these numbers; the
placement report and ``mpgen diff`` show them.

# NOTE: [Cost formulas]
# Sizes are at the training sizes, ``Graph.dims``: ``batch`` =
# ``train.batch_size`` (or ``train.dims.batch``), other symbolic dims from
# ``train.dims`` (default 16), the sizes the build checked the spec at
# (NOTE [Sample sizes] in analysis/shapes.py).
#
# params       the unit's parameter count (``Node.params``).
# weights      bytes of its parameters and buffers, at their real dtypes.
# gradients    bytes of its trainable parameters (one gradient each).
# optimizer    ``state_factor x`` the trainable parameter bytes, from
#              ``train.optimizer`` (:data:`OPTIMIZER_STATE`): SGD 0 (1 with
#              momentum), Adam/AdamW 2 (3 with amsgrad), RMSprop 1 (+1 with
#              momentum, +1 centered), Adagrad 1, ...
# activations  bytes of the tensors autograd saves for backward while the unit
#              runs forward, each storage counted once, on the first unit that
#              saves it; parameters (and views of them) are not activations. A
#              unit whose output is a model output also keeps that output (the
#              loss reads it). Measured with ``saved_tensors_hooks`` on meta
#              tensors. Not counted: temporaries freed during forward (the peak
#              inside one layer), the loss's own saved tensors, allocator
#              fragmentation and the CUDA context; when a unit reads a tensor
#              from another device its copy is counted on the device that first
#              saved the original. If the meta run of a unit fails, its
#              activations fall back to its output bytes (``UnitCost.measured`` is
#              False).
# checkpointed a unit recomputed in backward (``checkpoint: true``, or on a
#              ``pipeline.checkpoint`` device) keeps what
#              ``torch.utils.checkpoint`` keeps: its inputs, each storage not
#              saved by an earlier unit, plus its output if it is a model
#              output:  activations = checkpoint_bytes = sum(inputs not counted
#              before) (+ output);  recomputed_bytes = the activations it would
#              keep otherwise - checkpoint_bytes (the memory saved, at least 0).
#              Every unit measures checkpoint_bytes; a unit checkpointed by its
#              device (known after placement) swaps the numbers then, and the
#              units after it keep theirs.
# memory       weights + gradients + optimizer + activations.
# flops        forward FLOPs counted by ``torch.utils.flop_counter`` (matmul,
#              convolution, attention: 2 per multiply-add); elementwise ops,
#              norms and embeddings count 0.
# cut j|j+1    bytes of every value produced by unit j or earlier and read by
#              unit j+1 or later (skip connections count on every boundary they
#              span). Model inputs are not counted: each device that reads one
#              gets its own copy from the caller wherever the cuts fall.
#
# A repeated layer's instances are identical, so instance 0 and instance 1
# are measured (instance 1 reads instance 0's output, as later ones do) and
# instances 2... repeat instance 1's numbers. The same holds for the copies
# of a repeated layer inside a block (``_Recorder.chain``): copies 0 and 1
# run, and each later copy adds copy 1's activations and flops; the last
# copy run hands its output on, as fresh as the real last copy's.
#
# Recurrent layers (``nn.RNN``/``LSTM``/``GRU``) loop over the time steps in
# Python on meta, seconds per hundred steps, so a long training ``seq`` would
# take minutes. Over T > 3 steps (``_Recorder.short``) they run over 2 and 3
# steps on fresh inputs, each run counting everything it saves, and
#     activations(T) = a2 + (T - 2) * (a3 - a2), likewise flops:
# every step does the same matmuls and saves the same tensors (gates, states,
# dropout masks between layers), and what does not grow with T (the initial
# state, read once) is in both runs and cancels in the difference, so this
# is exact, not an estimate (``tests/compiler/frontend/test_bounded_work.py``
# checks it against the full run). The input counts as the real run would count it: not again
# when an earlier unit saved it, and as saved for later units when the layer
# saves it. The output gets the real length (``meta.short_sequences``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from mpgen.compiler.analysis import meta
from mpgen.compiler.analysis.budget import Budget, OutOfBudget
from mpgen.compiler.ir import Costs, Graph, Node, TensorType, UnitCost

#: Optimizer state kept per parameter element, in units of the parameter's own
#: bytes, by ``torch.optim`` class. A callable gets the optimizer's keyword
#: arguments. Optimizers not listed count 2 (as Adam).
OPTIMIZER_STATE: dict[str, Any] = {
    "SGD": lambda kw: 1 if _positive(kw.get("momentum", 0)) else 0,  # momentum_buffer
    "Adam": lambda kw: 3 if kw.get("amsgrad") else 2,  # exp_avg, exp_avg_sq (+max_exp_avg_sq)
    "AdamW": lambda kw: 3 if kw.get("amsgrad") else 2,
    "Adamax": 2,  # exp_avg, exp_inf
    "NAdam": 2,  # exp_avg, exp_avg_sq
    "RAdam": 2,  # exp_avg, exp_avg_sq
    "SparseAdam": 2,  # exp_avg, exp_avg_sq
    "Adadelta": 2,  # square_avg, acc_delta
    "Adagrad": 1,  # sum
    "RMSprop": lambda kw: (1 + (1 if _positive(kw.get("momentum", 0)) else 0)
                           + (1 if kw.get("centered") else 0)),  # square_avg, buf, grad_avg
    "Rprop": 2,  # prev, step_size
    "ASGD": 1,  # ax
    "Muon": 1,  # momentum_buffer
    "Adafactor": 0,  # factored second moments: one row and one column vector per matrix
    "LBFGS": lambda kw: 2 * int(kw.get("history_size", 100)) + 2,  # old_dirs, old_stps, d, prev
}
DEFAULT_OPTIMIZER_STATE = 2


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def optimizer_state(name: str, kwargs: Mapping[str, Any]) -> int:
    """Optimizer state per parameter, in parameter-sized copies (see the table)."""
    rule = OPTIMIZER_STATE.get(name, DEFAULT_OPTIMIZER_STATE)
    return int(rule(kwargs)) if callable(rule) else int(rule)


def measure_graph(graph: Graph, budget: Optional[Budget] = None) -> Graph:
    """The graph with its unit costs at the training settings (``graph.costs``)
    and each node's forward flops per instance, within ``budget`` (default: no
    deadline)."""
    train = graph.train
    optimizer = train.optimizer if train else "SGD"
    kwargs = dict(train.optimizer_kwargs) if train else {}
    budget = budget or Budget()
    with warnings.catch_warnings(), budget.watching():
        warnings.simplefilter("ignore")  # torch's warnings on meta tensors are noise
        costs = measure(graph, dict(graph.dims), optimizer, kwargs, budget)
    flops = {u.node: u.flops for u in costs.units if u.instance == 0}
    nodes = tuple(dataclasses.replace(n, flops=flops.get(i, 0))
                  for i, n in enumerate(graph.nodes))
    return dataclasses.replace(graph, costs=costs, nodes=nodes)


def measure(graph: Graph, dims: Mapping[str, int], optimizer: str = "SGD",
            optimizer_kwargs: Optional[Mapping[str, Any]] = None,
            budget: Optional[Budget] = None) -> Costs:
    """Run the graph on meta at the sizes ``dims`` and cost every unit."""
    factor = optimizer_state(optimizer, dict(optimizer_kwargs or {}))
    blocks = {b.name: b for b in graph.blocks}
    recorder = _Recorder(budget)
    env: dict[str, Optional[torch.Tensor]] = {}
    value_bytes: dict[str, int] = {}
    for t in graph.inputs:
        env[t.name] = _meta_tensor(t.type, dims)
        value_bytes[t.name] = t.type.nbytes(dims)
    units: list[UnitCost] = []
    outputs = {graph.value_name(out) for out in graph.outputs}
    modules: dict[str, nn.Module] = {}
    for i, node in enumerate(graph.nodes):
        fallback_out = node.out.nbytes(dims) if node.out is not None else 0
        module = None
        if node.op.has_module:
            try:
                module = meta.build(node, {}, blocks, recorder)
            except OutOfBudget:
                raise
            except Exception:  # shapes.infer built it; only exotic modules get here
                module = None
        tied = _tie(node, module, modules, value_bytes)
        weights, trainable = _weight_bytes(module, node, tied)
        if module is not None:
            modules[node.name] = module
            recorder.exclude(module)
        # (activations, flops, out, ok, kept when checkpointed)
        measured: list[tuple[int, int, int, bool, int]] = []
        x = [env.get(name) for name in node.inputs]
        values: dict[str, Any] = {}
        for _ in range(min(node.instances, 2)):
            inputs = {t.untyped_storage()._cdata: t for t in x
                      if isinstance(t, torch.Tensor) and not recorder.counted(t)}
            before = dict(recorder.saved)
            out, act, flops = recorder.record(lambda: meta.run(node, module, x, {}, recorder,
                                                               env=env))
            if node.checkpoint:  # forward keeps only the inputs: NOTE [Cost formulas]
                recorder.saved = before
                for t in inputs.values():
                    recorder.keep(t)
            try:
                values = meta.unpack(node, out) if out is not None else {}
            except meta.OutputError:
                values = {}
            ok = bool(values) and all(isinstance(v, torch.Tensor) for v in values.values())
            out_bytes = sum(_nbytes(v) for v in values.values()) if ok else fallback_out
            measured.append((act if ok else out_bytes, flops if ok else 0, out_bytes, ok,
                             sum(_storage_bytes(t) for t in inputs.values())))
            x = [out if ok and not node.pattern else None, *x[1:]]
        for name in node.value_names:
            env[name] = values.get(name)
            value = values.get(name)
            value_bytes[name] = _nbytes(value) if value is not None else measured[-1][2]
        # A model output stays alive until the loss reads it.
        kept = sum(recorder.keep(values[name]) for name in node.value_names
                   if name in outputs and values.get(name) is not None)
        for k in range(node.instances):
            act, flops, out_bytes, ok, inputs_kept = measured[min(k, 1)]
            if k == node.instances - 1:
                act, inputs_kept = act + kept, inputs_kept + kept
            unit = UnitCost(node.unit(k), i, k, node.params, weights, trainable,
                            trainable * factor, act, flops, out_bytes, ok, inputs_kept)
            units.append(checkpointed_cost(unit) if node.checkpoint else unit)
    cuts = _cut_bytes(graph, units)
    return Costs(tuple(units), tuple(cuts), tuple(value_bytes.items()),
                 tuple(dims.items()), optimizer, factor)


def checkpointed_cost(unit: UnitCost) -> UnitCost:
    """``unit`` recomputed in backward: it keeps its inputs, not its activations."""
    return dataclasses.replace(unit, activation_bytes=unit.checkpoint_bytes, checkpointed=True,
                               recomputed_bytes=max(unit.activation_bytes
                                                    - unit.checkpoint_bytes, 0))


def _cut_bytes(graph: Graph, units: Sequence[UnitCost]) -> list[int]:
    """Bytes crossing each boundary between neighbouring units (skips included)."""
    first = {}
    last = {}
    for j, unit in enumerate(units):
        first.setdefault(unit.node, j)
        last[unit.node] = j
    index = {v: i for i, n in enumerate(graph.nodes) for v in n.value_names}
    # value produced by unit p, read last by unit r -> it crosses cuts p .. r-1
    spans: dict[int, int] = {}  # producer unit -> last reader unit
    for j, unit in enumerate(units):
        node = graph.nodes[unit.node]
        reads = list(node.inputs) if unit.instance == 0 else node.inputs[1:]
        if unit.instance > 0:
            spans[j - 1] = max(spans.get(j - 1, j), j)
        for name in reads:
            if name in index:
                producer = last[index[name]]
                spans[producer] = max(spans.get(producer, j), j)
    diff = [0] * (len(units) + 1)
    for producer, reader in spans.items():
        size = units[producer].out_bytes
        diff[producer] += size
        diff[reader] -= size
    cuts, running = [], 0
    for j in range(len(units) - 1):
        running += diff[j]
        cuts.append(running)
    return cuts


# -- running units on meta ---------------------------------------------------

class _Recorder(meta.Hooks):
    """Counts saved-for-backward bytes and FLOPs per unit run; what it does
    not run (long sequences, copies of a repeated layer inside a block) it
    counts from what it did run (NOTE [Cost formulas])."""

    def __init__(self, budget: Optional[Budget] = None) -> None:
        super().__init__(budget)
        self.saved: dict[int, Any] = {}  # storage id -> storage (kept alive)
        self.excluded: set[int] = set()
        self.current = 0
        self.counter: Any = None  # the FlopCounterMode of the unit being run
        self.extra_flops = 0  # flops of what was counted without running it

    def exclude(self, module: nn.Module) -> None:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            self.excluded.add(storage._cdata)
            self.saved.setdefault(storage._cdata, storage)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.current += self.keep(tensor)
        return tensor

    def keep(self, tensor: torch.Tensor) -> int:
        """Count ``tensor``'s storage unless it was counted (or excluded) before."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.saved or key in self.excluded:
            return 0
        self.saved[key] = storage
        return storage.nbytes()

    def counted(self, tensor: torch.Tensor) -> bool:
        key = tensor.untyped_storage()._cdata
        return key in self.saved or key in self.excluded

    def flops(self) -> int:
        return int(self.counter.get_total_flops()) + self.extra_flops

    def record(self, fn) -> tuple[Any, int, int]:
        """``fn()``'s result (None if it fails), saved bytes and FLOPs."""
        from torch.utils.flop_counter import FlopCounterMode

        self.current = 0
        self.extra_flops = 0
        self.counter = FlopCounterMode(display=False)
        try:
            with self.counter, torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                                        lambda t: t):
                out = fn()
        except OutOfBudget:
            raise
        except Exception:
            return None, 0, 0
        return out, self.current, self.flops()

    # -- meta.Hooks --------------------------------------------------------
    def run(self, node, label, params, module, fn, inputs, call) -> Any:
        with meta.short_sequences(module, self.short):
            return call()

    def short(self, forward, input: torch.Tensor, dim: int, args, kwargs) -> Any:
        """A recurrent layer over ``input``'s whole sequence, counted from runs
        over 2 and 3 steps (NOTE [Cost formulas]); returns the 3-step output."""
        already = self.counted(input)
        before, base, base_flops = dict(self.saved), self.current, self.flops()
        measured = []
        for steps in (2, 3):
            self.saved = dict(before)  # each run counts all it saves (the state too)
            x = meta.stand_in(input, dim, steps)
            if already:  # what the real run saves of its input is counted
                self.saved[x.untyped_storage()._cdata] = x.untyped_storage()
            self.current, flops = 0, self.flops()
            out = forward(x, *args, **kwargs)
            measured.append((self.current, self.flops() - flops))
        (act2, flops2), (act3, flops3) = measured
        extra = input.shape[dim] - 2
        self.current = base + act2 + extra * (act3 - act2)
        self.extra_flops += flops2 + extra * (flops3 - flops2) - (self.flops() - base_flops)
        if not already and self.counted(x):  # saved, and counted above
            self.saved[input.untyped_storage()._cdata] = input.untyped_storage()
        return out

    def chain(self, node, label, layers, x, step) -> Any:
        """Copies 2... of a repeated layer inside a block cost what copy 1
        does (NOTE [Cost formulas]); copies 0 and 1 are run."""
        if len(layers) <= 2:
            return super().chain(node, label, layers, x, step)
        out = step(layers[0], x)
        act, flops = self.current, self.flops()
        out = step(layers[1], out)
        copies = len(layers) - 2
        self.extra_flops += copies * (self.flops() - flops)
        self.current += copies * (self.current - act)
        return out


def _meta_tensor(t: TensorType, dims: Mapping[str, int]) -> torch.Tensor:
    return meta.meta_tensor([s if s is not None else 1 for s in t.concrete(dims)], t.dtype)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _tie(node: Node, module: Optional[nn.Module], modules: Mapping[str, nn.Module],
         value_bytes: dict[str, int]) -> set[str]:
    """Share ``node``'s tied parameters with their owners (as the generated
    code does); their bytes count on the owner, and as a value a tied layer
    on another device reads. Returns the tied names."""
    tied = set()
    for tie in node.ties:
        owner = modules.get(tie.owner)
        if module is None or owner is None:
            continue
        shared = owner.get_parameter(tie.owner_param)
        meta.share_parameter(module, tie.param, shared)
        value_bytes[tie.source] = _nbytes(shared)
        tied.add(tie.param)
    return tied


def _weight_bytes(module: Optional[nn.Module], node: Node,
                  tied: set[str] = frozenset()) -> tuple[int, int]:
    """(parameter + buffer bytes, trainable parameter bytes) of one instance,
    without the parameters it shares with another layer."""
    if module is None:
        return node.params * 4, node.params * 4
    params = [p for name, p in module.named_parameters(remove_duplicate=False)
              if name not in tied]
    weights = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for b in module.buffers())
    return weights, sum(_nbytes(p) for p in params if p.requires_grad)


def meta_modules(graph: Graph) -> Iterable[tuple[str, nn.Module]]:
    """``(attribute, module)`` for every layer that owns one, built on meta.

    A repeated layer gives an ``nn.ModuleList`` of fresh instances; block
    instances are :class:`~mpgen.compiler.analysis.meta.MetaBlock`\\ s named after the block.
    Used by the placement benchmark to hand the same model to other tools.
    """
    blocks = {b.name: b for b in graph.blocks}
    for node in graph.nodes:
        if not node.op.has_module:
            continue
        if node.repeat:
            yield node.name, nn.ModuleList(meta.build(node, {}, blocks, index=k)
                                           for k in range(node.repeat))
        else:
            yield node.name, meta.build(node, {}, blocks)


def human_bytes(n: float) -> str:
    """``1.2 GiB``, ``512.0 KiB``, ``96 B``: binary units, one decimal."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    exponent = 0
    while n >= 1024 ** (exponent + 1) and exponent < len(units) - 1:
        exponent += 1
    if exponent == 0:
        return f"{int(n)} B"
    return f"{n / 1024 ** exponent:.1f} {units[exponent]}"
