"""pydantic v2 models of the spec language (``shared/design/spec-v1.md``).

The models only check the *shape* of the YAML: keys, types and simple value
rules. Meaning (does an op exist, does an ``in:`` name an earlier layer, do
shapes fit) is the compiler's job. Alternative spellings the language allows
(``x: [batch, 10]`` vs ``x: {shape: [...]}``, ``outputs: head`` vs ``[head]``)
are normalised by ``mode="before"`` validators, so a validation error's
``loc`` always follows the YAML and can be mapped to a line and column.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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
    if not isinstance(value, str):
        raise PydanticCustomError("device", "expected a device like 'cuda:0' or 'cpu'")
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
    raise _error("device", f"invalid device {value!r}: expected 'cpu' or 'cuda:N'{hint}")


def parse_size(value: Any) -> int:
    """``40GiB``, ``512MB``, ``1e9`` or a plain integer number of bytes."""
    if isinstance(value, bool):
        raise PydanticCustomError("size", "expected a memory size like '40GiB'")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    match = _SIZE.match(value) if isinstance(value, str) else None
    if not match:
        raise _error(
            "size", f"invalid memory size {value!r}: expected e.g. '40GiB', '512MB' or bytes"
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def _is_value(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list) and depth < 2:
        return all(_is_value(v, depth + 1) for v in value)
    return False


def _check_value(value: Any) -> Any:
    if not _is_value(value):
        raise PydanticCustomError(
            "value", "expected a scalar (number, string, bool, null) or a list of them"
        )
    return value


#: A device string, ``cpu`` or ``cuda:N``.
Device = Annotated[StrictStr, AfterValidator(check_device)]

#: An argument value: a YAML scalar or a (nested) list of scalars.
Value = Annotated[Any, AfterValidator(_check_value)]


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False)


class InputSpec(_Model):
    """A model input: its shape (ints and symbolic dims) and dtype."""

    shape: list[Union[StrictInt, StrictStr]] = Field(min_length=1)
    dtype: Dtype = "float32"

    @model_validator(mode="before")
    @classmethod
    def _shape_only(cls, data: Any) -> Any:
        return {"shape": data} if isinstance(data, list) else data

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int | str]) -> list[int | str]:
        for dim in shape:
            if isinstance(dim, int) and dim < 1:
                raise _error("dim", f"sizes must be positive, got {dim}")
            if isinstance(dim, str) and not dim.isidentifier():
                raise _error(
                    "dim", f"a symbolic dim must be a name like 'batch' or 'seq', got {dim!r}"
                )
        return shape


class LayerSpec(_Model):
    """One entry of ``layers``; keys other than the four below are kwargs."""

    model_config = ConfigDict(extra="allow", strict=True)

    op: StrictStr
    in_: Optional[list[StrictStr]] = Field(default=None, alias="in", min_length=1)
    args: list[Value] = Field(default_factory=list)
    repeat: Optional[StrictInt] = Field(default=None, ge=1, le=100_000)

    _one_input = field_validator("in_", mode="before")(_one_or_many)

    @model_validator(mode="after")
    def _kwarg_values(self) -> "LayerSpec":
        for key, value in (self.model_extra or {}).items():
            if not _is_value(value):
                raise _error(
                    "kwarg", f"keyword argument {key!r} must be a scalar or a list of scalars"
                )
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        """The op's keyword arguments, in spec order."""
        return dict(self.model_extra or {})


class BlockSpec(_Model):
    """A reusable sub-graph, generated as its own ``nn.Module`` class."""

    params: list[StrictStr] = Field(default_factory=list)
    inputs: list[StrictStr] = Field(default_factory=lambda: ["x"], min_length=1)
    layers: dict[str, LayerSpec] = Field(min_length=1)
    outputs: Optional[list[StrictStr]] = Field(default=None, min_length=1)

    _one_output = field_validator("outputs", mode="before")(_one_or_many)
    _one_input = field_validator("inputs", mode="before")(_one_or_many)


class AutoPlacementSpec(_Model):
    """``placement: {auto: ...}``: the compiler chooses a contiguous split."""

    devices: list[Device] = Field(min_length=1)
    balance: Literal["params", "memory", "flops"] = "params"
    capacity: dict[Device, int] = Field(default_factory=dict)
    speed: dict[Device, Union[StrictFloat, StrictInt]] = Field(default_factory=dict)

    @field_validator("devices", mode="after")
    @classmethod
    def _devices(cls, devices: list[str]) -> list[str]:
        if len(set(devices)) != len(devices):
            raise PydanticCustomError("devices", "a device is listed twice")
        return devices

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: parse_size(v) for k, v in value.items()}
        return value

    @field_validator("speed", mode="after")
    @classmethod
    def _speed(cls, value: dict[str, float]) -> dict[str, float]:
        for speed in value.values():
            if not speed > 0:
                raise PydanticCustomError("speed", "speeds must be positive")
        return value


class PlacementSpec(_Model):
    """Either ``explicit`` (layer key -> device) or ``auto``."""

    explicit: dict[str, Device] = Field(default_factory=dict)
    auto: Optional[AutoPlacementSpec] = None

    @model_validator(mode="before")
    @classmethod
    def _forms(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("auto"), dict):
            return data
        if isinstance(data, dict):
            return {"explicit": data}
        return data


class CallSpec(_Model):
    """``{op: Name, **kwargs}`` for losses and optimizers."""

    model_config = ConfigDict(extra="allow", strict=True)
    op: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, data: Any) -> Any:
        return {"op": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _values(self) -> "CallSpec":
        for key, value in (self.model_extra or {}).items():
            if not _is_value(value):
                raise _error("kwarg", f"{key!r} must be a scalar or a list of scalars")
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def _loss_form(value: Any) -> str:
    # ``Name`` or ``{op: Name, ...}`` is one loss; a mapping without ``op``
    # gives a loss per output: ``{head_a: CrossEntropyLoss, head_b: MSELoss}``.
    if isinstance(value, (str, CallSpec)) or (isinstance(value, dict) and "op" in value):
        return "one"
    return "each"


class TrainSpec(_Model):
    """Settings of the generated training script."""

    loss: Annotated[
        Union[Annotated[CallSpec, Tag("one")], Annotated[dict[str, CallSpec], Tag("each")]],
        Discriminator(_loss_form),
    ] = Field(default_factory=lambda: CallSpec(op="MSELoss"))
    optimizer: CallSpec = Field(default_factory=lambda: CallSpec(op="SGD", lr=0.01))
    batch_size: StrictInt = Field(default=32, ge=1)
    steps: StrictInt = Field(default=100, ge=1)
    seed: StrictInt = 0
    log_every: StrictInt = Field(default=1, ge=1)
    dims: dict[str, StrictInt] = Field(default_factory=dict)

    @field_validator("dims", mode="after")
    @classmethod
    def _dims(cls, value: dict[str, int]) -> dict[str, int]:
        for size in value.values():
            if size < 1:
                raise PydanticCustomError("dims", "dim sizes must be positive")
        return value


class Spec(_Model):
    """A whole spec file."""

    mpgen: Literal[1]
    name: StrictStr
    inputs: dict[str, InputSpec] = Field(min_length=1)
    blocks: dict[str, BlockSpec] = Field(default_factory=dict)
    layers: dict[str, LayerSpec] = Field(min_length=1)
    outputs: Optional[list[StrictStr]] = Field(default=None, min_length=1)
    placement: Optional[PlacementSpec] = None
    train: Optional[TrainSpec] = None

    _one_output = field_validator("outputs", mode="before")(_one_or_many)


#: Field names per model, for did-you-mean suggestions on unknown keys.
FIELDS = {
    "Spec": list(Spec.model_fields),
    "LayerSpec": ["op", "in", "args", "repeat"],
    "BlockSpec": list(BlockSpec.model_fields),
    "InputSpec": list(InputSpec.model_fields),
    "AutoPlacementSpec": list(AutoPlacementSpec.model_fields),
    "TrainSpec": list(TrainSpec.model_fields),
}
