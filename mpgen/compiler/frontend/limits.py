"""How much work one spec may ask for: every limit of a build, in one place.

A spec is a few lines of YAML, but what it asks for can grow without bound:
a repeat count, blocks that use blocks twice at every level, a huge training
size. Each limit here is a plain error at the offending line, checked before
the work it bounds is done: :func:`check_structure` before anything is
resolved or built, :func:`check_sizes` once the training sizes are known.
The analysis stage enforces :data:`MAX_LAYER_OBJECTS` while a layer is
built on meta; :class:`WorkBudget` holds :data:`DEFAULT_TIME_LIMIT` over a
spec's whole build (analysis, placement, code generation), in CPU seconds.
``docs/spec.md`` ("Limits") lists them for users; keep the two in step.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable, Iterator, Optional

from mpgen.compiler.ir import Graph
from mpgen.errors import Collector, MpgenError, Position
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import MAX_DIM, LayerSpec, Spec, TrainSpec

#: Copies of one layer (``repeat:``); a 96-layer GPT-3 uses 96.
MAX_REPEAT = 1_000
#: Layer instances of a whole model: every repeat and every layer of every
#: block instance, multiplied out through nesting (GPT-3 written with
#: nanoGPT's fine-grained blocks has about 2,100; ResNet-152 about 550).
MAX_INSTANCES = 5_000
#: Blocks inside blocks inside blocks ... (real models nest 2 or 3 deep).
MAX_BLOCK_DEPTH = 32
#: Dims of a model input.
MAX_RANK = 16
#: A training size (``train.batch_size``, a value of ``train.dims``), as the
#: largest size of an input dim.
MAX_TRAIN_SIZE = MAX_DIM
#: Elements of one model input at the training sizes (2**40, 4 TiB of float32).
MAX_ELEMENTS = 1 << 40
#: Parameter tensors, buffers and submodules that building one layer on the
#: meta device may create (an ``LSTM`` with 1,000 layers has 4,000 parameter
#: tensors, and takes seconds to build; GPT-2 XL as one module has about
#: 1,200 of all three).
MAX_LAYER_OBJECTS = 4_000
#: Layers one module stacks by its own argument (``num_layers`` of an
#: ``LSTM``, ``num_encoder_layers`` of a ``Transformer``): like ``repeat``.
#: A keyword is checked here, before the module is built (``nn.Transformer``
#: deep-copies its layers, which no creation hook sees); a positional one is
#: bounded by :data:`MAX_LAYER_OBJECTS` and the time budget.
MAX_STACKED = MAX_REPEAT
#: Tensors one operator may return (``torch.split(x, 1)``, ``torch.unbind``):
#: a million views take seconds to make, in one call the budget cannot stop.
MAX_OP_OUTPUTS = 100_000
#: CPU seconds the build of one spec may take once it is read: the front
#: end, the analysis (shapes and costs on the meta device), placement and
#: code generation. CPU time, not wall-clock time, so that whether a spec
#: builds does not depend on how loaded the machine is (NOTE [A budget of
#: CPU time]). The examples take at most 3.9 s (ResNet-50 over symbolic
#: sizes, 3 s of it the memory plan), a 96-block transformer 0.3 s; the
#: budget is four times the largest, because a loaded machine does stretch
#: CPU time somewhat (a build took 1.3x its idle CPU time beside 8 busy
#: processes on 2 cores: caches and switches), and torch's one-time import
#: of dynamo is not counted (``WorkBudget.paused``). Starting Python with
#: torch takes about 3 s more, so a spec that runs into the budget answers
#: within 20 s on an idle machine. Callers may raise it (``--time-limit``),
#: never remove it from a command line or a project's config; Python
#: callers may pass ``time_limit=None`` (benchmarks).
DEFAULT_TIME_LIMIT = 16.0

#: Bytes of address space (``RLIMIT_AS``) the child process that builds a
#: spec with code of its own may map (NOTE [User code in a child]): the
#: largest example maps 0.8 GiB; torch's threads reserve more on machines
#: with many cores.
MAX_BUILD_MEMORY = 8 << 30


def cpu_seconds() -> float:
    """CPU time this process has used (every thread, user and system)."""
    return time.process_time()


class OutOfBudget(MpgenError):
    """A build ran out of CPU time, or a layer asked for too much; not a
    failure of the layer itself, so no stage turns it into another error."""


# NOTE [A budget of CPU time]
# A wall-clock deadline makes a build's outcome depend on the machine's
# load: the same spec passed on an idle machine and failed on a CI runner
# at load 9. The budget counts this process's CPU time instead, which a
# loaded machine stretches out in wall-clock time but hardly changes. It is
# checked by plain calls (tick(), WorkBudget.check()) at every layer,
# module call, operator, parameter created, generated statement and black
# call, so nothing but those calls depends on it: no timer, thread or
# signal in the process that builds. Code of the user's (a module that
# sleeps or loops in pure Python, where no check is reached) runs in a
# child process instead (mpgen.commands.isolate), where the same budget
# is backed by RLIMIT_CPU and an idle watchdog.

_CURRENT: contextvars.ContextVar[Optional["WorkBudget"]] = contextvars.ContextVar(
    "mpgen_work_budget", default=None)


class WorkBudget:
    """The CPU seconds one spec's build may take (``seconds`` None: no
    limit), and what the build is doing, for the message when they run out."""

    #: Told of each task as it starts (where, what): the child process that
    #: builds a spec with code of its own reports them to its parent, which
    #: names the last one if the child dies (NOTE [User code in a child]).
    observer: Optional[Callable[[Optional[Position], str], None]] = None

    def __init__(self, seconds: Optional[float] = None) -> None:
        self.seconds = seconds
        self.deadline = None if seconds is None else cpu_seconds() + seconds
        # What is being done, innermost last: where, what, why it may be slow.
        self.tasks: list[tuple[Optional[Position], str, str]] = []

    @contextlib.contextmanager
    def task(self, pos: Optional[Position], what: str, why: str) -> Iterator[None]:
        """While ``what`` (``analysis of layer 'h.3'``, ``generating x.py``)
        is done: running out of the budget names it, at ``pos``."""
        self.tasks.append((pos, what, why))
        if WorkBudget.observer is not None:
            WorkBudget.observer(pos, what)
        try:
            self.check()
            yield
        finally:
            self.tasks.pop()

    def check(self) -> None:
        """Raise :class:`OutOfBudget` if the budget is spent while a task
        is under way (between tasks there is little to do, and the next
        task's check reports it)."""
        if self.deadline is None or not self.tasks or cpu_seconds() <= self.deadline:
            return
        pos, what, why = self.tasks[-1]
        raise OutOfBudget(pos, f"{what} ran past the {self.seconds:g} s CPU budget of a "
                          f"build; {why} (--time-limit SECONDS raises the budget)")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A fixed cost of the process, not of the spec (an import that
        happens once per process, whatever is built): the CPU time spent in
        the block moves the deadline, so a build costs the same first or
        later in a process."""
        start = cpu_seconds()
        try:
            yield
        finally:
            if self.deadline is not None:
                self.deadline += cpu_seconds() - start

    @contextlib.contextmanager
    def active(self) -> Iterator["WorkBudget"]:
        """Make this the budget :func:`tick` checks, until the block ends."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


def active_budget() -> Optional[WorkBudget]:
    """The budget :func:`tick` checks now, if any."""
    return _CURRENT.get()


def tick() -> None:
    """Check the active budget, if any: called in loops whose length grows
    with the spec (generated statements, placement over instances)."""
    budget = _CURRENT.get()
    if budget is not None:
        budget.check()


def check_structure(spec: Spec, source: SourceMap) -> None:
    """Repeats, block nesting, input ranks and the layer instances of the
    whole model, from the spec alone; raises MpgenError before anything is
    built (so exponential blocks are refused at once)."""
    errors = Collector()
    for name, tensor in spec.inputs.items():
        if len(tensor.shape) > MAX_RANK:
            errors.add(source.key(("inputs", name)), f"input {name!r}: {len(tensor.shape):,} "
                       f"dims; an input may have at most {MAX_RANK}")
    layers = [(("blocks", b, "layers"), spec.blocks[b].layers) for b in spec.blocks]
    layers.append((("layers",), spec.layers))
    for path, mapping in layers:
        for name, layer in mapping.items():
            for key, value in (layer.__pydantic_extra__ or {}).items():
                stacked = key == "num_layers" or (key.startswith("num_")
                                                  and key.endswith("_layers"))
                if (stacked and isinstance(value, int) and not isinstance(value, bool)
                        and value > MAX_STACKED):
                    errors.add(source.value((*path, name, key)), f"{_label(path, name)}: "
                               f"{key}: {value:,} is more than the {MAX_STACKED:,} layers "
                               "one module may stack")
            if layer.repeat is not None and layer.repeat > MAX_REPEAT:
                errors.add(source.value((*path, name, "repeat")), f"{_label(path, name)}: "
                           f"repeat: {layer.repeat:,} is more than the {MAX_REPEAT:,} copies "
                           "a layer may have")
    errors.raise_if_any()
    # A block may only use blocks defined before it (resolve reports any
    # other use), so one pass in order sees every block's insides first.
    instances: dict[str, int] = {}  # block -> layer instances in one instance of it
    depth: dict[str, int] = {}  # block -> levels of blocks, itself included
    for block_name, block in spec.blocks.items():
        path = ("blocks", block_name, "layers")
        instances[block_name] = _count(block.layers, instances)
        depth[block_name] = 1 + max((depth[layer.op] for layer in block.layers.values()
                                     if layer.op in depth), default=0)
        if depth[block_name] > MAX_BLOCK_DEPTH:
            name, inner = next((n, layer.op) for n, layer in block.layers.items()
                               if depth.get(layer.op) == MAX_BLOCK_DEPTH)
            errors.add(source.value((*path, name, "op")), f"{_label(path, name)}: block "
                       f"{inner!r} already nests {MAX_BLOCK_DEPTH} blocks deep, so "
                       f"{block_name!r} would nest {MAX_BLOCK_DEPTH + 1}; blocks may nest at "
                       f"most {MAX_BLOCK_DEPTH} deep")
            errors.raise_if_any()
    total = 0
    for name, layer in spec.layers.items():
        total += _count({name: layer}, instances)
        if total > MAX_INSTANCES:
            errors.add(source.key(("layers", name)), f"layer {name!r}: the model has "
                       f"{_number(total)} layer instances up to here (every repeat and every "
                       f"layer of every block instance); at most {MAX_INSTANCES:,} are "
                       "supported")
            errors.raise_if_any()


def check_sizes(graph: Graph, train: Optional[TrainSpec], source: SourceMap) -> None:
    """The training sizes, and each input's elements at them; raises MpgenError."""
    errors = Collector()
    train = train or TrainSpec()
    sizes = [(("train", "batch_size"), train.batch_size)]
    sizes += [(("train", "dims", name), size) for name, size in train.dims.items()]
    for path, size in sizes:
        if size > MAX_TRAIN_SIZE:
            errors.add(source.value(path), f"{'.'.join(path)}: {_number(size)} is larger than "
                       f"the largest size, {MAX_TRAIN_SIZE:,}")
    errors.raise_if_any()
    dims = dict(graph.dims)
    for tensor in graph.inputs:
        elements = tensor.type.numel(dims)
        if elements > MAX_ELEMENTS:
            shape = ", ".join(map(str, tensor.type.concrete(dims)))
            errors.add(tensor.pos, f"input {tensor.name!r}: {tensor.type} is [{shape}] at the "
                       f"training sizes, {_number(elements)} elements; an input may have at "
                       f"most {MAX_ELEMENTS:,}")
    errors.raise_if_any()


def _count(layers: dict[str, LayerSpec], instances: dict[str, int]) -> int:
    """Layer instances of ``layers``: each copy of a layer, plus the insides
    of each copy that is a block."""
    return sum((layer.repeat or 1) * (1 + instances.get(layer.op, 0))
               for layer in layers.values())


def _label(path: tuple, name: str) -> str:
    return f"layer {name!r} of block {path[1]!r}" if path[0] == "blocks" else f"layer {name!r}"


def _number(n: int) -> str:
    """``12,345``; astronomically large numbers (2**500) are not spelled out."""
    return f"{n:,}" if n < 10**30 else "more than 10**30"
