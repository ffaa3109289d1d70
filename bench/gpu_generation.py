"""Generation on real GPUs: the KV cache compiled from the spec against the
whole window, and against Hugging Face's generate.

Two steps, because the GPU machine may lack mpgen's build dependencies
(pydantic, black, jinja2): the builds are made here, the measurement there
needs only python3, torch with CUDA and the files (transformers, where it
is installed, for the reference row).

1. Here (mpgen installed), build the decoders::

       python bench/gpu_generation.py prepare [--out build/gpu_generation]

   gpt2_small (GPT-2 124M as nn.TransformerEncoderLayer, learned positions,
   a tied head) and tiny_llama (rotary positions, grouped-query attention)
   with ``--device-map cuda:0`` (one GPU) and in their own two-device
   layout, each a plain output folder under ``--out``.

2. There (the folder copied beside this script, or the repository with the
   folder in it), measure::

       python3 bench/gpu_generation.py measure [--out build/gpu_generation]
                                               [--prompt 32] [--new 200]

   Each build's generate_<name>.py classes, with their own initial weights,
   decode ``--new`` tokens greedily from one prompt of ``--prompt`` ids (the
   runtime's ``continue_prompts``: what the script runs), with the cache and
   without it, after one warm-up run each; prefill milliseconds and decoding
   tokens per second, both synchronised. Where transformers is installed,
   GPT2LMHeadModel of gpt2_small's sizes (random weights) generates the same
   number of tokens with its own cache, for reference. A layout needing more
   GPUs than visible is skipped with a line saying so. The table goes to
   stdout and to ``<out>/gpu_generation.md``.

Without a GPU, ``measure`` says so and exits 0 (``--cpu``: run it on the CPU
anyway, small, as a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "build" / "gpu_generation"
#: (spec, what it stands for).
SPECS = (
    ("examples/gpt2_small.yaml", "GPT-2 124M, TransformerEncoderLayer"),
    ("examples/tiny_llama.yaml", "Llama, rotary, GQA"),
)


def prepare(out: Path, specs: list[str] | None = None) -> None:
    sys.path.insert(0, str(HERE.parent))
    from mpgen.compiler import driver
    from mpgen.output import runtime
    from mpgen.output.write import write_files

    found = []
    for spec_name, what in SPECS:
        spec = HERE.parent / spec_name
        if specs and spec.stem not in specs:
            continue
        for layout, device_map in (("one", {"*": "cuda:0"}), ("split", None)):
            result = driver.generate(spec, device_map)
            folder = out / f"{spec.stem}_{layout}"
            write_files(folder, {**runtime.files(), **result.files})
            (script,) = [n for n in result.files if n.startswith("generate_")]
            found.append({"folder": folder.name, "spec": spec.stem, "what": what,
                          "script": script[:-3], "devices": list(result.graph.devices)})
            print(f"built {folder}")
    (out / "builds.json").write_text(json.dumps(found, indent=1))


def _synchronised(device_type: str) -> float:
    if device_type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def _run(runtime, model, prompt, how, use_cache, device_type):
    runtime.continue_prompts(model, prompt, how, set(), use_cache)  # warm-up
    _synchronised(device_type)
    out, times = runtime.continue_prompts(model, prompt, how, set(), use_cache)
    _synchronised(device_type)
    return out[0], times["prefill"], times["decoded"] / max(times["decode"], 1e-9)


def _hugging_face(prompt_length: int, new: int, device: str) -> list | None:
    try:
        import transformers
    except ImportError:
        return None
    import torch

    config = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).to(device).eval()
    ids = torch.arange(prompt_length, device=device)[None]
    rows = []
    for use_cache in (True, False):
        kwargs = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new,
                      use_cache=use_cache, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, **kwargs)
            started = _synchronised(device.split(":")[0])
            model.generate(ids, **kwargs)
            seconds = _synchronised(device.split(":")[0]) - started
        rows.append(["transformers GPT2LMHeadModel", device, "cache" if use_cache else "none",
                     "", f"{new / seconds:,.1f}"])
    return rows


def measure(out: Path, prompt_length: int, new: int, cpu: bool) -> None:
    import torch

    count = torch.cuda.device_count()
    if not count and not cpu:
        print("no CUDA device visible: nothing measured (--cpu runs it on the CPU)")
        return
    builds = json.loads((out / "builds.json").read_text())
    rows = []
    for build in builds:
        if any(d.startswith("cuda") and int(d.split(":")[1]) >= count for d in build["devices"]) \
                and not cpu:
            print(f"{build['folder']}: needs {', '.join(build['devices'])}, {count} visible: skipped")
            continue
        folder = out / build["folder"]
        sys.path.insert(0, str(folder))
        for name in [m for m in sys.modules if m == "mpgen_runtime" or
                     m.startswith("mpgen_runtime.") or m.startswith(("train_", "generate_"))]:
            del sys.modules[name]
        module = __import__(build["script"])
        sys.path.remove(str(folder))
        runtime = module.mpgen_runtime.generate
        generating = module.GENERATING
        torch.manual_seed(0)
        if cpu:
            from mpgen.testing import virtual_devices  # the smoke test: mpgen's virtual devices

            context = virtual_devices(cuda=2)
        else:
            import contextlib

            context = contextlib.nullcontext()
        with context:
            plain = generating.training.model().eval()
            cached = generating.cached()
            cached.load_state_dict(plain.state_dict())
            cached.eval()
            how = argparse.Namespace(temperature=0.0, top_k=0, top_p=1.0, seed=0,
                                     max_new_tokens=new)
            prompt = [[(7 * k + 3) % generating.vocab for k in range(prompt_length)]]
            device_type = "cpu" if cpu else "cuda"
            ids_cache, prefill_cache, rate_cache = _run(runtime, cached, prompt, how, True,
                                                        device_type)
            ids_none, prefill_none, rate_none = _run(runtime, plain, prompt, how, False,
                                                     device_type)
        where = ", ".join(build["devices"])
        rows.append([build["spec"], where, "cache", f"{prefill_cache * 1000:.1f}",
                     f"{rate_cache:,.1f}"])
        rows.append([build["spec"], where, "none", f"{prefill_none * 1000:.1f}",
                     f"{rate_none:,.1f}"])
        if ids_cache != ids_none:
            print(f"{build['folder']}: the cached and uncached ids differ")
    if not cpu:
        rows += _hugging_face(prompt_length, new, "cuda:0") or []
    header = ["model", "devices", "KV cache", "prefill ms", "decode tokens/s"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = (f"Greedy decoding of {new} tokens from a prompt of {prompt_length} "
            f"({torch.cuda.get_device_name(0) if count else 'CPU'}):\n\n" + "\n".join(lines))
    print(text)
    (out / "gpu_generation.md").write_text(text + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="step", required=True)
    made = sub.add_parser("prepare", help="build the decoders (needs mpgen)")
    made.add_argument("--out", type=Path, default=DEFAULT_OUT)
    made.add_argument("specs", nargs="*", help="spec stems (default: all)")
    run = sub.add_parser("measure", help="time generation (needs torch, and a GPU)")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT)
    run.add_argument("--prompt", type=int, default=32)
    run.add_argument("--new", type=int, default=200)
    run.add_argument("--cpu", action="store_true", help="on the CPU, as a smoke test")
    args = p.parse_args(argv)
    if args.step == "prepare":
        prepare(args.out, args.specs)
    else:
        measure(args.out, args.prompt, args.new, args.cpu)


if __name__ == "__main__":
    main()
