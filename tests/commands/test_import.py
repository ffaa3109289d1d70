"""``mpgen import``: a module traced with torch.fx becomes a spec that builds
into a model with the same parameters, in the same order, and the same
outputs.

Each model is written to a file in the test's folder (the working
directory, where ``MODULE:CLASS`` is imported from), imported with the CLI,
the spec built for the CPU, and the generated model given the original's
parameters by position (``zip(original.parameters(), generated.parameters())``).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import build_to, import_generated, mpgen
from mpgen.commands.importer.trace import parse_input
from mpgen.compiler.codegen.common import file_names
from mpgen.errors import MpgenError

CPU = {"*": "cpu"}

MODELS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualCNN(nn.Module):
    """conv-bn-relu, a residual add, pooling, flatten, a linear head."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16, eps=1e-3, momentum=0.2)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16 * 8 * 8, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(x + self.bn2(self.conv2(x)))
        x = self.pool(x)
        x = F.max_pool2d(x, 2)
        x = x.view(x.size(0), -1)
        return self.head(x)


class MLP(nn.Module):
    """A stack of identical layers in an nn.Sequential: one repeated layer."""

    def __init__(self, dim=32, depth=4):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])
        self.act = nn.GELU(approximate="tanh")
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        return self.out(self.act(self.blocks(self.inp(x))))


class TinyLM(nn.Module):
    """Token and position embeddings, the head tied to the token embedding."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(32, dim)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        h = F.dropout(h, 0.1, self.training)
        q, k = h.chunk(2, dim=-1)
        h = torch.cat([k, q], dim=-1) * 0.5
        h = torch.cat([h[:, :1], h[:, 1:]], dim=1) + h[:, -1].unsqueeze(1)
        return self.head(self.ln(h))


class Residual(nn.Module):
    def __init__(self, width, scale=1.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x))) * self.scale


class Stack(nn.Module):
    """Alike residual blocks of a user module, then one that differs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.blocks = nn.ModuleList([Residual(12) for _ in range(3)])
        self.last = Residual(12, scale=0.5)
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.last(x))


class Branches(nn.Module):
    """Registered in the opposite order of their use: the spec follows the
    registration, so parameters pair by position."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)

    def forward(self, x):
        return self.first(x) - self.second(x).transpose(0, 1).transpose(0, 1)


class HeadFirst(nn.Module):
    """The head registered before the layer it reads: no order can match."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.body(x))


class Shared(nn.Module):
    """One module called twice: the second call shares its parameters."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(self.norm(x))))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


class ToDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).double()


class RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.fc(x) * self.scale
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "importmodels.py").write_text(MODELS, encoding="utf-8")
    return tmp_path


def imported(project: Path, cls: str, *inputs: str, extra=()) -> str:
    ran = mpgen("import", f"importmodels:{cls}", *[a for i in inputs for a in ("--input", i)],
                *extra, cwd=project)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


def same_model(project: Path, spec_text: str, original: torch.nn.Module, *sample):
    """Build ``spec_text``, copy ``original``'s parameters in order, compare."""
    spec = project / "imported.yaml"
    spec.write_text(spec_text, encoding="utf-8")
    result = build_to(spec, project / "out", CPU)
    path = project / "out" / file_names(result.graph)["model"]
    generated = getattr(import_generated(path), result.graph.name)()
    mine, theirs = list(original.parameters()), list(generated.parameters())
    assert [p.shape for p in theirs] == [p.shape for p in mine]
    with torch.no_grad():
        for target, source in zip(theirs, mine):
            target.copy_(source)
    original.eval()
    generated.eval()
    torch.testing.assert_close(generated(*sample), original(*sample))
    return generated


def model(project: Path, cls: str, **kwargs) -> torch.nn.Module:
    import sys
    sys.path.insert(0, str(project))
    torch.manual_seed(0)
    return getattr(importlib.import_module("importmodels"), cls)(**kwargs)


@pytest.mark.slow  # 3 s: too long for the quick loop
def test_residual_cnn(project):
    text = imported(project, "ResidualCNN", "x=batch,3,32,32")
    assert "conv1: {op: Conv2d, args: [3, 16, 3], padding: 1, bias: false}" in text
    assert "bn2: {op: BatchNorm2d, args: [16], eps: 0.001, momentum: 0.2}" in text
    assert 'view: {op: torch.reshape, shape: ["=size(max_pool2d, 0)", -1]}' in text
    assert text.startswith("# Made by `mpgen import importmodels:ResidualCNN --input "
                           "x=batch,3,32,32`")
    same_model(project, text, model(project, "ResidualCNN"), torch.randn(3, 3, 32, 32))


def test_identical_layers_in_a_sequential_are_one_repeated_layer(project):
    text = imported(project, "MLP", "x=batch,8")
    assert "  blocks: {op: Linear, args: [32, 32], repeat: 4}" in text
    generated = same_model(project, text, model(project, "MLP"), torch.randn(5, 8))
    # Named after the container: the state dicts have the same keys.
    assert list(generated.state_dict()) == list(model(project, "MLP").state_dict())


def test_a_shared_parameter_is_a_tie(project):
    # A fixed length: its position table of 32 rows cannot hold every seq.
    text = imported(project, "TinyLM", "idx=batch,12:int64")
    assert "tie: {weight: wte.weight}" in text
    assert 'arange: {op: torch.arange, in: [], end: "=size(idx, 1)"}' in text
    assert "dropout: {op: F.dropout, p: 0.1}" in text  # training follows the model's mode
    assert "outputs: [getitem, getitem_1]" in text
    assert 'getitem_3: {op: torch.narrow, in: mul, args: [1, 1, "=size(mul, 1) - 1"]}' in text
    assert "getitem_4: {op: torch.select, in: mul, dim: 1, index: -1}" in text
    original = model(project, "TinyLM")
    generated = same_model(project, text, original, torch.randint(0, 50, (2, 12)))
    assert sum(p.numel() for p in generated.parameters()) == sum(
        p.numel() for p in original.parameters())


@pytest.mark.slow  # 3 s: too long for the quick loop
def test_alike_instances_of_a_user_module_are_a_repeated_block(project):
    text = imported(project, "Stack", "x=batch,5")
    assert ("blocks:\n  Residual:\n    layers:\n"
            "      norm: {op: LayerNorm, args: [12]}\n"
            "      gelu: {op: F.gelu}\n"
            "      fc: {op: Linear, args: [12, 12]}\n"
            "      mul: {op: torch.mul, args: [1.0]}\n"
            "      add: {op: torch.add, in: [x, mul]}\n") in text
    assert "  blocks: {op: Residual, repeat: 3}\n  last_norm: {op: LayerNorm" in text
    assert "  add_3: {op: torch.add, in: [blocks, mul_3]}\n" in text  # alone: unrolled
    original = model(project, "Stack")
    generated = same_model(project, text, original, torch.randn(4, 5))
    assert list(generated.state_dict())[:7] == list(original.state_dict())[:7]


def test_a_module_called_twice_shares_its_parameters(project):
    text = imported(project, "Shared", "x=batch,6")
    assert "fc_1: {op: Linear, args: [6, 6], tie: {weight: fc.weight, bias: fc.bias}}" in text
    same_model(project, text, model(project, "Shared"), torch.randn(3, 6))


def test_layers_follow_the_registration_order(project):
    text = imported(project, "Branches", "x=batch,4")
    assert text.index("second:") < text.index("first:")
    same_model(project, text, model(project, "Branches"), torch.randn(3, 4))


def test_an_order_that_cannot_match_is_noted(project):
    ran = mpgen("import", "importmodels:HeadFirst", "--input", "x=batch,4", cwd=project)
    assert ran.returncode == 0
    assert "note: no order of the layers gives HeadFirst's parameter order" in ran.stderr


@pytest.mark.slow
def test_torchvision_resnet18(project):
    pytest.importorskip("torchvision")
    (project / "tvresnet.py").write_text(textwrap.dedent('''
        from torchvision.models.resnet import BasicBlock, ResNet

        class ResNet18(ResNet):
            def __init__(self):
                super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=20)
    '''), encoding="utf-8")
    # torch.fx's folding (TorchDynamo, the default for a class holding a
    # library's modules, keeps them as blocks: tests/commands/test_import_wrappers.py)
    ran = mpgen("import", "tvresnet:ResNet18", "--input", "x=batch,3,64,64", "--trace", "fx",
                cwd=project)
    assert ran.returncode == 0, ran.stderr
    assert "  layer1: {op: BasicBlock, repeat: 2}\n" in ran.stdout  # two alike blocks
    assert "layer2_0_downsample_0: {op: Conv2d, in: layer1, args: [64, 128, 1]" in ran.stdout
    import sys
    sys.path.insert(0, str(project))
    torch.manual_seed(0)
    original = importlib.import_module("tvresnet").ResNet18()
    with torch.no_grad():  # running statistics away from their start, as trained
        for module in original.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.1, 0.1)
    same_model(project, ran.stdout, original, torch.randn(2, 3, 64, 64))


def test_output_file_and_devices(project):
    ran = mpgen("import", "importmodels:MLP", "--input", "x=batch,8", "--devices", "2",
                "-o", "mlp.yaml", cwd=project)
    assert ran.returncode == 0, ran.stderr
    text = (project / "mlp.yaml").read_text()
    assert "placement:\n  auto:\n    devices: [cuda:0, cuda:1]\n" in text
    again = mpgen("import", "importmodels:MLP", "--input", "x=batch,8", "-o", "mlp.yaml",
                  cwd=project)
    assert again.returncode == 2
    assert "mlp.yaml: exists; refusing to overwrite it (pass --force)" in again.stderr
    assert (project / "mlp.yaml").read_text() == text
    forced = mpgen("import", "importmodels:MLP", "--input", "x=batch,8", "-o", "mlp.yaml",
                   "--force", cwd=project)
    assert forced.returncode == 0 and "placement" not in (project / "mlp.yaml").read_text()


def test_constructor_arguments(project):
    text = imported(project, "MLP", "x=batch,8", extra=("--args", '{"dim": 16, "depth": 2}'))
    assert "blocks: {op: Linear, args: [16, 16], repeat: 2}" in text
    assert "act: {op: GELU, approximate: tanh}" in text
    positional = imported(project, "MLP", "x=batch,8", extra=("--args", "[16, 2]"))
    assert positional.split("\n", 1)[1] == text.split("\n", 1)[1]


@pytest.mark.parametrize("cls, expected", [
    ("Branchy", "importmodels.py:{line}:{col}: torch.fx cannot trace Branchy.forward: "
                "TraceError: symbolically traced variables cannot be used as inputs to "
                "control flow"),
    ("ToDouble", "importmodels.py:{line}:{col}: fx node 'double' (call_method double): casts "
                 "float32 to float64, a dtype a spec does not have (float32, float16, "
                 "bfloat16, int64, int32, bool)"),
    ("RawParameter", "importmodels.py:{line}:{col}: fx node 'scale' (get_attr scale): forward "
                     "reads a parameter of the module as a tensor (self.scale)"),
])
def test_what_cannot_be_expressed_is_an_error_at_its_line(project, cls, expected):
    ran = mpgen("import", f"importmodels:{cls}", "--input", "x=batch,4", "-o", "out.yaml",
                "--trace", "fx", cwd=project)
    assert ran.returncode == 2
    assert "Traceback" not in ran.stderr
    source = MODELS.splitlines()
    start = source.index(f"class {cls}(nn.Module):")
    line = next(i for i in range(start, len(source))
                if "if x.sum()" in source[i] or "double()" in source[i] or "self.scale\n" in
                source[i] + "\n")
    col = len(source[line]) - len(source[line].lstrip()) + 1
    if cls == "Branchy":
        col = source[line].index("x.sum()") + 1
    assert ran.stderr.startswith(expected.format(line=line + 1, col=col)), ran.stderr
    assert not (project / "out.yaml").exists()


@pytest.mark.parametrize("args, message", [
    (("importmodels:MLP", "--input", "y=batch,8"),
     "--input y: MLP.forward has no argument 'y'; its arguments: x"),
    (("importmodels:MLP", "--input", "x=batch,8", "--input", "x=batch,8"),
     "--input x: given more than once"),
    (("importmodels:MLP", "--input", "x=batch,0"),
     "--input 'x=batch,0': '0' is not a size"),
    (("importmodels:MLP", "--input", "x=batch,8:float"),
     "--input 'x=batch,8:float': unknown dtype 'float'"),
    (("importmodels:Mlp", "--input", "x=batch,8"),
     "importmodels:Mlp: importmodels has no nn.Module class or function 'Mlp' (did you mean 'MLP'?)"),
    (("importmodels:MLP", "--input", "x=batch,8", "--args", '{"width": 3}'),
     "MLP(width=3) failed: TypeError"),
    (("importmodels:MLP", "--input", "x=batch,4"),
     "fx node 'inp' (call_module inp): fails on sample inputs of the --input shapes"),
    # Each was a traceback: a RecursionError, a ValueError of int().
    (("importmodels:MLP", "--input", "x=batch,8", "--args", "[" * 20000 + "]" * 20000),
     "--args: nested 20000 levels deep; at most 64 are supported"),
    (("importmodels:MLP", "--input", "x=batch,8", "--args", '{"a": "[[[[", "b": ' + "[" * 65
      + "]" * 65 + "}"), "--args: nested 66 levels deep; at most 64 are supported"),
    (("importmodels:MLP", "--input", "x=batch,8", "--args", "[" + "9" * 5000 + "]"),
     "--args: an integer of more than 4,300 digits"),
])
def test_bad_command_lines(project, args, message):
    ran = mpgen("import", *args, cwd=project)
    assert ran.returncode == 2
    assert message in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr


@pytest.mark.parametrize("text, message", [
    ("x=" + ",".join(["2"] * 100), "--input 'x=2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,"
     "2,2,2,2,...': 100 dims; an input has at most 16"),
    ("x=batch,2147483648", "--input 'x=batch,2147483648': the size '2147483648' is larger than "
     "2,147,483,647, the most a dim may be"),
    ("x=" + "9" * 5000, "the size '99999999999999999999...' is larger than 2,147,483,647"),
    ("x=batch,65536,65536", "--input 'x=batch,65536,65536': the sample input holds 8,589,934,592 "
     "elements (symbolic dims at 2 for batch, 16 for others); the trace allows at most "
     "268,435,456; give smaller sizes or fewer dims"),
    ("x=batch," + ",".join(["seq"] * 16), "an input has at most 16"),
    ("x=batch," + ",".join(["seq"] * 14), "the sample input holds 144,115,188,075,855,872"),
    ("x=batch,²", "'²' is not a size"),
])
def test_every_input_size_is_bounded_before_a_tensor_is_made(text, message):
    # A size from the command line is a tensor's size: past the limits it is
    # one line, never an overflow in torch (Storage size calculation overflowed).
    with pytest.raises(MpgenError) as refused:
        parse_input(text)
    assert message in refused.value.message


def test_an_input_of_a_hundred_dims_is_one_line(project):
    ran = mpgen("import", "importmodels:MLP", "--input", "x=" + ",".join(["2"] * 100),
                cwd=project)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.count("\n") == 1 and "100 dims; an input has at most 16" in ran.stderr


def test_devices_is_bounded_in_one_line(project):
    ran = mpgen("import", "importmodels:MLP", "--input", "x=batch,8", "--devices", "10" * 9,
                cwd=project)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr == ("--devices 101010101010101010: expected a number of GPUs "
                          "from 1 to 4096\n")


LANGUAGE_MODELS = '''
from torch import nn


class TinyLM(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        return self.head(self.wte(idx))


class TinyBody(nn.Module):
    """Token ids [batch, seq] -> hidden states [batch, seq, dim]: no head."""

    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, idx):
        return self.mlp(self.wte(idx))
'''


@pytest.mark.parametrize("seq", ["seq", "12"])
def test_a_language_model_gets_cross_entropy_over_its_last_dim(tmp_path, seq):
    (tmp_path / "lms.py").write_text(LANGUAGE_MODELS, encoding="utf-8")
    ran = mpgen("import", "lms:TinyLM", "--input", f"idx=batch,{seq}:int64", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.endswith(
        f"\ntrain:\n  loss: {{op: CrossEntropyLoss, class_dim: -1}}  # logits [batch, {seq}, 40], "
        "a class per token id\n")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(ran.stdout, encoding="utf-8")
    build_to(spec, tmp_path / "out", CPU)
    for name in [m for m in sys.modules if m == "tiny_lm" or m.startswith("mpgen_runtime")]:
        del sys.modules[name]  # the other case's model and runtime
    training = import_generated(tmp_path / "out" / "train_tiny_lm.py").TRAINING
    assert training.shapes == (("batch", seq if seq == "seq" else 12),) * 2
    assert training.dtypes == ("int64", "int64")  # targets shaped like the token ids
    import mpgen_runtime

    ids = torch.randint(0, 40, (8, 12))
    torch.save({"idx": ids, "target": ids.roll(-1, 1)}, tmp_path / "tokens.pt")
    mpgen_runtime.train(training, ["--data", str(tmp_path / "tokens.pt"), "--steps", "2",
                                   "--batch-size", "4", "--log-dir", str(tmp_path / "runs")])


def test_hidden_states_of_a_body_without_a_head_are_not_taken_for_logits(tmp_path):
    # [batch, seq, 16] for ids [batch, seq]: shaped like logits, but 16 is the
    # width, not the 40 rows of the embedding (LlamaModel's hidden states).
    (tmp_path / "lms.py").write_text(LANGUAGE_MODELS, encoding="utf-8")
    ran = mpgen("import", "lms:TinyBody", "--input", "idx=batch,12:int64", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "\ntrain:" not in ran.stdout and "CrossEntropyLoss" not in ran.stdout


def test_a_model_of_no_known_kind_gets_no_train_section(project):
    text = imported(project, "ResidualCNN", "x=batch,3,32,32")
    assert "\ntrain:" not in text  # the defaults, MSELoss against targets shaped like the output


def test_a_position_table_read_over_a_symbolic_length_is_refused_with_its_line(project):
    # Meta runs check no index: the build follows arange's values to the
    # table, where seq = 33 would be an IndexError (NOTE [Index ranges]).
    ran = mpgen("import", "importmodels:TinyLM", "--input", "idx=batch,seq:int64", cwd=project)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ("layer 'wpe': Embedding(32, 16) has 32 rows, but 'arange' reads it at indices up "
            "to seq - 1") in ran.stderr
    assert "give seq a size of at most 32 in train.dims" in ran.stderr
    assert "line 12: wpe: {op: Embedding, in: arange, args: [32, 16]}" in ran.stderr
    # The model's own table, not a gap of the importer; --input is where a size goes.
    assert ("the imported spec does not build (the model reads a table of fixed rows along a "
            "symbolic dim)") in ran.stderr and "please report" not in ran.stderr
    assert "hint: the build checks symbolic dims (idx: seq)" in ran.stderr


def test_a_size_in_args_torch_cannot_allocate_is_one_line(project):
    # --args sizes reach the user's constructor: torch's refusal is quoted by
    # its first line, never with the C++ frames that follow it.
    ran = mpgen("import", "importmodels:MLP", "--input", "x=batch,8", "--args",
                '{"dim": 10000000000000000000000}', cwd=project)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.count("\n") == 1 and "frame #" not in ran.stderr
    assert "MLP(dim=10000000000000000000000) failed: TypeError: " in ran.stderr
