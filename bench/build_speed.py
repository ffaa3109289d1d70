"""How much does compiling cost beyond importing torch?

Builds transformer specs of growing depth, written both with `repeat: N`
and as N separate layers, and reports each build's time as a ratio to the
time of `import torch` measured in the same run (shared machines are
noisy; compare ratios, not seconds). Shape inference should be linear in
the number of layers: the per-layer column stays flat as depth grows.

    python bench/build_speed.py [--depths 12,48,96]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEADER = """\
mpgen: 1
name: Deep
inputs:
  tokens: {shape: [batch, seq], dtype: int64}
blocks:
  Block:
    params: [dim, heads]
    layers:
      layer: {op: TransformerEncoderLayer, d_model: $dim, nhead: $heads,
              dim_feedforward: 1024, batch_first: true, norm_first: true}
layers:
  embed: {op: Embedding, args: [1000, 256]}
"""


def spec(depth: int, repeated: bool) -> str:
    if repeated:
        body = f"  h: {{op: Block, args: [256, 8], repeat: {depth}}}\n"
        place = f"placement:\n  embed: cuda:0\n  h.{depth // 2}: cuda:1\n"
    else:
        body = "".join(f"  h{i}: {{op: Block, args: [256, 8]}}\n" for i in range(depth))
        place = f"placement:\n  embed: cuda:0\n  h{depth // 2}: cuda:1\n"
    return HEADER + body + "  head: {op: Linear, args: [256, 1000]}\n" + place


def timed(code: str) -> float:
    """Wall time of a fresh interpreter running ``code`` (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="12,48,96")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    base = timed("import torch")
    print(f"import torch: {base:.2f}s (= 1.00)\n")
    print("| spec | layers | build (s) | build / import torch | extra ms per layer |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for repeated in (True, False):
            for depth in depths:
                path = Path(tmp) / f"deep_{depth}_{repeated}.yaml"
                path.write_text(spec(depth, repeated))
                code = (f"from mpgen.compiler import pipeline as build; "
                        f"build.generate({str(path)!r})")
                seconds = timed(code)
                per_layer = (seconds - base) / (depth + 2) * 1000
                kind = f"repeat: {depth}" if repeated else f"{depth} layers"
                print(f"| {kind} | {depth + 2} | {seconds:.2f} | {seconds / base:.2f} | "
                      f"{per_layer:.1f} |")


if __name__ == "__main__":
    main()
