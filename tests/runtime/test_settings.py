"""``--set KEY=VALUE`` in process (mpgen/runtime/settings.py): VALUE read as
the spec's YAML, the schema's keys and bounds kept equal to the pydantic
models', the flags it sets, its one-line refusals, what --resume does with
a changed override, and --help's defaults. A build's verdict on the same
values: test_settings_as_spec.py."""

from __future__ import annotations

from types import SimpleNamespace

import annotated_types
import pytest
import torch
from torch import nn

from mpgen.runtime import flags, settings
from mpgen.spec_schema.load import load_text
from mpgen.spec_schema.models import TrainSpec

from tiny import STAGES, training

SETTINGS = {
    "loss": {"op": "CrossEntropyLoss"},
    "optimizer": {"op": "AdamW", "lr": 0.1, "weight_decay": 0.01},
    "batch_size": 4,
    "steps": 6,
    "seed": 0,
    "log_every": 1,
    "dims": {},
    "epochs": None,
    "scheduler": {"op": "cosine", "warmup": 0},
    "grad_clip": None,
    "accumulate": 1,
    "amp": "off",
    "no_decay": [],
    "data": None,
    "eval_data": None,
    "eval_every": 0,
    "eval_split": 0.0,
    "samples": 64,
    "workers": 0,
}


def parsed(argv: list[str], pipeline=None):
    """The flags of the tiny script with ``argv``, --set applied."""
    made = training(settings=SETTINGS)
    parser = flags.parser(made, pipeline)
    args = parser.parse_args(argv)
    settings.apply(parser, args, made, pipeline=pipeline is not None, argv=argv)
    return args


def refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        parsed(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line
    return err


@pytest.mark.parametrize("text", [
    "0.05", "1e-3", "1.0e-3", "-1", "0x10", "1_000", ".inf", "-.inf", "off", "On", "yes",
    "null", "~", "true", "cosine", "data/train.npz", "pkg.mod:make", "'quoted, text'",
    '"a\\tb"', "[0.9, 0.95]", "[0.9,0.95]", "[]", "{op: StepLR, step_size: 10}",
    "{op: cosine, warmup: 5, min_lr: 1.0e-5}", "[biases, norms]", "[[1, 2], [3]]",
])
def test_a_value_reads_as_the_spec_reads_it(text):
    assert settings.parse_value(text) == load_text(f"v: {text}\n", "v.yaml").data["v"]


@pytest.mark.parametrize("text", ["[0.9, 0.95", "{op: StepLR", "'open", "[1] x"])
def test_a_value_that_is_not_yaml_is_refused(text):
    with pytest.raises(ValueError):
        settings.parse_value(text)


def test_the_keys_and_integer_bounds_are_the_schemas():
    assert settings.TRAIN_KEYS == tuple(TrainSpec.model_fields)
    for key, (least, most) in settings.INTEGERS.items():
        bounds = {type(m): m for m in TrainSpec.model_fields[key].metadata}
        ge, le = bounds.get(annotated_types.Ge), bounds.get(annotated_types.Le)
        assert (ge.ge if ge else None, le.le if le else None) == (least, most), key
    nullable = [k for k, f in TrainSpec.model_fields.items() if f.default is None]
    assert set(settings.NULLABLE) == set(nullable) - {"metrics"}


def test_a_setting_that_is_a_flag_sets_it_and_the_rest_go_into_args_settings():
    args = parsed(["--set", "steps=3", "--set", "optimizer.lr=0.5", "--set", "grad_clip=2",
                   "--set", "optimizer.betas=[0.8, 0.9]", "--set", "scheduler.warmup=2"])
    assert (args.steps, args.lr, args.grad_clip) == (3, 0.5, 2.0)
    assert args.settings["optimizer"] == {"op": "AdamW", "lr": 0.5, "weight_decay": 0.01,
                                          "betas": [0.8, 0.9]}
    assert args.settings["scheduler"]["warmup"] == 2 and args.settings["steps"] == 3
    assert args.overrides == ["steps=3", "optimizer.lr=0.5", "grad_clip=2",
                              "optimizer.betas=[0.8, 0.9]", "scheduler.warmup=2"]


def test_set_steps_is_a_built_in_schedules_length_too_as_the_specs_steps_are():
    made = training(settings=SETTINGS, defaults=training().defaults | {"decay_steps": 6})
    parser = flags.parser(made)
    args = parser.parse_args(["--set", "steps=40"])
    settings.apply(parser, args, made, argv=["--set", "steps=40"])
    assert (args.steps, args.decay_steps) == (40, 40)
    argv = ["--set", "steps=40", "--decay-steps", "9"]
    args = parser.parse_args(argv)
    settings.apply(parser, args, made, argv=argv)
    assert (args.steps, args.decay_steps) == (40, 9)


def test_a_whole_optimizer_without_lr_has_its_classs_default_as_in_a_spec():
    args = parsed(["--set", "optimizer={op: AdamW, weight_decay: 0.05}"])
    assert args.lr == 0.001 and args.settings["optimizer"]["weight_decay"] == 0.05


def test_without_set_the_settings_are_the_specs_with_the_flags_values():
    args = parsed(["--steps", "2", "--lr", "0.3"])
    assert args.overrides == [] and args.settings["steps"] == 2
    assert args.settings["optimizer"]["lr"] == 0.3
    assert SETTINGS["steps"] == 6  # the script's own copy is untouched


def test_a_misspelled_key_is_one_line_with_the_did_you_mean(capsys):
    err = refusal(capsys, ["--set", "optimizer.wieght_decay=0.05"])
    assert err.endswith(": error: --set optimizer.wieght_decay=0.05: train.optimizer: unknown "
                        "keyword argument 'wieght_decay' for AdamW (did you mean "
                        "'weight_decay'?)\n")
    err = refusal(capsys, ["--set", "lerning_rate=3"])
    assert "unknown key 'lerning_rate' in train" in err


@pytest.mark.parametrize("item, said", [
    ("optimizer.weight_decay", "expected KEY=VALUE"),
    ("optimizer.betas=[0.9", "VALUE is read as YAML: ']' is missing"),
    ("batch_size=0", "train.batch_size: must be greater than or equal to 1, got 0"),
    ("amp=bf17", "(did you mean 'bf16'?)"),
    ("loss.label_smoothing=2", "CrossEntropyLoss cannot be computed with label_smoothing=2"),
])
def test_a_bad_value_names_the_flag_and_what_the_spec_accepts(capsys, item, said):
    err = refusal(capsys, ["--set", item])
    assert f"error: --set {item}: " in err and said in err


@pytest.mark.parametrize("item, what", [
    ("optimizer.op=SGD", "train.optimizer's class"),
    ("loss=MSELoss", "train.loss's op"),
    ("scheduler={op: StepLR, step_size: 2}", "train.scheduler's kind"),
    ("metrics=[accuracy]", "train.metrics"),
])
def test_a_change_that_needs_code_names_the_rebuild(capsys, item, what):
    err = refusal(capsys, ["--set", item])
    assert what in err
    assert "mpgen train tiny.yaml -- ARGS" in err and "-o build/" in err
    assert "generated" not in err


def test_a_flag_and_a_set_of_the_same_setting_are_refused(capsys):
    err = refusal(capsys, ["--steps", "4", "--set", "steps=3"])
    assert "--steps 4 sets train.steps too; give one" in err
    assert parsed(["--steps", "3", "--set", "steps=3"]).steps == 3  # the same: no conflict


def test_the_pipeline_program_refuses_fp16(capsys):
    with pytest.raises(SystemExit):
        parsed(["--set", "amp=fp16"], STAGES)
    assert "bf16 or not at all" in capsys.readouterr().err


def test_resume_says_a_changed_override_and_applies_it_to_the_optimizer():
    before = parsed(["--set", "optimizer.weight_decay=0.05"])
    now = parsed(["--set", "optimizer.weight_decay=0.2"])
    params = [nn.Parameter(torch.zeros(2))]
    saved = torch.optim.AdamW(params, lr=0.1, weight_decay=0.05).state_dict()
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.2)
    fresh = settings.hyperparameters(optimizer)
    optimizer.load_state_dict(saved)  # torch brings back the checkpoint's 0.05
    record = settings.record(before)
    settings.reapply(optimizer, fresh, record, now)
    assert optimizer.param_groups[0]["weight_decay"] == 0.2
    assert settings.on_resume(record, now) == [
        "--resume: optimizer.weight_decay is 0.2 in this run, 0.05 in the checkpoint's"]
    assert settings.on_resume(record, before) == []


def test_help_shows_every_flags_default():
    text = flags.parser(training(settings=SETTINGS)).format_help()
    flat = " ".join(text.split())
    for shown in ("base learning rate (the schedule scales it) (default: 0.1)",
                  "every RNG (default: 0)", "at the last (default: 1)", "--steps STEPS optimizer steps (default: 6)",
                  "--batch-size BATCH_SIZE samples per step", "(default: 4)"):
        assert shown in flat


def test_a_loss_per_output_is_set_by_its_output():
    each = SETTINGS | {"loss": {"cls": {"op": "CrossEntropyLoss"}, "reg": {"op": "HuberLoss"}}}
    new = settings.changed(each, "loss.reg.delta", 2.0)
    settings.check(new)
    assert new["loss"]["reg"] == {"op": "HuberLoss", "delta": 2.0}
    assert settings.changed(each, "loss.reg", "HuberLoss")["loss"]["reg"] == {"op": "HuberLoss"}
    with pytest.raises(settings.Refused, match=r"'rg' is not an output \(did you mean 'reg'\?\)"):
        settings.changed(each, "loss.rg.delta", 2.0)
    with pytest.raises(settings.Rebuild, match="train.loss's outputs"):
        settings.changed(each, "loss.label_smoothing", 0.1)
    with pytest.raises(settings.Refused, match="HuberLoss cannot be computed with delta=-1"):
        settings.check(settings.changed(each, "loss.reg.delta", -1))


@pytest.mark.parametrize("warmup", [0, 2])
def test_resume_applies_a_changed_argument_of_a_torch_schedule(warmup):
    def made(step_size: int, warmup: int):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
        main = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size)
        if not warmup:
            return main
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, 1 / (warmup + 1), total_iters=warmup)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, main], [warmup])

    each = SETTINGS | {"scheduler": {"op": "StepLR", "warmup": warmup, "step_size": 2}}
    before = SimpleNamespace(settings=each, overrides=["scheduler.step_size=2"])
    now_settings = settings.changed(each, "scheduler.step_size", 5)
    later = warmup + 1 if warmup else 0  # from none to some is a rebuild, not a resume
    now_settings["scheduler"]["warmup"] = later
    now = SimpleNamespace(settings=now_settings, overrides=["scheduler.step_size=5"])
    old = made(2, warmup)
    for _ in range(3):
        old.optimizer.step()
        old.step()
    scheduler = made(5, later)
    fresh = settings.schedule_state(scheduler)
    scheduler.load_state_dict(old.state_dict())  # the checkpoint's step_size 2 comes back
    settings.reapply_schedule(scheduler, fresh, settings.record(before), now)
    main = scheduler._schedulers[1] if warmup else scheduler
    assert main.step_size == 5
    if warmup:
        assert scheduler._milestones == [later]
        assert scheduler._schedulers[0].total_iters == later
