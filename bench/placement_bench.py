"""How good is mpgen's automatic placement? Bottlenecks against two baselines.

For each model shape the units (layers, instances of repeated layers, block
instances) are split over the devices three ways, balancing parameters:

* **mpgen**: ``placement: auto`` with ``balance: params``, compiled by
  mpgen itself (the exact optimal contiguous split);
* **greedy**: ``partition.greedy_fill``, devices filled in order up to a
  budget of total / devices (the first-fit idea of HF Accelerate);
* **accelerate**: HF Accelerate's ``get_balanced_memory`` then
  ``infer_auto_device_map`` on the same model built on the meta device (every
  unit's module class is ``no_split``, so both split at the same units), with
  an explicit ``max_memory`` large enough for the whole model on every device.
  Accelerate balances weight bytes (parameters and buffers); all models here
  are float32, so that is 4 bytes per parameter plus the BatchNorm buffers.

The table gives each method's bottleneck (the parameters on its heaviest
device) and its ratio to mpgen's. A second table balances the estimated
training memory (``balance: memory``) for mpgen and the greedy fill.

Accelerate is a benchmark-only dependency; without it that column says
"not installed".

    python bench/placement_bench.py
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpgen.compiler.analysis import costs as costs_mod  # noqa: E402
from mpgen.compiler.driver import compile_spec  # noqa: E402
from mpgen.compiler.placement.partition import greedy_fill  # noqa: E402

UNEVEN = """\
mpgen: 1
name: Uneven
inputs:
  x: [batch, 256]
blocks:
  Big:
    layers:
      fc: {op: Linear, args: [256, 256], bias: false, repeat: 5}
layers:
  first: {op: Big}
  middle: {op: Linear, args: [256, 256], bias: false, repeat: 24}
  last: {op: Big}
train:
  batch_size: 32
"""

#: (label, spec text or example file, devices)
MODELS = [
    ("GPT-2 small (untied head)", ROOT / "examples" / "gpt2_auto.yaml", 4),
    ("BERT-base + classifier", ROOT / "examples" / "bert_base.yaml", 4),
    ("ResNet-18", ROOT / "examples" / "resnet18.yaml", 4),
    ("uneven [50]+[10]*24+[50]", UNEVEN, 4),
]


#: A Llama-7B-shaped stack (LLaMA's sizes: vocabulary 32,000, width 4,096,
#: 32 decoder blocks of 32 heads, SwiGLU feed-forward of 11,008, RMSNorm,
#: untied head; rotary embeddings left out: they hold no parameters).
LLAMA_7B = """\
mpgen: 1
name: Llama7B
inputs:
  idx: {shape: [batch, seq], dtype: int64}
blocks:
  Attention:
    params: [dim, heads]
    layers:
      q_proj: {op: Linear, args: [$dim, $dim], bias: false, in: x}
      k_proj: {op: Linear, args: [$dim, $dim], bias: false, in: x}
      v_proj: {op: Linear, args: [$dim, $dim], bias: false, in: x}
      qh: {op: torch.unflatten, in: q_proj, dim: -1, sizes: [$heads, "=$dim // $heads"]}
      kh: {op: torch.unflatten, in: k_proj, dim: -1, sizes: [$heads, "=$dim // $heads"]}
      vh: {op: torch.unflatten, in: v_proj, dim: -1, sizes: [$heads, "=$dim // $heads"]}
      qt: {op: torch.transpose, in: qh, dim0: 1, dim1: 2}
      kt: {op: torch.transpose, in: kh, dim0: 1, dim1: 2}
      vt: {op: torch.transpose, in: vh, dim0: 1, dim1: 2}
      att: {op: F.scaled_dot_product_attention, in: [qt, kt, vt], is_causal: true}
      merged: {op: torch.transpose, dim0: 1, dim1: 2}
      flat: {op: torch.flatten, start_dim: 2}
      o_proj: {op: Linear, args: [$dim, $dim], bias: false}
  FeedForward:
    params: [dim, hidden]
    layers:
      gate_proj: {op: Linear, args: [$dim, $hidden], bias: false, in: x}
      act: {op: SiLU}
      up_proj: {op: Linear, args: [$dim, $hidden], bias: false, in: x}
      gated: {op: torch.mul, in: [act, up_proj]}
      down_proj: {op: Linear, args: [$hidden, $dim], bias: false}
  Decoder:
    params: [dim, heads, hidden]
    layers:
      input_layernorm: {op: RMSNorm, args: [$dim]}
      self_attn: {op: Attention, args: [$dim, $heads]}
      res1: {op: torch.add, in: [x, self_attn]}
      post_attention_layernorm: {op: RMSNorm, args: [$dim]}
      mlp: {op: FeedForward, args: [$dim, $hidden]}
      res2: {op: torch.add, in: [res1, mlp]}
layers:
  embed_tokens: {op: Embedding, args: [32000, 4096]}
  blocks: {op: Decoder, args: [4096, 32, 11008], repeat: 32}
  norm: {op: RMSNorm, args: [4096]}
  lm_head: {op: Linear, args: [4096, 32000], bias: false}
train:
  batch_size: 1
  dims: {seq: 16}
"""

#: The models of the placement-quality table of docs/benchmarks.md.
QUALITY_MODELS = [
    ("GPT-2 small (tied head)", ROOT / "examples" / "gpt2_small.yaml"),
    ("ResNet-50", ROOT / "examples" / "resnet50.yaml"),
    ("Llama-7B-shaped stack", LLAMA_7B),
]


def optimum(values: list[int], devices: int) -> int:
    """The smallest possible heaviest device over every split of ``values``
    (in order) into at most ``devices`` contiguous parts: a plain dynamic
    program, independent of mpgen's partitioner, to check it against."""
    n = len(values)
    prefix = [0]
    for v in values:
        prefix.append(prefix[-1] + v)
    inf = float("inf")
    # best[k][i]: the smallest heaviest part for the first i units in k parts
    best = [[inf] * (n + 1) for _ in range(devices + 1)]
    best[0][0] = 0
    for k in range(1, devices + 1):
        for i in range(n + 1):
            for j in range(i + 1):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i] = load
    return int(min(best[k][n] for k in range(1, devices + 1)))


def quality_rows(device_counts=(2, 4, 8), models=QUALITY_MODELS) -> list[list[str]]:
    """Heaviest device (parameters) / optimum for mpgen's ``placement: auto``
    (balance: params), the greedy fill and Accelerate's balanced
    ``infer_auto_device_map``, per model and device count."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, source in models:
            text = source.read_text(encoding="utf-8") if isinstance(source, Path) else source
            for devices in device_counts:
                graph = compile_text(with_auto(text, devices, "params"), folder, "q.yaml")
                costs = graph.costs
                params = costs.of("params")
                best = optimum(list(params), devices)
                mpgen_load = max(device_loads(graph, costs, params))
                greedy = greedy_fill(params, devices).bottleneck
                acc = accelerate_bottleneck(graph, costs, devices)
                acc_cell = ("not installed" if acc is None else
                            f"{acc[0] / best:.3f} ({acc[1]} used)")
                rows.append([label, str(devices), str(len(costs.units)), f"{sum(params):,}",
                             f"{best:,}", f"{mpgen_load / best:.3f}", f"{greedy / best:.3f}",
                             acc_cell])
    return rows


QUALITY_HEADER = ["model", "devices", "units", "parameters", "optimum (heaviest device)",
                  "mpgen auto / optimum", "greedy first-fit / optimum",
                  "accelerate balanced / optimum"]


def section(quick: bool, emit) -> None:
    """The placement-quality section of docs/benchmarks.md (``--quick``: two
    and four devices, without the Llama-shaped stack)."""
    counts = (2, 4) if quick else (2, 4, 8)
    models = QUALITY_MODELS[:2] if quick else QUALITY_MODELS
    rows = quality_rows(counts, models)
    emit("## Placement quality\n")
    emit("Reproduce: `python -m bench --only placement`. Each model's placement units "
         "(layers, instances of repeated layers, block instances) split into contiguous "
         "runs over K devices, balancing parameters; the table gives the parameters on the "
         "heaviest device as a ratio to the optimum, which a plain dynamic program over the "
         "same units computes (`optimum()` in `bench/placement_bench.py`, independent of "
         "mpgen's partitioner). mpgen: `placement: {auto: {devices: [...], balance: "
         "params}}`. Greedy first-fit: devices filled in order up to total / K "
         "(`partition.greedy_fill`). Accelerate: Hugging Face Accelerate's "
         "`get_balanced_memory` then `infer_auto_device_map` on the same modules built on "
         "the meta device, each unit's class `no_split`, with the device list given "
         "explicitly (this machine has no GPU); it balances weight bytes, and \"used\" is "
         "how many devices its map fills. The Llama-7B-shaped stack is LLaMA's sizes "
         "(32 blocks of width 4,096, SwiGLU 11,008, vocabulary 32,000, untied head) built "
         "on the meta device.\n")
    from bench.common import table as markdown_table

    emit(markdown_table(QUALITY_HEADER, rows) + "\n")


def with_auto(text: str, devices: int, balance: str) -> str:
    """The spec with its placement replaced by ``auto`` over ``devices`` GPUs."""
    auto = (f"placement:\n  auto:\n    devices: [{', '.join(f'cuda:{i}' for i in range(devices))}]"
            f"\n    balance: {balance}\n")
    text = re.sub(r"(?ms)^placement:.*?(?=^\S|\Z)", "", text)
    return text.rstrip("\n") + "\n\n" + auto


def compile_text(text: str, folder: Path, name: str):
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return compile_spec(path, time_limit=None)  # a benchmark, not a check: no budget


def device_loads(graph, costs, values) -> list[int]:
    totals: dict[str, int] = {}
    for unit, value in zip(costs.units, values):
        device = graph.nodes[unit.node].devices[unit.instance]
        totals[device] = totals.get(device, 0) + value
    return list(totals.values())


def accelerate_bottleneck(graph, costs, devices: int):
    """Accelerate's split of the same units; None when it is not installed."""
    try:
        import accelerate  # noqa: F401
        from accelerate.utils import get_balanced_memory, infer_auto_device_map
    except ImportError:
        return None
    import logging

    from torch import nn

    # Accelerate warns that cuda:1.. do not exist here; the split it computes
    # for an explicit max_memory does not depend on them existing.
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    model = nn.Module()
    no_split = set()
    for name, module in costs_mod.meta_modules(graph):
        model.add_module(name, module)
        parts = module if isinstance(module, nn.ModuleList) else [module]
        no_split |= {type(m).__name__ for m in parts}
    no_split = sorted(no_split)
    roomy = {i: 10 * 2**40 for i in range(devices)}
    balanced = get_balanced_memory(model, max_memory=roomy, no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=balanced,
                                       no_split_module_classes=no_split)
    per_device: dict = {}
    current = None
    for unit in costs.units:
        key = unit.name
        found = None
        while key:
            if key in device_map:
                found = device_map[key]
                break
            key = key.rpartition(".")[0]
        if found is None and "" in device_map:
            found = device_map[""]
        current = found if found is not None else current  # functions follow the previous unit
        per_device[current] = per_device.get(current, 0) + unit.params
    return max(per_device.values()), len(per_device)


def ratio(value, best) -> str:
    return f"{value / best:.3f}" if best else "-"


def main() -> None:
    rows_params = []
    rows_memory = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, source, devices in MODELS:
            text = source.read_text(encoding="utf-8") if isinstance(source, Path) else source
            graph = compile_text(with_auto(text, devices, "params"), folder, "params.yaml")
            costs = graph.costs  # measured by compile_spec (analysis.costs)
            params = costs.of("params")
            best = max(device_loads(graph, costs, params))
            greedy = greedy_fill(params, devices).bottleneck
            acc = accelerate_bottleneck(graph, costs, devices)
            if acc is None:
                acc_cells = ["not installed", "-"]
            else:
                acc_cells = [f"{acc[0]:,} ({acc[1]} devices)", ratio(acc[0], best)]
            rows_params.append([label, str(devices), str(len(costs.units)), f"{best:,}",
                                f"{int(greedy):,}", ratio(greedy, best), *acc_cells])

            graph_m = compile_text(with_auto(text, devices, "memory"), folder, "memory.yaml")
            costs_m = graph_m.costs
            memory = costs_m.of("memory")
            best_m = max(device_loads(graph_m, costs_m, memory))
            greedy_m = greedy_fill(memory, devices).bottleneck
            rows_memory.append([label, str(devices), costs_mod.human_bytes(best_m),
                                costs_mod.human_bytes(greedy_m), ratio(greedy_m, best_m)])

    print("Balance: params (bottleneck = parameters on the heaviest device)\n")
    header = ["model", "devices", "units", "mpgen (optimal)", "greedy fill", "greedy / optimal",
              "accelerate balanced", "accelerate / optimal"]
    print(table(header, rows_params))
    print("\nBalance: memory (estimated training memory on the heaviest device)\n")
    print(table(["model", "devices", "mpgen (optimal)", "greedy fill", "greedy / optimal"],
                rows_memory))


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
