"""``--set KEY=VALUE`` is checked exactly as the spec's ``train:`` is
(NOTE [Overrides checked as the spec] in mpgen/runtime/settings.py): for
many keys and good and bad values, the runtime's verdict is compared with a
real build of the spec with that value edited in. The runtime accepts what
the build accepts, refuses what it refuses with the build's message, and
where it asks for a rebuild, the build takes the value."""

from __future__ import annotations

import copy

import pytest
import yaml

from mpgen.compiler.codegen.train import settings as script_settings
from mpgen.compiler.driver import compile_spec
from mpgen.errors import MpgenError
from mpgen.runtime import settings as runtime
from mpgen.spec_schema.load import load_text

pytestmark = pytest.mark.slow  # a build per case

BASE = """\
mpgen: 1
name: Tiny
inputs: {x: [batch, 4]}
layers:
  fc: {op: Linear, args: [4, 3]}
"""
#: Two specs' train: sections, between them every kind of setting.
TRAINS = {
    "adamw_cosine": {
        "loss": {"op": "CrossEntropyLoss"},
        "optimizer": {"op": "AdamW", "lr": 0.001, "weight_decay": 0.1},
        "no_decay": ["biases"],
        "scheduler": {"op": "cosine", "warmup": 2, "min_lr": 0.0001},
        "batch_size": 4,
        "steps": 3,
    },
    "sgd_steplr": {
        "loss": "MSELoss",
        "optimizer": {"op": "SGD", "lr": 0.1, "momentum": 0.9},
        "scheduler": {"op": "StepLR", "step_size": 2},
        "grad_clip": 1.0,
        "steps": 3,
    },
}
#: (spec, KEY, VALUE as written after --set ...=).
CASES = [
    ("adamw_cosine", "optimizer.weight_decay", "0.05"),
    ("adamw_cosine", "optimizer", "{op: AdamW, weight_decay: 0.05}"),
    ("adamw_cosine", "optimizer", "{op: AdamW, weight_decay: 0}"),
    ("adamw_cosine", "scheduler", "{op: linear, warmup: 3}"),
    ("adamw_cosine", "loss", "{op: CrossEntropyLoss, label_smoothing: 0.2}"),
    ("adamw_cosine", "optimizer.wieght_decay", "0.05"),
    ("adamw_cosine", "optimizer.weight_decay", "-1"),
    ("adamw_cosine", "optimizer.weight_decay", "abc"),
    ("adamw_cosine", "optimizer.weight_decay", "0"),
    ("adamw_cosine", "optimizer.betas", "[0.9, 0.95]"),
    ("adamw_cosine", "optimizer.betas", "[0.9]"),
    ("adamw_cosine", "optimizer.betas", "[0.9, 1.5]"),
    ("adamw_cosine", "optimizer.eps", "1e-6"),
    ("adamw_cosine", "optimizer.amsgrad", "true"),
    ("adamw_cosine", "optimizer.capturable", "true"),
    ("adamw_cosine", "optimizer.lr", "3.0e-4"),
    ("adamw_cosine", "optimizer.lr", "-0.1"),
    ("adamw_cosine", "optimizer.lr", ".inf"),
    ("adamw_cosine", "optimizer.lr", "fast"),
    ("adamw_cosine", "optimizer.op", "Adamm"),
    ("adamw_cosine", "loss.label_smoothing", "0.1"),
    ("adamw_cosine", "loss.label_smoothing", "2"),
    ("adamw_cosine", "loss.label_smothing", "0.1"),
    ("adamw_cosine", "loss.reduction", "sum"),
    ("adamw_cosine", "loss.reduction", "none"),
    ("adamw_cosine", "loss.reduction", "bogus"),
    ("adamw_cosine", "loss.op", "CrossEntropyLos"),
    ("adamw_cosine", "scheduler.warmup", "10"),
    ("adamw_cosine", "scheduler.warmup", "-1"),
    ("adamw_cosine", "scheduler.warmup", "1.5"),
    ("adamw_cosine", "scheduler.min_lr", "0.00001"),
    ("adamw_cosine", "scheduler.min_lr", "-1"),
    ("adamw_cosine", "scheduler.min_lrr", "0.1"),
    ("adamw_cosine", "scheduler.op", "linear"),
    ("adamw_cosine", "scheduler.op", "cosin"),
    ("adamw_cosine", "no_decay", "[biases, norms]"),
    ("adamw_cosine", "no_decay", "[bias]"),
    ("adamw_cosine", "no_decay", "[biases, biases]"),
    ("adamw_cosine", "batch_size", "8"),
    ("adamw_cosine", "batch_size", "0"),
    ("adamw_cosine", "batch_size", "1.5"),
    ("adamw_cosine", "batch_size", "3000000000"),
    ("adamw_cosine", "batch_siz", "8"),
    ("adamw_cosine", "steps", "0"),
    ("adamw_cosine", "steps", "true"),
    ("adamw_cosine", "epochs", "2"),
    ("adamw_cosine", "epochs", "null"),
    ("adamw_cosine", "seed", "99999999999999999999999"),
    ("adamw_cosine", "seed", "-5"),
    ("adamw_cosine", "log_every", "0"),
    ("adamw_cosine", "grad_clip", "0.5"),
    ("adamw_cosine", "grad_clip", "0"),
    ("adamw_cosine", "grad_clip", "null"),
    ("adamw_cosine", "grad_clip", ".nan"),
    ("adamw_cosine", "amp", "bf16"),
    ("adamw_cosine", "amp", "off"),
    ("adamw_cosine", "amp", "bf17"),
    ("adamw_cosine", "accumulate", "2"),
    ("adamw_cosine", "accumulate", "0"),
    ("adamw_cosine", "eval_every", "-1"),
    ("adamw_cosine", "eval_split", "0.1"),
    ("adamw_cosine", "eval_split", "1"),
    ("adamw_cosine", "samples", "64"),
    ("adamw_cosine", "samples", "99999999999"),
    ("adamw_cosine", "workers", "300"),
    ("adamw_cosine", "data", "data/train.npz"),
    ("adamw_cosine", "data", "data/train.csv"),
    ("sgd_steplr", "optimizer.momentum", "0.5"),
    ("sgd_steplr", "optimizer.momentum", "-0.5"),
    ("sgd_steplr", "optimizer.nesterov", "true"),
    ("sgd_steplr", "optimizer.momentun", "0.5"),
    ("sgd_steplr", "optimizer.weight_decay", "0.01"),
    ("sgd_steplr", "scheduler.step_size", "5"),
    ("sgd_steplr", "scheduler.step_size", "five"),
    ("sgd_steplr", "scheduler.gamma", "0.5"),
    ("sgd_steplr", "scheduler.gama", "0.5"),
    ("sgd_steplr", "scheduler.min_lr", "0.1"),
    ("sgd_steplr", "loss.reduction", "sum"),
    ("sgd_steplr", "loss.delta", "1.0"),
    ("sgd_steplr", "grad_clip", "2"),
    ("sgd_steplr", "no_decay", "[norms]"),
    ("sgd_steplr", "optimizer.op", "Adam"),
    ("sgd_steplr", "loss.op", "L1Loss"),
    ("sgd_steplr", "scheduler.op", "ExponentialLR"),
    ("sgd_steplr", "scheduler.op", "LambdaLR"),
    ("adamw_cosine", "dims.seq", "8"),
    ("adamw_cosine", "dims.batch", "8"),
    ("adamw_cosine", "dims.batch", "0"),
    ("adamw_cosine", "metrics", "[accuracy]"),
    ("adamw_cosine", "loss.class_dim", "1"),
    ("adamw_cosine", "loss.ignore_index", "0"),
    ("adamw_cosine", "monitor", "eval_accuracy"),
    ("adamw_cosine", "monitor", "eval_acuracy"),
    ("adamw_cosine", "monitor", "3"),
    ("sgd_steplr", "monitor", "eval_loss"),
    ("sgd_steplr", "monitor_mode", "maxx"),
    ("sgd_steplr", "monitor_mode", "max"),
    ("adamw_cosine", "keep_last", "0"),
    ("adamw_cosine", "keep_last", "3"),
    ("adamw_cosine", "early_stop", "-1"),
    ("adamw_cosine", "early_stop", "5"),
]


def edited(train: dict, key: str, value) -> dict:
    """``train`` with the dotted ``key`` set to ``value``, a name-only call
    (``loss: MSELoss``) opened into ``{op: MSELoss}`` on the way."""
    train = copy.deepcopy(train)
    node, parts = train, key.split(".")
    for part in parts[:-1]:
        if isinstance(node.get(part), str):
            node[part] = {"op": node[part]}
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return train


def build_verdict(tmp_path, train: dict) -> str:
    spec = tmp_path / "spec.yaml"
    spec.write_text(BASE + yaml.safe_dump({"train": train}, sort_keys=False))
    try:
        compile_spec(spec, {"cuda:0": "cpu"})
    except MpgenError as error:
        return error.message
    return "ok"


def runtime_verdict(spec_settings: dict, key: str, value, columns: tuple) -> str:
    try:
        new = runtime.changed(spec_settings, key, value)
        runtime.check_names(new)
        runtime.check(new, ("batch",), ("cpu",), columns)
        if runtime.need_rebuild(spec_settings, new) is not None:
            return "rebuild"
    except runtime.Refused as error:
        return str(error)
    except runtime.Rebuild:
        return "rebuild"
    return "ok"


@pytest.fixture(scope="module")
def spec_settings(tmp_path_factory) -> dict:
    """Each spec's settings as its generated script holds them."""
    found = {}
    for name, train in TRAINS.items():
        folder = tmp_path_factory.mktemp(name)
        spec = folder / "spec.yaml"
        spec.write_text(BASE + yaml.safe_dump({"train": train}, sort_keys=False))
        graph = compile_spec(spec, {"cuda:0": "cpu"})
        found[name] = script_settings(graph), graph.train.eval_columns()
    return found


@pytest.mark.parametrize("name, key, text", CASES, ids=[f"{c[0]}:{c[1]}={c[2]}" for c in CASES])
def test_a_set_is_judged_as_the_build_judges_the_spec(tmp_path, spec_settings, name, key, text):
    value = load_text(f"v: {text}\n", "value.yaml").data["v"]
    assert runtime.parse_value(text) == value or value != value  # the spec's YAML (nan aside)
    settings, columns = spec_settings[name]
    ours = runtime_verdict(settings, key, runtime.parse_value(text), columns)
    theirs = build_verdict(tmp_path, edited(TRAINS[name], key, value))
    if ours == "rebuild":
        assert theirs == "ok", theirs  # the rebuild it names succeeds
    else:
        assert ours == theirs
