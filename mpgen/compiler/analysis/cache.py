"""The KV cache of a decoder: which layers its incremental form swaps, or why
it has none (NOTE [The KV cache compiled from the spec] in the runtime's
generate.py, which runs that form).

A decoder is a spec whose one input is integer token ids ``[batch, seq]``
and whose one output is logits ``[batch, seq, vocab]``. Its incremental
form runs only the new tokens, so every layer that mixes positions must be
one the cache knows: a causal ``F.scaled_dot_product_attention`` (its keys
and values cached), or a ``torch.arange`` that counts the positions (counted
from the cache's length). The analysis follows where each value comes
from, through block instances: ``data`` (the tokens, a parameter or a
buffer) or an ``arange``'s count; a mask made from sizes alone (as traced
Hugging Face decoders build their causal mask, ``is_causal`` false) is
taken for the causal mask the cache builds. Anything else that mixes
positions on data (a convolution or recurrence over time, a cumulative sum,
a reduction over the sequence, an attention that sees later positions, a
module it does not know) makes the form uncacheable, and the first such
layer is named in one note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from mpgen.compiler.ir import BinOp, Graph, Neg, Node, OpKind, Size, SymDim, TensorType
from mpgen.errors import Position

ATTENTION = "F.scaled_dot_product_attention"
#: torch.nn layers the cache knows, with the keyword of their causal mask.
ENCODER_LAYERS = {"TransformerEncoderLayer": "src_mask", "MultiheadAttention": "attn_mask"}
#: Constructor arguments of those that the cache's self-attention does not take.
UNCACHED_ARGUMENTS = ("kdim", "vdim", "add_bias_kv", "add_zero_attn")
ARANGE = "torch.arange"
DATA = "data"

#: torch.nn classes that act on each position alone.
POSITIONWISE = frozenset({
    "Linear", "Bilinear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "Identity",
    "GELU", "ReLU", "ReLU6", "SiLU", "Mish", "Tanh", "Sigmoid", "Hardtanh", "Hardswish",
    "Hardsigmoid", "ELU", "SELU", "CELU", "LeakyReLU", "PReLU", "Softplus", "Softsign",
    "GLU", "Softmax", "LogSoftmax", "Tanhshrink", "Threshold",
})
#: torch functions that mix positions along any dim they are given.
MIXING = frozenset({
    "torch.cumsum", "torch.cumprod", "torch.cummax", "torch.cummin", "torch.logcumsumexp",
    "torch.diff", "torch.roll", "torch.flip", "F.conv1d", "F.conv2d", "F.conv_transpose1d",
    "F.avg_pool1d", "F.max_pool1d", "F.pad", "torch.conv1d", "F.multi_head_attention_forward",
})
#: Functions that reduce or normalise along their ``dim``: mixing where it is the sequence's.
ALONG_DIM = frozenset({
    "torch.softmax", "F.softmax", "torch.log_softmax", "F.log_softmax", "torch.mean",
    "torch.sum", "torch.amax", "torch.amin", "torch.max", "torch.min", "torch.logsumexp",
    "torch.std", "torch.var", "torch.prod", "torch.norm", "F.normalize", "torch.cat",
})


@dataclass(frozen=True)
class Site:
    """A layer of a block (``block``) or of the model (None)."""

    block: Optional[str]
    node: str


@dataclass(frozen=True)
class CachePlan:
    """A decoder's cache: the attention and position layers its incremental
    form swaps, or ``problem``, why it has none (at the layer's position)."""

    tokens: str  # the token ids input
    vocab: int
    attention: frozenset[Site] = frozenset()
    positions: frozenset[Site] = frozenset()
    problem: Optional[tuple[Position, str]] = None
    layers: frozenset[Site] = frozenset()  # torch.nn layers swapped (ENCODER_LAYERS)
    table: Optional[int] = None  # the rows of the smallest position table (Embedding)

    @property
    def cacheable(self) -> bool:
        return self.problem is None


def decoder(graph: Graph) -> Optional[tuple[str, int]]:
    """(the token ids input, the vocabulary size) of a decoder, else None."""
    if len(graph.inputs) != 1 or len(graph.outputs) != 1:
        return None
    tokens = graph.inputs[0]
    logits = graph.type_of(graph.outputs[0])
    if (tokens.type.dtype not in ("int64", "int32") or len(tokens.type.shape) != 2
            or logits is None or len(logits.shape) != 3
            or not logits.dtype.startswith(("float", "bfloat"))
            or tuple(logits.shape[:2]) != tuple(tokens.type.shape)
            or not isinstance(logits.shape[2], int)):
        return None
    return tokens.name, logits.shape[2]


def plan(graph: Graph) -> Optional[CachePlan]:
    """The cache of a decoder (None: not a decoder)."""
    found = decoder(graph)
    if found is None:
        return None
    tokens, vocab = found
    flow = _Flow(graph)
    flow.run()
    seq = graph.inputs[0].type.shape[1]
    seq_symbol = seq.symbols if isinstance(seq, SymDim) and seq.known else None
    attention: set[Site] = set()
    layers: set[Site] = set()
    problems: list[tuple[Position, str]] = []
    for ctx, node in flow.all_nodes():
        reads = [flow.tags(ctx, name) for name in node.inputs]
        data = any(DATA in t for t in reads)
        if node.op.kind is OpKind.FUNCTION and node.op.callee == ATTENTION:
            problem = _attention_problem(flow, ctx, node)
            if problem:
                problems.append((node.pos, problem))
            attention.add(Site(ctx, node.name))
        elif node.op.kind is OpKind.MODULE and node.op.spelled in ENCODER_LAYERS:
            problem = _attention_problem(flow, ctx, node, ENCODER_LAYERS[node.op.spelled])
            given = [k for k, v in node.init.keyword if k in UNCACHED_ARGUMENTS and v]
            positional = [node.inputs[i] for i in node.feeding.positional[:3]
                          if isinstance(i, int)]
            if given:
                problem = (f"{node.op.spelled} with {given[0]}: the cache attends with one "
                           "projection of query, key and value")
            elif node.op.spelled == "MultiheadAttention" and len(set(positional)) != 1:
                problem = ("its query, key and value differ: the cache keeps a sequence "
                           "attending to itself")
            if problem:
                problems.append((node.pos, problem))
            layers.add(Site(ctx, node.name))
        elif node.op.kind in (OpKind.MODULE, OpKind.USER) and data:
            if node.op.kind is OpKind.USER or node.op.spelled not in POSITIONWISE:
                problems.append((node.pos, f"{node.op.spelled} mixes the sequence's positions "
                                 "in a way the cache does not know (it caches "
                                 f"{ATTENTION}'s keys and values)"))
        elif node.op.kind is OpKind.FUNCTION and data and node.op.callee in MIXING:
            problems.append((node.pos, f"{node.op.callee} mixes the sequence's positions"))
        elif (node.op.kind is OpKind.FUNCTION and node.op.callee == "torch.narrow"
              and DATA in reads[0] and _sizes_read(node.call.values) - {node.inputs[0]}):
            problems.append((node.pos, "torch.narrow reads the first rows of a table by "
                             "another tensor's size (positions read from a table so): the "
                             "cache cannot start them at its length; index the table with "
                             "a torch.arange of the positions (an Embedding)"))
        elif (node.op.kind is OpKind.FUNCTION and data and node.op.callee in ALONG_DIM
              and seq_symbol and _along_seq(flow, ctx, node, seq_symbol)):
            problems.append((node.pos, f"{node.op.callee} runs along the sequence's dim"))
    positions = frozenset(site for site in flow.aranges
                          if any(site in t and DATA in t for t in flow.values.values()))
    for site, node in flow.sized.items():  # made from the sizes, read with the data
        if any(site in t and DATA in t for t in flow.values.values()):
            problems.append((node.pos, f"{node.op.callee} makes a tensor of the sequence's "
                             "size that the data reads, which the cache cannot count on "
                             "from its length (only a torch.arange of the positions)"))
    rows = [_rows(node) for ctx, node in flow.all_nodes()
            if node.op.kind is OpKind.MODULE and node.op.spelled == "Embedding"
            and any(site in tags and DATA not in tags
                    for tags in (flow.tags(ctx, name) for name in node.inputs)
                    for site in positions)]
    rows = [r for r in rows if r is not None]
    problems.sort(key=lambda p: (p[0].file, p[0].line, p[0].col))
    return CachePlan(tokens, vocab, frozenset(attention), positions,
                     problems[0] if problems else None, frozenset(layers),
                     min(rows) if rows else None)


def _rows(node: Node) -> Optional[int]:
    rows = dict(node.init.keyword).get(
        "num_embeddings", node.init.positional[0] if node.init.positional else None)
    return rows if isinstance(rows, int) else None


def _attention_problem(flow: "_Flow", ctx: Optional[str], node: Node,
                       keyword: str = "attn_mask") -> Optional[str]:
    keywords = dict(node.call.keyword)
    feed = dict(node.feeding.keyword)
    causal = keywords.get("is_causal") is True
    if keyword in feed:
        mask = flow.tags(ctx, node.inputs[feed[keyword]])
        if DATA in mask:
            return (f"its {keyword} is computed from the tokens or weights, not from the "
                    "sizes alone, so the cache cannot make it")
        return None  # a mask of the sizes alone: the causal mask the cache makes
    if not causal:
        return ("it attends to every position (is_causal is not true and there is no "
                f"causal {keyword}), so a token's output changes with later tokens")
    return None


def _along_seq(flow: "_Flow", ctx: Optional[str], node: Node, seq: tuple) -> bool:
    keywords = dict(node.call.keyword)
    dim = keywords.get("dim", node.call.positional[0] if node.call.positional else None)
    if not isinstance(dim, int) or not node.inputs:
        return False
    t = flow.type_of(ctx, node.inputs[0])
    if t is None or not -len(t.shape) <= dim < len(t.shape):
        return False
    d = t.shape[dim]
    return isinstance(d, SymDim) and d.symbols == seq


class _Flow:
    """Where each value comes from: ``data`` and the aranges (as Sites) it
    is computed from, through block instances (a block's inputs take every
    call's)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.blocks = {b.name: b for b in graph.blocks}
        self.values: dict[tuple, frozenset] = {}
        self.aranges: set[Site] = set()
        self.sized: dict[Site, Node] = {}  # other factories whose sizes are read at run time
        for t in graph.inputs:
            self.values[(None, t.name)] = frozenset({DATA})

    def all_nodes(self):
        for node in self.graph.nodes:
            yield None, node
        for block in self.graph.blocks:
            for node in block.nodes:
                yield block.name, node

    def tags(self, ctx: Optional[str], name: str) -> frozenset:
        return self.values.get((ctx, name), frozenset())

    def type_of(self, ctx: Optional[str], name: str) -> Optional[TensorType]:
        if ctx is None:
            try:
                return self.graph.type_of(name)
            except KeyError:
                return None
        block = self.blocks[ctx]
        for t in block.inputs:
            if t.name == name:
                return t.type
        return dict(block.shapes).get(name)

    def _add(self, key: tuple, tags: frozenset) -> bool:
        old = self.values.get(key, frozenset())
        if tags <= old:
            return False
        self.values[key] = old | tags
        return True

    def run(self) -> None:
        changed = True
        while changed:
            changed = False
            for ctx, node in self.all_nodes():
                changed |= self._node(ctx, node)

    def _node(self, ctx: Optional[str], node: Node) -> bool:
        reads = [self.tags(ctx, name) for name in node.inputs]
        kind = node.op.kind
        changed = False
        if kind is OpKind.TENSOR:
            out = frozenset({DATA})
        elif kind is OpKind.BLOCK:
            block = self.blocks[node.op.target]
            for t, tags in zip(block.inputs, reads):
                changed |= self._add((block.name, t.name), tags)
            out = frozenset().union(*(self.tags(block.name, o) for o in block.outputs))
            if node.repeat and block.inputs and block.outputs:
                changed |= self._add((block.name, block.inputs[0].name),
                                     self.tags(block.name, block.outputs[0]))
        elif kind is OpKind.FUNCTION and node.op.callee == ATTENTION:
            mask = dict(node.feeding.keyword).get("attn_mask")
            out = frozenset().union(*(t for k, t in enumerate(reads) if k != mask))
        elif kind is OpKind.MODULE and node.op.spelled in ENCODER_LAYERS:
            mask = dict(node.feeding.keyword).get(ENCODER_LAYERS[node.op.spelled])
            out = frozenset().union(*(t for k, t in enumerate(reads) if k != mask)) | {DATA}
        elif kind is OpKind.FUNCTION and node.op.callee == ARANGE and node.factory:
            site = Site(ctx, node.name)
            self.aranges.add(site)
            out = frozenset({site})
        elif kind is OpKind.FUNCTION and node.factory and _reads_a_size(node.call.values):
            site = Site(ctx, node.name)
            self.sized[site] = node
            out = frozenset({site})
        else:
            out = frozenset().union(*reads)
            if kind in (OpKind.MODULE, OpKind.USER) and node.params:
                out |= {DATA}
        for name in node.value_names:
            changed |= self._add((ctx, name), out)
        return changed


def _sizes_read(values) -> set[str]:
    """The values whose sizes an argument reads at run time."""
    found: set[str] = set()
    for v in values:
        if isinstance(v, Size):
            found.add(v.value)
        elif isinstance(v, BinOp):
            found |= _sizes_read([v.left, v.right])
        elif isinstance(v, Neg):
            found |= _sizes_read([v.operand])
        elif isinstance(v, (list, tuple)):
            found |= _sizes_read(v)
    return found


def _reads_a_size(values) -> bool:
    """Whether an argument reads a tensor's size at run time (``size(x, 1)``)."""
    for v in values:
        if isinstance(v, Size):
            return True
        if isinstance(v, BinOp) and _reads_a_size([v.left, v.right]):
            return True
        if isinstance(v, Neg) and _reads_a_size([v.operand]):
            return True
        if isinstance(v, (list, tuple)) and _reads_a_size(v):
            return True
    return False


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype, torch.float32)).element_size()


def bytes_per_token(graph: Graph, cache: CachePlan) -> tuple[dict[str, int], bool]:
    """Each device's cached keys and values per token of one sequence, and
    whether every attention layer's size is known (its keys' and values'
    dims other than batch and sequence are numbers)."""
    flow = _Flow(graph)
    blocks = {b.name: b for b in graph.blocks}
    known = [True]

    def layer(ctx: Optional[str], node: Node) -> int:
        total = 0
        for name in node.inputs[1:3]:
            t = flow.type_of(ctx, name)
            rest = [t.shape[0 + 1:-2], t.shape[-1:]] if t is not None and len(t.shape) >= 3 else None
            dims = [d for part in rest for d in part] if rest else None
            if dims is None or not all(isinstance(d, int) for d in dims):
                known[0] = False
                continue
            total += math.prod(dims) * _itemsize(t.dtype)
        return total

    memo: dict[str, int] = {}

    def in_block(name: str) -> int:
        if name not in memo:
            memo[name] = 0
            memo[name] = sum(_of(name, node) for node in blocks[name].nodes)
        return memo[name]

    def encoder_layer(node: Node) -> int:
        keywords = dict(node.init.keyword)
        width = keywords.get("d_model", keywords.get(
            "embed_dim", node.init.positional[0] if node.init.positional else None))
        if not isinstance(width, int):
            known[0] = False
            return 0
        t = node.out
        return 2 * width * _itemsize(t.dtype if t is not None else "float32")

    def _of(ctx: Optional[str], node: Node) -> int:
        if Site(ctx, node.name) in cache.attention:
            return layer(ctx, node)
        if Site(ctx, node.name) in cache.layers:
            return encoder_layer(node) * (node.repeat or 1 if ctx is not None else 1)
        if node.op.kind is OpKind.BLOCK:
            return in_block(node.op.target) * (node.repeat or 1 if ctx is not None else 1)
        return 0

    found: dict[str, int] = {}
    for node in graph.nodes:
        each = _of(None, node)
        if not each:
            continue
        for device in node.devices or ("cpu",):
            found[device] = found.get(device, 0) + each
    return found, known[0]

