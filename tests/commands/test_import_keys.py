"""``mpgen import`` keeps the library's state-dict keys, the children of an
``nn.Sequential`` included (``conv1.0.weight``, RegNet's
``trunk_output.block1.block1-0.proj.0.weight``; NOTE [Layers named by
position]): the generated model loads the reference's own ``state_dict()``
strictly, by name, with no mapping, and so does ``--init`` (the runtime's
loader) of a ``torch.save``'d state dict and of a ``save_pretrained`` file;
outputs and every gradient within 1e-5."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import build_to, import_generated
from mpgen.compiler.codegen.common import file_names
from mpgen.testing import virtual_devices

pytestmark = pytest.mark.slow

TORCHVISION = {
    "shufflenet_v2_x0_5": ("torchvision.models:shufflenet_v2_x0_5", {}),
    "regnet_y_400mf": ("torchvision.models:regnet_y_400mf", {}),
}
CPU = {"*": "cpu"}
BERT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "num_labels": 3}


def _import(target: str, arguments: dict, inputs: list, hf: bool = False, devices=None):
    from mpgen.commands import importer

    root = importer.load_module(target, None if hf else json.dumps(arguments),
                                json.dumps(arguments) if hf else None)
    specs = [importer.parse_input(text) for text in inputs]
    imported = importer.import_module(root, specs, f"mpgen import {target}", devices,
                                      tracer="dynamo")
    return root, imported


def _generated(imported, tmp_path, device_map=CPU):
    spec = tmp_path / "imported.yaml"
    spec.write_text(imported.text)
    result = build_to(spec, tmp_path / "out", device_map)
    module = import_generated(tmp_path / "out" / file_names(result.graph)["model"])
    return getattr(module, result.graph.name)()


def _compare(root, generated, *samples) -> None:
    """The same outputs and gradients, in train mode (BatchNorm's batch statistics)."""
    root.train()
    generated.train()
    expected = root(*samples)
    expected = expected if isinstance(expected, torch.Tensor) else expected.logits
    got = generated(*samples)
    got = got if isinstance(got, torch.Tensor) else got[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    theirs = dict(root.named_parameters())
    for name, param in generated.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("case", TORCHVISION)
def test_torchvision_keys_are_the_originals(case, tmp_path):
    pytest.importorskip("torchvision")
    target, arguments = TORCHVISION[case]
    root, imported = _import(target, arguments, ["x=batch,3,32,32"])
    assert not imported.renamed
    generated = _generated(imported, tmp_path)
    assert list(generated.state_dict()) == list(root.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        for param in root.parameters():
            param.normal_(0, 0.1)
    generated.load_state_dict(root.state_dict(), strict=True)
    _compare(root, generated, torch.randn(2, 3, 32, 32, generator=torch.Generator()
                                          .manual_seed(1)))


def test_a_hugging_face_model_loads_its_save_pretrained_file_by_name(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from mpgen.runtime import checkpoint

    root, imported = _import("transformers:BertForSequenceClassification", BERT,
                             ["input_ids=batch,16:int64"], hf=True)
    generated = _generated(imported, tmp_path)
    root.save_pretrained(tmp_path / "pretrained")
    train = import_generated(tmp_path / "out" / "train_bert_for_sequence_classification.py")
    keys = list(generated.state_dict())
    checkpoint.initialise([generated], str(tmp_path / "pretrained" / "model.safetensors"),
                          keys, train.TRAINING)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    root.eval()  # dropout: the comparison in eval mode, gradients too
    generated.eval()
    expected, got = root(input_ids=ids).logits, generated(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    theirs = dict(root.named_parameters())
    for name, param in generated.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-5, atol=1e-5,
                                   msg=name)


def test_init_loads_a_torchvision_state_dict_file_by_name(tmp_path):
    pytest.importorskip("torchvision")
    from mpgen.runtime import checkpoint

    root, imported = _import("torchvision.models:shufflenet_v2_x0_5", {}, ["x=batch,3,32,32"])
    generated = _generated(imported, tmp_path)
    torch.save(root.state_dict(), tmp_path / "shufflenet.pt")
    train = import_generated(tmp_path / "out" / "train_shuffle_net_v2.py")
    checkpoint.initialise([generated], str(tmp_path / "shufflenet.pt"),
                          list(generated.state_dict()), train.TRAINING)
    for key, value in root.state_dict().items():
        assert torch.equal(generated.state_dict()[key], value), key


@pytest.mark.parametrize("target, split", [
    ("torchvision.models:efficientnet_b0", "[features]"),
    ("torchvision.models:regnet_y_400mf", "[trunk_output, trunk_output.block4]"),
])
def test_an_nn_sequential_split_over_two_devices_keeps_the_keys(target, split, tmp_path):
    pytest.importorskip("torchvision")
    root, imported = _import(target, {}, ["x=batch,3,32,32"], devices=2)
    assert f"split: {split}" in imported.text  # nn.Sequential blocks, layer by layer
    torch.manual_seed(0)
    root.eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with virtual_devices(cuda=2):
        generated = _generated(imported, tmp_path, None).eval()
        devices = {p.device.index for p in generated.parameters()}
        generated.load_state_dict(root.state_dict(), strict=True)
        got = generated(x)
    assert devices == {0, 1}
    torch.testing.assert_close(got.cpu(), root(x), rtol=1e-5, atol=1e-5)
