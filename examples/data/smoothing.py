"""Training data for the seed example: noisy signals and their smoothed versions.

Each sample is a signal of 10 points, a sum of two sinusoids of random
frequency and phase plus noise; its target is the signal smoothed by a
3-point moving average (wrapping around at the ends). Smoothing is a linear
map, so the seed example (two Linear layers) can learn it exactly: the loss
falls towards 0, on held-out signals too.

    python examples/data/smoothing.py OUT.npz [--samples N] [--seed S]

writes OUT.npz with ``x`` [N, 10] and ``target`` [N, 10], the keys the
generated training script's --data reads.
"""

import argparse

import numpy as np

POINTS = 10


def signals(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` noisy signals and their 3-point moving averages."""
    rng = np.random.default_rng(seed)
    t = np.arange(POINTS) / POINTS
    freq = rng.uniform(0.5, 3.0, size=(samples, 2, 1))
    phase = rng.uniform(0, 2 * np.pi, size=(samples, 2, 1))
    amp = rng.uniform(0.5, 1.5, size=(samples, 2, 1))
    x = (amp * np.sin(2 * np.pi * freq * t + phase)).sum(axis=1)
    x += rng.normal(0, 0.1, size=x.shape)
    target = (np.roll(x, 1, axis=1) + x + np.roll(x, -1, axis=1)) / 3
    return x.astype(np.float32), target.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the .npz file to write")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    x, target = signals(args.samples, args.seed)
    np.savez(args.out, x=x, target=target)
    print(f"wrote {args.out}: {args.samples} signals of {POINTS} points (x) and their "
          f"3-point moving averages (target)")


if __name__ == "__main__":
    main()
