"""Bounded work: a tiny spec never makes a build run for minutes (issue 10).

Each spec here is a few lines that once ran past 60 s or ended in a
traceback: an LSTM over a symbolic ``seq`` (shape inference stepped through
10,007 time steps on the meta device), ``repeat: 100000``, an LSTM with
100,000 layers, 10,000 transformer layers, blocks that double at every level,
a 1,001-dim input, 45,000 errors, ``batch_size: 10**15``, blocks nested 500
deep, a split into 3,000,000 tensors. Now each builds, or stops with one message at its line
(``mpgen/compiler/frontend/limits.py``; ``docs/spec.md``, "Limits").

They all run in one fresh interpreter (:func:`answers`), with a timeout as
the guard against a hang; how long each took is compared with building a
real model (``examples/resnet50.yaml``) in the same interpreter, a generous
ratio rather than a tight timing (each once took more than 30 times as long).
The limits must stay generous for real models: GPT-2 XL, a 96-layer
GPT-3-like model and ResNet-152 build under the default time budget.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, mpgen, write_spec
from mpgen.compiler import driver
from mpgen.compiler.analysis import costs, meta, shapes
from mpgen.compiler.analysis.budget import Budget, OutOfBudget
from mpgen.compiler.frontend import limits
from mpgen.compiler.frontend.limits import WorkBudget, cpu_seconds
from mpgen.compiler.ir import Args, Node, Op, OpKind
from mpgen.errors import MAX_ERRORS, STOPPED, Collector, ErrorList, MpgenError, Position

#: Slow: every case builds in a fresh interpreter, timed against a ResNet-50 build.
pytestmark = pytest.mark.slow

#: How many times the build time of a real model any case here may take.
RATIO = 10
REFERENCE = ROOT / "examples" / "resnet50.yaml"

TINY = """
mpgen: 1
name: Tiny
inputs:
  x: [batch, 8]
layers:
  fc: {op: Linear, args: [8, 8]}
"""


def _doubling(levels: int) -> str:
    """Block B<i> uses B<i-1> twice: 2**levels instances of B0's layer."""
    lines = ["mpgen: 1", "name: Doubling", "inputs:", "  x: [batch, 8]", "blocks:",
             "  B0:", "    layers:", "      fc: {op: Linear, args: [8, 8]}"]
    for i in range(1, levels + 1):
        lines += [f"  B{i}:", "    layers:", f"      a: {{op: B{i - 1}}}",
                  f"      b: {{op: B{i - 1}}}"]
    return "\n".join(lines + ["layers:", f"  top: {{op: B{levels}}}"]) + "\n"


def _nested(depth: int) -> str:
    """Blocks B1 ... B<depth>, each using the one before: ``depth`` levels."""
    lines = ["mpgen: 1", "name: Nested", "inputs:", "  x: [batch, 8]", "blocks:",
             "  B1:", "    layers:", "      fc: {op: Linear, args: [8, 8]}"]
    for i in range(2, depth + 1):
        lines += [f"  B{i}:", "    layers:", f"      a: {{op: B{i - 1}}}"]
    return "\n".join(lines + ["layers:", f"  top: {{op: B{depth}}}"]) + "\n"


def _many_transformer_layers(n: int) -> str:
    lines = ["mpgen: 1", "name: Many", "inputs:", "  x: [batch, seq, 64]", "blocks:",
             "  T:", "    layers:",
             "      t: {op: TransformerEncoderLayer, d_model: 64, nhead: 4, batch_first: true}",
             "layers:"]
    return "\n".join(lines + [f"  l{i}: {{op: T}}" for i in range(n)]) + "\n"


#: name -> spec text: each once ran for minutes or tracebacked.
CASES = {
    "lstm_over_seq": """
        mpgen: 1
        name: Tagger
        inputs:
          tokens: {shape: [batch, seq], dtype: int64}
        layers:
          emb: {op: Embedding, args: [1000, 64]}
          rnn: {op: LSTM, args: [64, 128, 2], batch_first: true, bidirectional: true,
                output: 0}
          head: {op: Linear, args: [256, 10]}
        train:
          loss: CrossEntropyLoss
          dims: {seq: 100000}
        """,
    "repeat": """
        mpgen: 1
        name: Rep
        inputs:
          x: [batch, 8]
        layers:
          fc: {op: Linear, args: [8, 8], repeat: 100000}
        """,
    "lstm_layers": """
        mpgen: 1
        name: Deep
        inputs:
          x: [seq, batch, 8]
        layers:
          rnn: {op: LSTM, args: [8, 8, 100000], output: 0}
        """,
    "transformer_repeat": """
        mpgen: 1
        name: Tx
        inputs:
          x: [batch, seq, 64]
        blocks:
          Stack:
            layers:
              h: {op: TransformerEncoderLayer, d_model: 64, nhead: 4, batch_first: true,
                  repeat: 1000}
        layers:
          stacks: {op: Stack, repeat: 10}
        """,
    "transformer_entries": _many_transformer_layers(10_000),
    "doubling_blocks": _doubling(30),
    "rank": "mpgen: 1\nname: Rank\ninputs:\n  x: [" + ", ".join(["2"] * 1001) + "]\n"
            "layers:\n  r: {op: torch.relu}\n",
    "errors": "mpgen: 1\nname: Errs\ninputs:\n  x: [batch, 8]\nlayers:\n"
              "  a: {op: torch.cat, in: [" + ", ".join(["q"] * 45_000) + "]}\n",
    "batch": """
        mpgen: 1
        name: Big
        inputs:
          x: [batch, 8]
        layers:
          fc: {op: Linear, args: [8, 8]}
        train:
          batch_size: 1000000000000000
        """,
    "elements": """
        mpgen: 1
        name: Big
        inputs:
          tokens: {shape: [batch, seq], dtype: int64}
        layers:
          emb: {op: Embedding, args: [1000, 64]}
        train:
          batch_size: 2000000000
          dims: {seq: 1000000}
        """,
    "nesting": _nested(500),
    "split": """
        mpgen: 1
        name: Split
        inputs:
          x: [batch, seq]
        layers:
          steps: {op: torch.split, args: [1], dim: 1, output: 0}
          fc: {op: Linear, args: [1, 4]}
        train:
          dims: {seq: 3000000}
        """,
}

#: name -> the whole of stderr (``{spec}``: the spec's path).
EXPECTED = {
    "repeat": "{spec}:6:42: layer 'fc': repeat: 100,000 is more than the 1,000 copies a "
              "layer may have",
    "lstm_layers": "{spec}:6:3: layer 'rnn': LSTM(8, 8, 100000) creates more than 4,000 "
                   "parameter tensors, buffers and submodules; at most 4,000 are supported "
                   "in one layer",
    "transformer_repeat": "{spec}:11:3: layer 'stacks': the model has 10,010 layer instances "
                          "up to here (every repeat and every layer of every block instance); "
                          "at most 5,000 are supported",
    "transformer_entries": "{spec}:2510:3: layer 'l2500': the model has 5,002 layer instances "
                           "up to here (every repeat and every layer of every block "
                           "instance); at most 5,000 are supported",
    "doubling_blocks": "{spec}:130:3: layer 'top': the model has 3,221,225,471 layer instances "
                       "up to here (every repeat and every layer of every block instance); at "
                       "most 5,000 are supported",
    "rank": "{spec}:4:3: input 'x': 1,001 dims; an input may have at most 16",
    "batch": "{spec}:8:15: train.batch_size: 1,000,000,000,000,000 is larger than the largest "
             "size, 2,147,483,647",
    "elements": "{spec}:4:3: input 'tokens': [batch, seq] is [2000000000, 1000000] at the "
                "training sizes, 2,000,000,000,000,000 elements; an input may have at most "
                "1,099,511,627,776",
    "split": "{spec}:6:3: layer 'steps': split would return 3,000,000 tensors; at most 100,000 "
             "are supported from one operator",
    "nesting": "{spec}:104:15: layer 'a' of block 'B33': block 'B32' already nests 32 blocks "
               "deep, so 'B33' would nest 33; blocks may nest at most 32 deep",
}

_SCRIPT = """
import contextlib, io, json, sys, time
from mpgen import cli
results = {}
for name, spec, out in json.loads(sys.argv[1]):
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["build", spec, "-o", out])
    results[name] = [code, err.getvalue(), time.monotonic() - start]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[int, str, float, str]]:
    """Every case built in one fresh interpreter, after a small spec (which
    loads what a first build loads) and the reference: name -> (exit status,
    stderr, seconds, spec path). A hang fails here, at the timeout."""
    folder = tmp_path_factory.mktemp("bounded")
    jobs = [("warm-up", str(write_spec(folder, TINY, "warm.yaml")), str(folder / "out-warm")),
            ("reference", str(REFERENCE), str(folder / "out-reference"))]
    paths = {"reference": str(REFERENCE)}
    for name, text in CASES.items():
        paths[name] = str(write_spec(folder, text, f"{name}.yaml"))
        jobs.append((name, paths[name], str(folder / f"out-{name}")))
    ran = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(jobs)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    results = json.loads(ran.stdout.splitlines()[-1])
    code, err = results["reference"][:2]
    # Built, with nothing but notes (its BatchNorms in the pipeline program)
    assert code == 0 and all(": note: " in line for line in err.splitlines()), err
    return {name: (*results[name], paths[name]) for name in paths}


def bounded(answers, seconds: float) -> bool:
    return seconds < RATIO * answers["reference"][2]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_spec_asking_for_unbounded_work_is_refused_at_its_line(answers, name):
    code, err, seconds, spec = answers[name]
    assert err.rstrip("\n") == EXPECTED[name].format(spec=spec)
    assert code == 2
    assert bounded(answers, seconds), (seconds, answers["reference"][2])


def test_an_lstm_over_a_long_sequence_builds_as_fast_as_a_small_spec(answers):
    code, err, seconds, spec = answers["lstm_over_seq"]
    # A token tagger reads as a decoder: the build's one note says why its
    # generate_tagger.py runs without a KV cache (the LSTM), and nothing else.
    assert code == 0
    assert all("runs without a KV cache" in line for line in err.splitlines()), err
    assert bounded(answers, seconds), (seconds, answers["reference"][2])
    model = (Path(spec).parent / "out-lstm_over_seq" / "tagger.py").read_text()
    assert "# [batch, seq, 256]" in model


def test_thousands_of_errors_stop_at_the_cap(answers):
    code, err, seconds, spec = answers["errors"]
    lines = err.splitlines()
    assert code == 2
    assert len(lines) == MAX_ERRORS + 1
    assert lines[0] == f"{spec}:6:27: layer 'a' reads unknown 'q' (it can read x)"
    assert lines[-1] == "... too many errors; stopping" == STOPPED
    assert bounded(answers, seconds), (seconds, answers["reference"][2])


# -- recurrent layers: counted over stand-in lengths, exactly ----------------

RECURRENT = """
mpgen: 1
name: Recurrent
inputs:
  tokens: {shape: [seq, batch], dtype: int64}
  h0: [4, batch, 16]
blocks:
  Twice:
    layers:
      gru: {op: GRU, args: [16, 16], output: 0, repeat: 3}
layers:
  emb: {op: Embedding, args: [50, 16]}
  side: {op: Linear, args: [16, 16], in: emb}  # saves emb, which the rnn reads
  rnn: {op: RNN, args: [16, 16, 2], bidirectional: true, dropout: 0.1, in: [emb, h0],
        outputs: [seq_out, hn]}
  proj: {op: Linear, args: [32, 16], in: seq_out}
  both: {op: torch.add, in: [proj, side]}
  lstm: {op: LSTM, args: [16, 16], proj_size: 8, in: both, output: 0}
  again: {op: Linear, args: [16, 8], in: both}  # saves both, which the lstm saved
  wide: {op: Linear, args: [8, 16], in: lstm}
  block: {op: Twice, in: wide}
  bf: {op: torch.transpose, args: [0, 1]}
  gru_bf: {op: GRU, args: [16, 16, 3], batch_first: true, in: bf, output: 0}
outputs: [gru_bf, hn, again]
train:
  batch_size: 3
  dims: {seq: 23}
"""


def test_recurrent_costs_at_stand_in_lengths_equal_the_full_run(tmp_path, monkeypatch):
    """NOTE [Cost formulas]: 2 and 3 steps extrapolated give every unit's
    activations and flops of the run over all 23 steps, with the initial
    state, a repeated copy inside a block, and inputs other layers save."""
    graph = driver.compile_spec(write_spec(tmp_path, RECURRENT))
    short = graph.costs
    monkeypatch.setattr(meta, "SHORT_SEQUENCE", 10**9)  # every step, as before
    full = costs.measure_graph(graph).costs
    assert short.units == full.units
    assert short.cuts == full.cuts
    rnn = next(u for u in short.units if u.node == 2)
    assert rnn.measured and rnn.activation_bytes > 0 and rnn.flops > 0


def test_the_copies_of_a_repeated_layer_in_a_block_cost_what_running_them_does(
        tmp_path, monkeypatch):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: Inner
        inputs:
          x: [batch, 16]
        blocks:
          Stack:
            layers:
              fc: {op: Linear, args: [16, 16], repeat: 7}
              act: {op: GELU, repeat: 4}
        layers:
          s: {op: Stack, repeat: 3}
          head: {op: Linear, args: [16, 4]}
        """)
    counted = driver.compile_spec(spec)
    monkeypatch.setattr(costs._Recorder, "chain", meta.Hooks.chain)  # run every copy
    ran = driver.compile_spec(spec)
    assert counted.costs == ran.costs
    assert counted.nodes[0].params == ran.nodes[0].params == 7 * (16 * 16 + 16)


def test_a_repeated_layer_in_a_block_that_changes_shape_is_refused(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: Grow
        inputs:
          x: [batch, 16]
        blocks:
          Stack:
            layers:
              fc: {op: Linear, args: [16, 32], repeat: 2}
        layers:
          s: {op: Stack}
        """)
    result = mpgen("build", str(spec), "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr == (f"{spec}:8:7: layer 's.fc': repeat needs the output to match the "
                             "input, but [batch, 16] becomes [batch, 32]\n")


# -- the time budget -----------------------------------------------------------

def test_the_budget_names_the_layer_being_analysed(tmp_path):
    spec = write_spec(tmp_path, TINY)
    with pytest.raises(OutOfBudget) as info:
        driver.compile_spec(spec, time_limit=0)
    assert str(info.value) == (f"{spec}:6:3: analysis of layer 'fc' ran past the 0 s CPU "
                               "budget of a build; the layers up to it are too large or too "
                               "slow to check in that time (--time-limit SECONDS raises the "
                               "budget)")
    assert driver.compile_spec(spec, time_limit=None).nodes[0].params == 72


def _layer(name: str, line: int) -> Node:
    return Node(name=name, var=name, op=Op(OpKind.MODULE, "Linear", "nn.Linear", None),
                init=Args(), call=Args(), inputs=(), pos=Position("spec.yaml", line, 3))


@pytest.mark.parametrize("work", ["module call", "operator", "parameter"])
def test_the_budget_is_checked_inside_a_layer(work):
    """A deadline that passes while one layer runs is caught at its next
    module call, operator or parameter, and reported at that layer."""
    budget = Budget(3600)
    with torch.device("meta"):
        linear = torch.nn.Linear(2, 2)
    x = torch.empty(4, 2, device="meta")
    with budget.watching(), budget.layer(_layer("slow", 9), "h.slow"):
        budget.deadline = cpu_seconds() - 1
        with pytest.raises(OutOfBudget) as info:
            if work == "module call":
                linear(x)
            elif work == "operator":
                torch.relu(x)
            else:
                linear.extra = torch.nn.Parameter(torch.empty(2, device="meta"))
    assert str(info.value) == ("spec.yaml:9:3: analysis of layer 'h.slow' ran past the 3600 s "
                               "CPU budget of a build; the layers up to it are too large or "
                               "too slow to check in that time (--time-limit SECONDS raises "
                               "the budget)")
    linear(x)  # the hooks are gone with the analysis
    torch.relu(x)


def test_the_budget_counts_cpu_time_not_waiting():
    """Time the process spends waiting (a loaded machine running others,
    or a sleep) does not count: only its own CPU time does."""
    budget = WorkBudget(0.5)
    with budget.task(Position("spec.yaml", 2, 7), "generating x.py", "why"):
        time.sleep(1.0)  # twice the budget in wall-clock time, almost no CPU
        budget.check()
        start = cpu_seconds()
        while cpu_seconds() - start < 0.6:  # more than the budget in CPU time
            pass
        with pytest.raises(OutOfBudget) as info:
            budget.check()
    assert str(info.value) == ("spec.yaml:2:7: generating x.py ran past the 0.5 s CPU budget "
                               "of a build; why (--time-limit SECONDS raises the budget)")


def test_a_loaded_machine_does_not_fail_a_build():
    """ResNet-50 over symbolic sizes, with the default budget, while eight
    CPU-bound processes compete for the cores: it once ran past a
    wall-clock budget on a busy machine; CPU time is not stretched by load."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(8)]
    try:
        result = driver.generate(ROOT / "examples" / "resnet50.yaml")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert result.graph.total_params == 25_557_032


def test_code_generation_is_under_the_budget(tmp_path):
    """Placement and code generation spend the same budget as the analysis:
    a spec within every limit that alternates devices per block instance
    is quick to analyse (one instance of a repeated layer is run) but gives
    a pipeline program of a thousand stages; it is stopped while its code
    is generated, at the model's name, not minutes later."""
    places = "".join(f"  h.{i}: cuda:{i % 2}\n" for i in range(1000))
    spec = write_spec(tmp_path, textwrap.dedent("""
        mpgen: 1
        name: Alternating
        inputs:
          x: [batch, 8]
        blocks:
          B:
            layers:
              a: {op: Linear, args: [8, 8]}
              b: {op: Tanh}
        layers:
          h: {op: B, repeat: 1000}
        placement:
        """) + places)
    with pytest.raises(OutOfBudget) as info:
        driver.generate(spec, time_limit=1.5)
    assert re.fullmatch(rf"{re.escape(str(spec))}:2:7: generating \S+ ran past the 1.5 s CPU "
                        r"budget of a build; the spec asks for too much work to build in that "
                        r"time \(--time-limit SECONDS raises the budget\)", str(info.value))


def test_a_huge_size_is_cut_in_the_layer_s_message(tmp_path):
    """A 4,000-digit size (YAML reads up to Python's digit limit) fails to
    build; the message names the call without spelling the number out."""
    spec = write_spec(tmp_path, TINY.replace("[8, 8]", f"[8, {'9' * 4000}]"))
    result = mpgen("show", str(spec))
    assert result.returncode == 2
    assert result.stderr.startswith(f"{spec}:6:3: layer 'fc': Linear(8, {'9' * 56}...9) "
                                    "cannot be built: ")
    assert len(result.stderr) < 400


def test_the_limits_are_documented_with_their_numbers():
    section = (ROOT / "docs" / "spec.md").read_text().split("## Limits")[1].split("\n## ")[0]
    numbers = [limits.MAX_REPEAT, limits.MAX_INSTANCES, limits.MAX_BLOCK_DEPTH,
               limits.MAX_RANK, limits.MAX_TRAIN_SIZE, limits.MAX_ELEMENTS,
               limits.MAX_LAYER_OBJECTS, limits.MAX_OP_OUTPUTS, MAX_ERRORS]
    for number in numbers:
        assert f"{number:,}" in section, number
    assert f"{limits.DEFAULT_TIME_LIMIT:g} s" in section


# -- the error cap -------------------------------------------------------------

def test_a_collector_stops_at_the_cap():
    errors = Collector()
    for line in range(1, MAX_ERRORS):
        errors.add(Position("f", line, 1), "bad")
    with pytest.raises(ErrorList) as info:
        errors.add(Position("f", MAX_ERRORS, 1), "bad")
    assert info.value.stopped and len(info.value.errors) == MAX_ERRORS
    assert str(info.value).splitlines()[-2:] == [f"f:{MAX_ERRORS}:1: bad", STOPPED]
    again = Collector()  # a list that was cut short stops the stage taking it in
    with pytest.raises(ErrorList) as info:
        again.extend(ErrorList([MpgenError(None, "x")], stopped=True))
    assert str(info.value) == f"x\n{STOPPED}"


# -- generous for real models ------------------------------------------------

def _example(name: str, *replacements: tuple[str, str]) -> str:
    text = (ROOT / "examples" / f"{name}.yaml").read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    return text


REAL_MODELS = {
    # 48 layers of 1600, as published.
    "gpt2_xl": _example("gpt2_small", ("name: GPT2Small", "name: GPT2XL"), ("768", "1600"),
                        ("nhead: 12", "nhead: 25"), ("3072", "6400"),
                        ("repeat: 12", "repeat: 48"), ("h.0-5", "h.0-23"), ("h.6-11", "h.24-47")),
    # nanoGPT's fine-grained blocks at GPT-3's size, 96 of them inside one
    # block: every copy is a layer instance (about 2,100).
    "gpt3_like": _example("nano_gpt", ("name: NanoGPT", "name: Gpt3Like"),
                          ("args: [65, 64]", "args: [50257, 12288]"),
                          ("args: [32, 64]", "args: [2048, 12288]"),
                          ("layers:\n  wte", "  Stack:\n    layers:\n      h: {op: Block, "
                           "args: [12288, 96], repeat: 96}\n\nlayers:\n  wte"),
                          ("h: {op: Block, args: [64, 4], repeat: 4}", "h: {op: Stack}"),
                          ("LayerNorm, args: [64]", "LayerNorm, args: [12288]"),
                          ("args: [64, 65]", "args: [12288, 50257]"),
                          ("h.2-3: cuda:1", "ln_f: cuda:1")),
    "resnet152": _example("resnet50", ("name: ResNet50", "name: ResNet152"),
                          ("[512, 128], repeat: 3", "[512, 128], repeat: 7"),
                          ("[1024, 256], repeat: 5", "[1024, 256], repeat: 35")),
}


@pytest.mark.parametrize("name, params", [("gpt2_xl", 1_557_611_200),
                                          ("gpt3_like", 174_604_259_328),
                                          ("resnet152", 60_192_808)])
def test_real_models_are_within_the_limits_and_the_budget(tmp_path, name, params):
    spec = write_spec(tmp_path, REAL_MODELS[name])
    graph = driver.compile_spec(spec)
    assert sum(n.params * n.instances for n in graph.nodes) == params


def test_blocks_nested_as_deep_as_allowed_build(tmp_path):
    spec = write_spec(tmp_path, _nested(limits.MAX_BLOCK_DEPTH))
    graph = driver.compile_spec(spec)
    assert graph.nodes[0].params == 72
    assert shapes.infer(graph).nodes[0].params == 72


def test_the_stand_in_keeps_unknown_sizes_unknown(tmp_path):
    """NOTE [Symbolic dims]: an LSTM over a strided convolution's output
    length (``?``) keeps it ``?``; over ``seq`` it reads ``seq``."""
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: ConvRnn
        inputs:
          x: [batch, 4, seq]
        layers:
          conv: {op: Conv1d, args: [4, 8, 3], stride: 2}
          t: {op: torch.transpose, args: [1, 2]}
          rnn: {op: LSTM, args: [8, 8], batch_first: true, output: 0}
          x_t: {op: torch.transpose, args: [1, 2], in: x}
          rnn_seq: {op: GRU, args: [4, 8], batch_first: true, output: 0}
        outputs: [rnn, rnn_seq]
        """)
    graph = driver.compile_spec(spec)
    assert [str(n.out) for n in graph.nodes] == ["[batch, 8, ?]", "[batch, ?, 8]",
                                                "[batch, ?, 8]", "[batch, seq, 4]",
                                                "[batch, seq, 8]"]


def test_a_one_time_import_is_not_the_spec_s_cost():
    """CPU time spent inside ``paused()`` (torch's dynamo, imported once per
    process for the memory plan) moves the deadline: a build costs the same
    first or later in a process."""
    budget = WorkBudget(0.3)
    with budget.active(), budget.task(None, "building", "too slow"):
        with budget.paused():
            end = cpu_seconds() + 0.6
            while cpu_seconds() < end:
                pass
        budget.check()  # 0.6 s spent, none of it counted
        end = cpu_seconds() + 0.6
        with pytest.raises(OutOfBudget):
            while cpu_seconds() < end:
                budget.check()


def test_the_memory_plan_s_import_of_dynamo_is_paused():
    # a fresh interpreter, where dynamo is not imported yet: the seed spec's
    # build counts well under the second the import takes
    code = ("import sys\n"
            "from mpgen.compiler import driver\n"
            "from mpgen.compiler.frontend import limits\n"
            "spent = []\n"
            "paused = limits.WorkBudget.paused\n"
            "def counted(self):\n"
            "    start = limits.cpu_seconds()\n"
            "    with paused(self):\n"
            "        yield\n"
            "    spent.append(limits.cpu_seconds() - start)\n"
            "import contextlib\n"
            "limits.WorkBudget.paused = contextlib.contextmanager(counted)\n"
            "assert 'torch._dynamo' not in sys.modules or "
            "type(sys.modules['torch._dynamo']).__name__ == '_StandIn'\n"
            f"driver.generate({str(ROOT / 'examples' / 'seed.yaml')!r})\n"
            "assert type(sys.modules['torch._dynamo']).__name__ == 'module'\n"
            "assert spent and spent[0] > 0.2, spent\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr
