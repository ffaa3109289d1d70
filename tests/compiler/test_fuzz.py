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

import difflib
import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import (PROFILE, SPEC_TREES, TREES, Result, assert_built_or_reported,
                     assert_reported, assert_safe_code, build_path, build_text, dump,
                     mutated_examples, pick, random_layers, sometimes)
from helpers import ROOT, time_limit

CORPUS = ROOT / "tests" / "fuzz_corpus"
UPDATE = os.environ.get("MPGEN_UPDATE_EXPECTED") == "1"

#: A build that runs longer than this is a hang (issue 10: every tiny spec
#: answers within 20 s).
HANG_S = 20

#: Seconds for all the examples of one test (the ci profile takes far less).
TOTAL_S = {"ci": 60}.get(PROFILE, 6 * 3600)


def build_checked(tmp_path: Path, text: str, *args: str) -> Result:
    """Build ``text`` under the hang limit and apply the oracle."""
    with time_limit(HANG_S):
        result = build_text(tmp_path, text, *args)
    assert_built_or_reported(result, f"spec (args {list(args)}):\n{text}")
    return result


def within_total(test):
    """Run the hypothesis test ``test`` and check it took under ``TOTAL_S``."""
    start = time.perf_counter()
    test()
    elapsed = time.perf_counter() - start
    assert elapsed < TOTAL_S, f"{test.__name__} took {elapsed:.0f}s"


# --------------------------------------------------------------------------
# random YAML trees

@pytest.mark.slow
@pytest.mark.parametrize("documents", [TREES, SPEC_TREES], ids=["any", "spec_shaped"])
def test_random_yaml_trees(tmp_path, documents):
    @given(documents)
    def random_tree(data):
        build_checked(tmp_path, dump(data))

    within_total(random_tree)


# --------------------------------------------------------------------------
# random layers: real ops, random arguments

@pytest.mark.slow
def test_random_layers(tmp_path):
    @given(random_layers())
    def random_model(spec):
        build_checked(tmp_path, dump(spec))

    within_total(random_model)


# --------------------------------------------------------------------------
# structural mutations of the examples

@pytest.mark.slow
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


@pytest.mark.slow
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
