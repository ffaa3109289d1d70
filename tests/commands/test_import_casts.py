"""``mpgen import`` of models that cast (docs/spec.md, "Casts"): Hugging Face's
T5, whose relative position buckets are ``.to(torch.long)`` of a float
logarithm, and RoBERTa, whose position ids are ``.int()`` of a mask, a
``cumsum``, ``.type_as`` and ``.long()``. Each imports through TorchDynamo,
builds for the CPU and for two devices, loads the reference's own
``state_dict()`` strictly by name, and gives its outputs and every gradient
within 1e-5, in eval and train mode; a cast a spec writes and one that disappears are seen in the
spec, from both tracers.

T5 holds its token embedding as ``shared``, which forward never calls (its
stacks' ``embed_tokens`` share the weight): the spec holds it with ``call:
false`` and ties the stacks' embeddings to it; its stack's ``block.0``, which
alone holds the relative attention bias, and ``block.1`` are the items of an
nn.ModuleList ``block``, so every key is the original's, with no mapping.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import build_to, import_generated
from mpgen.compiler.codegen.common import file_names

pytestmark = pytest.mark.slow

T5 = {"vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
      "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
      "relative_attention_max_distance": 16}
#: pad_token_id 1, as RoBERTa's: the sample ids hold some, whose positions stay 1
ROBERTA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 40,
           "pad_token_id": 1}
TOKENS = "input_ids=batch,16:int64"

#: name -> (MODULE:CLASS, --config, inputs, casts the spec writes)
MODELS = {
    "t5_encoder": ("transformers:T5EncoderModel", T5, [TOKENS], ["dtype: int64"]),
    "t5": ("transformers:T5Model", T5, [TOKENS, "decoder_input_ids=batch,16:int64"],
           ["dtype: int64"]),
    "roberta": ("transformers:RobertaModel", ROBERTA, [TOKENS],
                ["dtype: int32", "dtype: int64"]),
}


def _import(case: str, devices=None):
    from mpgen.commands import importer

    target, config, inputs, _ = MODELS[case]
    root = importer.load_module(target, None, json.dumps(config))
    specs = [importer.parse_input(text) for text in inputs]
    imported = importer.import_module(root, specs, f"mpgen import {target}", devices,
                                      tracer="dynamo")
    return root, specs, imported


def _built(text: str, tmp_path, device_map):
    spec = tmp_path / "imported.yaml"
    spec.write_text(text)
    result = build_to(spec, tmp_path / "out", device_map)
    path = tmp_path / "out" / file_names(result.graph)["model"]
    return result, path


def _tensors(output) -> list[torch.Tensor]:
    """The floating-point tensors of an output: a model output's fields, a
    tuple's elements, nested (T5's past key values are none: no cache)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


@pytest.mark.parametrize("case", MODELS)
def test_reproduces_the_reference(case, tmp_path):
    pytest.importorskip("transformers")
    root, specs, imported = _import(case)
    for cast in MODELS[case][3]:
        assert f"op: torch.Tensor.to, {cast}" in imported.text, imported.text
    torch.manual_seed(0)
    with torch.no_grad():  # weights that make every output depend on them
        for param in root.parameters():
            param.normal_(0, 0.1)
    result, path = _built(imported.text, tmp_path, {"*": "cpu"})
    generated = getattr(import_generated(path), result.graph.name)()
    assert not imported.renamed  # by name, no mapping
    state = root.state_dict()
    assert set(state) == set(generated.state_dict())
    generated.load_state_dict(state, strict=True)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 64, [2 if d == "batch" else d for d in spec.dims],
                             generator=generator) for spec in specs]
    theirs = {name: param for name, param in root.named_parameters(remove_duplicate=False)}
    for train in (False, True):  # in train mode, the same dropout masks from the same seed
        root.train(train)
        generated.train(train)
        root.zero_grad()
        generated.zero_grad()
        torch.manual_seed(2)
        expected = _tensors(root(**{s.name: x for s, x in zip(specs, samples)}))
        torch.manual_seed(2)
        got = _tensors(generated(*samples))
        assert len(got) == len(expected) > 0
        for mine, reference in zip(got, expected):
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
        sum(t.sum() for t in expected).backward()
        sum(t.sum() for t in got).backward()
        for name, param in generated.named_parameters():
            original = theirs[name]
            assert (param.grad is None) == (original.grad is None), name
            if param.grad is not None:
                torch.testing.assert_close(param.grad, original.grad, rtol=1e-5, atol=1e-5,
                                           msg=f"{name} (train={train})")


@pytest.mark.parametrize("case", MODELS)
def test_splits_over_two_devices(case, tmp_path):
    pytest.importorskip("transformers")
    _, _, imported = _import(case, devices=2)
    _, path = _built(imported.text, tmp_path, None)  # for two GPUs (none needed to build)
    model = path.read_text()
    per_device = model[model.index("Parameters per device:"):].split("total:")[0]
    assert "cuda:0:" in per_device and "cuda:1:" in per_device, per_device
    assert ".to(torch.int64)" in model


class _Buckets(nn.Module):
    """Casts as user code writes them: to integers and back, the same dtype
    (disappears), type_as, and ``torch.as_tensor`` (which fx cannot trace:
    ``.to`` there)."""

    def __init__(self, as_tensor: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.table = nn.Embedding(16, 4)
        self.as_tensor = as_tensor

    def forward(self, x, ids):
        h = self.fc(x)
        buckets = (h.abs() * 4).long().clamp(0, 15)  # float32 -> int64
        same = buckets.to(torch.int64)  # no layer
        counts = (torch.as_tensor(ids, dtype=torch.float32) if self.as_tensor
                  else ids.to(dtype=torch.float32)).type_as(h)  # int32 -> float32
        gate = (h > 0).float()  # bool -> float32
        half = h.half().float()  # float32 -> float16 -> float32
        return self.table(same).sum(-1) + counts * gate + half


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_casts_of_user_code_from_both_tracers(tracer, tmp_path, monkeypatch):
    from mpgen.commands import importer

    monkeypatch.chdir(tmp_path)
    root = _Buckets(as_tensor=tracer == "dynamo")
    specs = [importer.parse_input("x=batch,8"), importer.parse_input("ids=batch,8:int32")]
    imported = importer.import_module(root, specs, "mpgen import _Buckets", None,
                                      tracer=tracer)
    text = imported.text
    assert text.count("op: torch.Tensor.to") == 5, text  # long, as_tensor or to, float, half, float
    assert "dtype: int64" in text and "dtype: float16" in text
    result, path = _built(text, tmp_path, {"*": "cpu"})
    code = path.read_text()
    assert ".to(torch.int64)" in code and ".to(torch.float16)" in code
    generated = getattr(import_generated(path), result.graph.name)()
    generated.load_state_dict(root.state_dict(), strict=True)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    ids = torch.arange(24, dtype=torch.int32).reshape(3, 8)
    expected, got = root(x, ids), generated(x, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.sum().backward()
    got.sum().backward()
    for name, param in generated.named_parameters():
        torch.testing.assert_close(param.grad, dict(root.named_parameters())[name].grad,
                                   rtol=1e-5, atol=1e-5, msg=name)
