"""The specs the build-cost benchmark builds, and a command to measure them.

Transformer specs of growing depth (one block of a
``TransformerEncoderLayer(256, 8, 1024)``, ``repeat: N``, between an
embedding and a head) and specs of N distinct ``Linear(32, 32)`` layers
written out one by one, each split over two devices.

    python bench/build_speed.py [--rounds 5] [--quick]

prints the build-cost tables of ``python -m bench --only build``
(:mod:`bench.build_cost`), which also writes them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BLOCKS = (12, 48, 96, 384)
LAYERS = (24, 96, 384, 1536)

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


def blocks_spec(depth: int) -> str:
    """A transformer of ``depth`` blocks: one block, ``repeat: depth``
    (``depth + 2`` layer entries with the embedding and the head)."""
    return (HEADER + f"  h: {{op: Block, args: [256, 8], repeat: {depth}}}\n"
            "  head: {op: Linear, args: [256, 1000]}\n"
            f"placement:\n  embed: cuda:0\n  h.{depth // 2}: cuda:1\n")


def layers_spec(count: int) -> str:
    """``count`` distinct ``Linear(32, 32)`` layers written out one by one,
    split over two devices."""
    body = "".join(f"  fc{i}: {{op: Linear, args: [32, 32]}}\n" for i in range(count))
    return ("mpgen: 1\nname: Wide\ninputs:\n  x: [batch, 32]\nlayers:\n" + body
            + f"placement:\n  fc0: cuda:0\n  fc{count // 2}: cuda:1\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the two smallest of each kind")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import build_cost

    build_cost.section(args.quick, args.rounds, print)


if __name__ == "__main__":
    main()
