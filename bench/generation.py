"""Generation with the KV cache against without it, on the CPU.

For each decoder (nanoGPT's learned positions, the tiny Llama's rotary
tables, and gpt2_small's nn.TransformerEncoderLayer outside --quick), mpgen
builds it for the CPU into a temporary folder, and generate_<name>.py's
model classes run in a fresh process (every folder has its own
``mpgen_runtime``), with the weights its own initialisation gives: one
prompt, greedy decoding of N new tokens, through the runtime's
``continue_prompts`` (what the script runs) once with the cache and once
without (the whole window again for every token). The table gives the
prefill (the prompt's forward) and the decoding's tokens per second of each,
and their ratio, the best of ``rounds`` runs; both must make the same ids.

    python bench/generation.py [--quick] [--rounds N]
    python -m bench --only generation
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PYTHON, ROOT, table  # noqa: E402

#: (spec, what it stands for, prompt length, new tokens).
SPECS = (
    ("examples/nano_gpt.yaml", "GPT, learned positions (32)", 8, 24),
    ("examples/tiny_llama.yaml", "Llama, rotary positions", 16, 200),
    ("examples/gpt2_small.yaml", "GPT-2 124M, TransformerEncoderLayer", 16, 48),
)
QUICK = SPECS[:2]

#: Run in the output folder: the cached and uncached runs of one build.
MEASURE = """
import json, sys, types, torch
sys.path.insert(0, ".")
module = __import__(sys.argv[1])
runtime = module.mpgen_runtime.generate
prompt_length, new, rounds = map(int, sys.argv[2:5])
torch.manual_seed(0)
plain = module.GENERATING.training.model().eval()
cached = module.GENERATING.cached()
cached.load_state_dict(plain.state_dict())
cached.eval()
how = types.SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new_tokens=new)
prompt = [[(7 * k + 3) % module.GENERATING.vocab for k in range(prompt_length)]]
found = {}
for name, model, use in (("cache", cached, True), ("none", plain, False)):
    best = None
    for _ in range(rounds):
        out, times = runtime.continue_prompts(model, prompt, how, set(), use)
        rate = times["decoded"] / max(times["decode"], 1e-9)
        if best is None or rate > best["rate"]:
            best = {"prefill": times["prefill"], "rate": rate, "ids": out[0]}
    found[name] = best
print(json.dumps(found))
"""


def measure(spec: Path, folder: Path, prompt: int, new: int, rounds: int) -> dict:
    """The cached and uncached runs of ``spec`` built into ``folder``."""
    from mpgen.compiler import driver
    from mpgen.output import runtime
    from mpgen.output.write import write_files

    result = driver.generate(spec, {"*": "cpu"})
    write_files(folder, {**runtime.files(), **result.files})
    (name,) = [n for n in result.files if n.startswith("generate_")]
    ran = subprocess.run([PYTHON, "-c", MEASURE, name[:-3], str(prompt), str(new), str(rounds)],
                         cwd=folder, capture_output=True, text=True, check=True)
    return json.loads(ran.stdout.strip().splitlines()[-1])


def section(quick: bool, rounds: int, emit: Callable[[str], None]) -> None:
    emit("## Generation: the KV cache against the whole window\n")
    emit("`bench/generation.py`: each decoder built for the CPU, `generate_<name>.py`'s "
         "classes run greedy decoding of one prompt with the KV cache compiled from the spec "
         "and without it (the whole window again for every token; `--no-cache`), the best of "
         f"{rounds} runs. Both make the same ids. On GPUs, `bench/gpu_generation.py`.\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpgen-generation-") as tmp:
        for spec_name, what, prompt, new in (QUICK if quick else SPECS):
            spec = ROOT / spec_name
            found = measure(spec, Path(tmp) / spec.stem, prompt, new, rounds)
            cache, none = found["cache"], found["none"]
            same = "yes" if cache["ids"] == none["ids"] else "**no**"
            rows.append([spec.stem, what, f"{prompt} + {new}",
                         f"{cache['prefill'] * 1000:.1f}", f"{none['prefill'] * 1000:.1f}",
                         f"{cache['rate']:,.1f}", f"{none['rate']:,.1f}",
                         f"{cache['rate'] / max(none['rate'], 1e-9):.2f}x", same])
    emit(table(["spec", "model", "prompt + new tokens", "prefill ms, cache",
                "prefill ms, none", "decode tokens/s, cache", "decode tokens/s, none",
                "decode speedup", "same ids"], rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the two small decoders only")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    section(args.quick, args.rounds, print)


if __name__ == "__main__":
    main()
