"""Generated models against their public counterparts on a GPU: train-step time and memory.

For each pair, the spec is built with ``python -m mpgen build --device-map
'*=cuda:0'`` into a temporary folder and its generated model imported from
there; the reference comes from its library:

* ``examples/resnet18.yaml`` and ``examples/resnet50.yaml`` against
  torchvision's ``resnet18()`` and ``resnet50()`` (images 224 x 224,
  cross-entropy against random labels, SGD with momentum);
* ``examples/gpt2_small.yaml`` (causal, head tied to the embedding) against
  Hugging Face's ``GPT2LMHeadModel(GPT2Config())`` (causal, tied), on
  sequences of 1,024 tokens, cross-entropy over the vocabulary, AdamW.

A train step is forward, loss, backward and the optimizer's step, in fp32
and under ``torch.autocast(dtype=torch.bfloat16)``. The generated model and
its reference alternate round by round (``--rounds``, each ``--steps``
steps between ``torch.cuda.synchronize`` calls, after ``--warmup`` untimed
steps); the table gives the median time per step of each, their ratio, and
the peak memory a step allocates beyond what was allocated before it
(activations, gradients, optimizer state). For GPT-2: tokens/s and the
model FLOPs utilisation, 6 N + 12 L d T FLOPs per token (N: parameters
without the position embedding; PaLM's appendix B) over the device's peak
(``--peak-tflops``; known for A100, H100 and H200).

With two or more GPUs it then runs bench/gpu_pipeline.py (the tutorial's
one-GPU vs naive split vs micro-batched experiment).

Where no GPU is visible it prints one line saying so and exits 0.
``--device cpu`` is a smoke run of the same code on the CPU at small sizes
(``examples/nano_gpt.yaml`` against a GPT-2 of its sizes; ResNet-18 at batch 2),
which the project's tests run.

    python bench/gpu_models.py [--rounds 5] [--steps 5] [--warmup 3] [--out build/gpu_models.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.overhead import build  # noqa: E402

NO_GPU = ("gpu_models: no CUDA GPU visible, nothing measured "
          "(--device cpu runs a smoke test on the CPU)")

#: Dense peak TFLOP/s (fp32 without TF32, bf16) by a substring of the device name.
PEAKS = {"H200": (67.0, 989.0), "H100": (67.0, 989.0), "A100": (19.5, 312.0)}


@dataclass
class Pair:
    label: str
    spec: Path
    reference: Callable[[], torch.nn.Module]  # raises ImportError when missing
    inputs: Callable[[str], tuple[torch.Tensor, torch.Tensor]]  # device -> (x, target)
    language_model: bool = False


def torchvision_model(name: str) -> Callable[[], torch.nn.Module]:
    def make():
        import torchvision

        return getattr(torchvision.models, name)()
    return make


def hf_gpt2(**config) -> Callable[[], torch.nn.Module]:
    def make():
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(**config))
    return make


def image_inputs(batch: int, side: int) -> Callable:
    def make(device):
        return (torch.randn(batch, 3, side, side, device=device),
                torch.randint(0, 1000, (batch,), device=device))
    return make


def token_inputs(batch: int, seq: int, vocab: int) -> Callable:
    def make(device):
        return (torch.randint(0, vocab, (batch, seq), device=device),
                torch.randint(0, vocab, (batch, seq), device=device))
    return make


def pairs(smoke: bool) -> list[Pair]:
    examples = ROOT / "examples"
    if smoke:
        return [
            Pair("ResNet-18, batch 2, 224 x 224", examples / "resnet18.yaml",
                 torchvision_model("resnet18"), image_inputs(2, 224)),
            Pair("nanoGPT (4 x 64) vs GPT2LMHeadModel of its sizes, batch 2 x 32",
                 examples / "nano_gpt.yaml",
                 hf_gpt2(vocab_size=65, n_positions=32, n_embd=64, n_layer=4, n_head=4,
                         bos_token_id=64, eos_token_id=64),
                 token_inputs(2, 32, 65), language_model=True),
        ]
    return [
        Pair("ResNet-18, batch 128, 224 x 224", examples / "resnet18.yaml",
             torchvision_model("resnet18"), image_inputs(128, 224)),
        Pair("ResNet-50, batch 64, 224 x 224", examples / "resnet50.yaml",
             torchvision_model("resnet50"), image_inputs(64, 224)),
        Pair("GPT-2 small vs GPT2LMHeadModel, batch 8 x 1024", examples / "gpt2_small.yaml",
             hf_gpt2(), token_inputs(8, 1024, 50257), language_model=True),
    ]


def loss_of(pair: Pair, out, target):
    if hasattr(out, "logits"):
        out = out.logits
    if pair.language_model:
        return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())
    return F.cross_entropy(out.float(), target)


def make_step(pair: Pair, model, x, target, device: str, bf16: bool):
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if pair.language_model
                 else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def step():
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                            enabled=bf16):
            loss = loss_of(pair, model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_peak(step, device: str) -> Optional[int]:
    """Bytes a step allocates beyond what was allocated before it."""
    if not device.startswith("cuda"):
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    sync(device)
    return torch.cuda.max_memory_allocated() - before


def timed(step, steps: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / steps


def gib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def gpt2_flops_per_token(model, seq: int) -> float:
    params = sum(p.numel() for p in model.parameters())
    for name, p in model.named_parameters():
        if name.split(".")[-2:-1] == ["wpe"] or name.endswith("wpe.weight"):
            params -= p.numel()
    layers = sum(1 for m in model.modules() if type(m).__name__ == "GPT2Block")
    width = model.config.n_embd
    return 6 * params + 12 * layers * width * seq


def measure(pairs_: list[Pair], device: str, args) -> list[list[str]]:
    rows = []
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else ""
    peaks = next((v for k, v in PEAKS.items() if k in name), None)
    with tempfile.TemporaryDirectory() as tmp:
        for i, pair in enumerate(pairs_):
            folder = Path(tmp) / f"p{i}"
            folder.mkdir()
            try:
                reference = pair.reference().to(device)
            except Exception as exc:  # a missing or broken library: a finding, not a crash
                rows.append([pair.label, "", f"reference unavailable: {type(exc).__name__}",
                             *[""] * 6])
                continue
            generated_class = build(pair.spec, folder,
                                    "cpu" if device == "cpu" else "*=" + device)
            torch.manual_seed(0)
            generated = generated_class().to(device)
            x, target = pair.inputs(device)
            for bf16 in (False, True):
                steps = {key: make_step(pair, model, x, target, device, bf16)
                         for key, model in (("gen", generated), ("ref", reference))}
                for step in steps.values():
                    for _ in range(args.warmup):
                        step()
                memory = {key: step_peak(step, device) for key, step in steps.items()}
                times = {"gen": [], "ref": []}
                for r in range(args.rounds):
                    for key in (("gen", "ref") if r % 2 == 0 else ("ref", "gen")):
                        times[key].append(timed(steps[key], args.steps, device))
                gen, ref = (statistics.median(times[k]) for k in ("gen", "ref"))
                tokens = mfu = ""
                if pair.language_model:
                    per_step = x.numel()
                    tokens = f"{per_step / gen:,.0f} / {per_step / ref:,.0f}"
                    if peaks:
                        flops = gpt2_flops_per_token(reference, x.shape[1]) * per_step
                        peak = peaks[1 if bf16 else 0] * 1e12
                        mfu = f"{flops / gen / peak:.1%} / {flops / ref / peak:.1%}"
                rows.append([pair.label, "bf16 autocast" if bf16 else "fp32",
                             f"{1000 * gen:.1f} ms", f"{1000 * ref:.1f} ms", f"{gen / ref:.3f}",
                             gib(memory["gen"]), gib(memory["ref"]), tokens, mfu])
            del generated, reference
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


HEADER = ["model", "precision", "generated step", "reference step", "generated / reference",
          "generated step peak", "reference step peak", "tokens/s (gen / ref)",
          "MFU (gen / ref)"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run at small sizes (default cuda)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (5; cpu: 2)")
    parser.add_argument("--steps", type=int, help="steps per round (5; cpu: 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (3; cpu: 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_models.md")
    args = parser.parse_args(argv)
    smoke = args.device == "cpu"
    for name, gpu, cpu in (("rounds", 5, 2), ("steps", 5, 1), ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if smoke else gpu)
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be at least {0 if name == 'warmup' else 1}")
    return args


def report(argv=None) -> Optional[str]:
    """The markdown of a run, or None where no GPU is visible (and not --device cpu)."""
    from bench.common import table

    args = parse_args(argv)
    smoke = args.device == "cpu"
    if not smoke and not (torch.cuda.is_available() and torch.cuda.device_count()):
        return None
    device = "cpu" if smoke else "cuda:0"
    where = ("CPU smoke run (small sizes, wall-clock times, no memory figures)" if smoke else
             f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = measure(pairs(smoke), device, args)
    lines = [f"{where}. Median of {args.rounds} interleaved rounds of {args.steps} train "
             f"steps after {args.warmup} untimed.", "", table(HEADER, rows), ""]
    if not smoke and torch.cuda.device_count() >= 2:
        import io
        from contextlib import redirect_stdout

        from bench import gpu_pipeline

        buffer = io.StringIO()
        with redirect_stdout(buffer):
            gpu_pipeline.main([])
        lines += [buffer.getvalue()]
    return "\n".join(lines)


#: Where a GPU run's output is kept for the page (committed with its date and device).
RECORDED = ROOT / "docs" / "benchmarks-gpu.md"


def section(emit) -> None:
    """The GPU section of docs/benchmarks.md: measured here when a GPU is
    visible (and written to RECORDED), else what RECORDED holds from the last
    run on one, or a line saying there is none."""
    emit("## On a GPU\n")
    emit("Reproduce where GPUs exist: `python bench/gpu_models.py` (it prints that no GPU is "
         "visible and stops elsewhere). Generated against torchvision's ResNet-18/50 and "
         "Hugging Face's GPT-2 (causal, tied), train-step time and peak memory in fp32 and "
         "bf16, GPT-2's tokens/s and model FLOPs utilisation; with two or more GPUs, the "
         "tutorial's one-GPU vs naive split vs micro-batched experiment "
         "(`bench/gpu_pipeline.py`).\n")
    text = report([])
    if text is not None:
        RECORDED.write_text(f"Measured {datetime.date.today()}.\n\n{text}\n", encoding="utf-8")
        emit(text + "\n")
    elif RECORDED.exists():
        emit(f"No GPU on this machine; the last run on one ({RECORDED.name}):\n")
        emit(RECORDED.read_text(encoding="utf-8"))
    else:
        emit("No GPU on this machine, and no run on one recorded yet: nothing measured.\n")


def main(argv=None) -> int:
    text = report(argv)
    if text is None:
        print(NO_GPU)
        return 0
    args = parse_args(argv)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
