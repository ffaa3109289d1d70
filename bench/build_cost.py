"""Build cost: `mpgen build` and `mpgen check` in fresh processes, as ratios
to `python -c "import torch"` measured in the same rounds.

Each round runs `import torch`, then every build, then `mpgen check` of the
unchanged examples, each in a fresh interpreter; a build writes into a new
folder every time (a cold build: nothing of a previous build to reuse). The
ratio of each run is taken against the round's own `import torch`, and the
table gives the median over the rounds. The specs are bench/build_speed.py's:
transformers of N blocks of one `TransformerEncoderLayer(256, 8, 1024)`
(`repeat: N`), and N distinct `Linear` layers written out one by one.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import build_speed
from bench.common import IMPORT_TORCH, PYTHON, ROOT, cpu_seconds, median, table

REPEATED = build_speed.BLOCKS
DISTINCT = build_speed.LAYERS
QUICK_REPEATED = REPEATED[:2]
QUICK_DISTINCT = DISTINCT[:2]

COMMAND = "python -m bench --only build"


@dataclass
class Case:
    label: str
    repeated: bool
    entries: int  # layer entries of the spec (blocks, the embedding and the head)
    spec: Path
    ratios: list[float]


def mpgen(*args: str) -> list[str]:
    return [PYTHON, "-m", "mpgen", *args]


def examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.yaml"))


def measure(rounds: int, quick: bool) -> tuple[list[Case], list[float]]:
    """Every build case's ratios to import torch, and `mpgen check`'s."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = []
        for repeated, depths in ((True, QUICK_REPEATED if quick else REPEATED),
                                 (False, QUICK_DISTINCT if quick else DISTINCT)):
            for n in depths:
                path = folder / f"{'blocks' if repeated else 'layers'}_{n}.yaml"
                text = build_speed.blocks_spec(n) if repeated else build_speed.layers_spec(n)
                path.write_text(text, encoding="utf-8")
                label = f"{n} blocks (repeat: {n})" if repeated else f"{n} distinct layers"
                cases.append(Case(label, repeated, n + 2 if repeated else n, path, []))
        # The examples built once, untimed: `check` then finds them unchanged.
        built = folder / "examples_out"
        cpu_seconds(mpgen("build", "-o", str(built), *map(str, examples())), cwd=ROOT)
        check = []
        for r in range(rounds):
            base = cpu_seconds(IMPORT_TORCH)
            for i, case in enumerate(cases):
                out = folder / f"out_{r}_{i}"
                seconds = cpu_seconds(mpgen("build", "-o", str(out), "--time-limit", "600",
                                            str(case.spec)), cwd=ROOT)
                case.ratios.append(seconds / base)
            seconds = cpu_seconds(mpgen("check", "-o", str(built), *map(str, examples())),
                                  cwd=ROOT)
            check.append(seconds / base)
    return cases, check


def build_table(cases: list[Case]) -> str:
    """Each build as a ratio to import torch, and its growth over the row
    before (the part beyond import torch, against the growth in layers)."""
    rows = []
    previous = None
    for case in cases:
        value = median(case.ratios)
        growth = entries = ""
        if previous is not None and previous.repeated == case.repeated:
            before = median(previous.ratios)
            growth = f"{(value - 1) / (before - 1):.2f}x" if before > 1 else ""
            entries = f"{case.entries / previous.entries:.2f}x"
        rows.append([case.label, str(case.entries), f"{value:.2f}", growth, entries])
        previous = case
    return table(["spec", "layer entries", "build / import torch",
                  "beyond import torch, vs row above", "layer entries, vs row above"], rows)


def check_table(check: list[float]) -> str:
    return table(["command", "specs", "CPU time / import torch"],
                 [["mpgen check (unchanged examples)", str(len(examples())),
                   f"{median(check):.2f}"]])


def section(quick: bool, rounds: int, emit) -> None:
    """Measure and emit the build-cost section's markdown, piece by piece."""
    cases, check = measure(rounds, quick)
    emit("## Build cost\n")
    emit(f"Reproduce: `{COMMAND}`. CPU time (user + system) of `python -m mpgen build` "
         f"of one spec into a new folder, in a fresh process, divided by the CPU time of "
         f"`python -c \"import torch\"` in the same round; median of {rounds} interleaved "
         "rounds. The specs are `bench/build_speed.py`'s: an embedding, N blocks of one "
         "`TransformerEncoderLayer(256, 8, 1024)` (`repeat: N`) and a head; and N distinct "
         "`Linear` layers written out one by one; each over two devices. Linear growth "
         "shows as the two right-hand columns agreeing.\n")
    emit(build_table(cases) + "\n")
    emit(f"`mpgen check` of the {len(examples())} examples against their unchanged "
         "generated files (built once before the rounds), same measure:\n")
    emit(check_table(check) + "\n")
    emit("Goals of issue 14: `check` of the unchanged examples under 0.2x `import torch`; "
         "a 96-block cold build under 1.3x; linear growth to 10,000 layer entries.\n")
