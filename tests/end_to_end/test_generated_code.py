"""The generated code runs: models, training scripts and generated tests.

Every example is built with ``--device-map cpu`` so the real code runs here;
the tutorial seed is also compared with the hand-written tutorial model.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from helpers import EXAMPLES, build_to, import_generated, write_spec
from mpgen.compiler import driver as build
from mpgen.compiler.codegen import common as render

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun) or builds many specs

EXAMPLE_SPECS = sorted(EXAMPLES.glob("*.yaml"))
SMALL = [p for p in EXAMPLE_SPECS if p.stem in ("seed", "small_cnn", "multitask", "residual_mlp")]


class ToyModel(nn.Module):
    """The tutorial's hand-written model, on the CPU."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(10, 20)
        self.layer2 = nn.Linear(20, 10)

    def forward(self, x):
        return self.layer2(self.layer1(x))


def test_seed_matches_the_hand_written_tutorial_model(tmp_path):
    build_to(EXAMPLES / "seed.yaml", tmp_path, {"*": "cpu"})
    model = import_generated(tmp_path / "simple_model.py").SimpleModel()
    assert list(model.state_dict()) == ["layer1.weight", "layer1.bias", "layer2.weight",
                                        "layer2.bias"]
    reference = ToyModel()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 10)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_seed_forward_has_exactly_the_two_tutorial_transfers(tmp_path):
    graph = build.compile_spec(EXAMPLES / "seed.yaml")
    assert [(str(t.value), t.src, t.dst) for t in graph.plan.transfers] == [
        ("x", None, "cuda:0"), ("layer1", "cuda:0", "cuda:1")]
    build_to(EXAMPLES / "seed.yaml", tmp_path)
    tree = ast.parse((tmp_path / "simple_model.py").read_text())
    forward = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                   and n.name == "forward")
    moves = [ast.unparse(n) for n in ast.walk(forward)
             if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "to"]
    assert sorted(moves) == ["layer1.to('cuda:1')", "x.to('cuda:0')"]


def test_multi_output_heads_get_the_trunk_once_each(tmp_path):
    graph = build.compile_spec(EXAMPLES / "multitask.yaml")
    assert graph.node("cls_head").devices == ("cuda:1",)
    assert graph.node("reg_head").devices == ("cuda:2",)
    moved = [(str(t.value), t.src, t.dst) for t in graph.plan.transfers if t.src is not None]
    assert moved == [("trunk_act", "cuda:0", "cuda:1"), ("trunk_act", "cuda:0", "cuda:2")]


@pytest.mark.parametrize("spec", SMALL, ids=lambda p: p.stem)
def test_model_runs_forward_and_backward_on_cpu(tmp_path, spec):
    result = build_to(spec, tmp_path, {"*": "cpu"})
    graph = result.graph
    module = import_generated(tmp_path / render.file_names(graph)["model"])
    model = getattr(module, graph.name)()
    train = import_generated(tmp_path / render.file_names(graph)["train"])
    inputs, targets = train.make_batch(3)
    outputs = model(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == len(graph.outputs)
    for out, name in zip(outputs, graph.outputs):
        # make_batch(3): batch 3, every other symbolic dim at its training size.
        expected = list(graph.node(name).out.concrete(dict(graph.train.dims) | {"batch": 3}))
        assert list(out.shape) == expected
    sum(o.sum() for o in outputs).backward()
    assert all(p.grad is not None for p in model.parameters())


def run_scripts(commands: list[list[str]], cwds: list | None = None,
                timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Run the commands (each a fresh interpreter that loads torch) side by side."""
    cwds = cwds or [None] * len(commands)
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda c, d: subprocess.run(c, capture_output=True, text=True,
                                                         timeout=timeout, cwd=d),
                             commands, cwds))


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each small example's training script, built for the CPU and run once;
    the runs overlap, the tests below read them."""
    commands = {}
    for spec in SMALL:
        out = tmp_path_factory.mktemp(spec.stem)
        result = build_to(spec, out, {"*": "cpu"})
        script = out / render.file_names(result.graph)["train"]
        commands[spec.stem] = [sys.executable, str(script), "--steps", "3", "--batch-size", "4",
                               "--lr", "0.001", "--seed", "1"]
    return dict(zip(commands, run_scripts(list(commands.values()))))


@pytest.mark.parametrize("spec", SMALL, ids=lambda p: p.stem)
def test_training_script_runs_and_logs_the_loss(training_runs, spec):
    run = training_runs[spec.stem]
    assert run.returncode == 0, run.stderr
    lines = [l for l in run.stdout.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in lines] == ["1/3", "2/3", "3/3"]
    assert all(torch.isfinite(torch.tensor(float(l.split()[3]))) for l in lines)


def test_training_is_reproducible_by_seed(tmp_path):
    build_to(EXAMPLES / "residual_mlp.yaml", tmp_path, {"*": "cpu"})
    script = str(tmp_path / "train_residual_mlp.py")
    runs = run_scripts([[sys.executable, script, "--steps", "2", "--seed", seed]
                        for seed in ("3", "3", "4")])
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, again, other = ([l.split()[3] for l in run.stdout.splitlines()
                            if l.startswith("step ")] for run in runs)
    assert first == again
    assert first != other


@pytest.fixture(scope="module")
def generated_test_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each small example's generated tests, built for the CPU and run once by
    pytest in its own folder; the runs overlap, the tests below read them."""
    commands, cwds = {}, []
    for spec in SMALL:
        out = tmp_path_factory.mktemp(f"{spec.stem}_tests")
        result = build_to(spec, out, {"*": "cpu"})
        test_file = out / render.file_names(result.graph)["test"]
        commands[spec.stem] = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(test_file)]
        cwds.append(out)
    return dict(zip(commands, run_scripts(list(commands.values()), cwds, timeout=600)))


@pytest.mark.parametrize("spec", SMALL, ids=lambda p: p.stem)
def test_generated_tests_pass(generated_test_runs, spec):
    run = generated_test_runs[spec.stem]
    assert run.returncode == 0, run.stdout[-3000:]
    # Built for the CPU, both the real and the virtual runs pass; only the
    # transfer check and the memory plan's (on the CPU: measured only by
    # bench/memory_plan.py and --memory) are virtual-only.
    assert "10 passed, 2 skipped" in run.stdout, run.stdout[-1000:]


def test_user_module_classes_are_imported_by_dotted_path(tmp_path):
    pkg = tmp_path / "mylayers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "gates.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Gate(nn.Module):\n"
        "    def __init__(self, dim, scale=1.0):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(dim, dim)\n"
        "        self.scale = scale\n\n"
        "    def forward(self, x):\n"
        "        return torch.sigmoid(self.proj(x)) * x * self.scale\n"
    )
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: Gated
        inputs:
          x: [batch, 8]
        layers:
          gate: {op: mylayers.gates.Gate, args: [8], scale: 0.5}
          out: {op: Linear, args: [8, 2]}
    """)
    result = build_to(spec, tmp_path / "out", {"*": "cpu"})
    assert result.graph.node("gate").params == 72
    text = result.files["gated.py"]
    assert "import mylayers.gates" in text
    assert "mylayers.gates.Gate(8, scale=0.5)" in text
    sys.path.insert(0, str(tmp_path))
    try:
        model = import_generated(tmp_path / "out" / "gated.py").Gated()
        assert model(torch.randn(4, 8)).shape == (4, 2)
    finally:
        sys.path.remove(str(tmp_path))


def test_functions_and_multiple_inputs(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: TwoTowers
        inputs:
          a: [batch, 4]
          b: {shape: [batch, 6], dtype: float32}
        layers:
          ta: {op: Linear, args: [4, 8], in: a}
          tb: {op: Linear, args: [6, 8], in: b}
          both: {op: torch.stack, in: [ta, tb], dim: 1}
          mean: {op: torch.mean, dim: 1}
          act: {op: F.softplus, beta: 2.0}
          norm: {op: F.normalize, dim: -1}
        outputs: [norm, ta]
        placement:
          ta: cuda:0
          tb: cuda:1
          both: cuda:0
    """)
    result = build_to(spec, tmp_path / "out", {"*": "cpu"})
    text = result.files["two_towers.py"]
    assert "torch.stack([ta, tb], dim=1)" in text
    assert "F.softplus(mean, beta=2.0)" in text
    model = import_generated(tmp_path / "out" / "two_towers.py").TwoTowers()
    norm, ta = model(torch.randn(3, 4), torch.randn(3, 6))
    assert norm.shape == (3, 8) and ta.shape == (3, 8)
    graph = build.compile_spec(spec)
    assert [(str(t.value), t.src, t.dst) for t in graph.plan.transfers] == [
        ("a", None, "cuda:0"), ("b", None, "cuda:1"), ("tb", "cuda:1", "cuda:0")]


def test_output_picks_an_element_of_a_returned_tuple(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: SeqTagger
        inputs:
          tokens: {shape: [batch, seq], dtype: int64}
        blocks:
          AttnBlock:
            params: [dim, heads]
            layers:
              norm: {op: LayerNorm, args: [$dim]}
              attn: {op: MultiheadAttention, args: [$dim, $heads], batch_first: true,
                     in: [norm, norm, norm], output: 0}
              res: {op: torch.add, in: [x, attn]}
        layers:
          embed: {op: Embedding, args: [1000, 64]}
          lstm: {op: LSTM, args: [64, 64], batch_first: true, output: 0}
          blocks: {op: AttnBlock, args: [64, 4], repeat: 2}
          head: {op: Linear, args: [64, 9]}
        placement:
          embed: cuda:0
          blocks.1: cuda:1
        train:
          loss: CrossEntropyLoss
          dims: {seq: 12}
    """)
    result = build_to(spec, tmp_path / "out")
    text = result.files["seq_tagger.py"]
    assert "lstm = self.lstm(embed)[0]  # [batch, seq, 64]" in text
    assert "attn = self.attn(norm, norm, norm)[0]  # [batch, seq, 64]" in text
    assert str(result.graph.node("head").out) == "[batch, seq, 9]"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path / "out" / "test_seq_tagger.py")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path / "out")
    assert "5 passed, 5 skipped" in run.stdout, run.stdout[-2000:]
