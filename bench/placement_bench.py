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
from mpgen.compiler.pipeline import compile_spec  # noqa: E402
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
