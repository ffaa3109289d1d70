"""The intermediate representation: resolved facts, no pydantic, no YAML.

Stages fill it in order, each returning new frozen objects:
``resolve`` builds the :class:`Graph` (ops, edges, identifiers, positions),
``shapes`` adds output types, parameter counts and flops, ``placement`` adds
a device per unit and the :class:`ForwardPlan` with its :class:`Transfer`\\ s.
Templates read only these objects.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from mpgen.errors import Position

#: A dimension: a size, or a symbolic expression such as ``batch`` or ``batch*seq``.
Dim = Union[int, str]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of a tensor, with symbolic dims kept by name."""

    shape: tuple[Dim, ...]
    dtype: str = "float32"

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.shape) + "]"

    def numel(self, dims: Mapping[str, int]) -> int:
        """Number of elements with symbolic dims set to ``dims`` (unknown: 1)."""
        return math.prod(_eval_dim(d, dims) for d in self.shape)

    def nbytes(self, dims: Mapping[str, int]) -> int:
        return self.numel(dims) * DTYPE_BYTES.get(self.dtype, 4)


def _eval_dim(dim: Dim, dims: Mapping[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    total = 1
    for factor in dim.split("*"):
        total *= int(factor) if factor.isdigit() else dims.get(factor, 1)
    return total


@dataclass(frozen=True)
class Param:
    """A block parameter used as an argument value (``$dim`` in the spec)."""

    name: str


@dataclass(frozen=True)
class Expr:
    """A fixed expression the compiler itself chose (``torch.float16``)."""

    code: str


class OpKind(enum.Enum):
    MODULE = "module"  # a torch.nn class, rendered nn.Name(...)
    USER = "user"  # a user's nn.Module class, by dotted import path
    BLOCK = "block"  # a block class defined in the generated module
    FUNCTION = "function"  # torch.NAME or F.NAME, applied in forward


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
        """True when the layer owns an nn.Module attribute."""
        return self.kind is not OpKind.FUNCTION


@dataclass(frozen=True)
class Node:
    """One entry of ``layers`` (in the model or in a block)."""

    name: str  # spec name; the attribute name for module ops
    var: str  # the local variable holding its output in forward
    op: Op
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    inputs: tuple[str, ...]  # names of values read: inputs or earlier nodes
    pos: Position
    repeat: Optional[int] = None
    output: Optional[int] = None  # the element of a returned tuple that is the output
    # Filled by compiler.shapes:
    out: Optional[TensorType] = None
    params: int = 0  # per instance
    flops: int = 0  # per instance, forward, at the symbolic sizes in ``dims``
    # Filled by compiler.placement: one device per instance.
    devices: tuple[str, ...] = ()

    @property
    def instances(self) -> int:
        return self.repeat or 1


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


@dataclass(frozen=True)
class Transfer:
    """Move ``value`` (held in ``src_var``) from ``src`` to ``dst`` as ``dst_var``.

    ``src`` is None for model inputs, whose device is the caller's.
    """

    value: str
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
    """The loss applied to one output in the training script."""

    output: str
    callee: str
    kwargs: tuple[tuple[str, Any], ...]
    target: str  # "classes" | "like_output" | "probabilities"
    target_type: TensorType
    classes: Optional[int] = None
    flatten: bool = False  # (N, ..., C) outputs: flatten to (N*..., C)


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


@dataclass(frozen=True)
class Layout:
    """How the devices were chosen: ``default`` (no placement), ``explicit``,
    or ``auto``, with the automatic choice (``compiler.auto_placement.AutoChoice``:
    the settings, unit costs and the optimal split)."""

    method: str
    choice: Any = field(default=None, compare=False, repr=False)


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
    plan: Optional[ForwardPlan] = None
    device_map: tuple[tuple[str, str], ...] = ()
    # Filled by compiler.costs: per-unit costs at the training sizes.
    costs: Any = field(default=None, compare=False, repr=False)
    layout: Optional[Layout] = None

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

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
