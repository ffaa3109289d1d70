"""The ``train:`` keys of issue 11 resolve into ``TrainConfig``; each bad value
is refused at its key.

Each accepted form is compiled (``driver.compile_spec``: everything up to
the placed IR) and its ``TrainConfig`` compared; refusals run the CLI
(``mpgen build``: exit 2, nothing written) and compare the whole message with
its position. ``tests/errors/train_*`` holds more refusals, several to a spec.
The class dim of a class-index loss is PyTorch's (dim 1), the last dim for a
language model's ``[batch, seq, vocab]``, or the loss's ``class_dim:``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from helpers import ROOT, write_factory, write_spec
from mpgen.compiler import driver
from mpgen.compiler.frontend.training import scheduler_names
from mpgen.compiler.ir import DataSource, Scheduler, TrainConfig
from mpgen.errors import MpgenError
from test_training_specs import MODEL, build, refused

#: The fields issue 11 adds, and their defaults: a spec without them builds
#: the code it built before.
NEW_FIELDS = ("epochs", "steps_given", "scheduler", "grad_clip", "accumulate", "amp",
              "no_decay", "data", "eval_data", "eval_every", "eval_split", "samples", "workers")


def train_config(tmp_path, train: str, model: str = MODEL) -> TrainConfig:
    """The resolved ``train:`` of ``model`` with ``train`` (YAML lines under it)."""
    text = model + ("train:\n" + train if train else "")
    return driver.compile_spec(write_spec(tmp_path, text)).train


def new_settings(config: TrainConfig) -> dict:
    return {name: getattr(config, name) for name in NEW_FIELDS}


def test_without_the_new_keys_every_setting_is_the_irs_default(tmp_path):
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in NEW_FIELDS}
    assert new_settings(train_config(tmp_path, "")) == defaults
    assert new_settings(train_config(tmp_path, "  loss: MSELoss\n  steps: 5\n")) == defaults


def test_every_key_resolves(tmp_path):
    write_factory(tmp_path, "mydata.text:make")
    config = train_config(tmp_path, """\
  optimizer: {op: AdamW, lr: 3.0e-4, weight_decay: 0.1}
  steps: 50
  epochs: 3
  scheduler: {op: cosine, warmup: 100, min_lr: 6.0e-5}
  grad_clip: 1
  accumulate: 4
  amp: bf16
  no_decay: [biases, norms, embeddings]
  data: {factory: "mydata.text:make", split: train, root: data, sizes: [1, 2]}
  eval_data: data/eval.npz
  eval_every: 100
  samples: 64
  workers: 2
""")
    assert new_settings(config) == {
        "epochs": 3, "steps_given": True, "scheduler": Scheduler("cosine", (), 100, 6.0e-5),
        "grad_clip": 1.0, "accumulate": 4, "amp": "bf16",
        "no_decay": ("biases", "norms", "embeddings"),
        "data": DataSource(factory="mydata.text:make",
                           kwargs=(("split", "train"), ("root", "data"), ("sizes", [1, 2]))),
        "eval_data": DataSource(path="data/eval.npz"), "eval_every": 100, "eval_split": 0.0,
        "samples": 64, "workers": 2,
    }
    assert isinstance(config.grad_clip, float)
    assert config.optimizer_kwargs == (("weight_decay", 0.1),)


@pytest.mark.parametrize("train, epochs, steps, steps_given", [
    ("", None, 100, True),  # neither: 100 steps
    ("  steps: 7\n", None, 7, True),
    ("  epochs: 3\n", 3, 100, False),  # epochs alone: the script has no default step count
    ("  epochs: 3\n  steps: 7\n", 3, 7, True),  # both: whichever ends first
])
def test_steps_given_says_whether_steps_bound_the_run(tmp_path, train, epochs, steps,
                                                      steps_given):
    config = train_config(tmp_path, train)
    assert (config.epochs, config.steps, config.steps_given) == (epochs, steps, steps_given)


@pytest.mark.parametrize("written, scheduler", [
    ("cosine", Scheduler("cosine")),
    ("{op: linear, warmup: 10}", Scheduler("linear", warmup=10)),
    ("{op: constant, warmup: 5, min_lr: 0}", Scheduler("constant", warmup=5)),
    ("{op: StepLR, step_size: 30, gamma: 0.1, warmup: 5}",
     Scheduler("StepLR", (("step_size", 30), ("gamma", 0.1)), warmup=5)),
    ("{op: OneCycleLR, max_lr: 0.1, total_steps: 100}",
     Scheduler("OneCycleLR", (("max_lr", 0.1), ("total_steps", 100)))),
    # ReduceLROnPlateau's own min_lr, one per parameter group or one for all
    ("{op: ReduceLROnPlateau, mode: max, min_lr: [1.0e-5]}",
     Scheduler("ReduceLROnPlateau", (("mode", "max"), ("min_lr", [1.0e-5])))),
    ("{op: ReduceLROnPlateau, min_lr: [1.0e-5, 0]}\n  no_decay: [norms]",  # two groups
     Scheduler("ReduceLROnPlateau", (("min_lr", [1.0e-5, 0]),))),
    ("{op: CyclicLR, base_lr: 0.001, max_lr: 0.1}",  # cycles AdamW's betas
     Scheduler("CyclicLR", (("base_lr", 0.001), ("max_lr", 0.1)))),
])
def test_a_scheduler_resolves(tmp_path, written, scheduler):
    config = train_config(tmp_path, f"  optimizer: AdamW\n  scheduler: {written}\n")
    assert config.scheduler == scheduler


def test_a_spec_may_name_every_torch_schedule_but_those_taking_code():
    names = scheduler_names()
    assert {"StepLR", "MultiStepLR", "CosineAnnealingLR", "OneCycleLR", "ReduceLROnPlateau",
            "PolynomialLR", "LinearLR"} <= set(names)
    assert not {"SequentialLR", "ChainedScheduler", "LambdaLR", "MultiplicativeLR",
                "LRScheduler", "_LRScheduler"} & set(names)
    assert not set(Scheduler.BUILT_IN) & set(names)


@pytest.mark.parametrize("written, amp", [("off", "off"), ("false", "off"), ("'off'", "off"),
                                          ("bf16", "bf16"), ("fp16", "fp16")])
def test_amp(tmp_path, written, amp):
    """YAML reads a bare ``off`` as false: both mean off."""
    assert train_config(tmp_path, f"  amp: {written}\n").amp == amp


@pytest.mark.parametrize("optimizer", ["AdamW", "{op: SGD, weight_decay: 0.01}",
                                       "{op: Adam, weight_decay: 1}"])
def test_no_decay_with_weight_decay(tmp_path, optimizer):
    config = train_config(tmp_path, f"  optimizer: {optimizer}\n  no_decay: [norms]\n")
    assert config.no_decay == ("norms",)


@pytest.mark.parametrize("written, source", [
    ("data/train.npz", DataSource(path="data/train.npz")),
    ("/abs/train.safetensors", DataSource(path="/abs/train.safetensors")),
    ("train.pth", DataSource(path="train.pth")),
    ("mydata:make", DataSource(factory="mydata:make")),
    ("pkg.sub.mod:build_set", DataSource(factory="pkg.sub.mod:build_set")),
    ("{path: data/train.pt}", DataSource(path="data/train.pt")),
    ("{factory: 'mydata:make', split: train, n: 3, shuffle: false, extra: null}",
     DataSource(factory="mydata:make",
                kwargs=(("split", "train"), ("n", 3), ("shuffle", False), ("extra", None)))),
])
def test_data_sources(tmp_path, written, source):
    if source.factory:
        write_factory(tmp_path, source.factory)
    config = train_config(tmp_path, f"  data: {written}\n  eval_data: {written}\n")
    assert config.data == config.eval_data == source
    assert config.data.text == (source.path or source.factory)


def test_eval_split(tmp_path):
    config = train_config(tmp_path, "  data: d.pt\n  eval_split: 0.25\n  eval_every: 10\n")
    assert (config.eval_split, config.eval_every) == (0.25, 10)


def test_a_factory_is_never_imported_at_build_time(tmp_path):
    """A spec must never make mpgen run code: the module a factory names is
    read and parsed under the import policy, never run, even when it is
    right there beside the spec."""
    (tmp_path / "mydata.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('ran').write_text('x')\n"
        "def make():\n    return None\n")
    code, err = build(tmp_path, MODEL + "train: {data: 'mydata:make', eval_data: "
                      "{factory: 'mydata:make', split: test}}\n", "--device-map", "cpu")
    assert code == 0, err
    assert not (tmp_path / "ran").exists()


OWN = ("a data factory is a function of your own module, in the project or in a package "
       "listed under 'imports:', e.g. 'mydata:make'")


@pytest.mark.parametrize("factory, message", [
    # The training script would run these: a shell command, code, a package's function.
    ("os:system", f"'os:system' is in the standard library; {OWN}"),
    ("subprocess:run", f"'subprocess:run' is in the standard library; {OWN}"),
    ("builtins:eval", f"'builtins:eval' is in the standard library; {OWN}"),
    ("importlib.util:spec_from_file_location",
     f"'importlib.util:spec_from_file_location' is in the standard library; {OWN}"),
    ("torch.hub:load", f"'torch.hub:load' is in torch; {OWN}"),
    ("mpgen.cli:main", f"'mpgen.cli:main' is in mpgen; {OWN}"),
    ("yaml:load", "'yaml:load': 'yaml' is an installed package ({site}), outside the spec's "
                  "project ({root}); mpgen imports it only if the spec lists 'yaml' under "
                  "'imports:'"),
    ("pip.__main__:main", f"'pip.__main__:main' names a '__main__' module, a program's entry "
                          f"point; {OWN}"),
    ("mydata._impl:make", f"'mydata._impl:make' names a private module ('_impl'); {OWN}"),
    ("mydata:_make", f"'mydata:_make' names a private function ('_make'); {OWN}"),
    ("nothere:make", "unknown data factory 'nothere:make': no module 'nothere' in the spec's "
                     "project ({root}); put the module in the project, pass --root, or list "
                     "its package under 'imports:'"),
    ("mydata:load", "'mydata:load': mydata.py does not define 'load': a data factory is a "
                    "function its module defines with 'def load' (or a class) or imports "
                    "with 'from .module import load'"),
])
def test_a_factory_follows_the_import_policy_of_ops(tmp_path, factory, message):
    """train.data and train.eval_data name code the training script imports
    and runs: only a module of the project or of a package the spec lists
    (docs/spec.md, "User modules"), refused at the factory's value."""
    import yaml

    (tmp_path / ".git").mkdir()
    (tmp_path / "mydata.py").write_text("def make():\n    return None\n")
    err = refused(tmp_path, MODEL + f"train:\n  data: {{factory: '{factory}', command: "
                  f"'touch x'}}\n  eval_data: {factory}\n", "--device-map", "cpu")
    shown = message.format(root=tmp_path.resolve(),
                           site=Path(yaml.__file__).resolve().parent)
    assert err.splitlines() == [f"spec.yaml:8:19: train.data: {shown}",
                                f"spec.yaml:9:14: train.eval_data: {shown}"]
    assert not (tmp_path / "x").exists()


def test_a_factory_of_a_listed_package_or_reexported_in_the_project(tmp_path, monkeypatch):
    site = tmp_path / "site"
    write_factory(site, "extdata.sets:make")
    (site / "extdata" / "__init__.py").write_text("from .sets import make\n")
    monkeypatch.syspath_prepend(str(site))
    project = tmp_path / "project"
    write_factory(project, "mydata.text:load")
    (project / "mydata" / "__init__.py").write_text("from mydata.text import load as load\n")
    spec = MODEL + "train: {data: 'extdata:make', eval_data: 'mydata:load'}\n"
    with pytest.raises(MpgenError) as refusal:
        driver.compile_spec(write_spec(project, spec))
    assert str(refusal.value) == (
        f"{project / 'spec.yaml'}:7:15: train.data: 'extdata:make': 'extdata' is an installed "
        f"package ({(site / 'extdata').resolve()}), outside the spec's project "
        f"({project.resolve()}); mpgen imports it only if the spec lists 'extdata' under "
        "'imports:'")
    config = driver.compile_spec(write_spec(project, "imports: [extdata]\n" + spec)).train
    assert (config.data.factory, config.eval_data.factory) == ("extdata:make", "mydata:load")


# Single refusals, beside those of the fixtures (tests/errors/train_*).
@pytest.mark.parametrize("train, message", [
    ("scheduler: LambdaLR",
     "spec.yaml:7:20: train.scheduler: LambdaLR takes a Python function, which a spec cannot "
     "write; use a built-in schedule (cosine, linear, constant) or another "
     "torch.optim.lr_scheduler class (warmup: N adds a linear warmup to any of them)"),
    ("scheduler: {op: ChainedScheduler}",
     "spec.yaml:7:25: train.scheduler: ChainedScheduler chains other schedulers, which a spec "
     "cannot write; use a built-in schedule (cosine, linear, constant) or another "
     "torch.optim.lr_scheduler class (warmup: N adds a linear warmup to any of them)"),
    ("scheduler: LRScheduler",
     "spec.yaml:7:20: train.scheduler: LRScheduler is the base class of the schedules, not "
     "one, which a spec cannot write; use a built-in schedule (cosine, linear, constant) or "
     "another torch.optim.lr_scheduler class (warmup: N adds a linear warmup to any of "
     "them)"),
    ("scheduler: steplr",
     "spec.yaml:7:20: train.scheduler: unknown schedule 'steplr'; expected cosine, linear, "
     "constant or a torch.optim.lr_scheduler class (did you mean 'StepLR'?)"),
    ("scheduler: {op: CosineAnnealingLR, T_max: 10, min_lr: 0.001}",
     "spec.yaml:7:55: train.scheduler: unknown keyword argument 'min_lr' for "
     "CosineAnnealingLR (min_lr is for the built-in schedules)"),
    ("scheduler: {op: StepLR, step_size: 30, verbose: true}",
     "spec.yaml:7:48: train.scheduler: unknown keyword argument 'verbose' for StepLR"),
    ("scheduler: {op: StepLR}",
     "spec.yaml:7:25: train.scheduler: StepLR cannot be built: StepLR.__init__() missing 1 "
     "required positional argument: 'step_size'"),
    ("scheduler: {op: CosineAnnealingWarmRestarts, T_0: 0}",
     "spec.yaml:7:59: train.scheduler: CosineAnnealingWarmRestarts cannot be built with T_0=0: "
     "Expected positive integer T_0, but got 0"),
    ("scheduler: {op: ReduceLROnPlateau, mode: maxx}",
     "spec.yaml:7:50: train.scheduler: ReduceLROnPlateau cannot be built with mode='maxx': "
     "mode maxx is unknown!"),
    # with no_decay the script's optimizer has two parameter groups
    ("optimizer: AdamW, no_decay: [biases], scheduler: {op: ReduceLROnPlateau, min_lr: [0.001]}",
     "spec.yaml:7:90: train.scheduler: ReduceLROnPlateau cannot be built with min_lr=[0.001]: "
     "expected 2 min_lrs, got 1"),
    ("scheduler: {op: OneCycleLR, max_lr: 0.1}",
     "spec.yaml:7:25: train.scheduler: OneCycleLR cannot be built: You must define either "
     "total_steps OR (epochs AND steps_per_epoch)"),
    ("scheduler: {op: StepLR, step_size: 3, gamma: [0.5, x]}",
     "spec.yaml:7:54: train.scheduler: StepLR's gamma is a number (default 0.1), got "
     "[0.5, 'x']"),
    ("scheduler: {op: cosine, min_lr: .inf}",
     "spec.yaml:7:41: train.scheduler.min_lr: expected a finite number >= 0, got inf"),
    ("scheduler: {op: linear, warmup: 1.5}",
     "spec.yaml:7:41: train.scheduler.warmup: expected an integer, got 1.5"),
    ("scheduler: 3",
     "spec.yaml:7:20: train.scheduler: expected a schedule like 'cosine', {op: cosine, warmup: "
     "100} or {op: StepLR, step_size: 30}, got 3"),
    ("epochs: 1.5", "spec.yaml:7:17: train.epochs: expected an integer, got 1.5"),
    ("grad_clip: true", "spec.yaml:7:20: train.grad_clip: expected a number, got True"),
    ("grad_clip: .inf", "spec.yaml:7:20: train.grad_clip: expected a finite number, got inf"),
    ("grad_clip: 1" + "0" * 400,
     "spec.yaml:7:20: train.grad_clip: expected a finite number, got 1" + "0" * 55 + "...0"),
    ("accumulate: 2.0", "spec.yaml:7:21: train.accumulate: expected an integer, got 2.0"),
    ("amp: on", "spec.yaml:7:14: train.amp: expected one of off, bf16, fp16, got True"),
    ("amp: bf61",
     "spec.yaml:7:14: train.amp: expected one of off, bf16, fp16, got 'bf61' (did you mean "
     "'bf16'?)"),
    ("no_decay: norms", "spec.yaml:7:19: train.no_decay: expected a list, got 'norms'"),
    ("no_decay: [norms, biases, norms]",
     "spec.yaml:7:19: train.no_decay: 'norms' is listed twice"),
    ("optimizer: Rprop, no_decay: [norms]",
     "spec.yaml:7:37: train.no_decay: Rprop has no weight decay to keep parameters out of; "
     "use an optimizer with weight_decay, such as AdamW"),
    ("optimizer: Adam, no_decay: [norms]",
     "spec.yaml:7:36: train.no_decay: Adam's weight_decay defaults to 0, so no parameter "
     "decays; set train.optimizer.weight_decay (nanoGPT uses 0.1)"),
    ('data: "a\\nb.pt"',
     "spec.yaml:7:15: train.data: a data file's path has no NUL or line break, got 'a\\nb.pt'"),
    ("data: data/train",
     "spec.yaml:7:15: train.data: a data file ends in .pt, .pth, .npz or .safetensors, got "
     "'data/train' (a factory is written 'package.module:function')"),
    ("data: my.data:make.set",
     "spec.yaml:7:15: train.data: a data file ends in .pt, .pth, .npz or .safetensors, got "
     "'my.data:make.set' (a factory is written 'package.module:function')"),
    ("data: {path: x.pt, factory: 'a:b'}",
     "spec.yaml:7:16: train.data: give factory: or path:, not both"),
    ("data: {split: train}",
     "spec.yaml:7:15: train.data: expected factory: 'package.module:function' or path: FILE"),
    ("data: {factory: 'a:b', class: 3}",
     "spec.yaml:7:32: train.data: 'class' is a Python keyword, not a keyword argument name"),
    ("data: {factory: 'a:b', n: {k: 1}}",
     "spec.yaml:7:35: train.data.n: expected a scalar (number, string, bool, null) or a list "
     "of them, not a mapping"),
    ("data: [a.pt]",
     "spec.yaml:7:15: train.data: expected a file like data/train.npz, a factory "
     "'package.module:function', or {factory: 'package.module:function', KEYWORD: VALUE, ...}, "
     "got ['a.pt']"),
    ("eval_split: -0.1",
     "spec.yaml:7:21: train.eval_split: the fraction held out must be in [0, 1), got -0.1"),
    ("eval_split: '0.1'", "spec.yaml:7:21: train.eval_split: expected a number, got '0.1'"),
    ("samples: 2147483648",
     "spec.yaml:7:18: train.samples: at most 2,147,483,647 (the largest size), got 2147483648"),
    ("workers: -1", "spec.yaml:7:18: train.workers: must be greater than or equal to 0, got -1"),
    ("loss: {op: HuberLoss, class_dim: 1}",
     "spec.yaml:7:31: train.loss: class_dim is for the class-index losses (CrossEntropyLoss, "
     "MultiMarginLoss, NLLLoss); HuberLoss takes targets shaped like the output"),
])
def test_a_bad_setting_is_refused_at_its_key(tmp_path, train, message):
    assert refused(tmp_path, MODEL + f"train: {{{train}}}\n") == message


# -- the class dim -------------------------------------------------------------

def class_loss(tmp_path, inputs: str, layer: str, loss: str = "CrossEntropyLoss"):
    """The resolved loss of a one-layer model ``inputs`` -> ``layer``."""
    model = f"mpgen: 1\nname: M\ninputs:\n  x: {inputs}\nlayers:\n  out: {layer}\n"
    return train_config(tmp_path, f"  loss: {loss}\n", model).losses[0]


@pytest.mark.parametrize("inputs, layer, loss, class_dim, classes, flatten", [
    # [N, C]: classification
    ("[batch, 8]", "{op: Linear, args: [8, 5]}", "CrossEntropyLoss", 1, 5, False),
    # [batch, 21, h, w]: segmentation, PyTorch's dim 1
    ("[batch, 3, h, w]", "{op: Conv2d, args: [3, 21, 1]}", "CrossEntropyLoss", 1, 21, False),
    ("[batch, 3, 32, 32]", "{op: Conv2d, args: [3, 21, 1]}", "NLLLoss", 1, 21, False),
    # [batch, seq, vocab]: dim 1 is symbolic, the last a number: language models
    ("[batch, seq, 8]", "{op: Linear, args: [8, 65]}", "CrossEntropyLoss", 2, 65, True),
    ("[batch, seq, 8]", "{op: Linear, args: [8, 65]}", "MultiMarginLoss", 2, 65, True),
    # dim 1 of a fixed size by default ([batch, C, L]: classes per position); an output
    # of scores per position of its input ([batch, 64, 65] of [batch, 64, 8]) must say
    # which (tests/errors/train_class_dim_per_token.yaml), the last when the spec says so
    ("[batch, 4, 64]", "{op: Conv1d, args: [4, 65, 1]}", "CrossEntropyLoss", 1, 65, False),
    ("[batch, 64, 8]", "{op: Linear, args: [8, 65]}", "{op: CrossEntropyLoss, class_dim: -1}",
     2, 65, True),
    ("[batch, 64, 8]", "{op: Linear, args: [8, 65]}", "{op: CrossEntropyLoss, class_dim: 2}",
     2, 65, True),
    ("[batch, 8]", "{op: Linear, args: [8, 5]}", "{op: MultiMarginLoss, class_dim: 1}",
     1, 5, False),
    # classes in the middle of a rank-4 output
    ("[batch, h, 8, w]", "{op: Identity}", "{op: CrossEntropyLoss, class_dim: -2}",
     2, 8, False),
])
def test_the_class_dim(tmp_path, inputs, layer, loss, class_dim, classes, flatten):
    resolved = class_loss(tmp_path, inputs, layer, loss)
    assert (resolved.class_dim, resolved.classes, resolved.flatten) == (class_dim, classes,
                                                                        flatten)


def test_a_segmentation_target_is_the_output_without_its_class_dim(tmp_path):
    loss = class_loss(tmp_path, "[batch, 3, h, w]", "{op: Conv2d, args: [3, 21, 1]}")
    out = loss.target_type.shape
    assert (loss.rank, loss.class_dim, loss.classes) == (4, 1, 21)
    assert [str(d) for d in out] == ["batch", "h", "w"] and loss.target_type.dtype == "int64"


def test_a_language_model_target_is_the_output_without_its_vocab(tmp_path):
    loss = class_loss(tmp_path, "[batch, 64, 8]", "{op: Linear, args: [8, 65]}",
                      "{op: CrossEntropyLoss, class_dim: -1}")
    assert [str(d) for d in loss.target_type.shape] == ["batch", "64"]
    assert (loss.class_dim_given, loss.class_dim, loss.rank) == (-1, 2, 3)
    assert loss.kwargs == ()  # class_dim is mpgen's, never the loss class's


@pytest.mark.parametrize("inputs, loss, message", [
    ("[batch, 8]", "{op: CrossEntropyLoss, class_dim: 2}",
     "spec.yaml:7:49: train.loss.class_dim: 2 is not a dim of output 'out' [batch, 8], of rank "
     "2: expected -2 to 1"),
    ("[batch, 8]", "{op: CrossEntropyLoss, class_dim: 0}",
     "spec.yaml:7:49: train.loss.class_dim: dim 0 of output 'out' [batch, 8] is batch, not a "
     "fixed number of classes"),
    ("[batch, seq, 8]", "{op: CrossEntropyLoss, class_dim: 1}",
     "spec.yaml:7:49: train.loss.class_dim: dim 1 of output 'out' [batch, seq, 8] is seq, not "
     "a fixed number of classes"),
    ("[batch, seq, h]", "NLLLoss",
     "spec.yaml:7:15: train.loss: NLLLoss reads the classes from dim 1 of its output (or the "
     "last dim, when dim 1 is symbolic), but neither has a fixed size in 'out' [batch, seq, "
     "h]; give the classes a fixed size, or name their dim with class_dim"),
    ("[batch, 3, 8]", "{op: MultiMarginLoss, class_dim: 1}",
     "spec.yaml:7:48: train.loss: MultiMarginLoss takes an output (N, C), its classes on the "
     "last dim, but 'out' [batch, 3, 8] has them on dim 1; set class_dim: -1 to read the last "
     "dim, flattened"),
    ("[8]", "CrossEntropyLoss",
     "spec.yaml:7:15: train.loss: CrossEntropyLoss needs an output [N, classes], but 'out' "
     "gives [8]"),
])
def test_a_class_dim_without_classes_is_refused(tmp_path, inputs, loss, message):
    text = (f"mpgen: 1\nname: M\ninputs:\n  x: {inputs}\nlayers:\n  out: {{op: Identity}}\n"
            f"train: {{loss: {loss}}}\n")
    assert refused(tmp_path, text) == message


def test_the_example_of_docs_spec_md_builds(tmp_path):
    """The ``train:`` block that opens docs/spec.md's "Training" is a valid one."""
    section = (ROOT / "docs" / "spec.md").read_text().split("\n## Training\n")[1]
    example = section.split("```yaml\n")[1].split("```")[0]
    model = ("mpgen: 1\nname: M\ninputs:\n  x: [batch, seq, 8]\nlayers:\n"
             "  out: {op: Linear, args: [8, 65]}\n")
    config = driver.compile_spec(write_spec(tmp_path, model + example)).train
    assert (config.epochs, config.scheduler, config.amp, config.eval_data) == (
        3, Scheduler("cosine"), "bf16", DataSource(path="data/eval.npz"))
    assert config.losses[0].class_dim == 2
