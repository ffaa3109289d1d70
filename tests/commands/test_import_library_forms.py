"""What library models do in ``forward``, imported to spec forms: the
``self.dtype`` probe of a diffusers model, tables indexed with tensors
(torchvision Swin's relative position bias), and the models of issue 32's
corpus that use them or other constructs (tiny configurations each).

Each case imports the model directly, as ``mpgen import`` does, builds the
spec for ``--device-map cpu``, loads the original's ``state_dict()``
strictly, by name (the UNet's ModuleLists of unlike blocks called one by one
are layers ``down_blocks.0``, ``down_blocks.1``: no mapping), and compares
outputs and every gradient within 1e-5, in eval mode and in train mode.
Train mode is compared under one seed set before each model's forward:
dropout probabilities stay as the configurations have them (0 in these tiny
ones, but Swin's stochastic depth, 0.2 by default, which draws the same
numbers in the same order), and BatchNorm normalises by the batch's
statistics in both.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import build_to, import_generated, mpgen
from mpgen.compiler.codegen.common import file_names

pytestmark = pytest.mark.slow

CPU = {"*": "cpu"}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

UNET = {"sample_size": 16, "in_channels": 3, "out_channels": 3, "layers_per_block": 1,
        "block_out_channels": [8, 16], "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
        "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 4,
        "attention_head_dim": 4}
WHISPER = {"vocab_size": 64, "num_mel_bins": 8, "d_model": 32, "encoder_layers": 2,
           "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
           "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_source_positions": 16,
           "max_target_positions": 32}
NEOX = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64}
QWEN2 = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
VIT = {"model_name": "vit_tiny_patch16_224", "img_size": 32, "depth": 2, "num_classes": 10}
IMAGES = ["x=batch,3,32,32"]
TOKENS = ["input_ids=batch,16:int64"]

#: name -> (MODULE:NAME, --args, --config, inputs)
CASES = {
    "unet": ("diffusers:UNet2DModel", UNET, None, ["sample=batch,3,16,16", "timestep=batch"]),
    "whisper_encoder": ("transformers.models.whisper.modeling_whisper:WhisperEncoder", None,
                        WHISPER, ["input_features=batch,8,32"]),
    "gpt_neox": ("transformers:GPTNeoXForCausalLM", None, NEOX, TOKENS),
    "qwen2": ("transformers:Qwen2ForCausalLM", None, QWEN2, TOKENS),
    "timm_vit": ("timm:create_model", VIT, None, IMAGES),
    "swin_t": ("torchvision.models:swin_t", {"num_classes": 10}, None, IMAGES),
    "densenet121": ("torchvision.models:densenet121", {}, None, IMAGES),
    "shufflenet_v2_x0_5": ("torchvision.models:shufflenet_v2_x0_5", {}, None, IMAGES),
    "regnet_y_400mf": ("torchvision.models:regnet_y_400mf", {}, None, IMAGES),
}


def _import(case: str):
    from mpgen.commands import importer

    target, arguments, config, inputs = CASES[case]
    pytest.importorskip(target.partition(":")[0].partition(".")[0])
    root = importer.load_module(target, None if arguments is None else json.dumps(arguments),
                                None if config is None else json.dumps(config))
    specs = [importer.parse_input(text) for text in inputs]
    imported = importer.import_module(root, specs, f"mpgen import {target}", tracer="dynamo")
    return root, specs, imported


def _generated(imported, tmp_path):
    spec = tmp_path / "imported.yaml"
    spec.write_text(imported.text)
    result = build_to(spec, tmp_path / "out", CPU)
    path = tmp_path / "out" / file_names(result.graph)["model"]
    return getattr(import_generated(path), result.graph.name)()


def _samples(specs) -> list:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for spec in specs:
        shape = [2 if d == "batch" else d for d in spec.dims]
        if spec.dtype == "int64":
            samples.append(torch.randint(0, 64, shape, generator=generator))
        else:
            samples.append(torch.randn(shape, generator=generator))
    return samples


def _first(output):
    if isinstance(output, torch.Tensor):
        return output
    for field in ("sample", "logits", "last_hidden_state"):
        if hasattr(output, field):
            return getattr(output, field)
    return output[0]


def _compare(root, generated, imported, specs, training: bool) -> None:
    root.train(training)
    generated.train(training)
    root.zero_grad()
    generated.zero_grad()
    samples = _samples(specs)
    torch.manual_seed(2)
    expected = _first(root(**{s.name: x for s, x in zip(specs, samples)}))
    torch.manual_seed(2)
    got = _first(generated(*samples))
    torch.testing.assert_close(got, expected, **TOLERANCE)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    theirs = dict(root.named_parameters())
    for name, param in generated.named_parameters():
        original = theirs[name]
        assert param.requires_grad == original.requires_grad, name  # frozen stays frozen
        if original.grad is None:
            assert param.grad is None, name
            continue
        torch.testing.assert_close(param.grad, original.grad, **TOLERANCE, msg=name)


@pytest.mark.parametrize("case", CASES)
def test_imports_and_reproduces(case, tmp_path):
    root, specs, imported = _import(case)
    torch.manual_seed(0)
    with torch.no_grad():  # weights that make every output depend on them
        for param in root.parameters():
            param.normal_(0, 0.1)
    generated = _generated(imported, tmp_path)
    assert not imported.renamed  # the keys are the original's
    assert set(generated.state_dict()) == set(root.state_dict())
    generated.load_state_dict(root.state_dict(), strict=True)
    _compare(root, generated, imported, specs, training=False)
    _compare(root, generated, imported, specs, training=True)


TABLES = '''\
import torch
from torch import nn


class Bias(nn.Module):
    """Tables read at index tensors, as Swin's relative position bias."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))
        self.register_buffer("index", torch.tensor([[1, 2, 3, 4], [0, 9, 8, 7]]))
        self.pair = nn.Parameter(torch.randn(4, 5, 3))
        self.register_buffer("rows", torch.tensor([0, 3, 1]))
        self.register_buffer("cols", torch.tensor([4, 4, 0]))

    def forward(self, x):
        bias = self.table[self.index]
        flat = self.table[self.index.view(-1)]
        picked = self.pair[self.rows, self.cols]
        return x * bias.sum(0).sum(0) + flat.mean(0) + picked.sum(0)


class Columns(nn.Module):
    def forward(self, x, idx):
        return x[:, idx] * 2


class Mask(nn.Module):
    """A mask written by slice assignments, as Swin's shifted windows build it."""

    def forward(self, x):
        mask = x.new_zeros((x.size(1), x.size(1)))
        mask[0:-2, 0:-2] = 1
        mask[-2:, 1:] = 2
        mask[:, :1] = 3.5
        return x @ mask


class Probes(nn.Module):
    """``self.dtype`` and ``self.device`` read in forward, as diffusers' and
    transformers' ModelMixin/PreTrainedModel give them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    @property
    def device(self):
        return next(self.parameters()).device

    def forward(self, x):
        ones = torch.ones(6, dtype=self.dtype, device=self.device)
        return self.fc(x.to(self.dtype)) + ones


class InPlace(nn.Module):
    """Tensor methods that write in place (timm's LayerScale, masked scores)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(2)
        h.masked_fill_(h > 1, 1.0)
        h.clamp_(min=-1)
        return h + x


class Steps(nn.Module):
    def forward(self, x):
        return x[:, ::2] + x[:, 1::2]


class Apart(nn.Module):
    def forward(self, x, idx):
        return x[idx, :, idx]
'''


@pytest.mark.parametrize("cls, inputs, tracer", [
    ("Bias", ["x=batch,3"], "dynamo"),
    ("Columns", ["x=batch,5,4", "idx=3:int64"], "fx"),
    ("Columns", ["x=batch,5,4", "idx=3:int64"], "dynamo"),
    ("Mask", ["x=batch,6"], "dynamo"),
    ("Probes", ["x=batch,6"], "dynamo"),
    ("InPlace", ["x=batch,6"], "dynamo"),
    ("InPlace", ["x=batch,6"], "fx"),
    ("Steps", ["x=batch,6"], "fx"),
    ("Steps", ["x=batch,6"], "dynamo"),
])
def test_tables_masks_and_probes(cls, inputs, tracer, tmp_path, monkeypatch):
    """``table[idx]`` (an index of two dims), ``table[idx.view(-1)]``,
    ``x[a, b]`` of a table of three dims and ``x[:, idx]``: index_select,
    reshaped where the index has other than one dim; a mask written by
    slice assignments; in-place methods; steps; probes of the model's dtype and device (none in the
    spec; the parameter they read stays its layer's): the same outputs and
    gradients as the original."""
    from mpgen.commands import importer

    (tmp_path / "tables.py").write_text(TABLES)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = importer.load_module(f"tables:{cls}", None, None)
    specs = [importer.parse_input(text) for text in inputs]
    imported = importer.import_module(root, specs, "mpgen import", tracer=tracer)
    expected_op = {"Mask": "torch.slice_scatter", "Probes": "fc: {op: Linear",
                   "InPlace": "torch.masked_fill", "Steps": "torch.slice_copy"}
    assert expected_op.get(cls, "torch.index_select") in imported.text
    generated = _generated(imported, tmp_path)
    generated.load_state_dict(root.state_dict(), strict=True)
    x = torch.randn(2, *specs[0].dims[1:], requires_grad=True)
    samples = [x, torch.tensor([4, 0, 2])][:len(specs)]
    expected, got = root(*samples), generated(*samples)
    assert torch.equal(expected, got)
    theirs = torch.autograd.grad(expected.sum(), [x, *root.parameters()])
    mine = torch.autograd.grad(got.sum(), [x, *generated.parameters()])
    assert len(theirs) == len(mine)
    for a, b in zip(theirs, mine):
        assert torch.equal(a, b)


def test_an_index_a_spec_cannot_write_names_its_line(tmp_path):
    """Index tensors at dims apart (whose result's dims PyTorch moves first)
    are refused at the source line that indexes."""
    (tmp_path / "tables.py").write_text(TABLES)
    ran = mpgen("import", "tables:Apart", "--input", "x=batch,5,4", "--input", "idx=3:int64",
                "--trace", "dynamo", cwd=tmp_path)
    assert ran.returncode == 2
    line = TABLES.splitlines().index("        return x[idx, :, idx]") + 1
    assert ran.stderr.startswith(f"tables.py:{line}:9: "), ran.stderr
    assert "index tensors at adjacent dims" in ran.stderr


def test_a_diffusers_model_from_its_config(tmp_path):
    """``--config`` of a diffusers model is its constructor's keywords (its
    registered configuration); its ``self.dtype`` probe imports."""
    pytest.importorskip("diffusers")
    spec = tmp_path / "unet.yaml"
    ran = mpgen("import", "diffusers:UNet2DModel", "--config", json.dumps(UNET),
                "--input", "sample=batch,3,16,16", "--input", "timestep=batch",
                "-o", str(spec), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "UNet2DModel" in spec.read_text()
