"""Build-time shapes, dtypes and parameter counts, on the meta device.

Every layer is constructed with ``torch.device("meta")`` (no memory is
allocated) and run on meta tensors, so shape errors surface at build time at
the layer's line, and parameter counts come from the real modules.

# NOTE: [Symbolic dims]
# Symbolic dims (``batch``, ``seq``) are given distinct large prime sizes for
# the meta run. An output dim equal to one of them is shown by its name; one
# that is a product of them and a constant (``torch.flatten`` of
# ``[batch, seq, 768]``) as ``batch*seq*768``; a multiple of a symbol with a
# large remainder as ``?``. A size computed from a symbol by other arithmetic
# (a strided convolution over a symbolic height: ``(height - 1) // 2 + 1``)
# looks like a constant in one run, so the graph is run twice, the second
# time with the primes given to the symbols in the opposite order: a dim
# that reads the same in both runs is what it reads (a constant, a symbol, a
# product), one that differs depends on the symbols in a way no name
# describes and is ``?`` (``SymDim(known=False)``), never an internal size.
# Sizes in torch's own error messages are translated back as in the first
# run (those of the second only when it alone fails).
#
# Recurrent layers (``nn.RNN``/``LSTM``/``GRU``, also inside a user module)
# are the one place where a prime size is work, not just a number: their meta
# kernels loop over the time steps in Python, so an LSTM over ``seq`` would
# take 10,007 steps per run. ``meta.short_sequences`` runs them over one
# step instead and gives the output the sequence's real length (the dim
# that is the input's time dim, so it still reads ``seq`` in both runs, or
# ``?`` when the input's was). Nothing else they return depends on the
# length: the state is [layers * directions, batch, hidden] and the output's
# other dims are batch and features. An LSTM over ``seq`` costs what one
# over 1 does.
#
# Sizes far past a table do not fail on meta where the table is read by
# index: an ``Embedding`` (or ``F.embedding``) looks nothing up on meta,
# so a position table of 64 rows read through ``torch.arange(size(idx,
# 1))`` runs at seq = 10,007. The interpreter keeps the range of such
# indices (NOTE [Index ranges] in ``meta``) and ``_Runner.check_indices``
# compares it with the table's rows: indices past them at a fixed size or
# at the training and test sizes are refused at the table's line, and so
# are indices that grow with a symbolic dim ``train.dims`` does not size
# (it has no end, and no run says how long a sequence the model will get);
# one it sizes is checked at those sizes (NOTE [Sample sizes]).
#
# NOTE: [Sample sizes]
# Runs at primes near 10,007 say what a spec computes, not that it runs at
# the sizes its generated code uses: a 32x32 kernel over ``[batch, 3, h, w]``
# works at h = 10,007 and fails at 16. Those sizes have one source, the
# training sizes ``TrainConfig.dims`` (``train.batch_size``, ``train.dims``,
# 16 for a dim ``train.dims`` leaves out): the training script's
# ``make_batch`` defaults to them (``codegen/train.py``), the generated
# tests' ``make_inputs`` uses them with a batch of ``TEST_BATCH`` per
# micro-batch (``Graph.test_dims``; the tests draw no other sizes), and the
# costs are measured at them. So after the prime runs the graph runs once
# more at each of the two, with the batch a layer sees (a micro-batch's,
# when ``pipeline:`` splits the batch): ``check_sample_sizes``. A failure
# there is refused at the first input with a dim to change, naming the
# dims, and the sizes to set in ``train.dims``: the smallest doubling of
# the non-batch dims that runs, less each dim not needed for it
# (``_larger_sizes``). The build never picks other sizes by itself: they
# are the training script's defaults and the costs placement balances, so
# they stay what the spec says.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from mpgen.compiler.analysis import meta
from mpgen.compiler.analysis.budget import Budget, OutOfBudget
from mpgen.compiler.ir import (
    BlockClass,
    Dim,
    Graph,
    InputTensor,
    Node,
    OpKind,
    SymDim,
    TensorType,
)
from mpgen.errors import Collector, ErrorList, MpgenError

_PRIMES = (10007, 10009, 10037, 10039, 10061, 10067, 10069, 10079, 10091, 10093,
           10099, 10103, 10111, 10133, 10139, 10141, 10151, 10159, 10163, 10169)
# Smaller primes for inputs with 5 or 6 symbolic dims (10007**5 overflows int64).
_SMALL_PRIMES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061,
                 1063, 1069, 1087, 1091, 1093, 1097, 1103, 1109, 1117, 1123)
MAX_SYMBOLS = len(_PRIMES)
MAX_SYMBOLS_PER_INPUT = 6
_INT_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


class _Symbols:
    """Symbolic dim names <-> the prime sizes used for them on meta."""

    def __init__(self, names: Sequence[str], small: bool = False,
                 reverse: bool = False) -> None:
        primes = _SMALL_PRIMES if small else _PRIMES
        self.names = tuple(names)
        self.small = small
        self.floor = min(primes)
        self.value = {n: p for n, p in zip(names, primes[::-1] if reverse else primes)}
        self.name = {p: n for n, p in self.value.items()}

    @classmethod
    def at(cls, sizes: Mapping[str, int]) -> "_Symbols":
        """The symbols at the sizes the generated code uses, shown as numbers
        (NOTE [Sample sizes])."""
        symbols = cls(())
        symbols.names, symbols.value = tuple(sizes), dict(sizes)
        return symbols

    def other(self) -> "_Symbols":
        """The same symbols at other primes (the second run, NOTE [Symbolic dims])."""
        return _Symbols(self.names, self.small, reverse=True)

    @classmethod
    def of(cls, inputs: Sequence[InputTensor]) -> "_Symbols":
        """Symbols of the inputs' shapes; too many is an error at the input."""
        names: list[str] = []
        widest = 0
        for t in inputs:
            symbolic = [s for d in t.type.shape if isinstance(d, SymDim) for s in d.symbols]
            names += [d for d in symbolic if d not in names]
            widest = max(widest, len(symbolic))
            if len(names) > MAX_SYMBOLS:
                raise MpgenError(t.pos, f"input {t.name!r}: at most {MAX_SYMBOLS} different "
                                 "symbolic dims are supported in a spec")
            if len(symbolic) > MAX_SYMBOLS_PER_INPUT:
                raise MpgenError(t.pos, f"input {t.name!r}: at most {MAX_SYMBOLS_PER_INPUT} "
                                 "symbolic dims per input are supported; give the others "
                                 "as sizes")
        return cls(names, small=widest > 4)

    def size(self, dim: Dim) -> int:
        return dim if isinstance(dim, int) else dim.size(self.value)

    def dim(self, size: int) -> Dim:
        if size in self.name:
            return SymDim.named(self.name[size])
        factors, rest = [], size
        for prime, name in self.name.items():
            while rest % prime == 0 and rest > 1:
                factors.append(name)
                rest //= prime
        if not factors:
            return size
        if rest >= self.floor:
            return SymDim(known=False)
        return SymDim(tuple(factors), rest)

    def type(self, tensor: torch.Tensor) -> TensorType:
        return TensorType(tuple(self.dim(int(s)) for s in tensor.shape),
                          meta.DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).replace("torch.", "")))

    def text(self, message: str) -> str:
        return re.sub(r"\d{4,}", lambda m: str(self.dim(int(m.group()))), message)

    def tensor(self, t: TensorType) -> torch.Tensor:
        return torch.empty([self.size(d) for d in t.shape], dtype=meta.TORCH_DTYPES[t.dtype],
                           device="meta")


def infer(graph: Graph, budget: Optional[Budget] = None) -> Graph:
    """Fill ``out`` and ``params`` of every node (and blocks' shape comments),
    within ``budget`` (default: no deadline)."""
    budget = budget or Budget()
    with budget.watching():
        return _infer(graph, budget)


def _infer(graph: Graph, budget: Budget) -> Graph:
    symbols = _Symbols.of(graph.inputs)
    blocks = {b.name: b for b in graph.blocks}
    try:
        nodes, uses, limits = _run(graph, symbols, blocks, budget)
    except OutOfBudget:
        raise
    except MpgenError as error:
        raise _agree_errors(error, graph, symbols.other(), blocks, budget) from None
    # NOTE [Symbolic dims]: what a size derived from a symbol looks like at
    # other primes tells it from a constant.
    again, uses_again, _ = _run(graph, symbols.other(), blocks, budget)
    nodes = [_agree_node(n, m) for n, m in zip(nodes, again)]
    for name, per_use in uses.items():
        uses[name] = [(values, {k: _agree(t, other[1].get(k)) for k, t in types.items()},
                       count, layers)
                      for (values, types, count, layers), other
                      in zip(per_use, uses_again.get(name, []))]
    check_sample_sizes(graph, blocks, budget)
    inputs = tuple(_with_high(t, nodes, blocks) for t in graph.inputs)
    block_classes = tuple(_block_facts(b, uses.get(b.name, [])) for b in graph.blocks)
    return dataclasses.replace(graph, nodes=tuple(nodes), inputs=inputs, blocks=block_classes,
                               dim_limits=tuple((dim, *limits[dim]) for dim in sorted(limits)))


def _run(graph: Graph, symbols: _Symbols, blocks: Mapping[str, BlockClass], budget: Budget):
    """The nodes with their types at ``symbols``' sizes, and every block use."""
    runner = _Runner(symbols, blocks, budget)
    runner.sized = set(graph.train.dims_given) if graph.train is not None else set()
    env = {}
    for t in graph.inputs:
        try:
            env[t.name] = symbols.tensor(t.type)
        except RuntimeError as exc:
            raise MpgenError(t.pos, f"input {t.name!r}: {t.type} is too large to check "
                             f"({_clean(exc)})") from None
    with warnings.catch_warnings():
        # Warnings of torch's modules on meta tensors are noise among errors.
        warnings.simplefilter("ignore")
        nodes = runner.run_nodes(graph.nodes, env)
    runner.errors.raise_if_any()
    return nodes, runner.block_uses, runner.limits


#: How many times the non-batch dims may double in the search for sizes a
#: spec runs at (16 -> 1,024), each a run of the graph on meta.
_DOUBLINGS = 6


def sample_sizes(graph: Graph) -> dict[str, dict[str, int]]:
    """What each of the generated code's sizes is called -> the sizes a layer
    sees there: the training sizes and the generated tests' (NOTE [Sample
    sizes]), the batch a micro-batch's (the smallest ``tensor_split`` gives)."""
    micro = graph.pipeline.microbatches if graph.pipeline else 1
    named = {"the training sizes": dict(graph.dims),
             "the sizes of the generated tests": graph.test_dims}
    for dims in named.values():
        if "batch" in dims:
            dims["batch"] //= micro
    if named["the training sizes"] == named["the sizes of the generated tests"]:
        return {"the training and test sizes": named["the training sizes"]}
    return named


def check_sample_sizes(graph: Graph, blocks: Mapping[str, BlockClass], budget: Budget) -> None:
    """Run the graph at :func:`sample_sizes`; a failure is an MpgenError that
    names the dims and the ``train.dims`` that would run (NOTE [Sample sizes])."""
    if not graph.dims:
        return  # every size is fixed: the prime runs ran the model at them
    named = sample_sizes(graph)
    for label, dims in named.items():
        error = _failure(graph, dims, blocks, budget)
        if error is None:
            continue
        per = " per micro-batch" if graph.pipeline else ""
        shown = ", ".join(f"{name}={size}{per if name == 'batch' else ''}"
                          for name, size in dims.items())
        larger = _larger_sizes(graph, named, blocks, budget)
        if larger is None:
            raise MpgenError(error.pos, f"{error.message}, at {label} ({shown}); the training "
                             "script and the generated tests run at these sizes: set them with "
                             "train.batch_size and train.dims") from None
        given = next(t for t in graph.inputs if set(t.type.symbols) & set(larger))
        names = " and ".join(larger)
        fix = ", ".join(f"{name}: {size}" for name, size in larger.items())
        layer = f"line {error.pos.line}" if error.pos.file == given.pos.file else error.pos
        raise MpgenError(given.pos, f"input {given.name!r}: {names} too small at {label} "
                         f"({shown}): {error.message} ({layer}); set train.dims: {{{fix}}}") \
            from None


def _failure(graph: Graph, dims: Mapping[str, int], blocks: Mapping[str, BlockClass],
             budget: Budget) -> Optional[MpgenError]:
    """The first error of the graph run at ``dims`` (None: it runs)."""
    try:
        _run(graph, _Symbols.at(dims), blocks, budget)
    except OutOfBudget:
        raise
    except MpgenError as error:
        return _error_list(error)[0]
    return None


def _larger_sizes(graph: Graph, named: Mapping[str, dict[str, int]],
                  blocks: Mapping[str, BlockClass], budget: Budget) -> Optional[dict[str, int]]:
    """The non-batch dims to change, and their sizes, for the graph to run at
    every one of ``named``: the smallest doubling of them all that runs,
    less each dim that need not change (None: no doubling up to
    :data:`_DOUBLINGS` runs)."""
    first = next(iter(named.values()))
    names = [name for name in first if name != "batch"]
    if not names:
        return None

    def runs(sizes: Mapping[str, int]) -> bool:
        return all(_failure(graph, dims | sizes, blocks, budget) is None
                   for dims in named.values())

    for k in range(1, _DOUBLINGS + 1):
        sizes = {name: first[name] << k for name in names}
        if runs(sizes):
            break
    else:
        return None
    for name in names:
        if runs(sizes | {name: first[name]}):
            sizes[name] = first[name]
    return {name: size for name, size in sizes.items() if size != first[name]}


def _agree_errors(error: MpgenError, graph: Graph, other: _Symbols,
                  blocks: Mapping[str, BlockClass], budget: Budget) -> MpgenError:
    """``error`` with every size that differs at ``other``'s primes as ``?``
    (NOTE [Symbolic dims]): ``flat gives [batch, ?]``, never the size of a
    flattened strided convolution at the internal sizes."""
    try:
        _run(graph, other, blocks, budget)
    except OutOfBudget:
        raise
    except MpgenError as again:
        first, second = _error_list(error), _error_list(again)
        if [e.pos for e in first] == [e.pos for e in second]:
            merged = [MpgenError(a.pos, _agree_text(a.message, b.message))
                      for a, b in zip(first, second)]
            return ErrorList(merged) if len(merged) > 1 else merged[0]
    return error


def _error_list(error: MpgenError) -> list[MpgenError]:
    return list(error.errors) if isinstance(error, ErrorList) else [error]


def _agree_text(first: str, second: str) -> str:
    """``first`` with each number that ``second`` has otherwise as ``?``."""
    a, b = re.split(r"(\d+)", first), re.split(r"(\d+)", second)
    if len(a) != len(b) or a[::2] != b[::2]:
        return first
    return "".join(x if i % 2 == 0 or x == y else "?" for i, (x, y) in enumerate(zip(a, b)))


def _agree_node(node: Node, again: Node) -> Node:
    """``node`` with the types both runs agree on (its output, or the
    elements of a tuple it returns)."""
    changes = {"out": _agree(node.out, again.out)}
    elements = getattr(node, "elements", None)
    if elements:
        changes["elements"] = tuple(dataclasses.replace(e, type=_agree(e.type, f.type))
                                    for e, f in zip(elements, again.elements))
    return dataclasses.replace(node, **changes)


def _agree(first: Any, second: Any) -> Any:
    """A type as the two runs agree on it: a dim that differs is ``?``."""
    if isinstance(first, TensorType) and isinstance(second, TensorType):
        if len(first.shape) != len(second.shape):
            return first
        shape = tuple(a if a == b else SymDim(known=False)
                      for a, b in zip(first.shape, second.shape))
        return dataclasses.replace(first, shape=shape)
    if isinstance(first, (tuple, list)) and isinstance(second, (tuple, list)) \
            and len(first) == len(second):
        return type(first)(_agree(a, b) for a, b in zip(first, second))
    return first


class _Runner(meta.Hooks):
    """Runs the graph on meta tensors, turning failures into spec errors."""

    def __init__(self, symbols: _Symbols, blocks: Mapping[str, BlockClass],
                 budget: Budget) -> None:
        super().__init__(budget)
        self.symbols = symbols
        self.blocks = blocks
        self.errors = Collector()
        self.modules: dict[str, nn.Module] = {}  # built layers, for ties
        # block name -> [(param values, {node: type}, params count,
        # {layer: params count})] per use
        self.block_uses: dict[str, list[tuple[dict, dict, int]]] = {}
        self.sized: set[str] = set()  # symbolic dims with a training size the spec gives
        #: dim -> (its largest size, why): a sized symbolic dim whose indices
        #: read a table (check_indices); the scripts refuse data past it.
        self.limits: dict[str, tuple[int, str]] = {}

    def run_nodes(self, nodes: Sequence[Node], env: dict[str, Any]) -> list[Node]:
        result = []
        for node in nodes:
            try:
                out, (count, frozen) = self.run_node(node, env)
                values = self.unpack(node, node.name, out)
            except OutOfBudget:
                raise
            except MpgenError as exc:
                self.errors.extend(exc)
                return result
            env.update(values)
            if node.ties:
                node = dataclasses.replace(node, ties=self.typed_ties(node))
            if node.pattern:
                elements = tuple(dataclasses.replace(e, type=self.symbols.type(values[e.name]))
                                 for e in node.elements)
                result.append(dataclasses.replace(node, elements=elements, params=count,
                                                  frozen_params=frozen))
            else:
                result.append(dataclasses.replace(
                    node, out=None if node.held else self.symbols.type(out), params=count,
                    frozen_params=frozen))
        return result

    def unpack(self, node: Node, label: str, out: Any) -> dict[str, Any]:
        try:
            return meta.unpack(node, out)
        except meta.OutputError as exc:
            raise MpgenError(node.pos, f"layer {label!r}: {node.op.spelled} {exc}") from None

    def tie(self, node: Node, module: nn.Module) -> set[str]:
        """Make ``node``'s tied parameters its owners' (NOTE: ties); returns their names."""
        tied = set()
        for tie in node.ties:
            meta.share_tied(module, self.modules[tie.owner], node, tie, node.name)
            tied.add(tie.param)
        return tied

    def typed_ties(self, node: Node) -> tuple:
        """``node``'s ties with the types of the parameters they share."""
        owners = {t.owner: dict(self.modules[t.owner].named_parameters()) for t in node.ties}
        return tuple(dataclasses.replace(t, type=self.symbols.type(owners[t.owner][t.owner_param]))
                     for t in node.ties)

    def run_node(self, node: Node, env) -> tuple[torch.Tensor, tuple[int, int]]:
        """The layer's output, and its parameters per instance: all, and the frozen."""
        inputs = [env[name] for name in node.inputs]
        module = meta.build(node, {}, self.blocks, self) if node.op.has_module else None
        count = frozen = 0
        if module is not None:
            self.modules[node.name] = module
            tied = self.tie(node, module) if node.ties else set()
            # once each: a tie inside a block instance shares one parameter
            own = [p for name, p in module.named_parameters() if name not in tied]
            count = sum(p.numel() for p in own)
            frozen = sum(p.numel() for p in own if not p.requires_grad)
        out = meta.run(node, module, inputs, {}, self, env=env)
        if node.repeat and node.repeat > 1:
            self.check_chain(node, node.name, inputs[0], out)
        if node.per_copy:
            self.check_copies(node, module)
        return out, (count, frozen)

    def check_copies(self, node: Node, first: nn.Module) -> None:
        """Copies made with ``$index`` must each build and hold what the first
        does (placement and costs count every copy as the first)."""
        want = sum(p.numel() for p in first.parameters())
        for k in range(1, node.repeat):
            copy = meta.build(node, {}, self.blocks, self, index=k)
            got = sum(p.numel() for p in copy.parameters())
            if got != want:
                raise MpgenError(node.pos, f"layer {node.name!r}: copy {k} has {got:,} "
                                 f"parameters and copy 0 {want:,}: $index may change how a "
                                 "copy computes (a rate, a scale), not its sizes")

    def check_chain(self, node: Node, label: str, x: torch.Tensor, out: Any) -> None:
        """A repeated layer's copy must give what it was given (the next reads it)."""
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
            raise MpgenError(node.pos, f"layer {label!r}: repeat needs the output to match "
                             f"the input, but {self.symbols.type(x)} becomes "
                             f"{self.symbols.type(out)}")

    # -- meta.Hooks --------------------------------------------------------
    def build(self, node, label, params, make) -> nn.Module:
        try:
            return make()
        except MpgenError:
            raise
        except Exception as exc:
            raise MpgenError(node.pos, f"layer {label!r}: {meta.call_text(node, params)} cannot "
                             f"be built: {_clean(exc)}") from None

    def chain(self, node, label, layers, x, step) -> Any:
        """The copies of a repeated layer are alike and each is given what the
        first was (``check_chain``): running the first tells them all."""
        out = step(layers[0], x)
        if len(layers) > 1:
            self.check_chain(node, label, x, out)
        return out

    def run(self, node, label, params, module, fn, inputs, call) -> torch.Tensor:
        if module is not None and not isinstance(module, meta.MetaBlock):
            self.precheck(node, label, module, inputs, params)
        elif fn is nn.functional.embedding and len(inputs) > 1 and inputs[1].dim() >= 1:
            self.check_indices(node, label, params, int(inputs[1].shape[0]), inputs[0])
        try:
            with meta.short_sequences(module, _one_step):
                out = call()
        except MpgenError:
            raise
        except meta.OutputError as exc:
            raise MpgenError(node.pos, f"layer {label!r}: {node.op.spelled} {exc}") from None
        except Exception as exc:
            given = ", ".join(f"{name} {self.symbols.type(t)}"
                              for name, t in zip(node.inputs, inputs))
            on = f" on {given}" if given else ""
            raise MpgenError(node.pos, f"layer {label!r}: {meta.call_text(node, params)} "
                             f"fails{on}: {self.symbols.text(_clean(exc))}") from None
        if not isinstance(out, torch.Tensor) and not node.pattern:
            hint = (f"; make one element the layer's output with 'output: 0' (0 to "
                    f"{len(out) - 1})" if isinstance(out, (tuple, list)) else "")
            raise MpgenError(node.pos, f"layer {label!r}: {node.op.spelled} returns "
                             f"{type(out).__name__}, not a single tensor{hint}")
        return out

    def block_done(self, block, params, outputs, module) -> None:
        types = {name: self.symbols.type(outputs[name]) for n in block.nodes
                 for name in n.value_names}
        count = sum(p.numel() for p in module.parameters())
        # what trains: a frozen layer no output reads is no layer left untrained
        layers = {n.name: meta.parameter_count(module.get_submodule(n.name) if "." in n.name
                                               else getattr(module, n.name), trainable=True)
                  for n in block.nodes if n.op.has_module}
        self.block_uses.setdefault(block.name, []).append((dict(params), types, count, layers))

    def precheck(self, node: Node, label, module: nn.Module, inputs, params) -> None:
        """Explain the common mismatches in the spec's own terms."""
        if not inputs:
            return
        x = inputs[0]
        got = self.symbols.type(x)
        expected = None
        if isinstance(module, nn.Linear) and (x.dim() == 0 or x.shape[-1] != module.in_features):
            expected = f"[..., {module.in_features}]"
        elif isinstance(module, nn.modules.conv._ConvNd):
            n = len(module.kernel_size)
            if x.dim() not in (n + 1, n + 2) or x.shape[-n - 1] != module.in_channels:
                spatial = ", ".join("HWD"[i] if n > 1 else "L" for i in range(n))
                expected = f"[N, {module.in_channels}, {spatial}]"
        elif isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            x.dim() < 2 or x.shape[1] != module.num_features
        ):
            expected = f"[N, {module.num_features}, ...]"
        elif isinstance(module, nn.LayerNorm):
            ns = tuple(module.normalized_shape)
            if tuple(x.shape[-len(ns):]) != ns:
                expected = "[..., " + ", ".join(str(d) for d in ns) + "]"
        elif isinstance(module, nn.Embedding) and x.dtype not in _INT_DTYPES:
            raise MpgenError(node.pos, f"layer {label!r}: {meta.call_text(node, params)} expects "
                             f"integer indices but {node.inputs[0]} gives {got} {got.dtype}")
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            self.check_indices(node, label, params, module.num_embeddings, x)
        if expected:
            raise MpgenError(node.pos, f"layer {label!r}: {meta.call_text(node, params)} expects "
                             f"input {expected} but {node.inputs[0]} gives {got}")
        # Meta kernels do not check dtypes; CUDA and CPU kernels do.
        weight = next((p for p in module.parameters() if p.is_floating_point()), None)
        if weight is None or isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            return
        if not x.is_floating_point():
            raise MpgenError(node.pos, f"layer {label!r}: {meta.call_text(node, params)} expects "
                             f"floating-point input but {node.inputs[0]} gives {got} "
                             f"{got.dtype}")
        if x.dtype != weight.dtype:
            raise MpgenError(node.pos, f"layer {label!r}: {meta.call_text(node, params)} has "
                             f"{meta.DTYPE_NAMES.get(weight.dtype)} weights but "
                             f"{node.inputs[0]} gives {got.dtype}")


    def check_indices(self, node: Node, label: str, params, rows: int,
                      x: torch.Tensor) -> None:
        """A table of ``rows`` rows read with indices whose range the
        interpreter knows (NOTE [Index ranges] in ``meta``) must hold every
        one of them: meta kernels check no index, the model's run would (an
        IndexError). Indices that grow with a symbolic dim are refused unless
        ``train.dims`` sizes the dim: then the runs at the training and test
        sizes check them (NOTE [Sample sizes])."""
        found = meta.value_range(x)
        if found is None:
            return
        count = self.symbols.dim(found.count)
        symbolic = isinstance(count, SymDim)
        offset = found.high - (found.count - 1)  # arange(n) + offset: high = n - 1 + offset
        single = symbolic and count.known and len(count.symbols) == 1 and count.factor == 1
        if symbolic and count.known and set(count.symbols) <= self.sized:
            # checked at the sizes the spec gives (check_sample_sizes); the
            # scripts refuse data whose dim would read past the table
            if single and (count.symbols[0] not in self.limits
                           or rows - offset < self.limits[count.symbols[0]][0]):
                self.limits[count.symbols[0]] = (
                    rows - offset, f"layer {label!r} ({meta.call_text(node, params)}) has "
                    f"{rows:,} rows, read at positions up to {count.symbols[0]}"
                    + (f" + {offset - 1}" if offset > 1 else " - 1" if offset == 0 else ""))
            return
        if not symbolic and 0 <= found.low and found.high < rows:
            return
        origin = found.origin
        made = f"layer {origin.name!r} ({meta.call_text(origin, params)}, line {origin.pos.line})"
        call = (meta.call_text(node, params) if node.op.kind is not OpKind.FUNCTION
                else f"{node.op.spelled}'s table {node.inputs[1]!r}")
        where = f"layer {label!r}: {call} has {rows:,} rows, but {node.inputs[0]!r} reads it"
        if found.low < 0 and not symbolic:
            raise MpgenError(node.pos, f"{where} at index {found.low}, made by {made}: an "
                             "index below 0 is an IndexError when the model runs")
        if not symbolic:
            raise MpgenError(node.pos, f"{where} at indices up to {found.high:,}, made by "
                             f"{made}: an IndexError when the model runs; make the table at "
                             f"least {found.high + 1:,} rows, or the indices smaller")
        names = " and ".join(count.symbols) if count.known else "a symbolic dim"
        top = (f"{count} - 1" if offset == 0 else f"{count} + {offset - 1}" if offset > 1
               else str(count))
        most = rows - offset
        size = f" of at most {most:,}" if single and most >= 1 else ""
        past = f"any {names} over {most:,}" if single and most >= 1 else "a longer sequence"
        raise MpgenError(node.pos, f"{where} at indices up to {top}, made by {made}, and "
                         f"{names} is symbolic with no size in train.dims: {past} is an "
                         f"IndexError when the model runs (meta tensors check no index, so no "
                         f"build run shows it); give {names} a size{size} in train.dims (the "
                         f"training script and the tests run at it, and the build checks the "
                         f"table there) or in the input's shape, or compute the indices so "
                         f"that they stay below {rows:,}")


def _one_step(forward: Callable, input: torch.Tensor, dim: int, args, kwargs) -> Any:
    """A recurrent layer over one time step (``meta.short_sequences``):
    shapes are all that is wanted, and only the output's time dim depends on
    the sequence's length (NOTE [Symbolic dims])."""
    return forward(input.narrow(dim, 0, 1), *args, **kwargs)


def _clean(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _with_high(tensor: InputTensor, nodes: Sequence[Node], blocks) -> InputTensor:
    """Integer inputs: draw synthetic values below the smallest Embedding size."""
    if tensor.type.dtype not in ("int64", "int32"):
        return tensor
    embeddings = [n.init for n in nodes if n.inputs[:1] == (tensor.name,)
                  and n.op.kind is OpKind.MODULE and n.op.spelled == "Embedding"]
    sizes = [a.positional[0] for a in embeddings
             if a.positional and isinstance(a.positional[0], int)]
    sizes += [v for a in embeddings for k, v in a.keyword
              if k == "num_embeddings" and isinstance(v, int)]
    return dataclasses.replace(tensor, high=min(sizes) if sizes else None)


def _block_facts(block: BlockClass, uses) -> BlockClass:
    """Shape comments valid for every use of a block, and its count if fixed."""
    if not uses:
        return block
    counts = {count for _, _, count, _ in uses}
    shapes = []
    # A shape comment per value: a layer's output, or each named element.
    for name in [v for node in block.nodes for v in node.value_names]:
        types = [t.get(name) for _, t, _, _ in uses]
        if any(t is None for t in types):
            shapes.append((name, None))
            continue
        first = types[0]
        if any(len(t.shape) != len(first.shape) or t.dtype != first.dtype for t in types):
            shapes.append((name, None))
            continue
        dims = []
        for i, dim in enumerate(first.shape):
            column = [t.shape[i] for t in types]
            if all(c == dim for c in column):
                dims.append(dim)
                continue
            # A parameter names the dim only when it is the one parameter
            # whose value is the dim's size in every use: when several are
            # (equal-valued parameters), which one is the source cannot be
            # told from the sizes, and a name that merely has the value would
            # be wrong as often as right.
            by_param = [p for p in block.params
                        if all(values.get(p) == c for (values, *_), c in zip(uses, column))]
            dims.append(by_param[0] if len(by_param) == 1 else "?")
        shapes.append((name, TensorType(tuple(dims), first.dtype)))
    learning = {name for *_, layers in uses for name, n in layers.items() if n}
    return dataclasses.replace(block, shapes=tuple(shapes),
                               params_count=counts.pop() if len(counts) == 1 else None,
                               unused=_unused(block, learning))


def _unused(block: BlockClass, learning: set[str]) -> tuple[str, ...]:
    """Layers of ``block`` in ``learning`` (with parameters) that no output of
    the block depends on: training would never update them."""
    used = set(block.outputs)
    for node in reversed(block.nodes):
        if used & set(node.value_names):
            used.update(node.inputs)
    owners = {t.owner for n in block.nodes for t in n.ties}  # a held layer's readers train it
    return tuple(n.name for n in block.nodes if n.name in learning
                 and not used & set(n.value_names) and not (n.held and n.name in owners))
