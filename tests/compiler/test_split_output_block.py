"""A block instance that is the model's output splits like any other
(docs/spec.md, "Placement"; NOTE [Placement inside a block instance] in
frontend/resolve.py): a Llama body without a head, by explicit keys inside
it and by ``placement.auto.split``, keeps its output's name and value, and
equals the unsplit model on virtual devices; so does Hugging Face's own
``LlamaModel``, imported directly and through a user's class whose output
is the body."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from helpers import EXAMPLES, build_to, import_generated, mpgen, write_spec
from mpgen.compiler import driver
from mpgen.testing import virtual_devices

pytestmark = pytest.mark.slow  # builds a Llama body several times; imports Hugging Face's


def _body(placement: str, name: str) -> str:
    """examples/tiny_llama.yaml without its head: the body ``model`` is the output."""
    text = (EXAMPLES / "tiny_llama.yaml").read_text()
    text = text[text.index("mpgen: 1"):text.index("\nplacement:")]
    text = text.replace("name: TinyLlama", f"name: {name}")
    text = text.replace("  lm_head: {op: Linear, args: [32, 64], bias: false}\n", "")
    return text + placement + """
train:
  loss: MSELoss
  optimizer: {op: AdamW, lr: 1.0e-3}
  batch_size: 2
  dims: {seq: 16}
"""


EXPLICIT = """
placement:
  model.layers.0-1: cuda:0
  model.layers.2-3: cuda:1
  model.norm: cuda:1
"""
AUTO = """
placement:
  auto: {devices: [cuda:0, cuda:1], split: [model]}
"""
WHOLE = """
placement: {}
"""


def _build(tmp_path, placement: str, name: str, device_map=None):
    for module in [m for m in sys.modules if m.endswith(name)]:
        sys.modules.pop(module)  # an earlier test's build of the same spec
    stem = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    folder = tmp_path / stem
    result = build_to(write_spec(tmp_path, _body(placement, name), f"{stem}.yaml"), folder,
                      device_map)
    return result, folder, stem


def _devices(graph) -> dict[str, tuple[str, ...]]:
    return {n.name: n.devices for n in graph.nodes}


def test_the_body_splits_and_its_output_keeps_its_name(tmp_path):
    result, _, stem = _build(tmp_path, EXPLICIT, "BodyExplicit")
    graph = result.graph
    assert [s.path for s in graph.splits] == ["model"]
    assert graph.outputs == ("model",)
    assert graph.aliases == (("model", "model.norm"),)
    devices = _devices(graph)
    assert devices["model.embed_tokens"] == ("cuda:0",)
    assert devices["model.layers"] == ("cuda:0", "cuda:0", "cuda:1", "cuda:1")
    assert devices["model.norm"] == ("cuda:1",)
    code = result.files[f"{stem}.py"]
    assert "self.model = nn.Module()" in code
    assert code.rstrip().endswith("norm = self.model.norm(layers)  # [batch, seq, 32]\n"
                                  "        return norm")
    # the scripts know the output by its name, on the device it ends on
    assert '"""The loss: MSELoss of model, on cuda:1;' in result.files[f"train_{stem}.py"]
    assert "outputs=(\"model\",)" in result.files[f"predict_{stem}.py"]
    assert "model.norm" in result.files[f"pp_{stem}.py"]


def test_automatic_placement_splits_the_body(tmp_path):
    result, _, _ = _build(tmp_path, AUTO, "BodyAuto")
    devices = _devices(result.graph)
    assert result.graph.aliases == (("model", "model.norm"),)
    assert {d for ds in devices.values() for d in ds} == {"cuda:0", "cuda:1"}
    assert devices["model.embed_tokens"] == ("cuda:0",)
    assert devices["model.norm"] == ("cuda:1",)


def _run(model_class, state, ids):
    """Output and every gradient of ``model_class`` loaded with ``state``, on 2 virtual devices."""
    with virtual_devices(cuda=2):
        model = model_class()
        model.load_state_dict(state, strict=True)
        out = model(ids)
        out.sum().backward()
        return out.cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement, name", [(EXPLICIT, "BodyExplicit"), (AUTO, "BodyAuto")])
def test_the_split_body_equals_the_unsplit_one(tmp_path, placement, name):
    whole, folder, stem = _build(tmp_path, WHOLE, "BodyWhole")
    assert not whole.graph.splits and "class LlamaModel" in whole.files[f"{stem}.py"]
    unsplit = getattr(import_generated(folder / f"{stem}.py"), whole.graph.name)
    result, folder, stem = _build(tmp_path, placement, name)
    split = getattr(import_generated(folder / f"{stem}.py"), result.graph.name)
    torch.manual_seed(0)
    with virtual_devices(cuda=2, merge=True):
        state = {k: (v + torch.randn_like(v) * 0.1).cpu()  # norms not all ones
                 for k, v in unsplit().state_dict().items()}
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    expected, expected_grads = _run(unsplit, state, ids)
    out, grads = _run(split, state, ids)
    assert torch.equal(out, expected)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], rtol=1e-5, atol=1e-5)


def test_the_pipeline_program_runs_the_split_body(tmp_path):
    """pp_<name>.py's stages hold the body's layers; chained, they give the
    model's output."""
    result, folder, stem = _build(tmp_path, EXPLICIT, "BodyStages", {"*": "cpu"})
    pp = import_generated(folder / f"pp_{stem}.py")
    model = getattr(import_generated(folder / f"{stem}.py"), result.graph.name)()
    stages = [stage() for stage in pp.STAGES.stages]
    assert len(stages) == 2
    state = model.state_dict()
    for stage in stages:
        stage.load_state_dict({k: state[k] for k in stage.state_dict()}, strict=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    values = (ids,)
    for stage in stages:
        values = stage(*values)
    (out,) = values
    assert torch.equal(out, model(ids))


# -- Hugging Face's LlamaModel ----------------------------------------------------------

LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}

WRAPPER = f"""
import torch.nn as nn
from transformers import LlamaConfig, LlamaModel


class Body(nn.Module):
    \"\"\"A user's class whose output is the library's body.\"\"\"

    def __init__(self):
        super().__init__()
        self.model = LlamaModel(LlamaConfig(**{LLAMA!r}))

    def forward(self, input_ids):
        return self.model(input_ids).last_hidden_state
"""


def _imported_matches(tmp_path, reference: torch.nn.Module, spec_text: str):
    """The imported spec, built for its two devices, loads ``reference``'s
    state dict strictly and reproduces its output and every gradient."""
    spec = tmp_path / "imported.yaml"
    spec.write_text(spec_text)
    result = build_to(spec, tmp_path / "out")
    devices = {d for n in result.graph.nodes for d in n.devices}
    assert devices == {"cuda:0", "cuda:1"}, devices
    module = import_generated(tmp_path / "out" / f"{_stem(result.graph.name)}.py")
    with torch.no_grad():  # weights that make every output depend on them
        for param in reference.parameters():
            param.normal_(0, 0.1)
    reference.eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = reference(ids)
    expected = expected if isinstance(expected, torch.Tensor) else expected.last_hidden_state
    expected.sum().backward()
    theirs = dict(reference.named_parameters())
    with virtual_devices(cuda=2):
        model = getattr(module, result.graph.name)()
        model.load_state_dict(reference.state_dict(), strict=True)
        model.eval()
        out = model(ids)
        out.sum().backward()
        assert str(out.device) == "cuda:1"
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad.cpu(), theirs[name].grad, rtol=1e-5,
                                       atol=1e-5, msg=name)
    return result.graph


def _stem(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_hugging_face_llama_model_imported_over_two_devices(tmp_path):
    pytest.importorskip("transformers")
    import transformers

    ran = mpgen("import", "transformers:LlamaModel", "--config", json.dumps(LLAMA),
                "--input", "input_ids=batch,16:int64", "--devices", "2",
                "-o", str(tmp_path / "imported.yaml"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    torch.manual_seed(0)
    reference = transformers.LlamaModel(transformers.LlamaConfig(**LLAMA))
    _imported_matches(tmp_path, reference,
                      (tmp_path / "imported.yaml").read_text())


def test_a_users_class_whose_output_is_the_body(tmp_path, monkeypatch):
    """The wrapper's one layer is the body, a block instance that is the
    model's output: the import splits it (``split: [model]``)."""
    pytest.importorskip("transformers")
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    ran = mpgen("import", "wrapper:Body", "--input", "input_ids=batch,16:int64",
                "--devices", "2", "--trace", "dynamo", "-o", str(tmp_path / "imported.yaml"),
                cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    text = (tmp_path / "imported.yaml").read_text()
    assert "split: [model]" in text, text
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("wrapper", None)
    import wrapper

    torch.manual_seed(0)
    graph = _imported_matches(tmp_path, wrapper.Body(), text)
    assert graph.outputs == ("model",) and dict(graph.aliases)["model"] == "model.norm"


def test_place_writes_the_split_body_back(tmp_path):
    """``mpgen place --write`` names the body's layers that the bookmarks
    leave off the instance's device (model.norm after model.layers.2-3):
    inside a split instance, a layer no key names is on the instance's."""
    spec = write_spec(tmp_path, _body(AUTO, "BodyPlaced"), "body_placed.yaml")
    auto = driver.compile_spec(spec)
    ran = mpgen("place", str(spec), "--write", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    text = spec.read_text()
    assert "  model.layers.2-3: cuda:1\n  model.norm: cuda:1\n" in text, text
    written = driver.compile_spec(spec)
    assert written.layout.method == "explicit"
    assert _devices(written) == _devices(auto)
