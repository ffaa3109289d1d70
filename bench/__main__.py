"""``python -m bench``: measure every table and write docs/benchmarks.md.

    python -m bench [--quick] [--only SECTION,...] [--rounds N] [--out FILE]

Sections, in the page's order: ``build`` (build and check cost against
``import torch``), ``overhead`` (generated against hand-written modules, the
virtual devices, the generated test suites), ``placement`` (heaviest device
against the optimum for mpgen, greedy first-fit and Accelerate), ``pipeline``
(the schedule simulator against torchgpipe's published speedups), ``stages``
(``balance: time`` against every contiguous split measured, predicted
against measured stage times on this CPU), ``memory``
(the memory plan against peaks measured per device, per component, for the
training step and the pipeline program), ``generation`` (tokens/s with the KV
cache against without it, prefill and decoding) and ``gpu``
(generated against torchvision and Hugging Face on a GPU; where none is
visible the section says so). Each table is printed as soon as it is
measured, and the page is written at the end with exactly the printed text:
the numbers in it are the ones this run printed. ``--only`` writes a page
of those sections alone (to ``--out``, by default build/benchmarks.md, so
that the committed page is only ever a whole run's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

from bench.common import ROOT, machine_lines

PAGE = ROOT / "docs" / "benchmarks.md"
PARTIAL = ROOT / "build" / "benchmarks.md"
SECTIONS = ("build", "overhead", "placement", "pipeline", "stages", "memory", "generation",
            "gpu")


def _build(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import build_cost

    build_cost.section(quick, rounds, emit)


def _overhead(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import overhead

    overhead.section(quick, rounds, emit)


def _placement(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import placement_bench

    placement_bench.section(quick, emit)


def _pipeline(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import pipeline_sim

    pipeline_sim.section(emit)


def _stages(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import stage_times

    stage_times.section(quick, max(rounds, 5), emit)


def _memory(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import memory_plan

    memory_plan.section(quick, emit)


def _generation(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import generation

    generation.section(quick, max(rounds, 3), emit)


def _gpu(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    from bench import gpu_models

    gpu_models.section(emit)


RUNNERS = {"build": _build, "overhead": _overhead, "placement": _placement,
           "pipeline": _pipeline, "stages": _stages, "memory": _memory,
           "generation": _generation, "gpu": _gpu}


def _sections(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(unknown) or '(none)'}; choose from {', '.join(SECTIONS)}")
    return [n for n in SECTIONS if n in names]  # the page's order


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=_sections, default=list(SECTIONS), metavar="SECTION,...",
                        help=f"some of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer and smaller cases: a smoke run, not numbers to publish")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds of each timed comparison (default 5)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the page (default: {PAGE.relative_to(ROOT)} for a whole run, "
                             f"{PARTIAL.relative_to(ROOT)} otherwise)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.out is None:
        whole = args.only == list(SECTIONS) and not args.quick
        args.out = PAGE if whole else PARTIAL
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    parts: list[str] = []

    def emit(text: str) -> None:
        print(text, flush=True)
        parts.append(text)

    command = "python -m bench" + (f" --only {','.join(args.only)}"
                                   if args.only != list(SECTIONS) else "")
    command += " --quick" if args.quick else ""
    command += f" --rounds {args.rounds}" if args.rounds != 5 else ""
    emit("# Benchmarks\n")
    emit("Written by `" + command + "` (`bench/`); every number below is the one that run "
         "printed. Times are CPU times (user + system) or, on a GPU, synchronized wall "
         "times, always given as ratios measured in one run, with their medians over "
         "interleaved repeats: these machines are shared, so seconds mean little and "
         "ratios travel.\n")
    emit("\n".join(machine_lines()) + "\n")
    started = time.monotonic()
    for name in args.only:
        began = time.monotonic()
        RUNNERS[name](args.quick, args.rounds, emit)
        print(f"[bench: {name} took {time.monotonic() - began:.0f} s]", file=sys.stderr,
              flush=True)
    emit(f"The whole run took {(time.monotonic() - started) / 60:.1f} minutes of wall time.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
