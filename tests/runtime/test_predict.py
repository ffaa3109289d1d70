"""mpgen_runtime.predict in process, on tests/runtime/tiny.py's model: the
weights from each place they come from, the data in each format, the
outputs written by name and equal to the model's, the loss and accuracy,
and the refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from mpgen.runtime import checkpoint, sharded
from mpgen.runtime.predict import (
    Predicting,
    forward,
    join,
    padded,
    predict,
    split,
)

import tiny

#: Tiny as a generated train_<name>.py states it, with the shapes its batches are checked against.
TRAINING = tiny.training(shapes=(("batch", 4), ("batch",)), dtypes=("float32", "int64"),
                         classes=(None, (3, None)))
PREDICTING = Predicting(training=TRAINING, outputs=("head",), output_dims=(0,), scored=((0, 1),))


@pytest.fixture
def model() -> tiny.Tiny:
    torch.manual_seed(3)
    return tiny.Tiny().eval()


@pytest.fixture
def data(tmp_path) -> Path:
    torch.manual_seed(4)
    x = torch.randn(11, 4)
    path = tmp_path / "data.pt"
    torch.save({"x": x, "target": x[:, :3].argmax(1)}, path)
    return path


def saved_last(folder: Path, model) -> Path:
    """A train script's checkpoint folder: DIR/last.pt."""
    state = checkpoint.state(model, None, None, None, 2)
    checkpoint.save(state, folder / "last.pt")
    return folder


def outputs(path: Path) -> dict:
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    if path.suffix == ".npz":
        with numpy.load(path) as arrays:
            return {key: torch.from_numpy(arrays[key]) for key in arrays.files}
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_the_outputs_are_the_model_s_by_name_in_the_data_s_order(tmp_path, model, data, suffix,
                                                                 capsys):
    saved_last(tmp_path / "run", model)
    out = tmp_path / f"out{suffix}"
    predict(PREDICTING, ["--checkpoint", str(tmp_path / "run"), "--data", str(data),
                         "--out", str(out), "--batch-size", "4"])
    x = torch.load(data)["x"]
    found = outputs(out)
    assert list(found) == ["head"]
    with torch.no_grad():
        assert torch.allclose(found["head"], model(x), atol=1e-6)
    printed = capsys.readouterr().out.splitlines()
    target = torch.load(data)["target"]
    with torch.no_grad():
        loss = sum(torch.nn.functional.cross_entropy(model(b), t).item() * len(b)
                   for b, t in zip(x.split(4), target.split(4))) / 11
        accuracy = (model(x).argmax(1) == target).float().mean().item()
    assert printed[0].startswith("torch threads: ")
    assert printed[2] == f"loss {loss:.6g} over 11 samples; head accuracy {accuracy:.4f}"
    assert printed[3] == f"wrote {out}: head [11, 3] float32"


def test_a_file_of_inputs_alone_gives_the_outputs_and_no_loss(tmp_path, model, capsys):
    saved_last(tmp_path / "run", model)
    x = torch.randn(5, 4)
    safetensors.torch.save_file({"x": x}, tmp_path / "x.safetensors")
    out = tmp_path / "out.safetensors"
    predict(PREDICTING, ["--checkpoint", str(tmp_path / "run" / "last.pt"),
                         "--data", str(tmp_path / "x.safetensors"), "--out", str(out)])
    with torch.no_grad():
        assert torch.allclose(outputs(out)["head"], model(x), atol=1e-6)
    assert "loss" not in capsys.readouterr().out


def test_init_reads_a_state_dict_and_a_save_pretrained_folder_whole_or_sharded(
        tmp_path, model, data):
    x = torch.load(data)["x"]
    with torch.no_grad():
        expected = model(x)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(state, tmp_path / "w.safetensors")
    whole = tmp_path / "whole"
    whole.mkdir()
    safetensors.torch.save_file(state, whole / "model.safetensors")
    shards = tmp_path / "shards"
    shards.mkdir()
    index = {}
    for k, key in enumerate(state):
        name = f"model-{k:05d}-of-{len(state):05d}.safetensors"
        safetensors.torch.save_file({key: state[key]}, shards / name)
        index[key] = name
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    for source in (tmp_path / "w.safetensors", whole, shards):
        out = tmp_path / f"{source.stem}.pt"
        predict(PREDICTING, ["--init", str(source), "--data", str(data), "--out", str(out)])
        assert torch.allclose(outputs(out)["head"], expected, atol=1e-6), source


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_pipeline_checkpoint_s_newest_complete_step_is_read(tmp_path, model, data):
    """A step_N folder as the pipeline program writes it (DCP, keyed by the
    model's keys), an older and a partial one beside it."""
    root = tmp_path / "pp"
    for step, scale in ((1, 0.0), (2, 1.0), (3, 5.0)):
        state = {"model": {k: v * scale for k, v in model.state_dict().items()}, "step": step}
        folder = root / (f"step_{step}" if step < 3 else f".step_{step}.partial")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
        if step < 3:
            (folder / sharded.MARKER).write_text(f"step {step}\n")
    out = tmp_path / "out.safetensors"
    predict(PREDICTING, ["--checkpoint", str(root), "--data", str(data), "--out", str(out)])
    with torch.no_grad():
        assert torch.allclose(outputs(out)["head"], model(torch.load(data)["x"]), atol=1e-6)


def test_micro_batches_split_each_batch_and_join_its_outputs(model):
    x = torch.randn(7, 4)
    with torch.no_grad():
        assert torch.allclose(forward(model, PREDICTING, (x,), 3), model(x), atol=1e-6)


@pytest.mark.parametrize("layout", [0, 1, (0, 0), (0, 1)])
def test_split_and_join_are_inverse_along_each_layout(layout):
    """A product [seq*batch] with the batch its outer (b*S + s) or inner (s*B + b) factor."""
    size, seq = 5, 3
    if isinstance(layout, tuple):
        x = torch.arange(size * seq * 2).view(size * seq, 2)
    else:
        x = torch.arange(size * 2 * 3).view(*((size, 2, 3) if layout == 0 else (2, size, 3)))
    parts = split(x, layout, size, 2)
    sizes = [3, 2]  # tensor_split's runs of 5 samples in 2
    assert torch.equal(join(parts, layout, sizes), x)


def test_a_short_batch_is_padded_with_its_last_sample():
    x = torch.arange(6).view(3, 2)
    (found,) = padded((x,), (0,), 3, 5)
    assert torch.equal(found, torch.tensor([[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]))


def test_a_file_that_does_not_fit_the_inputs_is_refused_in_one_line(tmp_path, model):
    saved_last(tmp_path / "run", model)
    torch.save({"x": torch.randn(6, 5)}, tmp_path / "bad.pt")
    with pytest.raises(SystemExit) as stop:
        predict(PREDICTING, ["--checkpoint", str(tmp_path / "run"),
                             "--data", str(tmp_path / "bad.pt")])
    assert str(stop.value) == (f"{tmp_path / 'bad.pt'}: x is [6, 5], 6 samples of [5]; the "
                               "spec's input x is [batch, 4], a sample [4]")


def test_weights_of_another_model_are_refused_in_one_line(tmp_path, data):
    torch.save({"other.weight": torch.zeros(2)}, tmp_path / "w.pt")
    with pytest.raises(SystemExit) as stop:
        predict(PREDICTING, ["--init", str(tmp_path / "w.pt"), "--data", str(data)])
    assert str(stop.value).startswith(f"--init {tmp_path / 'w.pt'}: not a state dict of Tiny: "
                                      "4 missing (hidden.weight")


@pytest.mark.parametrize("args, message", [
    ([], "give the weights: --checkpoint PATH or --init FILE (one of them)"),
    (["--checkpoint", "nowhere"], "--checkpoint: no file or folder nowhere"),
    (["--init", "w.pt", "--out", "out.csv"], "--out out.csv: give a file ending .safetensors, "
                                             ".pt, .npz"),
])
def test_flags_predict_cannot_use_are_one_usage_line(tmp_path, monkeypatch, capsys, args,
                                                     message):
    monkeypatch.chdir(tmp_path)
    torch.save({}, tmp_path / "w.pt")
    with pytest.raises(SystemExit) as stop:
        predict(PREDICTING, args)
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {message}\n")


def test_a_folder_with_no_weights_is_named(tmp_path, data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        predict(PREDICTING, ["--checkpoint", str(tmp_path / "empty"), "--data", str(data)])
    assert str(stop.value) == (
        f"--checkpoint {tmp_path / 'empty'}: a folder with no last.pt, no complete step_N "
        "checkpoint (with its COMPLETE marker) and no model.safetensors")


FACTORY = '''
import torch
from torch.utils.data import DataLoader, Dataset


class Inputs(Dataset):
    """Samples of the input alone, as dicts."""

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"x": torch.arange(4.0) + i}


def inputs():
    return Inputs()


def loader():
    xs = torch.arange(24.0).view(6, 4)
    return DataLoader(list(zip(xs, xs[:, :3].argmax(1))), batch_size=4)
'''


def test_a_factory_s_dataset_or_dataloader_runs_in_its_order(tmp_path, model, monkeypatch,
                                                              capsys):
    (tmp_path / "mydata.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved_last(tmp_path / "run", model)
    predict(PREDICTING, ["--checkpoint", "run", "--data", "mydata:inputs", "--out", "a.pt"])
    with torch.no_grad():
        expected = model(torch.arange(4.0) + torch.arange(5.0)[:, None])
    assert torch.allclose(outputs(tmp_path / "a.pt")["head"], expected, atol=1e-6)
    assert "loss" not in capsys.readouterr().out  # no targets: the outputs only
    predict(PREDICTING, ["--checkpoint", "run", "--data", "mydata:loader", "--out", "b.pt"])
    with torch.no_grad():
        expected = model(torch.arange(24.0).view(6, 4))
    assert torch.allclose(outputs(tmp_path / "b.pt")["head"], expected, atol=1e-6)
    assert "over 6 samples; head accuracy" in capsys.readouterr().out
