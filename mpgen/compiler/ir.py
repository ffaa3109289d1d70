"""The intermediate representation: resolved facts, no pydantic, no YAML.

Stages fill it in order, each returning new frozen objects:

- ``frontend`` builds the :class:`Graph`: ops, edges, identifiers, positions,
  the resolved :class:`TrainConfig` and the placement request
  (:class:`ExplicitPlacement` or :class:`AutoPlacement`);
- ``analysis`` adds output types, parameter counts, loss targets and the
  per-unit :class:`Costs`;
- ``placement`` adds a device per instance, the :class:`Layout` and the
  :class:`ForwardPlan` with its :class:`Transfer`\\ s;
- ``codegen`` reads only these objects.

# NOTE: [Names in the IR]
# Three small types carry what used to be string conventions: a
# :class:`SymDim` is a size known by name (``batch``, ``batch*seq*768``); a
# :class:`UnitRef` is one placement unit (``wte``, ``h.3``), and
# :func:`unit_labels` / :meth:`UnitRange.parse` are the one formatter and the
# one parser of their labels (``h.0-5``); a :class:`ValueRef` names a tensor
# forward computes: a model input, a layer's output, or the output of one
# instance of a repeated layer that crosses to another device (``h.5``).
"""

from __future__ import annotations

import enum
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Optional, Sequence, Union

from mpgen.errors import Position

#: The batch of the generated tests per micro-batch (small: they run on CPUs).
TEST_BATCH = 2

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


# -- dims and tensor types ----------------------------------------------------

@dataclass(frozen=True)
class SymDim:
    """A size known at build time only by name: ``batch``, a product of
    symbols and a constant (``batch*seq*768``), or not known at all (``?``)."""

    symbols: tuple[str, ...] = ()
    factor: int = 1
    known: bool = True

    @classmethod
    def named(cls, name: str) -> "SymDim":
        return cls((name,))

    def __str__(self) -> str:
        if not self.known:
            return "?"
        return "*".join([*self.symbols, *([str(self.factor)] if self.factor != 1 else [])])

    def size(self, sizes: Mapping[str, int]) -> Optional[int]:
        """The size with the symbols set to ``sizes``; None if one is missing."""
        if not self.known or any(s not in sizes for s in self.symbols):
            return None
        return self.factor * math.prod(sizes[s] for s in self.symbols)


#: A dimension: a size, or a :class:`SymDim`.
Dim = Union[int, SymDim]


def dim_size(dim: Dim, sizes: Mapping[str, int]) -> Optional[int]:
    """The size of ``dim`` at ``sizes`` (None: not known at those sizes)."""
    return dim if isinstance(dim, int) else dim.size(sizes)


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of a tensor, with symbolic dims kept by name."""

    shape: tuple[Dim, ...]
    dtype: str = "float32"

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.shape) + "]"

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbol names in the shape, in first-use order."""
        names: dict[str, None] = {}
        for d in self.shape:
            if isinstance(d, SymDim):
                names.update(dict.fromkeys(d.symbols))
        return tuple(names)

    def concrete(self, sizes: Mapping[str, int]) -> tuple[Optional[int], ...]:
        """The shape at ``sizes``; None for a dim not known there."""
        return tuple(dim_size(d, sizes) for d in self.shape)

    def numel(self, sizes: Mapping[str, int]) -> int:
        """Number of elements at ``sizes``, a dim not known there counted as 1."""
        return math.prod(s if s is not None else 1 for s in self.concrete(sizes))

    def nbytes(self, sizes: Mapping[str, int]) -> int:
        return self.numel(sizes) * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def batch_dim(self) -> Optional[int]:
        """Where the ``batch`` dim is (the first one); None when it has none of its own
        (``batch*seq`` is not one)."""
        for k, d in enumerate(self.shape):
            if isinstance(d, SymDim) and d.symbols == ("batch",) and d.factor == 1:
                return k
        return None


# -- placement units and values -----------------------------------------------

@dataclass(frozen=True)
class UnitRef:
    """One placement unit: a layer (``instance`` None), or one instance of a
    repeated layer (``h.3``). A block instance is one unit."""

    node: str
    instance: Optional[int] = None

    def __str__(self) -> str:
        return self.node if self.instance is None else f"{self.node}.{self.instance}"


# A layer's name may be dotted: a layer inside a block instance split by
# placement (``model.layers``, NOTE [Placement inside a block instance]).
_RANGE = re.compile(r"^(?P<node>[^\W\d]\w*(?:\.[^\W\d]\w*)*)"
                    r"(?:\.(?P<start>[0-9]+)(?:-(?P<stop>[0-9]+))?)?$")


@dataclass(frozen=True)
class UnitRange:
    """A label naming units: a layer (``h``), an instance (``h.3``) or an
    inclusive range of instances (``h.0-5``)."""

    node: str
    first: Optional[int] = None
    last: Optional[int] = None  # inclusive; equal to ``first`` for one instance

    @classmethod
    def parse(cls, text: str) -> Optional["UnitRange"]:
        """The range a label names, or None when it is not a label."""
        match = _RANGE.match(text)
        if not match:
            return None
        if match.group("start") is None:
            return cls(match.group("node"))
        first = int(match.group("start"))
        last = int(match.group("stop")) if match.group("stop") is not None else first
        return cls(match.group("node"), first, last)

    def __str__(self) -> str:
        if self.first is None:
            return self.node
        if self.first == self.last:
            return f"{self.node}.{self.first}"
        return f"{self.node}.{self.first}-{self.last}"


def unit_labels(units: Iterable[UnitRef], repeats: Mapping[str, Optional[int]] = {},
                whole: bool = False) -> list[str]:
    """Labels for units in order, consecutive instances of a layer compressed
    (``h.0-5``); with ``whole``, a run of all ``repeats[node]`` instances of a
    layer is labelled by the layer alone."""
    runs: list[list] = []  # [node, first, last]
    for unit in units:
        if (runs and runs[-1][0] == unit.node and unit.instance is not None
                and runs[-1][2] is not None and runs[-1][2] + 1 == unit.instance):
            runs[-1][2] = unit.instance
        else:
            runs.append([unit.node, unit.instance, unit.instance])
    labels = []
    for node, first, last in runs:
        if first is not None and whole and first == 0 and last == (repeats.get(node) or 0) - 1:
            first = last = None
        labels.append(str(UnitRange(node, first, last)))
    return labels


@dataclass(frozen=True)
class ValueRef:
    """A tensor forward computes: a model input or a layer's output
    (``instance`` None for an input or a layer that is not repeated), or the
    output of instance ``instance`` of a repeated layer."""

    name: str
    instance: Optional[int] = None

    def __str__(self) -> str:
        return self.name if self.instance is None else f"{self.name}.{self.instance}"


# -- values in calls -----------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """A block parameter used as an argument value (``$dim`` in the spec)."""

    name: str


@dataclass(frozen=True)
class Expr:
    """A fixed expression the compiler itself chose (``torch.float16``)."""

    code: str


@dataclass(frozen=True)
class BinOp:
    """``left op right`` in an expression (``"=3 * $dim"``); ``op`` is one of
    ``+ - * / // % **``."""

    op: str
    left: Any
    right: Any


@dataclass(frozen=True)
class Neg:
    """``-operand`` in an expression."""

    operand: Any


@dataclass(frozen=True)
class Size:
    """``size(value, dim)``: the run-time size of a dim of a tensor in scope,
    read in ``forward`` (``idx.size(1)``)."""

    value: str
    dim: int


@dataclass(frozen=True)
class Training:
    """The module's training flag in ``forward`` (``self.training``): what a
    function such as ``F.dropout`` is given, so ``model.eval()`` turns it off."""


@dataclass(frozen=True)
class IfTraining:
    """``value`` while training, ``otherwise`` in eval (``dropout_p`` of
    ``F.scaled_dot_product_attention``)."""

    value: Any
    otherwise: Any


#: Operator precedence in expressions (Python's).
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2, "neg": 3, "**": 4}


def expression_text(value: Any, leaf: Callable[[Any], str], outer: int = 0) -> str:
    """An expression as text, with the parentheses Python needs and no others;
    ``leaf`` writes what is not an operator (a number, a param, a size)."""
    if isinstance(value, Neg):
        mine = PRECEDENCE["neg"]
        text = f"-{expression_text(value.operand, leaf, mine)}"
    elif isinstance(value, BinOp):
        mine = PRECEDENCE[value.op]
        # ** groups to the right, the others to the left.
        left = expression_text(value.left, leaf, mine + (value.op == "**"))
        right = expression_text(value.right, leaf, mine + (value.op != "**"))
        text = f"{left} {value.op} {right}"
    else:
        text = leaf(value)
        return f"({text})" if text.startswith("-") and outer else text
    return f"({text})" if mine < outer else text


def leaves(value: Any) -> Iterator[Any]:
    """The parts of an argument value that are not lists or expressions."""
    if isinstance(value, BinOp):
        yield from leaves(value.left)
        yield from leaves(value.right)
    elif isinstance(value, Neg):
        yield from leaves(value.operand)
    elif isinstance(value, IfTraining):
        yield from leaves(value.value)
        yield from leaves(value.otherwise)
    elif isinstance(value, list):
        for item in value:
            yield from leaves(item)
    else:
        yield value


#: ``$index`` and ``$repeat`` in a repeated layer's arguments: the copy's
#: index (0 ... N-1) and N. ``$repeat`` is replaced by N when the layer is
#: resolved; ``$index`` stays a :class:`Param` until each copy is made.
INDEX, REPEAT = "index", "repeat"


def substitute(value: Any, params: Mapping[str, Any],
               sizes: Mapping[str, str] = {}) -> Any:
    """``value`` with each :class:`Param` named in ``params`` replaced by its
    value, and each ``size()`` of a value renamed in ``sizes`` reading the new name."""
    if isinstance(value, Param):
        return params.get(value.name, value)
    if isinstance(value, Size):
        return Size(sizes.get(value.value, value.value), value.dim)
    if isinstance(value, list):
        return [substitute(v, params, sizes) for v in value]
    if isinstance(value, BinOp):
        return BinOp(value.op, substitute(value.left, params, sizes),
                     substitute(value.right, params, sizes))
    if isinstance(value, Neg):
        return Neg(substitute(value.operand, params, sizes))
    if isinstance(value, IfTraining):
        return IfTraining(substitute(value.value, params, sizes),
                          substitute(value.otherwise, params, sizes))
    return value


def params_used(value: Any) -> set[str]:
    """The block params an argument value reads."""
    return {leaf.name for leaf in leaves(value) if isinstance(leaf, Param)}


def sizes_used(value: Any) -> set[str]:
    """The tensors whose sizes an argument value reads (in forward)."""
    return {leaf.value for leaf in leaves(value) if isinstance(leaf, Size)}


@dataclass(frozen=True)
class Args:
    """Arguments of one call, as IR values: literals, :class:`Param`,
    :class:`Expr`, and (nested) lists of them."""

    positional: tuple[Any, ...] = ()
    keyword: tuple[tuple[str, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.positional or self.keyword)

    @property
    def values(self) -> list[Any]:
        return [*self.positional, *(v for _, v in self.keyword)]

    def substitute(self, params: Mapping[str, Any], sizes: Mapping[str, str] = {}) -> "Args":
        """These arguments with the params in ``params`` set (:func:`substitute`)."""
        return Args(tuple(substitute(v, params, sizes) for v in self.positional),
                    tuple((k, substitute(v, params, sizes)) for k, v in self.keyword))


#: An item of a layer's tensor arguments: an index into ``Node.inputs``, or a
#: tuple of items (a tuple argument such as an LSTM's ``(h0, c0)``).
FeedItem = Union[int, tuple]


@dataclass(frozen=True)
class Feed:
    """How a layer passes the values it reads (``Node.inputs``, by index):
    positional items, then tensors by keyword (``src_mask=causal``)."""

    positional: tuple[FeedItem, ...]
    keyword: tuple[tuple[str, int], ...] = ()

    @classmethod
    def plain(cls, n: int) -> "Feed":
        return cls(tuple(range(n)))

    def build(self, values: Sequence[Any], pack=tuple) -> tuple[list, dict]:
        """Positional and keyword arguments from ``values`` (one per input);
        a tuple item becomes ``pack(elements)``."""
        return ([_feed_item(i, values, pack) for i in self.positional],
                {k: values[i] for k, i in self.keyword})


def _feed_item(i, values: Sequence[Any], pack) -> Any:
    # Not a closure: a recursive one is a reference cycle that would keep
    # ``values`` (a layer's inputs) alive until the next garbage collection,
    # and the memory plan counts tensors freed by reference counting.
    return pack([_feed_item(j, values, pack) for j in i]) if isinstance(i, tuple) else values[i]


@dataclass(frozen=True)
class Element:
    """A named element of the tuple a layer returns (``outputs: [q, k, v]``):
    a value later layers read by ``name``."""

    name: str
    var: str
    path: tuple[int, ...]  # index path into the returned (nested) tuple
    type: Optional["TensorType"] = None  # filled by analysis.shapes


#: How a tuple is unpacked: element names, None for ``_``, nested tuples.
Pattern = tuple


@dataclass(frozen=True)
class Initializer:
    """A ``torch.nn.init`` function (``normal`` -> ``nn.init.normal_``) and
    its keyword arguments."""

    fn: str
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class InitRule:
    """``init:``: set parameter ``param`` of every module of class
    ``module`` (top level) or of one layer (``layer``) with ``init``."""

    param: str
    init: Initializer
    pos: Position
    module: Optional[str] = None  # a torch.nn class name, for the top-level form
    layer: Optional[str] = None  # a layer name, for a layer's own init:


@dataclass(frozen=True)
class Tie:
    """``tie: {param: owner.owner_param}``: this layer's ``param`` is the very
    parameter of layer ``owner``."""

    param: str
    owner: str
    owner_param: str
    pos: Position
    type: Optional["TensorType"] = None  # the parameter's, filled by analysis.shapes

    @property
    def source(self) -> str:
        """``wte.weight``: the owner's parameter, as its state-dict key."""
        return f"{self.owner}.{self.owner_param}"


# -- the graph -----------------------------------------------------------------

class OpKind(enum.Enum):
    MODULE = "module"  # a torch.nn class, rendered nn.Name(...)
    USER = "user"  # a user's nn.Module class, by dotted import path
    BLOCK = "block"  # a block class defined in the generated module
    FUNCTION = "function"  # torch.NAME or F.NAME, applied in forward
    TENSOR = "tensor"  # a Parameter or Buffer of the layer's own (Node.tensor)


@dataclass(frozen=True)
class Op:
    """What a layer is, resolved."""

    kind: OpKind
    spelled: str  # as written in the spec: "Linear", "F.relu", "mypkg.Gate"
    callee: str  # the expression in generated code: "nn.Linear", "F.relu"
    target: Any = field(compare=False, repr=False, hash=False)
    seq_input: bool = False  # the function takes its tensors as one list (torch.cat)
    module: Optional[str] = None  # import path for USER ops

    @property
    def has_module(self) -> bool:
        """True when the layer owns an attribute with state: an nn.Module, or
        (``TENSOR``) a parameter or buffer of its own."""
        return self.kind is not OpKind.FUNCTION

    @property
    def runs(self) -> bool:
        """True when the layer computes (a module or function); a Parameter
        or Buffer layer only reads its tensor."""
        return self.kind is not OpKind.TENSOR


@dataclass(frozen=True)
class OwnTensor:
    """``{op: Parameter, shape: [...]}`` or ``{op: Buffer, ...}``: a tensor of
    the layer's own, its value the tensor itself. ``shape`` holds IR values
    (sizes, :class:`Param`, expressions); ``values`` (``init: {values: [...]}``)
    its exact elements, flat; otherwise ``Node.inits`` has its initializer
    (an :class:`InitRule` with no ``param``), and none is zeros."""

    shape: tuple[Any, ...]
    dtype: str = "float32"
    buffer: bool = False
    persistent: bool = True
    values: Optional[tuple[Any, ...]] = None


@dataclass(frozen=True)
class Node:
    """One entry of ``layers`` (in the model or in a block)."""

    name: str  # spec name; the attribute name for module ops
    var: str  # the local variable holding its output in forward
    op: Op
    init: Args  # constructor arguments (modules, user modules, blocks)
    call: Args  # arguments after the tensors in the call (functions)
    inputs: tuple[str, ...]  # names of values read: inputs or earlier nodes' values
    pos: Position
    repeat: Optional[int] = None
    output: Optional[int] = None  # the element of a returned tuple that is the output
    feed: Optional[Feed] = None  # how ``inputs`` are passed; None: positionally
    pattern: Optional[Pattern] = None  # ``outputs:``: how a returned tuple is unpacked
    elements: tuple[Element, ...] = ()  # the named elements of ``pattern``
    factory: bool = False  # ``in: []``: made on its device, reads no tensor
    ties: tuple[Tie, ...] = ()
    inits: tuple[InitRule, ...] = ()  # the layer's own ``init:``
    # ``checkpoint: true``: forward recomputes it in backward instead of
    # keeping its activations (``torch.utils.checkpoint``), each instance.
    checkpoint: bool = False
    tensor: Optional[OwnTensor] = None  # OpKind.TENSOR: the Parameter or Buffer
    # ``requires_grad: false``: every parameter of the layer (of each copy,
    # inside a block instance too) is frozen: made with requires_grad=False.
    frozen: bool = False
    # A block's layer named otherwise than an identifier (``0``, ``block1-0``:
    # an nn.Sequential's child): its module's index in the block's class, an
    # nn.Sequential (``self[2]``; NOTE [Layers named by position] in resolve.py).
    position: Optional[int] = None
    # ``call: false``: a module the model holds but forward never calls (T5's
    # ``shared``, which its stacks' embeddings tie to): made in ``__init__``,
    # no statement in forward, no value (NOTE [Held layers] in resolve.py).
    held: bool = False
    # Filled by analysis.shapes:
    out: Optional[TensorType] = None
    params: int = 0  # per instance
    frozen_params: int = 0  # per instance, those of ``params`` that do not train
    flops: int = 0  # per instance, forward, at the symbolic sizes in ``dims``
    # Filled by compiler.placement: one device per instance.
    devices: tuple[str, ...] = ()

    @property
    def instances(self) -> int:
        return self.repeat or 1

    @property
    def per_copy(self) -> bool:
        """True when the copies of a repeated layer differ (``$index``)."""
        return INDEX in set().union(*(params_used(v) for v in self.init.values))

    @property
    def feeding(self) -> Feed:
        return self.feed or Feed.plain(len(self.inputs))

    @property
    def value_names(self) -> tuple[str, ...]:
        """The names later layers read this node's result by."""
        if self.held:
            return ()
        return tuple(e.name for e in self.elements) if self.pattern else (self.name,)

    def unit(self, instance: int) -> UnitRef:
        """Placement unit ``instance`` of this node (0 for a plain layer)."""
        return UnitRef(self.name, instance if self.repeat else None)

    @property
    def units(self) -> tuple[UnitRef, ...]:
        return tuple(self.unit(k) for k in range(self.instances))

    def value(self, instance: Optional[int] = None) -> ValueRef:
        """The value instance ``instance`` (default: the last) produces."""
        if not self.repeat:
            return ValueRef(self.name)
        return ValueRef(self.name, self.repeat - 1 if instance is None else instance)


def device_runs(devices: Sequence[str]) -> list[tuple[int, int, str]]:
    """Maximal runs of one device in a per-instance device list:
    ``(start, stop, device)``, e.g. h.0-5 on cuda:0 -> ``(0, 6, "cuda:0")``."""
    runs: list[tuple[int, int, str]] = []
    for k, device in enumerate(devices):
        if runs and runs[-1][2] == device:
            runs[-1] = (runs[-1][0], k + 1, device)
        else:
            runs.append((k, k + 1, device))
    return runs


@dataclass(frozen=True)
class InputTensor:
    """A model (or block) input."""

    name: str
    var: str
    type: TensorType
    pos: Position
    high: Optional[int] = None  # exclusive upper bound of integer values (from Embeddings)


@dataclass(frozen=True)
class BlockClass:
    """A block, generated as its own nn.Module class."""

    name: str
    params: tuple[str, ...]
    inputs: tuple[InputTensor, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    pos: Position
    params_count: Optional[int] = None  # when all uses agree
    shapes: tuple[tuple[str, Optional[TensorType]], ...] = ()  # node -> shape comment
    unused: tuple[str, ...] = ()  # layers with parameters no output of the block reads

    @property
    def sequential(self) -> bool:
        """Whether a layer is named by position: the class is an nn.Sequential."""
        return any(n.position is not None for n in self.nodes)


@dataclass(frozen=True)
class Transfer:
    """Move ``value`` (held in ``src_var``) from ``src`` to ``dst`` as ``dst_var``.

    ``src`` is None for model inputs, whose device is the caller's.
    """

    value: ValueRef
    src: Optional[str]
    dst: str
    src_var: str
    dst_var: str
    type: TensorType


@dataclass(frozen=True)
class Step:
    """Run instances ``[start, stop)`` of ``node`` on ``device``."""

    node: str
    device: str
    reads: tuple[str, ...]  # variables passed as inputs
    out_var: str
    start: int = 0
    stop: int = 1
    loop_var: Optional[str] = None  # for runs of a repeated layer
    # Tied parameters owned on another device: (param, variable of its copy here).
    tied: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Section:
    """Consecutive forward work on one device: transfers in, then steps."""

    device: str
    transfers: tuple[Transfer, ...]
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class ForwardPlan:
    """The model's forward, device by device, and what it returns."""

    sections: tuple[Section, ...]
    returns: tuple[str, ...]  # variables, in ``outputs`` order

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for s in self.sections for t in s.transfers)


@dataclass(frozen=True)
class Loss:
    """The loss applied to one output in the training script.

    The front end resolves the loss; ``analysis.targets`` fills the target's
    type from the output's shape."""

    output: str
    op: str  # the torch.nn loss class
    kwargs: tuple[tuple[str, Any], ...]
    target: str  # "classes" | "like_output" | "probabilities"
    pos: Position  # where the loss is written
    target_type: Optional[TensorType] = None
    classes: Optional[int] = None
    #: Class-index losses: the output's dim holding the classes, an index
    #: into its shape (0 <= class_dim < rank); None for other losses.
    class_dim: Optional[int] = None
    rank: int = 0  # the output's rank
    #: ``class_dim:`` as the spec writes it (negative counts from the end) and
    #: where; None: the default rule (``analysis.targets``).
    class_dim_given: Optional[int] = None
    class_dim_pos: Optional[Position] = None
    #: A target whose batch dim sits inside a product (``[seq*batch]``, an
    #: output flattened from ``[seq, batch, ...]``): ``(dim, place)``, place 0
    #: when the batch is the product's outer factor (index ``b*R + r``), 1 when
    #: its inner one (``r*B + b``, sequence-first); None: the target's own
    #: batch dim, or none (``analysis.targets``).
    flat_batch: Optional[tuple[int, int]] = None
    #: False: the default loss of a spec that writes no ``train.loss``
    #: (MSELoss on every output), which leaves out an output without gradients.
    written: bool = True

    module: Optional[str] = None  # a user's loss class: its module, which the script imports

    @property
    def batch_layout(self) -> "Optional[int] | tuple[int, int]":
        """How the target's samples stack: its batch dim, ``flat_batch``, or None."""
        return self.flat_batch if self.flat_batch is not None else self.target_type.batch_dim

    @property
    def callee(self) -> str:
        return self.op if self.module else f"nn.{self.op}"

    @property
    def flatten(self) -> bool:
        """Classes on the last dim of an output of rank > 2 (``[batch, seq,
        vocab]``): the loss reads it flattened to ``(N*..., C)``."""
        return self.class_dim is not None and self.rank > 2 and self.class_dim == self.rank - 1


@dataclass(frozen=True)
class Scheduler:
    """``train.scheduler``: how the learning rate changes, once per optimizer step.

    ``op`` is a built-in schedule (``cosine``, ``linear``, ``constant``: from
    the base learning rate to ``min_lr`` over the run, after ``warmup`` steps
    rising linearly from 0), or the name of a ``torch.optim.lr_scheduler``
    class built with ``kwargs`` (after ``warmup`` steps of linear warmup, when
    given)."""

    op: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    warmup: int = 0
    min_lr: float = 0.0  # built-in schedules only

    BUILT_IN: ClassVar[tuple[str, ...]] = ("cosine", "linear", "constant")

    @property
    def built_in(self) -> bool:
        return self.op in self.BUILT_IN


@dataclass(frozen=True)
class DataSource:
    """``train.data``/``train.eval_data``: a file of tensors (``path``:
    ``.pt``, ``.pth``, ``.npz`` or ``.safetensors``, keyed by input names plus
    ``target``), or a factory ``module:function`` called with ``kwargs`` that
    returns a ``Dataset`` or a ``DataLoader``. Exactly one of ``path`` and
    ``factory`` is set; both are checked text (a path, a dotted module and an
    identifier), pasted as string literals."""

    path: Optional[str] = None
    factory: Optional[str] = None  # "package.module:function"
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def text(self) -> str:
        """How ``--data`` spells it."""
        return self.path if self.path is not None else self.factory


@dataclass(frozen=True)
class Metric:
    """One of ``train.metrics``: ``op`` (one of :attr:`OPS`) or a user's
    ``function`` (``package.module:function``, vetted by the import policy),
    on ``output``, or (None) on every output it applies to."""

    op: str
    output: Optional[str] = None
    k: int = 1  # top_k_accuracy's
    function: Optional[str] = None
    pos: Optional[Position] = None

    OPS: ClassVar[tuple[str, ...]] = ("accuracy", "top_k_accuracy", "f1", "perplexity")

    @property
    def name(self) -> str:
        """Its log column without ``eval_`` (and the output, where several)."""
        if self.function is not None:
            return self.function.rpartition(":")[2]
        return f"top{self.k}_accuracy" if self.op == "top_k_accuracy" else self.op

    @property
    def module(self) -> Optional[str]:
        return self.function.partition(":")[0] if self.function else None

    def applies(self, loss: "Loss") -> bool:
        """Whether it can measure the output of ``loss``: an accuracy or F1
        a class-index loss's, perplexity a (log-)softmax one's; a user's any."""
        if self.function is not None:
            return True
        if self.op == "perplexity":
            return loss.op in ("CrossEntropyLoss", "NLLLoss") and not loss.module
        return loss.target == "classes"


@dataclass(frozen=True)
class MetricColumn:
    """A metric on one output: its column (``eval_`` + ``name``) and loss index."""

    name: str
    metric: Metric
    loss: int


@dataclass(frozen=True)
class TrainConfig:
    """Resolved ``train`` settings."""

    losses: tuple[Loss, ...]
    optimizer: str
    optimizer_kwargs: tuple[tuple[str, Any], ...]
    lr: float
    batch_size: int
    steps: int
    seed: int
    log_every: int
    dims: tuple[tuple[str, int], ...]  # symbolic dim -> size used for synthetic data
    closure: bool = False  # optimizer.step needs a closure that recomputes the loss (LBFGS)
    one_device: bool = False  # the optimizer needs every parameter on one device (LBFGS)
    optimizer_pos: Optional[Position] = None  # where the optimizer is named
    epochs: Optional[int] = None  # passes over the data; None: --steps alone decides
    steps_given: bool = True  # False: only epochs was given, so --steps has no default
    scheduler: Optional[Scheduler] = None
    grad_clip: Optional[float] = None  # max gradient norm (clip_grad_norm_)
    accumulate: int = 1  # micro-batches per optimizer step
    amp: str = "off"  # "off" | "bf16" | "fp16"
    #: Parameters without weight decay: any of "biases", "norms", "embeddings".
    no_decay: tuple[str, ...] = ()
    data: Optional[DataSource] = None  # None: synthetic data shaped from the spec
    eval_data: Optional[DataSource] = None
    eval_every: int = 0  # steps between evaluations; 0: at the end only, if there is eval data
    eval_split: float = 0.0  # fraction of the data held out for evaluation when no eval_data
    samples: int = 1024  # size of the synthetic dataset (one epoch)
    workers: int = 0  # DataLoader worker processes
    optimizer_module: Optional[str] = None  # a user's optimizer class: its module
    weight_decay: Optional[float] = None  # the optimizer's, written or its default
    dims_given: tuple[str, ...] = ()  # the symbolic dims train.dims (or batch_size) sizes
    #: ``train.metrics``; None: the default (:meth:`metric_columns`).
    metrics: Optional[tuple[Metric, ...]] = None
    loss_per_output: bool = False  # train.loss is a mapping of output -> loss
    monitor: Optional[str] = None  # the evaluation column whose best step is kept
    monitor_mode: Optional[str] = None  # "min" | "max"; None: as the name says
    keep_last: int = 1  # the newest saves kept
    early_stop: int = 0  # evaluations without a better monitor before stopping; 0: never

    @property
    def optimizer_callee(self) -> str:
        return self.optimizer if self.optimizer_module else f"torch.optim.{self.optimizer}"

    @property
    def modules(self) -> tuple[str, ...]:
        """The user modules the loss and optimizer classes (and the metric
        functions) come from, sorted."""
        found = {loss.module for loss in self.losses} | {self.optimizer_module}
        found |= {metric.module for metric in self.metrics or ()}
        return tuple(sorted(m for m in found if m))

    def eval_columns(self) -> tuple[str, ...]:
        """The columns of log.csv's evaluation rows (the runtime's
        ``metrics.eval_columns``): ``eval_loss``, each output's loss where
        several have one, each metric's."""
        outputs = [loss.output for loss in self.losses]
        each = [f"loss_{name}" for name in outputs] if len(outputs) > 1 else []
        return tuple(f"eval_{name}" for name in
                     ["loss", *each, *(c.name for c in self.metric_columns())])

    def metric_columns(self) -> tuple[MetricColumn, ...]:
        """Each metric on each output it measures, in the spec's order; by
        default (no ``train.metrics``) the accuracy of each class output and
        the perplexity of each token loss (classes on the last dim of an
        output ``[batch, seq, vocab]``). A name measured on several outputs
        gets the output's name (``accuracy_cls_head``)."""
        metrics = self.metrics
        if metrics is None:
            accuracy, perplexity = Metric("accuracy"), Metric("perplexity")
            metrics = (accuracy,) * any(accuracy.applies(loss) for loss in self.losses)
            tokens = [loss.output for loss in self.losses
                      if perplexity.applies(loss) and loss.flatten]
            metrics += tuple(Metric("perplexity", output) for output in tokens)
        found = [(metric, k) for metric in metrics for k, loss in enumerate(self.losses)
                 if (metric.output in (None, loss.output)) and metric.applies(loss)]
        names = [metric.name for metric, _ in found]
        return tuple(MetricColumn(metric.name if names.count(metric.name) == 1
                                  else f"{metric.name}_{self.losses[k].output}", metric, k)
                     for metric, k in found)


# -- costs ---------------------------------------------------------------------

@dataclass(frozen=True)
class UnitCost:
    """One placement unit and its costs at the training sizes
    (``analysis.costs`` says how each is measured)."""

    unit: UnitRef
    node: int  # index into Graph.nodes
    instance: int  # 0 for a layer that is not repeated
    params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    flops: int
    out_bytes: int
    measured: bool = True  # False: activations fell back to the output bytes
    #: What the unit keeps for backward when it is checkpointed: its inputs
    #: (NOTE [Cost formulas] in analysis/costs.py).
    checkpoint_bytes: int = 0
    #: Checkpointed: ``activation_bytes`` is ``checkpoint_bytes``, and
    #: ``recomputed_bytes`` the activations backward recomputes instead.
    checkpointed: bool = False
    recomputed_bytes: int = 0

    @property
    def name(self) -> str:
        return str(self.unit)

    @property
    def memory(self) -> int:
        """Bytes for training: weights + gradients + optimizer + activations."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


#: The per-unit quantities automatic placement can balance.
BALANCES = ("params", "memory", "flops", "time")
#: The balances a unit's own costs give (``time`` comes from a measured Profile).
COST_BALANCES = ("params", "memory", "flops")


@dataclass(frozen=True)
class Costs:
    """Every unit's costs and the cut bytes between neighbouring units."""

    units: tuple[UnitCost, ...]
    cuts: tuple[int, ...]  # cuts[j]: between units j and j + 1
    value_bytes: tuple[tuple[str, int], ...]  # value (input or node) -> bytes
    dims: tuple[tuple[str, int], ...]
    optimizer: str
    state_factor: int

    def of(self, balance: str) -> list[int]:
        """The per-unit quantity balanced by ``balance``."""
        if balance not in COST_BALANCES:  # "time" is measured: Profile.unit_ms
            raise ValueError(f"unknown balance {balance!r}")
        return [getattr(u, balance) for u in self.units]

    def nbytes(self, value: Union[str, ValueRef]) -> int:
        """Bytes of a value (model input or layer output) at the training sizes."""
        return self._bytes_by_value[value.name if isinstance(value, ValueRef) else value]

    @functools.cached_property
    def _bytes_by_value(self) -> dict[str, int]:
        # Built once (the object is frozen): a report looks up every edge.
        return dict(self.value_bytes)


@dataclass(frozen=True)
class UnitTime:
    """One unit's measured milliseconds per training batch on each device
    kind of a Profile (``kind``, forward ms, backward ms), and the unit's
    parameters and FLOPs when measured (what says a profile is stale)."""

    unit: str
    params: int
    flops: int
    times: tuple[tuple[str, float, float], ...]


@dataclass(frozen=True)
class Profile:
    """``<spec stem>.profile.yaml``, what ``mpgen profile`` measured beside
    the spec (``frontend.profile`` reads it; NOTE [Measured time] in
    ``commands/profile.py``): each device kind's hardware, the machine's
    devices and their kind, every unit's times, and the transfers measured."""

    path: str  # as errors show it
    kinds: tuple[tuple[str, str], ...]  # kind -> the hardware's name
    devices: tuple[tuple[str, str], ...]  # device -> kind
    batch: int
    units: tuple[UnitTime, ...]
    #: (from device, to device, bytes per millisecond)
    transfers: tuple[tuple[str, str, float], ...] = ()
    #: (kind, forward ms, backward ms) a stage costs whatever it computes,
    #: taken out of every unit's times (a stage pays it once).
    call: tuple[tuple[str, float, float], ...] = ()

    def kind_of(self, device: str) -> Optional[str]:
        """The kind measured for ``device``: its own, else the only kind
        (a spec's cuda:0..3 on a CPU-only machine); None when unknown."""
        found = dict(self.devices).get(device)
        if found is None and len(self.kinds) == 1:
            found = self.kinds[0][0]
        return found

    def unit_ms(self, kind: str) -> list[tuple[float, float]]:
        """Every unit's (forward, backward) ms on ``kind``."""
        return [next((f, b) for k, f, b in u.times if k == kind) for u in self.units]

    def stale(self, costs: "Costs") -> Optional[str]:
        """Why this profile does not time the units of ``costs`` (a clause),
        or None when it does: the same units in order, each with the
        parameters and FLOPs it was measured with (a changed layer, size or
        batch changes them)."""
        mine = [(u.name, u.params, u.flops) for u in costs.units]
        theirs = [(u.unit, u.params, u.flops) for u in self.units]
        if len(mine) != len(theirs):
            return (f"it times {len(theirs)} units and the spec has {len(mine)}: the model "
                    "changed since it was measured")
        for (name, params, flops), (other, p, f) in zip(mine, theirs):
            if name != other:
                return f"it times unit {other!r} where the spec has {name!r}"
            if (params, flops) != (p, f):
                return (f"unit {name!r} has {params} parameters and {flops} FLOPs, and was "
                        f"measured with {p} and {f}: the model or its sizes changed")
        return None


# -- memory plan ---------------------------------------------------------------

#: The parts of a device's memory a plan names, in the order they are shown.
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "transfers", "transient")


@dataclass(frozen=True)
class DeviceMemory:
    """One device's bytes in one way of running the model (NOTE [Memory plan]
    in placement/memory.py): each part at its largest during a step, and the
    largest total alive at one moment (``peak``), where the step reaches it
    (``phase``) and what is alive then (``at_peak``, by part; ``largest``, the
    units holding the most then, largest first)."""

    device: str
    weights: int  # parameters and buffers (and AMP's casts of them, held in forward)
    gradients: int  # one per trainable parameter; 0 for inference
    optimizer: int  # the optimizer's state; 0 for inference
    activations: int  # saved for backward at the end of forward (inference: the largest live set)
    peak: int
    phase: str = ""  # "forward", "backward", "optimizer step" (pipeline: "F3", "B1", ...)
    at_peak: tuple[tuple[str, int], ...] = ()  # part (MEMORY_PARTS) -> bytes alive at the peak
    largest: tuple[tuple[str, int], ...] = ()  # unit name -> bytes at the peak, at most 3


@dataclass(frozen=True)
class MemoryPlan:
    """Every device's memory for the single-process training script at the
    spec's batch (``train``), the pipeline program under the spec's schedule,
    micro-batches and replicas (``pipeline``; keyed by the stage's device) and
    a forward at the batch without gradients (``inference``)."""

    batch: int
    train: tuple[DeviceMemory, ...]
    pipeline: tuple[DeviceMemory, ...]
    inference: tuple[DeviceMemory, ...]
    schedule: str = "1f1b"
    microbatches: int = 1
    dp: int = 1
    #: The modes whose step could not be simulated, each with why (the
    #: exception's first line) and the layer it raised in, where one did:
    #: their peaks are the additive estimate (a build note says so).
    unsimulated: tuple[tuple[str, str, Optional[Position]], ...] = ()

    def of(self, mode: str) -> dict[str, DeviceMemory]:
        """Device -> its memory in ``mode``: train, pipeline or inference."""
        return {d.device: d for d in getattr(self, mode)}


@dataclass(frozen=True)
class Capacity:
    """The most bytes a device may hold (the spec's top-level ``capacity:``,
    or ``placement.auto.capacity``), checked against the plan's peaks."""

    device: str  # as the spec names it, before --device-map
    bytes: int
    pos: Position  # where it is written


# -- placement -----------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """A block instance that placement splits: ``model`` of block ``LlamaBody``
    when a placement key names a layer inside it (``model.layers.16-31``). Its
    layers are the graph's own nodes, named by their path (``model.norm``);
    ``nodes`` are those names, its nested splits' included (NOTE [Placement
    inside a block instance] in frontend/resolve.py)."""

    path: str
    block: str
    nodes: tuple[str, ...]
    pos: Position


@dataclass(frozen=True)
class PlacementEntry:
    """One ``key: device`` line of the explicit placement form."""

    key: str  # a unit label as written: ``h``, ``h.3``, ``h.0-5``
    device: str
    pos: Position


@dataclass(frozen=True)
class ExplicitPlacement:
    """The explicit form (no entries: no ``placement``, everything on cuda:0)."""

    entries: tuple[PlacementEntry, ...] = ()


@dataclass(frozen=True)
class AutoPlacement:
    """``placement: {auto: ...}``: the devices in stage order and the rules."""

    devices: tuple[str, ...]
    balance: str  # one of BALANCES
    capacity: tuple[tuple[str, int], ...]  # device -> bytes, for devices that have one
    speed: tuple[tuple[str, float], ...]  # device -> relative speed, when not 1
    pos: Position  # the ``placement`` key


PlacementRequest = Union[ExplicitPlacement, AutoPlacement]


@dataclass(frozen=True)
class Partition:
    """A split of ``n`` units into ``len(bounds) - 1`` contiguous stages.

    Stage ``k`` (on device ``k``) holds units ``bounds[k]:bounds[k + 1]``;
    ``bounds[0] == 0`` and ``bounds[-1] == n``.  ``loads[k]`` is the stage's
    cost sum divided by the device speed, ``bottleneck == max(loads)`` and
    ``cut_bytes`` the sum of the cut costs over the distinct interior
    boundaries used.
    """

    bounds: tuple[int, ...]
    loads: tuple[float, ...]
    bottleneck: float
    cut_bytes: float

    @property
    def stages(self) -> tuple[range, ...]:
        """The unit indices of every stage, as ranges."""
        b = self.bounds
        return tuple(range(b[k], b[k + 1]) for k in range(len(b) - 1))


@dataclass(frozen=True)
class AutoChoice:
    """The split automatic placement chose, and what it was chosen from."""

    request: AutoPlacement
    split: Partition
    speeds: tuple[float, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return self.request.devices

    def unit_devices(self) -> list[str]:
        """The device of every unit, in unit order (before ``--device-map``)."""
        return [device for device, stage in zip(self.devices, self.split.stages)
                for _ in stage]

    @property
    def bottleneck_device(self) -> str:
        """The first device whose load is the bottleneck."""
        return self.devices[self.split.loads.index(self.split.bottleneck)]


@dataclass(frozen=True)
class Layout:
    """How the devices were chosen: ``default`` (no placement), ``explicit``,
    or ``auto`` with the automatic choice."""

    method: str
    auto: Optional[AutoChoice] = None


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline:``: micro-batched execution of the model's stages
    (NOTE [Pipeline stages] in placement/stages.py)."""

    microbatches: int  # M: the generated forward splits the batch into M
    schedule: str = "1f1b"  # pp_<name>.py's default --schedule: one of SCHEDULES
    dp: int = 1  # pp_<name>.py's default --dp: replicas of the pipeline (data parallel)
    sync_bn: bool = False  # pp_<name>.py's default --sync-bn (BatchNorm over the replicas)
    #: Devices whose layers are all checkpointed (``checkpoint: [cuda:1]``),
    #: as the spec names them (before --device-map).
    checkpoint: tuple[str, ...] = ()
    # Where the spec says it, for the errors of checks after placement.
    pos: Optional[Position] = field(default=None, compare=False)
    checkpoint_pos: tuple[Position, ...] = field(default=(), compare=False)
    schedule_pos: Optional[Position] = field(default=None, compare=False)

    #: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B,
    #: ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
    #: ScheduleZBVZeroBubble and ScheduleDualPipeV (NOTE [Schedule model] in
    #: analysis/schedule.py).
    SCHEDULES: ClassVar[tuple[str, ...]] = ("gpipe", "1f1b", "interleaved", "looped-bfs",
                                            "interleaved-zb", "zbv", "dualpipev")


@dataclass(frozen=True)
class Graph:
    """A whole compiled spec."""

    name: str  # the model class name
    spec_path: str  # as shown in the generated header
    spec_hash: str
    inputs: tuple[InputTensor, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    blocks: tuple[BlockClass, ...]
    pos: Position  # where the model's ``name`` is written
    dims: tuple[tuple[str, int], ...] = ()  # symbolic dims -> sizes for byte estimates
    train: Optional[TrainConfig] = None
    placement: PlacementRequest = ExplicitPlacement()  # what the spec asks for
    init_rules: tuple[InitRule, ...] = ()  # the top-level ``init:``
    splits: tuple[Split, ...] = ()  # block instances split by placement, outer first
    #: A model output that is a block instance placement splits -> the value
    #: it became (``model`` -> ``model.norm``): the output keeps its name.
    aliases: tuple[tuple[str, str], ...] = ()
    # Filled by analysis.costs: per-unit costs at the training sizes.
    costs: Optional[Costs] = field(default=None, compare=False, repr=False)
    # Filled by placement:
    plan: Optional[ForwardPlan] = None
    device_map: tuple[tuple[str, str], ...] = ()
    # The plan at the spec's own devices, before --device-map: the stages of
    # pp_<name>.py (one per device run), whatever devices this build runs on.
    spec_plan: Optional[ForwardPlan] = field(default=None, compare=False, repr=False)
    pipeline: Optional[PipelineConfig] = None  # ``pipeline:``; None: the plain forward
    layout: Optional[Layout] = None
    #: Filled by analysis.shapes: (dim, largest size, why) for each symbolic
    #: dim whose positions read a table of fixed rows (NOTE [Symbolic dims]).
    dim_limits: tuple[tuple[str, int, str], ...] = ()
    #: Filled by placement.memory: every device's memory (NOTE [Memory plan]).
    memory: Optional[MemoryPlan] = field(default=None, compare=False, repr=False)
    #: The spec's top-level ``capacity:`` (auto placement's are in its request).
    capacity: tuple[Capacity, ...] = ()
    #: Read by the front end: ``<spec stem>.profile.yaml`` beside the spec, if any.
    profile: Optional[Profile] = field(default=None, compare=False, repr=False)

    def node(self, name: str) -> Node:
        return self._nodes_by_name[name]

    @functools.cached_property
    def _nodes_by_name(self) -> dict[str, Node]:
        # Built once per graph (frozen: its nodes never change); KeyError for
        # an unknown name, as before.
        return {node.name: node for node in self.nodes}

    @property
    def units(self) -> tuple[UnitRef, ...]:
        """Every placement unit, in ``layers`` order."""
        return tuple(u for n in self.nodes for u in n.units)

    @property
    def repeats(self) -> dict[str, Optional[int]]:
        """Node name -> ``repeat``, for :func:`unit_labels`."""
        return {n.name: n.repeat for n in self.nodes}

    def attribute_code(self, path: str, nodes: Optional[Sequence[Node]] = None) -> str:
        """``self.transformer.wte.weight``: a module's or parameter's path in
        the model (or in a block whose layers are ``nodes``) as code, through
        layers named by position (``self.conv1[0].weight``; NOTE [Layers named
        by position] in codegen/model.py) and copies of a repeated layer
        (``self.h[3]``)."""
        blocks = {b.name: b for b in self.blocks}
        splits = {s.path: s.block for s in self.splits} if nodes is None else {}
        scope: Optional[dict[str, Node]] = {n.name: n for n in (
            self.nodes if nodes is None else nodes)}
        code = "self"
        parts = path.split(".")
        for end, part in enumerate(parts, 1):
            node = scope.get(part) if scope is not None else None
            if node is not None and node.position is not None:
                code += f"[{node.position}]"
            else:
                code += f"[{part}]" if part.isdigit() else f".{part}"
            if node is None and ".".join(parts[:end]) in splits:  # a split instance's layers
                scope = {n.name: n for n in blocks[splits[".".join(parts[:end])]].nodes}
                continue
            scope = ({n.name: n for n in blocks[node.op.target].nodes}
                     if node is not None and node.op.kind is OpKind.BLOCK
                     and node.repeat is None else None)
        return code

    def value_name(self, name: str) -> str:
        """The value a name stands for: itself, or what a split output became."""
        return dict(self.aliases).get(name, name)

    def producer(self, name: str) -> Optional[Node]:
        """The node whose result is the value ``name`` (None: a model input)."""
        name = self.value_name(name)
        for node in self.nodes:
            if name in node.value_names:
                return node
        return None

    def type_of(self, name: str) -> Optional[TensorType]:
        """The type of a value: a model input, a layer's output or a named element."""
        name = self.value_name(name)
        for t in self.inputs:
            if t.name == name:
                return t.type
        node = self.producer(name)
        if node is None:
            raise KeyError(name)
        if node.pattern:
            return next(e.type for e in node.elements if e.name == name)
        return node.out

    @property
    def devices(self) -> tuple[str, ...]:
        """Devices used, in first-use order."""
        seen: dict[str, None] = {}
        for node in self.nodes:
            for device in node.devices:
                seen.setdefault(device)
        return tuple(seen)

    def params_by_device(self) -> dict[str, int]:
        totals: dict[str, int] = {d: 0 for d in self.devices}
        for node in self.nodes:
            for device in node.devices:
                totals[device] += node.params
        return totals

    @property
    def total_params(self) -> int:
        return sum(n.params * n.instances for n in self.nodes)

    @property
    def frozen_params(self) -> int:
        """Of :attr:`total_params`, those that do not train (``requires_grad: false``)."""
        return sum(n.frozen_params * n.instances for n in self.nodes)

    @property
    def trainable_params(self) -> int:
        return self.total_params - self.frozen_params

    @property
    def test_dims(self) -> dict[str, int]:
        """The sizes of the generated tests' inputs: the training sizes
        (``dims``) with a batch of :data:`TEST_BATCH` per micro-batch
        (NOTE [Sample sizes] in analysis/shapes.py)."""
        dims = dict(self.dims)
        if "batch" in dims:
            dims["batch"] = TEST_BATCH * (self.pipeline.microbatches if self.pipeline else 1)
        return dims
