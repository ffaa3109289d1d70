"""Hostile specs: nothing in a spec is executed, or pasted into code unescaped.

Strings that would be code if pasted (quotes, newlines, triple quotes,
backslashes, ``__import__('os')...``) are put everywhere a spec has a string:
argument values, names, placement keys, dims, op names, YAML tags, the spec's
own file name. Every build must either succeed with generated code that
compiles, runs and executes none of it, or fail with exit code 2 and
``FILE:LINE:COL: message`` lines, never a traceback. A seeded random fuzz of
the example specs checks the same on a few hundred mutations.

Every build runs in-process through :func:`mpgen.cli.main` (see
:func:`helpers.mpgen`: an escaping exception fails the test with the spec, and
warnings reach stderr as they would in a fresh interpreter);
``tests/test_errors.py`` proves once that ``python -m mpgen`` and the ``mpgen``
script run the same code.
"""

from __future__ import annotations

import ast
import copy
import os
import random
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import yaml

from fuzzing import (assert_built_or_reported, assert_reported, assert_safe_code,
                     build_path, build_text)
from fuzzing import paths as _paths
from helpers import EXAMPLES, ROOT


def import_model(path: Path):
    import importlib.util

    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"hostile_{uuid.uuid4().hex[:8]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A file that appears only if something from a spec was executed."""
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "something from the spec was executed"


def payloads(sentinel: Path) -> list[str]:
    """Strings that are code, or break out of string literals, if pasted."""
    s = str(sentinel)
    return [
        f"__import__('os').system('touch {s}')",
        f"'); __import__('os').system('touch {s}'); ('",
        f'"); __import__("os").system("touch {s}"); ("',
        f"'''); open({s!r}, 'w'); ('''",
        f'"""); open({s!r}, "w"); ("""',
        f"\\'); open({s!r}, 'w') #",
        f"line one\nopen({s!r}, 'w')\n",
        "back\\slash\\",
        "\\x00\\n\\u2028",
        "\u2028\u2029\x85 unicode line breaks",
        "{{ jinja }} {% if true %}x{% endif %} ${dollar} %s %(name)s",
        "# comment",
    ]


# --------------------------------------------------------------------------
# strings as values: emitted through repr, never executed


def test_hostile_argument_values_become_string_literals(tmp_path, sentinel):
    values = payloads(sentinel)
    layers = {
        "tap": {"op": "Identity", "args": values, "note": values[1], "more": values[4],
                "nested": [values[2], [values[5]]]},
        "fc": {"op": "Linear", "args": [10, 4]},
    }
    spec = {"mpgen": 1, "name": "Hostile", "inputs": {"x": ["batch", 10]}, "layers": layers,
            "placement": {"tap": "cuda:0", "fc": "cuda:1"},
            "train": {"loss": {"op": "MSELoss", "reduction": "mean"},
                      "optimizer": {"op": "SGD", "lr": 0.1}, "steps": 1, "batch_size": 2}}
    result = build_text(tmp_path, yaml.safe_dump(spec, sort_keys=False, allow_unicode=True),
                        "--device-map", "cpu")
    assert result.code == 0, result.err
    files = result.files()
    assert_safe_code(files)
    for value in values:  # each payload is in the code as a string constant
        constants = {n.value for n in ast.walk(ast.parse(files["hostile.py"]))
                     if isinstance(n, ast.Constant)}
        assert value in constants
    module = import_model(result.out_dir / "hostile.py")
    model = module.Hostile()
    import torch

    assert model(torch.randn(2, 10)).shape == (2, 4)


def test_hostile_kwarg_names_are_refused(tmp_path, sentinel):
    name = f"a=__import__('os').system('touch {sentinel}'), b"
    text = textwrap.dedent(f"""\
        mpgen: 1
        name: Hostile
        inputs:
          x: [batch, 10]
        layers:
          tap: {{op: Identity, {name!r}: 1}}
          act: {{op: Tanh, "x=1) or open('{sentinel}', 'w'": 1}}
        train:
          loss: {{op: MSELoss, "reduction='sum'); open('{sentinel}', 'w'); (": 1}}
        """)
    result = build_text(tmp_path, text)
    assert_reported(result)
    assert "is not a valid keyword argument name" in result.err
    assert result.err.count("\n") == 3


@pytest.mark.parametrize("where", [
    "model name", "input name", "layer name", "block name", "block param", "block input",
    "placement key", "dim", "train dim", "loss output", "output", "in", "device",
    "auto device", "dtype",
])
def test_hostile_names_are_refused(tmp_path, sentinel, where):
    evil = f"x'); __import__('os').system('touch {sentinel}'); ('\n\"\"\""
    spec = {"mpgen": 1, "name": "Hostile", "inputs": {"x": ["batch", 10]},
            "blocks": {"Block": {"params": ["dim"], "inputs": ["h"],
                                 "layers": {"fc": {"op": "Linear", "args": ["$dim", "$dim"]}}}},
            "layers": {"layer1": {"op": "Block", "args": [10]},
                       "layer2": {"op": "Linear", "args": [10, 4]}},
            "outputs": ["layer2"], "placement": {"layer1": "cuda:0"},
            "train": {"loss": "MSELoss"}}
    edits = {
        "model name": lambda s: s.update(name=evil),
        "input name": lambda s: s.update(inputs={evil: ["batch", 10]}),
        "layer name": lambda s: s["layers"].update({evil: {"op": "ReLU"}}),
        "block name": lambda s: s["blocks"].update({evil: copy.deepcopy(s["blocks"]["Block"])}),
        "block param": lambda s: s["blocks"]["Block"].update(params=[evil]),
        "block input": lambda s: s["blocks"]["Block"].update(inputs=[evil]),
        "placement key": lambda s: s["placement"].update({evil: "cuda:1"}),
        "dim": lambda s: s["inputs"].update(x=["batch", evil]),
        "train dim": lambda s: s["train"].update(dims={evil: 3}),
        "loss output": lambda s: s["train"].update(loss={evil: "MSELoss"}),
        "output": lambda s: s.update(outputs=[evil]),
        "in": lambda s: s["layers"]["layer2"].update({"in": evil}),
        "device": lambda s: s["placement"].update(layer2=evil),
        "auto device": lambda s: s.update(placement={"auto": {"devices": [evil]}}),
        "dtype": lambda s: s["inputs"].update(x={"shape": ["batch", 10], "dtype": evil}),
    }
    edits[where](spec)
    result = build_text(tmp_path, yaml.safe_dump(spec, sort_keys=False))
    assert_reported(result)
    # The name is shown escaped, on one line per error.
    assert "\\n" in result.err or "\\'" in result.err or '"""' in result.err


# --------------------------------------------------------------------------
# op names: looked up, never called at build time


SAFE_REFUSALS = [
    "os.system", "builtins.eval", "builtins.exec", "subprocess.Popen", "subprocess.call",
    "torch.load", "torch._C._nn", "torch._C", "torch.__import__", "torch._dynamo",
    "importlib.import_module", "os.path; import os", "__import__('os').system",
    "torch.nn.Module", "torch.hub.load", "F.__builtins__", "pickle.loads", "shutil.rmtree",
]


@pytest.mark.slow  # each op is imported in a child interpreter
@pytest.mark.parametrize("op", SAFE_REFUSALS)
def test_dangerous_op_names_are_refused_without_running_anything(tmp_path, sentinel, op):
    text = textwrap.dedent(f"""\
        mpgen: 1
        name: Hostile
        inputs:
          x: [batch, 10]
        layers:
          evil: {{op: {op!r}, args: ['touch {sentinel}']}}
        """)
    result = build_text(tmp_path, text)
    assert_reported(result)


def test_torch_save_is_not_an_op(tmp_path):
    target = tmp_path / "written_at_build_time.pt"
    text = textwrap.dedent(f"""\
        mpgen: 1
        name: Hostile
        inputs:
          x: [batch, 10]
        layers:
          evil: {{op: torch.save, args: [{str(target)!r}]}}
        """)
    result = build_text(tmp_path, text)
    assert result.code == 2
    assert not target.exists(), "torch.save ran at build time"


@pytest.mark.slow
def test_import_side_effects_of_stdlib_modules_do_not_run(tmp_path):
    result = build_text(tmp_path, "mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\n"
                                  "layers:\n  a: {op: this.Zen}\n")
    assert_reported(result)
    assert "Beautiful is better than ugly" not in result.out


# --------------------------------------------------------------------------
# YAML features that construct objects or blow up


def test_python_tags_are_never_constructed(tmp_path, sentinel):
    tags = [
        f"!!python/object/apply:os.system ['touch {sentinel}']",
        f"!!python/object/new:subprocess.Popen [['touch', '{sentinel}']]",
        "!!python/name:builtins.eval",
        "!!python/module:os",
        f"!!python/object:argparse.Namespace {{a: 1}}",
        "!!binary aGVsbG8=",
    ]
    body = "".join(f"  l{i}:\n    op: Identity\n    v: {tag}\n" for i, tag in enumerate(tags))
    spec = tmp_path / "tags.yaml"
    spec.write_text("mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\nlayers:\n" + body)
    result = build_path(spec, tmp_path / "out")
    assert result.code == 2, result.err
    assert "Traceback" not in result.err
    assert result.err.count("is not allowed in a spec") == len(tags)


def test_billion_laughs_is_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i-1}'] * 9)}]" for i in range(1, 10)]
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    result = build_path(spec, tmp_path / "out")
    assert time.perf_counter() - start < 60
    assert result.code == 2
    assert result.err == f"{spec}:1:5: YAML anchors (&a0) are not allowed in a spec; " \
                          "write the value out\n"


@pytest.mark.parametrize("text", [
    "a: " + "[" * 100_000,
    "a: " + "{a: " * 30_000 + "1" + "}" * 30_000,
    "a:\n" + "".join("  " * i + "- \n" for i in range(1, 600)),
    "- " * 50_000 + "x",
])
def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path, text):
    result = build_text(tmp_path, text)
    assert_reported(result)
    assert "nested deeper than 64 levels" in result.err or "invalid YAML" in result.err


def test_a_huge_spec_is_refused_before_parsing(tmp_path):
    text = "mpgen: 1\n# " + "x" * (1 << 20) + "\n"
    result = build_text(tmp_path, text)
    assert_reported(result)
    assert "spec is larger than 1048576 bytes" in result.err


def test_thousands_of_errors_are_reported_without_flooding(tmp_path):
    body = "".join(f"  l{i}: cuda:0\n" for i in range(3000))
    text = "mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\nlayers:\n  a: {op: ReLU}\n" \
           "placement:\n" + body
    result = build_text(tmp_path, text)
    assert_reported(result)
    lines = result.err.splitlines()
    assert len(lines) == 101  # the first 100 found; the rest are not looked for
    assert lines[-1] == "... too many errors; stopping"


@pytest.mark.parametrize("raw", [
    b"\x00\x01\x02", b"mpgen: 1\nname: \x1b[31mRed\n", b"\xff\xfe\x00m\x00p", b"\xef\xbb\xbf",
    b"mpgen: 1\r\nname: M\r", "name: \ud800".encode("utf-8", "surrogatepass"),
    b"\t", b"%YAML 1.1\n---\na: 1", b"%TAG ! tag:yaml.org,2002:python/\n---\n!object:os.X {}",
    b"? [a]\n: 1", b"!!python/name:os.system : 1", b"'", b"{", b"]", b"*x", b"&a", b"!<!> x",
])
def test_garbage_bytes_are_reported(tmp_path, raw):
    result = build_text(tmp_path, raw)
    assert_reported(result)


# --------------------------------------------------------------------------
# odd file names


ODD_NAMES = ["sp ace.yaml", "qu'o\"te.yaml", "ü-nïcode.yaml", "$(touch PWNED).yaml",
             "back\\slash.yaml", "new\nline.yaml", "tri'''ple\"\"\".yaml", "-o.yaml"]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_odd_spec_file_names_build_to_code_that_compiles(tmp_path, name):
    folder = tmp_path / "we'ird \"dir\" $(x)"
    folder.mkdir()
    spec = folder / name
    spec.write_text((EXAMPLES / "seed.yaml").read_text())
    result = build_path(spec, folder / "out")
    assert result.code == 0, result.err
    assert_safe_code(result.files())
    assert not (Path.cwd() / "PWNED").exists()


@pytest.mark.parametrize("name", ["sp ace.yaml", "qu'o\"te.yaml", "ü-nïcode.yaml",
                                  "$(touch PWNED).yaml", "-o.yaml"])
def test_odd_spec_file_names_in_errors(tmp_path, name):
    spec = tmp_path / name
    spec.write_text("mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\nlayers:\n"
                    "  a: {op: Linear, args: [10, 20]}\n  b: {op: Linear, args: [30, 10]}\n")
    result = build_path(spec, tmp_path / "out")
    assert result.code == 2, result.err
    assert result.err.startswith(f"{spec}:7:3: layer 'b': Linear(30, 10) expects input")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------
# compiler bugs this suite found (each fixed; kept as regression tests)


def test_non_finite_floats_are_emitted_as_valid_python(tmp_path):
    text = "mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\nlayers:\n" \
           "  a: {op: Hardtanh, min_val: -.inf, max_val: .inf}\n"
    result = build_text(tmp_path, text, "--device-map", "cpu")
    if result.code == 2:
        assert_reported(result)
        return
    assert_safe_code(result.files())
    import_model(result.out_dir / "m.py").M()


@pytest.mark.parametrize("layer", ["{op: MLP, dim: 10, hidden: 3}",
                                   "{op: MLP, args: [10, 3], dim: 10}"])
def test_block_keyword_arguments(tmp_path, layer):
    text = textwrap.dedent(f"""\
        mpgen: 1
        name: M
        inputs:
          x: [batch, 10]
        blocks:
          MLP:
            params: [dim, hidden]
            layers:
              fc1: {{op: Linear, args: [$dim, $hidden]}}
              fc2: {{op: Linear, args: [$hidden, $dim]}}
        layers:
          m: {layer}
        """)
    result = build_text(tmp_path, text, "--device-map", "cpu")
    if result.code == 2:
        assert_reported(result)
        return
    import torch

    import_model(result.out_dir / "m.py").M()(torch.randn(2, 10))


def test_too_many_symbolic_dims_has_a_position(tmp_path):
    dims = ", ".join(f"d{i}" for i in range(21))
    result = build_text(tmp_path, f"mpgen: 1\nname: M\ninputs:\n  x: [{dims}]\n"
                                  "layers:\n  a: {op: ReLU}\n")
    assert_reported(result)


# --------------------------------------------------------------------------
# a seeded fuzz of the example specs


FUZZ_CASES = int(os.environ.get("MPGEN_FUZZ_CASES", "300"))
FUZZ_SEED = int(os.environ.get("MPGEN_FUZZ_SEED", "1234"))
FUZZ_BASES = ["seed", "small_cnn", "multitask", "residual_mlp"]
BLOCK_BASE = """\
mpgen: 1
name: Blocks
inputs:
  x: [batch, 16]
  ids: {shape: [batch, seq], dtype: int64}
blocks:
  MLPBlock:
    params: [dim, hidden]
    inputs: [x]
    layers:
      fc1: {op: Linear, args: [$dim, $hidden]}
      act: {op: GELU}
      fc2: {op: Linear, args: [$hidden, $dim]}
      res: {op: torch.add, in: [fc2, x]}
    outputs: [res]
layers:
  emb: {op: Embedding, args: [100, 16], in: ids}
  pool: {op: torch.mean, dim: 1}
  mix: {op: torch.add, in: [pool, x]}
  mlp: {op: MLPBlock, args: [16, 32], repeat: 4}
  head: {op: Linear, args: [16, 3]}
placement:
  emb: cuda:0
  mlp.2-3: cuda:1
train:
  loss: CrossEntropyLoss
  optimizer: {op: AdamW, lr: 3.0e-4}
  batch_size: 4
  steps: 2
  dims: {seq: 8}
"""
SCALARS = [None, 0, 1, -1, 2, 10, 1.5, 1e-3, True, False, "", "x", "batch", "cuda:0", "cuda:1",
           "cpu", "gpu", "$dim", "$nope", "Linear", "ReLU", "torch.add", "F.relu", "MLPBlock",
           "h.0-1", "a b", "'\"", "\n", "__init__", "__import__('os').system('true')", "0x1f",
           10**30, -(10**30), [], {}, [1, 2], ["x"], {"op": "ReLU"}, [[1, [2]]], "int64"]
TEXT_NOISE = list(":-[]{}#&*!|>'\"%@`,?\t\n ") + ["---", "<<: ", "!!str ", "&a ", "*a", "  "]


def _mutate_data(rng: random.Random, data):
    data = copy.deepcopy(data)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(data) if p]
        path = rng.choice(paths)
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        action = rng.choice(["delete", "retype", "retype", "rename", "copy", "swap"])
        if action == "delete":
            del parent[last]
        elif action == "retype":
            parent[last] = copy.deepcopy(rng.choice(SCALARS))
        elif action == "rename" and isinstance(parent, dict):
            new = rng.choice([s for s in SCALARS if isinstance(s, str)] + [last + "x", "in",
                                                                         "args", "repeat"])
            parent[new] = parent.pop(last)
        elif action == "copy" and isinstance(parent, dict):
            other = rng.choice(paths)
            value = data
            for part in other:
                value = value[part]
            parent[last] = copy.deepcopy(value)
        elif action == "swap" and isinstance(parent, list) and len(parent) > 1:
            i, j = rng.sample(range(len(parent)), 2)
            parent[i], parent[j] = parent[j], parent[i]
    return data


def _mutate_text(rng: random.Random, text: str) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        action = rng.choice(["dup", "del", "char", "char", "dedent"])
        if action == "dup":
            lines.insert(i, lines[i])
        elif action == "del" and len(lines) > 1:
            del lines[i]
        elif action == "dedent":
            lines[i] = lines[i].lstrip(" ") if rng.random() < 0.5 else " " + lines[i]
        else:
            line = lines[i]
            at = rng.randrange(len(line) + 1)
            lines[i] = line[:at] + rng.choice(TEXT_NOISE) + line[at + rng.randint(0, 2):]
    return "".join(lines)


def fuzz_cases(n: int, seed: int):
    rng = random.Random(seed)
    bases = {name: (EXAMPLES / f"{name}.yaml").read_text() for name in FUZZ_BASES}
    bases["blocks"] = BLOCK_BASE
    for i in range(n):
        name = rng.choice(sorted(bases))
        text = bases[name]
        if rng.random() < 0.6:
            data = yaml.safe_load(text)
            text = yaml.safe_dump(_mutate_data(rng, data), sort_keys=False)
        else:
            text = _mutate_text(rng, text)
        extra = rng.choice([[], [], [], ["--device-map", "cpu"], ["--device-map", "cuda:1=cuda:0"]])
        yield i, name, text, extra


@pytest.mark.slow
def test_fuzz_never_tracebacks_and_success_compiles(tmp_path):
    """Mutated example specs: exit 0 with code that compiles, or exit 2 with positions."""
    outcomes = {0: 0, 2: 0}
    for i, base, text, extra in fuzz_cases(FUZZ_CASES, FUZZ_SEED):
        result = build_text(tmp_path, text, *extra)
        assert_built_or_reported(
            result, f"fuzz case {i} (seed {FUZZ_SEED}, base {base}, args {extra}):\n{text}")
        outcomes[result.code] += 1
    assert outcomes[0] > FUZZ_CASES // 20, outcomes  # the fuzz still reaches code generation
    assert outcomes[2] > FUZZ_CASES // 4, outcomes


def test_lazy_modules_do_not_crash(tmp_path):
    result = build_text(tmp_path, "mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\n"
                                  "layers:\n  a: {op: LazyLinear, args: [4]}\n")
    if result.code == 2:
        assert_reported(result)
    else:
        assert_safe_code(result.files())


def test_five_symbolic_dims_do_not_crash(tmp_path):
    result = build_text(tmp_path, "mpgen: 1\nname: M\ninputs:\n  x: [batch, t, c, h, w]\n"
                                  "layers:\n  a: {op: ReLU}\n")
    if result.code == 2:
        assert_reported(result)
    else:
        assert_safe_code(result.files())


def test_torch_warnings_do_not_reach_stderr(tmp_path):
    spec = tmp_path / "warn.yaml"
    spec.write_text("mpgen: 1\nname: M\ninputs:\n  x: [batch, 10]\nlayers:\n"
                    "  a: {op: Linear, args: [10, 0]}\n  b: {op: Linear, args: [5, 1]}\n")
    result = build_path(spec, tmp_path / "out")
    assert result.code == 2
    assert all(line.startswith(f"{spec}:") for line in result.err.splitlines()), result.err


def test_output_path_that_is_a_file_is_reported(tmp_path):
    target = tmp_path / "taken"
    target.write_text("a file, not a folder\n")
    result = build_path(Path("examples/seed.yaml"), target, cwd=ROOT)
    assert result.code == 2
    assert "Traceback" not in result.err
    assert target.read_text() == "a file, not a folder\n"
