"""Run-time overhead: the generated model against the same torch.nn layers
written by hand, forward + backward, interleaved in one process.

Each spec below is built twice with ``python -m mpgen build`` into a
temporary folder: with ``--device-map cpu`` (everything on the CPU), and
as written (over cuda:0 and cuda:1). The generated files are imported from
there (they never import mpgen). The hand-written module beside each spec
has the same layers under the same names, so the generated model's weights
load into it with a strict ``load_state_dict``: both compute the same thing.

A step is forward, the mean of the squared output, backward, and the
gradients set to None. One intra-op thread, timed with ``time.process_time``
(CPU time of this process: another process's load does not count). Each
round times a chunk of steps of every variant, in an order that alternates
between rounds; a round's ratio is its generated chunk over its hand-written
chunk, and the table gives the median over the rounds.

The second table runs the split build (cuda:0 and cuda:1 as in the spec)
under ``mpgen.testing.virtual_devices(cuda=2)`` against the same weights
built with ``--device-map cpu``: the cost of emulating the devices.

The third table runs each example's generated test suite (``pytest -q`` of
the generated ``test_<name>.py``) in a fresh process, as a ratio to
``python -c "import torch"``, with the process's peak memory (max RSS).
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import IMPORT_TORCH, PYTHON, ROOT, cpu_seconds, median, run_process, table

COMMAND = "python -m bench --only overhead"

MLP = """\
mpgen: 1
name: BenchMLP
inputs:
  x: [batch, 512]
layers:
  fc1: {op: Linear, args: [512, 1024]}
  act1: {op: GELU}
  fc2: {op: Linear, args: [1024, 1024]}
  act2: {op: GELU}
  fc3: {op: Linear, args: [1024, 10]}
placement:
  fc1: cuda:0
  fc2: cuda:1
train:
  batch_size: 64
"""

CNN = """\
mpgen: 1
name: BenchCNN
inputs:
  x: [batch, 3, 32, 32]
layers:
  conv1: {op: Conv2d, args: [3, 32, 3], padding: 1}
  bn1: {op: BatchNorm2d, args: [32]}
  relu1: {op: ReLU}
  pool1: {op: MaxPool2d, args: [2]}
  conv2: {op: Conv2d, args: [32, 64, 3], padding: 1}
  bn2: {op: BatchNorm2d, args: [64]}
  relu2: {op: ReLU}
  pool2: {op: MaxPool2d, args: [2]}
  flat: {op: torch.flatten, start_dim: 1}
  fc: {op: Linear, args: [4096, 10]}
placement:
  conv1: cuda:0
  conv2: cuda:1
train:
  batch_size: 32
"""

#: Four pre-norm blocks, causal attention through
#: F.scaled_dot_product_attention, a tied head: examples/nano_gpt.yaml's
#: layers at width 128.
TRANSFORMER = """\
mpgen: 1
name: BenchGPT
inputs:
  idx: {shape: [batch, seq], dtype: int64}
blocks:
  CausalSelfAttention:
    params: [dim, heads]
    layers:
      c_attn: {op: Linear, args: [$dim, "=3 * $dim"]}
      split: {op: torch.split, args: [$dim], dim: 2, outputs: [q, k, v]}
      qh: {op: torch.unflatten, in: q, dim: -1, sizes: [$heads, "=$dim // $heads"]}
      kh: {op: torch.unflatten, in: k, dim: -1, sizes: [$heads, "=$dim // $heads"]}
      vh: {op: torch.unflatten, in: v, dim: -1, sizes: [$heads, "=$dim // $heads"]}
      qt: {op: torch.transpose, in: qh, dim0: 1, dim1: 2}
      kt: {op: torch.transpose, in: kh, dim0: 1, dim1: 2}
      vt: {op: torch.transpose, in: vh, dim0: 1, dim1: 2}
      att: {op: F.scaled_dot_product_attention, in: [qt, kt, vt], is_causal: true}
      merged: {op: torch.transpose, dim0: 1, dim1: 2}
      flat: {op: torch.flatten, start_dim: 2}
      c_proj: {op: Linear, args: [$dim, $dim]}
  MLP:
    params: [dim]
    layers:
      c_fc: {op: Linear, args: [$dim, "=4 * $dim"]}
      gelu: {op: GELU, approximate: tanh}
      c_proj: {op: Linear, args: ["=4 * $dim", $dim]}
  Block:
    params: [dim, heads]
    layers:
      ln_1: {op: LayerNorm, args: [$dim]}
      attn: {op: CausalSelfAttention, args: [$dim, $heads]}
      res1: {op: torch.add, in: [x, attn]}
      ln_2: {op: LayerNorm, args: [$dim]}
      mlp: {op: MLP, args: [$dim]}
      res2: {op: torch.add, in: [res1, mlp]}
layers:
  wte: {op: Embedding, args: [256, 128], in: idx}
  pos: {op: torch.arange, in: [], args: ["=size(idx, 1)"]}
  wpe: {op: Embedding, args: [64, 128], in: pos}
  emb: {op: torch.add, in: [wte, wpe]}
  h: {op: Block, args: [128, 4], repeat: 4}
  ln_f: {op: LayerNorm, args: [128]}
  lm_head: {op: Linear, args: [128, 256], bias: false, tie: {weight: wte.weight}}
placement:
  wte: cuda:0
  h.2-3: cuda:1
train:
  batch_size: 8
  dims: {seq: 64}
"""


# -- the same layers, written by hand ------------------------------------------------

class HandMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(512, 1024)
        self.act1 = nn.GELU()
        self.fc2 = nn.Linear(1024, 1024)
        self.act2 = nn.GELU()
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class HandCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.fc = nn.Linear(4096, 10)

    def forward(self, x):
        x = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        x = self.pool2(self.relu2(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))


class HandAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class HandMLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class HandBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = HandAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = HandMLPBlock(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class HandGPT(nn.Module):
    """nanoGPT's model (Karpathy), without dropout: the layers of
    examples/nano_gpt.yaml and of TRANSFORMER above."""

    def __init__(self, vocab: int, block: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.h = nn.ModuleList([HandBlock(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass(frozen=True)
class Model:
    label: str
    spec: str | Path  # spec text, or an example's path
    hand: Callable[[], nn.Module]
    inputs: Callable[[], torch.Tensor]


MODELS = [
    Model("MLP 512-1024-1024-10, batch 64", MLP, HandMLP, lambda: torch.randn(64, 512)),
    Model("CNN (2 conv + BN, 32 x 32), batch 32", CNN, HandCNN,
          lambda: torch.randn(32, 3, 32, 32)),
    Model("transformer: 4 pre-norm blocks, causal, width 128, batch 8 x 64", TRANSFORMER,
          lambda: HandGPT(256, 64, 128, 4, 4), lambda: torch.randint(0, 256, (8, 64))),
    Model("examples/nano_gpt.yaml (4 blocks, width 64), batch 4 x 32",
          ROOT / "examples" / "nano_gpt.yaml", lambda: HandGPT(65, 32, 64, 4, 4),
          lambda: torch.randint(0, 65, (4, 32))),
]


# -- building and importing ----------------------------------------------------------

def build(spec: str | Path, folder: Path, device_map: str | None) -> nn.Module:
    """Build ``spec`` with the CLI into ``folder`` and return a fresh instance
    of the generated model class (imported from the generated file)."""
    if isinstance(spec, str):
        path = folder / "spec.yaml"
        path.write_text(spec, encoding="utf-8")
    else:
        path = spec
    out = folder / ("cpu" if device_map else "split")
    argv = [PYTHON, "-m", "mpgen", "build", "-o", str(out), str(path)]
    if device_map:
        argv[4:4] = ["--device-map", device_map]
    cpu_seconds(argv, cwd=ROOT)
    model_file = next(p for p in out.glob("*.py")
                      if not p.name.startswith(("train_", "test_", "pp_", "predict_", "generate_")))
    module_spec = importlib.util.spec_from_file_location(f"bench_{uuid.uuid4().hex}", model_file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    classes = [v for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, nn.Module)
               and v.__module__ == module.__name__]
    return classes[-1]  # the model class comes last, after its blocks


def step(model: nn.Module, x: torch.Tensor) -> None:
    out = model(x)
    out.float().square().mean().backward()
    for p in model.parameters():
        p.grad = None


def chunk(model: nn.Module, x: torch.Tensor, steps: int, context=None) -> float:
    """CPU seconds of ``steps`` steps (inside ``context`` when given)."""
    if context is not None:
        with context():
            return chunk(model, x, steps)
    start = time.process_time()
    for _ in range(steps):
        step(model, x)
    return time.process_time() - start


def steps_for(model: nn.Module, x: torch.Tensor, target: float, context=None) -> int:
    """Steps that take about ``target`` CPU seconds."""
    once = chunk(model, x, 2, context) / 2
    return max(2, round(target / max(once, 1e-6)))


def interleaved(variants: list[tuple[nn.Module, object]], x: torch.Tensor, rounds: int,
                target: float) -> list[list[float]]:
    """Each variant's chunk times, round by round, in alternating order."""
    for model, context in variants:  # warm up: allocator, lazy init
        chunk(model, x, 3, context)
    steps = steps_for(variants[0][0], x, target, variants[0][1])
    times = [[] for _ in variants]
    for r in range(rounds):
        order = list(range(len(variants)))
        if r % 2:
            order.reverse()
        for i in order:
            model, context = variants[i]
            times[i].append(chunk(model, x, steps, context))
    return times


def overhead_rows(rounds: int, target: float, models=MODELS) -> tuple[list, list]:
    """Rows of the overhead table and of the virtual-devices table."""
    from mpgen.testing import virtual_devices

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows, virtual_rows = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, m in enumerate(models):
                folder = Path(tmp) / f"m{i}"
                folder.mkdir()
                generated_class = build(m.spec, folder, "cpu")
                split_class = build(m.spec, folder, None)
                torch.manual_seed(0)
                generated = generated_class()
                hand = m.hand()
                hand.load_state_dict(generated.state_dict(), strict=True)
                x = m.inputs()
                with torch.no_grad():
                    generated.eval(), hand.eval()
                    same = torch.allclose(generated(x), hand(x), rtol=1e-5, atol=1e-6)
                    generated.train(), hand.train()
                if not same:
                    raise AssertionError(f"{m.label}: the hand-written module disagrees")
                times = interleaved([(generated, None), (hand, None)], x, rounds, target)
                ratios = [g / h for g, h in zip(*times)]
                params = sum(p.numel() for p in generated.parameters())
                rows.append([m.label, f"{params:,}", f"{median(ratios):.3f}",
                             f"{min(ratios):.3f} - {max(ratios):.3f}"])

                # One context, entered for each of its chunks: the split
                # model's tensors belong to it.
                devices = virtual_devices(cuda=2)
                with devices:
                    split = split_class()
                    split.load_state_dict(generated.state_dict(), strict=True)
                times = interleaved([(split, lambda: devices),
                                     (generated, None)], x, max(3, rounds // 2), target)
                ratios = [v / g for v, g in zip(*times)]
                virtual_rows.append([m.label, f"{median(ratios):.2f}"])
    finally:
        torch.set_num_threads(threads)
    return rows, virtual_rows


# -- generated test suites -------------------------------------------------------

QUICK_SUITES = ("small_cnn.yaml", "residual_mlp.yaml")


def suite_rows(quick: bool) -> list[list[str]]:
    """Each example's generated suite in a pytest process of its own, then all
    of them in one process (as CI runs ``pytest generated``): CPU time /
    import torch, and peak RSS."""
    specs = sorted((ROOT / "examples").glob("*.yaml"))
    if quick:
        specs = [s for s in specs if s.name in QUICK_SUITES]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tests = []
        for spec in specs:
            before = set(out.glob("test_*.py"))
            cpu_seconds([PYTHON, "-m", "mpgen", "build", "-o", str(out), str(spec)], cwd=ROOT)
            tests.append((spec, next(iter(set(out.glob("test_*.py")) - before))))
        for spec, test in tests:
            base = cpu_seconds(IMPORT_TORCH)
            seconds, peak = suite_run([test.name], out)
            rows.append([f"examples/{spec.name}", f"{seconds / base:.1f}",
                         f"{peak / 2**30:.2f} GiB"])
        base = cpu_seconds(IMPORT_TORCH)
        seconds, peak = suite_run([test.name for _, test in tests], out)
        rows.append([f"all {len(tests)} in one pytest process", f"{seconds / base:.1f}",
                     f"{peak / 2**30:.2f} GiB"])
    return rows


def suite_run(tests: list[str], folder: Path) -> tuple[float, int]:
    """CPU seconds and peak RSS (bytes) of ``pytest -q TESTS`` in ``folder``."""
    usage = run_process([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                        cwd=folder)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def section(quick: bool, rounds: int, emit) -> None:
    target = 0.05 if quick else 0.25
    rows, virtual_rows = overhead_rows(rounds, target)
    emit("## Run-time overhead\n")
    emit(f"Reproduce: `{COMMAND}`. Each model built with `python -m mpgen build --device-map "
         "cpu` into a temporary folder and imported from there, against a hand-written "
         "`nn.Module` with the same layers under the same names (the generated weights "
         "loaded into it, outputs checked equal). Forward + backward, one thread, CPU time "
         f"of chunks of steps, {rounds} interleaved rounds: generated / hand-written, the "
         "median and the range over the rounds. Goal of issue 14: within 1.02 (the outside "
         "check: a small transformer within 1.05).\n")
    emit(table(["model", "parameters", "generated / hand-written", "range over rounds"], rows)
         + "\n")
    emit("The same generated model built as the spec places it (cuda:0 and cuda:1) and run "
         "under `mpgen.testing.virtual_devices(cuda=2)`, against the `--device-map cpu` "
         "build with the same weights (median of interleaved rounds):\n")
    emit(table(["model", "virtual devices / cpu build"], virtual_rows) + "\n")
    suites = suite_rows(quick)
    emit("Each example's generated test suite (`python -m pytest -q test_<name>.py` in a "
         "folder the examples were built into), then all of them in one pytest process as CI "
         "runs them (`pytest generated`): CPU time as a ratio to `import torch` measured "
         "just before, one run each, with the pytest process's peak resident memory; a "
         "process of its own pays for importing torch and pytest each time"
         + (" (--quick: two small examples only)" if quick else "") + ":\n")
    emit(table(["suite", "CPU time / import torch", "peak RSS"], suites) + "\n")
    emit("Goal of issue 14: the examples' generated suites together (the last row) under 5x "
         "`import torch`.\n")
