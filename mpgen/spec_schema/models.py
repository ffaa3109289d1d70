"""pydantic v2 models of the spec language (``docs/spec.md``).

The models only check the *shape* of the YAML: keys, types and simple value
rules. Meaning (does an op exist, does an ``in:`` name an earlier layer, do
shapes fit) is the compiler's job. Alternative spellings the language allows
(``x: [batch, 10]`` vs ``x: {shape: [...]}``, ``outputs: head`` vs ``[head]``)
are normalised by ``mode="before"`` validators, so a validation error's
``loc`` always follows the YAML and can be mapped to a line and column.

# NOTE: [The JSON Schema of the input language]
# ``mpgen schema`` (``json_schema.py``) derives the JSON Schema of what a
# spec may say from these models, and ``docs/spec-reference.md`` from that
# schema: every key's description is its ``Field(description=...)``, every
# section's its model's docstring. Where the Python type of a field is not
# the form it is written in (``Annotated[Any, AfterValidator(...)]``, a
# short form a ``mode="before"`` validator normalises), the models give that
# form here, beside the validator: ``WithJsonSchema`` on a type,
# ``__get_pydantic_json_schema__`` on a model with several forms. A form
# made by :func:`form` is named: the schema defines it once (``$defs``) and
# the reference lists it under "Types". A form may be looser than its
# validator (a regular expression cannot check everything), never stricter:
# ``tests/spec_schema/test_json_schema.py`` checks that the schema accepts
# every spec the models accept.
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
    GetJsonSchemaHandler,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from mpgen.errors import did_you_mean, shown

DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")
Dtype = Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"]


_DEVICE = re.compile(r"^(cpu|cuda:(0|[1-9][0-9]{0,2}))$")
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE | re.ASCII)
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


def _check_call(value: Any) -> Any:
    """``call:`` is ``false`` or a mapping of keyword arguments; anything
    else is one line (a union's own error names pydantic's inner types)."""
    if value is None or value is False or isinstance(value, dict):
        return value
    raise _error("call", "expected a mapping of forward's keyword arguments, like "
                         f"{{is_causal: true}}, or false (a module forward never calls), "
                         f"got {shown(value)}")


def _mapping_of(what: str, example: str):
    """A ``mode="before"`` check: the value must be a mapping (``what``)."""
    def check(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _error("mapping", f"expected {what}, like {example}")
        return value
    return BeforeValidator(check)


#: The key of a named form in a JSON Schema (NOTE [The JSON Schema of the
#: input language]); ``json_schema.py`` turns it into a ``$ref``.
FORM = "x-mpgen-form"


def form(name: str, description: str, schema: dict) -> dict:
    """The JSON Schema of a named form of value: a definition of its own."""
    return {FORM: {"name": name, "schema": {**schema, "description": description}}}


_SCALAR = {"type": ["null", "boolean", "number", "string"]}
#: A keyword argument's name (:func:`kwarg_problem`) as a regular expression.
KWARG_PATTERN = ("^(?!(?:" + "|".join(keyword.kwlist) + ")$)(?!__)[A-Za-z_][A-Za-z0-9_]*$")

DEVICE_FORM = form("Device", "A device: `cpu` or `cuda:N` (N from 0 to 999).",
                   {"type": "string", "pattern": _DEVICE.pattern})
VALUE_FORM = form(
    "Value",
    "An argument value: a scalar (number, string, `true`/`false`, `null`) or a list of them, "
    "nested at most two deep. In a block, `$name` is the block parameter `name`; a string "
    "starting with `=` is an expression (`\"=3 * $dim\"`, `\"=size(idx, 1)\"`).",
    {"anyOf": [_SCALAR, {"type": "array", "items": {
        "anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}]}}]})
DIM_FORM = form(
    "Dim", f"A dim of an input shape: a size from 1 to {MAX_DIM:,}, or a symbolic dim by "
    "name (`batch` is the batch dim; `seq`, `h`, `w`...).",
    # A name: an identifier, which a pattern can only approximate (no space,
    # not starting with a digit: looser, never stricter).
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_DIM},
               {"type": "string", "pattern": r"^[^\s\d]\S*$"}]})
KWARG_FORM = form(
    "Keyword", "The name of a keyword argument: an ASCII identifier, not a Python keyword, "
    "not starting with `__`.", {"type": "string", "pattern": KWARG_PATTERN})

#: A device string, ``cpu`` or ``cuda:N``.
Device = Annotated[Any, AfterValidator(check_device), WithJsonSchema(DEVICE_FORM)]

#: An argument value: a YAML scalar or a (nested) list of scalars.
Value = Annotated[Any, AfterValidator(_check_value), WithJsonSchema(VALUE_FORM)]

#: A dim of an input shape: a positive size or a symbolic name.
Dim = Annotated[Any, AfterValidator(_check_dim), WithJsonSchema(DIM_FORM)]

#: The name of a keyword argument, pasted into generated code: an identifier.
KwargName = Annotated[str, AfterValidator(_check_kwarg_name), WithJsonSchema(KWARG_FORM)]


def _check_parameter_path(name: str) -> str:
    for part in name.split("."):
        _check_kwarg_name(part)
    return name


_PART = "(?!(?:" + "|".join(keyword.kwlist) + ")(?:[.]|$))(?!__)[A-Za-z_][A-Za-z0-9_]*"
PARAMETER_FORM = form(
    "ParameterPath", "A parameter of the layer: `weight`, or inside a block instance "
    "`embed_tokens.weight` (names as keyword arguments' are, joined by `.`).",
    {"type": "string", "pattern": f"^(?:{_PART}[.])*{_PART}$"})
#: A tie's key: a parameter of the layer, dotted inside a block instance.
ParameterPath = Annotated[str, AfterValidator(_check_parameter_path),
                          WithJsonSchema(PARAMETER_FORM)]


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
    quoted = (f' (a layer named {item} is read as "{item}", quoted)'
              if isinstance(item, int) and not isinstance(item, bool) and item >= 0 else "")
    raise _error("in", f"expected a name, a list of names or {{keyword: name}}, "
                 f"got {shown(item)}{quoted}")


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


_NAME = {"type": "string"}


def _names(depth: int) -> dict:
    """JSON Schema: a non-empty list of names and lists of names, nested
    ``depth`` levels below it (``_check_in_item``, ``_check_out_items``)."""
    item = _NAME if depth == 0 else {"anyOf": [_NAME, _names(depth - 1)]}
    return {"type": "array", "minItems": 1, "items": item}


TUPLE_FORM = form("Tuple", "A tuple of names: a non-empty list of names and tuples, "
                  "nested at most three deep (`[h, c]`, `[out, [h, c]]`).", _names(2))
#: A name, or a non-empty list of them (:func:`_one_or_many`).
_ONE_OR_MANY = {"anyOf": [_NAME, {"type": "array", "minItems": 1, "items": _NAME}]}
#: A layer's ``in:``: a name, or a list of names, tuples and a last mapping.
_IN_FORM = {"anyOf": [_NAME, {
    "type": "array",
    "items": {"anyOf": [_NAME, TUPLE_FORM, {
        "type": "object", "propertyNames": KWARG_FORM, "additionalProperties": _NAME}]},
    # At most one mapping (that it is the last item, the models check).
    "contains": {"type": "object"}, "minContains": 0, "maxContains": 1}]}

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


INITIALIZER_FORM = form(
    "Initializer", "A `torch.nn.init` function, by its name without the trailing `_`, alone "
    "or with its keyword arguments: `zeros`, `ones`, `{constant: 0.5}`, `{normal: {std: 0.02}}`, "
    "`{uniform: {a: -0.1, b: 0.1}}`, `{kaiming_normal: {mode: fan_out, nonlinearity: relu}}`.",
    {"anyOf": [_NAME, {"type": "object", "minProperties": 1, "maxProperties": 1,
                       "additionalProperties": {"anyOf": [VALUE_FORM, {
                           "type": "object", "additionalProperties": VALUE_FORM}]}}]})
INITIALIZERS_FORM = form(
    "Initializers", "Parameter -> initializer: `{weight: {normal: {std: 0.02}}, bias: zeros}`.",
    {"type": "object", "propertyNames": KWARG_FORM, "additionalProperties": INITIALIZER_FORM})


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


#: The ops of a tensor of the layer's own (``{op: Parameter, shape: [768]}``),
#: whose ``init:`` is one initializer, not a mapping of parameters.
TENSOR_OPS = ("Parameter", "Buffer")

#: A layer's ``init:``: parameter -> initializer; a plain value is instead the
#: constructor's own ``init`` argument (``nn.PReLU(init=0.25)``); for a
#: Parameter or Buffer, its one initializer (checked in LayerSpec, which knows
#: the op).
LayerInit = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": ["boolean", "number", "string"]}, INITIALIZERS_FORM, INITIALIZER_FORM]})]


def _check_layer_init(value: Any, op: Any) -> Any:
    if op in TENSOR_OPS:
        if isinstance(value, dict) and len(value) == 1 and isinstance(
                next(iter(value.values())), list):  # {values: [...]}: checked by the front end
            return value
        return _check_initializer(value)
    if _is_value(value) and not isinstance(value, list):
        return value
    return _check_init_map(value)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False)


def _json_forms(handler: GetJsonSchemaHandler, schema: core_schema.CoreSchema,
                *others: dict) -> dict:
    """The JSON Schema of a model written as a mapping of its fields or in one
    of the ``others`` forms (which its ``mode="before"`` validator normalises)."""
    json_schema = handler(schema)
    model = handler.resolve_ref_schema(json_schema)
    about = {key: model.pop(key) for key in ("title", "description") if key in model}
    mapping = dict(model)
    model.clear()
    model.update(about, anyOf=[*others, mapping])
    return json_schema


class InputSpec(_Model):
    """An entry of ``inputs``: a model input, its shape alone (``x: [batch, 10]``)
    or its shape and dtype (``ids: {shape: [batch, seq], dtype: int64}``)."""

    shape: list[Dim] = Field(min_length=1, description="The sizes and symbolic dims, in order.")
    dtype: Dtype = Field("float32", description="The input's dtype.")

    @classmethod
    def __get_pydantic_json_schema__(cls, schema, handler):
        return _json_forms(handler, schema, {"type": "array", "minItems": 1, "items": DIM_FORM,
                                             "description": "The shape alone."})

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
    """An entry of ``layers`` (of the model or of a block): ``{op: Linear,
    args: [10, 20]}``. Keys other than those below are keyword arguments of
    the op, checked against its real signature."""

    model_config = ConfigDict(extra="allow", strict=True)
    # Extra keys are keyword arguments: names become code, values literals.
    __pydantic_extra__: dict[KwargName, Value]

    op: StrictStr = Field(description=(
        "What the layer is: a `torch.nn` class (`Linear`), a block, `torch.NAME` or `F.NAME` "
        "(a tensor function), a cast (`torch.Tensor.to` with `dtype`, `torch.Tensor.type_as`), "
        "the dotted path of your own `nn.Module` class, or `Parameter` / `Buffer` (a tensor of "
        "the layer's own: `shape`, `dtype`, `init`, a Buffer's `persistent`)."))
    # Names, nested lists (tuple arguments) and a last mapping (keywords);
    # ``in: []`` marks a factory.
    in_: Optional[Annotated[list[Annotated[Any, AfterValidator(_check_in_item)]],
                            AfterValidator(_check_in_order), WithJsonSchema(_IN_FORM)]] = Field(
        default=None, alias="in", description=(
            "The input(s): a name or a list of names of model inputs, earlier layers' values "
            "or (in a block) the block's inputs; a nested list passes a tuple, a last mapping "
            "`{keyword: name}` passes tensors by keyword, `[]` marks a factory. Default: the "
            "previous layer of the same mapping; for the first layer, the first input."))
    args: list[Value] = Field(default_factory=list,
                              description="Positional arguments of the op.")
    repeat: Optional[StrictInt] = Field(default=None, ge=1, le=100_000, description=(
        "N fresh copies applied one after another: `h` with `repeat: 12` has instances `h.0` "
        "... `h.11`."))
    # mpgen extension: the element of a returned tuple that is the layer's
    # output (LSTM, MultiheadAttention return tuples): ``output: 0``.
    output: Optional[StrictInt] = Field(default=None, ge=-100, le=100, description=(
        "The one element of the tuple the op returns that is the layer's output: `output: 0` "
        "(mpgen)."))
    # The elements of a returned tuple, by name: ``outputs: [q, k, v]``.
    outputs: Optional[Annotated[
        list[Any], AfterValidator(_check_out_items),
        WithJsonSchema({"type": "array", "minItems": 1, "items": {"anyOf": [_NAME, TUPLE_FORM]}}),
    ]] = Field(default=None, min_length=1, description=(
        "Names for the elements of the tuple the op returns: `[q, k, v]`; a nested list "
        "names a nested tuple, `_` drops an element."))
    # Literal keyword arguments of a module's forward: ``call: {is_causal: true}``.
    # ``call: false``: a module the model holds but forward never calls.
    call: Annotated[Optional[Union[Literal[False], dict[KwargName, Value]]],
                    BeforeValidator(_check_call)] = Field(
        default=None, description=(
            "Literal keyword arguments (or expressions) of a module's `forward`: "
            "`{is_causal: true}`; `false`: the module is held (its parameters in the state "
            "dict, tied to or from) but forward never calls it."))
    # Shared parameters: ``tie: {weight: wte.weight}``.
    tie: Optional[dict[ParameterPath, StrictStr]] = Field(default=None, min_length=1, description=(
        "Parameters shared with an earlier layer: `{weight: wte.weight}`; on a block instance, "
        "a parameter inside it: `{embed_tokens.weight: encoder.embed_tokens.weight}`."))
    init_: Optional[LayerInit] = Field(default=None, alias="init", description=(
        "The layer's own initializers, applied after the top-level `init`; a plain value is "
        "instead the constructor's `init` argument (`{op: PReLU, init: 0.25}`)."))
    # mpgen extension: recompute the layer in backward (torch.utils.checkpoint).
    checkpoint: Optional[StrictBool] = Field(default=None, description=(
        "`true`: recompute the layer in backward instead of keeping its activations "
        "(`torch.utils.checkpoint`; mpgen); each instance of a repeated layer."))
    # mpgen extension: parameters that do not train (requires_grad=False).
    requires_grad: Optional[StrictBool] = Field(default=None, description=(
        "`false`: the layer's parameters do not train (`requires_grad_(False)`): a "
        "Parameter's, every parameter of a module, every parameter inside a block "
        "instance, each copy of a repeated layer. On a torch function, its own keyword."))

    _one_input = field_validator("in_", mode="before")(_one_or_many)

    @field_validator("init_")
    @classmethod
    def _init(cls, value: Any, info: ValidationInfo) -> Any:
        return None if value is None else _check_layer_init(value, info.data.get("op"))

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

    @model_serializer(mode="wrap")
    def _without_unset_requires_grad(self, handler):
        # No requires_grad: is no key, so the digest of a spec without one is
        # what it was before the key existed (NOTE [Spec digest]).
        data = handler(self)
        if isinstance(data, dict) and data.get("requires_grad") is None:
            data.pop("requires_grad", None)
        return data


class BlockSpec(_Model):
    """An entry of ``blocks``: a reusable sub-graph, generated as its own
    ``nn.Module`` class and used as a layer's ``op``. A block may use blocks
    defined before it; an instance is placed whole."""

    params: list[StrictStr] = Field(default_factory=list, description=(
        "The block's `__init__` arguments, read in its layers as `$name`."))
    inputs: Annotated[list[StrictStr], WithJsonSchema(_ONE_OR_MANY)] = Field(
        default_factory=lambda: ["x"], min_length=1, description="The block's input names.")
    layers: Annotated[
        dict[str, LayerSpec],
        _mapping_of("a mapping of layer name -> layer", "{fc: {op: Linear, args: [8, 8]}}"),
    ] = Field(min_length=1, description="The block's layers, in order: name -> layer.")
    outputs: Optional[Annotated[list[StrictStr], WithJsonSchema(_ONE_OR_MANY)]] = Field(
        default=None, min_length=1, description=(
            "The block's output(s), returned as a tuple when there are several. Default: the "
            "last layer."))

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _error("block", "expected a block, like {params: [dim], layers: {...}}")
        return data

    _one_output = field_validator("outputs", mode="before")(_one_or_many)
    _one_input = field_validator("inputs", mode="before")(_one_or_many)


#: A memory size, as :func:`parse_size` reads it.
SIZE_FORM = form(
    "MemorySize", "A memory size: `40GiB`, `512MB`, `1.5TB` (K, M, G, T: powers of 1000; "
    "Ki, Mi, Gi, Ti: of 1024) or a number of bytes.",
    {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {
        "type": "string",
        "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*([KkMmGgTt][Ii]?[Bb]|[Bb])?\s*$"}]})


class AutoPlacementSpec(_Model):
    """``placement: {auto: ...}``: mpgen chooses the layout, one contiguous
    stage of layers per device, the exact optimum of ``balance``
    (``docs/partition.md``)."""

    devices: list[Device] = Field(min_length=1, json_schema_extra={"uniqueItems": True},
                                  description="The devices, in stage order.")
    balance: Literal["params", "memory", "flops", "time"] = Field("params", description=(
        "What a device's load counts: parameters, memory (the estimated training memory), "
        "flops, or time: the milliseconds `mpgen profile` measured, read from "
        "`<spec stem>.profile.yaml` beside the spec."))
    capacity: dict[Device, Annotated[Any, AfterValidator(parse_size), WithJsonSchema(SIZE_FORM)]] \
        = Field(default_factory=dict, description=(
            "The most estimated training memory a device may hold, whatever the balance: "
            "`{cuda:0: 40GiB}`; no limit for a device not listed."))
    speed: dict[Device, Annotated[Any, AfterValidator(_check_speed), WithJsonSchema(
        {"type": "number", "exclusiveMinimum": 0})]] = Field(default_factory=dict, description=(
            "Relative speeds (default 1): a device's load is its stage's cost divided by its "
            "speed."))
    split: list[StrictStr] = Field(default_factory=list, description=(
        "Block instances whose layers are placed one by one, as if named inside by explicit "
        "keys (their state-dict keys stay the unsplit block's): `[model]`; a dotted path "
        "(`model.encoder`) splits an instance inside one too."))

    @field_validator("devices", mode="after")
    @classmethod
    def _devices(cls, devices: list[str]) -> list[str]:
        twice = [d for i, d in enumerate(devices) if d in devices[:i]]
        if twice:
            raise _error("devices", f"device {shown(twice[0])} is listed twice")
        return devices


class PlacementSpec(_Model):
    """``placement``: the device layout, explicit or automatic. Explicit: layer
    -> device, where a key is a layer, ``name.i`` or ``name.i-j`` (inclusive)
    of a repeated layer; entries are bookmarks: a layer not named stays on the
    device of the one before it, those before the first entry go to its
    device. Automatic: ``{auto: {...}}``. Default: everything on cuda:0."""

    # ``placement: {layer: device}``, as the models hold it (not a key of the YAML).
    explicit: dict[str, Device] = Field(default_factory=dict)
    auto: Optional[AutoPlacementSpec] = Field(default=None, description=(
        "mpgen chooses the layout (`docs/partition.md`)."))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema, handler):
        # The YAML's two forms (the validator ``_forms`` below): the explicit
        # mapping itself, or ``{auto: ...}`` alone; ``explicit`` is not a key.
        explicit = {"type": "object", "additionalProperties": DEVICE_FORM,
                    "description": "Explicit: layer -> device."}
        json_schema = _json_forms(handler, schema, explicit)
        auto_form = handler.resolve_ref_schema(json_schema)["anyOf"][-1]
        del auto_form["properties"]["explicit"]
        auto_form["required"] = ["auto"]
        return json_schema

    @model_validator(mode="before")
    @classmethod
    def _forms(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("auto"), (dict, list)):
            if "explicit" in data:  # a field, not a key of the YAML: it would be ignored
                raise _error("placement", "{auto: ...} stands alone; write the "
                             "explicit layout as the mapping itself, without 'explicit:'")
            return data
        if isinstance(data, dict):
            return {"explicit": data}
        raise _error("placement", "expected a mapping of layer -> device, like "
                     "{layer1: cuda:0, layer2: cuda:1}, or {auto: {devices: [...]}}")


class PipelineSpec(_Model):
    """``pipeline``: the micro-batched forward and the defaults of
    ``pp_<name>.py`` (``docs/pipelining.md``)."""

    # The schedule's name and the devices' use are the front end's to check.
    microbatches: StrictInt = Field(ge=1, le=100_000, description=(
        "M: `forward` splits every input with a `batch` dim into M micro-batches along it and "
        "runs the stages over them; at most `train.batch_size`."))
    # mpgen extension: pp_<name>.py's default --schedule.
    schedule: StrictStr = Field("1f1b", description=(
        "The default `--schedule` of `pp_<name>.py`, a `torch.distributed.pipelining` schedule: "
        "`gpipe`, `1f1b` (one stage per rank), `interleaved`, `looped-bfs`, `interleaved-zb` "
        "(a layout that visits its devices in a repeating order at least twice, a rank per "
        "device) or `zbv`, `dualpipev` (an even number of stages, two per rank in a V) (mpgen)."))
    # mpgen extension: pp_<name>.py's default --dp.
    dp: StrictInt = Field(1, ge=1, le=100_000, description=(
        "The default `--dp` of `pp_<name>.py`: replicas of the pipeline, each training its share "
        "of `train.batch_size` (data parallel); torchrun starts the schedule's ranks times `dp` "
        "processes (mpgen)."))
    # mpgen extension: pp_<name>.py's default --sync-bn.
    sync_bn: StrictBool = Field(False, description=(
        "The default `--sync-bn` of `pp_<name>.py`: each BatchNorm normalises a micro-batch by "
        "the statistics of that micro-batch on every `dp` replica together (without it each "
        "replica uses its own; docs/pipelining.md) (mpgen)."))
    # mpgen extension: every layer placed on these devices is checkpointed.
    checkpoint: list[Device] = Field(default_factory=list, description=(
        "Devices whose module layers are all checkpointed (the spec's devices, before "
        "`--device-map`; mpgen)."))


class CallSpec(_Model):
    """``{op: Name, **kwargs}`` for losses and optimizers."""

    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[KwargName, Value]
    op: StrictStr = Field(description=(
        "The class (or built-in schedule) by name, or your own loss or optimizer class by its "
        "dotted path."))

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

    @classmethod
    def __get_pydantic_json_schema__(cls, schema, handler):
        return _json_forms(handler, schema, {"type": "string", "description": "The name alone."})

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class LossSpec(CallSpec):
    """``train.loss``: a ``torch.nn`` loss, or your own loss class by its dotted
    path, by name (``MSELoss``) or as ``{op: Name, ...}`` whose other keys are
    the loss's keyword arguments."""

    class_dim: Optional[StrictInt] = Field(default=None, description=(
        "Which dim of the output holds the classes, for a class-index loss "
        "(`CrossEntropyLoss`, `NLLLoss`, `MultiMarginLoss`); negative counts from the end "
        "(mpgen; not passed to the loss). Default: dim 1, or the last when dim 1 is symbolic "
        "and the last a number."))

    example: ClassVar[str] = "a loss like 'MSELoss' or {op: CrossEntropyLoss, label_smoothing: 0.1}"


class OptimizerSpec(CallSpec):
    """``train.optimizer``: a ``torch.optim`` optimizer, or your own
    ``torch.optim.Optimizer`` subclass by its dotted path, by name (``SGD``) or
    as ``{op: Name, ...}`` whose other keys are its keyword arguments (without
    ``lr``, the optimizer's own default)."""

    example: ClassVar[str] = "an optimizer like 'SGD' or {op: AdamW, lr: 3.0e-4}"


class SchedulerSpec(CallSpec):
    """``train.scheduler``: the learning rate's schedule, changed once per
    optimizer step: a built-in schedule (``cosine``, ``linear``,
    ``constant``, from the base learning rate to ``min_lr``, default 0) or a
    ``torch.optim.lr_scheduler`` class, by name or as ``{op: Name, warmup:
    STEPS, ...}`` whose other keys are its keyword arguments."""

    # The front end checks the other keys against the schedule.
    warmup: StrictInt = Field(default=0, ge=0, description=(
        "Steps over which the learning rate first rises linearly from 0 (not with "
        "`ReduceLROnPlateau`)."))

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


_FACTORY_FORM = {"type": "string", "pattern": FACTORY.pattern}
_DATA_PATH_FORM = {"type": "string", "pattern": r"^[^\x00\n\r]*("
                   + "|".join(re.escape(suffix) for suffix in DATA_SUFFIXES) + ")$"}


class DataSpec(_Model):
    """``train.data``/``train.eval_data``: a file of tensors (``data/train.npz``,
    or ``{path: ...}``) holding one tensor per model input, by name, plus
    ``target``; or a factory ``package.module:function`` returning a
    ``Dataset`` or ``DataLoader`` (or ``{factory: ..., KEYWORD: VALUE}``: the
    other keys are its keyword arguments). A mapping gives exactly one of
    ``factory`` and ``path``. The factory's module follows the import policy
    of user modules (a module of the project, or of a package listed under
    ``imports:``; never the standard library), checked on disk: the build
    never imports it."""

    # Which of ``factory``/``path`` is given, and that only a factory takes
    # keyword arguments, the front end checks (at the keys).
    model_config = ConfigDict(extra="allow", strict=True)
    __pydantic_extra__: dict[KwargName, Value]
    factory: Optional[Annotated[StrictStr, AfterValidator(_check_factory),
                                WithJsonSchema(_FACTORY_FORM)]] = Field(default=None, description=(
        "`package.module:function`, called with the other keys as keyword arguments."))
    path: Optional[Annotated[StrictStr, AfterValidator(_check_data_path),
                             WithJsonSchema(_DATA_PATH_FORM)]] = Field(default=None, description=(
        "A file ending in " + ", ".join(f"`{suffix}`" for suffix in DATA_SUFFIXES)
        + ", relative to the working directory of the training script."))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema, handler):
        return _json_forms(handler, schema,
                           {**_DATA_PATH_FORM, "description": "A file of tensors."},
                           {**_FACTORY_FORM, "description": "A factory."})

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


class MetricSpec(_Model):
    """One of ``train.metrics``: a metric of the evaluation, by name
    (``accuracy``, ``top5_accuracy``, ``f1``, ``perplexity``, or your own
    function ``package.module:function``) or as ``{op: ..., k: K, output:
    NAME}``. The front end checks the name, ``k`` and the output."""

    op: StrictStr = Field(description=(
        "`accuracy`, `top_k_accuracy` (with `k`; or `topK_accuracy`), `f1` (macro), "
        "`perplexity`, or `package.module:function` called with each evaluation batch's "
        "output and target, returning a number (the mean over the batches is logged)."))
    k: Optional[Annotated[StrictInt, Field(ge=1)]] = Field(default=None, description=(
        "`top_k_accuracy`'s k: a target among the k largest outputs counts as right."))
    output: Optional[StrictStr] = Field(default=None, description=(
        "The output it measures. Default: every output it applies to (a class output for "
        "an accuracy or F1, a `CrossEntropyLoss`/`NLLLoss` one for perplexity); a function "
        "of a spec with several losses names it."))

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"op": data}
        if not isinstance(data, dict):
            raise _error("metrics", "expected a metric like 'accuracy', 'top5_accuracy' or "
                         f"{{op: top_k_accuracy, k: 5, output: NAME}}, got {shown(data)}")
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, schema, handler):
        return _json_forms(handler, schema, {"type": "string", "description": "The name alone."})


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


def _loss_per_output(schema: dict) -> None:
    """JSON Schema: the mapping of output -> loss is a mapping without ``op``
    (:func:`_loss_form`), so that exactly one form of ``train.loss`` matches."""
    next(form for form in schema["oneOf"] if form.get("type") == "object")["not"] = {
        "required": ["op"]}


class TrainSpec(_Model):
    """``train``: settings of the generated training script; every key is
    optional, and each is also a flag of the script, whose default it sets."""

    loss: Annotated[
        Union[Annotated[LossSpec, Tag("one")], Annotated[dict[str, LossSpec], Tag("each")]],
        Discriminator(_loss_form),
    ] = Field(default_factory=lambda: LossSpec(op="MSELoss"), json_schema_extra=_loss_per_output,
              description=("The loss; with several outputs, one loss applied to each, or a "
                           "mapping of output name -> loss, where an output it does not name "
                           "is returned and not trained on (an LSTM's `hn`, `cn`)."))
    optimizer: OptimizerSpec = Field(default_factory=lambda: OptimizerSpec(op="SGD", lr=0.01),
                                     description="The optimizer.")
    batch_size: StrictInt = Field(default=32, ge=1, description=(
        "Samples per (micro-)batch, at most 2,147,483,647."))
    steps: StrictInt = Field(default=100, ge=1, description=(
        "Optimizer steps (each of `accumulate` micro-batches)."))
    seed: StrictInt = Field(0, description=(
        "The script's default seed: the model, the data order and every RNG; in "
        "`[-2**63, 2**64 - 1]`."))
    log_every: StrictInt = Field(default=1, ge=1, description="Print the loss every N steps.")
    dims: dict[str, Annotated[StrictInt, Field(ge=1)]] = Field(default_factory=dict, description=(
        "Sizes of symbolic dims (`seq: 128`): the training script's synthetic data, the "
        "generated tests' inputs and the build's cost estimates, which the build checks the "
        "model runs at (default 16; at most 2,147,483,647)."))
    epochs: Optional[StrictInt] = Field(default=None, ge=1, description=(
        "Passes over the data; with `steps` too, whichever ends first."))
    scheduler: Optional[SchedulerSpec] = Field(default=None, description=(
        "The learning rate's schedule. Default: none (constant)."))
    grad_clip: Optional[Annotated[Any, AfterValidator(_check_grad_clip), WithJsonSchema(
        {"type": "number", "exclusiveMinimum": 0})]] = Field(default=None, description=(
            "Clip the gradients' total norm to this before each step (`clip_grad_norm_`). "
            "Default: no clipping."))
    accumulate: StrictInt = Field(default=1, ge=1, description=(
        "Micro-batches of `batch_size` whose gradients add up before each optimizer step."))
    amp: Annotated[Any, AfterValidator(_check_amp), WithJsonSchema({"enum": [*AMP, False]})] = \
        Field("off", description=(
            "Autocast the forward and the loss to bfloat16, or to float16 with a `GradScaler`; "
            "a bare `off` (which YAML reads as `false`) and `false` both mean off."))
    no_decay: Annotated[list[Annotated[Any, AfterValidator(_check_no_decay_kind)]],
                        AfterValidator(_check_distinct),
                        WithJsonSchema({"type": "array", "uniqueItems": True,
                                        "items": {"enum": list(NO_DECAY)}})] = Field(
        default_factory=list, description=(
            "Parameters without weight decay (nanoGPT's two parameter groups); needs an "
            "optimizer with a non-zero `weight_decay`."))
    data: Optional[DataSpec] = Field(default=None, description=(
        "The training data. Default: synthetic data shaped from the spec."))
    eval_data: Optional[DataSpec] = Field(default=None, description=(
        "The evaluation data. Default: none."))
    eval_every: StrictInt = Field(default=0, ge=0, description=(
        "Evaluate every N steps; 0: after the last step only, when there is evaluation data."))
    eval_split: Annotated[Any, AfterValidator(_check_fraction), WithJsonSchema(
        {"type": "number", "minimum": 0, "exclusiveMaximum": 1})] = Field(0.0, description=(
            "Hold this fraction of the data out for evaluation; not with `eval_data`."))
    samples: StrictInt = Field(default=1024, ge=1, description=(
        "Samples in one epoch of synthetic data, at most 2,147,483,647."))
    workers: StrictInt = Field(default=0, ge=0, le=256, description=(
        "`DataLoader` worker processes."))
    metrics: Optional[list[MetricSpec]] = Field(default=None, description=(
        "The evaluation's metrics, logged beside each output's loss (`eval_<name>`, "
        "`--monitor`'s names). Default: the accuracy of each class output and the perplexity "
        "of each token loss; `[]`: none."))
    monitor: Optional[StrictStr] = Field(default=None, description=(
        "The evaluation column whose best step is kept (`best.pt`; the pipeline program's "
        "`DIR/best`): `eval_loss`, `eval_loss_<output>` or `eval_<metric>`. Default: "
        "`eval_loss` where the run evaluates."))
    monitor_mode: Optional[Literal["min", "max"]] = Field(default=None, description=(
        "Whether lower (`min`) or higher (`max`) `monitor` is better. Default: as its name "
        "says (a loss or a perplexity: min; an accuracy or an F1: max)."))
    keep_last: StrictInt = Field(default=1, ge=1, description=(
        "Keep the N newest saves (`last.pt`, and past 1 `DIR/step_N.pt`; the pipeline "
        "program's `DIR/step_N`), the best kept besides."))
    early_stop: StrictInt = Field(default=0, ge=0, description=(
        "Stop after this many evaluations without a better `monitor`, saving as at the "
        "end; 0: never."))


class Spec(_Model):
    """An mpgen spec, format version 1: a model, its device layout and its
    training settings (``docs/spec.md``). Unknown keys are errors."""

    mpgen: Annotated[Literal[1], BeforeValidator(_check_version)] = Field(
        description="The spec format version: the integer 1.")
    name: StrictStr = Field(description=(
        "The class name of the generated `nn.Module`; the generated files are named after it "
        "in snake case (`SimpleModel` -> `simple_model.py`, `DigitViT` -> `digit_vit.py`; "
        "docs/spec.md gives the rule)."))
    inputs: Annotated[
        dict[str, InputSpec],
        _mapping_of("a mapping of input name -> shape", "{x: [batch, 10]}"),
    ] = Field(min_length=1, description=(
        "The model's inputs, in order (forward's arguments): name -> shape."))
    blocks: Annotated[
        dict[str, BlockSpec],
        _mapping_of("a mapping of block name -> block", "{MLP: {params: [dim], layers: ...}}"),
    ] = Field(default_factory=dict, description=(
        "Reusable sub-graphs, each a generated `nn.Module` class: name -> block."))
    layers: Annotated[
        dict[str, LayerSpec],
        _mapping_of("a mapping of layer name -> layer", "{fc: {op: Linear, args: [10, 20]}}"),
    ] = Field(min_length=1, description=(
        "The layers, in order: name -> layer. A name is a Python identifier, not starting "
        "with `__` and not an `nn.Module` attribute (`train`, `to`, `forward`...)."))
    outputs: Optional[Annotated[list[StrictStr], WithJsonSchema(_ONE_OR_MANY)]] = Field(
        default=None, min_length=1, description=(
            "The model's output(s): layer or element names, returned as a tuple in this order "
            "when there are several. Default: the last layer."))
    placement: Optional[PlacementSpec] = Field(default=None, description="The device layout.")
    # mpgen extension: the memory each device has, checked against the memory plan.
    capacity: dict[Device, Annotated[Any, AfterValidator(parse_size), WithJsonSchema(SIZE_FORM)]] \
        = Field(default_factory=dict, description=(
            "The memory each device has: `{cuda:0: 24GiB, cuda:1: 12GiB}`. A build whose memory "
            "plan needs more on a device (training, and the pipeline program with `pipeline:`) "
            "is an error naming the device, its need and what takes the most (docs/memory.md)."))
    pipeline: Annotated[
        Optional[PipelineSpec],
        _mapping_of("the pipeline settings", "{microbatches: 4, schedule: 1f1b}"),
    ] = Field(default=None, description=(
        "The micro-batched forward and the defaults of `pp_<name>.py`."))
    train: Optional[TrainSpec] = Field(default=None, description=(
        "Settings of the generated training script."))
    # module class -> parameter -> initializer
    init: Optional[dict[StrictStr, Annotated[
        Any, AfterValidator(_check_init_map), WithJsonSchema(INITIALIZERS_FORM)]]] = Field(
        default=None, description=(
            "Parameter initialization by `torch.nn` class: class -> parameter -> initializer, "
            "for every module of the class (and its subclasses) in module order, bias only "
            "where the module has one; a layer's own init applies after."))
    # installed packages (top-level names) dotted ops may import
    imports: Optional[list[Annotated[Any, AfterValidator(_check_import), WithJsonSchema(
        {"type": "string", "pattern": "^[^._][^.]*$", "not": {"enum": ["mpgen", "torch"]}})]]] \
        = Field(default=None, description=(
            "Installed packages, by top-level name, that dotted ops may import from besides the "
            "spec's project: not dotted, not private, not torch, mpgen or the standard "
            "library."))

    _one_output = field_validator("outputs", mode="before")(_one_or_many)

    @model_serializer(mode="wrap")
    def _without_empty_capacity(self, handler):
        # No capacity: is no key, so the digest of a spec without one is what
        # it was before the key existed (NOTE [Spec digest]).
        data = handler(self)
        if isinstance(data, dict) and not data.get("capacity"):
            data.pop("capacity", None)
        return data


#: Field names per model, for did-you-mean suggestions on unknown keys.
FIELDS = {
    "Spec": list(Spec.model_fields),
    "LayerSpec": ["op", "in", "args", "repeat", "output", "outputs", "call", "tie", "init",
                  "checkpoint", "requires_grad"],
    "BlockSpec": list(BlockSpec.model_fields),
    "InputSpec": list(InputSpec.model_fields),
    "AutoPlacementSpec": list(AutoPlacementSpec.model_fields),
    "TrainSpec": list(TrainSpec.model_fields),
    "PipelineSpec": list(PipelineSpec.model_fields),
}
