"""The inputs of ``mpgen import`` without ``--input``: what the model's library
says it takes (docs/import.md, "Inputs the library knows"), as a user would
write them; else an error naming ``forward``'s arguments."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from mpgen.errors import MpgenError

#: The side of a torchvision classification model's images when its weights
#: do not say one: ImageNet's usual crop.
DEFAULT_IMAGE_SIZE = 224


@dataclass(frozen=True)
class KnownInputs:
    """``--input`` values as a user writes them, and where they come from."""

    texts: tuple[str, ...]
    why: str

    def note(self) -> str:
        given = " ".join(f"--input {text}" for text in self.texts)
        return f"{given} ({self.why}); give --input to change it"


def known_inputs(target: str, root: nn.Module) -> Optional[KnownInputs]:
    """What ``root`` takes, from torchvision's, Hugging Face's or timm's own
    description of the model; None where the library says nothing (a class
    of the project: its ``forward`` is its own)."""
    module = type(root).__module__
    if re.fullmatch(r"torchvision\.models\.\w+", module):  # classification, not detection...
        return _torchvision(target.partition(":")[2], root)
    if module.startswith("transformers.") and getattr(root, "main_input_name", None):
        return _hugging_face(root)
    if module.startswith("timm."):
        return _timm(root)
    return None


def no_inputs(target: str, root: nn.Module) -> MpgenError:
    """The error of an import without ``--input`` of a model whose inputs no
    library describes: ``forward``'s arguments named."""
    cls = type(root).__name__
    names = _arguments(root)
    required = [p.name for p in names if p.default is p.empty] or [p.name for p in names]
    first = required[0] if required else "x"
    each = "its shape" if len(required) == 1 else "the shape of each, once per argument,"
    return MpgenError(None, f"{target}: no --input, and {cls} is none of the models whose "
                            f"inputs mpgen knows (torchvision classification, timm, Hugging "
                            f"Face of input_ids or pixel_values): give {cls}.forward's "
                            f"{', '.join(required) or 'argument'} {each} with --input "
                            f"{first}=D0,D1,... (each dim a size or a name such as batch)")


def _arguments(root: nn.Module) -> list[inspect.Parameter]:
    try:
        parameters = inspect.signature(root.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature
        return []
    return [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                p.KEYWORD_ONLY)]


def _first_argument(root: nn.Module) -> Optional[str]:
    names = _arguments(root)
    return names[0].name if names else None


def _torchvision(builder: str, root: nn.Module) -> Optional[KnownInputs]:
    """``x=batch,3,H,W``: the model's own ``image_size`` (ViT's), else the crop
    of the builder's default weights' transforms, else 224."""
    name = _first_argument(root)
    if name is None:
        return None
    size, why = _image_size(builder, root)
    return KnownInputs((f"{name}=batch,3,{size},{size}",), why)


def _image_size(builder: str, root: nn.Module) -> tuple[int, str]:
    own = getattr(root, "image_size", None)
    if isinstance(own, int) and own >= 1:
        return own, f"{type(root).__name__}'s image_size is {own}"
    try:
        from torchvision.models import get_model_weights

        weights = get_model_weights(builder).DEFAULT
        crop = weights.transforms.keywords["crop_size"]
    except Exception:  # a class, not a builder; weights without a crop
        crop = None
    crop = crop[0] if isinstance(crop, (list, tuple)) and crop else crop
    if isinstance(crop, int) and crop >= 1:
        return crop, f"torchvision's {builder} weights take {crop}x{crop} images"
    return DEFAULT_IMAGE_SIZE, (f"torchvision's classification models take 3-channel images; "
                                f"{DEFAULT_IMAGE_SIZE}x{DEFAULT_IMAGE_SIZE}, ImageNet's usual "
                                f"crop")


def _hugging_face(root: nn.Module) -> Optional[KnownInputs]:
    """``input_ids=batch,seq:int64`` (a fixed length where a learned position
    table is read along it, docs/import.md), with ``decoder_input_ids`` for an
    encoder-decoder; ``pixel_values`` of the configuration's channels and
    image size."""
    config = getattr(root, "config", None)
    main = root.main_input_name
    cls = type(root).__name__
    if main == "input_ids":
        length = _position_table(root, config)
        seq = "seq" if length is None else str(length)
        names = [main] + (["decoder_input_ids"] if getattr(config, "is_encoder_decoder", False)
                          and "decoder_input_ids" in {p.name for p in _arguments(root)} else [])
        why = (f"{cls}'s main input is token ids" +
               (f"; its position table holds {length}, a fixed length"
                if length is not None else ""))
        return KnownInputs(tuple(f"{n}=batch,{seq}:int64" for n in names), why)
    if main == "pixel_values":
        size = _side(getattr(config, "image_size", None))
        channels = getattr(config, "num_channels", 3)
        if size is None or not isinstance(channels, int):
            return None
        return KnownInputs((f"{main}=batch,{channels},{size},{size}",),
                           f"{cls}'s configuration: {channels} channels, image_size {size}")
    return None


def _position_table(root: nn.Module, config: Any) -> Optional[int]:
    """The configuration's position count where an ``nn.Embedding`` other than
    the token table holds that many rows (give or take BART's offset of 2): a
    table a symbolic length would read past."""
    positions = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None)
    if not isinstance(positions, int):
        return None
    tokens = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    for module in root.modules():
        if isinstance(module, nn.Embedding) and module is not tokens \
                and positions <= module.num_embeddings <= positions + 2:
            return positions
    return None


def _side(size: Any) -> Optional[int]:
    if isinstance(size, (list, tuple)) and size:
        size = size[0]
    return size if isinstance(size, int) and size >= 1 else None


def _timm(root: nn.Module) -> Optional[KnownInputs]:
    """``x=batch,C,H,W`` from the model's ``pretrained_cfg['input_size']``, its
    patch embedding's ``img_size`` where one was given (``img_size=32``)."""
    name = _first_argument(root)
    size = (getattr(root, "pretrained_cfg", None) or {}).get("input_size")
    if name is None or not (isinstance(size, (list, tuple)) and len(size) == 3):
        return None
    channels, height, width = size
    own = getattr(getattr(root, "patch_embed", None), "img_size", None)
    if isinstance(own, (list, tuple)) and len(own) == 2 and (height, width) != tuple(own):
        (height, width), why = own, f"{type(root).__name__}'s img_size is {own[0]}x{own[1]}"
    else:
        why = f"timm's pretrained_cfg input_size of {type(root).__name__}"
    return KnownInputs((f"{name}=batch,{channels},{height},{width}",), why)
