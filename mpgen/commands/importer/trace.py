"""The trace of ``mpgen import``: the command line's values, the user's class
built, and its ``forward`` traced with torch.fx and run once on sample
inputs, so that every node's value is known (a tensor, a tuple of tensors,
or a size); errors point at the user's source line."""

from __future__ import annotations

import importlib
import inspect
import json
import linecache
import math
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn

from mpgen.compiler.frontend.limits import MAX_RANK
from mpgen.errors import MpgenError, Position, did_you_mean
from mpgen.spec_schema.models import DTYPES, MAX_DIM  # the input dtypes of the spec language

#: Sizes of symbolic dims in the sample run that tells tensors from sizes.
SAMPLE_BATCH, SAMPLE_DIM = 2, 16
#: Elements of one sample input (symbolic dims at their sample sizes): the
#: trace runs the model on real tensors of these sizes, so this is memory
#: allocated now (1 GiB of float32), well below what the spec's limits allow
#: at the training sizes (``limits.MAX_ELEMENTS``).
MAX_SAMPLE_ELEMENTS = 1 << 28


# -- the command line's values -------------------------------------------------

@dataclass(frozen=True)
class InputSpec:
    """``--input NAME=D0,D1,...[:DTYPE]``."""

    name: str
    dims: tuple[Union[int, str], ...]
    dtype: str = "float32"

    def sample_sizes(self) -> list[int]:
        """The sizes of the sample run: symbolic dims at their sample sizes."""
        return [d if isinstance(d, int) else SAMPLE_BATCH if d == "batch" else SAMPLE_DIM
                for d in self.dims]

    def sample(self) -> torch.Tensor:
        sizes = self.sample_sizes()
        dtype = getattr(torch, self.dtype)
        if dtype.is_floating_point:
            return torch.randn(sizes, generator=torch.Generator().manual_seed(0)).to(dtype)
        return torch.zeros(sizes, dtype=dtype)  # index 0 is valid for any embedding


def parse_input(text: str) -> InputSpec:
    """``x=batch,3,32,32`` or ``idx=batch,seq:int64``; raises MpgenError."""
    name, eq, rest = text.partition("=")
    shape, colon, dtype = rest.partition(":")
    usage = f"--input {text!r}: expected NAME=D0,D1,... with optional :DTYPE, like x=batch,3,32,32"
    if not eq or not name.isidentifier() or not shape:
        raise MpgenError(None, usage)
    dims: list[Union[int, str]] = []
    parts = shape.split(",")
    if len(parts) > MAX_RANK:  # every CLI size is bounded before a tensor is made
        raise MpgenError(None, f"--input {_short(text)}: {len(parts)} dims; an input has at "
                               f"most {MAX_RANK}")
    for part in parts:
        part = part.strip()
        number = part.isascii() and part.isdigit()  # not "²", which int() refuses
        if number and (len(part) > 12 or int(part) > MAX_DIM):
            raise MpgenError(None, f"--input {_short(text)}: the size {_short(part, 20)} is "
                                   f"larger than {MAX_DIM:,}, the most a dim may be")
        if number and int(part) >= 1:
            dims.append(int(part))
        elif part.isidentifier():
            dims.append(part)
        else:
            raise MpgenError(None, f"--input {text!r}: {part!r} is not a size (an integer "
                                   f">= 1) or a symbolic dim (a name such as batch)")
    if colon and dtype not in DTYPES:
        raise MpgenError(None, f"--input {text!r}: unknown dtype {dtype!r}"
                               f"{did_you_mean(dtype, DTYPES)}; one of {', '.join(DTYPES)}")
    found = InputSpec(name, tuple(dims), dtype if colon else "float32")
    elements = math.prod(found.sample_sizes())
    if elements > MAX_SAMPLE_ELEMENTS:
        raise MpgenError(None, f"--input {_short(text)}: the sample input holds {elements:,} "
                               f"elements (symbolic dims at {SAMPLE_BATCH} for batch, "
                               f"{SAMPLE_DIM} for others); the trace allows at most "
                               f"{MAX_SAMPLE_ELEMENTS:,}; give smaller sizes or fewer dims")
    return found


def failure(exc: BaseException, most: int = 500) -> str:
    """``Type: message`` of an exception from the user's code or torch, in
    one line: the first of its message, cut to about ``most`` characters
    (torch's C++ errors carry a stack of frames after it)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= most else text[:most] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _short(text: str, most: int = 80) -> str:
    """``text`` as a message quotes it, cut to about ``most`` characters."""
    return repr(text if len(text) <= most else text[:most] + "...")


def load_module(target: str, args_json: Optional[str] = None,
                config_json: Optional[str] = None) -> nn.Module:
    """Import ``MODULE:NAME`` (the working directory first on ``sys.path``,
    as the generated training script finds ``module:function`` data) and
    build the model: ``NAME(**args)`` (a JSON object) or ``NAME(*args)`` (a
    list), where NAME is an ``nn.Module`` class or a function returning one
    (``torchvision.models:vit_b_16``); with ``config_json``, a Hugging Face
    class built from its configuration, ``NAME(NAME.config_class(**config))``."""
    module_name, colon, class_name = target.partition(":")
    if not colon or not class_name.isidentifier() or not all(
            p.isidentifier() for p in module_name.split(".")):
        raise MpgenError(None, f"{target!r}: expected MODULE:CLASS, like mymodels.resnet:ResNet, "
                               "or MODULE:FUNCTION, like torchvision.models:resnet50")
    args = _json_args(args_json) if args_json is not None else {}
    if not isinstance(args, (dict, list)):
        raise MpgenError(None, "--args: expected a JSON object (keyword arguments) or a "
                               "list (positional arguments)")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's code: any failure is theirs to see
        raise MpgenError(None, f"{target}: cannot import {module_name!r}: "
                               f"{broken_package(exc) or failure(exc)}") from None
    try:
        cls = getattr(module, class_name, None)
    except Exception as exc:  # a library's lazy attribute that fails to import
        raise MpgenError(None, f"{target}: cannot import {class_name!r} from {module_name}: "
                               f"{broken_package(exc) or failure(exc)}") from None
    is_class = inspect.isclass(cls) and issubclass(cls, nn.Module)
    if not (is_class or (inspect.isfunction(cls) and not inspect.isclass(cls))):
        names = [n for n, v in vars(module).items()
                 if (inspect.isclass(v) and issubclass(v, nn.Module)) or inspect.isfunction(v)]
        raise MpgenError(None, f"{target}: {module_name} has no nn.Module class or function "
                               f"{class_name!r}{did_you_mean(class_name, names)}")
    if config_json is not None:
        args = _config_args(target, cls, config_json, args)
    try:
        built = cls(**args) if isinstance(args, dict) else cls(*args)
    except Exception as exc:
        where = _user_frame(exc)
        raise MpgenError(where, f"{class_name}({shown_args(args)}) failed: "
                                f"{failure(exc)}") from None
    if not isinstance(built, nn.Module):
        raise MpgenError(None, f"{target}: {class_name}({shown_args(args)}) returned "
                               f"{type(built).__name__}, not an nn.Module")
    return built


# NOTE: [Broken packages]
# A library's model fails to import when a package it imports fails in its
# own module body: transformers imports torchvision, and a torchvision built
# for another torch raises "operator torchvision::nms does not exist" there.
# transformers then reports only that the class "could not be imported". The
# cause is the innermost module body running in the exception's chain; it is
# named with its version, its error's last line, and the usual fix for that
# error. A module of the project is the user's code: its error is shown as
# it is.

def broken_package(exc: BaseException) -> Optional[str]:
    """The installed package whose import raised under ``exc`` (NOTE [Broken
    packages]), its error and the likely fix, in one line; None when no
    package's module body raised (a name that is not there) or the module is
    the project's."""
    failed = _failed_module(exc)
    if failed is None or _in_project(failed[1]):
        return None
    package, inner = failed[0].partition(".")[0], failed[2]
    version = _version(package)
    named = f"{package} {version}" if version else package
    return f"the package {named} fails to import: {failure(inner)}; " \
           f"{_likely_fix(package, named, inner)}"


def _failed_module(exc: BaseException) -> Optional[tuple[str, str, BaseException]]:
    """``(module, file, error)``: the innermost module body running where an
    exception of ``exc``'s chain (causes first) was raised."""
    chain: list[BaseException] = []
    link: Optional[BaseException] = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    for link in reversed(chain):
        found = None
        frames = link.__traceback__
        while frames is not None:
            code, name = frames.tb_frame.f_code, frames.tb_frame.f_globals.get("__name__")
            if code.co_name == "<module>" and name and name != "__main__" \
                    and not code.co_filename.startswith("<"):
                found = (name, code.co_filename, link)
            frames = frames.tb_next
        if found:
            return found
    return None


def _version(package: str) -> Optional[str]:
    """The installed version of the distribution that provides ``package``."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get(package, [package]):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _likely_fix(package: str, named: str, error: BaseException) -> str:
    """What usually mends a package whose import raised ``error``."""
    text = str(error)
    if re.search(r"operator \w+::\w+ does not exist|undefined symbol|"
                 r"\.so[.\d]*: cannot open shared object file", text):
        fix = f"{named} was built for another torch than {torch.__version__}: install the " \
              f"{package} built for this torch"
        minor = re.match(r"2\.(\d+)\.", torch.__version__)
        if package == "torchvision" and minor:  # torchvision 0.(N+15) pairs with torch 2.N
            fix += f" (0.{int(minor[1]) + 15}.x, from the same index as torch)"
        return fix
    missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if missing and missing.partition(".")[0] != package:
        return f"install {missing.partition('.')[0]}, which {package} imports"
    return f"reinstall {package}, or install the versions it needs (`pip check` lists " \
           f"conflicts)"


def _config_args(target: str, cls: Any, config_json: str,
                 args: Union[dict, list]) -> Union[dict, list]:
    """``--config``: the class's configuration (``cls.config_class``), built
    from the JSON object, as the one positional argument. A cache of past
    keys and values is no tensor a spec returns: ``use_cache`` is false
    unless the JSON sets it. A diffusers model (``from_config`` and a
    ``config_name``) registers its constructor's keywords as its
    configuration: the JSON object is those keywords."""
    config_class = getattr(cls, "config_class", None)
    keywords = (config_class is None and inspect.isclass(cls) and hasattr(cls, "from_config")
                and bool(getattr(cls, "config_name", None)))  # a diffusers ConfigMixin
    if not keywords and (config_class is None or not inspect.isclass(cls)):
        raise MpgenError(None, f"{target}: --config builds a Hugging Face model class from "
                               "its configuration; this has no config_class (use --args)")
    if args:
        raise MpgenError(None, "--config and --args: give one of them")
    config = _json_args(config_json)
    if not isinstance(config, dict):
        raise MpgenError(None, "--config: expected a JSON object (the configuration's "
                               "keyword arguments)")
    if keywords:
        return config
    try:
        built = config_class(**config)
    except Exception as exc:
        raise MpgenError(None, f"{config_class.__name__}({shown_args(config)}) failed: "
                               f"{failure(exc)}") from None
    if "use_cache" not in config and hasattr(built, "use_cache"):
        built.use_cache = False
    return [built]


def default_tracer(target: str, root: Optional[nn.Module] = None) -> str:
    """``dynamo`` for a model of an installed library, or for a class of the
    project that holds one (a wrapper: ``self.body = GPT2Model(config)``),
    their hierarchy kept as blocks; ``fx`` for the project's own classes of
    ``torch.nn`` layers (docs/import.md, "Which tracer")."""
    module = sys.modules.get(target.partition(":")[0])
    if not _in_project(getattr(module, "__file__", None)):
        return "dynamo"
    return "dynamo" if root is not None and library_modules(root) else "fx"


def library_modules(root: nn.Module) -> list[str]:
    """The paths of ``root``'s modules whose class comes from an installed
    package other than torch (transformers, torchvision, timm), not from the
    project: code torch.fx does not follow."""
    found = []
    for path, module in root.named_modules():
        origin = getattr(sys.modules.get(type(module).__module__), "__file__", None)
        if origin and not _in_project(origin) and not _inside(origin, _TORCH_DIR):
            found.append(path)
    return found


def _in_project(file: Optional[str]) -> bool:
    """A source file of the working directory's project: under it, and not in
    an installed package's folder (a virtual environment inside the project)."""
    if not file:
        return False
    path = Path(file).resolve()
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return False
    return Path.cwd().resolve() in path.parents


def _inside(file: str, folder: str) -> bool:
    return str(Path(file).resolve()).startswith(folder + os.sep)


#: How deeply ``--args`` may nest lists and objects (as a spec's YAML).
MAX_ARGS_DEPTH = 64


def _json_args(text: str) -> Any:
    """``--args``, parsed: JSON nested at most MAX_ARGS_DEPTH levels (measured
    before parsing, which recurses once per level), integers within Python's
    digit limit."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    if deepest > MAX_ARGS_DEPTH:
        raise MpgenError(None, f"--args: nested {deepest} levels deep; at most "
                               f"{MAX_ARGS_DEPTH} are supported")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MpgenError(None, f"--args: not JSON: {exc}") from None
    except ValueError:  # an integer of more digits than Python converts
        raise MpgenError(None, f"--args: an integer of more than "
                               f"{sys.get_int_max_str_digits():,} digits") from None


def shown_args(args: Union[dict, list]) -> str:
    if isinstance(args, dict):
        return ", ".join(f"{k}={v!r}" for k, v in args.items())
    return ", ".join(repr(v) for v in args)


# -- where in the user's source ---------------------------------------------------

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _display(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _user_frame(exc: BaseException) -> Optional[Position]:
    """The innermost frame of ``exc``'s traceback outside torch and mpgen."""
    found = None
    mpgen_dir = str(Path(__file__).resolve().parents[2])  # mpgen/
    for frame in traceback.extract_tb(exc.__traceback__):
        where = str(Path(frame.filename).resolve()) if frame.filename else ""
        if _inside(where, _TORCH_DIR) or _inside(where, mpgen_dir) or not frame.lineno:
            continue
        found = Position(_display(frame.filename), frame.lineno, (frame.colno or 0) + 1)
    return found


def _frames(exc: BaseException) -> list[tuple[str, int, Optional[int]]]:
    """``(file, line, column)`` of the frames outside torch and mpgen where
    ``exc`` went through, outermost first: TorchDynamo's quoted user frames
    (its message), else the traceback's."""
    quoted = [(f, int(n), None) for f, n in re.findall(r'File "([^"]+)", line (\d+)', str(exc))]
    mpgen_dir = str(Path(__file__).resolve().parents[2])  # mpgen/
    frames = quoted or [(f.filename, f.lineno, f.colno)
                        for f in traceback.extract_tb(exc.__traceback__) if f.lineno]
    # torch's own folder, not torchvision's beside it (a plain prefix matched both)
    return [(f, n, c) for f, n, c in frames
            if f and not _inside(f, _TORCH_DIR) and not _inside(f, mpgen_dir)]


def _position(file: str, line: int, col: Optional[int]) -> Position:
    if col is None:  # the statement's indentation
        source = linecache.getline(file, line)
        col = len(source) - len(source.lstrip())
    return Position(_display(file), line, col + 1)


class TraceFailure(MpgenError):
    """A tracer's own refusal of ``forward`` (torch.fx's, TorchDynamo's), at the
    innermost line of the library's (or the user's) source it stopped at."""

    def __init__(self, exc: BaseException, tracer: str, cls: str) -> None:
        frames = _frames(exc)
        pos = _position(*frames[-1]) if frames else None
        name = "torch.fx" if tracer == "fx" else "TorchDynamo"
        message = f"{name} cannot trace {cls}.forward: {failure(exc)}"
        mine = [f for f in frames if _in_project(f[0])]
        if frames and mine and mine[-1] != frames[-1]:  # a library's line, called from one of theirs
            message += f" (called from {_position(*mine[-1])})"
        super().__init__(pos, message)
        self.tracer = tracer

    def hinted(self, hint: str) -> MpgenError:
        """The same failure, its message ending with what to try."""
        return MpgenError(self.pos, f"{self.message}; {hint}")


def writes_in_place(node: fx.Node) -> bool:
    """A tensor method that writes in place (``h.mul_(2)``), which fx deems
    pure: kept though nothing reads its result (a spec writes it, or refuses)."""
    return (node.op == "call_method" and isinstance(node.target, str)
            and node.target.endswith("_") and not node.target.startswith("_"))


def node_position(node: fx.Node) -> Optional[Position]:
    """The source line of ``node`` (recorded by the tracer), if any."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)[^\n]*\n([^\n]*)', trace)
    if not frames:
        return None
    # torch's own frames out (torchvision's folder starts with torch's name, and stays)
    frames = [f for f in frames if not Path(f[0]).resolve().is_relative_to(_TORCH_DIR)]
    if not frames:
        return None
    file, line, _ = frames[-1]
    source = linecache.getline(file, int(line))
    return Position(_display(file), int(line), len(source) - len(source.lstrip()) + 1)


def node_error(node: fx.Node, message: str) -> MpgenError:
    return MpgenError(node_position(node), f"fx node {node.name!r} ({_describe(node)}): "
                                           f"{message}")


def _describe(node: fx.Node) -> str:
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return f"call_function {name}"
    return f"{node.op} {node.target}"


# -- the trace and its sample run ------------------------------------------------------

class _Recorder(fx.Interpreter):
    """Runs the traced graph once and keeps every node's value."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            value = super().run_node(n)
        except Exception as exc:
            raise node_error(n, f"fails on sample inputs of the --input shapes: "
                                f"{failure(exc)}") from None
        self.values[n] = value
        return value


def trace(root: nn.Module, inputs: Sequence[InputSpec]
          ) -> tuple[fx.GraphModule, list[InputSpec], dict[fx.Node, Any]]:
    """``root`` traced (``torch.nn`` modules are leaves, user modules are
    traced through), the inputs in ``forward``'s order, and every node's
    value on samples of them."""
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    cls = type(root).__name__
    try:
        graph = tracer.trace(root)
    except Exception as exc:
        raise TraceFailure(exc, "fx", cls) from None
    gm = fx.GraphModule(root, graph, cls)
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda node: node.is_impure() or writes_in_place(node))
    inputs = _check_placeholders(root, gm.graph, inputs)
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*[spec.sample() for spec in inputs])
    return gm, inputs, recorder.values


def _check_placeholders(root: nn.Module, graph: fx.Graph, inputs: Sequence[InputSpec]
                        ) -> list[InputSpec]:
    """``inputs`` in ``forward``'s order; each of its arguments given once."""
    wanted = [n.target for n in graph.nodes if n.op == "placeholder"]
    check_placeholders(type(root).__name__, wanted, wanted, inputs)
    return sorted(inputs, key=lambda spec: wanted.index(spec.name))


def check_placeholders(cls: str, wanted: Sequence[str], required: Sequence[str],
                       inputs: Sequence[InputSpec]) -> None:
    """Each ``--input`` names an argument of ``forward`` (``wanted``), once,
    and every ``required`` one is given."""
    given = [spec.name for spec in inputs]
    for name in given:
        if given.count(name) > 1:
            raise MpgenError(None, f"--input {name}: given more than once")
        if name not in wanted:
            raise MpgenError(None, f"--input {name}: {cls}.forward "
                                   f"has no argument {name!r}{did_you_mean(name, wanted)}; "
                                   f"its arguments: {', '.join(wanted)}")
    missing = [n for n in required if n not in given]
    if missing:
        raise MpgenError(None, f"{cls}.forward takes "
                               f"{', '.join(missing)}: give its shape with --input "
                               f"{missing[0]}=D0,D1,...")
