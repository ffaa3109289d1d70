"""The oracle of the fuzz tests: what any spec, however broken, must give.

A build of any spec either exits 0 with generated files that compile and in
which no spec text became code (:func:`assert_safe_code`), or exits 2 with
nothing on stdout, every stderr line ``FILE:LINE:COL: message`` (or
``FILE: message`` for a problem of the whole file) and no output folder
written (:func:`assert_reported`); never a traceback (:func:`build_path`
fails the test with the spec), never a hang (``helpers.time_limit``).
``tests/compiler/test_hostile_input.py`` and ``tests/compiler/test_fuzz.py``
share it.

The specs hypothesis draws are here too (random YAML trees, random layers,
mutated examples, :func:`dump` to write them), with the hypothesis profiles
(``ci``, the default, and ``long``: ``HYPOTHESIS_PROFILE``), so that
``tests/spec_schema/test_json_schema.py`` checks the schema on the specs the
fuzz tests build.
"""

from __future__ import annotations

import ast
import copy
import math
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from helpers import EXAMPLES, mpgen

# No hypothesis deadline: it only measures an example once it has ended, and
# flags a slow first build (torch warming up) as flaky; test_fuzz's HANG_S
# interrupts.
_COMMON = dict(database=None, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=30, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

#: Names that generated code never needs; their appearance as code (not as a
#: string constant) means something from a spec became code.
FORBIDDEN_NAMES = {"__import__", "eval", "exec", "compile", "open", "os", "system",
                   "subprocess", "Popen", "builtins", "getattr", "globals", "breakpoint",
                   "input", "save", "load", "from_file"}
FORBIDDEN_ATTRIBUTES = {"system", "popen", "Popen", "__import__", "__builtins__", "__globals__",
                        "__subclasses__", "rmtree", "from_file", "loads"}


@dataclass
class Result:
    code: int
    out: str
    err: str
    out_dir: Path

    def files(self) -> dict[str, str]:
        if not self.out_dir.exists():
            return {}
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(self.out_dir.glob("*.py"))}


def build_text(tmp_path: Path, text: str | bytes, *args: str, name: str = "spec.yaml") -> Result:
    """Write ``text`` as a spec and run ``mpgen build`` on it in-process."""
    folder = tmp_path / uuid.uuid4().hex[:8]
    folder.mkdir()
    spec = folder / name
    spec.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return build_path(spec, folder / "out", *args)


def build_path(spec: Path, out: Path, *args: str, cwd: Path | None = None) -> Result:
    """``mpgen build SPEC -o OUT ARGS`` in-process; an escaping exception fails the test."""
    ran = mpgen("build", str(spec), "-o", str(out), *args, cwd=cwd)
    if ran.returncode == 1 and "Traceback (most recent call last)" in ran.stderr:
        pytest.fail(f"mpgen raised instead of reporting:\n{ran.stderr}\n"
                    f"spec:\n{((cwd or Path.cwd()) / spec).read_bytes()[:2000]!r}")
    return Result(ran.returncode, ran.stdout, ran.stderr, out)


def assert_reported(result: Result, spec_name: str = "spec.yaml", *,
                    whole_file: bool = False) -> None:
    """Exit 2, only ``FILE:LINE:COL: message`` lines (and ``FILE: message``
    with ``whole_file``), nothing written."""
    assert "Traceback" not in result.err + result.out
    assert result.code == 2, (result.code, result.err, result.out)
    assert result.out == ""
    lines = result.err.splitlines()
    assert lines, "no error message"
    where = r":\d+:\d+: \S" + (r"|: \S" if whole_file else "")
    # The summary lines of a long report (mpgen.errors).
    position = re.compile(rf"^.*{re.escape(spec_name)}(?:{where})"
                          r"|^\.\.\. and \d+ more errors$|^\.\.\. too many errors; stopping$")
    bad = [line for line in lines if not position.match(line)]
    assert not bad, f"not FILE:LINE:COL: message: {bad}"
    assert not result.out_dir.exists(), "an output directory was created"


def assert_safe_code(files: dict[str, str]) -> None:
    """Every generated file compiles, and no spec text became a name or call."""
    assert files
    for name, text in files.items():
        tree = ast.parse(text, name)
        compile(text, name, "exec", dont_inherit=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                assert node.id not in FORBIDDEN_NAMES, (name, ast.unparse(node))
            elif isinstance(node, ast.Attribute):
                assert node.attr not in FORBIDDEN_ATTRIBUTES, (name, ast.unparse(node))


def assert_built_or_reported(result: Result, where: str = "") -> None:
    """The oracle: exit 0 and safe code that compiles, or exit 2 and positions."""
    try:
        assert result.code in (0, 2), (result.code, result.err)
        if result.code == 2:
            assert_reported(result, whole_file=True)
        else:
            assert_safe_code(result.files())
    except (AssertionError, SyntaxError) as exc:
        raise AssertionError(f"{where}\nstderr:\n{result.err}") from exc


def paths(node, path=()):
    """Every path into a tree of dicts and lists, the root's ``()`` first."""
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, path + (i,))


# --------------------------------------------------------------------------
# specs: random YAML trees

class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True  # a value drawn twice is written twice, not as an anchor


def dump(data) -> str:
    return yaml.dump(data, Dumper=_Dumper, allow_unicode=True, sort_keys=False, width=1000)


SPEC_KEYS = ["mpgen", "name", "inputs", "blocks", "layers", "outputs", "placement", "train",
             "init"]
INNER_KEYS = ["op", "args", "in", "repeat", "shape", "dtype", "params", "inputs", "layers",
              "outputs", "call", "tie", "init", "loss", "optimizer", "lr", "batch_size",
              "steps", "dims", "seed", "log_every", "auto", "devices", "x", "batch", "seq",
              "h.0-1", "cuda:0"]
WORDS = ["", " ", "x", "batch", "seq", "Linear", "ReLU", "Conv2d", "LSTM", "F.relu",
         "torch.add", "torch.cat", "MSELoss", "CrossEntropyLoss", "SGD", "LBFGS", "cuda:0",
         "cuda:1", "cpu", "auto", "$dim", "$nope", "=3 * 2", "=size(x, 1)", "h.0-1", "h.5-2",
         "int64", "float16", "nan", "__init__", "ñame", "层", "\u202eevil", "a\u200bb"]
NUMBERS = st.one_of(
    st.integers(-3, 40),
    st.integers(),
    st.sampled_from([2**31, 2**63, 2**64, 10**30, -(10**30), 10**400, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.sampled_from(WORDS),
                    st.text(max_size=12))
KEYS = st.one_of(st.sampled_from(SPEC_KEYS + INNER_KEYS + WORDS), st.text(max_size=8),
                 st.integers(-2, 10), st.none(), st.booleans())
TREES = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(KEYS, children, max_size=5)),
    max_leaves=20,
)
#: Trees under the spec's own keys, so that more of them reach the compiler.
SPEC_TREES = st.fixed_dictionaries(
    {"mpgen": st.one_of(st.just(1), SCALARS), "name": st.one_of(st.just("M"), SCALARS),
     "inputs": st.one_of(st.just({"x": ["batch", 8]}), TREES),
     "layers": st.one_of(st.dictionaries(st.sampled_from(["a", "b", "h", "ñ"]), TREES,
                                         min_size=1, max_size=3), TREES)},
    optional={key: TREES for key in ("outputs", "placement", "train", "blocks", "init")},
)


# --------------------------------------------------------------------------
# specs: random layers, real ops with random arguments

OPS = ["Linear", "Conv1d", "Conv2d", "ConvTranspose2d", "BatchNorm1d", "BatchNorm2d",
       "LayerNorm", "Embedding", "LSTM", "GRU", "RNN", "MultiheadAttention",
       "TransformerEncoderLayer", "MaxPool2d", "AdaptiveAvgPool2d", "Dropout", "ReLU", "GELU",
       "Softmax", "Sigmoid", "Flatten", "Unflatten", "Identity", "PixelShuffle", "Upsample",
       "F.relu", "F.softmax", "F.pad", "F.interpolate", "F.scaled_dot_product_attention",
       "torch.add", "torch.cat", "torch.stack", "torch.matmul", "torch.flatten",
       "torch.reshape", "torch.transpose", "torch.split", "torch.chunk", "torch.mean",
       "torch.sum", "torch.argmax", "torch.select", "torch.unflatten", "torch.zeros",
       "torch.arange", "torch.triu"]
#: Hypothesis favours the first choices (and shrinks towards them): sizes and
#: arguments that work come first, so that many models reach shape inference
#: and code generation; the bad ones are there too.
def sometimes(often, rarely, one_in: int = 10):
    """``rarely`` about once in ``one_in`` draws, else ``often``."""
    return st.integers(0, one_in - 1).flatmap(lambda k: rarely if k == one_in // 2 else often)


SIZES = sometimes(st.one_of(st.integers(1, 12), st.sampled_from(["batch", "seq", "h"])),
                  st.sampled_from([0, -1, 10**9]))
ARGS = sometimes(st.integers(1, 16),
                 st.sampled_from([-1, 0, 10**9, 2**40, -(2**40), 1.5, True, None, "x", "batch",
                                  "$dim"]), one_in=5)


@st.composite
def random_layers(draw):
    ndim = draw(st.integers(1, 5))
    shape = [draw(SIZES) for _ in range(ndim)]
    dtype = draw(st.sampled_from([None, "float32", "int64", "float16", "bool"]))
    names = []
    layers = {}
    for i in range(draw(st.integers(1, 4))):
        layer = {"op": draw(st.sampled_from(OPS))}
        if draw(st.booleans()):
            layer["args"] = draw(st.lists(ARGS, max_size=4))
        if draw(sometimes(st.just(False), st.just(True), 4)):
            layer["in"] = draw(st.sampled_from(["x", *names, f"l{i}", f"l{i + 1}"]))
        if draw(sometimes(st.just(False), st.just(True), 5)):
            layer["repeat"] = draw(st.sampled_from([2, 1, 3, 0, -1, 10**6]))
        if draw(sometimes(st.just(False), st.just(True), 3)):
            layer[draw(st.sampled_from(["dim", "p", "kernel_size", "num_heads", "batch_first",
                                        "bias", "padding"]))] = draw(ARGS)
        names.append(f"l{i}")
        layers[f"l{i}"] = layer
    spec = {"mpgen": 1, "name": "R",
            "inputs": {"x": shape if dtype is None else {"shape": shape, "dtype": dtype}},
            "layers": layers}
    if draw(st.booleans()):
        spec["placement"] = {name: draw(st.sampled_from(["cuda:0", "cuda:1", "cpu"]))
                             for name in draw(st.lists(st.sampled_from(names), max_size=3,
                                                       unique=True))}
    if draw(sometimes(st.just(False), st.just(True), 3)):
        spec["train"] = {"loss": draw(st.sampled_from(["MSELoss", "CrossEntropyLoss",
                                                        "BCELoss", "NLLLoss", "L1Loss"])),
                         "dims": {"seq": draw(st.integers(1, 40))}}
    return spec


# --------------------------------------------------------------------------
# specs: structural mutations of the examples

EXAMPLE_DATA = {p.stem: yaml.safe_load(p.read_text(encoding="utf-8"))
                for p in sorted(EXAMPLES.glob("*.yaml"))}
HUGE = [0, -1, -(2**63), 2**64, 10**30, -(10**30), 10**6, 1e308, -0.0, math.nan, math.inf,
        -math.inf]
DEVICES = ["cuda:0", "cuda:1", "cuda:7", "cuda:-1", "cuda:99999999999999999999", "cpu", "gpu",
           "", "cuda", "CUDA:0", "cuda:0:1"]
UNICODE_NAMES = ["ñame", "层", "𝔘𝔫𝔦", "a\u200bb", "\u202eevil", "Ⅻ", "ｆｕｌｌ",
                 "e\u0301", "ß", "İ", "_", "__init__", "class", "self", "torch", "nn", "F"]
UNICODE = st.one_of(st.sampled_from(UNICODE_NAMES), st.text(min_size=1, max_size=8))


def pick(draw, items: list):
    """One of ``items``, uniformly (``sampled_from`` favours the first ones,
    the top-level keys of a spec); still shrunk towards the first."""
    return draw(st.randoms(use_true_random=False)).choice(items)


def _parent(data, path):
    for part in path[:-1]:
        data = data[part]
    return data


def _layer_names(data) -> list[str]:
    layers = data.get("layers") if isinstance(data, dict) else None
    return [k for k in layers if isinstance(k, str)] if isinstance(layers, dict) else []


def delete_key(draw, data):
    path = pick(draw, [p for p in paths(data) if p])
    del _parent(data, path)[path[-1]]


def retype(draw, data):
    path = pick(draw, [p for p in paths(data) if p])
    _parent(data, path)[path[-1]] = draw(st.one_of(SCALARS, TREES))


def rename_key(draw, data):
    keyed = [p for p in paths(data) if p and isinstance(_parent(data, p), dict)]
    path = pick(draw, keyed)
    parent, key = _parent(data, path), path[-1]
    typo = [f"{key}x", str(key)[:-1], str(key).upper(), str(key).replace("_", "")]
    new = draw(st.one_of(st.sampled_from(typo + INNER_KEYS + SPEC_KEYS), KEYS))
    items = [(new if k == key else k, v) for k, v in parent.items()]
    parent.clear()
    parent.update(items)


def number(draw, data):
    numeric = [p for p in paths(data) if p and isinstance(_parent(data, p)[p[-1]], (int, float))
               and not isinstance(_parent(data, p)[p[-1]], bool)]
    if numeric:
        path = pick(draw, numeric)
        _parent(data, path)[path[-1]] = draw(st.one_of(st.sampled_from(HUGE), st.integers()))


def placement_range(draw, data):
    names = _layer_names(data)
    if not names:
        return
    name = pick(draw, names)
    a, b = draw(st.integers(-2, 200)), draw(st.integers(-2, 200))
    key = draw(st.sampled_from([f"{name}.{a}-{b}", f"{name}.{a}", f"{name}.{a}-", name,
                                f"{name}.-{b}", f"{name}.x"]))
    if not isinstance(data.get("placement"), dict) or "auto" in data["placement"]:
        data["placement"] = {}
    data["placement"][key] = draw(st.sampled_from(DEVICES))


def cycle(draw, data):
    names = _layer_names(data)
    if not names:
        return
    at = draw(st.integers(0, len(names) - 1))
    layer = data["layers"][names[at]]
    if isinstance(layer, dict):
        later = names[at:]
        layer["in"] = draw(st.one_of(st.sampled_from(later),
                                     st.lists(st.sampled_from(later), min_size=1, max_size=3)))


def unicode_name(draw, data):
    """A layer, an input or the model renamed, every reference too."""
    choices = [("name", None)] + [("layers", n) for n in _layer_names(data)]
    if isinstance(data.get("inputs"), dict):
        choices += [("inputs", n) for n in data["inputs"] if isinstance(n, str)]
    where, old = pick(draw, choices)
    new = draw(UNICODE)
    if old is None:
        data["name"] = new
        return

    def renamed(node):
        if isinstance(node, dict):
            return {renamed(k): renamed(v) for k, v in node.items()}
        if isinstance(node, list):
            return [renamed(v) for v in node]
        if isinstance(node, str) and (node == old or node.startswith(old + ".")):
            return new + node[len(old):]
        return node

    data.update(renamed(data))


def swap_layers(draw, data):
    names = _layer_names(data)
    if len(names) < 2:
        return
    i, j = draw(st.lists(st.integers(0, len(names) - 1), min_size=2, max_size=2, unique=True))
    names[i], names[j] = names[j], names[i]
    data["layers"] = {n: data["layers"][n] for n in names}


MUTATIONS = [delete_key, retype, rename_key, number, placement_range, cycle, unicode_name,
             swap_layers]


def duplicate_line(draw, text: str) -> str:
    """A key written twice (a line repeated), which YAML loaders differ on."""
    lines = text.splitlines(keepends=True)
    keyed = [i for i, line in enumerate(lines) if re.match(r"\s*[^\s#-][^:]*:", line)]
    i = pick(draw, keyed)
    return "".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])


@st.composite
def mutated_examples(draw):
    base = draw(st.sampled_from(sorted(EXAMPLE_DATA)))
    data = copy.deepcopy(EXAMPLE_DATA[base])
    for mutate in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)):
        if isinstance(data, dict) and data:
            mutate(draw, data)
    text = dump(data)
    if draw(sometimes(st.just(False), st.just(True), 5)):
        text = duplicate_line(draw, text)
    args = draw(st.sampled_from([[], [], ["--device-map", "cpu"],
                                 ["--device-map", "cuda:1=cuda:0"]]))
    return base, text, args
