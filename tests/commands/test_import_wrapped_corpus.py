"""Every library model the direct imports reproduce (test_import_libraries,
test_import_library_forms, test_import_casts, test_import_keys), held in a
wrapper class of the user's own, imports like the library's model itself
(issue 32's "Done when": each model imported directly and through a wrapper).

The wrapper, a module of the project written into ``tmp_path`` (the working
directory), holds the library's model as an attribute, its tiny configuration
the direct tests' own, and returns a tensor (``.logits``,
``.last_hidden_state``, the UNet's ``.sample``, torchvision's output itself);
some add a head of the user's. It is imported with the real command line and no
``--trace``; the spec, built for the CPU, loads the wrapper's own
``state_dict()`` strictly by name and gives its outputs and every gradient
within 1e-5 in eval and train mode (the same seed before each forward:
``_import_and_compare`` of test_import_wrappers); a parameter the library does
not train stays untrained. A ``--devices 2`` import builds, parameters on
both devices.
"""

from __future__ import annotations

import textwrap

import pytest

from helpers import build_to, mpgen
from test_import_casts import ROBERTA, T5
from test_import_libraries import BART, BERT, GPT2, LLAMA
from test_import_library_forms import NEOX, QWEN2, UNET, VIT, WHISPER
from test_import_wrappers import _import_and_compare

pytestmark = pytest.mark.slow  # each imports, builds and runs a model: seconds

TOKENS = ["input_ids=batch,16:int64"]
TOKENS_2 = [*TOKENS, "decoder_input_ids=batch,16:int64"]
IMAGES = ["x=batch,3,32,32"]

#: name -> (imports, the library's model as the wrapper makes it, what forward
#: returns of its output, the head the wrapper adds or None, inputs)
CASES = {
    "llama": ("from transformers import LlamaConfig, LlamaForCausalLM",
              f"LlamaForCausalLM(LlamaConfig(**{LLAMA!r}))", ".logits", None, TOKENS),
    "bert": ("from transformers import BertConfig, BertForSequenceClassification",
             f"BertForSequenceClassification(BertConfig(**{BERT!r}))", ".logits",
             "nn.Linear(3, 2)", TOKENS),
    "gpt2": ("from transformers import GPT2Config, GPT2LMHeadModel",
             f"GPT2LMHeadModel(GPT2Config(**{GPT2!r}))", ".logits", None, TOKENS),
    "bart": ("from transformers import BartConfig, BartForConditionalGeneration",
             f"BartForConditionalGeneration(BartConfig(**{BART!r}))", ".logits", None,
             TOKENS_2),
    "roberta": ("from transformers import RobertaConfig, RobertaModel",
                f"RobertaModel(RobertaConfig(**{ROBERTA!r}))", ".last_hidden_state",
                "nn.Linear(32, 4)", TOKENS),
    "t5_encoder": ("from transformers import T5Config, T5EncoderModel",
                   f"T5EncoderModel(T5Config(**{T5!r}))", ".last_hidden_state", None, TOKENS),
    "t5": ("from transformers import T5Config, T5Model",
           f"T5Model(T5Config(**{T5!r}))", ".last_hidden_state", None, TOKENS_2),
    "gpt_neox": ("from transformers import GPTNeoXConfig, GPTNeoXForCausalLM",
                 f"GPTNeoXForCausalLM(GPTNeoXConfig(**{NEOX!r}))", ".logits", None, TOKENS),
    "qwen2": ("from transformers import Qwen2Config, Qwen2ForCausalLM",
              f"Qwen2ForCausalLM(Qwen2Config(**{QWEN2!r}))", ".logits", None, TOKENS),
    "whisper_encoder": (
        "from transformers import WhisperConfig\n"
        "from transformers.models.whisper.modeling_whisper import WhisperEncoder",
        f"WhisperEncoder(WhisperConfig(**{WHISPER!r}))", ".last_hidden_state",
        "nn.Linear(32, 2)", ["input_features=batch,8,32"]),
    "timm_vit": ("import timm", f"timm.create_model(**{VIT!r})", "", None, IMAGES),
    "unet": ("from diffusers import UNet2DModel", f"UNet2DModel(**{UNET!r})", ".sample",
             None, ["sample=batch,3,16,16", "timestep=batch"]),
    "vit_b_16": ("from torchvision.models import vit_b_16", "vit_b_16(image_size=32)", "",
                 None, IMAGES),
    "convnext_tiny": ("from torchvision.models import convnext_tiny", "convnext_tiny()", "",
                      "nn.Linear(1000, 3)", IMAGES),
    "efficientnet_b0": ("from torchvision.models import efficientnet_b0", "efficientnet_b0()",
                        "", None, IMAGES),
    "resnet50": ("from torchvision.models import resnet50", "resnet50()", "", None, IMAGES),
    "mobilenet_v3_small": ("from torchvision.models import mobilenet_v3_small",
                           "mobilenet_v3_small()", "", None, IMAGES),
    "swin_t": ("from torchvision.models import swin_t", "swin_t(num_classes=10)", "", None,
               IMAGES),
    "densenet121": ("from torchvision.models import densenet121", "densenet121()", "", None,
                    IMAGES),
    "shufflenet_v2_x0_5": ("from torchvision.models import shufflenet_v2_x0_5",
                           "shufflenet_v2_x0_5()", "", "nn.Linear(1000, 5)", IMAGES),
    "regnet_y_400mf": ("from torchvision.models import regnet_y_400mf", "regnet_y_400mf()", "",
                       None, IMAGES),
}

WRAPPER = '''
import torch
from torch import nn
{imports}


class Wrapped(nn.Module):
    """A user's class holding the library's model{what}."""

    def __init__(self):
        super().__init__()
        self.inner = {model}
{head}
    def forward(self, {args}):
        return {result}
'''


def _wrapper(case: str) -> tuple[str, list[str]]:
    """The wrapper's source for ``case`` and its inputs."""
    imports, model, field, head, inputs = CASES[case]
    names = [text.partition("=")[0] for text in inputs]
    args = ", ".join(names)
    # the first input by position, the rest by keyword (BART's and T5's second
    # parameter is attention_mask, not decoder_input_ids)
    passed = ", ".join([names[0], *(f"{name}={name}" for name in names[1:])])
    result = f"self.inner({passed}){field}"
    source = WRAPPER.format(
        imports=imports, model=model, args=args,
        what=", a head of the user's on its output" if head else "",
        head=f"        self.head = {head}\n" if head else "",
        result=f"self.head({result})" if head else result)
    return textwrap.dedent(source), inputs


def _libraries(case: str) -> None:
    imports = CASES[case][0]
    for library in ("transformers", "timm", "diffusers", "torchvision"):
        if library in imports:
            pytest.importorskip(library)


@pytest.mark.parametrize("case", CASES)
def test_a_wrapped_model_reproduces_its_library_model(case, tmp_path, monkeypatch):
    _libraries(case)
    source, inputs = _wrapper(case)
    _, original, generated = _import_and_compare(tmp_path, monkeypatch, source,
                                                 f"wrapped_{case}", "Wrapped", inputs)
    assert set(generated.state_dict()) == set(original.state_dict())
    theirs = dict(original.named_parameters(remove_duplicate=False))
    for name, param in generated.named_parameters():
        reference = theirs[name]
        if not reference.requires_grad:  # a frozen table stays frozen (Whisper's positions)
            assert not param.requires_grad, name
        elif not param.requires_grad:  # frozen only where no gradient reaches it (a module
            assert reference.grad is None, name  # whose result forward drops: RoBERTa's pooler)


@pytest.mark.parametrize("case", CASES)
def test_a_wrapped_model_splits_over_two_devices(case, tmp_path):
    _libraries(case)
    source, inputs = _wrapper(case)
    (tmp_path / f"split_{case}.py").write_text(source, encoding="utf-8")
    args = [a for text in inputs for a in ("--input", text)]
    ran = mpgen("import", f"split_{case}:Wrapped", *args, "--devices", "2", "-o", "split.yaml",
                cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "devices: [cuda:0, cuda:1]" in (tmp_path / "split.yaml").read_text()
    result = build_to(tmp_path / "split.yaml", tmp_path / "out")  # for two GPUs, none needed
    by_device = result.graph.params_by_device()
    assert set(by_device) == {"cuda:0", "cuda:1"} and all(by_device.values()), by_device
