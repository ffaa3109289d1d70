"""The generated training script's loop: every data path (files of tensors,
``module:function`` giving a Dataset or a DataLoader), epochs, evaluation
and accuracy, AMP (bf16 autocast, the fp16 gradient scaler), learning-rate
schedules, gradient accumulation and clipping, no-decay parameter groups, a
segmentation loss on NCHW outputs, bit-exact resume, the log and a missing
device; the ``train:`` keys that set the script's defaults.

Each script is built for real from a tiny spec and run for real: imported
and its ``main(argv)`` called (output through ``capsys``, ``sys.exit`` as
``SystemExit``), or as a subprocess where what a user sees matters (exit
status, no traceback, no progress bar without a terminal). Data factories
are modules written into the test's folder, the working directory of the run.
NaN losses, Ctrl-C and crashes during a save are tested in
``test_train_checkpoints.py``.
"""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy
import pytest
import safetensors.torch
import torch
from torch import nn

from helpers import build_to, import_generated, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun) or builds many specs


def spec(name: str, layers: list[str], *, inputs: str = "x: [batch, 4]", loss: str = "MSELoss",
         optimizer: str = "{op: SGD, lr: 0.1}",
         train: tuple[str, ...] = ("batch_size: 4", "steps: 4"), top: tuple[str, ...] = ()) -> str:
    """A spec: ``layers``, ``train`` and ``top`` are YAML lines under
    ``layers:``, under ``train:`` (after the loss and the optimizer) and at
    the top level. Model names differ from spec to spec: each model
    module is imported by its name."""
    lines = ["mpgen: 1", f"name: {name}", "inputs:", f"  {inputs}", "layers:",
             *(f"  {layer}" for layer in layers), *top,
             "train:", f"  loss: {loss}", f"  optimizer: {optimizer}",
             *(f"  {line}" for line in train)]
    return "\n".join(lines) + "\n"


#: x -> one output of 1; a learnable regression.
FC = ["fc: {op: Linear, args: [4, 1]}"]
REG = spec("LoopReg", FC)
#: Three classes of x.
CLS = spec("LoopCls", ["fc: {op: Linear, args: [4, 3]}"], loss="CrossEntropyLoss",
           optimizer="{op: SGD, lr: 0.5}")
#: Two outputs with a loss each: targets a_target and b_target.
TWO = spec("LoopTwo", ["a: {op: Linear, args: [4, 3], in: x}",
                      "b: {op: Linear, args: [4, 1], in: x}"],
           loss="{a: CrossEntropyLoss, b: MSELoss}", top=("outputs: [a, b]",))
#: Per-pixel classes: an NCHW output, classes on dim 1, targets [batch, h, w].
SEG = spec("LoopSeg", ["conv: {op: Conv2d, args: [3, 3, 1]}"], inputs="x: [batch, 3, 4, 4]",
           loss="CrossEntropyLoss", optimizer="{op: SGD, lr: 0.5}")
#: Weight decay on weights only: not on biases, norms or embeddings.
DECAY = spec("LoopDecay", ["emb: {op: Embedding, args: [10, 8]}",
                           "norm: {op: LayerNorm, args: [8]}", "head: {op: Linear, args: [8, 2]}"],
             inputs="tokens: {shape: [batch, 6], dtype: int64}",
             optimizer="{op: AdamW, lr: 0.01, weight_decay: 0.1}",
             train=("batch_size: 2", "steps: 1", "no_decay: [biases, norms, embeddings]"))


def scheduled(name: str, scheduler: str) -> str:
    """LoopReg's spec with a scheduler, over 8 steps."""
    return spec(name, FC, train=("batch_size: 4", "steps: 8", f"scheduler: {scheduler}"))


#: A torch scheduler after a warmup: resumed with its state.
STEPPED = scheduled("LoopStepped", "{op: StepLR, step_size: 2, gamma: 0.5, warmup: 1}")
#: Placed on two GPUs, built without --device-map.
GPUS = spec("LoopGpus", ["first: {op: Linear, args: [4, 4]}",
                        "second: {op: Linear, args: [4, 1]}"],
            top=("placement:", "  first: cuda:0", "  second: cuda:1"))
#: Every new key of train: sets a default of the script.
KEYS = spec("LoopKeys", FC, optimizer="{op: SGD, lr: 0.05}", train=(
    "batch_size: 3", "epochs: 2", "scheduler: {op: StepLR, step_size: 1, gamma: 0.5}",
    "grad_clip: 0.001", "accumulate: 2", "amp: bf16",
    'data: {factory: "loop_keys_data:make", n: 12}', "eval_split: 0.25", "eval_every: 1"))


@dataclass
class Built:
    """A spec built for the CPU: its folder, training script and imported modules."""

    folder: Path
    script: Path
    train: ModuleType  # train_<name>.py, imported
    model: type  # the model class

    def fresh(self, seed: int) -> nn.Module:
        """The model as main() makes it before training: seeded, then built."""
        torch.manual_seed(seed)
        return self.model()


def build(tmp_path_factory, text: str, device_map: dict | None = None,
          modules: dict[str, str] | None = None) -> Built:
    """``text`` built, beside ``modules`` (name: source) of its project."""
    folder = tmp_path_factory.mktemp("build")
    for name, source in (modules or {}).items():
        write_module(folder, name, source)
    spec = write_spec(folder, text)
    result = build_to(spec, folder / "out", device_map if device_map is not None else {"*": "cpu"})
    name = result.graph.name
    script = next((folder / "out").glob("train_*.py"))
    train = import_generated(script)
    return Built(folder / "out", script, train, getattr(train, name))


@pytest.fixture(scope="module")
def reg(tmp_path_factory) -> Built:
    return build(tmp_path_factory, REG)


@pytest.fixture(scope="module")
def cls(tmp_path_factory) -> Built:
    return build(tmp_path_factory, CLS)


@pytest.fixture(scope="module")
def seg(tmp_path_factory) -> Built:
    return build(tmp_path_factory, SEG)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory) -> Built:
    return build(tmp_path_factory, STEPPED)


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """The test's folder as the run's working directory (data factories are
    imported from it, as from the working directory of ``python train_*.py``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@dataclass
class Run:
    code: object  # 0, or what sys.exit got: a message or a status
    out: str
    err: str

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith(prefix)]


def train(built: Built, *argv: str) -> None:
    """The script's ``python train_<name>.py ARGV``, in this process."""
    import mpgen_runtime  # the output folder's copy, its folder on sys.path

    mpgen_runtime.train(built.train.TRAINING, list(argv))


def main(built: Built, capsys, *argv: str) -> Run:
    """Run the imported script's training (the runtime's loop) in this process."""
    capsys.readouterr()
    try:
        train(built, *argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return Run(code, out, err)


def ok(built: Built, capsys, *argv: str) -> Run:
    run = main(built, capsys, *argv)
    assert run.code == 0, (run.code, run.err)
    return run


def subprocess_run(built: Built, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(built.script), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def log_rows(folder: Path) -> list[dict]:
    with (folder / "log.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def losses(folder: Path) -> list[float]:
    return [float(row["loss"]) for row in log_rows(folder) if row["loss"]]


def lrs(folder: Path) -> list[float]:
    return [float(row["lr"]) for row in log_rows(folder) if row["lr"]]


def checkpoint(path: Path) -> dict:
    return torch.load(path / "last.pt", map_location="cpu", weights_only=True)


def save(path: Path, tensors: dict) -> Path:
    """A file of tensors in the format its suffix names."""
    if path.suffix == ".npz":
        numpy.savez(path, **{k: v.numpy() for k, v in tensors.items()})
    elif path.suffix == ".safetensors":
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    else:
        torch.save(tensors, path)
    return path


def regression(n: int, seed: int = 0, index: bool = False) -> dict:
    """x -> x @ w + 0.5: what LoopReg can learn exactly. With ``index``,
    x[:, 0] is the sample's number, to see which samples a run reads."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    if index:
        x[:, 0] = torch.arange(n, dtype=torch.float32)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return {"x": x, "target": x @ w + 0.5}


def classes(n: int, seed: int = 0) -> dict:
    """x whose class is the argmax of its first three features, by a margin."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 4, generator=g) * 0.3
    x[torch.arange(n), target] += 2.0
    return {"x": x, "target": target}


def write_module(folder: Path, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")


def delta(before: nn.Module, after: dict) -> float:
    """The norm of the change of all parameters (as one vector)."""
    moved = [(after[k] - v).flatten() for k, v in before.state_dict().items()]
    return torch.cat(moved).norm().item()


@pytest.fixture
def forward_dtypes():
    """The dtypes of every Linear output while the test runs (a global forward hook)."""
    seen = []

    def hook(module, args, output):
        if isinstance(module, nn.Linear):
            seen.append(output.dtype)

    handle = nn.modules.module.register_module_forward_hook(hook)
    yield seen
    handle.remove()


@pytest.fixture
def samples_seen():
    """The sample numbers (x[:, 0]) each forward of the model reads, as
    (training, numbers): LoopReg on :func:`regression` data with ``index``."""
    seen = []

    def hook(module, args, output):
        if type(module).__name__ == "LoopReg":
            seen.append((module.training, args[0][:, 0].long().tolist()))

    handle = nn.modules.module.register_module_forward_hook(hook)
    yield seen
    handle.remove()


# The data paths ------------------------------------------------------------


def test_each_file_format_trains_on_its_tensors_and_the_loss_goes_down(reg, here, capsys):
    data = regression(32)
    for suffix in (".pt", ".npz", ".safetensors"):
        path = save(here / f"data{suffix}", data)
        ok(reg, capsys, "--data", path.name, "--steps", "40", "--batch-size", "8",
           "--checkpoint", f"c{suffix}")
        trained = losses(here / f"c{suffix}")
        assert len(trained) == 40
        assert trained[-1] < trained[0] / 20, trained
    # The same tensors in three formats: the same training, bit for bit.
    states = [checkpoint(here / f"c{s}")["model"] for s in (".pt", ".npz", ".safetensors")]
    assert all(torch.equal(s[k], states[0][k]) for s in states[1:] for k in states[0])
    # Learned: x @ w + 0.5.
    assert torch.allclose(states[0]["fc.weight"], torch.tensor([[1.0, -2.0, 0.5, 3.0]]),
                          atol=0.05)


def test_several_losses_read_a_target_per_output(tmp_path_factory, here, capsys):
    two = build(tmp_path_factory, TWO)
    assert two.train.TRAINING.keys == ("x", "a_target", "b_target")
    labelled = classes(16)
    save(here / "two.pt", {"x": labelled["x"], "a_target": labelled["target"],
                           "b_target": labelled["x"][:, :1] * 2})
    ok(two, capsys, "--data", "two.pt", "--steps", "20", "--eval-data", "two.pt",
       "--log-dir", "log")
    rows = log_rows(here / "log")
    assert float(rows[-2]["loss"]) < float(rows[0]["loss"]) / 2
    assert float(rows[-1]["eval_accuracy"]) > 0.9
    # A file keyed for one loss names the keys it lacks and those it has.
    save(here / "one.pt", {"x": labelled["x"], "target": labelled["target"]})
    run = main(two, capsys, "--data", "one.pt")
    assert run.code == "one.pt: no tensor a_target, b_target (it has x, target)"


DATASETS = """
    import torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    target = x.sum(1, keepdim=True)


    class Tuples(Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return x[i], target[i]


    class Dicts(Tuples):
        def __getitem__(self, i):
            return {"target": target[i], "x": x[i]}  # by name, in any order


    def tuples():
        return Tuples()


    def dicts():
        return Dicts()


    def loader(batch_size=6):
        return DataLoader(TensorDataset(x, target), batch_size=batch_size)


    def three_items():
        return TensorDataset(x, target, target)


    def listed():
        return [x, target]
"""


def test_a_factory_gives_a_dataset_of_tuples_or_of_dicts(reg, here, capsys):
    write_module(here, "loop_datasets", DATASETS)
    for form in ("tuples", "dicts"):
        run = ok(reg, capsys, "--data", f"loop_datasets:{form}", "--epochs", "2",
                 "--steps", "100", "--batch-size", "4", "--checkpoint", form)
        # 12 samples in batches of 4: 3 steps an epoch.
        assert run.lines("LoopReg: ") == ["LoopReg: 5 parameters; 6 steps of 4 samples"]
        assert len(run.lines("step ")) == 6
    tuples, dicts = checkpoint(here / "tuples")["model"], checkpoint(here / "dicts")["model"]
    assert all(torch.equal(tuples[k], dicts[k]) for k in tuples)
    assert not torch.equal(tuples["fc.weight"], reg.fresh(0).fc.weight.detach())


def test_a_factory_gives_a_dataloader_that_is_read_in_its_own_batches(reg, here, capsys):
    write_module(here, "loop_loader", DATASETS)
    # A DataLoader's epoch is its batches (12 samples in 6s); --batch-size does not apply.
    ok(reg, capsys, "--data", "loop_loader:loader", "--epochs", "3", "--steps", "100",
       "--log-dir", "log")
    rows = log_rows(here / "log")
    assert [row["step"] for row in rows] == ["1", "2", "3", "4", "5", "6"]
    assert [row["epoch"] for row in rows] == ["0", "0", "1", "1", "2", "2"]


@pytest.mark.parametrize("argv, files, message", [
    (["--data", "partial.pt"], {"partial.pt": {"x": torch.zeros(8, 4)}},
     "partial.pt: no tensor target (it has x)"),
    (["--data", "uneven.npz"],
     {"uneven.npz": {"x": torch.zeros(8, 4), "target": torch.zeros(6, 1)}},
     "uneven.npz: the tensors hold different numbers of samples [6, 8]"),
    (["--data", "data.csv"], {},
     "--data data.csv: expected a file (.pt, .pth, .npz, .safetensors) or module:function"),
    (["--data", "absent.safetensors"], {}, "--data: no file absent.safetensors"),
    (["--data", "data.pt", "--eval-data", "absent.pt"],
     {"data.pt": regression(8)}, "--eval-data: no file absent.pt"),
    (["--data", "loop_no_such_module:make"], {},
     "--data loop_no_such_module:make: no module loop_no_such_module"),
    (["--data", ":make"], {},
     "--data :make: expected a file (.pt, .pth, .npz, .safetensors) or module:function"),
    (["--data", "loop_bad_data:nothing"], {},
     "--data loop_bad_data:nothing: loop_bad_data has no function nothing"),
    (["--data", "loop_bad_data:listed"], {},
     "--data loop_bad_data:listed: returned list, not a Dataset or DataLoader"),
    (["--data", "loop_bad_data:three_items"], {},
     "the data gives 3 items per sample; expected 2: x, target"),
    (["--data", "few.pt", "--batch-size", "8"], {"few.pt": regression(6)},
     "one optimizer step needs 8 samples, more than one pass over the data gives; lower --batch-size or --accumulate"),
    # argparse's usage errors (exit 2):
    (["--data", "data.pt", "--eval-every", "2"], {"data.pt": regression(8)},
     "error: --eval-every needs --eval-data or --eval-split"),
    (["--data", "loop_bad_data:loader", "--eval-split", "0.2"], {},
     "error: --eval-split needs a Dataset; this --data gives a DataLoader (use --eval-data)"),
])
def test_bad_data_stops_with_a_message(reg, here, capsys, argv, files, message):
    write_module(here, "loop_bad_data", DATASETS)
    for name, tensors in files.items():
        save(here / name, tensors)
    run = main(reg, capsys, *argv, "--steps", "2")
    if message.startswith("error: "):
        assert run.code == 2
        assert run.err.splitlines()[-1].endswith(f": {message}")  # after the program's name
    else:
        assert run.code == message
    assert "Traceback" not in run.out + run.err


def test_a_factory_module_whose_own_import_fails_shows_the_traceback(reg, here, capsys):
    # Not a bad --data: the module is there, what it imports is not.
    write_module(here, "loop_broken_data", "import loop_missing_dependency\n")
    with pytest.raises(ModuleNotFoundError, match="loop_missing_dependency"):
        train(reg, "--data", "loop_broken_data:make", "--steps", "1")


def test_bad_data_in_a_real_run_exits_1_with_the_message_alone(reg, tmp_path):
    done = subprocess_run(reg, tmp_path, "--data", "loop_nowhere:make")
    assert (done.returncode, done.stdout, done.stderr) == (
        1, "", "--data loop_nowhere:make: no module loop_nowhere\n")


# Epochs ---------------------------------------------------------------------


def test_epochs_run_e_times_n_over_b_steps_each_epoch_a_shuffled_pass(reg, here, capsys,
                                                                       samples_seen):
    save(here / "ten.pt", regression(10, index=True))
    # 10 samples in batches of 3: 3 steps an epoch, the 10th sample left over.
    run = ok(reg, capsys, "--data", "ten.pt", "--batch-size", "3", "--epochs", "2",
             "--steps", "100")
    assert run.lines("LoopReg: ") == ["LoopReg: 5 parameters; 6 steps of 3 samples"]
    assert [row["epoch"] for row in log_rows(here / "runs" / "loop_reg")] == ["0"] * 3 + ["1"] * 3
    read = [n for training, numbers in samples_seen if training for n in numbers]
    first, second = read[:9], read[9:]
    assert len(set(first)) == len(set(second)) == 9
    assert first != second  # shuffled anew each epoch
    # With --steps too, whichever ends first; --accumulate makes an epoch fewer steps.
    for argv, steps in [(["--epochs", "2", "--steps", "4"], 4),
                        (["--epochs", "2", "--steps", "10"], 6),
                        (["--epochs", "3", "--steps", "100", "--accumulate", "2"], 3),
                        (["--steps", "7"], 7)]:
        run = ok(reg, capsys, "--data", "ten.pt", "--batch-size", "3", *argv)
        assert run.lines("step ")[-1].startswith(f"step {steps}/{steps}  loss ")


# Evaluation -----------------------------------------------------------------


def test_eval_every_k_evaluates_at_k_2k_and_the_end(cls, here, capsys):
    save(here / "train.pt", classes(24))
    run = ok(cls, capsys, "--data", "train.pt", "--eval-split", "0.25", "--eval-every", "2",
             "--steps", "5", "--log-dir", "log")
    assert [line.split(":")[0] for line in run.lines("eval at")] == [
        "eval at step 2", "eval at step 4", "eval at step 5"]
    evaluated = [row for row in log_rows(here / "log") if row["eval_loss"]]
    assert [row["step"] for row in evaluated] == ["2", "4", "5"]
    assert all(0 <= float(row["eval_accuracy"]) <= 1 for row in evaluated)
    last = evaluated[-1]
    # The summary's evaluation, the log's path, then the best step (--monitor's eval_loss).
    assert run.out.splitlines()[-3] == (f"eval loss {float(last['eval_loss']):.6f}, "
                                        f"accuracy {float(last['eval_accuracy']):.2%}")
    best = min(evaluated, key=lambda row: float(row["eval_loss"]))
    assert run.out.splitlines()[-1].startswith(f"best eval loss ")
    assert run.out.splitlines()[-1].endswith(f" at step {best['step']}")


def test_eval_data_gives_the_loss_and_accuracy_of_the_trained_model(cls, here, capsys):
    save(here / "train.npz", classes(32, seed=1))
    held = classes(10, seed=2)
    save(here / "held.npz", held)
    ok(cls, capsys, "--data", "train.npz", "--eval-data", "held.npz", "--steps", "6",
       "--checkpoint", "c")
    row = log_rows(here / "c")[-1]
    # By hand: the checkpoint's model on held.npz in batches of 4 (4, 4, 2).
    model = cls.fresh(0)
    model.load_state_dict(checkpoint(here / "c")["model"])
    with torch.no_grad():
        batch_losses = [nn.functional.cross_entropy(model(x), t).item() for x, t in
                        zip(held["x"].split(4), held["target"].split(4))]
        right = (model(held["x"]).argmax(1) == held["target"]).sum().item()
    assert float(row["eval_loss"]) == pytest.approx(sum(batch_losses) / 3, rel=1e-6)
    assert float(row["eval_accuracy"]) == right / 10


def test_evaluate_counts_right_predictions(cls):
    data = classes(8)
    model = cls.fresh(0)
    with torch.no_grad():  # the class is the argmax of x[:, :3]
        model.fc.weight.copy_(torch.eye(3, 4))
        model.fc.bias.zero_()
    batches = list(zip(data["x"].split(4), data["target"].split(4)))
    import mpgen_runtime.loop

    def evaluate(model, losses, data, autocast):
        return mpgen_runtime.loop.evaluate(cls.train.TRAINING, model, losses, data, autocast)

    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    found = evaluate(model, (nn.CrossEntropyLoss(),), batches, autocast)
    assert list(found) == ["eval_loss", "eval_accuracy"] and found["eval_accuracy"] == 1.0
    wrong = [(x, (t + 1) % 3) if k == 0 else (x, t) for k, (x, t) in enumerate(batches)]
    assert evaluate(model, (nn.CrossEntropyLoss(),), wrong, autocast)["eval_accuracy"] == 0.5
    # ignore_index (-100) targets are not counted.
    ignored = [(x, torch.where(torch.arange(4) < 2, -100, (t + 1) % 3)) for x, t in batches]
    assert evaluate(model, (nn.CrossEntropyLoss(),), ignored, autocast)["eval_accuracy"] == 0.0
    assert model.training  # evaluate() puts it back in training mode


def test_eval_split_holds_out_the_fraction_without_overlap(reg, here, capsys, samples_seen):
    save(here / "twenty.pt", regression(20, index=True))
    ok(reg, capsys, "--data", "twenty.pt", "--eval-split", "0.25", "--batch-size", "5",
       "--epochs", "2", "--steps", "100", "--eval-every", "3")
    trained = {n for training, numbers in samples_seen if training for n in numbers}
    evaluated = [n for training, numbers in samples_seen if not training for n in numbers]
    assert len(trained) == 15
    assert len(evaluated) == 5 * 2  # at step 3 and at step 6, the end
    assert len(set(evaluated)) == 5
    assert trained.isdisjoint(evaluated)
    assert trained | set(evaluated) == set(range(20))


# AMP ------------------------------------------------------------------------


def test_amp_bf16_autocasts_the_forward_on_the_cpu(reg, here, capsys, forward_dtypes):
    save(here / "data.pt", regression(16))
    ok(reg, capsys, "--data", "data.pt", "--amp", "bf16", "--log-dir", "bf16")
    assert set(forward_dtypes) == {torch.bfloat16}
    forward_dtypes.clear()
    ok(reg, capsys, "--data", "data.pt", "--log-dir", "off")
    assert set(forward_dtypes) == {torch.float32}
    bf16, off = losses(here / "bf16"), losses(here / "off")
    assert bf16 != off
    assert bf16 == pytest.approx(off, rel=0.1)


def small(n: int) -> dict:
    """Inputs near 0 and targets 0: errors small enough that fp16 gradients
    scaled by GradScaler's initial 2**16 do not overflow."""
    return {"x": torch.randn(n, 4, generator=torch.Generator().manual_seed(0)) * 0.01,
            "target": torch.zeros(n, 1)}


def test_amp_fp16_scales_the_loss_and_keeps_the_scale_in_the_checkpoint(reg, here, capsys):
    save(here / "small.pt", small(16))
    ok(reg, capsys, "--data", "small.pt", "--amp", "fp16", "--steps", "2", "--checkpoint", "c")
    state = checkpoint(here / "c")
    assert state["scaler"]["scale"] == 2.0 ** 16  # GradScaler's initial scale: no overflow
    assert delta(reg.fresh(0), state["model"]) > 0
    # Without fp16 the scaler is off: its state is empty.
    ok(reg, capsys, "--data", "small.pt", "--steps", "1", "--checkpoint", "off")
    assert checkpoint(here / "off")["scaler"] == {}


def test_amp_fp16_skips_a_step_whose_gradients_overflow_and_halves_the_scale(reg, here, capsys):
    # Targets of 1e3: the scaled gradient of the fp16 output (2**16 * 2 * 1e3 / 4)
    # overflows fp16; the loss itself (fp32) is finite.
    data = small(16)
    save(here / "far.pt", {"x": data["x"], "target": torch.full((16, 1), 1e3)})
    save(here / "small.pt", data)
    fresh = reg.fresh(0)
    same = ["--amp", "fp16", "--checkpoint", "c"]
    ok(reg, capsys, "--data", "far.pt", "--steps", "1", *same)
    state = checkpoint(here / "c")
    assert state["scaler"]["scale"] == 2.0 ** 15
    assert delta(fresh, state["model"]) == 0  # the step was skipped
    ok(reg, capsys, "--data", "far.pt", "--steps", "3", *same, "--resume")
    state = checkpoint(here / "c")
    assert state["scaler"]["scale"] == 2.0 ** 13  # halved at each overflow, resumed with it
    assert delta(fresh, state["model"]) == 0
    # Gradients that fit step at the lowered scale.
    ok(reg, capsys, "--data", "small.pt", "--steps", "4", *same, "--resume")
    state = checkpoint(here / "c")
    assert state["scaler"]["scale"] == 2.0 ** 13
    assert delta(fresh, state["model"]) > 0


# Schedules ------------------------------------------------------------------


def used_lrs(built: Built, here: Path, capsys, steps: int, *argv: str) -> list[float]:
    """The lr each step of a run used, from log.csv."""
    ok(built, capsys, "--steps", str(steps), "--log-dir", "log", *argv)
    return lrs(here / "log")


def cosine(step: int, steps: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup to lr over ``warmup`` steps, then half a cosine down to
    min_lr at ``steps`` (the lr of step ``step``, counted from 1)."""
    if step <= warmup:
        return lr * step / (warmup + 1)
    progress = (step - 1 - warmup) / (steps - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def linear(step: int, steps: int, warmup: int, lr: float, min_lr: float) -> float:
    if step <= warmup:
        return lr * step / (warmup + 1)
    return lr - (lr - min_lr) * (step - 1 - warmup) / (steps - warmup)


@pytest.mark.parametrize("op, formula", [("cosine", cosine), ("linear", linear)])
def test_a_built_in_schedule_sets_each_steps_lr_by_its_formula(tmp_path_factory, here, capsys,
                                                                op, formula):
    built = build(tmp_path_factory, scheduled(f"Loop{op.title()}",
                                                f"{{op: {op}, warmup: 2, min_lr: 0.01}}"))
    assert used_lrs(built, here, capsys, 8) == pytest.approx(
        [formula(s, 8, 2, 0.1, 0.01) for s in range(1, 9)], rel=1e-12)
    # --lr scales it, min_lr stays.
    assert used_lrs(built, here, capsys, 8, "--lr", "0.2") == pytest.approx(
        [formula(s, 8, 2, 0.2, 0.01) for s in range(1, 9)], rel=1e-12)
    # lr_factor: the fraction of --lr after `done` steps; min_lr from steps on.
    import mpgen_runtime

    def factor(*args):
        return mpgen_runtime.lr_factor(*args, op)

    assert [factor(done, 8, 2, 0.1) for done in (0, 1, 2)] == [1 / 3, 2 / 3, 1.0]
    assert factor(8, 8, 2, 0.1) == factor(20, 8, 2, 0.1) == pytest.approx(0.1)


def test_a_built_in_schedule_spans_the_specs_steps_whatever_steps_stops_at(
        tmp_path_factory, here, capsys):
    # So 3 steps and a resume to 6 equal 6 straight, bit for bit, under cosine too.
    built = build(tmp_path_factory, scheduled("LoopSpan", "{op: cosine, warmup: 2}"))
    assert used_lrs(built, here, capsys, 3) == pytest.approx(
        [cosine(s, 8, 2, 0.1, 0.0) for s in range(1, 4)], rel=1e-12)
    assert used_lrs(built, here, capsys, 4, "--decay-steps", "4") == pytest.approx(
        [cosine(s, 4, 2, 0.1, 0.0) for s in range(1, 5)], rel=1e-12)
    same = ["--seed", "2", "--batch-size", "2"]
    ok(built, capsys, *same, "--steps", "6", "--checkpoint", "A")
    ok(built, capsys, *same, "--steps", "3", "--checkpoint", "B")
    ok(built, capsys, *same, "--steps", "6", "--checkpoint", "B", "--resume")
    a, b = checkpoint(here / "A"), checkpoint(here / "B")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert lrs(here / "A") == lrs(here / "B")


def test_the_constant_schedule_warms_up_then_keeps_the_lr(tmp_path_factory, here, capsys):
    built = build(tmp_path_factory, scheduled("LoopConstant", "{op: constant, warmup: 3}"))
    assert used_lrs(built, here, capsys, 6) == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_a_torch_scheduler_with_and_without_warmup(tmp_path_factory, stepped, here, capsys):
    plain = build(tmp_path_factory,
                  scheduled("LoopStepLR", "{op: StepLR, step_size: 2, gamma: 0.5}"))
    assert used_lrs(plain, here, capsys, 6) == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    # warmup: 1 then StepLR from its start.
    assert used_lrs(stepped, here, capsys, 6) == pytest.approx(
        [0.05, 0.1, 0.1, 0.05, 0.05, 0.025])


def test_reduce_lr_on_plateau_steps_on_the_loss(tmp_path_factory, here, capsys):
    built = build(tmp_path_factory, scheduled(
        "LoopPlateau", "{op: ReduceLROnPlateau, factor: 0.5, patience: 0}"))
    # One sample repeated and a tiny lr: the loss stays on a plateau, so every
    # step after the first halves the lr.
    one = regression(1)
    save(here / "same.pt", {k: v.expand(8, *v.shape[1:]) for k, v in one.items()})
    assert used_lrs(built, here, capsys, 4, "--data", "same.pt", "--lr", "1e-6") == pytest.approx(
        [1e-6, 1e-6, 5e-7, 2.5e-7])
    # With evaluation data it steps on the evaluation loss, at each evaluation.
    # The first (step 2) is the best so far, the second (step 4) is not.
    assert used_lrs(built, here, capsys, 6, "--data", "same.pt", "--lr", "1e-6",
                    "--eval-data", "same.pt", "--eval-every", "2") == pytest.approx(
        [1e-6, 1e-6, 1e-6, 1e-6, 5e-7, 5e-7])


# Accumulation and clipping --------------------------------------------------


def test_accumulating_two_batches_of_two_equals_batches_of_four(reg, here, capsys):
    save(here / "data.pt", regression(16))
    same = ["--data", "data.pt", "--steps", "6"]  # over an epoch's end (4 steps)
    ok(reg, capsys, *same, "--accumulate", "2", "--batch-size", "2", "--checkpoint", "two")
    ok(reg, capsys, *same, "--batch-size", "4", "--checkpoint", "four")
    two, four = checkpoint(here / "two")["model"], checkpoint(here / "four")["model"]
    assert all(torch.allclose(two[k], four[k], rtol=1e-5, atol=1e-6) for k in two)
    assert losses(here / "two") == pytest.approx(losses(here / "four"), rel=1e-5)
    assert delta(reg.fresh(0), two) > 0.1


@pytest.mark.parametrize("amp", ["off", "fp16"])
def test_grad_clip_bounds_the_update_by_lr_times_the_norm(reg, here, capsys, amp):
    save(here / "small.pt", small(16))
    fresh = reg.fresh(0)
    same = ["--data", "small.pt", "--steps", "1", "--amp", amp]
    ok(reg, capsys, *same, "--grad-clip", "0.01", "--checkpoint", "clipped")
    ok(reg, capsys, *same, "--checkpoint", "free")
    # SGD: the update is lr times the clipped gradient, whose norm is the clip
    # (with fp16, the gradient is unscaled before it is clipped).
    assert delta(fresh, checkpoint(here / "clipped")["model"]) == pytest.approx(0.1 * 0.01,
                                                                                 rel=1e-3)
    assert delta(fresh, checkpoint(here / "free")["model"]) > 10 * 0.1 * 0.01


# no_decay -------------------------------------------------------------------


def test_no_decay_puts_biases_norms_and_embeddings_in_the_group_without_decay(
        tmp_path_factory, here, capsys):
    built = build(tmp_path_factory, DECAY)
    model = built.fresh(0)
    import mpgen_runtime

    decay, exempt = mpgen_runtime.param_groups(model, 0.1, ("biases", "norms", "embeddings"))
    assert '"no_decay": ["biases", "norms", "embeddings"]' in built.script.read_text()
    assert decay["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model.head.weight)]
    assert {id(p) for p in exempt["params"]} == {
        id(model.emb.weight), id(model.norm.weight), id(model.norm.bias), id(model.head.bias)}
    # The script's optimizer has these groups.
    ok(built, capsys, "--checkpoint", "c")
    groups = checkpoint(here / "c")["optimizer"]["param_groups"]
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(0.1, 1), (0.0, 4)]


# Segmentation ---------------------------------------------------------------


def pixels(n: int, seed: int = 0) -> dict:
    """Images whose pixel class is the argmax of its 3 channels."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 3, (n, 4, 4), generator=g)
    x = torch.randn(n, 3, 4, 4, generator=g) * 0.3 + 2 * nn.functional.one_hot(target, 3).permute(
        0, 3, 1, 2)
    return {"x": x, "target": target}


def test_segmentation_classes_on_dim_1_train_and_accuracy_counts_pixels(seg, here, capsys):
    inputs, targets = seg.train.make_batch(2)
    assert inputs[0].shape == (2, 3, 4, 4) and targets[0].shape == (2, 4, 4)
    assert targets[0].dtype == torch.int64 and 0 <= targets[0].min() <= targets[0].max() < 3
    save(here / "train.pt", pixels(16))
    save(here / "held.pt", pixels(8, seed=1))
    ok(seg, capsys, "--data", "train.pt", "--eval-data", "held.pt", "--steps", "30",
       "--log-dir", "log")
    trained = losses(here / "log")
    assert trained[-1] < trained[0] / 4
    assert float(log_rows(here / "log")[-1]["eval_accuracy"]) > 0.95
    # One wrong pixel of 2 x 4 x 4: accuracy is 31/32.
    model = seg.fresh(0)
    with torch.no_grad():
        model.conv.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
        model.conv.bias.zero_()
    batch = pixels(2)
    wrong = batch["target"].clone()
    wrong[1, 2, 3] = (wrong[1, 2, 3] + 1) % 3
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    import mpgen_runtime.loop

    assert mpgen_runtime.loop.evaluate(seg.train.TRAINING, model, (nn.CrossEntropyLoss(),),
                                       [(batch["x"], wrong)], autocast)["eval_accuracy"] == 31 / 32


# Resume ---------------------------------------------------------------------


def test_resume_is_bit_exact_with_bf16_a_scheduler_accumulation_and_a_data_file(
        stepped, here, capsys):
    save(here / "ten.npz", regression(10))
    # 10 samples, micro-batches of 2, 2 a step: 2 steps an epoch, so the
    # resumed run starts mid-epoch and crosses two epoch ends.
    same = ["--data", "ten.npz", "--batch-size", "2", "--accumulate", "2", "--amp", "bf16",
            "--seed", "3"]
    ok(stepped, capsys, *same, "--steps", "6", "--checkpoint", "A")
    ok(stepped, capsys, *same, "--steps", "3", "--checkpoint", "B")
    run = ok(stepped, capsys, *same, "--steps", "6", "--checkpoint", "B", "--resume")
    assert run.out.splitlines()[2] == "resumed from B/last.pt at step 3"  # after threads, model
    a, b = checkpoint(here / "A"), checkpoint(here / "B")
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["scheduler"]["_last_lr"] == b["scheduler"]["_last_lr"]
    assert losses(here / "A") == losses(here / "B")
    assert [row["epoch"] for row in log_rows(here / "B")] == ["0", "0", "1", "1", "2", "2"]


def test_resume_reads_a_dataloader_from_the_batch_it_stopped_at(reg, here, capsys):
    write_module(here, "loop_resume_loader", DATASETS.replace("batch_size=6", "batch_size=5"))
    same = ["--data", "loop_resume_loader:loader", "--seed", "1"]  # 3 batches an epoch
    ok(reg, capsys, *same, "--steps", "5", "--checkpoint", "A")
    ok(reg, capsys, *same, "--steps", "2", "--checkpoint", "B")
    ok(reg, capsys, *same, "--steps", "5", "--checkpoint", "B", "--resume")
    a, b = checkpoint(here / "A")["model"], checkpoint(here / "B")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# The log --------------------------------------------------------------------


def test_without_a_terminal_progress_is_plain_lines_the_log_a_csv_and_a_summary(cls, tmp_path):
    save(tmp_path / "data.pt", classes(24))
    done = subprocess_run(cls, tmp_path, "--data", "data.pt", "--eval-split", "0.25",
                          "--eval-every", "2", "--steps", "4", "--log-every", "2",
                          "--log-dir", "logs")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress bar
    threads, *lines = done.stdout.splitlines()
    assert threads.startswith("torch threads: ")
    assert lines[0] == "LoopCls: 15 parameters; 4 steps of 4 samples"
    assert [line.split()[:2] for line in lines[1:5]] == [
        ["step", "2/4"], ["eval", "at"], ["step", "4/4"], ["eval", "at"]]
    assert lines[1].split()[2] == "loss" and lines[1].endswith(" samples/s")
    rows = log_rows(tmp_path / "logs")
    # The summary: from step 1's loss (not logged) to the last.
    assert re.fullmatch(r"trained 4 steps in [0-9.]+ s \([0-9,]+ samples/s\); "
                        rf"loss [0-9.]+ -> {float(rows[2]['loss']):.6f}", lines[5]), lines[5]
    assert lines[6].startswith("eval loss ") and "accuracy" in lines[6]
    assert lines[7] == "log: logs/log.csv"
    assert re.fullmatch(r"best eval loss [0-9.]+ at step [24]", lines[8]) and len(lines) == 9
    assert list(rows[0]) == ["step", "epoch", "loss", "lr", "seconds_per_step",
                             "samples_per_second", "eval_loss", "eval_accuracy",
                             "tokens_per_second", "grad_norm", "idle", "mfu"]
    assert [(r["step"], bool(r["loss"]), bool(r["eval_loss"])) for r in rows] == [
        ("2", True, False), ("2", False, True), ("4", True, False), ("4", False, True)]
    assert all(float(r["lr"]) == 0.5 for r in rows if r["lr"])
    # TensorBoard, installed here, gets the same scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [2, 4]
    assert not (tmp_path / "runs").exists()


def test_the_log_goes_to_the_checkpoint_folder_else_runs(reg, here, capsys):
    ok(reg, capsys, "--steps", "2", "--checkpoint", "c")
    ok(reg, capsys, "--steps", "3")
    assert [r["step"] for r in log_rows(here / "c")] == ["1", "2"]
    assert [r["step"] for r in log_rows(here / "runs" / "loop_reg")] == ["1", "2", "3"]


# A missing device -----------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has both GPUs")
def test_a_model_placed_on_missing_gpus_names_them_and_suggests_device_map(tmp_path_factory):
    gpus = build(tmp_path_factory, GPUS, device_map={})
    done = subprocess_run(gpus, gpus.folder)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    count = torch.cuda.device_count()
    assert done.stderr.startswith(
        f"LoopGpus is placed on {'cuda:0, cuda:1' if count == 0 else 'cuda:1'}, "
        f"but this machine has {f'{count} CUDA device(s)' if count else 'no CUDA device'}.")
    if count == 0:  # a build apart, never into the folder of the script
        assert "Run it here with: mpgen train spec.yaml --device-map cpu\n" in done.stderr


# train: keys as the script's defaults ---------------------------------------


def test_the_specs_train_keys_are_the_scripts_defaults(tmp_path_factory, here, capsys,
                                                       forward_dtypes):
    data = """
        import torch
        from torch.utils.data import TensorDataset


        def make(n):
            x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
            return TensorDataset(x, x.sum(1, keepdim=True) * 100)
    """
    keys = build(tmp_path_factory, KEYS, modules={"loop_keys_data": data})  # the spec's project
    forward_dtypes.clear()  # the build's own runs
    write_module(here, "loop_keys_data", data)  # where the script runs
    run = ok(keys, capsys, "--checkpoint", "c")
    # n: 12 reaches the factory; 3 held out (eval_split) leaves 9 samples:
    # 3 batches of 3, 2 a step (accumulate), so 1 step an epoch, 2 epochs.
    assert run.lines("LoopKeys: ") == ["LoopKeys: 5 parameters; 2 steps of 2 micro-batches of 3 samples"]
    assert [line.split(":")[0] for line in run.lines("eval at")] == [
        "eval at step 1", "eval at step 2"]
    assert lrs(here / "c") == pytest.approx([0.05, 0.025])  # StepLR, step_size 1
    assert set(forward_dtypes) == {torch.bfloat16}  # amp: bf16
    # grad_clip: 0.001: each step moves the weights by lr * 0.001.
    assert 0 < delta(keys.fresh(0), checkpoint(here / "c")["model"]) <= 0.075 * 0.001 * (1 + 1e-6)
    ok(keys, capsys, "--steps", "1", "--checkpoint", "one")
    assert delta(keys.fresh(0), checkpoint(here / "one")["model"]) == pytest.approx(0.05 * 0.001,
                                                                                   rel=1e-4)
    # Flags override the keys; another --data gets none of the spec's arguments.
    write_module(here, "loop_other_data", """
        from loop_keys_data import make as spec_make


        def make(n=6):
            return spec_make(n)
    """)
    run = ok(keys, capsys, "--data", "loop_other_data:make", "--epochs", "1", "--accumulate",
             "1", "--eval-split", "0", "--eval-every", "0")
    assert run.lines("LoopKeys: ") == ["LoopKeys: 5 parameters; 2 steps of 3 samples"]
    assert not run.lines("eval at")


# Data checked against the spec -----------------------------------------------
#
# Every batch (a file's tensors once, as it is read) is compared with the
# spec's shapes and dtypes before the model runs (NOTE [Batches checked
# against the spec] in mpgen/runtime/data.py): one line, exit 1.

#: An image classifier: x [batch, 1, 8, 8], three classes; across two devices
#: for the pipeline script.
IMG = spec("LoopImg", ["conv: {op: Conv2d, args: [1, 2, 3]}",
                       "flat: {op: torch.flatten, start_dim: 1}",
                       "fc: {op: Linear, args: [72, 3]}"],
           inputs="x: [batch, 1, 8, 8]", loss="CrossEntropyLoss",
           top=("placement:", "  conv: cuda:0", "  fc: cuda:1"))
#: Token ids [batch, seq] and a class per token: seq binds across the keys.
TOKENS = spec("LoopTokens", ["emb: {op: Embedding, args: [10, 8]}",
                             "head: {op: Linear, args: [8, 10]}"],
              inputs="tokens: {shape: [batch, seq], dtype: int64}",
              loss="{op: CrossEntropyLoss, class_dim: -1}", train=("batch_size: 4", "steps: 2",
                                                                  "dims: {seq: 6}"))

SHAPED = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def loader():
        x = torch.randn(8, 8, 8)  # no channel dim
        return DataLoader(TensorDataset(x, torch.zeros(8, dtype=torch.int64)), batch_size=4)


    def dicts():
        return DataLoader([{"x": torch.zeros(1, 8, 8)}] * 8, batch_size=4)  # no target


    class Ragged(torch.utils.data.Dataset):  # samples that differ in width
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.zeros(1, 8, 8 + i % 2), torch.tensor(0)


    def ragged():
        return Ragged()
"""


@pytest.fixture(scope="module")
def img(tmp_path_factory) -> Built:
    return build(tmp_path_factory, IMG)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Built:
    return build(tmp_path_factory, TOKENS)


def images(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 1, 8, 8, generator=g),
            "target": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize("files, argv, message", [
    ({"flat.pt": {"x": torch.zeros(16, 8, 8), "target": torch.zeros(16, dtype=torch.int64)}},
     ["--data", "flat.pt"],
     "flat.pt: x is [16, 8, 8], 16 samples of [8, 8]; the spec's input x is [batch, 1, 8, 8], "
     "a sample [1, 8, 8]"),
    ({"floats.npz": {"x": torch.zeros(16, 1, 8, 8), "target": torch.zeros(16)}},
     ["--data", "floats.npz"],
     "floats.npz: target is float32; the spec's target is int64 (integer values)"),
    ({"classes.pt": {"x": torch.zeros(16, 1, 8, 8), "target": torch.full((16,), 3)}},
     ["--data", "classes.pt"],
     "classes.pt: target holds class 3; the spec's target takes classes 0 to 2 or the "
     "ignore_index -100"),
    ({}, ["--data", "loop_shaped:loader"],
     "--data loop_shaped:loader: x is [4, 8, 8]; the spec's input x is [batch, 1, 8, 8]"),
    ({}, ["--data", "loop_shaped:dicts"],
     "--data loop_shaped:dicts: no target (the spec's target [batch])"),
    ({"data.pt": images(16), "eval.pt": {"x": torch.zeros(4, 1, 8, 4),
                                         "target": torch.zeros(4, dtype=torch.int64)}},
     ["--data", "data.pt", "--eval-data", "eval.pt"],
     "eval.pt: x is [4, 1, 8, 4], 4 samples of [1, 8, 4]; the spec's input x is "
     "[batch, 1, 8, 8], a sample [1, 8, 8]"),
])
def test_data_not_shaped_as_the_spec_says_is_one_line(img, here, capsys, files, argv, message):
    write_module(here, "loop_shaped", SHAPED)
    for name, tensors in files.items():
        save(here / name, tensors)
    run = main(img, capsys, *argv, "--steps", "2")
    assert run.code == message
    assert "Traceback" not in run.out + run.err


def test_samples_that_do_not_stack_are_one_line(img, here, capsys):
    write_module(here, "loop_shaped", SHAPED)
    done = subprocess_run(img, here, "--data", "loop_shaped:ragged", "--workers", "1")
    assert done.returncode == 1 and "step 1" not in done.stdout  # stopped before the model ran
    assert done.stderr.startswith("--data loop_shaped:ragged: the samples' x do not stack "
                                  "(RuntimeError: stack expects each tensor to be equal size")
    assert len(done.stderr.splitlines()) == 1


def test_named_dims_bind_across_the_keys_of_a_batch(tokens, here, capsys):
    save(here / "short.pt", {"tokens": torch.zeros(8, 6, dtype=torch.int64),
                             "target": torch.zeros(8, 5, dtype=torch.int64)})
    run = main(tokens, capsys, "--data", "short.pt", "--steps", "1")
    assert run.code == ("short.pt: target is [8, 5], 8 samples of [5]; the spec's target is "
                        "[batch, seq], a sample [seq] (with seq = 6 from the other keys)")
    # Any seq the keys agree on trains (the spec's 6 is the synthetic data's).
    save(here / "long.pt", {"tokens": torch.zeros(8, 9, dtype=torch.int64),
                            "target": torch.zeros(8, 9, dtype=torch.int64)})
    assert "step 1/1" in ok(tokens, capsys, "--data", "long.pt", "--steps", "1").out


def test_a_dtype_of_the_same_kind_is_converted(img, here, capsys):
    data = images(16)
    save(here / "wide.npz", {"x": data["x"].double(), "target": data["target"].int()})
    save(here / "spec.pt", data)
    ok(img, capsys, "--data", "wide.npz", "--steps", "2", "--log-dir", "wide")
    ok(img, capsys, "--data", "spec.pt", "--steps", "2", "--log-dir", "spec")
    assert losses(here / "wide") == losses(here / "spec")


def test_a_wrong_data_file_in_a_real_run_exits_1_with_the_line_alone(img, tmp_path):
    save(tmp_path / "flat.pt", {"x": torch.zeros(16, 8, 8),
                                "target": torch.zeros(16, dtype=torch.int64)})
    done = subprocess_run(img, tmp_path, "--data", "flat.pt")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == ("flat.pt: x is [16, 8, 8], 16 samples of [8, 8]; the spec's input x "
                           "is [batch, 1, 8, 8], a sample [1, 8, 8]\n")


def test_the_pipeline_script_checks_its_batches_too(img, tmp_path):
    save(tmp_path / "flat.pt", {"x": torch.zeros(16, 8, 8),
                                "target": torch.zeros(16, dtype=torch.int64)})
    script = img.folder / "pp_loop_img.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--data", str(tmp_path / "flat.pt"), "--steps", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert run.returncode != 0
    assert ("flat.pt: x is [16, 8, 8], 16 samples of [8, 8]; the spec's input x is "
            "[batch, 1, 8, 8], a sample [1, 8, 8]") in run.stderr
    assert "[rank0]: Traceback" not in run.stderr and "[rank1]: Traceback" not in run.stderr


# A target flattened with its samples ([seq*batch]) ----------------------------

#: pytorch/examples' word_language_model (RNNModel, LSTM): sequence-first,
#: its log-probs reshaped to [seq*batch, vocab] for NLLLoss; no dropout, so
#: that a hand-written reference follows it exactly.
WORD_LM = """
mpgen: 1
name: LoopWordLM
inputs:
  tokens: {shape: [seq, batch], dtype: int64}
  h0: [2, batch, 32]
  c0: [2, batch, 32]
layers:
  encoder: {op: Embedding, args: [50, 16], in: tokens}
  rnn: {op: LSTM, args: [16, 32, 2], in: [encoder, [h0, c0]], outputs: [seq_out, [hn, cn]]}
  decoder: {op: Linear, args: [32, 50], in: seq_out}
  flat: {op: torch.reshape, shape: [-1, 50]}
  logp: {op: torch.log_softmax, dim: 1}
outputs: [logp, hn, cn]
train:
  loss: {logp: NLLLoss}
  optimizer: {op: SGD, lr: 1.0}
  batch_size: 4
  dims: {seq: 6}
"""


class RNNModel(nn.Module):
    """pytorch/examples' word_language_model.RNNModel (LSTM, no dropout), as written there."""

    def __init__(self, ntoken: int = 50, ninp: int = 16, nhid: int = 32, nlayers: int = 2):
        super().__init__()
        self.ntoken = ntoken
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        emb = self.encoder(input)
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return torch.nn.functional.log_softmax(decoded, dim=1), hidden


def test_a_sequence_first_lm_trains_like_pytorch_examples(tmp_path_factory, here, capsys):
    built = build(tmp_path_factory, WORD_LM)
    training = built.train.TRAINING
    assert training.batch_dims == (1, 1, 1, (0, 1))  # the target: [seq, batch], flattened
    # 16 samples of 6 tokens from one stream, each target the next 6 tokens.
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 50, (16, 7), generator=g)
    data = {"tokens": stream[:, :-1], "target": stream[:, 1:],
            "h0": torch.zeros(16, 2, 32), "c0": torch.zeros(16, 2, 32)}
    save(here / "lm.pt", data)
    ok(built, capsys, "--data", "lm.pt", "--steps", "3", "--log-dir", "lm")
    got = losses(here / "lm")

    reference = RNNModel()
    reference.load_state_dict(built.fresh(0).state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    # The runtime's order of samples (data.batches): a permutation seeded by --seed and the epoch.
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0)).view(-1, 4)
    expected, batch_major = [], []
    for step in range(3):
        idx = order[step]
        # pytorch/examples' batchify/get_batch: a column per sequence, targets .view(-1).
        source, target = data["tokens"][idx].t(), data["target"][idx].t().reshape(-1)
        hidden = (data["h0"][idx].transpose(0, 1), data["c0"][idx].transpose(0, 1))
        output, _ = reference(source, hidden)
        loss = nn.functional.nll_loss(output, target)
        batch_major.append(nn.functional.nll_loss(output, data["target"][idx].reshape(-1)).item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert got == pytest.approx(expected, rel=1e-5)
    # The layout matters: targets stacked batch-first would give other losses.
    assert got[0] != pytest.approx(batch_major[0], rel=1e-3)


def test_a_batch_first_flattened_target_stacks_batch_first(tmp_path_factory):
    built = build(tmp_path_factory, spec(
        "LoopFlatFirst", ["emb: {op: Embedding, args: [10, 8]}",
                          "head: {op: Linear, args: [8, 10]}",
                          "flat: {op: torch.flatten, start_dim: 0, end_dim: 1}"],
        inputs="tokens: {shape: [batch, seq], dtype: int64}", loss="CrossEntropyLoss",
        train=("batch_size: 4", "steps: 1", "dims: {seq: 3}")))
    training = built.train.TRAINING
    assert training.batch_dims == (0, (0, 0))
    import mpgen_runtime

    samples = [(torch.arange(3) + 10 * b, torch.arange(3) + 10 * b) for b in range(4)]
    tokens, target = mpgen_runtime.data.collate(samples, training)
    assert target.tolist() == tokens.flatten().tolist()  # as flatten(0, 1) orders the output
    half = mpgen_runtime.data.share((tokens, target), training, 1, 2)
    assert half[1].tolist() == tokens[2:].flatten().tolist()


def test_the_pipeline_script_of_a_flattened_target_says_why_it_cannot_run(tmp_path_factory):
    built = build(tmp_path_factory, WORD_LM.replace("LoopWordLM", "LoopWordPipe"))
    run = subprocess.run([sys.executable, "pp_loop_word_pipe.py", "--steps", "1"],
                         cwd=built.folder, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert ("the target of logp [seq*batch] holds its samples inside seq*batch, which the "
            "schedule cannot split into micro-batches") in run.stderr
    assert "Traceback" not in run.stderr


def test_a_spec_without_train_refuses_token_id_targets_in_one_line(tmp_path_factory, here,
                                                                   capsys):
    # No train: the default MSELoss, whose targets are shaped like the logits.
    built = build(tmp_path_factory, "\n".join([
        "mpgen: 1", "name: LoopNoTrain", "inputs:",
        "  idx: {shape: [batch, seq], dtype: int64}", "layers:",
        "  wte: {op: Embedding, args: [10, 8]}", "  head: {op: Linear, args: [8, 10]}", ""]))
    ids = torch.randint(0, 10, (8, 5))
    save(here / "tokens.pt", {"idx": ids, "target": ids})
    run = main(built, capsys, "--data", "tokens.pt", "--steps", "1")
    assert run.code == ("tokens.pt: target is [8, 5], 8 samples of [5]; the spec's target is "
                        "[batch, seq, 10], a sample [seq, 10] (with seq = 5 from the other keys)")
    assert "step 1/1" in ok(built, capsys, "--steps", "1").out  # its synthetic targets fit


def test_an_npz_of_pickled_objects_is_refused_unread(reg, here, capsys):
    numpy.savez(here / "objects.npz", x=numpy.array([{"a": 1}], dtype=object),
                target=numpy.zeros((1, 1)))
    run = main(reg, capsys, "--data", "objects.npz", "--steps", "1")
    assert run.code == ("--data: cannot read objects.npz (ValueError: Object arrays cannot be "
                        "loaded when allow_pickle=False)")
