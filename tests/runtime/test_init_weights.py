"""--init: the single-process loop (and the pipeline's stages) start from a
state dict in a .pt or .safetensors file, loaded strictly; a key missing
because its parameter is tied to one in the file takes that tensor; what
does not fit stops the run with one line naming the keys (mpgen/runtime)."""

from __future__ import annotations

import sys

import pytest
import safetensors.torch
import torch
from torch import nn

from mpgen.runtime import checkpoint, loop
from tiny import TRAINING, Tiny, training


def train(*argv: str, spec=TRAINING) -> None:
    loop.train(spec, list(argv))


def save(state: dict, path) -> None:
    if path.suffix == ".safetensors":
        safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        torch.save(state, path)


def weights(seed: int) -> dict:
    torch.manual_seed(seed)
    return Tiny().state_dict()


def trained(folder) -> dict:
    return torch.load(folder / "last.pt", weights_only=True)["model"]


@pytest.mark.parametrize("name", ["init.pt", "init.safetensors"])
def test_the_run_starts_from_the_file(tmp_path, name, capsys):
    save(weights(7), tmp_path / name)
    train("--steps", "1", "--lr", "0", "--init", str(tmp_path / name),
          "--checkpoint", str(tmp_path / "run"))
    assert f"started from {tmp_path / name}\n" in capsys.readouterr().out
    after, expected = trained(tmp_path / "run"), weights(7)
    assert all(torch.equal(after[key], value) for key, value in expected.items())
    assert not torch.equal(after["head.weight"], weights(0)["head.weight"])  # not --seed's


def test_a_checkpoint_of_a_run_is_a_state_dict_to_start_from(tmp_path):
    train("--steps", "2", "--checkpoint", str(tmp_path / "first"))
    train("--steps", "1", "--lr", "0", "--init", str(tmp_path / "first" / "last.pt"),
          "--checkpoint", str(tmp_path / "second"))
    first, second = trained(tmp_path / "first"), trained(tmp_path / "second")
    assert all(torch.equal(first[key], second[key]) for key in first)


class Tied(nn.Module):
    """An embedding and a head that shares its weight (head.weight is embed.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4, bias=False)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight


TIED = training(model=Tied, ties=(("head.weight", "embed.weight"),))


@pytest.mark.parametrize("saved", ["embed.weight", "head.weight"])
def test_a_key_left_out_for_its_tie_takes_the_tensor_it_is_tied_to(tmp_path, saved):
    """Hugging Face's save_pretrained writes one key of a tied pair (lm_head.weight
    is left out); either one fills the model."""
    value = torch.arange(12.0).reshape(4, 3)
    save({saved: value}, tmp_path / "tied.safetensors")
    model = Tied()
    checkpoint.initialise([model], str(tmp_path / "tied.safetensors"),
                          list(model.state_dict()), TIED)
    assert torch.equal(model.embed.weight, value) and model.head.weight is model.embed.weight


@pytest.mark.parametrize("state, message", [
    ({"hidden.weight": torch.zeros(8, 4)},
     "not a state dict of Tiny: 3 missing (hidden.bias, head.weight, head.bias)"),
    (weights(0) | {f"extra.{k}": torch.zeros(1) for k in range(7)},
     "not a state dict of Tiny: 7 unexpected (extra.0, extra.1, extra.2, extra.3, extra.4, ...)"),
    ({k.replace("head", "out"): v for k, v in weights(0).items()},
     "not a state dict of Tiny: 2 missing (head.weight, head.bias); 2 unexpected (out.bias, "
     "out.weight)"),  # a safetensors file's keys come sorted
    (weights(0) | {"head.bias": torch.zeros(5)},
     "RuntimeError: Error(s) in loading state_dict for Tiny: size mismatch for head.bias: "
     "copying a param with shape torch.Size([5]) from checkpoint, the shape in current model "
     "is torch.Size([3])."),
])
def test_a_state_dict_that_does_not_fit_stops_naming_the_keys(tmp_path, state, message):
    save(state, tmp_path / "other.safetensors")
    with pytest.raises(SystemExit) as stop:
        train("--steps", "1", "--init", str(tmp_path / "other.safetensors"))
    assert stop.value.code == f"--init {tmp_path / 'other.safetensors'}: {message}"


def test_a_file_that_is_not_a_state_dict_stops_in_one_line(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    torch.save([1, 2], tmp_path / "list.pt")
    for name, reason in (("junk.safetensors", "SafetensorError: Error while deserializing "
                          "header: header too small"),
                         ("list.pt", "ValueError: expected a dict of tensors, got list")):
        with pytest.raises(SystemExit) as stop:
            train("--steps", "1", "--init", str(tmp_path / name))
        assert stop.value.code == f"--init {tmp_path / name}: cannot read it ({reason})"


def test_without_safetensors_a_safetensors_file_says_how_to_install_it(tmp_path, monkeypatch):
    save(weights(0), tmp_path / "init.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if not installed
    with pytest.raises(SystemExit) as stop:
        train("--steps", "1", "--init", str(tmp_path / "init.safetensors"))
    assert stop.value.code == (f"--init {tmp_path / 'init.safetensors'}: cannot read it "
                               "(ValueError: it needs safetensors: pip install safetensors)")


def test_resume_takes_the_checkpoints_weights_not_inits(tmp_path, capsys):
    folder = tmp_path / "run"
    train("--steps", "2", "--checkpoint", str(folder))
    straight = trained(folder)
    train("--steps", "3", "--checkpoint", str(folder), "--resume",
          "--init", str(tmp_path / "gone.pt"))  # not read: no file is needed
    assert (f"resumed from {folder / 'last.pt'} at step 2 (its weights, not --init's)\n"
            in capsys.readouterr().out)
    assert torch.load(folder / "last.pt", weights_only=True)["step"] == 3
    assert straight.keys() == trained(folder).keys()
