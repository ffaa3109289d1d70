"""``--set KEY=VALUE``: a ``train:`` setting of the spec changed for one run,
checked as the build checks the spec's, and applied without a rebuild.

A generated script holds its spec's ``train:`` section as data
(``Training.settings``); the code it generates reads the optimizer's, the
losses' and the schedule's keyword arguments from ``args.settings``, which
this module makes: the spec's settings with each ``--set`` applied. A
setting that is also a flag (``steps``, ``batch_size``, ``grad_clip``,
``optimizer.lr``: ``--lr``...) sets the flag. A change the generated code
cannot follow (another loss or optimizer class, another kind of schedule,
the synthetic data's ``dims``) is refused, naming the rebuild to run.

# NOTE: [Overrides checked as the spec]
# The rules here are the spec's (mpgen/spec_schema's pydantic models, the
# front end's compiler/frontend/training.py), restated without pydantic or
# mpgen, which a generated script never imports: the same bounds and
# messages for the plain settings, and for a loss, an optimizer or a
# schedule the same trial the build makes (torch builds it on sample
# parameters and takes one step). tests/runtime/test_settings_as_spec.py
# edits each value into a spec and compares this module's verdict with a
# real build's, so a rule changed on one side alone fails there.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import inspect
import json
import math
import re
import sys
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import lr_scheduler

#: ``train:``'s keys, in the schema's order (TrainSpec's fields).
TRAIN_KEYS = ("loss", "optimizer", "batch_size", "steps", "seed", "log_every", "dims")
TRAIN_KEYS += ("epochs", "scheduler", "grad_clip", "accumulate", "amp", "no_decay")
TRAIN_KEYS += ("data", "eval_data", "eval_every", "eval_split", "samples", "workers")
TRAIN_KEYS += ("metrics", "monitor", "monitor_mode", "keep_last", "early_stop")
#: The keys only a rebuild changes, and what they make.
REBUILT = {"metrics": "the evaluation's code"}
#: The largest size (a batch, the synthetic samples), as the build's.
MOST_SIZE = 2**31 - 1
#: The integer settings: (least, most), None where the spec has no bound.
INTEGERS = {
    "batch_size": (1, None),
    "steps": (1, None),
    "seed": (None, None),
    "log_every": (1, None),
    "epochs": (1, None),
    "accumulate": (1, None),
    "eval_every": (0, None),
    "samples": (1, None),
    "workers": (0, 256),
    "keep_last": (1, None),
    "early_stop": (0, None),
}
#: The settings that may be null (absent in the spec).
NULLABLE = ("epochs", "scheduler", "grad_clip", "data", "eval_data", "monitor")
NULLABLE += ("monitor_mode",)
MONITOR_MODES = ("min", "max")
#: The seeds torch.manual_seed takes.
SEEDS = (-(2**63), 2**64 - 1)
NO_DECAY = ("biases", "norms", "embeddings")
AMP = ("off", "bf16", "fp16")
BUILT_IN = ("cosine", "linear", "constant")
CLASS_LOSSES = ("CrossEntropyLoss", "NLLLoss", "MultiMarginLoss")
PROB_LOSSES = ("BCELoss", "BCEWithLogitsLoss", "KLDivLoss", "MultiLabelSoftMarginLoss")
#: lr_scheduler classes a spec cannot name, and why (the build's words).
REFUSED_SCHEDULERS = {
    "SequentialLR": "chains other schedulers",
    "ChainedScheduler": "chains other schedulers",
    "LambdaLR": "takes a Python function",
    "MultiplicativeLR": "takes a Python function",
    "LRScheduler": "is the base class of the schedules, not one",
}
#: A scheduler's arguments the script passes itself, or that torch deprecates.
SCHEDULER_OWN = ("optimizer", "last_epoch", "verbose")
FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$", re.ASCII)
DATA_SUFFIXES = (".pt", ".pth", ".npz", ".safetensors")
#: How torch's messages name some keywords, to blame the one at fault.
SPELLED = {"lr": "learning rate", "eps": "epsilon", "betas": "beta"}
#: The flags a top-level setting sets (the rest are read from args.settings).
FLAGS = ("steps", "epochs", "batch_size", "seed", "log_every", "grad_clip")
FLAGS += ("accumulate", "amp", "eval_split", "eval_every", "samples", "workers")
FLAGS += ("data", "eval_data", "monitor", "monitor_mode", "keep_last", "early_stop")


class Refused(Exception):
    """A --set the run cannot take: its message, after ``--set KEY=VALUE: ``."""


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, as the build shows values."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 4]}...{text[-1]}"


def did_you_mean(word: str, candidates) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, as the build suggests."""
    pool = [c for c in dict.fromkeys(candidates) if c != word]
    lowered = {c.lower(): c for c in pool}
    if word.lower() in lowered:
        return f" (did you mean {lowered[word.lower()]!r}?)"
    match = difflib.get_close_matches(word, pool, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


# -- VALUE, read as YAML reads a spec's value ---------------------------------

_INT = re.compile(
    r"^(?:[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0o[0-7_]+|[-+]?0b[01_]+)$"
)
_FLOAT = re.compile(
    r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_BOOLS = {w: True for w in "yes Yes YES true True TRUE on On ON".split()}
_BOOLS |= {w: False for w in "no No NO false False FALSE off Off OFF".split()}
_NULLS = ("", "~", "null", "Null", "NULL")


def scalar(text: str) -> Any:
    """A plain YAML scalar as the spec loader resolves it."""
    if text in _NULLS:
        return None
    if text in _BOOLS:
        return _BOOLS[text]
    if _INT.match(text):
        digits = text.replace("_", "")
        sign = -1 if digits.startswith("-") else 1
        digits = digits.lstrip("+-")
        base = {"0x": 16, "0o": 8, "0b": 2}.get(digits[:2], 10)
        return sign * int(digits[2:] if base != 10 else digits, base)
    if _FLOAT.match(text):
        lowered = text.replace("_", "").lower()
        if lowered.endswith((".inf", ".nan")):
            return float(lowered.replace(".", ""))
        return float(lowered)
    return text


def parse_value(text: str) -> Any:
    """VALUE of ``--set KEY=VALUE`` as YAML reads it in a spec: a plain or
    quoted scalar, or a flow list or mapping (``[0.9, 0.95]``, ``{op: StepLR,
    step_size: 10}``). Raises ValueError on what is not such a value."""
    value, end = _flow(text, _skip(text, 0), top=True)
    if _skip(text, end) != len(text):
        raise ValueError(f"unexpected {text[end:].strip()[:20]!r} after the value")
    return value


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t":
        i += 1
    return i


def _flow(text: str, i: int, top: bool = False) -> tuple[Any, int]:
    if i < len(text) and text[i] in "[{":
        close, items, pairs = "]" if text[i] == "[" else "}", [], {}
        i = _skip(text, i + 1)
        while i < len(text) and text[i] != close:
            item, i = _flow(text, i)
            i = _skip(text, i)
            if close == "}":
                if i >= len(text) or text[i] != ":":
                    raise ValueError("a mapping's entry is KEY: VALUE")
                value, i = _flow(text, _skip(text, i + 1))
                pairs[item] = value
            else:
                items.append(item)
            i = _skip(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip(text, i + 1)
            elif i < len(text) and text[i] != close:
                raise ValueError(f"expected ',' or {close!r} at {text[i:][:20]!r}")
        if i >= len(text):
            raise ValueError(f"{close!r} is missing")
        return (pairs if close == "}" else items), i + 1
    if i < len(text) and text[i] in "'\"":
        quote, j, out = text[i], i + 1, []
        while j < len(text):
            if text[j] == quote and quote == "'" and text[j + 1 : j + 2] == "'":
                out.append("'")
                j += 2
            elif text[j] == quote:
                return "".join(out), j + 1
            elif text[j] == "\\" and quote == '"':
                out.append(json.loads(f'"{text[j:j + 2]}"'))
                j += 2
            else:
                out.append(text[j])
                j += 1
        raise ValueError("the closing quote is missing")
    stops = "" if top else ",]}"
    j = i
    while j < len(text) and text[j] not in stops:
        if text[j] == ":" and (j + 1 == len(text) or text[j + 1] in " \t") and not top:
            break
        j += 1
    return scalar(text[i:j].strip()), j


# -- the checks: the spec's rules ----------------------------------------------


def _number(value: Any) -> Optional[float]:
    """``value`` as a finite float, or None (a bool, a string, nan, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _check_integer(key: str, value: Any) -> None:
    least, most = INTEGERS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(f"train.{key}: expected an integer, got {shown(value)}")
    if least is not None and value < least:
        raise Refused(
            f"train.{key}: must be greater than or equal to {least}, got {shown(value)}"
        )
    if most is not None and value > most:
        raise Refused(
            f"train.{key}: must be less than or equal to {most}, got {shown(value)}"
        )
    if key == "batch_size" and value > MOST_SIZE:
        raise Refused(
            f"train.batch_size: {value:,} is larger than the largest size, {MOST_SIZE:,}"
        )
    if key == "samples" and value > MOST_SIZE:
        raise Refused(
            f"train.samples: at most {MOST_SIZE:,} (the largest size), got {shown(value)}"
        )
    if key == "seed" and not SEEDS[0] <= value <= SEEDS[1]:
        raise Refused(
            f"train.seed: {shown(value)} is outside the range torch.manual_seed takes, "
            f"[{SEEDS[0]}, {SEEDS[1]}]"
        )


def _check_plain(key: str, value: Any) -> Any:
    """A top-level setting other than loss, optimizer, scheduler, dims; its
    value as the spec's model holds it."""
    if value is None and key in NULLABLE:
        return None
    if key in INTEGERS:
        _check_integer(key, value)
        return value
    if key == "grad_clip":
        number = _finite(key, value)
        if number <= 0:
            raise Refused(
                "train.grad_clip: the largest gradient norm must be greater than 0, "
                f"got {shown(value)}"
            )
        return number
    if key == "eval_split":
        number = _finite(key, value)
        if not 0 <= number < 1:
            raise Refused(
                f"train.eval_split: the fraction held out must be in [0, 1), got {shown(value)}"
            )
        return number
    if key == "amp":
        if value is False:
            return "off"
        if value not in AMP or not isinstance(value, str):
            hint = did_you_mean(value, AMP) if isinstance(value, str) else ""
            raise Refused(
                f"train.amp: expected one of {', '.join(AMP)}, got {shown(value)}{hint}"
            )
        return value
    if key == "no_decay":
        if not isinstance(value, list):
            raise Refused(f"train.no_decay: expected a list, got {shown(value)}")
        for k, kind in enumerate(value):
            if kind not in NO_DECAY or not isinstance(kind, str):
                hint = did_you_mean(kind, NO_DECAY) if isinstance(kind, str) else ""
                raise Refused(
                    f"train.no_decay[{k}]: expected one of {', '.join(NO_DECAY)}, "
                    f"got {shown(kind)}{hint}"
                )
        twice = [kind for k, kind in enumerate(value) if kind in value[:k]]
        if twice:
            raise Refused(f"train.no_decay: {twice[0]!r} is listed twice")
        return value
    if key in ("data", "eval_data"):
        return _check_data(key, value)
    if key == "monitor":  # its column: check(), given the evaluation's columns
        if not isinstance(value, str):
            raise Refused(f"train.monitor: expected a string, got {shown(value)}")
        return value
    if key == "monitor_mode":
        if value not in MONITOR_MODES or not isinstance(value, str):
            raise Refused(
                f"train.monitor_mode: expected 'min' or 'max', got {shown(value)}"
            )
        return value
    raise AssertionError(key)


def _finite(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"train.{key}: expected a number, got {shown(value)}")
    number = _number(value)
    if number is None:
        raise Refused(f"train.{key}: expected a finite number, got {shown(value)}")
    return number


def _check_data(key: str, value: Any) -> Any:
    forms = (
        "a file like data/train.npz, a factory 'package.module:function', or "
        "{factory: 'package.module:function', KEYWORD: VALUE, ...}"
    )
    if isinstance(value, dict):
        text = value.get("factory", value.get("path"))
    elif isinstance(value, str):
        text = value
    else:
        raise Refused(f"train.{key}: expected {forms}, got {shown(value)}")
    if not isinstance(text, str):
        raise Refused(f"train.{key}: expected {forms}, got {shown(value)}")
    if FACTORY.match(text):
        return value
    if "\0" in text or "\n" in text or "\r" in text:
        raise Refused(
            f"train.{key}: a data file's path has no NUL or line break, got {shown(text)}"
        )
    if not text.endswith(DATA_SUFFIXES):
        raise Refused(
            f"train.{key}: a data file ends in {', '.join(DATA_SUFFIXES[:-1])} or "
            f"{DATA_SUFFIXES[-1]}, got {shown(text)} (a factory is written "
            "'package.module:function')"
        )
    return value


def _class(op: Any, module: Any, what: str) -> Any:
    """The class ``op`` names: in ``module`` (torch.nn, torch.optim), or a
    user's by its dotted path (the script imported its module already);
    Refused for a name the build would not know (``what``: "loss" or
    "optimizer")."""
    if not isinstance(op, str):
        raise Refused(f"train.{what}: op: expected a string, got {shown(op)}")
    if "." in op:
        name, _, attr = op.rpartition(".")
        return getattr(importlib.import_module(name), attr)
    names = loss_names() if what == "loss" else optimizer_names()
    if op not in names:
        raise Refused(f"train.{what}: unknown {what} {op!r}{did_you_mean(op, names)}")
    return getattr(module, op)


def loss_names() -> list[str]:
    """torch.nn's losses, as the build names them."""
    return [
        n for n in dir(nn) if n.endswith("Loss") and inspect.isclass(getattr(nn, n))
    ]


def optimizer_names() -> list[str]:
    """torch.optim's optimizers, as the build names them."""
    return sorted(
        n
        for n in dir(torch.optim)
        if inspect.isclass(getattr(torch.optim, n))
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    )


def scheduler_names() -> list[str]:
    """The lr_scheduler classes a spec may name."""
    return sorted(
        name
        for name, cls in vars(lr_scheduler).items()
        if inspect.isclass(cls)
        and not name.startswith("_")
        and cls.__module__ == lr_scheduler.__name__
        and (issubclass(cls, lr_scheduler.LRScheduler) or name == "ReduceLROnPlateau")
        and name not in REFUSED_SCHEDULERS
    )


def _signature(cls: type) -> tuple[list[str], bool]:
    """``cls.__init__``'s keyword names, and whether it takes ``**kwargs``."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return [], True
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in params if p.kind in kinds]
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _quietly(make: Callable, kwargs: dict) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(kwargs)


def _trial(what: str, kwargs: dict, make: Callable, failure: str) -> Any:
    """``make(kwargs)``, or Refused ``WHAT FAILURE with KEY=VALUE: torch's
    message``, blaming the keyword torch names, else the first without which
    it works (as the build does)."""
    try:
        return _quietly(make, kwargs)
    except Exception as exc:  # whatever torch raises for a bad value
        lines = str(exc).strip().splitlines()
        text = lines[0] if lines else type(exc).__name__
        blamed = None
        for key in kwargs:
            words = (key, SPELLED.get(key, key))
            if any(re.search(rf"\b{re.escape(w)}\b", text) for w in words):
                blamed = key
                break
        if blamed is None:
            for key in kwargs:
                try:
                    _quietly(make, {k: v for k, v in kwargs.items() if k != key})
                except Exception:  # noqa: BLE001 - still failing: not this one alone
                    continue
                blamed = key
                break
        given = "" if blamed is None else f" with {blamed}={shown(kwargs[blamed])}"
        raise Refused(f"{what} {failure}{given}: {text}") from None


def _sample_params() -> list:
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(3))]
    for param in params:
        param.grad = torch.ones_like(param)
    return params


def _sample_optimizer(cls: type, kwargs: dict, groups: bool = False):
    params = _sample_params()
    if groups:
        split = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}]
        return cls(split, **kwargs)
    return cls(params, **kwargs)


def _sample_step(cls: type, kwargs: dict) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k != "capturable"}
    calls = iter(range(5))

    class Evaluated(Exception):
        pass

    def closure() -> torch.Tensor:
        if next(calls, None) is None:
            raise Evaluated
        return torch.zeros(())

    try:
        _sample_optimizer(cls, kwargs).step(closure)
    except Evaluated:
        pass


def _check_optimizer(optimizer: dict) -> tuple[type, float]:
    """train.optimizer's keywords, as the build checks them; its class and lr."""
    op = optimizer["op"]
    cls = _class(op, torch.optim, "optimizer")
    names, var = _signature(cls)
    allowed = [n for n in names if n != "params"]
    kwargs = {k: v for k, v in optimizer.items() if k != "op"}
    for key, value in kwargs.items():
        if key not in allowed and not var:
            raise Refused(
                f"train.optimizer: unknown keyword argument {key!r} for {op}"
                f"{did_you_mean(key, allowed)}"
            )
        if key == "lr" and (
            isinstance(value, bool) or not isinstance(value, (int, float))
        ):
            raise Refused("train.optimizer.lr: expected a number")
        if key == "lr" and _number(value) is None:
            raise Refused(
                f"train.optimizer.lr: expected a finite number, got {shown(value)}"
            )
    default = inspect.signature(cls.__init__).parameters.get("lr")
    default_lr = (
        float(default.default)
        if default is not None and isinstance(default.default, (int, float))
        else 0.01
    )
    what = f"train.optimizer: {op}"
    made = lambda given: _sample_optimizer(
        cls, {"lr": default_lr, **given}
    )  # noqa: E731
    _trial(what, kwargs, made, "cannot be built")
    step = lambda given: _sample_step(cls, {"lr": default_lr, **given})  # noqa: E731
    _trial(what, kwargs, step, "cannot take a step")
    lr = _number(kwargs["lr"]) if "lr" in kwargs else default_lr
    return cls, lr


def _sample_batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    if kind == "classes":
        return torch.randn(2, 3, generator=generator), torch.tensor([0, 2])
    if kind == "probabilities":
        return torch.rand(2, 3, generator=generator), torch.rand(
            2, 3, generator=generator
        )
    return torch.randn(2, 3, generator=generator), torch.randn(
        2, 3, generator=generator
    )


def _check_loss(loss: dict) -> None:
    """One loss's keywords, as the build checks them: known to the class,
    built, computed on a sample to one number."""
    op = loss["op"]
    cls = _class(op, nn, "loss")
    names, var = _signature(cls)
    kwargs = {k: v for k, v in loss.items() if k not in ("op", "class_dim")}
    for key in kwargs:
        if key not in names and not (var and "." in op):
            raise Refused(
                f"train.loss: unknown keyword argument {key!r} for {op}"
                f"{did_you_mean(key, names)}"
            )
    what = f"train.loss: {op}"
    _trial(what, kwargs, lambda given: cls(**given), "cannot be built")
    if "." in op:  # a user's loss: the build tried its kinds of target
        return
    kind = (
        "classes"
        if op in CLASS_LOSSES
        else "probabilities" if op in PROB_LOSSES else "like_output"
    )
    compute = lambda given: cls(**given)(*_sample_batch(kind))  # noqa: E731
    value = _trial(what, kwargs, compute, "cannot be computed")
    if value.dim() != 0:
        given = [
            f"{key}={shown(kwargs[key])}"
            for key in ("reduction", "reduce")
            if key in kwargs
        ]
        raise Refused(
            f"train.loss: {op}({', '.join(given)}) gives a loss per element, not the one "
            "number the training script minimises; use reduction 'mean' or 'sum'"
        )


def _kind_of(default: Any) -> Optional[str]:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (int, float)):
        return "a number"
    if isinstance(default, str):
        return "a string"
    return None


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "a number" and isinstance(value, list):
        return bool(value) and all(_is_kind(item, kind) for item in value)
    if isinstance(value, bool):
        return kind == "true or false"
    if isinstance(value, (int, float)):
        return kind == "a number"
    return isinstance(value, str) and kind == "a string"


def _check_scheduler(scheduler: dict, optimizer: Callable) -> None:
    """train.scheduler, as the build checks it; ``optimizer()`` makes the
    spec's optimizer over sample parameters, for a torch class's trial."""
    op, warmup = scheduler["op"], scheduler.get("warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise Refused(
            f"train.scheduler.warmup: expected an integer, got {shown(warmup)}"
        )
    if warmup < 0:
        raise Refused(
            f"train.scheduler.warmup: must be greater than or equal to 0, got {shown(warmup)}"
        )
    kwargs = {k: v for k, v in scheduler.items() if k not in ("op", "warmup")}
    if op in BUILT_IN:
        for key, value in kwargs.items():
            if key != "min_lr":
                raise Refused(
                    f"train.scheduler: unknown keyword {key!r} for the built-in schedule "
                    f"{op!r}, which takes warmup and min_lr"
                    f"{did_you_mean(key, ('warmup', 'min_lr'))}"
                )
            number = _number(value)
            if number is None or number < 0:
                raise Refused(
                    f"train.scheduler.min_lr: expected a finite number >= 0, got {shown(value)}"
                )
        return
    if op in REFUSED_SCHEDULERS:
        raise Refused(
            f"train.scheduler: {op} {REFUSED_SCHEDULERS[op]}, which a spec cannot write; use "
            "a built-in schedule (cosine, linear, constant) or another "
            "torch.optim.lr_scheduler class (warmup: N adds a linear warmup to any of them)"
        )
    if op not in scheduler_names():
        raise Refused(
            f"train.scheduler: unknown schedule {op!r}; expected cosine, linear, constant or "
            "a torch.optim.lr_scheduler class"
            f"{did_you_mean(op, [*BUILT_IN, *scheduler_names()])}"
        )
    cls = getattr(lr_scheduler, op)
    names, _ = _signature(cls)
    allowed = [n for n in names if n not in SCHEDULER_OWN]
    for key in kwargs:
        if key not in allowed:
            hint = did_you_mean(key, [*allowed, "warmup"])
            if not hint and key == "min_lr":
                hint = " (min_lr is for the built-in schedules)"
            raise Refused(
                f"train.scheduler: unknown keyword argument {key!r} for {op}{hint}"
            )
    if op == "ReduceLROnPlateau" and warmup:
        raise Refused(
            "train.scheduler: ReduceLROnPlateau steps on a loss, so it cannot follow a "
            "warmup (torch's SequentialLR steps without one); drop warmup, or use a "
            "built-in schedule with warmup"
        )
    defaults = inspect.signature(cls.__init__).parameters
    for key, value in kwargs.items():
        expected = _kind_of(defaults[key].default)
        if expected is not None and not _is_kind(value, expected):
            raise Refused(
                f"train.scheduler: {op}'s {key} is {expected} (default "
                f"{shown(defaults[key].default)}), got {shown(value)}"
            )
    what = f"train.scheduler: {op}"
    _trial(what, kwargs, lambda given: cls(optimizer(), **given), "cannot be built")

    def step(given: dict) -> None:
        made = cls(optimizer(), **given)
        (
            made.step(1.0)
            if isinstance(made, lr_scheduler.ReduceLROnPlateau)
            else made.step()
        )

    _trial(what, kwargs, step, "cannot take a step")


def check_names(settings: dict) -> None:
    """Refused where a loss, the optimizer or the schedule is not one the
    build knows (with its did-you-mean)."""
    losses = settings["loss"]
    for loss in losses.values() if "op" not in losses else [losses]:
        if isinstance(loss, dict):
            _class(loss.get("op"), nn, "loss")
    _class(settings["optimizer"].get("op"), torch.optim, "optimizer")
    op = (settings.get("scheduler") or {}).get("op", "cosine")
    if op in REFUSED_SCHEDULERS:
        _check_scheduler(settings["scheduler"], lambda: None)
    if op not in (*BUILT_IN, *scheduler_names()):
        hint = did_you_mean(str(op), [*BUILT_IN, *scheduler_names()])
        raise Refused(
            f"train.scheduler: unknown schedule {op!r}; expected cosine, linear, constant or "
            f"a torch.optim.lr_scheduler class{hint}"
        )


def check(
    settings: dict, symbols: tuple = (), devices: tuple = (), columns: tuple = ()
) -> None:
    """Raise Refused where ``settings`` (a ``train:`` section, as
    ``Training.settings`` holds one) is not what the spec accepts;
    ``symbols``: the symbolic dims of the model's inputs (train.dims' keys),
    ``devices``: the model's, ``columns``: its evaluation's (what
    ``monitor`` may name)."""
    for name, size in (settings.get("dims") or {}).items():
        if name not in symbols:
            raise Refused(
                f"train.dims: {name!r} is not a symbolic dim of the inputs"
                f"{did_you_mean(name, symbols)}"
            )
        if isinstance(size, bool) or not isinstance(size, int):
            raise Refused(f"train.dims.{name}: expected an integer, got {shown(size)}")
        if size < 1:
            raise Refused(
                f"train.dims.{name}: must be greater than or equal to 1, got {shown(size)}"
            )
    for key in TRAIN_KEYS:
        if key in settings and key not in ("loss", "optimizer", "scheduler", "dims"):
            settings[key] = _check_plain(key, settings[key])
    losses = settings["loss"]
    for loss in losses.values() if "op" not in losses else [losses]:
        _check_loss(loss)
    cls, lr = _check_optimizer(settings["optimizer"])
    kwargs = {k: v for k, v in settings["optimizer"].items() if k not in ("op", "lr")}
    no_decay = settings.get("no_decay") or []
    groups = bool(no_decay) and "weight_decay" in _signature(cls)[0]
    if settings.get("scheduler") is not None:
        made = lambda: _sample_optimizer(
            cls, {"lr": lr, **kwargs}, groups
        )  # noqa: E731
        _check_scheduler(settings["scheduler"], made)
    name = settings["optimizer"]["op"]
    if no_decay:
        param = inspect.signature(cls.__init__).parameters.get("weight_decay")
        decay = kwargs.get("weight_decay", param and param.default)
        if param is None:
            raise Refused(
                f"train.no_decay: {name} has no weight decay to keep parameters out of; "
                "use an optimizer with weight_decay, such as AdamW"
            )
        if _number(decay) == 0:
            said = "is 0" if "weight_decay" in kwargs else "defaults to 0"
            raise Refused(
                f"train.no_decay: {name}'s weight_decay {said}, so no parameter decays; "
                "set train.optimizer.weight_decay (nanoGPT uses 0.1)"
            )
    if settings["optimizer"].get("capturable") and "cpu" in devices:
        raise Refused(
            f"train.optimizer: {name} with capturable keeps its step on a GPU, but parameters "
            "are on cpu; drop capturable, or place every layer with parameters on a GPU"
        )
    if settings.get("eval_data") is not None and settings.get("eval_split", 0) > 0:
        raise Refused(
            "train.eval_split: the evaluation data is train.eval_data; hold out a split "
            "only without it"
        )
    monitor = settings.get("monitor")
    if monitor is not None and columns and monitor not in columns:
        raise Refused(
            f"train.monitor: {monitor!r} is not a column of the evaluation"
            f"{did_you_mean(monitor, columns)}; it has {', '.join(columns)}"
        )
    if monitor is not None and settings.get("monitor_mode") is None:
        from .monitor import mode_of

        if mode_of(monitor) is None:
            raise Refused(
                f"train.monitor: the name {monitor!r} does not say whether lower or higher "
                "is better; add monitor_mode: min or monitor_mode: max"
            )
    closure = "closure" in inspect.signature(cls.step).parameters and (
        inspect.signature(cls.step).parameters["closure"].default is inspect._empty
    )
    if closure and settings.get("amp") == "fp16":
        raise Refused(
            f"train.amp: fp16 scales the loss with a GradScaler, which cannot step {name} "
            "(its step evaluates a closure); use bf16 or off"
        )
    if closure and settings.get("accumulate", 1) > 1:
        raise Refused(
            f"train.accumulate: {name} evaluates the loss itself, several times a step "
            "(a closure), so micro-batches cannot be accumulated; use accumulate: 1 and "
            "a larger batch_size"
        )


# -- KEY: where it goes, and what the generated code can follow -------------------


class Rebuild(Exception):
    """A --set the generated code cannot follow: what it would change."""


def changed(settings: dict, key: str, value: Any) -> dict:
    """``settings`` with the dotted ``key`` set to ``value``; Refused for a
    key the spec does not have (with the build's did-you-mean)."""
    parts = key.split(".")
    new = copy.deepcopy(settings)
    if parts[0] not in TRAIN_KEYS:
        raise Refused(
            f"unknown key {parts[0]!r} in train{did_you_mean(parts[0], TRAIN_KEYS)}"
        )
    if parts[0] in REBUILT:
        raise Rebuild(f"it changes train.{parts[0]} ({REBUILT[parts[0]]})")
    losses = settings.get("loss") or {}
    if (
        parts[0] == "loss" and len(parts) > 1 and "op" not in losses
    ):  # a loss per output
        if parts[1] not in losses:
            hint = did_you_mean(parts[1], losses)
            if not hint:  # an output without a loss, or none at all: the build knows
                raise Rebuild("it changes train.loss's outputs")
            raise Refused(f"train.loss: {parts[1]!r} is not an output{hint}")
        if len(parts) == 2:
            value = call(value)
    node, path = new, []
    for part in parts[:-1]:
        path.append(part)
        child = node.get(part)
        if child is None and path == ["scheduler"]:
            raise Rebuild("it adds train.scheduler")
        if isinstance(child, str) and path[0] in ("loss", "optimizer", "scheduler"):
            child = node[part] = {"op": child}
        if not isinstance(child, dict):
            where = ".".join(path)
            raise Refused(f"train.{where} is {shown(child)}, not a mapping with keys")
        node = child
    node[parts[-1]] = value
    return new


def call(value: Any) -> Any:
    """A loss's, optimizer's or schedule's ``Name`` as ``{op: Name}``."""
    return {"op": value} if isinstance(value, str) else value


def need_rebuild(before: dict, after: dict) -> Optional[str]:
    """What of ``after`` the code built from ``before`` cannot run, or None."""
    if after.get("dims", {}) != before.get("dims", {}):
        return "train.dims (the synthetic data's sizes)"
    b, a = before["loss"], after["loss"]
    if ("op" in b) != ("op" in a) or ("op" not in b and set(b) != set(a)):
        return "train.loss's outputs"
    for one, other in zip(
        [b] if "op" in b else b.values(), [a] if "op" in a else a.values()
    ):
        for part in ("op", "class_dim", "ignore_index"):
            if one.get(part) != other.get(part):
                return f"train.loss's {part} (the code that computes the loss)"
    if before["optimizer"]["op"] != after["optimizer"]["op"]:
        return "train.optimizer's class"
    if bool(before.get("no_decay")) != bool(after.get("no_decay")):
        return "train.no_decay (the optimizer's parameter groups)"
    b, a = before.get("scheduler"), after.get("scheduler")
    if (b is None) != (a is None):
        return "train.scheduler"
    if b is not None:
        if (b["op"] in BUILT_IN) != (a["op"] in BUILT_IN):
            return "train.scheduler's kind"
        if b["op"] not in BUILT_IN and (
            b["op"] != a["op"] or bool(b.get("warmup")) != bool(a.get("warmup"))
        ):
            return "train.scheduler's class or warmup"
    for key in ("data", "eval_data"):
        b, a = before.get(key), after.get(key)
        if isinstance(a, dict) and a != b:
            return f"train.{key}'s factory arguments"
    return None


def keywords(call: dict, *own: str) -> dict:
    """A loss's, optimizer's or schedule's keyword arguments: its settings
    but ``op`` and those the script passes itself (``own``)."""
    return {k: v for k, v in call.items() if k != "op" and k not in own}


def flag_value(key: str, value: Any) -> Any:
    """What the flag a top-level setting sets takes for ``value``."""
    if key == "grad_clip":
        return float(value or 0.0)
    if key == "eval_split":
        return float(value)
    if key in ("data", "eval_data") and isinstance(value, dict):
        return value.get("factory", value.get("path"))
    return value


# -- the run's settings: args.settings, args.overrides ----------------------------


def _given(parser, argv: Optional[list]) -> set:
    """The flags given on the command line (their dests), not defaulted."""
    saved = [(action, action.default) for action in parser._actions]
    for action, _ in saved:
        action.default = argparse.SUPPRESS
    try:
        found, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(found))


def flatten(settings: dict, prefix: str = "") -> dict:
    """``{"optimizer.weight_decay": 0.05, ...}``: each setting by its dotted key."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def apply(parser, args, training, pipeline: bool = False, argv=None) -> None:
    """Check each ``--set KEY=VALUE`` (``args.set``) as the build checks the
    spec and apply it: a setting that is a flag sets it, the others go into
    ``args.settings``, the run's ``train:`` settings (the spec's, each --set
    applied, the flags' values in), which the generated code reads;
    ``args.overrides``: ``["KEY=VALUE", ...]`` as given. One usage line
    (exit 2) for a bad one, naming it, or for one the generated code cannot
    follow, naming the rebuild to run."""

    def refuse(item: str, message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: --set {item}: {message}\n")

    if not training.settings:  # a Training written without them
        if getattr(args, "set", None):
            parser.error(f"--set: {training.name}'s script holds no train: settings")
        args.settings, args.overrides = {}, []
        return
    spec = copy.deepcopy(training.settings)
    settings, overrides, set_keys = copy.deepcopy(spec), [], {}
    for item in getattr(args, "set", None) or []:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            refuse(item, "expected KEY=VALUE, like optimizer.weight_decay=0.05")
        try:
            value = parse_value(text)
        except ValueError as error:
            refuse(item, f"VALUE is read as YAML: {error}")
        if key.split(".")[0] in ("loss", "optimizer", "scheduler"):
            value = call(value) if key.count(".") == 0 else value
        try:
            new = changed(settings, key, value)
            why = need_rebuild(spec, new)
            check_names(new)
            # as far as this script's torch can try it
            check(
                new, symbols(training), training.devices, tuple(training.eval_metrics)
            )
            if why is not None:
                raise Rebuild(f"it changes {why}")
        except Refused as error:
            refuse(item, str(error))
        except Rebuild as error:
            refuse(item, _rebuild(training, str(error)))
        if pipeline and new.get("amp") == "fp16":
            refuse(
                item,
                "the pipeline program autocasts to bf16 or not at all (fp16 would "
                "need a gradient scaler spanning the ranks)",
            )
        settings, set_keys[key] = new, item
        overrides.append(f"{key}={text.strip()}")
    given = _given(parser, argv) if set_keys else set()
    sets = {k.split(".")[0] for k in set_keys}
    for key in FLAGS:
        if key in sets and key in vars(args):
            if key in given and getattr(args, key) != flag_value(key, settings[key]):
                flag = f"--{key.replace('_', '-')}"
                refuse(
                    set_keys[next(k for k in set_keys if k.split(".")[0] == key)],
                    f"{flag} {getattr(args, key)} sets train.{key} too; give one",
                )
            setattr(args, key, flag_value(key, settings[key]))
    # A built-in schedule's length is the spec's steps, unless --decay-steps is given.
    if "steps" in sets and "decay_steps" in vars(args) and "decay_steps" not in given:
        args.decay_steps = settings["steps"]
    if "optimizer.lr" in set_keys or "optimizer" in set_keys:
        lr = settings["optimizer"].get("lr")
        if (
            lr is None
        ):  # a whole optimizer without lr: the class's default, as in a spec
            lr = _check_optimizer(settings["optimizer"])[1]
        if "lr" in given and lr is not None and float(lr) != args.lr:
            refuse(
                set_keys.get("optimizer.lr", set_keys.get("optimizer")),
                f"--lr {args.lr} sets train.optimizer.lr too; give one",
            )
        if lr is not None:
            args.lr = float(lr)
    for key in FLAGS:  # the run's values, whatever set them
        if key in vars(args):
            value = getattr(args, key)
            settings[key] = (value or None) if key == "grad_clip" else value
    settings["optimizer"]["lr"] = args.lr
    args.settings, args.overrides = settings, overrides


def symbols(training) -> tuple:
    """The symbolic dims of the model's inputs, as their shapes name them."""
    shapes = training.shapes[: len(training.inputs)]
    found = [d for shape in shapes for d in shape if isinstance(d, str)]
    return tuple(dict.fromkeys(d for d in found if d.isidentifier()))


def _rebuild(training, why: str) -> str:
    """The refusal of a change the generated code cannot follow, with the
    rebuild to run: never into the folder of the committed scripts."""
    return (
        f"{why}, which needs code the build writes; write it in {training.spec}'s train: "
        f"and run mpgen train {training.spec} -- ARGS (or build it apart: mpgen build "
        f"{training.spec} -o build/{training.run})"
    )


def record(args) -> dict:
    """What a checkpoint keeps of the run's settings (plain data)."""
    return {"settings": args.settings, "overrides": list(args.overrides)}


def on_resume(saved: Optional[dict], args) -> list[str]:
    """The lines --resume says of the settings: each one set by --set in
    either run whose value differs between the checkpoint's run and this
    one (this run's applies: the optimizer's hyperparameters are set again
    after its state is loaded, see :func:`reapply`)."""
    if not saved:
        return []
    before, now = flatten(saved["settings"]), flatten(args.settings)
    keys = [o.partition("=")[0] for o in [*saved["overrides"], *args.overrides]]
    lines = []
    for key in dict.fromkeys(keys):
        touched = [k for k in now if k == key or k.startswith(key + ".")]
        for k in touched or [key]:
            if before.get(k) != now.get(k):
                lines.append(
                    f"--resume: {k} is {shown(now.get(k))} in this run, "
                    f"{shown(before.get(k))} in the checkpoint's"
                )
    return lines


def reapply(optimizer, fresh: list[dict], saved: Optional[dict], args) -> None:
    """After ``optimizer.load_state_dict``, which brings back the
    checkpoint's hyperparameters: this run's, from ``fresh`` (the groups'
    before the load), for each of train.optimizer's keywords whose value
    differs from the checkpoint's run (``saved``: its record); the learning
    rate stays the schedule's."""
    if not saved or optimizer is None:
        return
    before = saved["settings"].get("optimizer", {})
    now = args.settings.get("optimizer", {})
    keys = [k for k in {**before, **now} if k not in ("op", "lr")]
    for group, made in zip(optimizer.param_groups, fresh):
        for key in keys:
            if before.get(key) != now.get(key) and key in made:
                group[key] = made[key]


def hyperparameters(optimizer) -> list[dict]:
    """The optimizer's groups' settings, to :func:`reapply` after a load."""
    if optimizer is None:
        return []
    return [
        {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def schedule_state(scheduler) -> Optional[dict]:
    """A schedule's state before a load, to :func:`reapply_schedule` after."""
    return None if scheduler is None else copy.deepcopy(scheduler.state_dict())


def reapply_schedule(
    scheduler, fresh: Optional[dict], saved: Optional[dict], args
) -> None:
    """After ``scheduler.load_state_dict``, which brings back a torch
    class's arguments (they are its state): this run's, from ``fresh``
    (its state before the load), for each of train.scheduler's keys whose
    value differs from the checkpoint's run; a changed warmup is its
    SequentialLR's milestone and its LinearLR's length. (A built-in
    schedule reads args.settings itself.)"""
    if not saved or scheduler is None or fresh is None:
        return
    before = saved["settings"].get("scheduler") or {}
    now = args.settings.get("scheduler") or {}
    keys = [k for k in {**before, **now} if k != "op" and before.get(k) != now.get(k)]
    pairs = [(scheduler, fresh)]
    if getattr(scheduler, "_schedulers", None):  # SequentialLR: [warmup, the class]
        pairs += list(zip(scheduler._schedulers, fresh["_schedulers"]))
    for key in keys:
        names = (
            ("_milestones", "total_iters", "start_factor")
            if key == "warmup"
            else (key,)
        )
        for made, state in pairs:
            for name in names:
                if name in state and name in vars(made):
                    setattr(made, name, copy.deepcopy(state[name]))
