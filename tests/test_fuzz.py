"""Fuzzing with hypothesis: no spec gives a traceback, a hang or a partial output.

Every spec is built in-process (``mpgen build SPEC -o OUT``) and judged by
the oracle of ``tests/fuzzing.py``: exit 0 with generated files that
compile, or exit 2 with every stderr line ``FILE:LINE:COL: message``
(``FILE: message`` for the whole file) and no output folder; never a
traceback, never a build past ``HANG_S`` seconds (a hard limit per example),
and each test's examples in ``TOTAL_S`` seconds. The specs:

- random YAML trees: mappings, lists and scalars (huge and negative numbers,
  nan, unicode, empty strings, null), alone or under the spec's own keys;
- random layers: real ops with random arguments, inputs and repeats;
- structural mutations of the example specs in ``examples/``: deleted,
  duplicated and renamed keys, wrong types, huge and negative numbers, bad
  ranges and devices in placement, cycles in ``in:``, unicode names, swapped
  layers;
- random ``train:`` settings (every loss and optimizer, random keyword
  values), where a build that succeeds must also give a training script
  that takes its step.

The ``ci`` profile (the default) runs a few derandomized examples per test,
the same ones every run; ``HYPOTHESIS_PROFILE=long`` runs thousands with a
fresh seed (``docs/testing.md``, "Fuzzing"). Hypothesis shrinks a failure to
a minimal spec; keep it in ``tests/fuzz_corpus/`` (run below) with its
exact message.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import (Result, assert_built_or_reported, assert_reported, assert_safe_code,
                     build_path, build_text, paths)
from helpers import time_limit

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CORPUS = ROOT / "tests" / "fuzz_corpus"
UPDATE = os.environ.get("MPGEN_UPDATE_EXPECTED") == "1"

#: A build that runs longer than this is a hang (issue 10: every tiny spec
#: answers within 20 s).
HANG_S = 20

# No hypothesis deadline: it only measures an example once it has ended, and
# flags a slow first build (torch warming up) as flaky; HANG_S interrupts.
_COMMON = dict(database=None, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=30, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
#: Seconds for all the examples of one test (the ci profile takes far less).
TOTAL_S = {"ci": 60}.get(PROFILE, 6 * 3600)


def build_checked(tmp_path: Path, text: str, *args: str) -> Result:
    """Build ``text`` under the hang limit and apply the oracle."""
    with time_limit(HANG_S):
        result = build_text(tmp_path, text, *args)
    assert_built_or_reported(result, f"spec (args {list(args)}):\n{text}")
    return result


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True  # a value drawn twice is written twice, not as an anchor


def dump(data) -> str:
    return yaml.dump(data, Dumper=_Dumper, allow_unicode=True, sort_keys=False, width=1000)


def within_total(test):
    """Run the hypothesis test ``test`` and check it took under ``TOTAL_S``."""
    start = time.perf_counter()
    test()
    elapsed = time.perf_counter() - start
    assert elapsed < TOTAL_S, f"{test.__name__} took {elapsed:.0f}s"


# --------------------------------------------------------------------------
# random YAML trees

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


@pytest.mark.parametrize("documents", [TREES, SPEC_TREES], ids=["any", "spec_shaped"])
def test_random_yaml_trees(tmp_path, documents):
    @given(documents)
    def random_tree(data):
        build_checked(tmp_path, dump(data))

    within_total(random_tree)


# --------------------------------------------------------------------------
# random layers: real ops, random arguments

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


def test_random_layers(tmp_path):
    @given(random_layers())
    def random_model(spec):
        build_checked(tmp_path, dump(spec))

    within_total(random_model)


# --------------------------------------------------------------------------
# structural mutations of the examples

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


def test_mutated_examples(tmp_path):
    @given(mutated_examples())
    def mutated(case):
        base, text, args = case
        build_checked(tmp_path, text, *args)

    within_total(mutated)


# --------------------------------------------------------------------------
# random train: settings, and the training script run for one step

TRAIN_MODELS = {
    "vector": {"inputs": {"x": ["batch", 8]}, "layers": {"fc": {"op": "Linear", "args": [8, 4]}}},
    "sequence": {"inputs": {"x": ["batch", "seq", 8]},
                 "layers": {"fc": {"op": "Linear", "args": [8, 4]}}},
    "probabilities": {"inputs": {"x": ["batch", 8]},
                      "layers": {"fc": {"op": "Linear", "args": [8, 4]},
                                 "prob": {"op": "Sigmoid"}}},
    "two_heads": {"inputs": {"x": ["batch", 8]},
                  "layers": {"a": {"op": "Linear", "args": [8, 4], "in": "x"},
                             "b": {"op": "Linear", "args": [8, 2], "in": "x"}},
                  "outputs": ["a", "b"]},
}
TRAIN_VALUES = st.one_of(
    st.sampled_from(["mean", "sum", "none", "batchmean", "bogus", "strong_wolfe", None, True,
                     False, 0, 1, -1, 0.5, 2.0, -0.1, 1e-8, 10**30, [0.9, 0.999], [0.5, 1.2],
                     [1e-6, 50], 3, "x"]),
    st.floats(-2, 2), st.integers(-5, 100))


def _signature_names(cls) -> list[str]:
    import inspect

    return [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]


@st.composite
def call_specs(draw, module, names: list[str]):
    name = pick(draw, names)
    keys = _signature_names(getattr(module, name))
    kwargs = {key: draw(TRAIN_VALUES) for key in draw(st.lists(st.sampled_from(keys),
                                                               max_size=2, unique=True))} \
        if keys else {}
    return {"op": name, **kwargs} if kwargs else name


@st.composite
def train_specs(draw):
    import torch

    model = draw(st.sampled_from(sorted(TRAIN_MODELS)))
    losses = sorted(n for n in dir(torch.nn) if n.endswith("Loss") and n[0].isupper())
    optimizers = sorted(n for n in dir(torch.optim) if n[0].isupper() and n != "Optimizer"
                        and isinstance(getattr(torch.optim, n), type))
    train = {"loss": draw(call_specs(torch.nn, losses)),
             "optimizer": draw(call_specs(torch.optim, optimizers)),
             "batch_size": draw(st.integers(1, 4)), "steps": 1,
             "seed": draw(sometimes(st.integers(0, 2**32),
                                    st.sampled_from([-(2**63) - 1, 2**64]))),
             "log_every": draw(st.integers(1, 3))}
    if model == "sequence":
        train["dims"] = {"seq": draw(st.integers(1, 5))}
    return {"mpgen": 1, "name": "M", **TRAIN_MODELS[model], "train": train}


@pytest.mark.filterwarnings("ignore::UserWarning")  # the script's own (deprecated keywords)
def test_random_train_settings_build_a_script_that_runs(tmp_path):
    """Whatever ``train:`` holds, a spec that builds gives a training script
    that takes its step (issue 10: no accepted spec gives a broken script)."""
    from run_generated import train_one_step

    @given(train_specs())
    def train_settings(spec):
        text = dump(spec)
        result = build_checked(tmp_path, text, "--device-map", "cpu")
        if result.code == 0:
            with time_limit(HANG_S):
                try:
                    printed = train_one_step(result.out_dir / "train_m.py")
                except Exception as exc:
                    raise AssertionError(f"the training script of this spec fails:\n{text}") \
                        from exc
            assert "step 1/1  loss" in printed, (printed, text)

    within_total(train_settings)


# --------------------------------------------------------------------------
# the corpus: every failure found, minimal, with its exact message


def corpus_cases():
    for spec in sorted(CORPUS.glob("*.yaml")):
        first = spec.read_text(encoding="utf-8").partition("\n")[0]
        reason = first.removeprefix("# xfail:").strip() if first.startswith("# xfail:") else None
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        yield pytest.param(spec.stem, marks=marks, id=spec.stem)


@pytest.mark.parametrize("case", list(corpus_cases()))
def test_corpus(tmp_path, case):
    """``tests/fuzz_corpus/CASE.yaml`` gives exactly ``CASE.expected``: the
    stderr of its build from the repository root (a refused spec), or
    nothing (a spec that now builds; its code must compile). A first line
    ``# xfail: REASON`` marks a failure whose fix lies elsewhere; its
    ``.expected`` says what the message should be. Regenerate with
    ``MPGEN_UPDATE_EXPECTED=1`` and read the diff."""
    spec = Path("tests/fuzz_corpus") / f"{case}.yaml"
    args = (ROOT / spec.with_suffix(".args")).read_text().split() \
        if (ROOT / spec.with_suffix(".args")).exists() else []
    with time_limit(HANG_S):
        result = build_path(spec, tmp_path / "out", *args, cwd=ROOT)
    expected_file = ROOT / spec.with_suffix(".expected")
    if UPDATE and not (ROOT / spec).read_text().startswith("# xfail:"):
        expected_file.write_text(result.err, encoding="utf-8")
    expected = expected_file.read_text(encoding="utf-8")
    assert result.err == expected, "".join(difflib.unified_diff(
        expected.splitlines(True), result.err.splitlines(True), "expected", "got"))
    if expected:
        assert_reported(result, spec.name, whole_file=True)
    else:
        assert result.code == 0
        assert_safe_code(result.files())
