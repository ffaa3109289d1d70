"""pydantic v2 models of the spec language (``docs/spec.md``).

The models only check the *shape* of the YAML: keys, types and simple value
rules. Meaning (does an op exist, does an ``in:`` name an earlier layer, do
shapes fit) is the compiler's job. Alternative spellings the language allows
(``x: [batch, 10]`` vs ``x: {shape: [...]}``, ``outputs: head`` vs ``[head]``)
are normalised by ``mode="before"`` validators, so a validation error's
``loc`` always follows the YAML and can be mapped to a line and column.
"""

from __future__ import annotations

import keyword
import math
import re
import sys
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mpgen.errors import did_you_mean, shown

DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")
Dtype = Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"]


_DEVICE = re.compile(r"^(cpu|cuda:(0|[1-9][0-9]{0,2}))$")
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def _error(kind: str, message: str) -> PydanticCustomError:
    # The message is final text: user values inside it are never templates.
    return PydanticCustomError(kind, "{message}", {"message": message})


def check_device(value: Any) -> str:
    """A device string is ``cpu`` or ``cuda:N``; suggest the fix otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1000:
        raise _error("device", f"invalid device {shown(value)}: expected 'cpu' or 'cuda:N' "
                     f"(did you mean 'cuda:{value}'?)")
    if not isinstance(value, str):
        raise _error("device", f"invalid device {shown(value)}: expected 'cpu' or 'cuda:N'")
    if _DEVICE.match(value):
        return value
    hint = ""
    digits = re.findall(r"[0-9]+", value)
    lowered = value.strip().lower()
    if lowered in ("cuda", "gpu"):
        hint = " (did you mean 'cuda:0'?)"
    elif digits and re.match(r"^(cuda|gpu|cuda_|device)\W*[0-9]+$", lowered):
        hint = f" (did you mean 'cuda:{int(digits[0])}'?)"
    elif lowered == "cpu":
        hint = " (did you mean 'cpu'?)"
    raise _error("device", f"invalid device {shown(value)}: expected 'cpu' or 'cuda:N'{hint}")


def parse_size(value: Any) -> int:
    """``40GiB``, ``512MB``, ``1e9`` or a plain integer number of bytes."""
    if isinstance(value, bool):
        raise PydanticCustomError("size", "expected a memory size like '40GiB'")
    if isinstance(value, (int, float)) and value > 0 and math.isfinite(value):
        return int(value)
    match = _SIZE.match(value) if isinstance(value, str) else None
    if not match:
        raise _error(
            "size", f"invalid memory size {shown(value)}: expected e.g. '40GiB', '512MB' or bytes"
        )
    number, unit = match.groups()
    size = int(float(number) * _UNITS[(unit or "").lower()])
    if size < 1:
        raise _error("size", f"invalid memory size {shown(value)}: must be at least 1 byte")
    return size


def kwarg_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot be a keyword argument in generated code, or None."""
    if not (name.isidentifier() and name.isascii()):
        return f"{shown(name)} is not a valid keyword argument name"
    if keyword.iskeyword(name):
        return f"{shown(name)} is a Python keyword, not a keyword argument name"
    if name.startswith("__"):
        return f"{shown(name)} must not start with '__'"
    return None


def _check_kwarg_name(name: str) -> str:
    problem = kwarg_problem(name)
    if problem:
        raise _error("kwarg_name", problem)
    return name


def _is_value(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list) and depth < 2:
        return all(_is_value(v, depth + 1) for v in value)
    return False


def _check_value(value: Any) -> Any:
    if isinstance(value, dict):
        raise _error("value", "expected a scalar (number, string, bool, null) or a list of "
                     "them, not a mapping")
    if not _is_value(value):
        raise _error("value", "expected a scalar (number, string, bool, null) or a list of "
                     "them (lists nest at most two deep)")
    return value


#: The largest size of one input dim: more is a typo, and overflows torch's int64.
MAX_DIM = 2**31 - 1


def _check_dim(dim: Any) -> Any:
    if isinstance(dim, int) and not isinstance(dim, bool):
        if dim < 1:
            raise _error("dim", f"sizes must be positive, got {dim}")
        if dim > MAX_DIM:
            raise _error("dim", f"sizes must be at most {MAX_DIM:,}, got {shown(dim)}")
        return dim
    if isinstance(dim, str):
        if not dim.isidentifier():
            raise _error("dim", f"a symbolic dim must be a name like 'batch' or 'seq', "
                         f"got {shown(dim)}")
        return dim
    raise _error("dim", f"a dim is a positive integer or a name like 'batch', got {shown(dim)}")


def _check_version(value: Any) -> Any:
    if type(value) is not int or value != 1:
        raise _error("version", f"expected the spec format version, the integer 1, "
                     f"got {shown(value)}")
    return value


def _number(kind: str, value: Any) -> float:
    """``value`` as a finite float; a bool, a string, nan, inf or an int too
    big for a float is an error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _error(kind, f"expected a number, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _error(kind, f"expected a finite number, got {shown(value)}")
    return number


def _check_speed(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _error("speed", f"expected a number, got {shown(value)}")
    try:
        positive = value > 0 and math.isfinite(value)
    except OverflowError:  # an int too big for a float
        positive = False
    if not positive:
        raise _error("speed", f"speeds must be positive numbers, got {shown(value)}")
    return value


def _mapping_of(what: str, example: str):
    """A ``mode="before"`` check: the value must be a mapping (``what``)."""
    def check(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _error("mapping", f"expected {what}, like {example}")
        return value
    return BeforeValidator(check)


#: A device string, ``cpu`` or ``cuda:N``.
Device = Annotated[Any, AfterValidator(check_device)]

#: An argument value: a YAML scalar or a (nested) list of scalars.
Value = Annotated[Any, AfterValidator(_check_value)]

#: A dim of an input shape: a positive size or a symbolic name.
Dim = Annotated[Any, AfterValidator(_check_dim)]

#: The name of a keyword argument, pasted into generated code: an identifier.
KwargName = Annotated[str, AfterValidator(_check_kwarg_name)]


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _check_in_item(item: Any, depth: int = 0) -> Any:
    """One ``in:`` item: a name, a nested list of names (a tuple argument),
    or a mapping keyword -> name (tensors passed by keyword)."""
    if isinstance(item, str):
        return item
    if isinstance(item, list) and depth < 3:
        if not item:
            raise _error("in", "a nested list in 'in' is a tuple argument and needs at "
                         "least one name")
        for value in item:
            if isinstance(value, dict):
                raise _error("in", "a mapping in 'in' passes tensors by keyword and must be "
                             "its last item, not inside a nested list")
            _check_in_item(value, depth + 1)
        return item
    if isinstance(item, dict) and depth == 0:
        for key, name in item.items():
            problem = kwarg_problem(key) if isinstance(key, str) else "not a name"
            if problem:
                raise _error("in", f"keyword {shown(key)}: {problem}")
            if not isinstance(name, str):
                raise _error("in", f"keyword {key!r} must name a tensor, got {shown(name)}")
        return item
    raise _error("in", f"expected a name, a list of names or {{keyword: name}}, "
                 f"got {shown(item)}")


def _check_in_order(items: list) -> list:
    if any(isinstance(item, dict) for item in items[:-1]):
        raise _error("in", "a mapping in 'in' passes tensors by keyword and must be its "
                     "last item")
    return items


def _check_out_items(items: list, depth: int = 0) -> list:
    """A layer's ``outputs:``: element names (``_`` drops one), nested lists."""
    for item in items:
        if isinstance(item, str):
            continue
        if isinstance(item, list) and item and depth < 3:
            _check_out_items(item, depth + 1)
            continue
        raise _error("outputs", "a layer's 'outputs' names the elements of the tuple it "
                     f"returns, like [q, k, v] or [out, [h, c]]; got {shown(item)}")
    return items


_INIT_FORM = ("an initializer like zeros, ones, {constant: 0.5}, {normal: {std: 0.02}} or "
              "{uniform: {a: -0.1, b: 0.1}}")


def _check_initializer(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (name, arg), = value.items()
        if isinstance(name, str) and (_is_value(arg) or (
                isinstance(arg, dict) and all(isinstance(k, str) and _is_value(v)
                                              for k, v in arg.items()))):
            return value
    raise _error("init", f"expected {_INIT_FORM}, got {shown(value)}")


def _check_init_map(value: Any) -> Any:
    if not isinstance(value, dict):
        raise _error("init", "expected a mapping of parameter -> initializer, like "
                     "{weight: {normal: {std: 0.02}}, bias: zeros}")
    for key, init in value.items():
        problem = kwarg_problem(key) if isinstance(key, str) else "not a name"
        if problem:
            raise _error("init", f"init: parameter {shown(key)}: {problem}")
        _check_initializer(init)
    return value


def _check_import(value: Any) -> Any:
    """An ``imports:`` entry: the top-level name of an installed package that
    dotted ops may import (``docs/spec.md``, "User modules")."""
    if not isinstance(value, str) or not value.replace(".", "_").isidentifier():
        raise _error("imports", f"expected the name of a package, like mylayers; got "
                     f"{shown(value)}")
    top = value.split(".")[0]
    if top != value:
        raise _error("imports", f"{value!r}: list the top-level package, {top!r}")
    if value.startswith("_"):
        raise _error("imports", f"{value!r} is private (starts with '_'); list a public package")
    if value in ("torch", "mpgen"):
        raise _error("imports", f"{value!r} is not a package of layers: torch's ops are "
                     "spelled Linear, torch.NAME or F.NAME")
    if value in sys.stdlib_module_names:
        raise _error("imports", f"{value!r} is in the standard library, which mpgen never "
                     "imports for an op")
    return value


#: A layer's ``init:``: parameter -> initializer; a plain value is instead the
#: constructor's own ``init`` argument (``nn.PReLU(init=0.25)``).
LayerInit = Annotated[Any, AfterValidator(
    lambda v: v if _is_value(v) and not isinstance(v, list) else _check_init_map(v))]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False)


class InputSpec(_Model):
    """A model input: its shape (ints and symbolic dims) and dtype."""

    shape: list[Dim] = Field(min_length=1)
    dtype: Dtype = "float32"

    @model_validator(mode="before")
    @classmethod
    def _shape_only(cls, data: Any) -> Any:
        if isinstance(data, list):
            return {"shape": data}
        if not isinstance(data, dict):
            raise _error("input", "expected a shape like [batch, 10], or "
                         "{shape: [batch, 10], dtype: int64}")
        return data


class LayerSpec(_Model):
    """One entry of ``layers``; keys other than the five below are kwargs."""

    model_config = ConfigDict(extra="allow", strict=True)
    # Extra keys are keyword arguments: names become code, values literals.
    __pydantic_extra__: dict[KwargName, Value]

    op: StrictStr
    # Names, nested lists (tuple arguments) and a last mapping (keywords);
    # ``in: []`` marks a factory.
    in_: Optional[Annotated[list[Annotated[Any, AfterValidator(_check_in_item)]],
                            AfterValidator(_check_in_order)]] = Field(default=None, alias="in")
    args: list[Value] = Field(default_factory=list)
    repeat: Optional[StrictInt] = Field(default=None, ge=1, le=100_000)
    # mpgen extension: the element of a returned tuple that is the layer's
    # output (LSTM, MultiheadAttention return tuples): ``output: 0``.
    output: Optional[StrictInt] = Field(default=None, ge=-100, le=100)
    # The elements of a returned tuple, by name: ``outputs: [q, k, v]``.
    outputs: Optional[Annotated[list[Any], AfterValidator(_check_out_items)]] = Field(
        default=None, min_length=1)
    # Literal keyword arguments of a module's forward: ``call: {is_causal: true}``.
    call: Optional[dict[KwargName, Value]] = None
    # Shared parameters: ``tie: {weight: wte.weight}``.
    tie: Optional[dict[KwargName, StrictStr]] = Field(default=None, min_length=1)
    init_: Optional[LayerInit] = Field(default=None, alias="init")
    # mpgen extension: recompute the layer in backward (torch.utils.checkpoint).
    checkpoint: Optional[StrictBool] = None

    _one_input = field_validator("in_", mode="before")(_one_or_many)

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _error("layer", "expected a layer, like {op: Linear, args: [10, 20]}")
        return data

    @property
    def kwargs(self) -> dict[str, Any]:
        """The op's keyword arguments, in spec order (a plain ``init`` value is one)."""
        extra = dict(self.model_extra or {})
        if self.init_ is not None and not isinstance(self.init_, dict):
            extra["init"] = self.init_
        return extra

    @property
    def init_map(self) -> dict[str, Any]:
        """The layer's own initializers: parameter -> initializer."""
        return self.init_ if isinstance(self.init_, dict) else {}


class BlockSpec(_Model):
    """A reusable sub-graph, generated as its own ``nn.Module`` class."""

    params: list[StrictStr] = Field(default_factory=list)
    inputs: list[StrictStr] = Field(default_factory=lambda: ["x"], min_length=1)
    layers: Annotated[
        dict[str, LayerSpec],
        _mapping_of("a mapping of layer name -> layer", "{fc: {op: Linear, args: [8, 8]}}"),
    ] = Field(min_length=1)
    outputs: Optional[list[StrictStr]] = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _error("block", "expected a block, like {params: [dim], layers: {...}}")
        return data

    _one_output = field_validator("outputs", mode="before")(_one_or_many)
    _one_input = field_validator("inputs", mode="before")(_one_or_many)


class AutoPlacementSpec(_Model):
    """``placement: {auto: ...}``: the compiler chooses a contiguous split."""

    devices: list[Device] = Field(min_length=1)
    balance: Literal["params", "memory", "flops"] = "params"
    capacity: dict[Device, Annotated[Any, AfterValidator(parse_size)]] = Field(
        default_factory=dict
    )
    speed: dict[Device, Annotated[Any, AfterValidator(_check_speed)]] = Field(
        default_factory=dict
    )

    @field_validator("devices", mode="after")
    @classmethod
    def _devices(cls, devices: list[str]) -> list[str]:
        twice = [d for i, d in enumerate(devices) if d in devices[:i]]
        if twice:
            raise _error("devices", f"device {shown(twice[0])} is listed twice")
        return devices


class PlacementSpec(_Model):
    """Either ``explicit`` (layer key -> device) or ``auto``."""

    explicit: dict[str, Device] = Field(default_factory=dict)
    auto: Optional[AutoPlacementSpec] = None

    @model_validator(mode="before")
    @classmethod
    def _forms(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("auto"), (dict, list)):
            return data
        if isinstance(data, dict):
            return {"explicit": data}
        raise _error("placement", "expected a mapping of layer -> device, like "
                     "{layer1: cuda:0, layer2: cuda:1}, or {auto: {devices: [...]}}")


class PipelineSpec(_Model):
    """``pipeline:``: the micro-batched forward and ``pp_<name>.py``'s defaults.
    The schedule's name and the devices' use are the front end's to check."""

    microbatches: StrictInt = Field(ge=1, le=100_000)
    # mpgen extension: pp_<name>.py's default --schedule.
    schedule: StrictStr = "1f1b"
    # mpgen extension: every layer placed on these devices is checkpointed.
    checkpoint: list[Device] = Field(default_factory=list)


class CallSpec(_Model):
    """``{op: Name, **kwargs}`` for losses and optimizers."""

    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[KwargName, Value]
    op: StrictStr

    #: How the value is written, for the message when it is neither form.
    example: ClassVar[str] = "'Name' or {op: Name, ...}"

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"op": data}
        if not isinstance(data, dict):
            raise _error("call", f"expected {cls.example}, got {shown(data)}")
        return data

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class LossSpec(CallSpec):
    """``train.loss``: a ``torch.nn`` loss name, or ``{op: Name, **kwargs}``.
    ``class_dim`` (class-index losses) is mpgen's: which dim of the output
    holds the classes; it is not passed to the loss."""

    class_dim: Optional[StrictInt] = None

    example: ClassVar[str] = "a loss like 'MSELoss' or {op: CrossEntropyLoss, label_smoothing: 0.1}"


class OptimizerSpec(CallSpec):
    """``train.optimizer``: a ``torch.optim`` class name, or ``{op: Name, **kwargs}``."""

    example: ClassVar[str] = "an optimizer like 'SGD' or {op: AdamW, lr: 3.0e-4}"


class SchedulerSpec(CallSpec):
    """``train.scheduler``: a built-in schedule (``cosine``, ``linear``,
    ``constant``) or a ``torch.optim.lr_scheduler`` class, by name or as
    ``{op: Name, warmup: STEPS, **kwargs}``; the front end checks the keys
    against the schedule."""

    warmup: StrictInt = Field(default=0, ge=0)

    example: ClassVar[str] = ("a schedule like 'cosine', {op: cosine, warmup: 100} or "
                              "{op: StepLR, step_size: 30}")


#: A factory of training data, ``package.module:function``.
FACTORY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
#: The files of tensors a training script loads.
DATA_SUFFIXES = (".pt", ".pth", ".npz", ".safetensors")
_DATA_FORMS = ("a file like data/train.npz, a factory 'package.module:function', or "
               "{factory: 'package.module:function', KEYWORD: VALUE, ...}")


def _check_factory(text: str) -> str:
    if not FACTORY.match(text):
        raise _error("data", f"expected a factory 'package.module:function', got {shown(text)}")
    return text


def _check_data_path(text: str) -> str:
    if "\0" in text or "\n" in text or "\r" in text:
        raise _error("data", f"a data file's path has no NUL or line break, got {shown(text)}")
    if not text.endswith(DATA_SUFFIXES):
        raise _error("data", f"a data file ends in {', '.join(DATA_SUFFIXES[:-1])} or "
                     f"{DATA_SUFFIXES[-1]}, got {shown(text)} (a factory is written "
                     "'package.module:function')")
    return text


class DataSpec(_Model):
    """``train.data``/``train.eval_data``: a path, ``package.module:function``,
    or ``{factory: ..., **kwargs}`` / ``{path: ...}``. Only the text is
    checked: a factory's module is never imported at build time. Which of
    ``factory``/``path`` is given, and that only a factory takes keyword
    arguments, the front end checks (at the keys)."""

    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[KwargName, Value]
    factory: Optional[Annotated[StrictStr, AfterValidator(_check_factory)]] = None
    path: Optional[Annotated[StrictStr, AfterValidator(_check_data_path)]] = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"factory" if FACTORY.match(data) else "path": data}
        if not isinstance(data, dict):
            raise _error("data", f"expected {_DATA_FORMS}, got {shown(data)}")
        return data

    @property
    def kwargs(self) -> dict[str, Any]:
        """The factory's keyword arguments, in spec order."""
        return dict(self.model_extra or {})


#: ``train.no_decay``: the kinds of parameters kept out of weight decay.
NO_DECAY = ("biases", "norms", "embeddings")
#: ``train.amp``: autocast dtypes; YAML reads a bare ``off`` as false.
AMP = ("off", "bf16", "fp16")


def _check_no_decay_kind(kind: Any) -> Any:
    if kind not in NO_DECAY or not isinstance(kind, str):
        hint = did_you_mean(kind, NO_DECAY) if isinstance(kind, str) else ""
        raise _error("no_decay", f"expected one of {', '.join(NO_DECAY)}, got {shown(kind)}{hint}")
    return kind


def _check_distinct(kinds: list) -> list:
    twice = [kind for i, kind in enumerate(kinds) if kind in kinds[:i]]
    if twice:
        raise _error("no_decay", f"{twice[0]!r} is listed twice")
    return kinds


def _check_amp(value: Any) -> str:
    if value is False:
        return "off"
    if value not in AMP or not isinstance(value, str):
        hint = did_you_mean(value, AMP) if isinstance(value, str) else ""
        raise _error("amp", f"expected one of {', '.join(AMP)}, got {shown(value)}{hint}")
    return value


def _check_grad_clip(value: Any) -> float:
    number = _number("grad_clip", value)
    if number <= 0:
        raise _error("grad_clip", f"the largest gradient norm must be greater than 0, got "
                     f"{shown(value)}")
    return number


def _check_fraction(value: Any) -> float:
    number = _number("eval_split", value)
    if not 0 <= number < 1:
        raise _error("eval_split", f"the fraction held out must be in [0, 1), got {shown(value)}")
    return number


def _loss_form(value: Any) -> str:
    # ``Name`` or ``{op: Name, ...}`` is one loss; a mapping without ``op``
    # gives a loss per output: ``{head_a: CrossEntropyLoss, head_b: MSELoss}``.
    if isinstance(value, dict) and "op" not in value:
        return "each"
    return "one"


class TrainSpec(_Model):
    """Settings of the generated training script."""

    loss: Annotated[
        Union[Annotated[LossSpec, Tag("one")], Annotated[dict[str, LossSpec], Tag("each")]],
        Discriminator(_loss_form),
    ] = Field(default_factory=lambda: LossSpec(op="MSELoss"))
    optimizer: OptimizerSpec = Field(default_factory=lambda: OptimizerSpec(op="SGD", lr=0.01))
    batch_size: StrictInt = Field(default=32, ge=1)
    steps: StrictInt = Field(default=100, ge=1)
    seed: StrictInt = 0
    log_every: StrictInt = Field(default=1, ge=1)
    dims: dict[str, Annotated[StrictInt, Field(ge=1)]] = Field(default_factory=dict)
    epochs: Optional[StrictInt] = Field(default=None, ge=1)
    scheduler: Optional[SchedulerSpec] = None
    grad_clip: Optional[Annotated[Any, AfterValidator(_check_grad_clip)]] = None
    accumulate: StrictInt = Field(default=1, ge=1)
    amp: Annotated[Any, AfterValidator(_check_amp)] = "off"
    no_decay: Annotated[list[Annotated[Any, AfterValidator(_check_no_decay_kind)]],
                        AfterValidator(_check_distinct)] = Field(default_factory=list)
    data: Optional[DataSpec] = None
    eval_data: Optional[DataSpec] = None
    eval_every: StrictInt = Field(default=0, ge=0)
    eval_split: Annotated[Any, AfterValidator(_check_fraction)] = 0.0
    samples: StrictInt = Field(default=1024, ge=1)
    workers: StrictInt = Field(default=0, ge=0, le=256)


class Spec(_Model):
    """A whole spec file."""

    mpgen: Annotated[Literal[1], BeforeValidator(_check_version)]
    name: StrictStr
    inputs: Annotated[
        dict[str, InputSpec],
        _mapping_of("a mapping of input name -> shape", "{x: [batch, 10]}"),
    ] = Field(min_length=1)
    blocks: Annotated[
        dict[str, BlockSpec],
        _mapping_of("a mapping of block name -> block", "{MLP: {params: [dim], layers: ...}}"),
    ] = Field(default_factory=dict)
    layers: Annotated[
        dict[str, LayerSpec],
        _mapping_of("a mapping of layer name -> layer", "{fc: {op: Linear, args: [10, 20]}}"),
    ] = Field(min_length=1)
    outputs: Optional[list[StrictStr]] = Field(default=None, min_length=1)
    placement: Optional[PlacementSpec] = None
    pipeline: Annotated[
        Optional[PipelineSpec],
        _mapping_of("the pipeline settings", "{microbatches: 4, schedule: 1f1b}"),
    ] = None
    train: Optional[TrainSpec] = None
    # module class -> parameter -> initializer
    init: Optional[dict[StrictStr, Annotated[Any, AfterValidator(_check_init_map)]]] = None
    # installed packages (top-level names) dotted ops may import
    imports: Optional[list[Annotated[Any, AfterValidator(_check_import)]]] = None

    _one_output = field_validator("outputs", mode="before")(_one_or_many)


#: Field names per model, for did-you-mean suggestions on unknown keys.
FIELDS = {
    "Spec": list(Spec.model_fields),
    "LayerSpec": ["op", "in", "args", "repeat", "output", "outputs", "call", "tie", "init",
                  "checkpoint"],
    "BlockSpec": list(BlockSpec.model_fields),
    "InputSpec": list(InputSpec.model_fields),
    "AutoPlacementSpec": list(AutoPlacementSpec.model_fields),
    "TrainSpec": list(TrainSpec.model_fields),
    "PipelineSpec": list(PipelineSpec.model_fields),
}
