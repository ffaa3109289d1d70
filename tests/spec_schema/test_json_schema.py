"""The JSON Schema of a spec (``mpgen schema``) and the spec reference
(``mpgen schema --markdown``), both generated from ``mpgen.spec_schema.models``.

The committed copies (``docs/mpgen-spec.schema.json``, ``docs/spec-reference.md``)
must be what the commands print, so they cannot drift from the models; every
example names the schema on its first line for editors and is valid against it.
The schema describes the language as it is written (``in: x``, ``loss:
MSELoss``, expressions, keyword arguments), so it must accept every spec the
loader (``load`` + ``validate``) accepts: it may be looser where a check is
beyond JSON Schema, never stricter. That is checked on the examples, on every
fixture of the error and fuzz suites, on the documented short forms, and on
specs hypothesis draws (random YAML trees, random layers, mutated examples).
Regenerate the committed copies after changing the models with::

    .venv/bin/mpgen schema -o docs/mpgen-spec.schema.json
    .venv/bin/mpgen schema --markdown -o docs/spec-reference.md
"""

from __future__ import annotations

import copy
import os
import re
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given, settings

from fuzzing import SPEC_TREES, TREES, dump, mutated_examples, random_layers
from helpers import ROOT, mpgen, mpgen_process
from mpgen.errors import MpgenError
from mpgen.spec_schema.json_schema import DIALECT, schema_text, spec_json_schema
from mpgen.spec_schema.load import LoadedSpec, load_file, load_text
from mpgen.spec_schema.reference import reference_markdown
from mpgen.spec_schema.validate import validate

SCHEMA = ROOT / "docs" / "mpgen-spec.schema.json"
REFERENCE = ROOT / "docs" / "spec-reference.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _is_yaml_data(path: Path) -> bool:
    try:
        load_file(path)
    except MpgenError:
        return False
    return True


#: Every spec fixture of the suite that is YAML data (the others are the YAML
#: loader's own errors, which come before any schema): error cases, many of
#: them valid to the models and refused later by the compiler, and the fuzz
#: corpus.
FIXTURES = [path for folder in ("errors", "fuzz_corpus")
            for path in sorted((ROOT / "tests" / folder).glob("*.yaml")) if _is_yaml_data(path)]
SCHEMA_LINE = "# yaml-language-server: $schema=../docs/mpgen-spec.schema.json"
VALIDATOR = jsonschema.Draft202012Validator(spec_json_schema())
REGENERATE = ".venv/bin/mpgen schema{} -o {}"


def loader_error(loaded: LoadedSpec) -> str:
    """What the models say of ``loaded``: "" when they accept it."""
    try:
        validate(loaded)
    except MpgenError as exc:
        return str(exc)
    return ""


def loader_accepts(loaded: LoadedSpec) -> bool:
    return not loader_error(loaded)


def schema_errors(data) -> list[str]:
    """Each error of the schema, as its most relevant part says it (the
    alternative an ``anyOf`` failed in, as editors show it)."""
    errors = (jsonschema.exceptions.best_match([error]) for error in VALIDATOR.iter_errors(data))
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in errors]


def assert_never_stricter(loaded: LoadedSpec, text: str = "") -> bool:
    """The schema accepts what the loader accepts; the loader's verdict."""
    accepted = loader_accepts(loaded)
    if accepted:
        assert not schema_errors(loaded.data), (schema_errors(loaded.data), text)
    return accepted


# --------------------------------------------------------------------------
# the committed copies and the command


def test_the_schema_is_a_valid_draft_2020_12_schema():
    schema = spec_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == DIALECT
    assert schema["$id"] and schema["title"] and schema["additionalProperties"] is False


def test_mpgen_schema_prints_the_committed_schema():
    ran = mpgen("schema")
    assert (ran.returncode, ran.stderr) == (0, "")
    assert ran.stdout == SCHEMA.read_text(encoding="utf-8"), (
        f"{SCHEMA.name} is not current; run: {REGENERATE.format('', 'docs/' + SCHEMA.name)}")


def test_mpgen_schema_markdown_prints_the_committed_reference():
    ran = mpgen("schema", "--markdown")
    assert (ran.returncode, ran.stderr) == (0, "")
    assert ran.stdout == REFERENCE.read_text(encoding="utf-8"), (
        f"{REFERENCE.name} is not current; run: "
        f"{REGENERATE.format(' --markdown', 'docs/' + REFERENCE.name)}")


def test_schema_out_writes_the_file(tmp_path):
    ran = mpgen("schema", "-o", str(tmp_path / "spec.schema.json"))
    assert (ran.returncode, ran.stdout) == (0, f"wrote {tmp_path / 'spec.schema.json'}\n")
    assert (tmp_path / "spec.schema.json").read_text(encoding="utf-8") == schema_text()


def test_schema_out_to_a_folder_that_does_not_exist(tmp_path):
    ran = mpgen("schema", "-o", str(tmp_path / "no" / "schema.json"))
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.startswith("mpgen: ") and ran.stdout == ""


@pytest.mark.parametrize("seed", ["0", "1"])
def test_the_schema_is_the_same_in_a_fresh_interpreter_with_any_hash_seed(seed):
    ran = mpgen_process("schema", env={**os.environ, "PYTHONHASHSEED": seed})
    assert (ran.returncode, ran.stderr) == (0, "")
    assert ran.stdout == SCHEMA.read_text(encoding="utf-8")


def test_every_key_of_every_section_is_in_the_reference():
    schema = spec_json_schema()
    text = reference_markdown()
    for name, definition in [("Spec", schema), *schema["$defs"].items()]:
        assert f"\n## {name}\n" in text or f"\n### {name}\n" in text, name
        assert definition.get("description"), f"{name} has no description"
        for form in [definition, *definition.get("anyOf", [])]:
            for key, field in form.get("properties", {}).items():
                assert field.get("description"), f"{name}.{key} has no description"
                assert f"| `{key}` |" in text, f"{name}.{key}"


def test_the_reference_is_linked_from_the_spec_documentation():
    assert "(spec-reference.md)" in (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")


# --------------------------------------------------------------------------
# the examples and the suite's specs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_names_the_schema_and_is_valid(path):
    assert path.read_text(encoding="utf-8").splitlines()[0] == SCHEMA_LINE
    loaded = load_file(path)
    assert schema_errors(loaded.data) == []
    assert loader_accepts(loaded)


#: Fixtures the loader refuses but the schema cannot (a check JSON Schema
#: cannot express): none so far; a new one goes here, with the reason.
ONLY_THE_LOADER_REFUSES: dict[str, str] = {}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_schema_and_the_loader_agree_on_the_suites_fixtures(path):
    loaded = load_file(path)
    accepted = assert_never_stricter(loaded)
    if not accepted and path.name not in ONLY_THE_LOADER_REFUSES:
        assert schema_errors(loaded.data), f"the schema accepts {path.name}, the loader does not"


# --------------------------------------------------------------------------
# the documented forms, and mistakes both refuse

#: A small valid spec, by top-level section.
BASE = {"mpgen": "mpgen: 1", "name": "name: M", "inputs": "inputs:\n  x: [batch, 10]",
        "layers": "layers:\n  fc: {op: Linear, args: [10, 20]}\n"
                  "  out: {op: Linear, args: [20, 10]}"}


def spec(extra: str = "", layer: str = "") -> LoadedSpec:
    """:data:`BASE` with its layer ``out`` written as ``layer``, and the
    top-level sections of ``extra`` added (or written instead of BASE's)."""
    sections = dict(BASE)
    if layer:
        sections["layers"] = ("layers:\n  fc: {op: Linear, args: [10, 20]}\n"
                              + textwrap.indent(textwrap.dedent(layer).strip("\n"), "  "))
    for section in re.split(r"\n(?=\S)", textwrap.dedent(extra).strip("\n")):
        if section:
            sections[section.split(":", 1)[0]] = section
    return load_text("\n".join(sections.values()) + "\n", "spec.yaml")


#: Forms docs/spec.md documents, each a layer or section the loader accepts.
DOCUMENTED = {
    "in: a name": dict(layer="  out: {op: Linear, args: [20, 10], in: fc}"),
    "in: a list, a tuple and keywords": dict(layer="""
          out: {op: LSTM, args: [20, 20], in: [fc, [h0, c0], {hx: h0}], outputs: [y, [hn, cn]]}"""),
    "in: [] (a factory)": dict(layer="""
          out: {op: torch.arange, in: [], args: ["=size(x, 1)"]}"""),
    "expressions and keyword arguments": dict(layer="""
          out: {op: Linear, args: [20, "=2 * 5"], bias: false, dtype: float16}"""),
    "output: k and call:": dict(layer="""
          out: {op: MultiheadAttention, args: [20, 2], in: [fc, fc, fc], output: 0,
                call: {need_weights: false}, checkpoint: true}"""),
    "tie and a layer's init": dict(layer="""
          out: {op: Linear, args: [20, 10], tie: {weight: fc.weight},
                init: {bias: zeros, weight: {normal: {std: 0.02}}}}"""),
    "a plain init value": dict(layer="  out: {op: PReLU, init: 0.25}"),
    "outputs: a name": dict(extra="outputs: out\n"),
    "inputs with a dtype": dict(extra="inputs: {ids: {shape: [batch, seq], dtype: int64}}\n"),
    "blocks": dict(extra="""
        blocks:
          MLP:
            params: [dim]
            inputs: x
            layers: {fc: {op: Linear, args: [$dim, "=4 * $dim"]}}
            outputs: fc
        """),
    "explicit placement": dict(extra="placement: {fc: cuda:0, out.0-1: cuda:1, x: cpu}\n"),
    "automatic placement": dict(extra="""
        placement:
          auto: {devices: [cuda:0, cuda:1], balance: memory,
                 capacity: {cuda:0: 40GiB, cuda:1: 1.5e9}, speed: {cuda:1: 2.0}}
        """),
    "pipeline": dict(extra="pipeline: {microbatches: 4, schedule: gpipe, checkpoint: [cuda:0]}\n"),
    "train: short forms": dict(extra="""
        train: {loss: MSELoss, optimizer: AdamW, scheduler: cosine, amp: off,
                data: data/train.npz, eval_data: mydata.text:make, no_decay: [biases, norms]}
        """),
    "train: long forms": dict(extra="""
        train:
          loss: {op: CrossEntropyLoss, label_smoothing: 0.1, class_dim: -1}
          optimizer: {op: AdamW, lr: 3.0e-4, betas: [0.9, 0.95]}
          scheduler: {op: StepLR, warmup: 10, step_size: 30}
          data: {factory: mydata.text:make, split: train}
          eval_data: {path: data/eval.pt}
          grad_clip: 1.0
          eval_split: 0.1
          dims: {seq: 128}
          amp: bf16
        """),
    "train: a loss per output": dict(extra="""
        train: {loss: {fc: CrossEntropyLoss, out: {op: HuberLoss, delta: 0.5}}}
        """),
    "top-level init and imports": dict(extra="""
        init: {Linear: {weight: {kaiming_normal: {mode: fan_out}}, bias: zeros}}
        imports: [mylayers]
        """),
}


@pytest.mark.parametrize("form", DOCUMENTED)
def test_the_documented_forms_are_valid(form):
    loaded = spec(**DOCUMENTED[form])
    assert loader_accepts(loaded)
    assert schema_errors(loaded.data) == []


#: Mistakes the schema refuses as the loader does, and where and what the
#: schema says (the start of its message, as an editor shows it).
MISTAKES = {
    "a misspelled top-level key": (
        dict(extra="output: out\n"),
        ": Additional properties are not allowed ('output' was unexpected)"),
    "a misspelled layer key that cannot be a keyword argument": (
        dict(layer="  out: {op: Linear, args: [20, 10], batch-first: true}"),
        "layers.out: 'batch-first' does not match any of the regexes"),
    "a misspelled layer key whose value is no argument": (
        dict(layer="  out: {op: Linear, args: [20, 10], cal: {is_causal: true}}"),
        "layers.out.cal: {'is_causal': True} is not valid"),
    "a misspelled input key": (dict(extra="inputs: {x: {shap: [batch, 10]}}\n"),
                               "inputs.x: {'shap': ['batch', 10]} is not valid"),
    "a misspelled train key": (
        dict(extra="train: {optimiser: SGD}\n"),
        "train: Additional properties are not allowed ('optimiser' was unexpected)"),
    "a misspelled auto placement key": (dict(extra="placement: {auto: {device: [cuda:0]}}\n"),
                                        "placement.auto: {'device': ['cuda:0']} is not valid"),
    "the version as a string": (dict(extra="mpgen: '1'\n"), "mpgen: 1 was expected"),
    "args not a list": (dict(layer="  out: {op: Linear, args: 20}"),
                        "layers.out.args: 20 is not of type 'array'"),
    "a repeat of 0": (dict(layer="  out: {op: Linear, args: [20, 10], repeat: 0}"),
                      "layers.out.repeat: 0 is less than the minimum of 1"),
    "a nested mapping as an argument": (dict(layer="  out: {op: Linear, args: [20, {n: 10}]}"),
                                        "layers.out.args.1: {'n': 10} is not valid"),
    "an unknown dtype": (dict(extra="inputs: {x: {shape: [batch], dtype: float64}}\n"),
                         "inputs.x.dtype: 'float64' is not one of"),
    "a device misspelled": (dict(extra="placement: {fc: cuda0}\n"),
                            "placement.fc: 'cuda0' does not match"),
    "a batch size of 0": (dict(extra="train: {batch_size: 0}\n"),
                          "train.batch_size: 0 is less than the minimum of 1"),
    "an unknown amp": (dict(extra="train: {amp: bf17}\n"), "train.amp: 'bf17' is not one of"),
    "a no_decay kind twice": (dict(extra="train: {no_decay: [biases, biases]}\n"),
                              "train.no_decay: ['biases', 'biases'] has non-unique elements"),
    "a memory size in words": (
        dict(extra="placement: {auto: {devices: [cuda:0], capacity: {cuda:0: lots}}}\n"),
        "placement.auto.capacity.cuda:0: 'lots' does not match"),
    "a data file of an unknown kind": (dict(extra="train: {data: data/train.csv}\n"),
                                       "train.data: 'data/train.csv' is not valid"),
    "inputs as a list": (dict(extra="inputs: [x]\n"), "inputs: ['x'] is not of type 'object'"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_are_refused_by_the_schema_and_the_loader(mistake):
    where, message = MISTAKES[mistake]
    loaded = spec(**where)
    assert not loader_accepts(loaded)
    errors = schema_errors(loaded.data)
    assert any(error.startswith(message) for error in errors), errors


# --------------------------------------------------------------------------
# drawn specs: the schema is never stricter than the loader


def judge(text: str) -> None:
    try:
        loaded = load_text(text, "spec.yaml")
    except MpgenError:
        return  # refused as YAML: no data for the schema
    accepted = assert_never_stricter(loaded, text)
    if not accepted and "unknown key" in loader_error(loaded):
        assert schema_errors(loaded.data), f"an unknown key the schema accepts:\n{text}"


@pytest.mark.slow
@settings(max_examples=300)
@given(mutated_examples())
def test_mutated_examples(case):
    judge(case[1])


@pytest.mark.slow
@settings(max_examples=200)
@given(random_layers())
def test_random_layers(data):
    judge(dump(data))


@pytest.mark.slow
@pytest.mark.parametrize("documents", [TREES, SPEC_TREES], ids=["any", "spec_shaped"])
def test_random_yaml_trees(documents):
    @settings(max_examples=200)
    @given(documents)
    def random_tree(data):
        judge(dump(data))

    random_tree()


@pytest.mark.slow
def test_every_example_with_one_key_removed():
    """Each optional key of each example left out, each required one missing:
    the schema and the loader agree on every one."""
    for path in EXAMPLES:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        for key in list(data):
            smaller = copy.deepcopy(data)
            del smaller[key]
            loaded = load_text(dump(smaller), "spec.yaml")
            accepted = assert_never_stricter(loaded)
            assert accepted == (not schema_errors(loaded.data)), (path.name, key)
