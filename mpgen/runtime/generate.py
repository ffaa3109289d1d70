"""Generate: token ids continued by a decoder (``generate_<name>.py``).

A decoder is a spec whose input is integer token ids ``[batch, seq]`` and
whose output is logits ``[batch, seq, vocab]``. The prompts come as ids
(--prompt 5,17,42; --prompts FILE, one a line) or as text with --tokenizer
DIR (Hugging Face's tokenizer, through transformers, imported only then);
the weights from --checkpoint or --init, read as predict reads them. The
ids of each sequence, its prompt followed by what was generated, are the
last lines printed, one a prompt, comma-separated.

# NOTE: [The KV cache compiled from the spec]
# The build writes, in generate_<name>.py, the model's classes once more
# with two kinds of layer swapped (compiler/analysis/cache.py finds them,
# codegen/generate.py writes them): each causal
# F.scaled_dot_product_attention is a KVAttention layer, which keeps that
# layer's keys and values (on that layer's device, as the tensors come)
# and attends the new queries to all of them; each torch.arange that counts
# the positions of the tokens (the learned positions' index, the rotary
# tables' positions) is a Positions layer, which counts from the cache's
# length. Everything else is the model's own code, run on the new tokens
# only. Both layers hold no tensor of the state dict, so the model's
# weights load as they are. A Cache binds them for one generation: its
# length, which positions are padding, and the mask of each step: a query
# at position p sees the keys at positions up to p that are not padding
# (and itself, so a padding query attends to something), built once per
# step and device. Without a bound cache both layers are the plain
# function (the model's forward). A spec whose form cannot be cached (the
# build's note says why) runs --no-cache's way: the whole window again for
# every token.
#
# Prompts of different lengths are padded on the left, in one batch: no
# query attends to a padding position, and the positions are counted from
# the start of the padded window (so a shorter prompt's tokens sit at later
# positions than alone; with rotary positions only their differences
# count). --no-cache runs prompts of different lengths one by one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import threads
from .loop import check_devices
from .predict import load_weights
from .spec import Training


class Cache:
    """One generation's keys and values, per attention layer, and where the
    padding is (NOTE [The KV cache compiled from the spec])."""

    def __init__(self, padding: torch.Tensor, capacity: Optional[int] = None) -> None:
        self.length = 0  # positions already cached
        self.capacity = capacity  # the longest sequence expected
        self.padding = padding  # [batch, length + new]: True where a token is real
        self.layers: dict = {}  # KVAttention -> (keys, values)
        self.masks: dict = {}  # device -> this step's mask
        self.unpadded = bool(padding.all())

    def extend(self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor):
        """The layer's keys and values so far, the new ones written after them
        (seq: dim -2), in buffers of ``capacity`` positions made at the first
        forward (so a step copies only its own); past the capacity, appended."""
        end = self.length + key.size(-2)
        if layer not in self.layers:
            room = max(self.capacity or 0, end)
            buffers = tuple(
                t.new_empty((*t.shape[:-2], room, t.shape[-1])) for t in (key, value)
            )
            self.layers[layer] = buffers
        past_key, past_value = self.layers[layer]
        if end > past_key.size(-2):
            key = torch.cat([past_key[..., : self.length, :], key], dim=-2)
            value = torch.cat([past_value[..., : self.length, :], value], dim=-2)
            self.layers[layer] = (key, value)
            return key, value
        past_key[..., self.length : end, :] = key
        past_value[..., self.length : end, :] = value
        return past_key[..., :end, :], past_value[..., :end, :]

    def attend(self, new: int, device: torch.device) -> dict:
        """The mask arguments of scaled_dot_product_attention for ``new``
        queries: none at all for one token without padding (it sees every
        key), is_causal for a first forward without padding, else the mask."""
        if self.unpadded and new == 1:
            return {}
        if self.unpadded and not self.length:
            return {"is_causal": True}
        return {"attn_mask": self.mask(new, device)}

    def mask(self, new: int, device: torch.device) -> torch.Tensor:
        """[batch, 1, new, length + new]: True where a query may attend."""
        if device not in self.masks:
            total = self.length + new
            keys = torch.arange(total, device=device)
            queries = torch.arange(self.length, total, device=device)
            causal = keys[None, :] <= queries[:, None]
            real = self.padding.to(device)[:, None, :]
            itself = keys[None, None, :] == queries[None, :, None]
            self.masks[device] = (causal[None] & (real | itself))[:, None]
        return self.masks[device]

    def step(self, new_tokens: int) -> None:
        """After a forward over ``new_tokens`` tokens: they are cached, and the
        next step's one token per sequence is real."""
        self.length += new_tokens
        ones = torch.ones(self.padding.size(0), 1, dtype=torch.bool)
        self.padding = torch.cat([self.padding, ones], dim=1)
        self.masks = {}

    def bytes_by_device(self) -> dict:
        found: dict = {}
        for key, value in self.layers.values():
            d = str(key.device)
            found[d] = found.get(d, 0) + key.nbytes + value.nbytes
        return found


class KVAttention(nn.Module):
    """F.scaled_dot_product_attention with this layer's keys and values kept
    in the bound Cache; the plain function where none is bound."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: Optional[Cache] = None

    def forward(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if self.cache is None:
            return F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        # The model's own mask (a causal mask built from the sizes) is replaced
        # by the cache's, which knows the past and the padding.
        key, value = self.cache.extend(self, key, value)
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            **self.cache.attend(query.size(-2), query.device),
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=enable_gqa,
        )


class KVTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """nn.TransformerEncoderLayer (the same arguments and state dict) whose
    self-attention keeps its keys and values in the bound Cache, whatever
    causal src_mask the model passes; the plain layer where none is bound."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache: Optional[Cache] = None

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if self.cache is None:
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        x = src
        if self.norm_first:
            x = x + self._cached_attention(self.norm1(x))
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._cached_attention(x))
        return self.norm2(x + self._ff_block(x))

    def _cached_attention(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout1(self_attention(self.self_attn, x, self.cache, self))


class KVMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (the same arguments and state dict) attending a
    sequence to itself with its keys and values kept in the bound Cache,
    whatever causal attn_mask the model passes (no attention weights: None);
    the plain layer where none is bound."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache: Optional[Cache] = None

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if self.cache is None:
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        return self_attention(self, query, self.cache, self), None


def self_attention(
    attention: nn.MultiheadAttention, x: torch.Tensor, cache: Cache, owner: nn.Module
) -> torch.Tensor:
    """``attention`` of ``x`` to itself, its keys and values kept in ``cache``
    under ``owner``: the projections and heads of nn.MultiheadAttention
    (query, key and value of one width), through scaled_dot_product_attention."""
    if not attention.batch_first:
        x = x.transpose(0, 1)
    heads, width = attention.num_heads, x.size(-1)
    projected = F.linear(x, attention.in_proj_weight, attention.in_proj_bias)
    query, key, value = (
        part.unflatten(-1, (heads, width // heads)).transpose(1, 2)
        for part in projected.chunk(3, dim=-1)
    )
    key, value = cache.extend(owner, key, value)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        **cache.attend(query.size(-2), query.device),
        dropout_p=attention.dropout if attention.training else 0.0,
    )
    out = attention.out_proj(out.transpose(1, 2).flatten(2))
    return out if attention.batch_first else out.transpose(0, 1)


class Positions(nn.Module):
    """torch.arange over the new tokens, counted from the bound Cache's
    length (0 where none is bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: Optional[Cache] = None
        # Where the positions are made: moves with the layer, in no state dict.
        self.register_buffer("anchor", torch.empty(0), persistent=False)

    def forward(self, *args, **kwargs):
        positions = torch.arange(*args, **kwargs, device=self.anchor.device)
        if self.cache is None or not self.cache.length:
            return positions
        return positions + self.cache.length


@dataclasses.dataclass(frozen=True)
class Generating:
    """One decoder's generation, as ``generate_<name>.py`` states it: the
    training facts (the model, its devices, ties), the model's classes with
    the KV cache (None: its form cannot be cached, and ``uncached`` says
    why), the size of the vocabulary and the longest sequence its position
    tables hold (None: no limit known)."""

    training: Training
    cached: Optional[Callable] = None
    uncached: str = ""
    vocab: Optional[int] = None
    max_length: Optional[int] = None

    @property
    def script(self) -> str:
        return f"generate_{self.training.run}.py"


# -- flags ------------------------------------------------------------------------


def parser(generating: Generating) -> argparse.ArgumentParser:
    name = generating.training.name
    p = argparse.ArgumentParser(
        description=f"Continue prompts with {name}: the ids of each sequence (prompt then "
        "generated) are the last lines printed, one a prompt.",
    )
    add = p.add_argument
    add(
        "--prompt",
        metavar="IDS|TEXT",
        help="one prompt: ids (5,17,42), or text with --tokenizer",
    )
    add("--prompts", metavar="FILE", help="a batch of prompts, one a line")
    add(
        "--tokenizer",
        metavar="DIR",
        help="a Hugging Face tokenizer (needs transformers)",
    )
    add(
        "--checkpoint",
        metavar="PATH",
        help="the weights: a train script's DIR (its last.pt), a pipeline checkpoint DIR or a file",
    )
    add(
        "--init",
        metavar="FILE",
        help=f"the weights: a state dict of {name} (.pt or .safetensors), or a Hugging Face "
        "save_pretrained folder",
    )
    add(
        "--max-new-tokens", type=int, default=20, metavar="N", help="tokens to generate"
    )
    add(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0: greedy, the most likely token (default)",
    )
    add(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample among the K most likely",
    )
    add(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample among the most likely tokens whose probability adds up to P",
    )
    add("--seed", type=int, default=0, help="the sampling's seed")
    add(
        "--stop",
        metavar="IDS",
        help="ids that end a sequence (default: the tokenizer's end of sequence, else the "
        "eos_token_id of a config.json beside the weights)",
    )
    add(
        "--no-cache",
        action="store_true",
        help="run the whole window again for every token (no KV cache)",
    )
    threads.add_flag(p)
    return p


def ids(text: str, where: str) -> list[int]:
    try:
        found = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        sys.exit(
            f"{where}: expected comma-separated token ids, got {text!r} "
            "(give --tokenizer DIR for text)"
        )
    if not found:
        sys.exit(f"{where}: an empty prompt")
    return found


def tokenizer(folder: str):
    try:
        import transformers
    except ImportError:
        sys.exit(
            f"--tokenizer {folder}: reading a tokenizer needs transformers, which is not "
            "installed (pip install transformers), or give the prompts as ids"
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # transformers raises many kinds
        sys.exit(
            f"--tokenizer {folder}: {str(error).splitlines()[0] if str(error) else error!r}"
        )


def prompts(args, tok) -> list[list[int]]:
    if (args.prompt is None) == (args.prompts is None):
        sys.exit("give one of --prompt IDS and --prompts FILE")
    if args.prompt is not None:
        lines = [(args.prompt, "--prompt")]
    else:
        try:
            text = pathlib.Path(args.prompts).read_text()
        except OSError as error:
            sys.exit(f"--prompts {args.prompts}: {error.strerror or error}")
        lines = [
            (line, f"{args.prompts}:{k}")
            for k, line in enumerate(text.splitlines(), 1)
            if line.strip()
        ]
        if not lines:
            sys.exit(f"--prompts {args.prompts}: no prompt")
    if tok is None:
        return [ids(line, where) for line, where in lines]
    return [
        tok(line, add_special_tokens=False)["input_ids"] or sys.exit(f"{where}: empty")
        for line, where in lines
    ]


def stops(args, tok) -> set[int]:
    if args.stop is not None:
        return set(ids(args.stop, "--stop"))
    if tok is not None and tok.eos_token_id is not None:
        return {tok.eos_token_id}
    weights = args.init or args.checkpoint
    if weights is None:
        return set()
    folder = pathlib.Path(weights)
    folder = folder if folder.is_dir() else folder.parent
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {eos}
    return set()


def check(generating: Generating, args, sequences: list[list[int]]) -> None:
    if args.max_new_tokens < 1:
        sys.exit(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        sys.exit(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        sys.exit(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        sys.exit(f"--top-k must be 0 (all) or more, got {args.top_k}")
    if (args.checkpoint is None) == (args.init is None):
        sys.exit("give the weights: one of --checkpoint PATH and --init FILE")
    vocab = generating.vocab
    for k, prompt in enumerate(sequences, 1):
        bad = [i for i in prompt if not 0 <= i < (vocab or 2**63)]
        if bad:
            sys.exit(
                f"prompt {k}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
    longest = max(map(len, sequences)) + args.max_new_tokens
    if generating.max_length is not None and longest > generating.max_length:
        sys.exit(
            f"{generating.training.name} holds sequences of at most "
            f"{generating.max_length} tokens (its position table), and a prompt and "
            f"--max-new-tokens make {longest}"
        )


# -- decoding ---------------------------------------------------------------------


def next_tokens(logits: torch.Tensor, args, generator: torch.Generator) -> torch.Tensor:
    """[batch] ids from the last position's logits [batch, vocab]."""
    logits = logits.float()
    if args.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / args.temperature
    if args.top_k:
        kth = torch.topk(logits, min(args.top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if args.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(before >= args.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    probabilities = logits.softmax(dim=-1).cpu()
    return torch.multinomial(probabilities, 1, generator=generator)[:, 0]


def last_logits(output) -> torch.Tensor:
    return (output[0] if isinstance(output, tuple) else output)[:, -1, :].cpu()


def bind(model: nn.Module, cache: Optional[Cache]) -> None:
    for module in model.modules():
        if isinstance(
            module,
            (KVAttention, KVMultiheadAttention, KVTransformerEncoderLayer, Positions),
        ):
            module.cache = cache


def cached(
    model: nn.Module,
    batch: list[list[int]],
    args,
    stop: set[int],
    generator: torch.Generator,
) -> tuple[list[list[int]], dict]:
    """The batch continued with the KV cache: one prefill over the (left
    padded) prompts, then one token per sequence per step."""
    longest = max(map(len, batch))
    window = torch.zeros(len(batch), longest, dtype=torch.long)
    padding = torch.zeros(len(batch), longest, dtype=torch.bool)
    for row, prompt in enumerate(batch):
        window[row, longest - len(prompt) :] = torch.tensor(prompt)
        padding[row, longest - len(prompt) :] = True
    cache = Cache(padding, longest + args.max_new_tokens)
    bind(model, cache)
    out = [list(p) for p in batch]
    done = [False] * len(batch)
    times = {"prefill": 0.0, "decode": 0.0, "decoded": 0}
    try:
        started = time.perf_counter()
        logits = last_logits(model(window))
        cache.step(window.size(1))
        times["prefill"] = time.perf_counter() - started
        started = time.perf_counter()
        for made in range(args.max_new_tokens):
            new = next_tokens(logits, args, generator)
            for row, token in enumerate(new.tolist()):
                if not done[row]:
                    out[row].append(token)
                    done[row] = token in stop
            if all(done) or made + 1 == args.max_new_tokens:
                break
            logits = last_logits(model(new[:, None]))
            cache.step(1)
            times["decoded"] += 1
        times["decode"] = time.perf_counter() - started
        times["cache"] = cache.bytes_by_device()
    finally:
        bind(model, None)
    return out, times


def uncached(
    model: nn.Module,
    batch: list[list[int]],
    args,
    stop: set[int],
    generator: torch.Generator,
) -> tuple[list[list[int]], dict]:
    """The batch continued by running the whole window for every token;
    prompts of different lengths one by one (the model's forward takes no
    padding mask)."""
    if len(set(map(len, batch))) > 1:
        outs, times = [], {"prefill": 0.0, "decode": 0.0, "decoded": 0}
        for prompt in batch:
            out, each = uncached(model, [prompt], args, stop, generator)
            outs += out
            for key in ("prefill", "decode", "decoded"):
                times[key] += each[key]
        return outs, times
    out = [list(p) for p in batch]
    done = [False] * len(batch)
    window = torch.tensor(batch, dtype=torch.long)
    times = {"prefill": 0.0, "decode": 0.0, "decoded": 0}
    started = time.perf_counter()
    for made in range(args.max_new_tokens):
        logits = last_logits(model(window))
        if made == 0:
            times["prefill"] = time.perf_counter() - started
            started = time.perf_counter()
        else:
            times["decoded"] += 1
        new = next_tokens(logits, args, generator)
        for row, token in enumerate(new.tolist()):
            if not done[row]:
                out[row].append(token)
                done[row] = token in stop
        if all(done):
            break
        window = torch.cat([window, new[:, None]], dim=1)
    times["decode"] = time.perf_counter() - started
    return out, times


def continue_prompts(
    model: nn.Module, batch: list[list[int]], args, stop: set[int], use_cache: bool
) -> tuple[list[list[int]], dict]:
    """Each prompt followed by its generated ids (ending at a stop id, which
    is kept), and the time of the prefill and of the decoding."""
    generator = torch.Generator().manual_seed(args.seed)
    with torch.inference_mode():
        run = cached if use_cache else uncached
        return run(model, batch, args, stop, generator)


def generate(generating: Generating, argv: list[str] | None = None) -> None:
    """``generate_<name>.py``: load the weights and continue the prompts."""
    training = generating.training
    args = parser(generating).parse_args(argv)
    tok = tokenizer(args.tokenizer) if args.tokenizer else None
    batch = prompts(args, tok)
    check(generating, args, batch)
    check_devices(training, argv, f"generate_{training.run}.py")
    stop = stops(args, tok)
    use_cache = not args.no_cache and generating.cached is not None
    if not args.no_cache and generating.cached is None:
        print(
            f"{training.name}: no KV cache ({generating.uncached}): the whole window runs "
            "for every token",
            file=sys.stderr,
        )
    torch.manual_seed(args.seed)
    model = (generating.cached if use_cache else training.model)()
    where = load_weights([model], list(model.state_dict()), training, args)
    model.eval()
    threads.cap(args.threads, sys.stderr)  # stdout is the sequences
    out, times = continue_prompts(model, batch, args, stop, use_cache)
    made = sum(len(o) - len(p) for o, p in zip(out, batch))
    rate = times["decoded"] * len(batch) / max(times["decode"], 1e-9)
    how = "with the KV cache" if use_cache else "without a cache"
    print(
        f"{training.name}: {made} tokens for {len(batch)} prompt(s) from {where} {how}: "
        f"prefill {times['prefill'] * 1000:.1f} ms, decoding {rate:,.1f} tokens/s",
        file=sys.stderr,
    )
    if tok is not None:
        for sequence in out:
            print(tok.decode(sequence))
    for sequence in out:
        print(",".join(map(str, sequence)))
